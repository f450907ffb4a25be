"""The gated delta rule's CUDA kernel (crates/mlxrs-core/src/models/gated_delta.rs) against the
reference recurrence, on a GPU of MLX's CUDA backend (the H200 test machine):

1. the op, on random inputs (float32 and bfloat16; decode and prefill lengths; key head dims 32,
   64, 128; value heads sharing key heads; several rows): the kernel's y and state against our
   reference ops path, mlx-lm 0.32.2's `gated_delta_ops` on the same values and a float64 numpy
   recurrence; and the recurrence cut into chunks at odd boundaries (the state carried between
   kernel calls) against one call — the max abs error of each, and MLX's own
   `mx.fast.gated_delta_update` beside them for information;
2. the models (tests/tinymodels.py's qwen3_5 and qwen3_next, float32 and bfloat16): with the
   kernel (MLXRS_GDN_KERNEL=1) and without (=0) in one process: greedy tokens and last-position
   logits of a prompt prefilled in chunks of 16, a batch of mixed lengths against each prompt alone,
   and a prompt-prefix cache hit against the cold run (the recurrent-state snapshot);
3. the time of one 512-token chunk of Qwen3.5's shape (16 key heads, 32 value heads, 128 × 128) both ways.

    python bench/check_gdn_kernel.py [--out gdn.json]           (exit 1 when a check fails)
    bash bench/device_run.sh gdn [--out $OUT/gdn.json]          (on the device, with .device/ carried)
    python bench/check_gdn_kernel.py --mlx-only                 (no mlxrs needed: the kernel source,
        read from gated_delta.rs, through MLX's Python mx.fast.cuda_kernel — the C++ function mlx-c's
        mlx_fast_cuda_kernel_* wraps — against mlx-lm's gated_delta_ops; what bench/RESULTS-gpu.md records)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

# max abs error allowed, relative to max(1, max |reference|): the state is float32 either way
TOL = {"float32": {"y": 1e-4, "state": 1e-4}, "bfloat16": {"y": 2e-2, "state": 1e-4}}
TEXT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France; Berlin of Germany."


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (round to nearest even, as MLX's astype)."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return (((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF).astype(np.uint16)


def widen(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def run_op(name: str, arrays: list[np.ndarray], dtypes: list[str]) -> list[np.ndarray]:
    import arrays_util  # tests/: needs the test build's mlxrs._native._op (the `testing` feature)

    raws = [
        arrays_util.to_raw(bf16_bits(a), "bfloat16") if d == "bfloat16" else arrays_util.to_raw(a.astype(np.float32))
        for a, d in zip(arrays, dtypes)
    ]
    return [arrays_util.from_raw(o) for o in arrays_util.native_op()(name, raws, "{}")]


def numpy_ref(q, k, v, g, beta, state):
    from arrays_util import np_gated_delta  # tests/: the float64 recurrence tests/test_ops.py checks against

    return np_gated_delta(q, k, v, g, beta, state)


def inputs(shape: tuple[int, int, int, int, int, int], seed: int, dtype: str):
    b, t, hk, hv, dk, dv = shape
    r = np.random.default_rng(seed)

    def unit(x):  # l2-normalised along the head dim, as normalize_qk leaves q and k (q also * dk^-0.5)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q = (unit(r.standard_normal((b, t, hk, dk))) * dk**-0.5).astype(np.float32)
    k = unit(r.standard_normal((b, t, hk, dk))).astype(np.float32)
    v = r.standard_normal((b, t, hv, dv)).astype(np.float32)
    g = r.uniform(0.6, 1.0, (b, t, hv)).astype(np.float32)
    beta = r.uniform(0.0, 1.0, (b, t, hv)).astype(np.float32)
    state = (r.standard_normal((b, hv, dv, dk)) * 0.1).astype(np.float32)
    if dtype == "bfloat16":  # the values the bf16 paths see
        q, k, v, beta = (widen(bf16_bits(a)) for a in (q, k, v, beta))
    return [q, k, v, g, beta, state]


def err(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - ref)) / max(1.0, float(np.max(np.abs(ref)))))


def check_op(shape, dtype: str, seed: int) -> dict:
    import mlx.core as mx
    from mlx_lm.models.gated_delta import gated_delta_ops as mlxlm_ops

    xs = inputs(shape, seed, dtype)
    dts = [dtype, dtype, dtype, "float32", dtype, "float32"]
    ky, ks = run_op("gated_delta_kernel", xs, dts)
    ry, rs = run_op("gated_delta_ops", xs, dts)
    ny, ns = numpy_ref(*xs)
    mt = mx.bfloat16 if dtype == "bfloat16" else mx.float32
    mq, mk, mv, mg, mb, ms = (mx.array(a).astype(mt if i in (0, 1, 2, 4) else mx.float32) for i, a in enumerate(xs))
    ly, ls = mlxlm_ops(mq, mk, mv, mg, mb, ms)
    ly, ls = np.array(ly.astype(mx.float32)), np.array(ls)
    row = {
        "shape": dict(zip("B T Hk Hv Dk Dv".split(), shape)),
        "dtype": dtype,
        "kernel_vs_numpy": {"y": err(ky, ny), "state": err(ks, ns)},
        "reference_vs_numpy": {"y": err(ry, ny), "state": err(rs, ns)},
        "kernel_vs_reference": {"y": err(ky, ry.astype(np.float64)), "state": err(ks, rs.astype(np.float64))},
        "reference_vs_mlx_lm": {"y": err(ry, ly.astype(np.float64)), "state": err(rs, ls.astype(np.float64))},
    }
    # the same tokens in chunks (the state carried from one kernel call to the next)
    t = shape[1]
    if t > 2:
        cuts = sorted({1, t // 3 + 1, t - 1})
        state, ys = xs[5], []
        for lo, hi in zip([0, *cuts], [*cuts, t]):
            part = [a[:, lo:hi] for a in xs[:5]] + [state]
            y, state = run_op("gated_delta_kernel", part, dts)
            ys.append(y)
        row["chunked_vs_one_call"] = {
            "cuts": cuts,
            "y": err(np.concatenate(ys, 1), ky.astype(np.float64)),
            "state": err(state, ks.astype(np.float64)),
        }
    if hasattr(mx.fast, "gated_delta_update"):  # MLX's own op, for information
        try:
            fy, fs = mx.fast.gated_delta_update(mq, mk, mv, mg, mb, ms)
            row["mlx_fast_vs_numpy"] = {"y": err(np.array(fy.astype(mx.float32)), ny), "state": err(np.array(fs), ns)}
        except Exception as e:  # noqa: BLE001 - informational
            row["mlx_fast_vs_numpy"] = f"{type(e).__name__}: {str(e)[:200]}"
    tol = TOL[dtype]
    row["ok"] = all(
        row[k]["y"] <= tol["y"] and row[k]["state"] <= tol["state"]
        for k in ("kernel_vs_numpy", "kernel_vs_reference", "reference_vs_numpy")
    )
    if "chunked_vs_one_call" in row:
        row["ok"] = (
            row["ok"] and row["chunked_vs_one_call"]["y"] <= 1e-6 and row["chunked_vs_one_call"]["state"] <= 1e-6
        )
    return row


def check_model(arch: str, dtype: str) -> dict:
    import mlxrs
    from tinymodels import make_model

    d = make_model(f"{arch}-{dtype}", arch, dtype=dtype)
    out: dict = {"arch": arch, "dtype": dtype}
    for switch in ("0", "1"):
        os.environ["MLXRS_GDN_KERNEL"] = switch
        with mlxrs.Session(d, prefill_step_size=16) as s:
            ids = s.tokenize(TEXT) * 2
            gen = s.generate(ids, max_tokens=32, ignore_eos=True, temperature=0.0).tokens
            logits = np.array(s.logits(ids), dtype=np.float32)
            ps = [ids[:n] for n in (3, len(ids), 11, 27)]
            alone = [s.generate(p, max_tokens=24, ignore_eos=True, temperature=0.0).tokens for p in ps]
            batch = [r.tokens for r in s.generate_batch(ps, max_tokens=24, ignore_eos=True, temperature=0.0)]
        with mlxrs.Session(d, prompt_cache_bytes=0) as cold, mlxrs.Session(d) as warm:
            first, longer = ids[:40], ids[:40] + ids[5:30]
            hits = []
            for p in (first, longer, longer):
                hits.append(
                    warm.generate(p, max_tokens=24, ignore_eos=True).tokens
                    == cold.generate(p, max_tokens=24, ignore_eos=True).tokens
                )
            cached = warm.info["prompt_cache"]
        out[f"switch{switch}"] = {
            "tokens": gen,
            "logits": logits,
            "batch_equals_alone": batch == alone,
            "prefix_hit_equals_cold": all(hits),
            "prompt_cache": cached,
        }
    os.environ.pop("MLXRS_GDN_KERNEL", None)
    a, b = out.pop("switch0"), out.pop("switch1")
    out["tokens_equal"] = a["tokens"] == b["tokens"]
    out["first_diff"] = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), None)
    out["logits_max_diff"] = float(np.max(np.abs(a["logits"] - b["logits"])))
    out["batch_equals_alone"] = {"reference": a["batch_equals_alone"], "kernel": b["batch_equals_alone"]}
    out["prefix_hit_equals_cold"] = {"reference": a["prefix_hit_equals_cold"], "kernel": b["prefix_hit_equals_cold"]}
    out["prompt_cache_kernel"] = b["prompt_cache"]  # the hits the warm session served
    out["ok"] = (
        out["logits_max_diff"] <= (1e-3 if dtype == "float32" else 5e-2)
        and b["batch_equals_alone"]
        and b["prefix_hit_equals_cold"]
    )
    return out


def time_chunk(t: int = 512) -> dict:
    shape = (1, t, 16, 32, 128, 128)
    xs = inputs(shape, 7, "bfloat16")
    dts = ["bfloat16", "bfloat16", "bfloat16", "float32", "bfloat16", "float32"]
    row: dict = {"shape": dict(zip("B T Hk Hv Dk Dv".split(), shape)), "dtype": "bfloat16"}
    for name in ("gated_delta_kernel", "gated_delta_ops"):
        run_op(name, xs, dts)  # warm-up (the kernel compiles once per shape)
        t0 = time.perf_counter()
        for _ in range(3):
            run_op(name, xs, dts)
        row[f"{name}_ms"] = (time.perf_counter() - t0) / 3 * 1e3  # includes the copies in and out
    return row


def mlx_only() -> int:
    """The kernel source through MLX's Python API against mlx-lm's ops, timed both ways."""
    import re

    import mlx.core as mx
    from mlx_lm.models.gated_delta import gated_delta_ops

    rs = (ROOT / "crates/mlxrs-core/src/models/gated_delta.rs").read_text()
    source = re.search(r'const SOURCE: &str = r#"(.*?)"#;', rs, re.S).group(1)
    kern = mx.fast.cuda_kernel(
        name="mlxrs_gated_delta_step",
        input_names=["q", "k", "v", "g", "beta", "state_in"],
        output_names=["y", "state_out"],
        source=source,
    )

    def run(q, k, v, g, b, s):
        bsz, _, hk, dk = q.shape
        hv, dv = v.shape[2:]
        return kern(
            inputs=[q, k, v, g, b, s],
            template=[("InT", q.dtype), ("StT", s.dtype), ("Dk", dk), ("Dv", dv), ("Hk", hk), ("Hv", hv)],
            grid=(32, dv, bsz * hv),
            threadgroup=(32, 4, 1),
            output_shapes=[v.shape, s.shape],
            output_dtypes=[q.dtype, s.dtype],
        )

    def ms(f):
        mx.eval(f())
        t0 = time.perf_counter()
        for _ in range(3):
            mx.eval(f())
        return (time.perf_counter() - t0) / 3 * 1e3

    def rel(a, c):
        c = c.astype(mx.float32)
        return float(mx.abs(a.astype(mx.float32) - c).max() / mx.maximum(1, mx.abs(c).max()))

    bad = 0
    for dt in (mx.float32, mx.bfloat16):
        for i, shape in enumerate(
            [
                (1, 1, 2, 4, 128, 128),
                (2, 37, 2, 4, 128, 128),
                (3, 5, 1, 2, 64, 32),
                (1, 64, 4, 4, 32, 32),
                (2, 129, 16, 32, 128, 128),
                (1, 512, 16, 32, 128, 128),
            ]
        ):
            name = "bfloat16" if dt == mx.bfloat16 else "float32"
            xs = [mx.array(a) for a in inputs(shape, i, name)]
            a = [x.astype(dt) if j in (0, 1, 2, 4) else x for j, x in enumerate(xs)]
            y, s = run(*a)
            c = shape[1] // 3 + 1
            y1, s1 = run(*[x[:, :c] for x in a[:5]], a[5])
            y2, s2 = run(*[x[:, c:] for x in a[:5]], s1)
            ry, rst = gated_delta_ops(*a)
            row = {
                "dtype": name,
                "shape": shape,
                "y": rel(y, ry),
                "state": rel(s, rst),
                "chunked_y": rel(mx.concatenate([y1, y2], 1), y),
                "chunked_state": rel(s2, s),
                "kernel_ms": ms(lambda: run(*a)),
                "ops_ms": ms(lambda: gated_delta_ops(*a)) if shape[1] >= 64 else None,
            }
            ok = (
                row["y"] <= TOL[name]["y"]
                and row["state"] <= TOL[name]["state"]
                and row["chunked_y"] == 0 == row["chunked_state"]
            )
            bad += not ok
            print(json.dumps(row), flush=True)
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--skip-models", action="store_true")
    ap.add_argument("--mlx-only", action="store_true")
    a = ap.parse_args()
    if a.mlx_only:
        return mlx_only()
    import mlx.core as mx

    cuda = getattr(getattr(mx, "cuda", None), "is_available", lambda: None)()
    print(f"mlx {mx.__version__}, default device {mx.default_device()}, cuda {cuda}", flush=True)
    rows: dict = {"op": [], "models": [], "timing": None}
    shapes = [
        (1, 1, 2, 4, 128, 128),
        (3, 1, 2, 4, 64, 32),
        (2, 37, 2, 4, 128, 128),
        (1, 64, 4, 4, 32, 32),
        (2, 129, 1, 2, 128, 64),
        (1, 16, 16, 32, 128, 128),
    ]
    for dtype in ("float32", "bfloat16"):
        for i, shape in enumerate(shapes):
            r = check_op(shape, dtype, seed=i)
            rows["op"].append(r)
            print(json.dumps(r), flush=True)
    if not a.skip_models:
        for arch in ("qwen3_5", "qwen3_next"):
            for dtype in ("float32", "bfloat16"):
                try:
                    r = check_model(arch, dtype)
                except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                    r = {"arch": arch, "dtype": dtype, "ok": False, "error": f"{type(e).__name__}: {str(e)[:400]}"}
                rows["models"].append(r)
                print(json.dumps(r), flush=True)
    rows["timing"] = time_chunk()
    print(json.dumps(rows["timing"]), flush=True)
    bad = [r for r in rows["op"] + rows["models"] if not r["ok"]]
    print(f"{len(rows['op']) + len(rows['models']) - len(bad)}/{len(rows['op']) + len(rows['models'])} checks pass")
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
