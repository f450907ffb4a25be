"""MLX-quantized models (mlx-lm's affine 4-bit / 8-bit, bfloat16 scales as mlx-community ships them) on
the CPU backend: mlxrs with its packed kernel (crates/mlxrs-core/src/handle/packed.rs) and its float32
dequantization of prefill chunks (the defaults), mlxrs with MLX's own quantized matmul for both
(`MLXRS_CPU_HOST_BLOCKS=0 MLXRS_DEQUANT_PREFILL_ROWS=0`) and mlx-lm, one process, alternating,
after the same warm-up. Random-weight Llama-shaped models written under --dir.

    python bench/cpu_quantized.py --bits 4,8 --rounds 2
    python bench/cpu_quantized.py --bits 4 --shape 1b --prompt 64 --rounds 1   # MLX's paths take minutes here

Prints, per model, decode tokens/s (a --prompt-token prompt, --gen greedy tokens: the engines' own
generation rates) and mlxrs's prefill tokens/s of each and the ratios, and whether mlxrs's two paths decoded the same tokens (they
need not: MLX's x86 CPU kernel accumulates bfloat16 in bfloat16, the packed kernel in float32).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

SHAPE = dict(
    hidden_size=1024,
    num_hidden_layers=8,
    intermediate_size=4096,
    num_attention_heads=16,
    num_key_value_heads=8,
    vocab_size=32000,
    head_dim=64,
)


def make_model(d: Path, bits: int, shape: dict | None = None) -> Path:
    """A random-weight llama (`shape`, default SHAPE) quantized to `bits` (group 64) with bfloat16
    scales and norms."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    from tinymodels import write_tokenizer

    if (d / "config.json").exists():
        return d
    d.mkdir(parents=True, exist_ok=True)
    cfg = dict(
        model_type="llama",
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        **(shape or SHAPE),
    )
    mx.random.seed(0)
    m = llama.Model(llama.ModelArgs(**cfg))
    nn.quantize(m, group_size=64, bits=bits)  # in float32 (MLX's CPU quantize of bfloat16 is slow)
    cfg["quantization"] = {"group_size": 64, "bits": bits}
    w = {k: (v.astype(mx.bfloat16) if v.dtype == mx.float32 else v) for k, v in tree_flatten(m.parameters())}
    mx.eval(w)
    mx.save_safetensors(str(d / "model.safetensors"), w, metadata={"format": "mlx"})
    (d / "config.json").write_text(json.dumps(cfg))
    write_tokenizer(d, cfg["vocab_size"])
    return d


def ours(d: Path, prompt: list[int], gen: int, kernel: bool) -> tuple[float, list[int], float]:
    import mlxrs

    # off: MLX's quantized matmul for every product (decode steps and prefill chunks)
    os.environ["MLXRS_CPU_HOST_BLOCKS"] = "1" if kernel else "0"
    if kernel:
        os.environ.pop("MLXRS_DEQUANT_PREFILL_ROWS", None)
    else:
        os.environ["MLXRS_DEQUANT_PREFILL_ROWS"] = "0"
    with mlxrs.Session(d, prompt_cache_bytes=0) as s:
        s.generate(prompt, max_tokens=2, ignore_eos=True)
        c = s.generate(prompt, max_tokens=gen, ignore_eos=True, temperature=0.0)
    return c.timings.generation_tps, c.tokens, c.timings.prompt_tps


def theirs(model, tok, prompt: list[int], gen: int) -> float:
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    for _ in stream_generate(model, tok, prompt, max_tokens=2, sampler=make_sampler(0.0)):
        pass
    r = None
    for r in stream_generate(model, tok, prompt, max_tokens=gen, sampler=make_sampler(0.0)):
        pass
    assert r is not None
    return float(r.generation_tps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--dir", default="/tmp/mlxrs-cpu-quantized")
    ap.add_argument("--shape", default="small", help="small (SHAPE) or bench_device.py's 1b")
    args = ap.parse_args()
    import mlxrs  # first: its BLAS ahead of libmlx (mlxrs/__init__.py)

    from mlx_lm import load

    print(json.dumps({k: mlxrs.runtime_info().get(k) for k in ("mlx_version", "blas", "default_device")}))
    prompt = [1] + [(7919 * i) % 30000 + 4 for i in range(args.prompt - 1)]
    for bits in [int(b) for b in args.bits.split(",")]:
        if args.shape == "1b":
            from bench_device import SHAPES

            d = make_model(Path(args.dir) / f"llama-1b-q{bits}-bf16", bits, SHAPES["1b"])
        else:
            d = make_model(Path(args.dir) / f"llama-1024x8-q{bits}-bf16", bits)
        model, tok = load(str(d))
        res: dict[str, list[float]] = {"kernel": [], "mlx": [], "mlx-lm": [], "prefill": [], "prefill-mlx": []}
        same = True
        for _ in range(args.rounds):
            a, ta, pa = ours(d, prompt, args.gen, True)
            b, tb, pb = ours(d, prompt, args.gen, False)
            res["kernel"].append(a)
            res["mlx"].append(b)
            res["prefill"].append(pa)
            res["prefill-mlx"].append(pb)
            res["mlx-lm"].append(theirs(model, tok, prompt, args.gen))
            same = same and ta == tb
        med = {k: statistics.median(v) for k, v in res.items()}
        print(
            f"{bits}-bit: decode tok/s mlxrs (packed kernel) {med['kernel']:.2f}, mlxrs (MLX's quantized matmul) "
            f"{med['mlx']:.2f}, mlx-lm {med['mlx-lm']:.2f}; mlxrs / mlx-lm {med['kernel'] / med['mlx-lm']:.1f}x, "
            f"kernel / MLX's {med['kernel'] / med['mlx']:.1f}x; mlxrs prefill {med['prefill']:.1f} tok/s "
            f"({med['prefill-mlx']:.1f} with MLX's); mlxrs's two paths the same tokens: {same}",
            flush=True,
        )
        del model


if __name__ == "__main__":
    main()
