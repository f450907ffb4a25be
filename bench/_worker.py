"""One engine in its own process, driven by bench_generate.py over stdin/stdout (JSON lines).

    python bench/_worker.py --engine mlxrs|mlxlm --model DIR

The BLAS is whatever this process loads: mlxrs preloads OpenBLAS itself; mlx-lm uses the reference
BLAS bundled with the mlx-cpu wheel unless the driver started it with LD_PRELOAD=<openblas>.

Both engines are timed the same way, from outside: t0 just before the generation is started (the
prompt ids are a Python list at that point), t_first when the first generated token id is in Python's
hands, t_last when the last one is. prefill = t_first - t0 (that is the prompt plus the first decode
step, like Completion.timings.prompt_seconds), decode = t_last - t_first over the n - 1 later tokens.
Greedy sampling, EOS ignored, so both produce exactly `max_tokens` tokens.

Requests: {"prompt": [ids], "max_tokens": n}. Replies: {"tokens": [...], "t_prefill": s, "t_decode": s,
"internal": {...} (mlxrs only: its own Completion.timings)}. The first line written is a "ready" record.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable


def loaded_blas() -> list[str]:
    libs: set[str] = set()
    with open("/proc/self/maps") as f:
        for line in f:
            p = line.split()[-1]
            if "blas" in os.path.basename(p).lower():
                libs.add(p)
    return sorted(libs)


def mlxrs_engine(model: str) -> Callable[[list[int], int], dict[str, Any]]:
    import mlxrs

    s = mlxrs.Session(model)

    def run(prompt: list[int], n: int) -> dict[str, Any]:
        toks: list[int] = []
        internal: dict[str, Any] = {}
        t_first = t_last = 0.0
        t0 = time.perf_counter()
        for ch in s.stream(prompt, max_tokens=n, temperature=0.0, ignore_eos=True):
            if ch.token is not None:
                t_last = time.perf_counter()
                if not toks:
                    t_first = t_last
                toks.append(ch.token)
            if ch.timings is not None:
                internal = {
                    "prompt_seconds": ch.timings.prompt_seconds,
                    "generation_seconds": ch.timings.generation_seconds,
                }
        return {"tokens": toks, "t_prefill": t_first - t0, "t_decode": t_last - t_first, "internal": internal}

    return run


def mlxlm_engine(model_dir: str) -> Callable[[list[int], int], dict[str, Any]]:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, _tok = load(model_dir)

    def run(prompt: list[int], n: int) -> dict[str, Any]:
        toks: list[int] = []
        t_first = t_last = 0.0
        t0 = time.perf_counter()
        p = mx.array(prompt, dtype=mx.int32)
        for tok, _lp in generate_step(p, model, max_tokens=n):  # greedy (argmax) by default
            t_last = time.perf_counter()
            if not toks:
                t_first = t_last
            toks.append(int(tok))
        mx.synchronize()  # generate_step queues one step past the last token; finish it untimed
        return {"tokens": toks, "t_prefill": t_first - t0, "t_decode": t_last - t_first, "internal": {}}

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["mlxrs", "mlxlm"], required=True)
    ap.add_argument("--model", required=True)
    a = ap.parse_args()
    out = sys.stdout
    sys.stdout = sys.stderr  # keep library chatter off the protocol channel
    t = time.perf_counter()
    run = mlxrs_engine(a.model) if a.engine == "mlxrs" else mlxlm_engine(a.model)
    ready = {"ready": True, "load_s": time.perf_counter() - t, "pid": os.getpid(), "blas": loaded_blas()}
    if a.engine == "mlxrs":
        import mlxrs

        ready["blas_reported"] = mlxrs.runtime_info().get("blas")
    out.write(json.dumps(ready) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        try:
            c0 = time.process_time()
            res = run(req["prompt"], int(req["max_tokens"]))
            res["cpu_s"] = time.process_time() - c0  # every thread of this process (BLAS, MLX, engine)
        except Exception as e:  # report, keep serving
            res = {"error": f"{type(e).__name__}: {e}"}
        res["blas"] = loaded_blas()
        out.write(json.dumps(res) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
