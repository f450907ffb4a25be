"""mlxrs's CUDA quantized matvec (`models/qmv.rs`) against MLX's kernel inside the engine: the logits
of prompts of 1 to 4 tokens (whose every matmul takes the kernel) with `MLXRS_CUDA_QMV` on and off, one
process each, on a model directory (bench_device.py's random-weight models):

    PYTHONPATH=/tmp/site LD_LIBRARY_PATH=/tmp/site/mlx/lib python3 bench/qmv_check.py /tmp/models/8b_q4

Prints, per prompt length, the largest logit difference relative to the largest |logit| and whether
the argmax agrees.

`--rope` instead checks the fused q/k/v kernel's rotary epilogue (`qmv::qkv_rope`) and the RMSNorm in
the 4-bit kernel's prologue (`qmv::Norm`) against MLX's rope and rms_norm ops around the product
(`MLXRS_CUDA_QKV_ROPE=0 MLXRS_CUDA_QMV_NORM=0`), both with the kernel on:
48 greedy decode steps of one prompt and of a batch of three (every step's q/k/v through it), and
prints where the tokens first part and the largest difference of the chosen tokens' log-probabilities
before that:

    python3 bench/qmv_check.py --rope /tmp/models/8b_q4 1b_q4+llama3 1b_q8+traditional ...

(a model directory, or SHAPE_KIND[+VARIANT] of bench_device.py's models, made under /tmp/qmv-check:
`llama3` Llama 3.1's rope_scaling, the frequencies path; `traditional` the interleaved rotation).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys
import mlxrs
s = mlxrs.Session(sys.argv[1])
print(json.dumps([s.logits(list(range(3, 3 + n))) for n in (1, 2, 3, 4)]))
"""


def run(model: str, on: bool) -> list[list[float]]:
    env = dict(os.environ, MLXRS_CUDA_QMV="1" if on else "0")
    p = subprocess.run([sys.executable, "-c", CHILD, model], env=env, capture_output=True, text=True, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


DECODE = r"""
import json, sys
import mlxrs
s = mlxrs.Session(sys.argv[1])
opts = dict(max_tokens=48, temperature=0.0, logprobs=True, ignore_eos=True)
one = s.generate(list(range(3, 40)), **opts)
batch = s.generate_batch([list(range(3 + i, 30 + 5 * i)) for i in range(3)], **opts)
print(json.dumps([[c.tokens, [lp.logprob for lp in c.logprobs]] for c in [one, *batch]]))
"""


def decode(model: str, fused: bool) -> list:
    on = "1" if fused else "0"
    env = dict(os.environ, MLXRS_CUDA_QMV="1", MLXRS_CUDA_QKV_ROPE=on, MLXRS_CUDA_QMV_NORM=on)
    p = subprocess.run([sys.executable, "-c", DECODE, model], env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{model}: {p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


VARIANTS = {
    "": {},
    "llama3": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    },
    "traditional": {"rope_traditional": True},
}


def bench_device():  # noqa: ANN201
    """bench/bench_device.py (its models and `first_divergence`), with tests/ importable as it needs."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path[:0] = [here, os.path.join(here, "..", "tests")]
    import bench_device

    return bench_device


def model_dir(spec: str) -> str:
    """A directory as given, else bench_device.py's model SHAPE_KIND with VARIANTS[variant], made once."""
    if os.path.isdir(spec):
        return spec
    from pathlib import Path

    bd = bench_device()
    name, _, variant = spec.partition("+")
    shape, kind = name.split("_")
    d = Path("/tmp/qmv-check") / spec.replace("+", "-")
    if not (d / "config.json").exists():
        bd.make_model(d, shape, bd.BITS[kind], VARIANTS[variant])
    return str(d)


def check_rope(specs: list[str]) -> None:
    for model in map(model_dir, specs):
        ours, ref = decode(model, True), decode(model, False)
        for name, (a, b) in zip(["alone", "batch row 0", "batch row 1", "batch row 2"], zip(ours, ref)):
            (ta, la), (tb, lb) = a, b
            part = bench_device().first_divergence(ta, tb)
            upto = len(ta) if part is None else part
            d = max((abs(x - y) for x, y in zip(la[:upto], lb[:upto])), default=0.0)
            where = "never" if part is None else f"at step {part}"
            print(f"{model} {name}: tokens part {where}; max |Δ logprob| before {d:.3e}", flush=True)


def main() -> None:
    if sys.argv[1] == "--rope":
        check_rope(sys.argv[2:])
        return
    model = model_dir(sys.argv[1])
    ours, ref = run(model, True), run(model, False)
    for n, (a, b) in enumerate(zip(ours, ref), start=1):
        scale = max(abs(v) for v in b)
        diff = max(abs(x - y) for x, y in zip(a, b)) / scale
        same = max(range(len(a)), key=a.__getitem__) == max(range(len(b)), key=b.__getitem__)
        print(f"{n} tokens: max |Δlogit| / max |logit| {diff:.2e}, argmax equal {same}", flush=True)


if __name__ == "__main__":
    main()
