"""The decode attention kernel (crates/mlxrs-core/src/models/decode_attn.rs: one query a row over the KV
cache's buffers at the step's positions) against MLX's `scaled_dot_product_attention` over the slices the
cache would hand it, on a GPU of MLX's CUDA backend. The kernel's text is read from decode_attn.rs and run
through MLX's Python `mx.fast.cuda_kernel` (the C++ function mlx-c's `mlx_fast_cuda_kernel_*` wraps, as
the engine does):

1. random queries and buffers of bfloat16, float16 and float32; head sizes 64, 96, 128, 256; grouped
   (32/8, 8/1) and plain heads; one row and batches whose rows sit at different positions (0, 1, 31, 32,
   100, 1023), with and without a sliding window; the buffers' unread part filled with large values (a
   read past a row's keys shows): every output within the dtype's rounding of MLX's (the max |Δ| is
   reported against MLX's own distance from a float64 numpy reference);
2. the time of one layer's attention of a 1B (32/8 heads of 64) and an 8B (32/8 of 128) decode step at
   batch 1 and 32 (~200 and ~4000 keys): the kernel against MLX's two slices + attention (+ the boolean
   mask for a batch). Rows past 1024 keys (a wide step's, which the engine gives the kernel) are in 1.

    . bench/device_site.sh; python3 bench/attn_check.py [--out a.json] [--no-timing]     (exit 1 past the tolerance)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

TEXT = (Path(__file__).resolve().parent.parent / "crates/mlxrs-core/src/models/decode_attn.rs").read_text()
SOURCE = TEXT.split('pub(crate) const SOURCE: &str = r#"')[1].split('"#;')[0]
KERNEL = mx.fast.cuda_kernel(
    name="mlxrs_decode_attn", input_names=["q", "k", "v", "pos"], output_names=["out"], source=SOURCE
)


def kernel(q: mx.array, k: mx.array, v: mx.array, pos: mx.array, scale: float, window: int) -> mx.array:
    b, h, _, d = q.shape
    bits = int(np.array([scale], np.float32).view(np.int32)[0])
    return KERNEL(
        inputs=[q, k, v, pos],
        template=[("T", q.dtype), ("D", d), ("WINDOW", window), ("SCALE_BITS", bits)],
        grid=(h * 1024, b, 1),
        threadgroup=(1024, 1, 1),
        output_shapes=[(b, h, 1, d)],
        output_dtypes=[q.dtype],
    )[0]


def mlx_rows(q: mx.array, k: mx.array, v: mx.array, pos: list[int], scale: float, window: int) -> mx.array:
    """MLX's attention row by row over the keys the row sees (the per-row cache's views)."""
    outs = []
    for b, p in enumerate(pos):
        lo = max(0, p + 1 - window) if window else 0
        outs.append(
            mx.fast.scaled_dot_product_attention(
                q[b : b + 1], k[b : b + 1, :, lo : p + 1], v[b : b + 1, :, lo : p + 1], scale=scale
            )
        )
    return mx.concatenate(outs, axis=0)


def numpy_ref(q: mx.array, k: mx.array, v: mx.array, pos: list[int], scale: float, window: int) -> np.ndarray:
    qn, kn, vn = (np.array(a.astype(mx.float32), dtype=np.float64) for a in (q, k, v))
    b, h, _, d = qn.shape
    g = h // kn.shape[1]
    out = np.zeros((b, h, 1, d))
    for r, p in enumerate(pos):
        lo = max(0, p + 1 - window) if window else 0
        for hh in range(h):
            s = scale * kn[r, hh // g, lo : p + 1] @ qn[r, hh, 0]
            w = np.exp(s - s.max())
            out[r, hh, 0] = (w / w.sum()) @ vn[r, hh // g, lo : p + 1]
    return out


# a wide step (8 rows of 32 heads: 256 blocks) takes rows past 1024 keys
LONG = [4100, 1500, 3000, 17, 2047, 2048, 900, 4095]


def check(out_json: dict) -> bool:
    ok = True
    mx.random.seed(0)
    rows = []
    for dtype in (mx.bfloat16, mx.float16, mx.float32):
        for d in (64, 96, 128, 256):
            for heads, kv_heads in ((32, 8), (8, 1), (4, 4)):
                for pos, window in (
                    ([0], 0),
                    ([1], 0),
                    ([31], 0),
                    ([32], 0),
                    ([100], 0),
                    ([1023], 0),
                    ([0, 5, 31, 32, 200, 33], 0),
                    ([100, 40, 7], 16),
                    ([3], 16),
                    (LONG, 0),
                    (LONG, 300),
                ):
                    b, cap = len(pos), max(pos) + 9
                    slots = b + 1
                    q = mx.random.normal((b, heads, 1, d)).astype(dtype)
                    k = mx.random.normal((slots, kv_heads, cap, d)).astype(dtype)
                    v = mx.random.normal((slots, kv_heads, cap, d)).astype(dtype)
                    # what no row may read: large values past each row's position
                    beyond = mx.arange(cap)[None, None, :, None] > mx.array(pos + [0])[:, None, None, None]
                    k, v = mx.where(beyond, mx.array(300.0, dtype), k), mx.where(beyond, mx.array(-500.0, dtype), v)
                    scale = 1.0 / math.sqrt(d)
                    got = kernel(q, k, v, mx.array(pos, dtype=mx.int32), scale, window)
                    want = mlx_rows(q, k, v, pos, scale, window)
                    ref = numpy_ref(q, k[:b], v[:b], pos, scale, window)
                    g, w = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
                    d_k, d_m = float(np.abs(g - ref).max()), float(np.abs(w - ref).max())
                    # within twice MLX's own distance from float64, plus one rounding step of the dtype
                    eps = {mx.bfloat16: 2**-8, mx.float16: 2**-11, mx.float32: 2**-23}[dtype]
                    good = bool(np.isfinite(g).all()) and d_k <= 2 * d_m + 4 * eps
                    ok &= good
                    rows.append(
                        {
                            "dtype": str(dtype),
                            "d": d,
                            "heads": [heads, kv_heads],
                            "pos": pos,
                            "window": window,
                            "kernel_vs_f64": d_k,
                            "mlx_vs_f64": d_m,
                            "kernel_vs_mlx": float(np.abs(g - w).max()),
                            "ok": good,
                        }
                    )
                    if not good:
                        print("MISMATCH", rows[-1], flush=True)
    out_json["cases"] = rows
    out_json["all_ok"] = ok
    print(f"{len(rows)} cases, all within tolerance: {ok}; worst kernel-vs-f64 / mlx-vs-f64 per dtype:")
    for dt in ("mlx.core.bfloat16", "mlx.core.float16", "mlx.core.float32"):
        sel = [r for r in rows if r["dtype"] == dt]
        print(f"  {dt}: {max(r['kernel_vs_f64'] for r in sel):.3g} / {max(r['mlx_vs_f64'] for r in sel):.3g}")
    return ok


def timing(out_json: dict) -> None:
    res = []
    for name, heads, kv_heads, d in (("1B", 32, 8, 64), ("8B", 32, 8, 128)):
        for b, pos0 in ((1, 600), (32, 200), (32, 4000)):
            cap = pos0 + 3 * b + 264
            pos = [pos0 + 3 * i for i in range(b)]
            q = mx.random.normal((b, heads, 1, d)).astype(mx.bfloat16)
            k = mx.random.normal((b, kv_heads, cap, d)).astype(mx.bfloat16)
            v = mx.random.normal((b, kv_heads, cap, d)).astype(mx.bfloat16)
            p = mx.array(pos, dtype=mx.int32)
            mx.eval(q, k, v, p)
            n = max(pos) + 1
            mask = mx.arange(n)[None, None, None, :] <= p[:, None, None, None]
            scale = 1.0 / math.sqrt(d)

            def ours():  # noqa: ANN202
                return kernel(q, k, v, p, scale, 0)

            def theirs():  # noqa: ANN202
                kk, vv = k[:, :, :n], v[:, :, :n]
                return mx.fast.scaled_dot_product_attention(q, kk, vv, scale=scale, mask=mask if b > 1 else None)

            t = {}
            for label, f in (("kernel", ours), ("mlx", theirs), ("kernel2", ours), ("mlx2", theirs)):
                for _ in range(5):
                    mx.eval(f())
                reps = 200
                t0 = time.perf_counter()
                outs = [f() for _ in range(reps)]
                mx.eval(*outs)
                t[label] = (time.perf_counter() - t0) / reps * 1e6
            row = {
                "model": name,
                "rows": b,
                "keys": n,
                "kernel_us": min(t["kernel"], t["kernel2"]),
                "mlx_us": min(t["mlx"], t["mlx2"]),
            }
            res.append(row)
            print(
                f"{name} rows {b} keys ≤{n}: kernel {row['kernel_us']:.1f} µs a call, MLX slices+attention {row['mlx_us']:.1f} µs (wall, 200 calls in one eval)"
            )
    out_json["timing"] = res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--no-timing", action="store_true", help="the check alone")
    args = ap.parse_args()
    result: dict = {"device": str(mx.default_device())}
    ok = check(result)
    if not args.no_timing:
        timing(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
