"""Decode ms/token of one model directory under the CPU decode switches, alternating in one process.

    python bench/ab_cpu_decode.py ~/.cache/mlxrs/gguf/<digest>-f32-v5 6

Three configurations (MLXRS_CPU_Q8_HEAD, MLXRS_CPU_HOST_BLOCKS: both off — every product from the
f32 weights —, the Q8_0 head only, both on — the default), one session each per round, the order
rotated each round; a 64-token prompt, a 4-token warm-up, then 33 greedy tokens timed by the engine
(`timings.generation_tps`). Prints the medians and whether all configurations decoded the same tokens.
"""

from __future__ import annotations

import os
import statistics
import sys

import mlxrs

CONFS = {
    "f32 (no blocks)": {"MLXRS_CPU_Q8_HEAD": "0", "MLXRS_CPU_HOST_BLOCKS": "0"},
    "q8 head": {"MLXRS_CPU_Q8_HEAD": "1", "MLXRS_CPU_HOST_BLOCKS": "0"},
    "q8 head + projections' blocks (default)": {"MLXRS_CPU_Q8_HEAD": "1", "MLXRS_CPU_HOST_BLOCKS": "1"},
}


def main() -> None:
    d, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 6
    prompt = [2] + [(7919 * i) % 262000 + 4 for i in range(63)]
    names = list(CONFS)
    res: dict[str, list[float]] = {n: [] for n in names}
    toks: dict[str, list[int]] = {}
    for r in range(rounds):
        for n in names[r % 3 :] + names[: r % 3]:
            os.environ.update(CONFS[n])
            with mlxrs.Session(d) as s:
                s.generate(prompt, max_tokens=4, ignore_eos=True)
                c = s.generate(prompt, max_tokens=33, ignore_eos=True)
                res[n].append(1000 / c.timings.generation_tps)
                toks.setdefault(n, c.tokens)
    for n in names:
        print(f"{n}: median {statistics.median(res[n]):.1f} ms/token, rounds {[round(x, 1) for x in res[n]]}")
    print("tokens identical:", len({tuple(t) for t in toks.values()}) == 1)
    print("load", os.getloadavg())


if __name__ == "__main__":
    main()
