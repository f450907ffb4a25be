"""GGUF import of the llama-family architectures: a tiny HF model is written as a llama.cpp-style
GGUF with gguf-py (llama.cpp's names, its q/k row permutation for llama, ggml dimension order, a
GPT-2 byte-level vocabulary with merges), imported by mlxrs, and must reproduce the original model's
logits and greedy tokens."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import mlxrs
from mlxrs import models
from tinymodels import make_model

gguf = pytest.importorskip("gguf")

NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(src: Path, out: Path) -> None:
    import mlx.core as mx

    cfg = json.loads((src / "config.json").read_text())
    arch = cfg["model_type"]
    weights = {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(src / "model.safetensors")).items()}
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    specials = {t["id"] for t in tok["added_tokens"] if t.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in specials else 1 for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    for name, a in weights.items():
        if "rotary_emb" in name:
            continue
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        elif name == "lm_head.weight":
            g = "output.weight"
        else:
            _, _, idx, rest = name.split(".", 3)
            base, kind = rest.rsplit(".", 1)
            g = f"blk.{idx}.{NAMES[base]}.{kind}"
            if arch == "llama" and base in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = cfg["num_attention_heads"] if base.endswith("q_proj") else cfg["num_key_value_heads"]
                a = llamacpp_permute(a, heads)
        w.add_tensor(g, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_llama_family_gguf_import_reproduces_the_model(arch, tmp_path):
    src = make_model(f"{arch}-float32", arch)
    g = tmp_path / f"{arch}.gguf"
    write_gguf(src, g)
    out = models.convert_gguf(g, tmp_path / "imported", dtype="f32", progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == arch
    text = "The quick brown fox jumps over the lazy dog. def add(a, b):"
    with mlxrs.Session(src) as a, mlxrs.Session(out) as b:
        ids = a.tokenize(text)
        assert b.tokenize(text) == ids, "the GGUF vocabulary and merges rebuild the same tokenizer"
        diff = float(np.max(np.abs(np.array(a.logits(ids)) - np.array(b.logits(ids)))))
        assert diff < 1e-4, diff
        assert a.generate(ids, max_tokens=24, ignore_eos=True).tokens == b.generate(ids, max_tokens=24, ignore_eos=True).tokens
