"""mlx-lm's own batched decoding against its single-sequence decoding, on the same prompts: the
test that tells a GPU's batch-shape numerics from a batching bug (bench/device_parity.py
--oracle-batch). Reads a JSON job on stdin, writes JSON on stdout.

Job: {"model": dir, "prompts": [[ids]...], "max_tokens": n}
Out: {"batch": [[ids]...] (BatchGenerator, greedy, no stop tokens), "alone": [[ids]...] (generate_step)}
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import BatchGenerator, generate_step


def main() -> None:
    job = json.load(sys.stdin)
    model, _tok = load(job["model"])
    n = job["max_tokens"]
    alone = []
    for p in job["prompts"]:
        toks = []
        for tok, _ in generate_step(mx.array(p, dtype=mx.int32), model, max_tokens=n):
            toks.append(int(tok))
        alone.append(toks)
    gen = BatchGenerator(model, stop_tokens=[])
    uids = gen.insert(job["prompts"], [n] * len(job["prompts"]))
    out: dict = {u: [] for u in uids}
    while responses := gen.next_generated():
        for r in responses:
            out[r.uid].append(int(r.token))
    gen.close()
    json.dump({"batch": [out[u] for u in uids], "alone": alone}, sys.stdout)


if __name__ == "__main__":
    main()
