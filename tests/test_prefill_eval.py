"""The prefill's per-layer evaluation (`CausalLm::forward_staged`, on by default on GPU backends to hold
MLX's peak memory to the planner's one-layer transient) gives exactly the values of the whole-chunk
graph (the CPU default). Forced here on the CPU through MLXRS_PREFILL_EVAL_LAYERS, read at every
generation: greedy tokens, their log-probabilities and the last-position logits must be identical,
for every architecture, over several prefill chunks, with a quantized KV cache, past a sliding
window and with a rotating cache; evaluating every layer, every 3 layers, and with one stage queued
ahead (`1a`, `2a`)."""

from __future__ import annotations

import numpy as np
import pytest

import mlxrs
from tinymodels import make_model

ENV = "MLXRS_PREFILL_EVAL_LAYERS"
TEXT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France."


def _run(s: mlxrs.Session, ids: list[int], every: str, monkeypatch) -> tuple[list[int], list[float], np.ndarray]:
    monkeypatch.setenv(ENV, every)
    c = s.generate(ids, max_tokens=12, ignore_eos=True, temperature=0.0, logprobs=True)
    logits = np.array(s.logits(ids), dtype=np.float32)
    return c.tokens, [lp.logprob for lp in c.logprobs], logits


CASES = [
    pytest.param("llama", {}, id="llama"),
    pytest.param("qwen2", {}, id="qwen2"),
    pytest.param("qwen3", {"prefill_step_size": 16}, id="qwen3-chunked"),
    pytest.param("gemma3_text", {"prefill_step_size": 16}, id="gemma3-past-window"),
    pytest.param("llama", {"prefill_step_size": 16, "kv_bits": 8}, id="llama-kv8-chunked"),
    pytest.param("qwen2", {"prefill_step_size": 16, "max_kv_size": 24}, id="qwen2-rotating"),
    pytest.param("qwen3_moe", {"prefill_step_size": 16}, id="qwen3_moe-chunked"),
    pytest.param("mixtral", {"prefill_step_size": 16}, id="mixtral-chunked"),
    pytest.param("glm4_moe", {"prefill_step_size": 16}, id="glm4_moe-chunked"),
    pytest.param("gpt_oss", {"prefill_step_size": 16}, id="gpt_oss-past-window"),
]


@pytest.mark.parametrize("arch,opts", CASES)
def test_staged_prefill_is_identical(arch, opts, monkeypatch):
    d = make_model(f"{arch}-float32", arch)
    with mlxrs.Session(d, **opts) as s:
        ids = s.tokenize(TEXT) * 2
        whole = _run(s, ids, "0", monkeypatch)
        for every in ("1", "3", "1a", "2a"):
            staged = _run(s, ids, every, monkeypatch)
            assert staged[0] == whole[0], every
            assert staged[1] == whole[1], every
            np.testing.assert_array_equal(staged[2], whole[2], err_msg=every)
