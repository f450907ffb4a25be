"""Variants of the engine's CUDA quantized matvec (crates/mlxrs-core/src/models/qmv.rs), checked and
timed one kernel at a time (issue #11). Run on the GPU machine under Nsight Compute, which gives each
kernel's own GPU time:

    ncu --metrics gpu__time_duration.sum --clock-control none --csv --log-file /tmp/v.csv \\
        python3 bench/qmv_variants.py
    python3 bench/qmv_variants.py --report /tmp/v.csv

Each variant is a kernel source (`VARIANTS`), named `qmv_<variant>` so the report
groups by it; every 8B decode shape (q/k/v fused, o, gate/up fused, down, the 128256-row head), 4- and
8-bit, one row of x, each launched `--reps` times on distinct weights. Before timing, each variant's
output is compared with float32 products of the same dequantized weights (max |diff| / max |y|) and
with MLX's `quantized_matmul` on the same weights.

Variants (4-bit unless said):
- `engine`: the engine's kernel now (crates/mlxrs-core/src/models/qmv.rs).
- `base`: the engine's kernel before 2026-12-02 (q as 2^23 + q through the float's bits, minus 2^23: shift,
  mask-or, add, fma; all of a read's x values converted first: 75 registers, 3 blocks per SM).
- `onep`: q placed in the mantissa's top bits as 1 + q/16 (8-bit: 1 + q/256): shift, mask-or, fma; the
  chunk's dot is 16 (Σ x (1 + q/16) − Σ x), one add per chunk instead of one per value.
- `pair`: (4-bit) four shifts of the packed word bring every nibble to bits 12–15 or 16–19, where a
  mask-or alone makes it 1 + q/2048 or 1 + q/128: 1.5 integer ops per value instead of 3.
- `unroll4`: `base` with the loop unrolled 4 times (more loads in flight per lane).
- `onep_u4`: `onep` unrolled 4 times.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent


def engine_source() -> str:
    text = (HERE.parent / "crates/mlxrs-core/src/models/qmv.rs").read_text()
    start = text.index('const SOURCE: &str = r#"') + len('const SOURCE: &str = r#"')
    return text[start : text.index('"#;', start)]


# the engine's kernel until 2026-12-02 (commit 2b49d4c): all 32 (4-bit) x values of a read converted
# first, each packed value decoded as 2^23 + q minus 2^23; the variants below change it
BASE = r"""
    // y[m, n] = sum_k x[m, k] * (scale[n, g] * q[n, k] + bias[n, g]),  g = k / GS (MLX's affine mode).
    constexpr int PER_U32 = 32 / BITS;
    constexpr unsigned MASK = (1u << BITS) - 1u;
    constexpr int WPR = K / PER_U32;            // packed uint32 per weight row
    constexpr int VPU4 = 4 * PER_U32;           // values per 16-byte read
    constexpr int NG = K / GS;                  // groups per row
    const unsigned lane = threadIdx.x & 31u;
    const unsigned row0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * R;
    if (row0 >= (unsigned)N) return;
    float acc[R][M];
    #pragma unroll
    for (int r = 0; r < R; ++r)
        #pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
    const uint4* wbase = reinterpret_cast<const uint4*>(w);
    #pragma unroll 2
    for (int i = lane; i < WPR / 4; i += 32) {
        const int k0 = i * VPU4;
        uint4 q[R];
        float s[R], b[R];
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            const unsigned row = min(row0 + r, (unsigned)N - 1u);
            q[r] = wbase[(size_t)row * (WPR / 4) + i];
            s[r] = static_cast<float>(scales[(size_t)row * NG + k0 / GS]);
            b[r] = static_cast<float>(biases[(size_t)row * NG + k0 / GS]);
        }
        #pragma unroll
        for (int m = 0; m < M; ++m) {
            const uint4* xv4 = reinterpret_cast<const uint4*>(x + (size_t)m * K + k0);
            float xf[VPU4];
            float xs = 0.f;
            #pragma unroll
            for (int c = 0; c < VPU4 / 8; ++c) {
                const uint4 xr = xv4[c];
                const T* xe = reinterpret_cast<const T*>(&xr);
                #pragma unroll
                for (int t = 0; t < 8; ++t) { xf[c * 8 + t] = static_cast<float>(xe[t]); xs += xf[c * 8 + t]; }
            }
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                const unsigned qs[4] = {q[r].x, q[r].y, q[r].z, q[r].w};
                float dot = 0.f;
                #pragma unroll
                for (int j = 0; j < 4; ++j) {
                    #pragma unroll
                    for (int t = 0; t < PER_U32; ++t) {
                        const float qf = __uint_as_float(((qs[j] >> (t * BITS)) & MASK) | 0x4B000000u) - 8388608.f;
                        dot = fmaf(xf[j * PER_U32 + t], qf, dot);
                    }
                }
                acc[r][m] = fmaf(s[r], dot, fmaf(b[r], xs, acc[r][m]));
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < R; ++r) {
        #pragma unroll
        for (int m = 0; m < M; ++m) {
            float v = acc[r][m];
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0 && row0 + r < (unsigned)N) y[(size_t)m * N + row0 + r] = static_cast<T>(v);
        }
    }
"""

# the per-value decode and the per-chunk combine of `base`, replaced by the variants
BASE_DOT = """                float dot = 0.f;
                #pragma unroll
                for (int j = 0; j < 4; ++j) {
                    #pragma unroll
                    for (int t = 0; t < PER_U32; ++t) {
                        const float qf = __uint_as_float(((qs[j] >> (t * BITS)) & MASK) | 0x4B000000u) - 8388608.f;
                        dot = fmaf(xf[j * PER_U32 + t], qf, dot);
                    }
                }
                acc[r][m] = fmaf(s[r], dot, fmaf(b[r], xs, acc[r][m]));"""

ONEP_DOT = """                // q as 1 + q / 2^BITS: the value's bits moved to the mantissa's top (bits 23-BITS..22)
                float dot = 0.f;
                #pragma unroll
                for (int j = 0; j < 4; ++j) {
                    #pragma unroll
                    for (int t = 0; t < PER_U32; ++t) {
                        constexpr int TOP = 23 - BITS;
                        const int sh = TOP - t * BITS;
                        const unsigned v = sh >= 0 ? (qs[j] << sh) : (qs[j] >> (-sh));
                        const float qf = __uint_as_float((v & (MASK << TOP)) | 0x3F800000u);
                        dot = fmaf(xf[j * PER_U32 + t], qf, dot);
                    }
                }
                acc[r][m] = fmaf(s[r] * (float)(1u << BITS), dot - xs, fmaf(b[r], xs, acc[r][m]));"""

# 4-bit only: nibble t of a word sits at bits 4t..4t+3. Bits 12-15 (scale 2^-11) and 16-19 (2^-7):
# word: t3 -> B, t4 -> A; word<<8: t1 -> B, t2 -> A; word>>8: t5 -> B, t6 -> A; word<<16: t0 -> A;
# word>>12: t7 -> A. A = {0, 2, 4, 6, 7}, B = {1, 3, 5}.
PAIR_DOT = """                float da = 0.f, db = 0.f;
                #pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const unsigned w0 = qs[j], wl8 = qs[j] << 8, wr8 = qs[j] >> 8, wl16 = qs[j] << 16, wr12 = qs[j] >> 12;
                    const float* xj = xf + j * 8;
                    da = fmaf(xj[0], __uint_as_float((wl16 & 0x000F0000u) | 0x3F800000u), da);
                    db = fmaf(xj[1], __uint_as_float((wl8 & 0x0000F000u) | 0x3F800000u), db);
                    da = fmaf(xj[2], __uint_as_float((wl8 & 0x000F0000u) | 0x3F800000u), da);
                    db = fmaf(xj[3], __uint_as_float((w0 & 0x0000F000u) | 0x3F800000u), db);
                    da = fmaf(xj[4], __uint_as_float((w0 & 0x000F0000u) | 0x3F800000u), da);
                    db = fmaf(xj[5], __uint_as_float((wr8 & 0x0000F000u) | 0x3F800000u), db);
                    da = fmaf(xj[6], __uint_as_float((wr8 & 0x000F0000u) | 0x3F800000u), da);
                    da = fmaf(xj[7], __uint_as_float((wr12 & 0x000F0000u) | 0x3F800000u), da);
                }
                const float dot = 128.f * (da - xsa[m]) + 2048.f * (db - (xs - xsa[m]));
                acc[r][m] = fmaf(s[r], dot, fmaf(b[r], xs, acc[r][m]));"""

# the x sums of class A (positions 0, 2, 4, 6, 7 of each 8) for `pair`
PAIR_XS_OLD = """                for (int t = 0; t < 8; ++t) { xf[c * 8 + t] = static_cast<float>(xe[t]); xs += xf[c * 8 + t]; }
            }"""
PAIR_XS_NEW = """                for (int t = 0; t < 8; ++t) { xf[c * 8 + t] = static_cast<float>(xe[t]); xs += xf[c * 8 + t]; }
            }
            if (BITS == 4) {
                float a = 0.f;
                #pragma unroll
                for (int c = 0; c < VPU4 / 8; ++c)
                    a += xf[c * 8] + xf[c * 8 + 2] + xf[c * 8 + 4] + xf[c * 8 + 6] + xf[c * 8 + 7];
                xsa[m] = a;
            }"""


def variant(name: str) -> str:
    src = BASE
    if name == "engine":
        return engine_source()
    assert BASE_DOT in src
    if name.startswith("onep"):
        src = src.replace(BASE_DOT, ONEP_DOT)
    if name == "pair":
        src = src.replace(BASE_DOT, PAIR_DOT).replace(PAIR_XS_OLD, PAIR_XS_NEW)
        src = src.replace(
            "    #pragma unroll\n        for (int m = 0; m < M; ++m) {\n            const uint4* xv4",
            "    float xsa[M];\n        #pragma unroll\n        for (int m = 0; m < M; ++m) {\n            const uint4* xv4",
            1,
        )
    if name.endswith("u4") or name == "unroll4":
        src = src.replace("#pragma unroll 2\n    for (int i = lane;", "#pragma unroll 4\n    for (int i = lane;")
    return src


VARIANTS = ["base", "onep", "pair", "unroll4", "onep_u4", "engine"]
SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "head": (128256, 4096),
}


def run(args: argparse.Namespace) -> None:
    import mlx.core as mx

    kernels = {}
    for v in args.variants.split(","):
        src = variant(v)
        if v == "pair" and "xsa" not in src:
            raise SystemExit("pair: the x-sum edit did not apply")
        kernels[v] = mx.fast.cuda_kernel(
            name=f"qmv_{v}", input_names=["x", "w", "scales", "biases"], output_names=["y"], source=src
        )

    def call(v: str, x, w, s, b, bits: int):
        m, k = x.shape
        n = w.shape[0]
        return kernels[v](
            inputs=[x, w, s, b],
            template=[("T", x.dtype), ("M", m), ("K", k), ("N", n), ("GS", 64), ("BITS", bits), ("R", 2)],
            grid=(((n + 1) // 2) * 32, 1, 1),
            threadgroup=(256, 1, 1),
            output_shapes=[(m, n)],
            output_dtypes=[x.dtype],
        )[0]

    mx.random.seed(0)
    checks = []
    for bits in (4, 8):
        for m in (1, 2, 4):
            for name, (n, k) in SHAPES.items():
                if name == "head" and m > 1:
                    continue
                w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
                wq, s, b = mx.quantize(w, group_size=64, bits=bits)
                x = mx.random.normal((m, k)).astype(mx.bfloat16)
                exact = x.astype(mx.float32) @ mx.dequantize(wq, s, b, group_size=64, bits=bits).astype(mx.float32).T
                sc = mx.abs(exact).max().item()
                ref = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=bits)
                row = {
                    "bits": bits,
                    "m": m,
                    "shape": name,
                    "mlx": mx.abs(ref.astype(mx.float32) - exact).max().item() / sc,
                }
                for v in kernels:
                    if v == "pair" and bits != 4:
                        continue
                    out = call(v, x, wq, s, b, bits).astype(mx.float32)
                    row[v] = mx.abs(out - exact).max().item() / sc
                checks.append(row)
                print(
                    "check " + " ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                    file=sys.stderr,
                    flush=True,
                )
    bad = [r for r in checks for v in kernels if v in r and r[v] > max(3 * r["mlx"], 8e-3)]
    if bad:
        print(f"variants worse than 3x MLX's error: {bad}", file=sys.stderr)
    if args.checks:
        Path(args.checks).write_text(json.dumps(checks, indent=1))
    # timing: distinct weights per launch (no L2 reuse between launches), random packed values
    for bits in (4, 8):
        for name, (n, k) in SHAPES.items():
            mats = []
            for _ in range(args.reps):
                wq = mx.random.randint(0, 2**31 - 1, (n, k * bits // 32)).astype(mx.uint32)
                s = (mx.random.normal((n, k // 64)) * 0.01).astype(mx.bfloat16)
                b = (mx.random.normal((n, k // 64)) * 0.01).astype(mx.bfloat16)
                mats.append((wq, s, b))
            x = mx.random.normal((1, k)).astype(mx.bfloat16)
            mx.eval(mats, x)
            for v in kernels:
                if v == "pair" and bits != 4:
                    continue
                for wq, s, b in mats:
                    mx.eval(call(v, x, wq, s, b, bits))
            for wq, s, b in mats:
                mx.eval(mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=bits))
            del mats


def _bytes(name: str, bits: int) -> int:
    n, k = SHAPES[name]
    return n * k * bits // 8 + 2 * 2 * n * (k // 64)


def report(args: argparse.Namespace) -> None:
    lines = Path(args.report).read_text().splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    times: dict[tuple[str, int, str], list[float]] = defaultdict(list)
    for r in csv.DictReader(lines[head:]):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(r["Metric Value"].replace(",", ""))
        us = (
            v / 1e3
            if r.get("Metric Unit") in ("nsecond", "ns")
            else v * 1e3
            if r.get("Metric Unit") in ("msecond", "ms")
            else v
        )
        kn = r["Kernel Name"]
        mk = re.search(r"qmv_(\w+?)_bfloat16_t_(\d+)_(\d+)_(\d+)_64_(\d)_2", kn)
        if mk:
            var, m, k, n, bits = mk.group(1), int(mk.group(2)), int(mk.group(3)), int(mk.group(4)), int(mk.group(5))
        elif "qmv" in kn:  # MLX's own quantized matvec
            var, m, k, n, bits = "mlx", 1, 0, 0, 0
        else:
            continue
        if m != 1:
            continue
        times[(var, bits, f"{n}x{k}")].append(us)
    # MLX's kernel names carry no shape: assign its launches in order (timing loop: shapes in SHAPES order)
    out = []
    shape_of = {f"{n}x{k}": name for name, (n, k) in SHAPES.items()}
    for (var, bits, nk), ts in sorted(times.items()):
        if var == "mlx":
            continue
        t = sorted(ts)[len(ts) // 2]
        name = shape_of.get(nk, nk)
        out.append({"variant": var, "bits": bits, "shape": name, "us": t, "GB_s": _bytes(name, bits) / t / 1e3})
    for bits in (4, 8):
        print(f"{bits}-bit, 1 row: us (GB/s)")
        print(f"  {'variant':10}" + "".join(f"{s:>18}" for s in SHAPES) + f"{'step':>10}")
        for var in dict.fromkeys(o["variant"] for o in out):
            rows = {o["shape"]: o for o in out if o["variant"] == var and o["bits"] == bits}
            if not rows:
                continue
            # one decode step's matvecs: 32 layers of qkv, o, gate_up, down + the head
            step = sum(32 * rows[s]["us"] for s in ("qkv", "o", "gate_up", "down") if s in rows) + rows.get(
                "head", {}
            ).get("us", 0)
            print(
                f"  {var:10}"
                + "".join(
                    f"{rows[s]['us']:8.2f} ({rows[s]['GB_s']:5.0f})  " if s in rows else f"{'':18}" for s in SHAPES
                )
                + f"{step / 1e3:8.3f} ms"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--checks", help="write the checks as JSON here")
    ap.add_argument("--report", help="an ncu --csv log of a run: print the table")
    ap.add_argument("--json")
    a = ap.parse_args()
    report(a) if a.report else run(a)


if __name__ == "__main__":
    main()
