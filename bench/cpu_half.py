"""bfloat16 (or float16) dense models on the CPU: mlxrs with its host op for 16-bit weights
(models/layers.rs `host_half`, the default), mlxrs through MLX's half-precision matmul
(`MLXRS_CPU_HALF=0`), and mlx-lm, alternating in one process after the same warm-up, on
tests/tinymodels.py's fit-llama-bf16 (hidden 1024, 8 layers, bfloat16 safetensors).

    python bench/cpu_half.py --prompt 512 --gen 64 --rounds 2
    python bench/cpu_half.py --quantized 4 --no-mlx-lm --rounds 2   # an MLX 4-bit model with bfloat16
                                                                   # activations (bench/cpu_quantized.py's)

Prints prompt and generation tokens/s of each (median of the rounds) and the ratios.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def ours(d: Path, ids: list[int], gen: int, host: bool) -> tuple[float, float]:
    import mlxrs

    if host:
        os.environ.pop("MLXRS_CPU_HALF", None)
    else:
        os.environ["MLXRS_CPU_HALF"] = "0"
    with mlxrs.Session(d, prompt_cache_bytes=0) as s:
        c = s.generate(ids, max_tokens=gen, temperature=0.0, ignore_eos=True)
    return float(c.timings.prompt_tps), float(c.timings.generation_tps)


def theirs(model, tok, ids: list[int], gen: int) -> tuple[float, float]:
    from mlx_lm.generate import stream_generate

    r = None
    for r in stream_generate(model, tok, ids, max_tokens=gen):
        pass
    assert r is not None
    return float(r.prompt_tps), float(r.generation_tps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="fit-llama-bf16")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip-mlx", action="store_true", help="leave out mlxrs through MLX's half matmul (slow)")
    ap.add_argument("--quantized", type=int, default=0, help="bits: bench/cpu_quantized.py's MLX-quantized model")
    ap.add_argument("--dir", default="/tmp/mlxrs-bench-cpu-half", help="where --quantized writes its model")
    ap.add_argument("--no-mlx-lm", action="store_true", help="leave out mlx-lm (MLX's x86 quantized kernel is slow)")
    args = ap.parse_args()
    import mlxrs  # first: its BLAS ahead of libmlx (mlxrs/__init__.py)
    from mlx_lm import load

    from tinymodels import make_fit_model

    if args.quantized:
        sys.path.insert(0, str(ROOT / "bench"))
        from cpu_quantized import make_model

        name = f"llama-q{args.quantized}-bf16"
        d = make_model(Path(args.dir) / name, args.quantized)
    else:
        name = args.model
        d = make_fit_model(args.model)
    model, tok = (None, None) if args.no_mlx_lm else load(str(d))
    ids = [random.Random(args.prompt).randrange(10, 2048) for _ in range(args.prompt)]
    ours(d, ids[:32], 4, True)  # warm-up
    if model is not None:
        theirs(model, tok, ids[:32], 4)
    print(f"mlxrs {mlxrs.__version__}, {name}, prompt {args.prompt}, generate {args.gen}, CPU", flush=True)
    kinds = ["host"] + ([] if args.skip_mlx else ["mlx"]) + ([] if args.no_mlx_lm else ["mlx-lm"])
    res: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    for _ in range(args.rounds):
        res["host"].append(ours(d, ids, args.gen, True))
        if "mlx" in res:
            res["mlx"].append(ours(d, ids, args.gen, False))
        if "mlx-lm" in res:
            res["mlx-lm"].append(theirs(model, tok, ids, args.gen))
    med = {k: (statistics.median(p for p, _ in v), statistics.median(g for _, g in v)) for k, v in res.items()}
    for k, (p, g) in med.items():
        print(f"{k:7s} prefill {p:8.1f} tok/s   decode {g:7.1f} tok/s", flush=True)
    hp, hg = med["host"]
    for other in ("mlx", "mlx-lm"):
        if other in med:
            op, og = med[other]
            print(f"mlxrs / {other}: prefill {hp / op:.2f}x, decode {hg / og:.2f}x", flush=True)


if __name__ == "__main__":
    main()
