"""mlxrs's CUDA quantized matvec (`models/qmv.rs`) against MLX's kernel inside the engine: the logits
of prompts of 1 to 4 tokens (whose every matmul takes the kernel) with `MLXRS_CUDA_QMV` on and off, one
process each, on a model directory (bench_device.py's random-weight models):

    PYTHONPATH=/tmp/site LD_LIBRARY_PATH=/tmp/site/mlx/lib python3 bench/qmv_check.py /tmp/models/8b_q4

Prints, per prompt length, the largest logit difference relative to the largest |logit| and whether
the argmax agrees.
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


def main() -> None:
    model = sys.argv[1]
    ours, ref = run(model, True), run(model, False)
    for n, (a, b) in enumerate(zip(ours, ref), start=1):
        scale = max(abs(v) for v in b)
        diff = max(abs(x - y) for x, y in zip(a, b)) / scale
        same = max(range(len(a)), key=a.__getitem__) == max(range(len(b)), key=b.__getitem__)
        print(f"{n} tokens: max |Δlogit| / max |logit| {diff:.2e}, argmax equal {same}", flush=True)


if __name__ == "__main__":
    main()
