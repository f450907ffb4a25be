"""Every architecture's parity with mlx-lm on a GPU (MLX's CUDA backend on the H200 test machine, or
Metal): the tiny random models of tests/tinymodels.py in float32, bfloat16 (which MLX's CPU cannot
run for MoE experts: the CPU test suite skips those) and 4-bit; for each, mlxrs's greedy tokens and
last-position logits against mlx-lm 0.32.2's (tests/oracle_mlxlm.py in a subprocess), a batch of
mixed-length prompts decoded together (the stacked KV, the GPU default) against each prompt alone,
and, for the MoE architectures, the experts streamed from the files.

    python bench/device_parity.py [--archs llama,qwen3_moe] [--variants float32,bfloat16-q4,bfloat16-mxfp4]
                                  [--out parity.json] [--no-compile] [--oracle-batch]

--no-compile runs both engines with MLX_DISABLE_COMPILE=1 (MLX's compiler off: every op its own
kernel), which tells a difference in where the two fuse ops from one in what they compute.
--oracle-batch also decodes the same batch with mlx-lm's BatchGenerator (bench/oracle_batch.py) and
records where its rows leave mlx-lm's own single-sequence runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

TEXT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France; Berlin of Germany."
N = 32
ARCHS = [
    "llama",
    "qwen2",
    "qwen3",
    "gemma3_text",
    "gemma4_text",
    "qwen3_next",
    "qwen3_5",
    "qwen3_moe",
    "mixtral",
    "glm4_moe",
    "gpt_oss",
    "gemma4_text_moe",
    "qwen3_5_moe",
    "deepseek_v3",
    "deepseek_v32",
    "glm_moe_dsa",
    "mistral4",
]
MOE = {
    "qwen3_moe",
    "mixtral",
    "glm4_moe",
    "gpt_oss",
    "gemma4_text_moe",
    "qwen3_next",
    "qwen3_5_moe",
    "deepseek_v3",
    "deepseek_v32",
    "glm_moe_dsa",
    "mistral4",
}
TOL = {"float32": 1e-3, "bfloat16": 5e-2}


def oracle(d: Path, ids: list[int]) -> dict:
    job = {
        "model": str(d),
        "prompt": ids,
        "max_tokens": N,
        "kv_bits": None,
        "max_kv_size": None,
        "prefill_step_size": 2048,
    }
    r = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "oracle_mlxlm.py")],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    return json.loads(r.stdout)


def oracle_batch(d: Path, prompts: list[list[int]]) -> list[int | None]:
    """Where each row of mlx-lm's BatchGenerator first leaves mlx-lm's own run of it alone."""
    job = {"model": str(d), "prompts": prompts, "max_tokens": N}
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "oracle_batch.py")],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    out = json.loads(r.stdout)
    return [
        next((i for i, (x, y) in enumerate(zip(b, al)) if x != y), None) for b, al in zip(out["batch"], out["alone"])
    ]


def one(arch: str, dtype: str, quant: int | None, with_oracle_batch: bool = False, mode: str = "affine") -> dict:
    import numpy as np

    import mlxrs
    from tinymodels import make_model

    name = f"{arch}-{dtype}" + (f"-q{quant}" if quant else "") + ("" if mode == "affine" else f"-{mode}")
    row: dict = {"arch": arch, "dtype": dtype, "quant": quant, "mode": mode}
    try:
        d = make_model(name, arch, dtype=dtype, quant_bits=quant, quant_mode=mode)
        with mlxrs.Session(d) as s:
            ids = s.tokenize(TEXT)
            ours = s.generate(ids, max_tokens=N, ignore_eos=True, temperature=0.0).tokens
            logits = np.array(s.logits(ids), dtype=np.float32)
            ps = [ids[:n] for n in (3, len(ids), 11, 27)]
            alone = [s.generate(p, max_tokens=N, ignore_eos=True, temperature=0.0).tokens for p in ps]
            batch = [r.tokens for r in s.generate_batch(ps, max_tokens=N, ignore_eos=True, temperature=0.0)]
            row["stacked_decode_steps"] = s.info["stacked_decode_steps"]
        ref = oracle(d, ids)
        row["tokens_equal"] = ours == ref["tokens"]
        row["first_diff"] = next((i for i, (a, b) in enumerate(zip(ours, ref["tokens"])) if a != b), None)
        row["logits_max_diff"] = float(np.max(np.abs(logits - np.array(ref["logits"], dtype=np.float32))))
        row["logits_ok"] = row["logits_max_diff"] <= TOL[dtype] * (4 if quant else 1)
        row["batch_equals_alone"] = batch == alone
        # where each batched row first leaves its alone run (None: never), of N tokens
        row["batch_first_diff"] = [
            next((i for i, (x, y) in enumerate(zip(b, al)) if x != y), None) for b, al in zip(batch, alone)
        ]
        if with_oracle_batch:
            row["oracle_batch_first_diff"] = oracle_batch(d, ps)
        if arch in MOE:
            with mlxrs.Session(d, stream_experts=True) as s:
                st = s.generate(ids, max_tokens=N, ignore_eos=True, temperature=0.0).tokens
                x = s.info["experts"]
            row["streamed_equal"] = st == ours
            row["streamed_hit_rate"] = x["hit_rate"]
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--variants", default="float32,bfloat16,float32-q4")
    ap.add_argument("--out")
    ap.add_argument("--no-compile", action="store_true", help="MLX_DISABLE_COMPILE=1 for both engines")
    ap.add_argument("--oracle-batch", action="store_true", help="mlx-lm's BatchGenerator vs its own alone runs")
    a = ap.parse_args()
    if a.no_compile:  # read by MLX at its first compile: before mlxrs is imported, inherited by the oracle
        os.environ["MLX_DISABLE_COMPILE"] = "1"
    rows = []
    t0 = time.time()
    for arch in a.archs.split(","):
        for v in a.variants.split(","):
            # float32, float32-q4 (affine 4-bit), bfloat16-mxfp4 / -mxfp8 / -nvfp4 (MLX's microscaling modes)
            dtype, _, q = v.partition("-")
            mode = q if q in ("mxfp4", "mxfp8", "nvfp4") else "affine"
            bits = (8 if q == "mxfp8" else 4) if mode != "affine" else (int(q[1:]) if q else None)
            r = one(arch, dtype, bits, a.oracle_batch, mode)
            rows.append(r)
            print(json.dumps(r), flush=True)
            if a.out:  # after every row: a run cut short still leaves what it measured
                Path(a.out).write_text(json.dumps({"rows": rows}, indent=1))
    ok = [
        r
        for r in rows
        if "error" not in r
        and r["tokens_equal"]
        and r["logits_ok"]
        and r["batch_equals_alone"]
        and r.get("streamed_equal", True)
    ]
    print(f"{len(ok)}/{len(rows)} rows agree with mlx-lm ({time.time() - t0:.0f} s)")
    if a.out:
        Path(a.out).write_text(
            json.dumps(
                {"rows": rows, "env": {k: os.environ.get(k) for k in ("MLXRS_BATCH_KV", "MLX_DISABLE_COMPILE")}},
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
