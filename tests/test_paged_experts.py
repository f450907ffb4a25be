"""Paged-expert IO (`Session(stream_experts=True)`): a qwen3_moe model whose experts stay in the
safetensors files and are read per step into an expert cache holding a quarter of them generates
what mlx-lm 0.32.2 generates with every expert resident (48 greedy tokens identical, last-position
logits within test_parity's tolerances), in float32 (the Hugging Face per-expert layout), 4-bit
(mlx-lm's stacked `switch_mlp` layout, expert rows read by offset) and bfloat16 4-bit; the counters
agree with each other and with the files; a truncated file is refused naming the tensor."""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

import mlxrs
from tinymodels import make_model

TEXT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France."
N_TOKENS = 48


def _expert_bytes(d: Path) -> int:
    """Bytes of the expert tensors, from the safetensors headers (read here, not by mlxrs)."""
    total = 0
    for f in d.glob("*.safetensors"):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name != "__metadata__" and (".mlp.experts." in name or ".switch_mlp." in name):
                total += t["data_offsets"][1] - t["data_offsets"][0]
    return total


def _all_bytes(d: Path) -> int:
    total = 0
    for f in d.glob("*.safetensors"):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        total += sum(t["data_offsets"][1] - t["data_offsets"][0] for k, t in header.items() if k != "__metadata__")
    return total


CASES = {
    "float32": dict(name="qwen3_moe-float32", kw={}, tol=1e-4, step=2048, repeat=1),
    "q4": dict(name="qwen3_moe-q4", kw=dict(quant_bits=4), tol=1e-4, step=2048, repeat=1),
    "bf16-q4": dict(name="qwen3_moe-bf16-q4", kw=dict(dtype="bfloat16", quant_bits=4), tol=2e-2, step=16, repeat=2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_matches_mlx_lm_resident(oracle, case):
    c = CASES[case]
    d = make_model(c["name"], "qwen3_moe", **c["kw"])
    experts = _expert_bytes(d)
    with mlxrs.Session(d, stream_experts=True, prefill_step_size=c["step"]) as s:
        ids = s.tokenize(TEXT) * c["repeat"]
        ours = s.generate(ids, max_tokens=N_TOKENS, ignore_eos=True, temperature=0.0)
        logits = np.array(s.logits(ids), dtype=np.float32)
        info = s.info
    ref = oracle({"model": str(d), "prompt": ids, "max_tokens": N_TOKENS, "prefill_step_size": c["step"]})
    diff = float(np.max(np.abs(logits - np.array(ref["logits"], dtype=np.float32))))
    assert diff <= c["tol"], f"last-token logits differ by {diff}"
    assert ours.tokens == ref["tokens"], f"greedy tokens differ:\n ours {ours.tokens}\n ref  {ref['tokens']}"
    assert len(ours.tokens) == N_TOKENS

    x = info["experts"]
    # the experts stayed in the files: what mlxrs counts as streamed is what the headers say
    assert x["streamed_bytes"] == experts
    assert info["weights_bytes"] == _all_bytes(d) - experts
    # the default cache: a quarter of the expert bytes (4 of the 16 experts of the 2 MoE layers)
    assert x["cache_budget_bytes"] == experts // 4
    assert x["streamed_layers"] == 2
    assert 0 < x["cache_bytes"] <= x["cache_budget_bytes"]
    # a quarter of the experts for 2 layers × top-2 per token: the cache cycles
    assert x["misses"] > 0 and x["hits"] > 0 and x["evictions"] > 0
    per_expert = experts // 16
    assert x["bytes_read"] == x["misses"] * per_expert
    assert x["hit_rate"] == pytest.approx(x["hits"] / (x["hits"] + x["misses"]))
    # tokens through the model: prompt + generated (generate feeds all but the last sampled
    # token) + the logits call's prompt, counted once per forward step at the first MoE layer
    assert x["tokens"] == 2 * len(ids) + N_TOKENS - 1
    assert x["bytes_read_per_token"] == pytest.approx(x["bytes_read"] / x["tokens"])
    assert x["read_bytes_per_second"] > 0


def test_resident_session_has_no_expert_counters():
    d = make_model("qwen3_moe-float32", "qwen3_moe")
    with mlxrs.Session(d) as s:
        assert s.info["experts"] is None
        assert s.info["weights_bytes"] == _all_bytes(d)


def test_cache_of_every_expert_reads_each_once(tmp_path):
    """With room for every expert, each is read at most once: misses ≤ 16, and a second identical
    generation reads nothing."""
    d = make_model("qwen3_moe-float32", "qwen3_moe")
    experts = _expert_bytes(d)
    with mlxrs.Session(d, stream_experts=True, expert_cache_bytes=experts) as s:
        ids = s.tokenize(TEXT)
        a = s.generate(ids, max_tokens=8, ignore_eos=True, temperature=0.0)
        first = dict(s.info["experts"])
        b = s.generate(ids, max_tokens=8, ignore_eos=True, temperature=0.0)
        second = s.info["experts"]
    assert a.tokens == b.tokens
    assert first["misses"] <= 16 and first["evictions"] == 0
    assert second["misses"] == first["misses"] and second["bytes_read"] == first["bytes_read"]
    assert second["hits"] > first["hits"]


def test_zero_cache_reads_every_routed_expert(oracle):
    """expert_cache_bytes=0: nothing is kept, every routed expert is read at every step; still the
    same tokens as mlx-lm."""
    d = make_model("qwen3_moe-q4", "qwen3_moe", quant_bits=4)
    with mlxrs.Session(d, stream_experts=True, expert_cache_bytes=0) as s:
        ids = s.tokenize(TEXT)
        ours = s.generate(ids, max_tokens=16, ignore_eos=True, temperature=0.0)
        x = s.info["experts"]
    ref = oracle({"model": str(d), "prompt": ids, "max_tokens": 16})
    assert ours.tokens == ref["tokens"]
    assert x["hits"] == 0 and x["cache_bytes"] == 0
    # each decode step routes 2 distinct experts in each of the 2 MoE layers
    assert x["misses"] >= 4 * 15


def test_truncated_expert_file_is_refused_naming_the_tensor(tmp_path):
    src = make_model("qwen3_moe-q4", "qwen3_moe", quant_bits=4)
    d = tmp_path / "m"
    shutil.copytree(src, d)
    f = d / "model.safetensors"
    # at load: the header's offsets run past the data
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])
    with pytest.raises(Exception, match=r"tensor model\.layers\.\d+\..* truncated"):
        mlxrs.Session(d, stream_experts=True)
    # after load: the file shrinks under a running session; the next expert read names the tensor
    f.write_bytes(data)
    with mlxrs.Session(d, stream_experts=True, expert_cache_bytes=0) as s:
        ids = s.tokenize(TEXT)
        s.generate(ids, max_tokens=2, ignore_eos=True, temperature=0.0)
        (n,) = struct.unpack("<Q", data[:8])
        f.write_bytes(data[: 8 + n])
        with pytest.raises(Exception, match=r"weight model\.layers\.\d+\.mlp\.switch_mlp\.\w+_proj\.\w+ .*truncated"):
            s.generate(ids + [5], max_tokens=2, ignore_eos=True, temperature=0.0)


@pytest.mark.parametrize("field,value,needle", [
    ("num_experts", 16, "model.layers.0.mlp.experts.8"),
    ("moe_intermediate_size", 64, "model.layers.0.mlp.switch_mlp.gate_proj.weight"),
])
def test_streamed_config_disagreeing_with_weights_is_refused(tmp_path, field, value, needle):
    src = make_model("qwen3_moe-float32", "qwen3_moe")
    d = tmp_path / field
    shutil.copytree(src, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg[field] = value
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match=needle.replace(".", r"\.")):
        mlxrs.Session(d, stream_experts=True)


def test_bad_options_are_refused():
    d = make_model("qwen3_moe-float32", "qwen3_moe")
    with pytest.raises(ValueError, match="expert_cache_bytes"):
        mlxrs.Session(d, stream_experts=True, expert_cache_bytes=-1)
    with pytest.raises(ValueError, match="stream_experts=True"):
        mlxrs.Session(d, expert_cache_bytes=1000)
    with pytest.raises(ValueError, match="stream_experts"):
        mlxrs.Session(d, stream_experts="yes")
