"""Decode speed under a JSON-schema constraint vs unconstrained, in one run, one session.

    python bench/bench_constrained.py --model fit-llama-f32 [--tokens 128] [--batch 1,8] [--rounds 3]

`--model` is a tests/tinymodels.py FIT_MODELS name, "tiny" (the tests' qwen3) or a model directory.
Each round generates `--batch` sequences at once (generate_batch), unconstrained (ignore_eos, exactly
`--tokens` tokens each) and under a schema whose output is about `--tokens` tokens long (an array of
single-digit integers: one digit and one comma per item), both greedy and both from the same prompt.
Decode tok/s = generated tokens / the slowest sequence's generation seconds (the prompt excluded); the
best of `--rounds` each side. Prints both and the ratio (constrained / unconstrained)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import mlxrs  # noqa: E402


def model_dir(name: str) -> Path:
    from tinymodels import FIT_MODELS, make_fit_model, make_model

    if name in FIT_MODELS:
        return make_fit_model(name)
    if name == "tiny":
        return make_model("qwen3-float32", "qwen3")
    return Path(name)


def decode_rate(s: mlxrs.Session, batch: int, **kw) -> tuple[float, int, list[str]]:
    outs = s.generate_batch(["Write a list of numbers."] * batch, **kw)
    toks = sum(c.usage.completion_tokens for c in outs)
    secs = max(c.timings.generation_seconds for c in outs)
    return toks / secs, toks, [c.finish_reason for c in outs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="fit-llama-f32")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    items = a.tokens // 2
    schema = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": items,
        "maxItems": items,
    }
    results = []
    with mlxrs.Session(model_dir(a.model)) as s:
        s.generate("warm up", max_tokens=8)
        s.generate("warm up", max_tokens=8, json_schema=schema)  # builds the token trie once
        for batch in [int(b) for b in a.batch.split(",")]:
            free, tied = 0.0, 0.0
            for _ in range(a.rounds):
                r, n_free, _ = decode_rate(s, batch, max_tokens=a.tokens, ignore_eos=True)
                free = max(free, r)
                r, n_tied, reasons = decode_rate(s, batch, max_tokens=a.tokens + 8, json_schema=schema)
                assert all(x == "stop" for x in reasons), reasons
                tied = max(tied, r)
            row = {
                "model": a.model,
                "batch": batch,
                "unconstrained_tok_s": round(free, 1),
                "constrained_tok_s": round(tied, 1),
                "ratio": round(tied / free, 3),
                "tokens_unconstrained": n_free,
                "tokens_constrained": n_tied,
            }
            results.append(row)
            print(
                f"batch {batch}: unconstrained {free:.1f} tok/s, JSON schema {tied:.1f} tok/s, ratio {tied / free:.3f}",
                flush=True,
            )
    if a.out:
        Path(a.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "results": results}, indent=1))


if __name__ == "__main__":
    main()
