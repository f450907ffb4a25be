"""Where one CPU decode step of an imported model goes: the transformer body against the output head.

    python bench/profile_cpu_decode.py MODEL_DIR [--steps 32]

Runs mlx-lm on MODEL_DIR under the BLAS path mlxrs runs on (re-executes itself with LD_PRELOAD=<mlxrs's
gemv router>:<its OpenBLAS>, as bench_generate.py's 'mlx-lm openblas+gemv' engine), after a 64-token
prompt: the median ms of a whole decode step (body + head + argmax), of the body alone
(`model.model(...)`, same cache position), and of the head alone on the body's output, with the bytes
each reads, and mlxrs's own decode ms/token on the same directory for reference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def preload() -> None:
    if os.environ.get("_PROFILE_CHILD"):
        return
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import mlxrs; i = mlxrs.runtime_info(); print(i.get('blas_gemv') or ''); print(i.get('blas') or '')",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    env = dict(os.environ, _PROFILE_CHILD="1", LD_PRELOAD=":".join(out))
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def median_ms(f, n: int) -> float:
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return 1000 * statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=32)
    a = ap.parse_args()
    preload()
    import mlx.core as mx
    from mlx_lm import load
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(a.model)
    cfg = json.loads((Path(a.model) / "config.json").read_text())
    vocab = cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]
    prompt = mx.array([[(7919 * i) % (vocab - 4) + 4 for i in range(64)]], dtype=mx.int32)
    tok = mx.array([[5]], dtype=mx.int32)

    def fresh() -> list:
        c = make_prompt_cache(model)
        mx.eval(model(prompt, cache=c))
        return c

    def step(c: list) -> None:  # what a greedy decode step evaluates
        mx.eval(mx.argmax(model(tok, cache=c)[:, -1, :], axis=-1))

    def body(c: list) -> None:
        mx.eval(model.model(tok, cache=c))

    h = model.model(tok, cache=fresh())
    mx.eval(h)
    tied = getattr(model, "tie_word_embeddings", False)
    head = model.model.embed_tokens.as_linear if tied else model.lm_head
    res = {}
    for name, f in (("step", step), ("body", body)):
        c = fresh()
        f(c)  # warm
        res[name] = median_ms(lambda: f(c), a.steps)
    res["head"] = median_ms(lambda: mx.eval(mx.argmax(head(h[:, -1, :]), axis=-1)), a.steps)
    emb = model.model.embed_tokens.weight if tied else model.lm_head.weight
    head_bytes = emb.nbytes
    all_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    print(
        f"{a.model}: {emb.dtype}, parameters {all_bytes / 1e6:.0f} MB, output head {head_bytes / 1e6:.0f} MB; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print(
        f"  decode step {res['step']:.1f} ms  = body {res['body']:.1f} ms ({(all_bytes - head_bytes) / 1e6:.0f} MB, "
        f"{(all_bytes - head_bytes) / res['body'] / 1e6:.1f} GB/s) + head {res['head']:.1f} ms "
        f"({head_bytes / res['head'] / 1e6:.1f} GB/s); head share {res['head'] / res['step']:.0%}"
    )


if __name__ == "__main__":
    main()
