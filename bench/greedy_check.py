"""The fused greedy kernel (crates/mlxrs-core/src/models/greedy.rs: the engine's greedy token in one CUDA
kernel) against MLX's ops it replaces — `argmax(logits - logsumexp(logits))`, as mlx-lm samples greedily —
on a GPU of MLX's CUDA backend. The kernel's text is read from greedy.rs and run through MLX's Python
`mx.fast.cuda_kernel` (the C++ function mlx-c's `mlx_fast_cuda_kernel_*` wraps, as the engine does):

1. random logits of bfloat16, float16 and float32, vocabularies of Llama 3 (128256), Qwen (151936),
   Gemma 3 (262144) and odd sizes, scaled up to where the rounding of `x - lse` makes ties, with
   masked (-inf) entries, equal maxima and near-ties: every token must equal the ops' token;
2. the time of one call against the three ops on one row of 128256 bfloat16 logits.

    . bench/device_site.sh; python3 bench/greedy_check.py [--out g.json]     (exit 1 on a mismatch)

The engine's own A/B (`MLXRS_CUDA_GREEDY=0`: the ops) is bench/device_run.sh's `--ab-env`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

TEXT = (Path(__file__).resolve().parent.parent / "crates/mlxrs-core/src/models/greedy.rs").read_text()
SOURCE = TEXT.split('const SOURCE: &str = r#"')[1].split('"#;')[0]
KERNEL = mx.fast.cuda_kernel(name="mlxrs_greedy", input_names=["logits"], output_names=["y"], source=SOURCE)


def fused(logits: mx.array) -> mx.array:
    rows, v = logits.shape
    return KERNEL(
        inputs=[logits],
        template=[("T", logits.dtype), ("V", v)],
        grid=(rows * 1024, 1, 1),
        threadgroup=(1024, 1, 1),
        output_shapes=[(rows,)],
        output_dtypes=[mx.int32],
    )[0]


def reference(logits: mx.array) -> mx.array:
    return mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1).astype(mx.int32)


def cases():  # noqa: ANN201
    """(name, logits [rows, V]) of every kind the check runs."""
    mx.random.seed(0)
    for dtype in (mx.bfloat16, mx.float16, mx.float32):
        for v in (128256, 151936, 262144, 32000, 1001):
            for scale in (1.0, 8.0, 60.0):
                l = (mx.random.normal((16, v)) * scale).astype(dtype)
                yield f"{dtype}/{v}/x{scale}", l
                # a quarter masked out, as a constraint or a top-k would
                mask = mx.random.uniform(shape=(16, v)) < 0.25
                yield f"{dtype}/{v}/x{scale}/masked", mx.where(mask, mx.array(-float("inf"), dtype), l)
        # equal maxima: the first index wins
        l = mx.random.normal((4, 50000)).astype(dtype)
        top = mx.max(l, axis=-1, keepdims=True) + 1
        for a, b in ((7, 40000), (0, 49999), (123, 124), (30000, 20000)):
            l[:, a] = top[:, 0]
            l[:, b] = top[:, 0]
        yield f"{dtype}/ties", l
        # ties that the rounding of x - lse makes: distinct values near 0.5 (bf16 steps of 2^-8) all
        # become x - lse near -11.75 (steps of 2^-4), so several maxima of the rounded values are not
        # the max of x, and the first of them wins
        yield f"{dtype}/rounding_ties", (0.5 + 0.05 * mx.random.uniform(shape=(8, 128256))).astype(dtype)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    a = ap.parse_args()
    out: dict = {"cases": {}}
    bad = 0
    for name, l in cases():
        got, want = fused(l), reference(l)
        mx.eval(got, want)
        n = int(mx.sum(got != want).item())
        out["cases"][name] = n
        bad += n
        if n:
            print(f"MISMATCH {name}: {n} of {l.shape[0]} rows", flush=True)
    print(f"{len(out['cases'])} cases, {bad} mismatched rows", flush=True)
    l = mx.random.normal((1, 128256)).astype(mx.bfloat16)
    mx.eval(l)
    for name, f in (("fused", fused), ("ops", reference)):
        mx.eval(f(l))
        mx.synchronize()
        t = time.perf_counter()
        for _ in range(200):
            mx.eval(f(l))
        mx.synchronize()
        out[f"{name}_us"] = (time.perf_counter() - t) / 200 * 1e6
    print(f"one row of 128256 bf16: fused {out['fused_us']:.1f} us a call, ops {out['ops_us']:.1f}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
