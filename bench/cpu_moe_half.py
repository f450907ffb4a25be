"""A bfloat16 mixture of experts on the CPU. mlx-lm cannot run it there (MLX's CPU gather_mm has only
float32: "[GatherMM::eval] Currently only supports float32"), so its figure is on the same model
converted to float32 (twice the memory: what a mlx-lm user on a CPU would have to do); mlxrs runs the
bfloat16 model (its experts through the host gather op, handle/half.rs `host_half_gather_matmul`) and
the float32 copy too. Alternating in one process after the same warm-up; tests/tinymodels.py's
qwen3_moe (8 experts of width 128, 2 a token, one dense layer) at hidden 1024, 8 layers.

    python bench/cpu_moe_half.py --prompt 512 --gen 64 --rounds 2

Prints prompt and generation tokens/s of each (median of the rounds) and the ratios.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

SHAPE = dict(hidden=1024, layers=8, heads=8, kv_heads=4, head_dim=128, inter=2048, vocab=2048)


def ours(d: Path, ids: list[int], gen: int) -> tuple[float, float]:
    import mlxrs

    with mlxrs.Session(d, prompt_cache_bytes=0) as s:
        c = s.generate(ids, max_tokens=gen, temperature=0.0, ignore_eos=True)
    return float(c.timings.prompt_tps), float(c.timings.generation_tps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    import mlxrs  # first: its BLAS ahead of libmlx (mlxrs/__init__.py)
    from cpu_half import theirs
    from mlx_lm import load

    from tinymodels import make_model

    bf16 = make_model("bench-qwen3_moe-bf16", "qwen3_moe", dtype="bfloat16", **SHAPE)
    f32 = make_model("bench-qwen3_moe-f32", "qwen3_moe", dtype="float32", **SHAPE)
    model, tok = load(str(f32))
    ids = [random.Random(args.prompt).randrange(10, 2048) for _ in range(args.prompt)]
    ours(bf16, ids[:32], 4)  # warm-up
    ours(f32, ids[:32], 4)
    theirs(model, tok, ids[:32], 4)
    print(f"mlxrs {mlxrs.__version__}, qwen3_moe {SHAPE}, prompt {args.prompt}, generate {args.gen}, CPU", flush=True)
    runs = {"mlxrs bf16": lambda: ours(bf16, ids, args.gen), "mlxrs f32": lambda: ours(f32, ids, args.gen)}
    runs["mlx-lm f32"] = lambda: theirs(model, tok, ids, args.gen)
    res: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
    for _ in range(args.rounds):
        for k, f in runs.items():
            res[k].append(f())
    med = {k: (statistics.median(p for p, _ in v), statistics.median(g for _, g in v)) for k, v in res.items()}
    for k, (p, g) in med.items():
        print(f"{k:11s} prefill {p:8.1f} tok/s   decode {g:7.1f} tok/s", flush=True)
    hp, hg = med["mlxrs bf16"]
    op, og = med["mlx-lm f32"]
    print(f"mlxrs bf16 / mlx-lm f32: prefill {hp / op:.2f}x, decode {hg / og:.2f}x", flush=True)


if __name__ == "__main__":
    main()
