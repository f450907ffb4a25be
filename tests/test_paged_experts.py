"""Paged-expert IO (`Session(stream_experts=True)`): a qwen3_moe model whose experts stay in the
safetensors files and are read per step into an expert cache holding a quarter of them generates
what mlx-lm 0.32.2 generates with every expert resident (48 greedy tokens identical, last-position
logits within test_parity's tolerances), in float32 (the Hugging Face per-expert layout), 4-bit
(mlx-lm's stacked `switch_mlp` layout, expert rows read by offset), bfloat16 4-bit and MLX's
microscaling modes mxfp4, mxfp8, nvfp4 (uint8 scales, no biases); the counters
agree with each other and with the files; a truncated file is refused naming the tensor."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

import mlxrs
from test_parity import mlx_quantized_matmul
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
    # MLX's mxfp4 (uint8 scales, no biases) as mlx-lm's convert --q-mode mxfp4 writes it
    "mxfp4": dict(name="qwen3_moe-mxfp4", kw=dict(quant_bits=4, quant_mode="mxfp4"), tol=1e-4, step=16, repeat=2),
    "mxfp8": dict(name="qwen3_moe-mxfp8", kw=dict(quant_bits=8, quant_mode="mxfp8"), tol=1e-4, step=2048, repeat=1),
    "nvfp4": dict(name="qwen3_moe-nvfp4", kw=dict(quant_bits=4, quant_mode="nvfp4"), tol=1e-4, step=2048, repeat=1),
}


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no-prefetch"])
@pytest.mark.parametrize("case", list(CASES))
def test_streamed_matches_mlx_lm_resident(oracle, case, prefetch, monkeypatch):
    c = CASES[case]
    if "bf16" in case:
        mlx_quantized_matmul(monkeypatch)  # a bfloat16 MoE model compared bit for bit
    d = make_model(c["name"], "qwen3_moe", **c["kw"])
    experts = _expert_bytes(d)
    with mlxrs.Session(d, stream_experts=True, prefill_step_size=c["step"], expert_prefetch=prefetch) as s:
        ids = s.tokenize(TEXT) * c["repeat"]
        ours = s.generate(ids, max_tokens=N_TOKENS, ignore_eos=True, temperature=0.0)
        logits = np.array(s.logits(ids), dtype=np.float32)
        info = s.info
    ref = oracle.generate(d, ids, N_TOKENS, prefill_step_size=c["step"])
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
    # every read: the misses not read ahead, and every expert read ahead (used or not)
    assert x["prefetch"] is prefetch
    if prefetch:
        # layer 1's router on layer 0's input picks some experts it then uses
        assert 0 < x["prefetch_hits"] <= x["prefetched"] and x["prefetch_hits"] <= x["misses"]
        assert x["prefetch_hit_rate"] == pytest.approx(x["prefetch_hits"] / x["prefetched"])
    else:
        assert x["prefetched"] == x["prefetch_hits"] == 0 and x["prefetch_hit_rate"] is None
    assert x["bytes_read"] == (x["misses"] - x["prefetch_hits"] + x["prefetched"]) * per_expert
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
    ref = oracle.generate(d, ids, 16)
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


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("num_experts", 16, "model.layers.0.mlp.experts.8"),
        ("moe_intermediate_size", 64, "model.layers.0.mlp.switch_mlp.gate_proj.weight"),
    ],
)
def test_streamed_config_disagreeing_with_weights_is_refused(tmp_path, field, value, needle):
    src = make_model("qwen3_moe-float32", "qwen3_moe")
    d = tmp_path / field
    shutil.copytree(src, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg[field] = value
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match=needle.replace(".", r"\.")):
        mlxrs.Session(d, stream_experts=True)


def test_prefetch_leaves_the_cache_as_it_is():
    """Reading ahead touches no cache entry: with and without prefetch the same tokens, hits,
    misses, evictions and cache contents; prefetch only adds the reads of the wasted predictions."""
    d = make_model("qwen3_moe-q4-l8", "qwen3_moe", quant_bits=4, layers=8)
    per_expert = _expert_bytes(d) // 56
    got = {}
    for prefetch in (True, False):
        with mlxrs.Session(d, stream_experts=True, expert_prefetch=prefetch) as s:
            ids = s.tokenize(TEXT)
            got[prefetch] = (s.generate(ids, max_tokens=24, ignore_eos=True, temperature=0.0).tokens, s.info["experts"])
    (t_on, on), (t_off, off) = got[True], got[False]
    assert t_on == t_off
    for k in ("hits", "misses", "evictions", "cache_bytes", "cached_experts", "tokens"):
        assert on[k] == off[k], k
    assert on["prefetched"] > 0 and off["prefetched"] == 0
    assert on["bytes_read"] - off["bytes_read"] == (on["prefetched"] - on["prefetch_hits"]) * per_expert


def test_bad_options_are_refused():
    d = make_model("qwen3_moe-float32", "qwen3_moe")
    with pytest.raises(ValueError, match="expert_prefetch"):
        mlxrs.Session(d, stream_experts=True, expert_prefetch="on")
    with pytest.raises(ValueError, match="stream_experts=True"):
        mlxrs.Session(d, expert_prefetch=True)
    with pytest.raises(ValueError, match="expert_cache_bytes"):
        mlxrs.Session(d, stream_experts=True, expert_cache_bytes=-1)
    with pytest.raises(ValueError, match="stream_experts=True"):
        mlxrs.Session(d, expert_cache_bytes=1000)
    with pytest.raises(ValueError, match="stream_experts"):
        mlxrs.Session(d, stream_experts="yes")


# -- the memory plan -----------------------------------------------------------------------------------
CTX = 256


def _plan(d: Path, **kw) -> dict:
    from mlxrs import fit

    return fit.plan(d, CTX, **kw)


def _deep_moe() -> Path:
    """8 layers, 7 of them MoE (layer 1 dense) × 8 experts, top-2, 4-bit."""
    return make_model("qwen3_moe-q4-l8", "qwen3_moe", quant_bits=4, layers=8)


def test_plan_streams_a_moe_model_over_its_budget():
    d = _deep_moe()
    experts, weights = _expert_bytes(d), _all_bytes(d)
    resident = _plan(d, budget="100G")
    assert resident["strategy"] == "generic-kv" and resident["weightsBytes"] == weights
    assert "expertCacheBytes" not in resident  # the dense plan's JSON is unchanged
    # a budget a quarter of the experts short of the resident total: streamed, and it fits (the
    # cache above its floor, a quarter of the experts: 7 MoE layers × top-2 of 8)
    budget = resident["totalBytes"] - experts // 4
    p = _plan(d, budget=str(budget))
    assert p["strategy"] == "streamed-experts" and p["fits"]
    assert p["streamedExpertBytes"] == experts
    per_expert = experts // 56  # 7 MoE layers × 8 experts
    # one layer's experts read and stacked (a prefill routes all 8), and the next layer's 8 read ahead
    step = 3 * 8 * per_expert
    # resident: the non-expert weights, the cache, one step's experts, KV, transient, reserve
    assert p["weightsBytes"] == weights - experts + p["expertCacheBytes"]
    assert p["transientBytes"] == resident["transientBytes"] + step
    assert p["kvBytes"] == resident["kvBytes"]
    assert p["totalBytes"] == p["weightsBytes"] + p["kvBytes"] + p["transientBytes"] + p["reserveBytes"] <= budget
    # without reading ahead, one copy fewer
    off = _plan(d, budget=str(budget), expert_prefetch=False)
    assert off["transientBytes"] == resident["transientBytes"] + 2 * 8 * per_expert
    # the cache gets the rest of the budget
    assert p["expertCacheBytes"] == budget - (p["totalBytes"] - p["expertCacheBytes"])
    frac = p["expertCacheBytes"] / experts
    assert p["expertCacheFraction"] == pytest.approx(frac)
    # uniform routing: (1 - fraction) × (7 layers × top-2) experts read per token
    assert p["predictedExpertBytesPerToken"] == pytest.approx((1 - frac) * 14 * per_expert)
    # forced, with a given cache
    f = _plan(d, budget="100G", stream_experts=True, expert_cache_bytes=experts // 4)
    assert f["strategy"] == "streamed-experts" and f["expertCacheBytes"] == experts // 4
    assert f["predictedExpertBytesPerToken"] == pytest.approx(0.75 * 14 * per_expert)
    # a dense model is never streamed
    dense = make_model("qwen3-float32", "qwen3")
    assert _plan(dense, budget="1000", stream_experts=True)["strategy"] == "generic-kv"


@pytest.mark.parametrize(
    "name,kw",
    [
        ("qwen3_moe-mxfp4", dict(arch="qwen3_moe", quant_bits=4, quant_mode="mxfp4")),
        ("gpt_oss-experts-mxfp4", dict(arch="gpt_oss", quant_bits=4, quant_mix="experts-mxfp4")),
    ],
)
def test_plan_counts_mxfp4_expert_bytes(name, kw):
    """mxfp4 experts (4-bit e2m1 packed in uint32, one uint8 e8m0 scale per 32 inputs, no biases):
    the plan's streamed expert bytes are the files' expert tensor bytes (the headers, read here) and
    what mxfp4 takes (4.25 bits per weight, from the config's shapes); the loaded model streams that
    much and keeps the rest resident; the KV cache is planned in the dtype mlx-lm's holds."""
    d = make_model(name, **kw)
    cfg = json.loads((d / "config.json").read_text())
    h, e = cfg["hidden_size"], cfg.get("num_experts") or cfg["num_local_experts"]
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    moe_layers = (
        sum(1 for k in cfg["quantization"] if isinstance(cfg["quantization"][k], dict)) // 3
        if "experts-" in name
        else cfg["num_hidden_layers"] - len(cfg.get("mlp_only_layers", []))
    )
    per_expert = 3 * inter * h // 2 + 3 * inter * h // 32  # gate, up, down: e2m1 nibbles + e8m0 scales
    experts = _expert_bytes(d)
    biases = 0
    if kw["arch"] == "gpt_oss":  # the experts' float32 biases (gate, up: inter; down: hidden)
        biases = moe_layers * e * (2 * inter + h) * 4
    assert experts == moe_layers * e * per_expert + biases
    p = _plan(d, budget="100G", stream_experts=True)
    assert p["strategy"] == "streamed-experts" and p["streamedExpertBytes"] == experts
    assert p["weightsBytes"] == _all_bytes(d) - experts + p["expertCacheBytes"]
    f32 = _plan(make_model(f"{kw['arch']}-float32", kw["arch"]), budget="100G")
    # the KV cache's dtype is the one mlx-lm's cache holds after a step (an mxfp4 embedding
    # dequantizes to bfloat16, the float32 norms promote it back)
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    import mlx.core as mx

    model, _ = load(str(d))
    cache = make_prompt_cache(model)
    model(mx.array([[1, 2, 3]]), cache=cache)
    assert p["kvBytes"] * 4 == f32["kvBytes"] * cache[0].keys.dtype.size
    with mlxrs.Session(d, stream_experts=True) as s:
        s.generate(s.tokenize(TEXT), max_tokens=2, temperature=0.0)
        info = s.info
    assert info["experts"]["streamed_bytes"] + info["weights_bytes"] == _all_bytes(d)


def test_plan_keeps_the_expert_cache_floor_and_shrinks_the_context():
    """A budget the model's whole context would fill: the streamed plan keeps the expert cache's
    floor — one decoded token's routed experts, 7 MoE layers × top-2, from the headers — instead
    of a cache of 0 bytes, and the context gives way to it; `fit` says so."""
    from cli_util import run_cli

    d = _deep_moe()
    floor = 14 * (_expert_bytes(d) // 56)

    def plan(ctx, budget, **kw):
        return json.loads(mlxrs._native.plan(str(d), ctx, None, str(budget), stream_experts=True, **kw))

    # what the model's whole context needs with no expert cache at all
    budget = plan(None, "100G", expert_cache_bytes=0)["totalBytes"]
    p = plan(None, budget)
    assert p["expertCacheFloorBytes"] == floor and p["expertCacheBytes"] == floor
    assert not p["fits"] and p["totalBytes"] == budget + floor
    m = p["maxSafeContext"]
    assert 0 < m < p["contextTokens"]
    at = plan(m, budget)
    assert at["fits"] and at["expertCacheBytes"] >= floor and at["totalBytes"] <= budget
    past = plan(m + 1, budget)
    assert not past["fits"] and past["expertCacheBytes"] == floor
    # a cache given explicitly has no floor
    assert "expertCacheFloorBytes" not in plan(None, budget, expert_cache_bytes=0)
    out = run_cli("fit", str(d), "--memory-budget", str(budget))
    assert out.returncode == 0, out.stderr
    assert "one token's routed experts: the context gives way" in out.stdout
    assert f"up to {m} tokens do beside the expert cache's floor" in out.stdout


def test_fit_cli_reports_streaming(tmp_path):
    from cli_util import run_cli

    d = _deep_moe()
    budget = _plan(d, budget="100G")["totalBytes"] - _expert_bytes(d) // 4
    out = run_cli("fit", str(d), "--ctx", str(CTX), "--memory-budget", str(budget))
    assert out.returncode == 0, out.stderr
    assert "streamed from the files" in out.stdout and "read per token" in out.stdout
    assert "fits with the experts streamed from disk" in out.stdout


def test_served_streamed_when_the_weights_exceed_the_budget():
    """`serve --memory-budget` below the model's weights: served with its experts streamed (mlx-lm
    would need every weight in memory), the answer the same as a resident session's."""
    from server_util import Server

    d = _deep_moe()
    # the streamed plan at the model's full context, with room for a quarter of the experts: less
    # than the resident plan needs
    full = json.loads(
        mlxrs._native.plan(str(d), None, None, "100G", stream_experts=True, expert_cache_bytes=_expert_bytes(d) // 4)
    )
    budget = full["totalBytes"]
    assert budget < json.loads(mlxrs._native.plan(str(d), None, None, "100G"))["totalBytes"]
    with mlxrs.Session(d) as s:
        ids = s.tokenize(TEXT)
        want = s.generate(ids, max_tokens=12, ignore_eos=True, temperature=0.0).tokens
    with Server(d, "--memory-budget", str(budget)) as srv:
        st = srv.stats()
        assert st["memory_plan"]["strategy"] == "streamed-experts"
        assert st["memory_plan"]["expertCacheBytes"] == _expert_bytes(d) // 4
        status, body = srv.post(
            "/v1/completions",
            {"model": "m", "prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 1},
        )
        assert status == 200, body
        st = srv.stats()
        x = st["experts"]
        assert x["misses"] > 0 and x["cache_budget_bytes"] == _expert_bytes(d) // 4
        assert x["prefetch"] is True and x["prefetched"] > 0  # reading ahead by default
        assert x["bytes_read_per_token"] > 0 and 0 <= x["hit_rate"] <= 1
    got = body["choices"][0]
    with mlxrs.Session(d) as s:
        assert got["text"] == s.detokenize(want)


def test_batched_decode_streamed_matches_mlx_lm(oracle):
    """Several generations decoded together (one batched step over every row) with the experts
    streamed: each the tokens mlx-lm generates for its prompt alone."""
    d = make_model("qwen3_moe-q4", "qwen3_moe", quant_bits=4)
    with mlxrs.Session(d, stream_experts=True) as s:
        prompts = [s.tokenize(t) for t in (TEXT, "Large language models predict", "def add(a, b):")]
        got = s.generate_batch(prompts, max_tokens=16, ignore_eos=True, temperature=0.0)
        assert s.info["decode_steps"] < 3 * 16  # the rows were decoded together
    for ids, c in zip(prompts, got):
        ref = oracle.generate(d, ids, 16)
        assert c.tokens == ref["tokens"]


def test_serve_expert_prefetch_off():
    """`serve --expert-prefetch off`: the streamed experts are read only once routed (and the plan
    counts two copies of a layer's experts, not three)."""
    from server_util import Server

    d = _deep_moe()
    with Server(d, "--stream-experts", "--expert-prefetch", "off") as srv:
        status, body = srv.post(
            "/v1/completions", {"model": "m", "prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        )
        assert status == 200, body
        st = srv.stats()
        x = st["experts"]
        assert x["prefetch"] is False and x["prefetched"] == 0 and x["misses"] > 0
        on = json.loads(mlxrs._native.plan(str(d), None, None, None, stream_experts=True))
        assert st["memory_plan"]["transientBytes"] == on["transientBytes"] - 8 * (_expert_bytes(d) // 56)


def test_fit_cli_expert_cache_implies_streaming():
    from cli_util import run_cli

    d = _deep_moe()
    cache = _expert_bytes(d) // 4
    out = run_cli("fit", str(d), "--ctx", str(CTX), "--json", "--expert-cache-bytes", str(cache))
    assert out.returncode == 0, out.stderr
    p = json.loads(out.stdout)
    assert p["strategy"] == "streamed-experts" and p["expertCacheBytes"] == cache


# every MoE architecture, in each of the layouts its checkpoints ship (stacked switch_mlp, per-expert
# `experts.{e}.{proj}` or Mixtral's w1/w3/w2, the fused `experts.gate_up_proj`), streamed with the
# default cache (a quarter of the expert bytes) against mlx-lm with every expert resident
MOE_ARCHS = [
    "mixtral",
    "glm4_moe",
    "gpt_oss",
    "qwen3_next",
    "qwen3_5_moe",
    "gemma4_text_moe",
    "deepseek_v3",
    "deepseek_v32",
    "glm_moe_dsa",
    "mistral4",
    "mistral3",
]


# (name, make_model keywords): gpt-oss quantized mxfp4 by mlx-lm's convert, and as its mixed checkpoints
# ship (mxfp4 experts, affine attention, the rest not quantized)
MX_MODELS = {
    "mxfp4": ("gpt_oss-mxfp4", dict(quant_bits=4, quant_mode="mxfp4")),
    "experts-mxfp4": ("gpt_oss-experts-mxfp4", dict(quant_bits=4, quant_mix="experts-mxfp4")),
}
STREAM_CASES = [(a, q) for a in MOE_ARCHS for q in (None, 4)] + [("gpt_oss", m) for m in MX_MODELS]


@pytest.mark.parametrize(
    "arch,quant",
    STREAM_CASES,
    ids=[f"{a}-{'float32' if q is None else 'q4' if q == 4 else q}" for a, q in STREAM_CASES],
)
def test_every_moe_architecture_streams_as_mlx_lm(oracle, arch, quant):
    """Streamed with prefetch on (each MoE layer reads the next one's predicted experts ahead)."""
    if isinstance(quant, str):
        name, kw = MX_MODELS[quant]
        d = make_model(name, arch, **kw)
    else:
        d = make_model(f"{arch}-float32" if quant is None else f"{arch}-q4", arch, quant_bits=quant)
    with mlxrs.Session(d, stream_experts=True, prefill_step_size=16, expert_prefetch=True) as s:
        ids = s.tokenize(TEXT) * 2
        ours = s.generate(ids, max_tokens=N_TOKENS, ignore_eos=True, temperature=0.0)
        logits = np.array(s.logits(ids), dtype=np.float32)
        x = s.info["experts"]
    ref = oracle.generate(d, ids, N_TOKENS, prefill_step_size=16)
    diff = float(np.max(np.abs(logits - np.array(ref["logits"], dtype=np.float32))))
    assert diff <= 1e-4, f"last-token logits differ by {diff}"
    assert ours.tokens == ref["tokens"], f"greedy tokens differ:\n ours {ours.tokens}\n ref  {ref['tokens']}"
    # the experts came from the files through the cache, within its budget
    assert x["streamed_layers"] > 0 and x["misses"] > 0 and x["bytes_read"] > 0
    assert 0 < x["cache_bytes"] <= x["cache_budget_bytes"]
    # every layer after a streamed one was read ahead; with one MoE layer there is no next
    if x["streamed_layers"] == 1:
        assert x["prefetched"] == 0
    else:
        assert x["prefetched"] > 0 and 0 <= x["prefetch_hits"] <= x["prefetched"]
