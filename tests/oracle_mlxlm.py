"""The parity oracle: mlx-lm run in its own process (so it can be given the same BLAS as mlxrs
through LD_PRELOAD). The tests reach it through tests/oracle_server.py, one long-lived process that
loads each model once and answers many jobs; run as a script it answers one job (bench/device_parity.py):
reads a JSON job on stdin, writes JSON results on stdout.

Job: {"model": dir, "prompt": [ids], "max_tokens": n, "kv_bits": b|null, "max_kv_size": n|null,
      "prefill_step_size": n, "adapter_path": dir|null (a LoRA/DoRA adapter, mlx-lm's load_adapters),
      "exact_quantized_matmul": bool (optional: _exact_quantized_matmul and _exact_gather_mm below)}
Out: {"tokens": [ids] (greedy), "logits": [last-position logits, float32],
      "margins": [each step's log-probability gap between its best and second-best token]}
"""

from __future__ import annotations

import json
import sys
from typing import Any

import mlx.core as mx
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step, maybe_quantize_kv_cache
from mlx_lm.models.cache import make_prompt_cache


_MLX_QUANTIZED_MATMUL = mx.quantized_matmul
EXACT = [False]  # the running job's "exact_quantized_matmul"


def _exact_quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None = None,
    transpose: bool = True,
    group_size: int | None = None,
    bits: int | None = None,
    mode: str = "affine",
    **kw: Any,
) -> mx.array:
    """`mx.quantized_matmul` as mlxrs computes it on the CPU for a bfloat16/float16 x: exact products
    — W dequantized in float32 (affine: with its scales and biases in float32), x in float32, the
    result rounded once to x's dtype — where mlxrs takes them so: its packed kernel for up to 8 rows
    (crates/mlxrs-core/src/handle/packed.rs: affine 4 or 8 bits, groups of a multiple of 32) and its
    float32 dequantization from 9 rows on (models/layers.rs `dequant_matmul_f32`). MLX's own CPU
    kernel accumulates a bfloat16 x in bfloat16 on x86 (its SIMD width there is 1: `_qmm_t<bfloat16_t>`),
    a rounding per term that mlxrs does not reproduce; a job that asks for it
    (`exact_quantized_matmul`) gets these products (a float32 x, and everywhere else, is MLX's own
    path)."""
    g, b = group_size or 64, bits or 4
    rows = x.size // max(x.shape[-1], 1)
    kernel = mode == "affine" and biases is not None and b in (4, 8) and g % 32 == 0
    if (
        EXACT[0]
        and mx.default_device() == mx.cpu
        and w.ndim == 2
        and transpose
        and x.dtype in (mx.bfloat16, mx.float16)
        and (rows > 8 or kernel)
    ):
        f32 = mx.float32
        if mode == "affine":
            wd = mx.dequantize(w, scales.astype(f32), None if biases is None else biases.astype(f32), g, b)
        else:
            wd = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits, mode=mode).astype(f32)
        return (x.astype(f32) @ wd.T).astype(x.dtype)
    return _MLX_QUANTIZED_MATMUL(
        x, w, scales, biases, transpose=transpose, group_size=group_size, bits=bits, mode=mode, **kw
    )


mx.quantized_matmul = _exact_quantized_matmul

_MLX_GATHER_MM = mx.gather_mm


def _exact_gather_mm(a: mx.array, b: mx.array, *args: Any, **kw: Any) -> mx.array:
    """`mx.gather_mm` as mlxrs computes it on the CPU for 16-bit experts (crates/mlxrs-core/src/handle/half.rs
    `host_half_gather_matmul`): exact products — x and W widened to float32, summed in float32 — rounded
    once to x's dtype. MLX's CPU `gather_mm` has only float32, so without this mlx-lm cannot run a
    bfloat16 or float16 mixture on the CPU at all; a job that asks for exact products gets these (the
    rest of the model is MLX's own path)."""
    if EXACT[0] and mx.default_device() == mx.cpu and a.dtype in (mx.bfloat16, mx.float16) and b.dtype == a.dtype:
        return _MLX_GATHER_MM(a.astype(mx.float32), b.astype(mx.float32), *args, **kw).astype(a.dtype)
    return _MLX_GATHER_MM(a, b, *args, **kw)


mx.gather_mm = _exact_gather_mm


def load(job: dict[str, Any]) -> Any:
    """The model a job runs on: mlx-lm's `load`, with the job's adapter (the tokenizer is not used)."""
    model, _tok = mlx_lm_load(job["model"], adapter_path=job.get("adapter_path"))
    return model


def run(model: Any, job: dict[str, Any]) -> dict[str, Any]:
    """One job on a loaded model. Every job makes its own caches: nothing of one job is left for the next."""
    EXACT[0] = bool(job.get("exact_quantized_matmul"))
    prompt = mx.array(job["prompt"], dtype=mx.int32)
    step = job.get("prefill_step_size", 2048)
    kv_bits = job.get("kv_bits")
    # last-position logits on generate_step's schedule: chunks of all but the last token, then it
    cache = make_prompt_cache(model, max_kv_size=job.get("max_kv_size"))
    head, tail = prompt[:-1], prompt[-1:]
    chunks = [head[i : i + step] for i in range(0, head.shape[0], step)] + [tail]
    logits = None
    for c in chunks:
        logits = model(c[None], cache=cache)
        maybe_quantize_kv_cache(cache, quantized_kv_start=0, kv_group_size=64, kv_bits=kv_bits)
        mx.eval([x.state for x in cache])
    last = logits[0, -1].astype(mx.float32)
    tokens, margins = [], []
    for tok, lp in generate_step(
        prompt,
        model,
        max_tokens=job["max_tokens"],
        max_kv_size=job.get("max_kv_size"),
        prefill_step_size=step,
        kv_bits=kv_bits,
        quantized_kv_start=0,
    ):
        tokens.append(int(tok))
        top2 = mx.topk(lp.astype(mx.float32), 2)
        margins.append(float(mx.abs(top2[0] - top2[1])))
    return {"tokens": tokens, "logits": last.tolist(), "margins": margins}


def main() -> None:
    job = json.load(sys.stdin)
    json.dump(run(load(job), job), sys.stdout)


if __name__ == "__main__":
    main()
