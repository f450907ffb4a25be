"""The CPU's packed kernel for MLX's own 4-bit and 8-bit affine weights (crates/mlxrs-core/src/handle/
packed.rs; `MLXRS_CPU_HOST_BLOCKS`): decode steps and short prompts of an mlx-lm-quantized model read
the packed words through it. A float32 model gives what MLX's own quantized matmul gives (the switch
off): the same greedy tokens and logits within float32 summation order. A bfloat16 model is compared
with mlx-lm computing the same products exactly (float32 dequantization and matmul: MLX's x86 CPU
kernel accumulates bfloat16 in bfloat16, tests/oracle_mlxlm.py), as tests/test_parity.py's bfloat16
cases are. Its agreement with MLX's dequantized matmul, value by value, for every instruction set,
scale type and bit width: the Rust unit tests (handle/packed.rs)."""

from __future__ import annotations

import numpy as np
import pytest

import mlxrs
from mlxrs import _native
from test_parity import _check
from tinymodels import make_model

PROMPT = [(7919 * i) % 500 + 3 for i in range(20)]
SHORT = PROMPT[:5]  # a prompt of up to 8 tokens: its logits through the kernel too

CASES = [
    ("llama-q4", "llama", dict(quant_bits=4)),
    ("llama-q8", "llama", dict(quant_bits=8)),
]
BF16_CASES = [
    ("qwen3-bf16-q4", "qwen3", dict(dtype="bfloat16", quant_bits=4)),
    ("llama-bf16-q8", "llama", dict(dtype="bfloat16", quant_bits=8)),
]


def _cpu() -> None:
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        pytest.skip("the packed kernel is the CPU backend's")


def _run(d, switch: str | None, monkeypatch) -> tuple[list[int], np.ndarray, int]:
    if switch is None:
        monkeypatch.delenv("MLXRS_CPU_HOST_BLOCKS", raising=False)
    else:
        monkeypatch.setenv("MLXRS_CPU_HOST_BLOCKS", switch)
    before = _native._packed_matmul_count()
    with mlxrs.Session(d, prompt_cache_bytes=0) as s:
        tokens = s.generate(PROMPT, max_tokens=24, ignore_eos=True, temperature=0.0).tokens
        logits = np.array(s.logits(SHORT), dtype=np.float32)
    return tokens, logits, _native._packed_matmul_count() - before


@pytest.mark.parametrize("name,arch,kw", CASES, ids=[c[0] for c in CASES])
def test_packed_kernel_matches_mlx_quantized_matmul(name, arch, kw, monkeypatch):
    _cpu()
    d = make_model(name, arch, **kw)
    ours, ours_logits, calls = _run(d, None, monkeypatch)
    ref, ref_logits, ref_calls = _run(d, "0", monkeypatch)
    # every quantized projection of every decode step and of the short prompt took the kernel, and
    # none with the switch off
    assert calls > 24 * 4 and ref_calls == 0, (calls, ref_calls)
    assert ours == ref
    scale = float(np.max(np.abs(ref_logits)))
    diff = float(np.max(np.abs(ours_logits - ref_logits)))
    assert diff <= 1e-4 * max(scale, 1.0), (diff, scale)


@pytest.mark.parametrize("name,arch,kw", BF16_CASES, ids=[c[0] for c in BF16_CASES])
def test_bfloat16_models_take_the_kernel_and_match_exact_products(oracle, name, arch, kw, monkeypatch):
    _cpu()
    monkeypatch.delenv("MLXRS_CPU_HOST_BLOCKS", raising=False)
    d = make_model(name, arch, **kw)
    before = _native._packed_matmul_count()
    _check(oracle, d, "The quick brown", dtype="bfloat16")  # 3 tokens: the prompt through the kernel too
    assert _native._packed_matmul_count() - before > 64 * 4
