"""Prefill into a quantized KV cache (`kv_bits`) on the CPU: mlxrs with its float32 dequantization of the
cache for each prefill chunk's attention (models/layers.rs `dequant_kv`, the default), mlxrs with MLX's
quantized matmul there (`MLXRS_DEQUANT_PREFILL_ROWS=0`), mlxrs without a quantized cache, and mlx-lm with
the same cache (`kv_bits`, quantized from the first token), alternating in one process after the same
warm-up, on tests/tinymodels.py's fit-llama-f32 (hidden 1024, 8 layers, 8 KV heads of 128, float32).

    python bench/cpu_kv_prefill.py --prompt 3000 --rounds 2

Prints prompt tokens/s of each (median of the rounds) and the ratios.
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


def ours(d: Path, ids: list[int], kv: int | None, dequant: bool) -> float:
    import mlxrs

    if dequant:
        os.environ.pop("MLXRS_DEQUANT_PREFILL_ROWS", None)
    else:
        os.environ["MLXRS_DEQUANT_PREFILL_ROWS"] = "0"
    with mlxrs.Session(d, kv_bits=kv, prompt_cache_bytes=0) as s:
        c = s.generate(ids, max_tokens=1, temperature=0.0)
    return float(c.timings.prompt_tps)


def theirs(model, tok, ids: list[int], kv: int) -> float:
    from mlx_lm.generate import stream_generate

    r = None
    for r in stream_generate(model, tok, ids, max_tokens=1, kv_bits=kv, kv_group_size=64, quantized_kv_start=0):
        pass
    assert r is not None
    return float(r.prompt_tps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=3000)
    ap.add_argument("--kv-bits", default="8,4")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    import mlxrs  # first: its BLAS ahead of libmlx (mlxrs/__init__.py)
    from mlx_lm import load

    from tinymodels import make_fit_model

    d = make_fit_model("fit-llama-f32")
    model, tok = load(str(d))
    ids = [random.Random(args.prompt).randrange(10, 2048) for _ in range(args.prompt)]
    ours(d, ids[:64], 8, True)  # warm-up
    theirs(model, tok, ids[:64], 8)
    print(f"mlxrs {mlxrs.__version__}, prompt {args.prompt} tokens, float32 model on the CPU", flush=True)
    for kv in [int(b) for b in args.kv_bits.split(",")]:
        res: dict[str, list[float]] = {"dequant": [], "mlx": [], "none": [], "mlx-lm": []}
        for _ in range(args.rounds):
            res["dequant"].append(ours(d, ids, kv, True))
            res["mlx"].append(ours(d, ids, kv, False))
            res["none"].append(ours(d, ids, None, True))
            res["mlx-lm"].append(theirs(model, tok, ids, kv))
        m = {k: statistics.median(v) for k, v in res.items()}
        print(
            f"kv_bits {kv}: prefill tok/s mlxrs {m['dequant']:.1f} (MLX's quantized matmul {m['mlx']:.1f}, "
            f"no quantized cache {m['none']:.1f}), mlx-lm {m['mlx-lm']:.1f}; mlxrs / mlx-lm "
            f"{m['dequant'] / m['mlx-lm']:.2f}x, dequantized / quantized matmul {m['dequant'] / m['mlx']:.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
