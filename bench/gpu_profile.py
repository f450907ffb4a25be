"""Where a decode step's GPU time goes, by kernel (issue #11): Nsight Compute over a window of decode
steps, for mlxrs and for mlx-lm on the same weights (bench/device_profile.sh runs both).

On the GPU machine (bench/device_run.sh's site on PYTHONPATH), per engine:

    ncu --profile-from-start off --metrics gpu__time_duration.sum --clock-control none --csv \
        --log-file /tmp/k_mlxrs.csv python3 bench/gpu_profile.py run --engine mlxrs --gen 5 MODEL_DIR
    python3 bench/gpu_profile.py report --steps 4 /tmp/k_mlxrs.csv

`run` warms the engine up (two generations of `--gen` tokens; `--gen` 5 is a 4-token prefill and four
decode steps), times decode without the profiler (64 more tokens' time over 64), then opens the profiler's window (the driver's
cuProfilerStart) around one generation of the same length. Nsight Compute runs each kernel of the
window alone (serialised, caches flushed between kernels as by default, clocks as the GPU sets them), so
its durations are each kernel's own GPU time: their sum per step against the unprofiled step time says
whether a step is GPU- or host-bound. `--batch N` profiles N rows decoded together instead
(`generate_batch` / mlx-lm's `batch_generate`; a batch's prefill kernels fall in the window too).
`report` prints per step the kernel count, the kernels' summed
time and the kernels grouped by name (time per step, count per step), largest first; `--json PATH`
writes the same.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

PROMPT = [1, 2, 3, 4]


def _profiler(on: bool) -> None:
    cuda = ctypes.CDLL("libcuda.so.1")
    rc = (cuda.cuProfilerStart if on else cuda.cuProfilerStop)()
    if rc != 0:
        print(f"cuProfiler{'Start' if on else 'Stop'} returned {rc}", file=sys.stderr)


def run(args: argparse.Namespace) -> None:
    import mlx.core as mx

    # --batch N: N rows decoded together (distinct prompts, so no prefix sharing): mlxrs's
    # generate_batch against mlx-lm's batch_generate
    prompts = [[*PROMPT, 5 + i] for i in range(args.batch)]
    if args.engine == "mlxrs":
        import mlxrs

        sess = mlxrs.Session(args.model, prompt_cache_bytes=0)

        def gen(n: int) -> int:
            if args.batch:
                outs = sess.generate_batch(prompts, max_tokens=n, ignore_eos=True, temperature=0.0)
                return sum(len(o.tokens) for o in outs)
            return len(sess.generate(PROMPT, max_tokens=n, ignore_eos=True, temperature=0.0).tokens)
    else:
        from mlx_lm import load
        from mlx_lm.generate import batch_generate, generate_step

        model, tok = load(args.model)

        def gen(n: int) -> int:
            if args.batch:
                r = batch_generate(model, tok, prompts, max_tokens=n, return_token_ids=True)
                return sum(len(x) for x in r.token_ids)
            return sum(1 for _ in generate_step(mx.array(PROMPT), model, max_tokens=n))

    gen(args.gen)
    gen(args.gen)
    mx.synchronize()

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        gen(n)
        mx.synchronize()
        return time.perf_counter() - t0

    # the unprofiled decode step: 64 more tokens' time, over 64 (median of three)
    step_ms = sorted(1e3 * (timed(args.gen + 64) - timed(args.gen)) / 64 for _ in range(3))[1]
    _profiler(True)
    t0 = time.perf_counter()
    n = gen(args.gen)
    mx.synchronize()
    dt = time.perf_counter() - t0
    _profiler(False)
    print(json.dumps({"engine": args.engine, "decode_step_ms_unprofiled": step_ms, "tokens": n, "profiled_s": dt}))


def _short(name: str) -> str:
    """A kernel's name without template arguments or parameter lists (groups instantiations)."""
    name = re.sub(r"\(.*$", "", name)
    depth, out = 0, []
    for ch in name:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    s = "".join(out).strip()
    return s.split(" ")[-1][:80] or name[:80]


def ncu_kernel_times(log: str | Path) -> list[tuple[str, float]]:
    """(kernel name, µs) of each kernel launch in an `ncu --metrics gpu__time_duration.sum --csv
    --log-file LOG` log, in launch order (bench/qmv_variants.py reads its logs with this too)."""
    lines = Path(log).read_text().splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    kern: list[tuple[str, float]] = []
    for r in csv.DictReader(lines[head:]):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = r.get("Metric Unit", "")
        v = float(r["Metric Value"].replace(",", ""))
        us = v / 1e3 if unit in ("nsecond", "ns") else v * 1e3 if unit in ("msecond", "ms") else v
        kern.append((r["Kernel Name"], us))
    return kern


def report(args: argparse.Namespace) -> None:
    kern = ncu_kernel_times(args.log)
    if not kern:
        raise SystemExit("no kernels in the window")
    steps = args.steps
    by: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, us in kern:
        by[_short(name)][0] += us
        by[_short(name)][1] += 1
    out = {
        "kernels_per_step": len(kern) / steps,
        "kernel_ms_per_step": sum(us for _, us in kern) / 1e3 / steps,
        "by_kernel": [
            {"kernel": k, "us_per_step": v[0] / steps, "per_step": v[1] / steps, "us_each": v[0] / v[1]}
            for k, v in sorted(by.items(), key=lambda kv: -kv[1][0])
        ],
    }
    print(
        f"{Path(args.log).name}: {out['kernels_per_step']:.1f} kernels/step, their GPU time"
        f" {out['kernel_ms_per_step']:.3f} ms/step"
    )
    for e in out["by_kernel"][: args.top]:
        print(
            f"  {e['us_per_step']:9.1f} us/step  {e['per_step']:6.1f}/step  {e['us_each']:7.2f} us each  {e['kernel']}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("model")
    r.add_argument("--engine", choices=["mlxrs", "mlx-lm"], default="mlxrs")
    r.add_argument("--gen", type=int, default=5)
    r.add_argument("--batch", type=int, default=0, help="rows decoded together (0: one generation)")
    p = sub.add_parser("report")
    p.add_argument("log", help="ncu --csv --log-file output")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--json")
    a = ap.parse_args()
    run(a) if a.cmd == "run" else report(a)


if __name__ == "__main__":
    main()
