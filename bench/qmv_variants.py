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
- (`pair`, measured 2026-12-02 and now part of `engine`: four shifts of the packed word bring every
  nibble to bits 12–15 or 16–19, where a mask-or alone makes it 1 + q/2048 or 1 + q/128.)
- `unroll4`: `base` with the loop unrolled 4 times (more loads in flight per lane).
- `onep_u4`: `onep` unrolled 4 times.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _kernel_of(text: str) -> str:
    """`const SOURCE` of a qmv.rs."""
    start = text.index('const SOURCE: &str = r#"') + len('const SOURCE: &str = r#"')
    return text[start : text.index('"#;', start)]


def engine_source() -> str:
    """The kernel as the engine runs it: `const SOURCE` of crates/mlxrs-core/src/models/qmv.rs (also
    what bench/qmv_kernel_dev.py runs)."""
    return _kernel_of((HERE.parent / "crates/mlxrs-core/src/models/qmv.rs").read_text())


PREVIOUS_COMMIT = "2b49d4c"


def previous_source() -> str:
    """The engine's kernel until 2026-12-02 (commit 2b49d4c: all of a read's x values converted first,
    each packed value decoded as 2^23 + q minus 2^23), which the variants below edit: from
    $MLXRS_QMV_PREVIOUS (a copy of that commit's qmv.rs, for a machine without the repository's
    history: `git show 2b49d4c:crates/mlxrs-core/src/models/qmv.rs > .device/qmv_2b49d4c.rs`), else git;
    "" where neither has it (then only `engine` runs)."""
    path = os.environ.get("MLXRS_QMV_PREVIOUS")
    if path and Path(path).is_file():
        return _kernel_of(Path(path).read_text())
    try:
        r = subprocess.run(
            ["git", "show", f"{PREVIOUS_COMMIT}:crates/mlxrs-core/src/models/qmv.rs"],
            cwd=HERE,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return ""
    return _kernel_of(r.stdout)


BASE = previous_source()

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


# `q8x`: x rounded to int8 per 16-byte read's worth of values (32 for 4-bit, 16 for 8-bit), one thread per
# block of x into shared memory before any weight is read (the scale d = max|x|/127 and d·Σq_x per block);
# then each packed word is a dp4a or two (4-bit: the low and high nibbles masked into bytes against x
# stored as [x0 x2 x4 x6 | x1 x3 x5 x7] per eight; 8-bit: the bytes unsigned against x signed), one
# integer dot I per read and row, then d·(s·I + b·Σq_x) in float: the dequantized weights against the
# rounded x. llama.cpp's mmvq does the same with q8_1 blocks of 32. x's int8 copy takes M·K bytes of
# shared memory (M·K ≤ 32768 here). `q8x4`: four output rows a warp instead of two.
Q8X = r"""
#ifndef MLXRS_RES
#define MLXRS_RES(i) 0.f
#endif
    constexpr int PER_U32 = 32 / BITS;
    constexpr int WPR = K / PER_U32;            // packed uint32 per weight row
    constexpr int VPU4 = 4 * PER_U32;           // values per 16-byte read = one x block
    constexpr int NB = K / VPU4;                // x blocks per row of x
    constexpr int NG = K / GS;
    __shared__ __align__(16) int xq[M * K / 4];
    __shared__ float xd[M * NB];
    __shared__ float xsum[M * NB];
    const unsigned lane = threadIdx.x & 31u;
    // one thread per x block: its values converted, max |x|, rounded to int8 (4-bit: stored as
    // [x0 x2 x4 x6 | x1 x3 x5 x7] per eight), the scale d and d * (sum of the int8 values), so that the
    // dequantized weights meet the rounded x throughout: y = sum_blocks d (s I + b sum q_x)
    for (int bi = threadIdx.x; bi < M * NB; bi += blockDim.x) {
        const int m = bi / NB, blk = bi % NB;
        const uint4* src = reinterpret_cast<const uint4*>(x + (size_t)m * K + blk * VPU4);
        float v[VPU4];
        float amax = 0.f;
        #pragma unroll
        for (int c = 0; c < VPU4 / 8; ++c) {
            const uint4 raw = src[c];
            const T* e = reinterpret_cast<const T*>(&raw);
            #pragma unroll
            for (int u = 0; u < 8; ++u) { v[8 * c + u] = static_cast<float>(e[u]); amax = fmaxf(amax, fabsf(v[8 * c + u])); }
        }
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        int packed[VPU4 / 4];
        #pragma unroll
        for (int u = 0; u < VPU4 / 4; ++u) packed[u] = 0;
        int qsum = 0;
        #pragma unroll
        for (int e = 0; e < VPU4; ++e) {
            const int qv = __float2int_rn(v[e] * inv);
            qsum += qv;
            const int te = e & 7;
            const int pos = BITS == 4 ? (e & ~7) | ((te & 1) ? 4 + (te >> 1) : (te >> 1)) : e;
            packed[pos >> 2] |= (qv & 0xff) << (8 * (pos & 3));
        }
        int4* dst = reinterpret_cast<int4*>(xq + ((size_t)m * K + blk * VPU4) / 4);
        #pragma unroll
        for (int c = 0; c < VPU4 / 16; ++c) dst[c] = make_int4(packed[4 * c], packed[4 * c + 1], packed[4 * c + 2], packed[4 * c + 3]);
        xd[bi] = amax * (1.f / 127.f);
        xsum[bi] = amax * (1.f / 127.f) * (float)qsum;
    }
    __syncthreads();
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
            const int4* xv = reinterpret_cast<const int4*>(xq + ((size_t)m * K + k0) / 4);
            int xw[VPU4 / 4];
            #pragma unroll
            for (int c = 0; c < VPU4 / 16; ++c) {
                const int4 t = xv[c];
                xw[4 * c] = t.x; xw[4 * c + 1] = t.y; xw[4 * c + 2] = t.z; xw[4 * c + 3] = t.w;
            }
            const float d = xd[m * NB + i], xs = xsum[m * NB + i];
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                const unsigned qs[4] = {q[r].x, q[r].y, q[r].z, q[r].w};
                int dot = 0;
                #pragma unroll
                for (int j = 0; j < 4; ++j) {
                    if (BITS == 4) {
                        const unsigned lo = qs[j] & 0x0F0F0F0Fu, hi = (qs[j] >> 4) & 0x0F0F0F0Fu;
                        asm("dp4a.u32.s32 %0, %1, %2, %0;" : "+r"(dot) : "r"(lo), "r"(xw[2 * j]));
                        asm("dp4a.u32.s32 %0, %1, %2, %0;" : "+r"(dot) : "r"(hi), "r"(xw[2 * j + 1]));
                    } else {
                        asm("dp4a.u32.s32 %0, %1, %2, %0;" : "+r"(dot) : "r"(qs[j]), "r"(xw[j]));
                    }
                }
                acc[r][m] = fmaf(s[r] * d, (float)dot, fmaf(b[r], xs, acc[r][m]));
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
            if (lane == 0 && row0 + r < (unsigned)N) {
                const size_t i = (size_t)m * N + row0 + r;
                y[i] = static_cast<T>(v + MLXRS_RES(i));
            }
        }
    }
"""


def variant(name: str) -> str:
    src = BASE
    if name == "engine":
        return engine_source()
    if name.startswith("q8x"):
        return Q8X
    if BASE_DOT not in src:
        raise SystemExit(f"variant {name}: no copy of the kernel of {PREVIOUS_COMMIT} (see previous_source)")
    if name.startswith("onep"):
        src = src.replace(BASE_DOT, ONEP_DOT)
    if name.endswith("u4") or name == "unroll4":
        src = src.replace("#pragma unroll 2\n    for (int i = lane;", "#pragma unroll 4\n    for (int i = lane;")
    return src


VARIANTS = ["base", "onep", "unroll4", "onep_u4", "engine", "q8x", "q8x4"]
# output rows per warp where not 2
ROWS_PER_WARP = {"q8x4": 4}
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
        kernels[v] = mx.fast.cuda_kernel(
            name=f"qmv_{v}", input_names=["x", "w", "scales", "biases"], output_names=["y"], source=src
        )

    def call(v: str, x, w, s, b, bits: int):
        m, k = x.shape
        n = w.shape[0]
        r = ROWS_PER_WARP.get(v, 2)
        return kernels[v](
            inputs=[x, w, s, b],
            template=[("T", x.dtype), ("M", m), ("K", k), ("N", n), ("GS", 64), ("BITS", bits), ("R", r)],
            grid=(((n + r - 1) // r) * 32, 1, 1),
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
                    if v.startswith("q8x") and m * k > 32768:  # x's int8 copy over static shared memory
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
                for wq, s, b in mats:
                    mx.eval(call(v, x, wq, s, b, bits))
            for wq, s, b in mats:
                mx.eval(mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=bits))
            del mats


def _bytes(name: str, bits: int) -> int:
    n, k = SHAPES[name]
    return n * k * bits // 8 + 2 * 2 * n * (k // 64)


def report(args: argparse.Namespace) -> None:
    from gpu_profile import ncu_kernel_times

    times: dict[tuple[str, int, str], list[float]] = defaultdict(list)
    for kn, us in ncu_kernel_times(args.report):
        mk = re.search(r"qmv_(\w+?)_bfloat16_t_(\d+)_(\d+)_(\d+)_64_(\d)_(\d)", kn)
        if not mk or int(mk.group(2)) != 1:  # MLX's own kernel (its name carries no shape), or m > 1
            continue
        var, k, n, bits = mk.group(1), int(mk.group(3)), int(mk.group(4)), int(mk.group(5))
        times[(var, bits, f"{n}x{k}")].append(us)
    out = []
    shape_of = {f"{n}x{k}": name for name, (n, k) in SHAPES.items()}
    for (var, bits, nk), ts in sorted(times.items()):
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
