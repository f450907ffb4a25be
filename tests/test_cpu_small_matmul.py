"""The CPU backend's host kernel for float32 projections of 2-12 rows (handle/f32mm.rs, what a batched
decode step runs instead of the BLAS's sgemm) against MLX's matmul: the same greedy tokens for every row of
a batch of 3 and of 9 sequences (whole 4-row blocks and an edge block of 1), with the kernel shown to have
run (and not run when switched off)."""

from __future__ import annotations

import pytest

import mlxrs
from mlxrs import _native
from tinymodels import make_model


def batch(d, monkeypatch, mode: str, rows: int) -> tuple[list[list[int]], int]:
    monkeypatch.setenv("MLXRS_CPU_SMALL_MATMUL", mode)
    before = _native._host_matmul_count()
    with mlxrs.Session(d, prompt_cache_bytes=0) as s:
        ids = s.tokenize("The quick brown fox jumps over the lazy dog. Paris is the capital of France.")
        prompts = [ids[i % 5 : 5 + (7 * i) % 15] for i in range(rows)]
        out = s.generate_batch(prompts, max_tokens=32, ignore_eos=True, temperature=0.0)
    return [r.tokens for r in out], _native._host_matmul_count() - before


@pytest.mark.parametrize("rows", [3, 9])
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_host_kernel_gives_mlx_tokens(arch, rows, monkeypatch):
    d = make_model(f"{arch}-float32", arch)
    mlx_tokens, off_calls = batch(d, monkeypatch, "0", rows)
    host_tokens, on_calls = batch(d, monkeypatch, "1", rows)
    assert off_calls == 0, "MLXRS_CPU_SMALL_MATMUL=0 still ran the host kernel"
    assert on_calls > 0, "the batched decode never reached the host kernel"
    assert host_tokens == mlx_tokens
