"""MLX ops per decode step and decode ms/token, fused projections on and off, in one process (CPU).

    python bench/ops_per_step.py [rounds] [model_dir ...]

Without model directories: the tiny test models of tests/tinymodels.py (llama, qwen2, qwen3,
gemma3_text, ministral3, fp32 and 4-bit) and a model with Llama 3.2 1B's layer structure (16
layers, 32 query heads over 8 KV heads of 64 dims; narrow hidden and MLP widths: the op count
depends on the structure, not the widths).

Ops per step: `mlxrs._native._op_count()` (every MLX op mlxrs builds, crates/mlxrs-core
handle/ops.rs `op_count`) over two greedy generations of the same prompt, 4 and 20 tokens, without
the prompt cache: (ops(20) - ops(4)) / 16 is exactly one decode step's ops (checked against a third
generation of 36 tokens). ms/token: the engine's `timings.generation_tps` of a 33-token generation,
median over `rounds` rounds (default 3), fused and unfused sessions alternating (MLXRS_FUSED_PROJ
read at load). Also checks that both decode the same tokens.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import mlxrs
from mlxrs import _native

MODES = {"fused": "1", "unfused": "0"}


def default_models() -> list[Path]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tinymodels import make_model  # type: ignore[import-not-found]

    out = []
    for arch in ("llama", "qwen2", "qwen3", "gemma3_text", "ministral3"):
        out.append(make_model(f"{arch}-float32", arch))
        if arch != "ministral3":
            out.append(make_model(f"{arch}-q4", arch, quant_bits=4))
    shape = dict(layers=16, heads=32, kv_heads=8, head_dim=64, hidden=256, inter=512)
    out.append(make_model("llama-1bshape-float32", "llama", **shape))
    return out


def ops_per_step(s: mlxrs.Session, prompt: list[int]) -> float:
    def ops(n: int) -> int:
        before = _native._op_count()
        s.generate(prompt, max_tokens=n, ignore_eos=True, temperature=0.0)
        return _native._op_count() - before

    s.generate(prompt, max_tokens=4, ignore_eos=True, temperature=0.0)  # traces the compiled functions
    a, b, c = ops(4), ops(20), ops(36)
    per = (b - a) / 16
    if (c - b) / 16 != per:
        raise SystemExit(f"ops per step not constant: {per} then {(c - b) / 16}")
    return per


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    models = [Path(p) for p in sys.argv[2:]] or default_models()
    prompt = [(7919 * i) % 500 + 3 for i in range(24)]
    print(f"{'model':28} {'ops/step fused':>14} {'unfused':>8} {'ms/tok fused':>12} {'unfused':>8}  same tokens")
    for d in models:
        ops: dict[str, float] = {}
        ms: dict[str, list[float]] = {m: [] for m in MODES}
        toks: dict[str, list[int]] = {}
        for r in range(rounds):
            for m in list(MODES)[r % 2 :] + list(MODES)[: r % 2]:
                os.environ["MLXRS_FUSED_PROJ"] = MODES[m]
                with mlxrs.Session(d, prompt_cache_bytes=0) as s:
                    if m not in ops:
                        ops[m] = ops_per_step(s, prompt)
                    c = s.generate(prompt, max_tokens=33, ignore_eos=True, temperature=0.0)
                    ms[m].append(1000 / c.timings.generation_tps)
                    toks.setdefault(m, c.tokens)
        med = {m: statistics.median(v) for m, v in ms.items()}
        same = toks["fused"] == toks["unfused"]
        print(
            f"{d.name:28} {ops['fused']:14.0f} {ops['unfused']:8.0f} {med['fused']:12.2f} {med['unfused']:8.2f}  {same}"
        )
    os.environ.pop("MLXRS_FUSED_PROJ", None)
    print("load", os.getloadavg())


if __name__ == "__main__":
    main()
