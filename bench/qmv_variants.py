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
- `q8x`: the engine's 4-bit kernel (`SOURCE_Q8X`: x rounded to int8 per 32 values, dp4a); `q8x4`: the same
  with four output rows a warp (both also run for 8-bit, where the engine keeps the float kernel).
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


def _kernel_of(text: str, const: str = "SOURCE") -> str:
    """`const SOURCE` (or another kernel text) of a qmv.rs."""
    start = text.index(f'const {const}: &str = r#"') + len(f'const {const}: &str = r#"')
    return text[start : text.index('"#;', start)]


QMV_RS = HERE.parent / "crates/mlxrs-core/src/models/qmv.rs"


def engine_source() -> str:
    """The kernel as the engine runs it: `const SOURCE` of crates/mlxrs-core/src/models/qmv.rs after
    its norm prologue (also what bench/qmv_kernel_dev.py runs)."""
    text = QMV_RS.read_text()
    return _kernel_of(text, "NORM_PROLOGUE") + _kernel_of(text, "NORM_STAGE") + _kernel_of(text)


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


# `q8x`: the engine's int8-activation kernel (`SOURCE_Q8X` of qmv.rs: x rounded to int8 per 32 values in
# shared memory, dp4a); `q8x4`: the same with four output rows a warp instead of two.
def engine_header() -> str:
    """`const HEADER` of qmv.rs (the row mapping and the store that `engine` and `q8x` use)."""
    return _kernel_of(QMV_RS.read_text(), "HEADER")


def engine_q8x_source() -> str:
    text = QMV_RS.read_text()
    return _kernel_of(text, "NORM_PROLOGUE") + _kernel_of(text, "SOURCE_Q8X")


def variant(name: str) -> str:
    src = BASE
    if name == "engine":
        return engine_source()
    if name.startswith("q8x"):
        return engine_q8x_source()
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
            name=f"qmv_{v}",
            input_names=["x", "w", "scales", "biases"],
            output_names=["y"],
            source=src,
            header=engine_header() if v == "engine" or v.startswith("q8x") else "",
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
