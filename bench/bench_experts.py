"""Paged-expert IO: a random qwen3_moe decoded with its experts streamed from the safetensors files
(expert cache at 25% and 50% of the expert bytes, and at 100%: every expert cached after the warm-up,
the cost of streaming without reads) vs fully resident, and mlx-lm fully resident.

    python bench/bench_experts.py [--layers 12 --experts 32 --top-k 4 --hidden 384 --moe-inter 384]
                                  [--prompt-tokens 32 --gen-tokens 48] [--dir /tmp/mlxrs-bench-experts]
                                  [--prefetch] [--cold]

--prefetch compares reading ahead on and off instead (streamed with the cache at 0%, 25%, 50%, and
mlx-lm); --cold keeps the model file out of the page cache while measuring (posix_fadvise DONTNEED
every 2 ms from a thread of the engine's process), so that the expert reads go to the disk.

The model (float32, the Hugging Face per-expert layout, tests/tinymodels.py's weights) is written
under --dir and deleted at the end (--keep keeps it). Each engine runs in its own process: one
warm-up generation, then three measured greedy generations of --gen-tokens after a random prompt
(the prompt-prefix cache off); median decode tok/s over the tokens after the first; for mlxrs
streamed, the expert counters of the measured generations (hits, misses, hit rate, bytes read per token, read throughput) from
Session.info; the process's peak RSS (VmHWM). Reads come from the page cache when the file is in it
(this machine cannot drop caches): the bytes read are exact, the read throughput is the page
cache's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ENGINES = ["mlxrs resident", "mlxrs streamed 100%", "mlxrs streamed 50%", "mlxrs streamed 25%", "mlx-lm resident"]
# --prefetch: the streamed engines with reading ahead on (the default) and off, at 0% (every routed
# expert read), 25% and 50%; mlx-lm last (its tokens are the reference)
PREFETCH_ENGINES = [f"mlxrs streamed {c}%{p}" for c in (0, 25, 50) for p in ("", " no-prefetch")] + ["mlx-lm resident"]


def engine_cache(eng: str, experts: int) -> int | None:
    """The expert cache of a streamed engine ("mlxrs streamed 25%[ no-prefetch]"); None: resident."""
    if "streamed" not in eng:
        return None
    pct = int(eng.split("streamed ")[1].split("%")[0])
    return experts if pct == 100 else experts * pct // 100


def write_model(d: Path, a: argparse.Namespace) -> None:
    sys.path.insert(0, str(HERE.parent / "tests"))
    import mlx.core as mx
    import tinymodels as tm

    if (d / ".complete").exists():
        return
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    cfg = tm.base_config(
        "qwen3_moe", layers=a.layers, hidden=a.hidden, heads=4, kv_heads=2, head_dim=a.hidden // 4, inter=a.hidden * 2
    )
    cfg.update(
        num_experts=a.experts,
        num_experts_per_tok=a.top_k,
        moe_intermediate_size=a.moe_inter,
        mlp_only_layers=[],
        norm_topk_prob=True,
    )
    cfg["torch_dtype"] = "float32"
    w = tm._weights("qwen3_moe", cfg, 0)
    mx.eval(w)
    mx.save_safetensors(str(d / "model.safetensors"), w, metadata={"format": "mlx"})
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    tm.write_tokenizer(d, cfg["vocab_size"])
    (d / ".complete").write_text("ok")


def expert_bytes(d: Path) -> tuple[int, int]:
    import struct

    with open(d / "model.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        h = json.loads(f.read(n))
    sizes = {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in h.items() if k != "__metadata__"}
    return sum(v for k, v in sizes.items() if ".mlp.experts." in k), sum(sizes.values())


def keep_cold(model: str, every_s: float = 0.002) -> None:
    """A daemon thread that keeps dropping the model's safetensors pages from the page cache
    (posix_fadvise DONTNEED: unprivileged, clean pages of this file only), so that expert reads go to
    the disk as for a model larger than memory."""
    import threading

    files = [os.open(f, os.O_RDONLY) for f in Path(model).glob("*.safetensors")]

    def loop() -> None:
        while True:
            for fd in files:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            time.sleep(every_s)

    threading.Thread(target=loop, daemon=True).start()


def worker(engine: str, model: str, cache: int | None, prompt: list[int], n: int, cold: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if engine.startswith("mlxrs"):
        import mlxrs

        kw = (
            {"stream_experts": True, "expert_cache_bytes": cache, "expert_prefetch": not engine.endswith("no-prefetch")}
            if cache is not None
            else {}
        )
        s = mlxrs.Session(model, prompt_cache_bytes=0, **kw)

        def run() -> tuple[list[int], float, float]:
            toks: list[int] = []
            t0 = t_first = t_last = time.perf_counter()
            for ch in s.stream(prompt, max_tokens=n, temperature=0.0, ignore_eos=True):
                if ch.token is not None:
                    t_last = time.perf_counter()
                    if not toks:
                        t_first = t_last
                    toks.append(ch.token)
            return toks, t_first - t0, t_last - t_first

        run()  # warm-up
        if cold and cache is not None:
            keep_cold(model)
        before = dict(s.info["experts"] or {})
        toks, tp, td = measured(run)
        after = s.info["experts"]
        if after:
            d = {
                k: after[k] - before.get(k, 0)
                for k in ("hits", "misses", "bytes_read", "tokens", "read_seconds", "prefetched", "prefetch_hits")
            }
            d["prefetch_hit_rate"] = d["prefetch_hits"] / d["prefetched"] if d["prefetched"] else None
            d["read_wait_ms_per_token"] = 1e3 * d["read_seconds"] / max(1, d["tokens"])
            d["hit_rate"] = d["hits"] / max(1, d["hits"] + d["misses"])
            d["bytes_read_per_token"] = d["bytes_read"] / max(1, d["tokens"])
            d["read_bytes_per_second"] = d["bytes_read"] / d["read_seconds"] if d["read_seconds"] > 0 else None
            d["cache_budget_bytes"] = after["cache_budget_bytes"]
            out["experts"] = d
        out["weights_bytes_resident"] = s.info["weights_bytes"]
    else:
        import mlx.core as mx
        from mlx_lm import load
        from mlx_lm.generate import generate_step

        model_, _ = load(model)

        def run() -> tuple[list[int], float, float]:
            toks: list[int] = []
            t0 = t_first = t_last = time.perf_counter()
            for tok, _ in generate_step(mx.array(prompt, dtype=mx.int32), model_, max_tokens=n):
                t_last = time.perf_counter()
                if not toks:
                    t_first = t_last
                toks.append(int(tok))
            mx.synchronize()
            return toks, t_first - t0, t_last - t_first

        run()
        toks, tp, td = measured(run)
    out.update(
        tokens=toks,
        prefill_s=tp,
        decode_s=td,
        decode_tps=(len(toks) - 1) / td if td > 0 else None,
        peak_rss_bytes=peak_rss(),
    )
    return out


RUNS = 3


def measured(run: Any) -> tuple[list[int], float, float]:
    """RUNS generations: the tokens (all the same, greedy), the median prefill and decode times."""
    rs = [run() for _ in range(RUNS)]
    assert all(r[0] == rs[0][0] for r in rs)
    return rs[0][0], sorted(r[1] for r in rs)[RUNS // 2], sorted(r[2] for r in rs)[RUNS // 2]


def peak_rss() -> int:
    """This program's peak resident set (VmHWM: unlike ru_maxrss, not inherited across fork/exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--moe-inter", type=int, default=384)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--gen-tokens", type=int, default=48)
    ap.add_argument("--dir", default="/tmp/mlxrs-bench-experts")
    ap.add_argument("--keep", action="store_true", help="keep the model directory")
    ap.add_argument(
        "--prefetch",
        action="store_true",
        help="compare reading ahead on and off (streamed at 0%%, 25%%, 50%%) instead of the default engines",
    )
    ap.add_argument(
        "--cold",
        action="store_true",
        help="streamed engines: keep dropping the model file from the page cache while measuring "
        "(posix_fadvise DONTNEED every 2 ms), so that reads go to the disk",
    )
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        job = json.loads(a.worker)
        sys.stdout, out = sys.stderr, sys.stdout
        out.write(
            json.dumps(worker(job["engine"], job["model"], job["cache"], job["prompt"], job["n"], job["cold"])) + "\n"
        )
        return
    d = Path(a.dir) / "model"
    try:
        t = time.perf_counter()
        write_model(d, a)
        print(f"model written in {time.perf_counter() - t:.1f}s: {d}", file=sys.stderr)
        experts, total = expert_bytes(d)
        import random

        rnd = random.Random(0)
        prompt = [rnd.randrange(10, 500) for _ in range(a.prompt_tokens)]
        import mlxrs

        env = dict(os.environ)
        info = mlxrs.runtime_info()
        libs = [p for p in (info.get("blas_gemv"), info.get("blas")) if p] if info.get("blas") else []
        results = []
        for eng in PREFETCH_ENGINES if a.prefetch else ENGINES:
            cache = engine_cache(eng, experts)
            e = dict(env)
            if eng.startswith("mlx-lm") and libs:  # the same BLAS as mlxrs (as the parity oracle runs)
                e["LD_PRELOAD"] = ":".join(libs)
            job = {"engine": eng, "model": str(d), "cache": cache, "prompt": prompt, "n": a.gen_tokens, "cold": a.cold}
            p = subprocess.run(
                [sys.executable, __file__, "--worker", json.dumps(job)],
                capture_output=True,
                text=True,
                env=e,
                timeout=1800,
            )
            if p.returncode != 0:
                raise SystemExit(f"{eng} failed:\n{p.stderr[-3000:]}")
            r = json.loads(p.stdout.strip().splitlines()[-1])
            r["engine"] = eng
            results.append(r)
            print(f"{eng}: {r['decode_tps']:.1f} tok/s", file=sys.stderr)
        ref = results[-1]["tokens"]
        print(
            f"\nrandom qwen3_moe: {a.layers} layers × {a.experts} experts (top-{a.top_k}), hidden {a.hidden}, "
            f"expert width {a.moe_inter}, float32; weights {total / 1e6:.0f} MB of which experts "
            f"{experts / 1e6:.0f} MB; prompt {a.prompt_tokens}, {a.gen_tokens} generated tokens\n"
        )
        print(
            "| engine | decode tok/s | tokens = mlx-lm's | hit rate | MB read / token | read MB/s | peak RSS MB "
            "| prefetch hit rate | read wait ms / token |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for r in results:
            x = r.get("experts")
            cells = [
                r["engine"],
                f"{r['decode_tps']:.1f}",
                "yes" if r["tokens"] == ref else "NO",
                f"{x['hit_rate']:.2f}" if x else "-",
                f"{x['bytes_read_per_token'] / 1e6:.2f}" if x else "0",
                f"{x['read_bytes_per_second'] / 1e6:.0f}" if x and x["read_bytes_per_second"] else "-",
                f"{r['peak_rss_bytes'] / 1e6:.0f}",
                f"{x['prefetch_hit_rate']:.2f}" if x and x.get("prefetch_hit_rate") is not None else "-",
                f"{x['read_wait_ms_per_token']:.2f}" if x else "-",
            ]
            print("| " + " | ".join(cells) + " |")
        if a.json:
            Path(a.json).write_text(
                json.dumps(
                    {"args": vars(a), "expert_bytes": experts, "weights_bytes": total, "results": results}, indent=1
                )
            )
    finally:
        if not a.keep:
            shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
