"""A CPU batched decode step's time under the CPU decode switches, configurations alternating.

    python bench/cpu_step.py --rows 16 --rounds 2            # fit-llama-f32 (tests/tinymodels.py)
    python bench/cpu_step.py --rows 8,16,32 --model tiny
    python bench/cpu_step.py --confs "both (default),spawned=MLXRS_HOST_POOL=0"   # an env A/B

Each configuration runs in a process of its own (the switches, and OPENBLAS_NUM_THREADS where a
configuration sets it, are read there) per round, in the same order each round: `rows` prompts of
20 to 20 + rows tokens decoded together (`Session.generate_batch`, greedy, no EOS); the step time is the
difference of a 40- and an 8-token batch over the 32 steps between them, twice per process. Prints each
configuration's median and whether every configuration decoded the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CONFS: dict[str, dict[str, str]] = {
    "MLX (both off)": {"MLXRS_CPU_SMALL_MATMUL": "0", "MLXRS_CPU_ROWS_ATTENTION": "0"},
    "host matmul op": {"MLXRS_CPU_ROWS_ATTENTION": "0"},
    "rows attention op": {"MLXRS_CPU_SMALL_MATMUL": "0"},
    "both (default)": {},
}

SWITCHES = ("MLXRS_CPU_SMALL_MATMUL", "MLXRS_CPU_ROWS_ATTENTION")

CHILD = r"""
import hashlib, json, sys, time
sys.path.insert(0, sys.argv[3] + "/tests"); sys.path.insert(0, sys.argv[3] + "/bench")
import mlxrs
mlxrs.runtime_info()  # the native runtime first: MLX then binds the BLAS mlxrs routes to
from bench_serve import model_dir
d = model_dir(sys.argv[1])
n = int(sys.argv[2])
prompts = [[5 + (i * 131 + j * 7) % 900 for j in range(20 + i)] for i in range(n)]
with mlxrs.Session(str(d), prompt_cache_bytes=0) as s:
    s.generate_batch(prompts, max_tokens=4, ignore_eos=True)
    out = []
    for _ in range(2):
        t0 = time.perf_counter(); s.generate_batch(prompts, max_tokens=8, ignore_eos=True); a = time.perf_counter() - t0
        t0 = time.perf_counter(); s.generate_batch(prompts, max_tokens=40, ignore_eos=True); b = time.perf_counter() - t0
        out.append((b - a) / 32 * 1000)
    toks = [r.tokens for r in s.generate_batch(prompts, max_tokens=12, ignore_eos=True)]
print(json.dumps({"ms": out, "tokens": hashlib.sha256(str(toks).encode()).hexdigest()[:16]}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="fit-llama-f32")
    ap.add_argument("--rows", default="16", help="comma-separated batch sizes")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--confs",
        help="comma-separated configurations to run (default: all); NAME=VAR=VALUE[;VAR=VALUE] adds one "
        "(the default settings plus those variables)",
    )
    args = ap.parse_args()
    confs = CONFS
    if args.confs:
        confs = {}
        for c in args.confs.split(","):
            name, _, env = c.partition("=")
            confs[name] = dict(kv.split("=", 1) for kv in env.split(";")) if env else CONFS[name]
    for rows in [int(r) for r in args.rows.split(",")]:
        res: dict[str, list[float]] = {k: [] for k in confs}
        toks: dict[str, str] = {}
        for _ in range(args.rounds):
            for name, env in confs.items():
                e = {k: v for k, v in os.environ.items() if k not in SWITCHES}
                e.update(env)
                p = subprocess.run(
                    [sys.executable, "-c", CHILD, args.model, str(rows), str(ROOT)],
                    env=e,
                    capture_output=True,
                    text=True,
                )
                if p.returncode:
                    sys.exit(f"{name}: {p.stderr[-2000:]}")
                r = json.loads(p.stdout.strip().splitlines()[-1])
                res[name] += r["ms"]
                toks.setdefault(name, r["tokens"])
        print(f"{args.model}, {rows} rows:")
        for name, v in res.items():
            print(f"  {name}: median {statistics.median(v):.1f} ms/step {[round(x, 1) for x in v]}")
        print("  tokens identical:", len(set(toks.values())) == 1, "| load", os.getloadavg())


if __name__ == "__main__":
    main()
