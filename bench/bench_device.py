"""mlxrs vs mlx-lm on a GPU (MLX's CUDA backend on the H200 test machine, or Metal), alternating in
one process after the same warm-up, on random-weight Llama-1B-shaped models (bf16 and 4-bit).

    python bench/bench_device.py --out results.json      # on the GPU machine (see bench/README.md)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

L1B = dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, num_attention_heads=32,
           num_key_value_heads=8, vocab_size=32000, head_dim=64)


def make_model(d: Path, bits: int | None) -> Path:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    from tinymodels import write_tokenizer

    d.mkdir(parents=True, exist_ok=True)
    cfg = dict(model_type="llama", rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=500000.0,
               max_position_embeddings=8192, **L1B)
    mx.random.seed(0)
    m = llama.Model(llama.ModelArgs(**cfg))
    m.set_dtype(mx.bfloat16)
    if bits:
        nn.quantize(m, group_size=64, bits=bits)
        cfg["quantization"] = {"group_size": 64, "bits": bits}
    w = dict(tree_flatten(m.parameters()))
    mx.eval(w)
    mx.save_safetensors(str(d / "model.safetensors"), w, metadata={"format": "mlx"})
    (d / "config.json").write_text(json.dumps(cfg))
    write_tokenizer(d, cfg["vocab_size"])
    return d


def run_mlxlm(model, prompt, gen):
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    p = mx.array(prompt)
    t0 = time.perf_counter()
    first = None
    toks = []
    for tok, _ in generate_step(p, model, max_tokens=gen):
        if first is None:
            first = time.perf_counter()
        toks.append(int(tok))
    t1 = time.perf_counter()
    return len(prompt) / (first - t0), (len(toks) - 1) / (t1 - first), toks


def run_mlxrs(sess, prompt, gen):
    t0 = time.perf_counter()
    first = None
    toks = []
    for ch in sess.stream(prompt, max_tokens=gen, ignore_eos=True):
        if ch.token is not None:
            if first is None:
                first = time.perf_counter()
            toks.append(ch.token)
    t1 = time.perf_counter()
    return len(prompt) / (first - t0), (len(toks) - 1) / (t1 - first), toks


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--out")
    args = ap.parse_args()
    import mlx.core as mx
    from mlx_lm import load

    import mlxrs

    info = mlxrs.runtime_info()
    out = {"runtime": info, "mlx_device": str(mx.default_device()), "models": {}}
    print(json.dumps(info), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        # MLX 0.30.6's CUDA backend has no quantized matmul for these shapes ("QMM NYI"): bf16 only there
        models = [("llama1b_bf16", None)] + ([] if info["backend"] == "cuda" else [("llama1b_q4", 4)])
        for name, bits in models:
            d = make_model(Path(tmp) / name, bits)
            ref, _ = load(str(d))
            sess = mlxrs.Session(d)
            prompt = [int(x) for x in (mx.random.randint(0, 1000, (args.prompt,), key=mx.random.key(1))).tolist()]
            # warm-up on the same shapes (kernel JIT) for both
            run_mlxlm(ref, prompt, 16)
            run_mlxrs(sess, prompt, 16)
            rows = {"mlxrs": [], "mlx-lm": []}
            same = True
            for _ in range(args.runs):
                a = run_mlxrs(sess, prompt, args.gen)
                b = run_mlxlm(ref, prompt, args.gen)
                rows["mlxrs"].append(a[:2])
                rows["mlx-lm"].append(b[:2])
                same = same and a[2] == b[2]
            res = {}
            for k, v in rows.items():
                res[k] = {"prefill_tps": statistics.median(x[0] for x in v), "decode_tps": statistics.median(x[1] for x in v),
                          "runs": v}
            res["decode_ratio"] = res["mlxrs"]["decode_tps"] / res["mlx-lm"]["decode_tps"]
            res["prefill_ratio"] = res["mlxrs"]["prefill_tps"] / res["mlx-lm"]["prefill_tps"]
            res["same_greedy_tokens"] = same
            out["models"][name] = res
            print(name, json.dumps(res), flush=True)
            sess.close()
            del ref
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
