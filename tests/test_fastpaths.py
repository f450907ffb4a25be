"""Fast paths against their reference paths, on the CPU (the GPU runs them by default; there the
same comparison is made on the device, bench/RESULTS-gpu.md):

- quantized matmuls through a dequantized weight (models/layers.rs `quant_matmul`, on CUDA from
  `plan::DEQUANT_ROWS_CUDA` rows) against MLX's packed quantized kernel: the same greedy tokens and
  last-position logits within float32 rounding, forced on every matmul here with
  MLXRS_DEQUANT_PREFILL_ROWS=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tinymodels import make_model

RUN = r"""
import json, sys
import mlxrs
with mlxrs.Session(sys.argv[1], prefill_step_size=16) as s:
    ids = s.tokenize("The quick brown fox jumps over the lazy dog. Paris is the capital of France.") * 2
    out = s.generate(ids, max_tokens=32, ignore_eos=True, temperature=0.0)
    print(json.dumps({"tokens": out.tokens, "logits": s.logits(ids)}))
"""


def _run(model, rows: str | None) -> dict:
    env = dict(os.environ)
    env.pop("MLXRS_DEQUANT_PREFILL_ROWS", None)
    if rows is not None:
        env["MLXRS_DEQUANT_PREFILL_ROWS"] = rows
    r = subprocess.run([sys.executable, "-c", RUN, str(model)], capture_output=True, text=True, env=env, timeout=300)
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
    ref = _run(d, None)  # the packed kernel (the CPU default)
    fast = _run(d, "1")  # every quantized matmul through a dequantized weight
    off = _run(d, "0")  # 0 switches the fast path off: the reference again
    assert off == ref
    diff = float(np.max(np.abs(np.array(fast["logits"]) - np.array(ref["logits"]))))
    assert diff < 1e-3, diff
    assert fast["tokens"] == ref["tokens"]
