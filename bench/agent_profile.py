"""Where an agent turn's time goes, in-process: the bench_serve.py agent conversation (history growing
from --start to --end tokens over --turns turns) through `mlxrs.Session`, each turn split into chat
template rendering, tokenizing, and `generate(max_tokens=1)` (its wall time and the engine's own
prompt time), prefix cache on.

    python bench/agent_profile.py --model DIR --turns 10 --start 2000 --end 8000
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--start", type=int, default=2000)
    ap.add_argument("--end", type=int, default=8000)
    ap.add_argument("--out")
    a = ap.parse_args()
    import mlxrs
    from bench_serve import FILLER, _ensure_template

    d = Path(a.model)
    _ensure_template(d)
    rows = []
    with mlxrs.Session(d) as s:
        system = (FILLER * (1 + a.start // len(FILLER)))[: a.start]
        step = max(1, (a.end - a.start) // max(1, a.turns - 1))
        msgs = [{"role": "system", "content": system}]
        for t in range(a.turns):
            msgs.append({"role": "user", "content": f"Turn {t}. " + (FILLER * (1 + step // len(FILLER)))[:step]})
            t0 = time.perf_counter()
            text = s.apply_chat_template(msgs, add_generation_prompt=True)
            t1 = time.perf_counter()
            ids = s.tokenize(text, add_special_tokens=False)
            t2 = time.perf_counter()
            r = s.generate(ids, max_tokens=1, temperature=0.0)
            t3 = time.perf_counter()
            row = {
                "prompt_tokens": len(ids),
                "cached_tokens": r.usage.cached_tokens,
                "render_ms": 1e3 * (t1 - t0),
                "tokenize_ms": 1e3 * (t2 - t1),
                "generate_ms": 1e3 * (t3 - t2),
                "engine_prompt_ms": 1e3 * r.timings.prompt_seconds,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            msgs.append({"role": "assistant", "content": f"Noted, item {t}: the owner and the date are set."})
    later = rows[1:] or rows
    summary = {
        k: statistics.mean(r[k] for r in later) for k in ("render_ms", "tokenize_ms", "generate_ms", "engine_prompt_ms")
    }
    print("mean after turn 1", json.dumps(summary), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"rows": rows, "mean_after_first": summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
