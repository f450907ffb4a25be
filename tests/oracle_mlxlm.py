"""The parity oracle: mlx-lm run in its own process (so it can be given the same BLAS as mlxrs
through LD_PRELOAD). The tests reach it through tests/oracle_server.py, one long-lived process that
loads each model once and answers many jobs; run as a script it answers one job (bench/device_parity.py):
reads a JSON job on stdin, writes JSON results on stdout.

Job: {"model": dir, "prompt": [ids], "max_tokens": n, "kv_bits": b|null, "max_kv_size": n|null,
      "prefill_step_size": n, "adapter_path": dir|null (a LoRA/DoRA adapter, mlx-lm's load_adapters)}
Out: {"tokens": [ids] (greedy), "logits": [last-position logits, float32]}
"""

from __future__ import annotations

import json
import sys
from typing import Any

import mlx.core as mx
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step, maybe_quantize_kv_cache
from mlx_lm.models.cache import make_prompt_cache


def load(job: dict[str, Any]) -> Any:
    """The model a job runs on: mlx-lm's `load`, with the job's adapter (the tokenizer is not used)."""
    model, _tok = mlx_lm_load(job["model"], adapter_path=job.get("adapter_path"))
    return model


def run(model: Any, job: dict[str, Any]) -> dict[str, Any]:
    """One job on a loaded model. Every job makes its own caches: nothing of one job is left for the next."""
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
    tokens = []
    for tok, _ in generate_step(
        prompt,
        model,
        max_tokens=job["max_tokens"],
        max_kv_size=job.get("max_kv_size"),
        prefill_step_size=step,
        kv_bits=kv_bits,
        quantized_kv_start=0,
    ):
        tokens.append(int(tok))
    return {"tokens": tokens, "logits": last.tolist()}


def main() -> None:
    job = json.load(sys.stdin)
    json.dump(run(load(job), job), sys.stdout)


if __name__ == "__main__":
    main()
