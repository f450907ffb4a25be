"""An independent GGUF → Hugging Face-layout conversion for the real-model tests, written with
llama.cpp's own gguf-py (reader and dequantization) and transformers' GGUF tokenizer code, sharing
nothing with mlxrs's importer. mlx-lm then loads the result as the oracle."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from buildlock import build_lock, cached_build

NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def convert_gemma3(gguf_path: Path, out: Path, dtype: str = "float32") -> Path:
    """mlx-lm's layout of the Gemma 3 GGUF at `gguf_path`, dequantized independently of mlxrs, written
    once into `out`."""
    with build_lock(out):
        # the GGUF is the pinned package's (its version is in the cache's digest), named by its size
        return cached_build(out, lambda: _convert_gemma3(gguf_path, out, dtype), gguf_path.stat().st_size, dtype)


def _convert_gemma3(gguf_path: Path, out: Path, dtype: str) -> Path:
    import mlx.core as mx
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from transformers.integrations.gguf import gguf_tokenizer_mapping as gtm

    if (out / ".complete").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    r = GGUFReader(str(gguf_path))

    def meta(k: str):  # noqa: ANN202
        f = r.fields.get(k)
        return None if f is None else f.contents()

    weights = {}
    for t in r.tensors:
        a = dequantize(t.data, t.tensor_type).astype(np.float32).reshape([int(d) for d in t.shape[::-1]])
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        else:
            _, idx, base, kind = t.name.split(".")
            name = f"model.layers.{idx}.{NAMES[base]}.{kind}"
        if name.endswith("norm.weight"):
            a = a - 1.0  # llama.cpp stores Gemma norms as w + 1
        weights[name] = mx.array(a).astype(getattr(mx, dtype))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    hd = int(meta("gemma3.attention.key_length"))
    cfg = {
        "model_type": "gemma3_text",
        "hidden_size": int(meta("gemma3.embedding_length")),
        "num_hidden_layers": int(meta("gemma3.block_count")),
        "intermediate_size": int(meta("gemma3.feed_forward_length")),
        "num_attention_heads": int(meta("gemma3.attention.head_count")),
        "num_key_value_heads": int(meta("gemma3.attention.head_count_kv")),
        "head_dim": hd,
        "query_pre_attn_scalar": hd,
        "rms_norm_eps": float(meta("gemma3.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta("gemma3.rope.freq_base")),
        "rope_local_base_freq": 10000.0,
        "sliding_window": int(meta("gemma3.attention.sliding_window")),
        "sliding_window_pattern": 6,
        "max_position_embeddings": int(meta("gemma3.context_length")),
        "vocab_size": len(meta("tokenizer.ggml.tokens")),
        "eos_token_id": [int(meta("tokenizer.ggml.eos_token_id"))],
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    d = {
        name: meta("tokenizer." + key)
        for key, name in gtm.GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if meta("tokenizer." + key) is not None
    }
    tok, _ = gtm.convert_gguf_tokenizer("gemma3", d)
    tok.save(str(out / "tokenizer.json"))
    toks = d["tokens"]
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "add_bos_token": True,
                "bos_token": toks[int(meta("tokenizer.ggml.bos_token_id"))],
                "eos_token": toks[int(meta("tokenizer.ggml.eos_token_id"))],
            }
        )
    )
    (out / ".complete").write_text("ok")
    return out
