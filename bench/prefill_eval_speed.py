"""The prefill evaluated between decoder layers (MLXRS_PREFILL_EVAL_LAYERS: `1`, every layer, the GPU
default; `0`, the whole chunk as one graph; `ka`, every k layers with one stage queued ahead) on
random-weight Llama-shaped bf16 models (bench_device.py's 1B shape; `3b`: 28 layers, hidden 3072),
alternating the modes in one process after the same warm-up: prefill and decode speed, and MLX's
peak memory over a prefill + 2 tokens next to the plan (`fused_attention` as the planner's default
on this device).

    python bench/prefill_eval_speed.py [--shapes 1b 3b] [--prompts 512 4000] [--modes 1 0] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
ENV = "MLXRS_PREFILL_EVAL_LAYERS"
SHAPES = {
    "1b": None,  # bench_device.L1B
    "3b": dict(
        hidden_size=3072,
        num_hidden_layers=28,
        intermediate_size=8192,
        num_attention_heads=24,
        num_key_value_heads=8,
        vocab_size=32000,
        head_dim=128,
    ),
}


def once(sess, prompt: list[int], gen: int, mode: str) -> dict:
    os.environ[ENV] = mode
    t0 = time.perf_counter()
    first = None
    n = 0
    for ch in sess.stream(prompt, max_tokens=gen, ignore_eos=True):
        if ch.token is not None:
            if first is None:
                first = time.perf_counter()
            n += 1
    t1 = time.perf_counter()
    c = sess.generate(prompt, max_tokens=2, temperature=0)  # the peak of a prefill + 2 tokens alone
    return {
        "prefill_tps": len(prompt) / (first - t0),
        "decode_tps": (n - 1) / (t1 - first),
        "peak": c.timings.peak_memory,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["1b"])
    ap.add_argument("--prompts", type=int, nargs="*", default=[512, 4000])
    ap.add_argument("--modes", nargs="*", default=["1", "0"])
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    import mlxrs
    from mlxrs import _native

    import bench_device

    info = mlxrs.runtime_info()
    out: dict = {"runtime": info, "rows": []}
    for shape in args.shapes:
        if SHAPES[shape] is not None:
            bench_device.L1B = SHAPES[shape]
        with tempfile.TemporaryDirectory() as tmp:
            d = bench_device.make_model(Path(tmp) / f"llama{shape}_bf16", None)
            sess = mlxrs.Session(d)
            for n in args.prompts:
                prompt = [random.Random(n).randrange(10, 30000) for _ in range(n)]
                for mode in args.modes:  # warm-up (kernel JIT) for all
                    once(sess, prompt, 8, mode)
                runs: dict[str, list[dict]] = {m: [] for m in args.modes}
                for _ in range(args.runs):
                    for mode in args.modes:
                        runs[mode].append(once(sess, prompt, args.gen, mode))
                plans = {}
                for fused in (None, False, True):  # the device's default, materialized, fused
                    p = json.loads(_native.plan(str(d), n + 2, None, None, fused_attention=fused, device_bytes=1 << 40))
                    plans[str(fused)] = p["weightsBytes"] + p["kvBytes"] + p["transientBytes"]
                planned = plans["None"]
                row: dict = {"shape": shape, "n": n, "planned": planned, "plans": plans, "modes": {}}
                line = f"{shape} n={n}: planned {planned / 1e6:.1f} MB"
                for mode, v in runs.items():
                    r = {
                        "prefill_tps": statistics.median(x["prefill_tps"] for x in v),
                        "decode_tps": statistics.median(x["decode_tps"] for x in v),
                        "peak_max": max(x["peak"] for x in v),
                        "runs": v,
                    }
                    row["modes"][mode] = r
                    line += (
                        f"; [{mode}] peak {r['peak_max'] / 1e6:.1f} MB ({planned / r['peak_max']:.3f}), "
                        f"prefill {r['prefill_tps']:.0f} tok/s, decode {r['decode_tps']:.1f}"
                    )
                out["rows"].append(row)
                print(line, flush=True)
            sess.close()
    os.environ.pop(ENV, None)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
