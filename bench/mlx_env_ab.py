"""MLX's own run-time settings (environment variables read once when MLX starts) against decode speed:
each setting in its own process, mlxrs and mlx-lm measured side by side in that process, the settings
alternated round by round on the same random-weight models (bench_device.py's shapes).

    python bench/mlx_env_ab.py --models 1b_bf16,8b_q4 --env "" --env MLX_MAX_OPS_PER_BUFFER=200 --rounds 2

MLX 0.32.4's CUDA backend reads, among others, MLX_MAX_OPS_PER_BUFFER / MLX_MAX_MB_PER_BUFFER (how many
ops one command buffer -- one CUDA graph -- takes before it is committed), MLX_USE_CUDA_GRAPHS and
MLX_CUDA_GRAPH_CACHE_SIZE (`strings libmlx.so`). "" is MLX's defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]


def child(model: Path, prompt_len: int, gen: int, runs: int) -> dict:
    import mlx.core as mx
    from mlx_lm import load

    from bench_device import open_session, run_mlxlm, run_mlxrs

    prompt = [int(x) for x in mx.random.randint(0, 1000, (prompt_len,), key=mx.random.key(0)).tolist()]
    sess = open_session(model)
    ref, _ = load(str(model))
    for _ in range(2):  # warm-up: kernels compiled, graphs cached
        run_mlxrs(sess, prompt, 16)
        run_mlxlm(ref, prompt, 16)
    ours, theirs = [], []
    for _ in range(runs):
        ours.append(run_mlxrs(sess, prompt, gen)[1])
        theirs.append(run_mlxlm(ref, prompt, gen)[1])
    return {"mlxrs_tps": statistics.median(ours), "mlxlm_tps": statistics.median(theirs), "runs": [ours, theirs]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="1b_bf16")
    ap.add_argument("--env", action="append", default=[], help='"NAME=VALUE[,NAME=VALUE]"; "" for the defaults')
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--dir")
    ap.add_argument("--out")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(Path(a.child), a.prompt, a.gen, a.runs)), flush=True)
        return 0
    from bench_device import BITS, make_model

    envs = a.env or [""]
    out: dict = {"args": vars(a), "models": {}}
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        for name in a.models.split(","):
            shape, kind = name.split("_")
            d, _ = make_model(Path(tmp) / name, shape, BITS[kind])
            rows: dict[str, list[dict]] = {e: [] for e in envs}
            for r in range(a.rounds):
                for e in envs if r % 2 == 0 else list(reversed(envs)):
                    env = dict(os.environ)
                    env.update(dict(kv.split("=", 1) for kv in e.split(",") if kv))
                    t0 = time.perf_counter()
                    p = subprocess.run(
                        [sys.executable, __file__, "--child", str(d), "--prompt", str(a.prompt), "--gen", str(a.gen)]
                        + ["--runs", str(a.runs)],
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=900,
                    )
                    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
                    res = json.loads(line[7:]) if line else {"error": p.stderr[-2000:]}
                    res["wall_s"] = time.perf_counter() - t0
                    rows[e].append(res)
                    print(name, repr(e), json.dumps({k: v for k, v in res.items() if k != "runs"}), flush=True)
            summary = {}
            for e, rs in rows.items():
                ok = [x for x in rs if "mlxrs_tps" in x]
                if ok:
                    summary[e or "(defaults)"] = {
                        "mlxrs_tps": statistics.median(x["mlxrs_tps"] for x in ok),
                        "mlxlm_tps": statistics.median(x["mlxlm_tps"] for x in ok),
                    }
            out["models"][name] = {"summary": summary, "rows": rows}
            print(name, json.dumps(summary), flush=True)
            for f in d.glob("*.safetensors"):
                f.unlink()
            if a.out:
                Path(a.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
