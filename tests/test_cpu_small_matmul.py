"""The CPU backend's host kernel for float32 projections of 2-4 rows (handle/f32mm.rs, what a decode step
of a few sequences runs instead of the BLAS's sgemm) against MLX's matmul: the same greedy tokens for every
row of a batch, with the kernel shown to have run (and not run when switched off)."""

from __future__ import annotations

import pytest

import mlxrs
from mlxrs import _native
from tinymodels import make_model


def batch(d, monkeypatch, mode: str) -> tuple[list[list[int]], int]:
    monkeypatch.setenv("MLXRS_CPU_SMALL_MATMUL", mode)
    before = _native._host_matmul_count()
    with mlxrs.Session(d, prompt_cache_bytes=0) as s:
        ids = s.tokenize("The quick brown fox jumps over the lazy dog. Paris is the capital of France.")
        out = s.generate_batch([ids[:5], ids[2:19], ids[:11]], max_tokens=32, ignore_eos=True, temperature=0.0)
    return [r.tokens for r in out], _native._host_matmul_count() - before


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_host_kernel_gives_mlx_tokens(arch, monkeypatch):
    d = make_model(f"{arch}-float32", arch)
    mlx_tokens, off_calls = batch(d, monkeypatch, "0")
    host_tokens, on_calls = batch(d, monkeypatch, "1")
    assert off_calls == 0, "MLXRS_CPU_SMALL_MATMUL=0 still ran the host kernel"
    assert on_calls > 0, "the batched decode never reached the host kernel"
    assert host_tokens == mlx_tokens
