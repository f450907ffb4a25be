"""Measure what the memory planner (crates/mlxrs-core/src/plan.rs) is calibrated against: MLX's peak
memory over one generation of 2 tokens after a prompt of n random tokens, each in a fresh process,
next to the plan's weights + KV + transient at n + 2 tokens (this backend's plan, and one layer in flight with
and without fused attention).

    python bench/fit_calibration.py [--out results.json] [--cases NAME:N[:KVBITS] ...]

The models are tests/test_fit.py's (random weights, written once under tests/.models). The calibration of
plan.rs's TRANSIENT_SLACK comes from this script on the CPU, its GPU_LAYERS_IN_FLIGHT from it
(and bench/prefill_eval_speed.py) on an H200 (bench/device_fit.sh, bench/RESULTS-fit.md). The measuring processes inherit the environment:
MLXRS_PREFILL_EVAL_LAYERS=0 measures the prefill evaluated a whole chunk at a time (the GPU default
before per-layer evaluation); each row records the setting.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

CASES = [
    "fit-llama-f32:512",
    "fit-llama-f32:1000",
    "fit-llama-f32:2048",
    "fit-llama-f32:3000",
    "fit-llama-f32:4000",
    "fit-llama-f32:3000:8",
    "fit-llama-f32:3000:4",
    "fit-llama-bf16:512",
    "fit-llama-bf16:2048",
    "fit-llama-bf16:4000",
    "fit-gemma3-f32:1000",
    "fit-gemma3-f32:2048",
    "fit-gemma3-f32:4000",
    "fit-qwen3-bf16:512",
    "fit-qwen3-bf16:2048",
    "fit-qwen3-bf16:4000",
]

MEASURE = """
import json, random, sys
import mlxrs
d, n, kv, vocab = sys.argv[1], int(sys.argv[2]), (None if sys.argv[3] == "none" else int(sys.argv[3])), int(sys.argv[4])
s = mlxrs.Session(d, kv_bits=kv)
ids = [random.Random(n).randrange(10, vocab) for _ in range(n)]
c = s.generate(ids, max_tokens=2, temperature=0)
print(json.dumps({"peak": c.timings.peak_memory, "prompt_seconds": c.timings.prompt_seconds}))
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--cases", nargs="*", default=CASES)
    args = ap.parse_args()

    import mlxrs
    from mlxrs import _native

    info = mlxrs.runtime_info()  # loads the runtime (and the BLAS preload) before mlx is imported
    from tinymodels import FIT_MODELS, make_fit_model

    print(f"backend {info['backend']} ({info['device']}), device memory {_native.device_memory()}", flush=True)
    rows: list[dict[str, Any]] = []
    for case in args.cases:
        name, n_s, *kv_s = case.split(":")
        n, kv = int(n_s), (int(kv_s[0]) if kv_s else None)
        shape = FIT_MODELS[name][2]
        d = make_fit_model(name)
        r = subprocess.run(
            [sys.executable, "-c", MEASURE, str(d), str(n), str(kv or "none"), str(shape["vocab"])],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if r.returncode != 0:
            print(f"{case}: failed\n{r.stderr[-2000:]}", flush=True)
            continue
        m = json.loads(r.stdout)
        row: dict[str, Any] = {
            "model": name,
            "n": n,
            "kv_bits": kv,
            "prefill_eval_layers": os.environ.get("MLXRS_PREFILL_EVAL_LAYERS", "auto"),
            **m,
        }
        # the planner's default for this machine's backend, then materialized / fused attention with
        # one layer in flight (the CPU's rule, and the GPU's before the staged prefill)
        for key, kw in (
            ("plan", {}),
            ("unfused", dict(backend="cpu", fused_attention=False)),
            ("fused", dict(backend="cpu", fused_attention=True)),
        ):
            p = json.loads(_native.plan(str(d), n + 2, kv, None, device_bytes=1 << 40, **kw))
            est = p["weightsBytes"] + p["kvBytes"] + p["transientBytes"]
            row[key] = {"planned": est, "ratio": est / m["peak"], **p}
        rows.append(row)
        print(
            f"{name:16s} n={n:5d} kv={kv}: measured {m['peak'] / 1e6:8.1f} MB; planned {row['plan']['planned'] / 1e6:8.1f} "
            f"({row['plan']['ratio']:.3f}); one layer: unfused {row['unfused']['planned'] / 1e6:8.1f} "
            f"({row['unfused']['ratio']:.3f}), fused {row['fused']['planned'] / 1e6:8.1f} ({row['fused']['ratio']:.3f}); "
            f"prefill {m['prompt_seconds']:.2f}s",
            flush=True,
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"runtime": info, "rows": rows}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
