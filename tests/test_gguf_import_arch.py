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
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    # qwen3moe: the router and the experts, stacked [experts, out, in] (convert_hf_to_gguf stacks them)
    "mlp.gate": "ffn_gate_inp",
    "mlp.switch_mlp.gate_proj": "ffn_gate_exps",
    "mlp.switch_mlp.up_proj": "ffn_up_exps",
    "mlp.switch_mlp.down_proj": "ffn_down_exps",
}
GGUF_ARCH = {"qwen3_moe": "qwen3moe"}


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llamacpp_rope_factors(cfg: dict) -> np.ndarray:
    """convert_hf_to_gguf's rope_freqs for a llama3 `rope_scaling` (LlamaModel.generate_extra_tensors),
    re-written here: per-dimension divisors of the rotary frequencies."""
    rs, dim, base = cfg["rope_scaling"], cfg["head_dim"], cfg["rope_theta"]
    freqs = 1.0 / (np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def gguf_name(name: str) -> str:
    """llama.cpp's GGUF name of a llama-family HF tensor name (NAMES for the blocks)."""
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if name in top:
        return top[name]
    _, _, idx, rest = name.split(".", 3)
    base, kind = rest.rsplit(".", 1)
    return f"blk.{idx}.{NAMES[base]}.{kind}"


def write_header(w: "gguf.GGUFWriter", cfg: dict, src: Path) -> None:
    """The llama-family hyperparameters of `cfg` and the byte-level BPE vocabulary of `src`'s
    tokenizer.json (tokens, types, merges) as llama.cpp's converter writes them (also
    bench/bench_device.py's BF16 writer)."""
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    specials = {t["id"] for t in tok["added_tokens"] if t.get("special")}
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
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)


def write_gguf(src: Path, out: Path, q8_0: tuple[str, ...] = (), quants: dict[str, str] | None = None) -> None:
    """`src` as a llama.cpp GGUF, all float32 but the tensors named in `q8_0` (GGUF names), which
    gguf-py quantizes to Q8_0 as llama.cpp's converter does, and those of `quants` (GGUF name → a type
    gguf-py quantizes: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)."""
    types = {g: "Q8_0" for g in q8_0} | (quants or {})
    import mlx.core as mx

    cfg = json.loads((src / "config.json").read_text())
    arch = cfg["model_type"]
    weights = {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(src / "model.safetensors")).items()}
    if arch == "qwen3_moe":
        for l in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{l}.mlp"
            for proj in ("gate_proj", "up_proj", "down_proj"):
                if f"{p}.experts.0.{proj}.weight" in weights:
                    weights[f"{p}.switch_mlp.{proj}.weight"] = np.stack(
                        [weights.pop(f"{p}.experts.{e}.{proj}.weight") for e in range(cfg["num_experts"])]
                    )
    w = gguf.GGUFWriter(str(out), GGUF_ARCH.get(arch, arch))
    write_header(w, cfg, src)
    if arch == "qwen3_moe":
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    for name, a in weights.items():
        if "rotary_emb" in name:
            continue
        g = gguf_name(name)
        if arch == "llama" and name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            a = llamacpp_permute(a, heads)
        if g in types:
            ty = gguf.GGMLQuantizationType[types[g]]
            w.add_tensor(g, gguf.quants.quantize(np.ascontiguousarray(a, dtype=np.float32), ty), raw_dtype=ty)
        else:
            w.add_tensor(g, np.ascontiguousarray(a, dtype=np.float32))
    if cfg.get("rope_scaling", {}).get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llamacpp_rope_factors(cfg))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
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
        assert (
            a.generate(ids, max_tokens=24, ignore_eos=True).tokens
            == b.generate(ids, max_tokens=24, ignore_eos=True).tokens
        )


def test_llama3_rope_scaling_survives_the_gguf_round_trip(oracle, tmp_path):
    """Llama 3.x keeps its rope scaling in the rope_freqs tensor, not in the metadata: the import
    recovers the llama3 `rope_scaling`, and mlxrs with it matches mlx-lm on the original model."""
    import shutil

    base = make_model("llama-float32", "llama")
    src = tmp_path / "llama3-rope"
    shutil.copytree(base, src)
    cfg = json.loads((src / "config.json").read_text())
    # factor 8 with a short original context: the tiny model's 32 frequencies fall in all three bands
    cfg["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    (src / "config.json").write_text(json.dumps(cfg))
    factors = llamacpp_rope_factors(cfg)
    assert (factors == 1).any() and (factors == 8).any() and ((factors > 1) & (factors < 8)).any()
    g = tmp_path / "llama3.gguf"
    write_gguf(src, g)
    out = models.convert_gguf(g, tmp_path / "imported", dtype="f32", progress=False)
    got = json.loads((out / "config.json").read_text())["rope_scaling"]
    # the factors fix the band edges old/low and old/high, not the three numbers: same edges
    assert got["rope_type"] == "llama3" and got["factor"] == 8.0, got
    old = got["original_max_position_embeddings"]
    assert abs(old / got["low_freq_factor"] - 256) < 1e-3 and abs(old / got["high_freq_factor"] - 64) < 1e-3, got
    prompt = list(range(5, 300))  # past the original context, where the scaling matters most
    ref = oracle.generate(src, prompt, 16)
    with mlxrs.Session(out) as b:
        diff = float(np.max(np.abs(np.array(b.logits(prompt)) - np.array(ref["logits"]))))
        assert diff < 1e-4, diff
        assert b.generate(prompt, max_tokens=16, ignore_eos=True).tokens == ref["tokens"]
    # without the scaling the model is a different one: the check above can fail
    plain = tmp_path / "plain"
    shutil.copytree(base, plain)
    with mlxrs.Session(plain) as c:
        assert float(np.max(np.abs(np.array(c.logits(prompt)) - np.array(ref["logits"])))) > 1e-3


def test_rope_factors_that_fit_no_llama3_scaling_are_refused(tmp_path):
    from mlxrs.errors import MlxrsError

    src = make_model("llama-float32", "llama")
    g = tmp_path / "odd.gguf"
    cfg = json.loads((src / "config.json").read_text())
    cfg["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    odd = tmp_path / "odd-src"
    import shutil

    shutil.copytree(src, odd)
    (odd / "config.json").write_text(json.dumps(cfg))
    real = llamacpp_rope_factors
    try:
        globals()["llamacpp_rope_factors"] = lambda c: real(c) * np.float32(1.3)
        write_gguf(odd, g)
    finally:
        globals()["llamacpp_rope_factors"] = real
    with pytest.raises(MlxrsError, match="rope_freqs"):
        models.convert_gguf(g, tmp_path / "imported", dtype="f32", progress=False)


def test_qwen3moe_gguf_import_quantized_experts(oracle, tmp_path, monkeypatch):
    """A qwen3moe GGUF imported as MLX 4-bit: the stacked experts quantized too ([experts, out, in]
    per expert row), and the imported model runs as mlx-lm runs it (same tokens, logits; a bfloat16
    MoE model, so through MLX's quantized matmul: test_parity.mlx_quantized_matmul)."""
    from test_parity import TEXT, _check, mlx_quantized_matmul

    mlx_quantized_matmul(monkeypatch)

    src = make_model("qwen3_moe-float32", "qwen3_moe")
    g = tmp_path / "qwen3moe.gguf"
    write_gguf(src, g)
    out = models.convert_gguf(g, tmp_path / "imported", dtype="q4", progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["mlp_only_layers"]) == (8, 2, [1])
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "numpy") as f:
        assert f.get_slice("model.layers.0.mlp.switch_mlp.gate_proj.scales").get_shape() == [8, 128, 4]
    _check(oracle, out, TEXT, dtype="float32")


def _on_and_off(
    oracle, out: Path, switch: str, monkeypatch
) -> tuple[list[int], dict[str, tuple[list[int], np.ndarray]]]:
    """A short prompt (<= 8 tokens: its logits() runs through the decode-step paths too) decoded and
    scored with `switch` on and off: both mlx-lm's greedy tokens and its logits within 1e-4."""
    with mlxrs.Session(out) as s:
        ids = s.tokenize("The quick brown fox")
    assert len(ids) <= 8
    ref = oracle.generate(out, ids, 24)
    got = {}
    for mode in ("1", "0"):
        monkeypatch.setenv(switch, mode)
        with mlxrs.Session(out) as s:
            got[mode] = (
                s.generate(ids, max_tokens=24, ignore_eos=True).tokens,
                np.array(s.logits(ids), dtype=np.float32),
            )
        assert got[mode][0] == ref["tokens"], f"{switch}={mode}: greedy tokens differ from mlx-lm's"
        diff = float(np.max(np.abs(got[mode][1] - np.array(ref["logits"], dtype=np.float32))))
        assert diff < 1e-4, f"{switch}={mode}: logits differ from mlx-lm's by {diff}"
    return ids, got


@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # a tied head, an untied one
def test_q8_0_head_on_the_cpu(oracle, arch, tmp_path, monkeypatch):
    """A GGUF whose output head is Q8_0 imports to f32 plus the head's own Q8_0 blocks
    (head_q8_0.safetensors), which the CPU decodes through (MLXRS_CPU_Q8_HEAD, on by default): the
    same greedy tokens as mlx-lm on the imported directory (it reads model.safetensors only: the
    dequantized head) and as the f32 head (MLXRS_CPU_Q8_HEAD=0), logits within float32 rounding;
    the head really is read from that file (scales doubled there double the logits), and a head file
    of the wrong shape is refused naming the tensor."""
    import shutil

    import mlx.core as mx
    from mlxrs.errors import MlxrsError

    src = make_model(f"{arch}-float32", arch)
    cfg = json.loads((src / "config.json").read_text())
    head = "token_embd.weight" if cfg["tie_word_embeddings"] else "output.weight"
    g = tmp_path / f"{arch}.gguf"
    write_gguf(src, g, q8_0=(head,))
    out = models.convert_gguf(g, tmp_path / "imported", dtype="f32", progress=False)
    hf = out / "head_q8_0.safetensors"
    assert hf.is_file()
    ids, got = _on_and_off(oracle, out, "MLXRS_CPU_Q8_HEAD", monkeypatch)
    # the Q8_0 head is the file's: its scales doubled, the logits double (the f32 head is untouched)
    doubled = tmp_path / "doubled"
    shutil.copytree(out, doubled)
    t = mx.load(str(hf))
    mx.save_safetensors(
        str(doubled / hf.name),
        {"head_q8_0.weight": t["head_q8_0.weight"], "head_q8_0.scales": t["head_q8_0.scales"] * 2},
    )
    monkeypatch.setenv("MLXRS_CPU_Q8_HEAD", "1")
    with mlxrs.Session(doubled) as s:
        twice = np.array(s.logits(ids), dtype=np.float32)
    assert np.allclose(twice, 2 * got["0"][1], atol=2e-4), float(np.max(np.abs(twice - 2 * got["0"][1])))
    # a head file that does not fit the model
    mx.save_safetensors(
        str(doubled / hf.name),
        {"head_q8_0.weight": t["head_q8_0.weight"][:-1], "head_q8_0.scales": t["head_q8_0.scales"][:-1]},
    )
    with pytest.raises(MlxrsError, match="head_q8_0.weight"):
        mlxrs.Session(doubled)


BLOCK_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # llama: q/k rows permuted in the file
def test_projection_blocks_on_the_cpu(oracle, arch, tmp_path, monkeypatch):
    """A GGUF whose projections are in block formats (gguf-py's Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 cycled
    over the matrices: q/k/v and gate/up of different formats, fused into one product) imports to f32
    plus host_blocks.safetensors, which the CPU's decode steps read (MLXRS_CPU_HOST_BLOCKS, on by
    default): the same greedy tokens as mlx-lm on the imported directory (it reads the dequantized f32
    weights of model.safetensors) and as the f32 path (MLXRS_CPU_HOST_BLOCKS=0); a short prompt's logits
    within float32 rounding of mlx-lm's, and not bit-equal to the f32 path's (the blocks really ran);
    the blocks are what is read (one matrix's scales zeroed there changes the logits); blocks that do
    not fit the model are refused naming the module."""
    import shutil

    import mlx.core as mx
    from mlxrs.errors import MlxrsError

    src = make_model(f"{arch}-float32", arch)
    g = tmp_path / f"{arch}.gguf"
    projs = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    cfg = json.loads((src / "config.json").read_text())
    names = [f"blk.{l}.{p}.weight" for l in range(cfg["num_hidden_layers"]) for p in projs]
    write_gguf(src, g, quants={n: BLOCK_TYPES[i % len(BLOCK_TYPES)] for i, n in enumerate(names)})
    out = models.convert_gguf(g, tmp_path / "imported", dtype="f32", progress=False)
    hb = out / "host_blocks.safetensors"
    t = mx.load(str(hb))
    assert {k.rsplit(".", 1)[1] for k in t} == {"host_q", "host_scales", "host_biases"}
    assert len([k for k in t if k.endswith(".host_q")]) == len(names)
    ids, got = _on_and_off(oracle, out, "MLXRS_CPU_HOST_BLOCKS", monkeypatch)
    assert not np.array_equal(got["1"][1], got["0"][1]), "the blocks' products are not the f32 path's"
    # the blocks are the file's: one matrix's scales zeroed, the logits move (the f32 weights are untouched)
    changed = tmp_path / "changed"
    shutil.copytree(out, changed)
    key = "model.layers.0.mlp.down_proj.host_scales"
    mx.save_safetensors(str(changed / hb.name), {**t, key: t[key] * 0})
    monkeypatch.setenv("MLXRS_CPU_HOST_BLOCKS", "1")
    with mlxrs.Session(changed) as s:
        moved = np.array(s.logits(ids), dtype=np.float32)
    assert float(np.max(np.abs(moved - got["1"][1]))) > 1e-3
    # blocks that do not fit the model
    key = "model.layers.0.self_attn.q_proj.host_q"
    mx.save_safetensors(str(changed / hb.name), {**t, key: t[key][:-1]})
    with pytest.raises(MlxrsError, match="q_proj"):
        mlxrs.Session(changed)
