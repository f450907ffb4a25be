"""Attention written out in ops (models/sdpa.rs: what CUDA runs for a first-seen prompt shape, so a
prefix-cache hit does not pay a cuDNN graph build) against MLX's fused call: on the CPU MLX's fused
call is its own fallback, so every logit and token must be the same bit for bit — alone, batched (array
masks), a sliding window (gemma3_text), grouped and latent (MLA) heads, and a prompt extending a
prefix-cache hit. `MLXRS_SDPA_NEW_SHAPES=unfused` writes out every call without sinks; `fused` none."""

from __future__ import annotations

import pytest

import mlxrs
from tinymodels import make_model

TEXT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France. Rust meets Python."


def run(d, monkeypatch, mode: str) -> tuple[list[float], list[list[int]], list[int], int]:
    monkeypatch.setenv("MLXRS_SDPA_NEW_SHAPES", mode)
    monkeypatch.setenv("MLXRS_BATCH_KV", "1")
    with mlxrs.Session(d, prefill_step_size=16) as s:
        ids = s.tokenize(TEXT)
        logits = s.logits(ids)
        batch = s.generate_batch([ids[:5], ids[3:40], ids[:23]], max_tokens=24, ignore_eos=True, temperature=0.0)
        # a first turn, then a prompt extending it: the second prefills only its new tokens
        first = s.generate(ids[:30], max_tokens=8, ignore_eos=True, temperature=0.0)
        follow = s.generate(ids[:30] + first.tokens + ids[30:], max_tokens=16, ignore_eos=True, temperature=0.0)
        return logits, [r.tokens for r in batch], follow.tokens, follow.usage.cached_tokens


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text", "deepseek_v3"])
def test_written_out_attention_is_mlx_bit_for_bit(arch, monkeypatch):
    d = make_model(f"{arch}-float32", arch)
    fused = run(d, monkeypatch, "fused")
    ours = run(d, monkeypatch, "unfused")
    assert ours[0] == fused[0], "last-position logits differ"
    assert ours[1] == fused[1], "batched tokens differ"
    assert ours[2] == fused[2], "tokens after a prefix-cache hit differ"
    assert ours[3] == fused[3] and fused[3] >= 30, "the follow-up did not hit the prefix cache"
