"""Batched decode of quantized models on a GPU: MLX's quantized matmul against a dequantized weight and
a plain matmul, per batch size, beside mlx-lm's `batch_generate` — the measurement behind
`plan::DEQUANT_ROWS_CUDA` (from how many rows a quantized matmul dequantizes its weight).

    bash bench/device_run.sh dequant --models 8b_q4,8b_q8 --batch 1,2,4,8,16,32 --out $OUT/dequant.json

One process, one mlxrs session per model (`MLXRS_DEQUANT_PREFILL_ROWS` is read per request, so the
setting changes between calls of the same session): at batch B, "dequant" runs with the threshold at B
(every decode step dequantizes) and "packed" at B + 1 (decode steps run MLX's quantized kernel; the
prompts' prefill, 128 tokens a row, dequantizes in both). Decode tokens/s is aggregate over the batch,
from the difference of two generations of --gen and 8 tokens (the prefill and the first tokens cancel);
the same for mlx-lm's `batch_generate`. Medians of --runs alternating rounds.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_device import BITS, env, make_model, open_session  # noqa: E402

ENV = "MLXRS_DEQUANT_PREFILL_ROWS"


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def decode_tps(fn_gen, bsz: int, gen: int) -> float:
    """Aggregate decode tokens/s: (gen − 8) tokens per row over the time the longer run takes more."""
    short = timed(lambda: fn_gen(8))
    long = timed(lambda: fn_gen(gen))
    return bsz * (gen - 8) / max(long - short, 1e-9)


def bench(name: str, d: Path, args) -> dict:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import batch_generate

    ref, tok = load(str(d))
    sess = open_session(d)
    out: dict = {}
    for bsz in args.batch:
        key = mx.random.key(7)
        ps = [
            [int(x) for x in mx.random.randint(0, 1000, (128,), key=mx.random.split(key, bsz)[i]).tolist()]
            for i in range(bsz)
        ]

        def mlxrs_gen(n: int, rows: int) -> list[list[int]]:
            with env({ENV: str(rows)}):
                return [o.tokens for o in sess.generate_batch(ps, max_tokens=n, ignore_eos=True)]

        def mlxlm_gen(n: int):
            return batch_generate(ref, tok, ps, max_tokens=n, return_token_ids=True)

        # warm-up: both paths' kernels at these shapes (quantized kernels JIT-compile on first use)
        mlxrs_gen(8, bsz)
        mlxrs_gen(8, bsz + 1)
        mlxlm_gen(8)
        rows: dict[str, list[float]] = {"dequant": [], "packed": [], "mlx-lm": []}
        for r in range(args.runs):
            order = ["dequant", "packed"] if r % 2 == 0 else ["packed", "dequant"]
            for k in order:
                t = bsz if k == "dequant" else bsz + 1
                rows[k].append(decode_tps(lambda n, t=t: mlxrs_gen(n, t), bsz, args.gen))
            rows["mlx-lm"].append(decode_tps(mlxlm_gen, bsz, args.gen))
        a = mlxrs_gen(args.gen, bsz)
        b = mlxrs_gen(args.gen, bsz + 1)
        med = {k: statistics.median(v) for k, v in rows.items()}
        out[str(bsz)] = {
            "dequant_tps": med["dequant"],
            "packed_tps": med["packed"],
            "mlxlm_tps": med["mlx-lm"],
            "dequant_over_packed": med["dequant"] / med["packed"],
            "best_over_mlxlm": max(med["dequant"], med["packed"]) / med["mlx-lm"],
            "rows_equal_dequant_vs_packed": sum(x == y for x, y in zip(a, b)),
            "runs": rows,
        }
        print(
            f"{name} batch {bsz}: dequant {med['dequant']:.0f}  packed {med['packed']:.0f}  "
            f"mlx-lm {med['mlx-lm']:.0f} tok/s",
            flush=True,
        )
    sess.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="8b_q4,8b_q8", help="SHAPE_TYPE as bench_device.py: 1b_q4, 8b_q8, ...")
    ap.add_argument("--batch", default="1,2,4,8,16,32")
    ap.add_argument("--gen", type=int, default=72)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--out")
    args = ap.parse_args()
    args.batch = [int(b) for b in args.batch.split(",") if b]
    res = {}
    for name in args.models.split(","):
        shape, kind = name.split("_")
        if BITS[kind] is None:
            raise SystemExit(f"{name}: not a quantized model")
        d = Path(args.dir) / f"bench-{name}"
        if not (d / "config.json").exists():
            make_model(d, shape, BITS[kind])
        res[name] = bench(name, d, args)
        gc.collect()  # the model's session and mlx-lm's copy go before the next model loads
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
