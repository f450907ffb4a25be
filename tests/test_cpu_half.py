"""The CPU's host ops for 16-bit float models (crates/mlxrs-core/src/handle/half.rs; `MLXRS_CPU_HALF`):
a bfloat16 (or float16) model's projections (in place for decode steps, float32 tiles through the BLAS
for prompts) and its prompts' attention run through them, its decode steps' attention through
`RowsDecodeAttention` at MLX's rounding points. Against mlx-lm: the products are exact float32 sums in another order than
MLX's half-precision matmul, compared as tests/test_parity.py compares them (a logit one bfloat16 step
away, tokens parting only at a near-tie). Against mlxrs with the switch off (MLX's ops): the counters show
which path ran, and the logits agree within bfloat16 rounding. The kernels value by value, for both
16-bit types and every instruction set: the Rust unit tests (handle/half.rs, models/sdpa.rs)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import mlxrs
from mlxrs import _native
from test_parity import TEXT, _check
from tinymodels import make_model

CASES = [
    ("llama-bfloat16", "llama", "bfloat16"),
    ("qwen3-bfloat16", "qwen3", "bfloat16"),
    ("llama-float16", "llama", "float16"),
]


def _cpu() -> None:
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        pytest.skip("the host ops are the CPU backend's")


def _counts() -> tuple[int, int]:
    return _native._half_matmul_count(), _native._half_attention_count()


def _switched(
    d, switch: str | None, counts: Callable[[], tuple[int, ...]], monkeypatch
) -> tuple[list[int], np.ndarray, tuple[int, ...]]:
    """8 greedy tokens and the prompt's logits of model `d` with MLXRS_CPU_HALF unset (None) or
    `switch`, and how much each of `counts` grew meanwhile."""
    if switch is None:
        monkeypatch.delenv("MLXRS_CPU_HALF", raising=False)
    else:
        monkeypatch.setenv("MLXRS_CPU_HALF", switch)
    before = counts()
    with mlxrs.Session(d, prompt_cache_bytes=0) as s:
        ids = s.tokenize(TEXT)
        tokens = s.generate(ids, max_tokens=8, ignore_eos=True, temperature=0.0).tokens
        logits = np.array(s.logits(ids), dtype=np.float32)
    return tokens, logits, tuple(a - b for a, b in zip(counts(), before))


@pytest.mark.parametrize("name,arch,dtype", CASES, ids=[c[0] for c in CASES])
def test_16bit_models_take_the_host_ops_and_match_mlx_lm(oracle, name, arch, dtype, monkeypatch):
    _cpu()
    monkeypatch.delenv("MLXRS_CPU_HALF", raising=False)
    d = make_model(name, arch, dtype=dtype)
    mm, att = _counts()
    _check(oracle, d, TEXT, dtype=dtype)
    mm2, att2 = _counts()
    # every projection of 64 decode steps (at least q/k/v, o, gate/up, down, the head a step) and the
    # prompt's attention in every layer
    assert mm2 - mm > 64 * 4, (mm, mm2)
    assert att2 - att > 0, (att, att2)


def test_the_switch_turns_them_off_and_the_values_agree(monkeypatch):
    _cpu()
    d = make_model("llama-bfloat16", "llama", dtype="bfloat16")
    ours, ours_logits, calls = _switched(d, None, _counts, monkeypatch)
    ref, ref_logits, ref_calls = _switched(d, "0", _counts, monkeypatch)
    assert ref_calls == (0, 0), ref_calls
    assert calls[0] > 8 * 4 and calls[1] > 0, calls
    assert len(ours) == len(ref) == 8
    # the same products summed in another order, rounded to bfloat16 where MLX rounds: a logit may land
    # a bfloat16 step or two (2^-7 of its magnitude each) away
    scale = float(np.max(np.abs(ref_logits)))
    diff = float(np.max(np.abs(ours_logits - ref_logits)))
    assert diff <= 2 * 2.0**-7 * max(scale, 1.0), (diff, scale)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_a_16bit_mixture_runs_on_the_cpu_through_the_gather_op(arch, monkeypatch):
    """MLX's CPU gather_mm has only float32 (mlx-lm stops with "[GatherMM::eval] Currently only supports
    float32" on such a model): mlxrs's experts go through its host op, with the switch on or off (its
    parity against the oracle's exact gather: tests/test_parity.py `test_plain`). Both settings give
    the same prompt logits within the routers' ties (2^-5 of the largest, as there)."""
    _cpu()
    d = make_model(f"{arch}-bfloat16", arch, dtype="bfloat16")

    def gathers() -> tuple[int]:
        return (_native._half_gather_count(),)

    ours, ours_logits, (calls,) = _switched(d, None, gathers, monkeypatch)
    ref, ref_logits, (ref_calls,) = _switched(d, "0", gathers, monkeypatch)
    # every MoE layer's three projections, for the prompt and 8 decode steps, in both settings
    assert calls >= 3 * 9 and ref_calls >= 3 * 9, (calls, ref_calls)
    assert len(ours) == len(ref) == 8
    assert np.all(np.isfinite(ours_logits))
    diff = float(np.max(np.abs(ours_logits - ref_logits)))
    assert diff <= 2.0**-5 * max(float(np.max(np.abs(ref_logits))), 1.0), diff
