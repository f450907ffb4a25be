"""Fast paths against their reference paths, on the CPU (the GPU runs them by default; there the
same comparison is made on the device, bench/RESULTS-gpu.md):

- quantized matmuls through a dequantized weight (models/layers.rs `quant_matmul`, on CUDA from
  `plan::DEQUANT_ROWS_CUDA` rows) against MLX's packed quantized kernel: the same greedy tokens and
  last-position logits within float32 rounding, forced on every matmul here with
  MLXRS_DEQUANT_PREFILL_ROWS=1; and, on the CPU, a prefill chunk's attention over a quantized KV
  cache (`kv_bits`, float32 activations: models/layers.rs `dequant_kv`) through its keys and values
  dequantized to float32 against MLX's quantized matmul.
- fused projections (models/layers.rs `Linear::concat`: q/k/v as one linear, gate/up as one, for
  the decoders built on models/llama.rs and gemma3_text) against the separate projections
  (MLXRS_FUSED_PROJ=0): the same greedy tokens, last-position logits within 1e-5 (float32
  activations, dense and 4-bit weights), fewer MLX ops per decode step (`mlxrs._native._op_count`)
  and the same resident memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import mlxrs
from mlxrs import _native
from tinymodels import make_model

RUN = r"""
import json, sys
import mlxrs
kv = int(sys.argv[2]) if len(sys.argv) > 2 else None
with mlxrs.Session(sys.argv[1], prefill_step_size=16, kv_bits=kv) as s:
    ids = s.tokenize("The quick brown fox jumps over the lazy dog. Paris is the capital of France.") * 2
    out = s.generate(ids, max_tokens=32, ignore_eos=True, temperature=0.0)
    logits = s.logits(ids)
    print(json.dumps({"tokens": out.tokens, "logits": logits, "ops": mlxrs._native._op_count()}))
"""


def _run(model, rows: str | None, kv_bits: int | None = None) -> dict:
    env = dict(os.environ)
    env.pop("MLXRS_DEQUANT_PREFILL_ROWS", None)
    if rows is not None:
        env["MLXRS_DEQUANT_PREFILL_ROWS"] = rows
    args = [sys.executable, "-c", RUN, str(model)] + ([str(kv_bits)] if kv_bits else [])
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


# (model, architecture, make_model keywords): affine 4-bit, and gpt-oss in mxfp4 (its attention,
# embedding and head: uint8 scales, no biases)
DEQUANT_CASES = [(f"{a}-q4", a, dict(quant_bits=4)) for a in ("llama", "qwen3", "gemma3_text")] + [
    ("gpt_oss-mxfp4", "gpt_oss", dict(quant_bits=4, quant_mode="mxfp4"))
]


@pytest.mark.parametrize("name,arch,kw", DEQUANT_CASES, ids=[c[0] for c in DEQUANT_CASES])
def test_dequantized_matmul_matches_the_quantized_kernel(name, arch, kw):
    d = make_model(name, arch, **kw)
    ref = _run(d, "0")  # 0: never dequantized (the packed kernels)
    fast = _run(d, "1")  # every quantized matmul through a dequantized weight
    default = _run(d, None)  # the backend's threshold (on the CPU: prefill chunks of 9+ rows)
    for other in (fast, default):
        diff = float(np.max(np.abs(np.array(other["logits"]) - np.array(ref["logits"]))))
        assert diff < 1e-3, diff
        assert other["tokens"] == ref["tokens"]
    assert _run(d, "0") == ref  # deterministic: the same path gives the same values


@pytest.mark.parametrize("kv_bits", [4, 8])
def test_dequantized_kv_cache_matches_the_quantized_matmul(kv_bits):
    """A float32 model with a quantized KV cache: its prefill chunks (16 rows here) attend over the
    cache's keys and values dequantized to float32 on the CPU (the default), every step does with
    `MLXRS_DEQUANT_PREFILL_ROWS=1`, none with `0` (MLX's quantized matmul, mlx-lm's path): the same
    greedy tokens and last-position logits within float32 summation order (the parity suite compares
    the default with mlx-lm itself: test_parity.py `test_quantized_kv`)."""
    d = make_model("llama-float32", "llama")
    ref = _run(d, "0", kv_bits)
    for rows in (None, "1"):
        other = _run(d, rows, kv_bits)
        diff = float(np.max(np.abs(np.array(other["logits"]) - np.array(ref["logits"]))))
        assert diff < 1e-4, (rows, diff)
        assert other["tokens"] == ref["tokens"], rows
        # the path taken shows in the op count: the keys and the values dequantized (two ops) and the
        # keys transposed where the quantized matmuls took three arrays each (grouped-query heads:
        # each expanded, six ops): one op fewer an attention
        assert other["ops"] < ref["ops"], (rows, other["ops"], ref["ops"])


def test_the_dequant_threshold_applies_to_batched_decode_and_is_read_per_request(monkeypatch):
    """A batched decode step of B sequences has B rows: from `MLXRS_DEQUANT_PREFILL_ROWS` = B its
    quantized matmuls go through dequantized weights (more MLX ops: dequantize and transpose before
    each matmul), at B + 1 through the packed kernel; the same tokens either way. One session: the
    variable is read per request."""
    d = make_model("llama-q4", "llama", quant_bits=4)
    with mlxrs.Session(d, prompt_cache_bytes=0) as s:
        prompts = [s.tokenize(t) for t in ("The quick brown fox", "Paris is the capital of", "One two", "x y z w")]

        def run(rows: int, n: int) -> tuple[list[list[int]], int]:
            monkeypatch.setenv("MLXRS_DEQUANT_PREFILL_ROWS", str(rows))
            before = _native._op_count()
            out = s.generate_batch(prompts, max_tokens=n, ignore_eos=True, temperature=0.0)
            return [o.tokens for o in out], _native._op_count() - before

        def per_step(rows: int) -> tuple[list[list[int]], float]:
            short, a = run(rows, 4)
            toks, b = run(rows, 12)
            assert [t[:4] for t in toks] == short
            return toks, (b - a) / 8

        dq_toks, dq_ops = per_step(len(prompts))
        packed_toks, packed_ops = per_step(len(prompts) + 1)
        dq_again, dq_ops_again = per_step(len(prompts))
    assert dq_toks == packed_toks == dq_again
    # each quantized linear of a step: dequantize + transpose + matmul instead of one quantized matmul
    assert min(dq_ops, dq_ops_again) > packed_ops, (dq_ops, dq_ops_again, packed_ops)


# every architecture whose loader fuses (llama.rs's decoder and its users, gemma3_text), float32;
# the dense ones also 4-bit (quantized weights, scales and biases stacked row for row); gpt_oss's
# q/k/v carry biases, qwen3_moe/glm4_moe have dense layers among the MoE ones
FUSED_CASES = [
    (f"{a}-float32", a, {})
    for a in (
        "llama",
        "qwen2",
        "qwen3",
        "gemma3_text",
        "ministral3",
        "mistral3_llama",
        "qwen3_moe",
        "mixtral",
        "glm4_moe",
    )
] + [(f"{a}-q4", a, dict(quant_bits=4)) for a in ("llama", "qwen2", "qwen3", "gemma3_text", "ministral3", "gpt_oss")]
FUSED_CASES.append(("gpt_oss-float32", "gpt_oss", {}))
PROMPT = [(7919 * i) % 500 + 3 for i in range(24)]


def _decode(d, mode: str, monkeypatch) -> dict:
    """Greedy tokens, last-position logits, MLX ops per decode step and active memory of a Session
    of `d` loaded with MLXRS_FUSED_PROJ=`mode`."""
    monkeypatch.setenv("MLXRS_FUSED_PROJ", mode)
    with mlxrs.Session(d, prompt_cache_bytes=0) as s:
        tokens = s.generate(PROMPT, max_tokens=24, ignore_eos=True, temperature=0.0).tokens
        counts = []
        for n in (4, 12):
            before = _native._op_count()
            s.generate(PROMPT, max_tokens=n, ignore_eos=True, temperature=0.0)
            counts.append(_native._op_count() - before)
        logits = np.array(s.logits(PROMPT), dtype=np.float32)
        # more than 32 rows: the fused projections run part by part (Linear::forward_parts)
        long = s.generate(PROMPT * 2, max_tokens=8, ignore_eos=True, temperature=0.0).tokens
        long_logits = np.array(s.logits(PROMPT * 2), dtype=np.float32)
        memory = mlxrs.runtime_info()["active_memory"]
    return {
        "tokens": tokens,
        "logits": logits,
        "long": long,
        "long_logits": long_logits,
        "ops": (counts[1] - counts[0]) / 8,
        "memory": memory,
    }


@pytest.mark.parametrize("name,arch,kw", FUSED_CASES, ids=[c[0] for c in FUSED_CASES])
def test_fused_projections_match_the_separate_ones(name, arch, kw, monkeypatch):
    d = make_model(name, arch, **kw)
    ref = _decode(d, "0", monkeypatch)
    fused = _decode(d, "1", monkeypatch)
    assert fused["tokens"] == ref["tokens"]
    assert fused["long"] == ref["long"]
    for k in ("logits", "long_logits"):
        diff = float(np.max(np.abs(fused[k] - ref[k])))
        # OpenBLAS's sgemm blocks a wider product otherwise: the fused one sums in another order
        assert diff < 1e-4, f"fused projections move the {k} by {diff}"
    # every layer's q/k/v at least (gate/up: one matmul and a split for two matmuls)
    assert fused["ops"] < ref["ops"], (fused["ops"], ref["ops"])
    # the parts were dropped: no more resident bytes than the separate projections
    assert fused["memory"] <= ref["memory"] * 1.01 + (1 << 16), (fused["memory"], ref["memory"])
