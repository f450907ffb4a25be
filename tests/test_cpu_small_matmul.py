"""The CPU backend's two ops of a batched decode step (native/mlxrs_ext.cpp), each against MLX's own path:
the host kernel for float32 projections of 2-32 rows (handle/f32mm.rs, instead of the BLAS's sgemm) and
the per-row decode attention as one op for all rows (instead of MLX's attention per row). The same greedy
tokens for every row of a batch of 3, 9 and 30 sequences (whole 4-row blocks and edge blocks), with
each op shown to have run (and not run when switched off); cache kinds it does not take (quantized)
keep MLX's path."""

from __future__ import annotations

import pytest

import mlxrs
from mlxrs import _native
from tinymodels import make_model


def batch(d, monkeypatch, mode: str, rows: int, **opts: int) -> tuple[list[list[int]], int]:
    monkeypatch.setenv("MLXRS_CPU_SMALL_MATMUL", mode)
    before = _native._host_matmul_count()
    with mlxrs.Session(d, prompt_cache_bytes=0, **opts) as s:
        ids = s.tokenize("The quick brown fox jumps over the lazy dog. Paris is the capital of France.")
        prompts = [ids[i % 5 : 5 + (7 * i) % 15] for i in range(rows)]
        out = s.generate_batch(prompts, max_tokens=32, ignore_eos=True, temperature=0.0)
    return [r.tokens for r in out], _native._host_matmul_count() - before


def ops_of_batch(d, monkeypatch, attention: str, rows: int, **opts: int) -> tuple[list[list[int]], int]:
    """The greedy tokens of a batch and the MLX ops it built, with the per-row attention op on or off."""
    monkeypatch.setenv("MLXRS_CPU_ROWS_ATTENTION", attention)
    before = _native._op_count()
    toks, _ = batch(d, monkeypatch, "1", rows, **opts)
    return toks, _native._op_count() - before


@pytest.mark.parametrize("rows", [3, 9, 30])
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_host_kernel_gives_mlx_tokens(arch, rows, monkeypatch):
    d = make_model(f"{arch}-float32", arch)
    mlx_tokens, off_calls = batch(d, monkeypatch, "0", rows)
    host_tokens, on_calls = batch(d, monkeypatch, "1", rows)
    assert off_calls == 0, "MLXRS_CPU_SMALL_MATMUL=0 still ran the host kernel"
    assert on_calls > 0, "the batched decode never reached the host kernel"
    assert host_tokens == mlx_tokens


@pytest.mark.parametrize(
    "arch,opts",
    [("llama", {}), ("qwen3", {}), ("gemma3_text", {}), ("llama", {"kv_bits": 8})],
    ids=["llama", "qwen3", "gemma3_text", "llama-kv8"],
)
def test_rows_attention_gives_mlx_tokens(arch, opts, monkeypatch):
    """gemma3_text: sliding-window layers (rotating caches) past their window beside global ones; an
    8-bit KV cache is not float32 keys, so MLX's quantized attention keeps every row (no fewer ops)."""
    d = make_model(f"{arch}-float32", arch)
    mlx_tokens, mlx_ops = ops_of_batch(d, monkeypatch, "0", 9, **opts)
    op_tokens, op_ops = ops_of_batch(d, monkeypatch, "1", 9, **opts)
    assert op_tokens == mlx_tokens
    if "kv_bits" in opts:
        assert op_ops == mlx_ops, "a quantized cache's rows left MLX's attention"
    else:
        # per layer and decode step, 9 rows' attention ops and their concatenation become one op:
        # 9 fewer for each of the 2-3 layers over ~31 steps (at least 8 fewer in each of 20 steps)
        assert mlx_ops - op_ops >= 8 * 20, (op_ops, mlx_ops)
