"""Generation speed: mlxrs vs mlx-lm on the same random-weight Llama models, on this machine.

    python bench/bench_generate.py --model all --runs 5 --json bench/results.json

Engines, each a persistent worker process (bench/_worker.py) with its model loaded once:

  mlxrs                 mlxrs.Session (it loads its gemv router, libmlxrs_blas, then OpenBLAS, before
                        libmlx: native/blas_gemv.c)
  mlx-lm stock          mlx_lm.generate.generate_step after a plain `import mlx.core` (the reference
                        BLAS bundled in the mlx-cpu wheel)
  mlx-lm openblas       the same, started with LD_PRELOAD=<the OpenBLAS mlxrs reports>
  mlx-lm openblas+gemv  the same, started with LD_PRELOAD=<mlxrs's gemv router>:<that OpenBLAS>: exactly
                        the BLAS path mlxrs runs on
  mlxrs no-gemv         (only with --engines) mlxrs with MLXRS_BLAS_GEMV=off: OpenBLAS alone

Every engine gets the same prompt token ids, greedy decoding with EOS ignored, the same warm-up (one
discarded generation identical to a measured one), and is timed the same way from outside (see
_worker.py). Runs alternate: run r goes through the engines in an order rotated by r, one at a time.
Reported: the median over runs of prefill tok/s (prompt tokens / time to first token) and decode tok/s
((n - 1) / (time from the first to the last token)), and the ratios mlxrs / mlx-lm.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MODELS_DIR = HERE / ".models"

# name -> (make_model shape, default prompt tokens, default generated tokens)
MODELS: dict[str, dict[str, Any]] = {
    "tiny": {
        "dir": "llama-tiny",
        "shape": dict(hidden=256, layers=4, vocab=1024, heads=4, kv_heads=2, head_dim=64, inter=512),
        "tie": False,
        "prompt_tokens": 64,
        "gen_tokens": 256,
    },
    "100m": {
        # 12 x 7.1M (attention 2.4M + MLP 4.7M) + a 24.6M embedding tied to the head = 110M parameters
        "dir": "llama-100m",
        "shape": dict(hidden=768, layers=12, vocab=32000, heads=12, kv_heads=12, head_dim=64, inter=2048),
        "tie": True,
        "prompt_tokens": 512,
        "gen_tokens": 128,
    },
}

ENGINES = ["mlxrs", "mlx-lm stock", "mlx-lm openblas", "mlx-lm openblas+gemv"]
OPTIONAL = ["mlxrs no-gemv"]

# (model, metric, baseline engine) -> target ratio mlxrs / baseline
TARGETS = {
    ("tiny", "decode", "mlx-lm stock"): 1.3,
    ("tiny", "decode", "mlx-lm openblas"): 1.3,
    ("100m", "prefill", "mlx-lm stock"): 10.0,
    ("100m", "decode", "mlx-lm stock"): 2.0,
    ("100m", "prefill", "mlx-lm openblas"): 1.0,
    ("100m", "decode", "mlx-lm openblas"): 1.0,
    ("100m", "prefill", "mlx-lm openblas+gemv"): 1.0,
    ("100m", "decode", "mlx-lm openblas+gemv"): 1.0,
}


def load_tinymodels() -> Any:
    spec = importlib.util.spec_from_file_location("tinymodels", REPO / "tests" / "tinymodels.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def ensure_model(key: str) -> Path:
    """Write the model once (random weights from a fixed seed, float32) under bench/.models."""
    m = MODELS[key]
    d = MODELS_DIR / m["dir"]
    if (d / ".complete").exists():
        return d
    tm = load_tinymodels()
    tm.ROOT = MODELS_DIR
    if m["tie"]:
        base = tm.base_config

        def tied(arch: str, **kw: Any) -> dict[str, Any]:
            c = base(arch, **kw)
            c["tie_word_embeddings"] = True
            return c

        tm.base_config = tied
    print(f"[bench] writing {d} ...", flush=True)
    return tm.make_model(m["dir"], "llama", dtype="float32", **m["shape"])


def blas_paths() -> tuple[str, str]:
    """The OpenBLAS and the gemv router mlxrs loads ('' where it loads none)."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import mlxrs; i = mlxrs.runtime_info(); print(i.get('blas') or ''); print(i.get('blas_gemv') or '')",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    blas, gemv = (out.stdout.splitlines() + ["", ""])[:2]
    return blas.strip(), gemv.strip()


def mlxrs_build() -> dict[str, Any]:
    """Which mlxrs was measured: the commit, whether crates/ had local edits, the extension's mtime."""

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()

    import glob

    so = sorted(glob.glob(str(REPO / "python" / "mlxrs" / "_native*.so")))
    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "crates_modified": bool(git("status", "--porcelain", "crates")),
        "extension": so[0] if so else None,
        "extension_mtime": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(os.path.getmtime(so[0]))) if so else None,
    }


class Worker:
    def __init__(self, name: str, model: Path, blas: str, gemv: str) -> None:
        self.name = name
        engine = "mlxrs" if name.startswith("mlxrs") else "mlxlm"
        env = dict(os.environ)
        env.pop("LD_PRELOAD", None)
        env.pop("MLXRS_BLAS", None)
        env.pop("MLXRS_BLAS_GEMV", None)
        if name == "mlx-lm openblas":
            env["LD_PRELOAD"] = blas
        if name == "mlx-lm openblas+gemv":
            env["LD_PRELOAD"] = f"{gemv}:{blas}"
        if name == "mlxrs no-gemv":
            env["MLXRS_BLAS_GEMV"] = "off"
        self.p = subprocess.Popen(
            [sys.executable, str(HERE / "_worker.py"), "--engine", engine, "--model", str(model)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            bufsize=1,
        )
        self.ready = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.p.stdout
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name}: the worker exited (code {self.p.wait()})")
        return json.loads(line)

    def run(self, prompt: list[int], n: int) -> dict[str, Any]:
        assert self.p.stdin
        self.p.stdin.write(json.dumps({"prompt": prompt, "max_tokens": n}) + "\n")
        self.p.stdin.flush()
        r = self._read()
        if "error" in r:
            raise RuntimeError(f"{self.name}: {r['error']}")
        return r

    def close(self) -> None:
        if self.p.stdin:
            self.p.stdin.close()
        self.p.wait(timeout=60)


def cpu_busy_s() -> float:
    """Seconds of CPU time used by everything on this machine so far (from /proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]  # idle + iowait
    return (sum(v[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def wait_quiet(limit: float, max_wait: float) -> float:
    """Wait (up to max_wait seconds) until other processes use fewer than `limit` cores; return the last
    reading. The workers are idle while this samples."""
    t_end = time.time() + max_wait
    while True:
        b0, t0 = cpu_busy_s(), time.time()
        time.sleep(0.5)
        busy = (cpu_busy_s() - b0) / (time.time() - t0)
        if busy < limit or time.time() > t_end:
            return busy


def prompt_ids(vocab: int, n: int, seed: int = 0) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(4, vocab) for _ in range(n)]  # past the special tokens


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def bench_model(
    key: str,
    runs: int,
    p_tokens: int,
    g_tokens: int,
    blas: str,
    engines: list[str],
    gemv: str,
    quiet: float | None,
    quiet_wait: float = 120,
) -> dict[str, Any]:
    d = ensure_model(key)
    vocab = json.loads((d / "config.json").read_text())["vocab_size"]
    prompt = prompt_ids(vocab, p_tokens)
    print(f"\n[bench] model {key}: {d.name}, prompt {p_tokens} tokens, {g_tokens} generated, {runs} runs", flush=True)
    workers = {e: Worker(e, d, blas, gemv) for e in engines}
    samples: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
    try:
        for e, w in workers.items():
            print(f"[bench]   {e:16s} loaded in {w.ready['load_s']:.2f}s, BLAS {w.ready['blas']}", flush=True)
        for e, w in workers.items():  # identical warm-up for every engine: one discarded generation
            w.run(prompt, g_tokens)
        for r in range(runs):
            order = engines[r % len(engines) :] + engines[: r % len(engines)]
            for e in order:
                for attempt in range(4 if quiet is not None else 1):
                    if quiet is not None:
                        wait_quiet(quiet, quiet_wait)
                    load = os.getloadavg()[0]
                    b0, t0 = cpu_busy_s(), time.time()
                    res = workers[e].run(prompt, g_tokens)
                    wall = time.time() - t0
                    # cores' worth of CPU that other processes (not this worker) used during the run
                    res["others_cores"] = max(0.0, (cpu_busy_s() - b0 - res["cpu_s"]) / wall)
                    res["loadavg_before"] = load
                    res["attempts"] = attempt + 1
                    if quiet is None or res["others_cores"] < quiet:
                        break
                    print(
                        f"[bench]   run {r + 1}/{runs} {e:16s} disturbed (others used {res['others_cores']:.2f} cores): again",
                        flush=True,
                    )
                n = len(res["tokens"])
                res["prefill_tps"] = p_tokens / res["t_prefill"]
                res["decode_tps"] = (n - 1) / res["t_decode"] if n > 1 and res["t_decode"] > 0 else float("nan")
                samples[e].append(res)
                print(
                    f"[bench]   run {r + 1}/{runs} {e:16s} prefill {res['prefill_tps']:9.1f} tok/s   "
                    f"decode {res['decode_tps']:8.1f} tok/s   (cpu {res['cpu_s']:.1f}s for {res['t_prefill'] + res['t_decode']:.1f}s, "
                    f"others {res['others_cores']:.2f} cores)",
                    flush=True,
                )
    finally:
        for w in workers.values():
            w.close()

    ref = samples["mlxrs"][0]["tokens"] if "mlxrs" in samples else samples[engines[0]][0]["tokens"]
    checks = {}
    for e in engines:
        stable = all(s["tokens"] == samples[e][0]["tokens"] for s in samples[e])
        div = first_divergence(samples[e][0]["tokens"], ref)
        checks[e] = {
            "same_as_mlxrs": div is None,
            "first_divergence": div,
            "stable_across_runs": stable,
            "n": len(samples[e][0]["tokens"]),
        }
    med = {
        e: {
            "prefill_tps": statistics.median(s["prefill_tps"] for s in samples[e]),
            "decode_tps": statistics.median(s["decode_tps"] for s in samples[e]),
            "decode_ms_per_token": 1000
            * statistics.median(s["t_decode"] / max(len(s["tokens"]) - 1, 1) for s in samples[e]),
        }
        for e in engines
    }
    internal = None
    if "mlxrs" in samples:
        internal = {
            "prompt_seconds": statistics.median(s["internal"]["prompt_seconds"] for s in samples["mlxrs"]),
            "generation_seconds": statistics.median(s["internal"]["generation_seconds"] for s in samples["mlxrs"]),
        }
    return {
        "model": key,
        "dir": str(d),
        "prompt_tokens": p_tokens,
        "gen_tokens": g_tokens,
        "runs": runs,
        "blas": {e: workers[e].ready["blas"] for e in engines},
        "median": med,
        "checks": checks,
        "mlxrs_internal_median": internal,
        "samples": samples,
    }


def table(results: list[dict[str, Any]], engines: list[str]) -> str:
    base = [e for e in engines if e.startswith("mlx-lm")]
    ours = [e for e in engines if e.startswith("mlxrs")]
    pairs = [(o, b) for o in ours for b in base]
    head = ["model", "metric", *[f"{e} tok/s" for e in engines], *[f"{o} / {b}" for o, b in pairs]]
    rows = [head, ["---"] * len(head)]
    for res in results:
        for metric in ("prefill", "decode"):
            k = f"{metric}_tps"
            m = res["median"]
            row = [res["model"], f"{metric} ({res['prompt_tokens'] if metric == 'prefill' else res['gen_tokens']} tok)"]
            row += [f"{m[e][k]:.1f}" for e in engines]
            for o, b in pairs:
                ratio = m[o][k] / m[b][k]
                t = TARGETS.get((res["model"], metric, b)) if o == "mlxrs" else None  # targets are for mlxrs as shipped
                row.append(f"{ratio:.2f}x" + (f" ({'met' if ratio >= t else 'MISSED'}: >= {t:g}x)" if t else ""))
            rows.append(row)
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "100m", "all"], default="all")
    ap.add_argument("--runs", type=int, default=5, help="measured runs per engine (after one warm-up)")
    ap.add_argument("--prompt-tokens", type=int, help="default: 64 (tiny), 512 (100m)")
    ap.add_argument("--gen-tokens", type=int, help="default: 256 (tiny), 128 (100m)")
    ap.add_argument(
        "--engines",
        default=",".join(ENGINES),
        help=f"comma-separated, of: {', '.join(ENGINES + OPTIONAL)} (default: {', '.join(ENGINES)})",
    )
    ap.add_argument(
        "--quiet-below",
        type=float,
        metavar="CORES",
        help="shared machines: before each run wait until other processes use fewer than CORES cores, "
        "and repeat a run (up to 3 times) during which they used more",
    )
    ap.add_argument(
        "--quiet-wait",
        type=float,
        default=120,
        metavar="S",
        help="the longest wait for quiet before a run (default 120 s)",
    )
    ap.add_argument("--json", help="write every sample and the medians here")
    ap.add_argument("--table-from", metavar="JSON", help="print the table of an earlier --json file and exit")
    a = ap.parse_args()
    if a.table_from:
        saved = json.loads(Path(a.table_from).read_text())
        print(table(saved["results"], list(saved["results"][0]["median"])))
        return
    engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    if bad := [e for e in engines if e not in ENGINES + OPTIONAL]:
        ap.error(f"unknown engine(s): {bad}")
    blas, gemv = blas_paths()
    if not blas and any(e.startswith("mlx-lm openblas") for e in engines):
        ap.error("mlxrs reports no OpenBLAS, so there is no 'mlx-lm openblas' to run")
    if not gemv and "mlx-lm openblas+gemv" in engines:
        ap.error("mlxrs reports no gemv router (libmlxrs_blas.so: python native/build.py builds it)")
    keys = ["tiny", "100m"] if a.model == "all" else [a.model]
    build = mlxrs_build()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(
        f"[bench] {platform.node()}: {os.cpu_count()} cores, {cpu}; OpenBLAS {blas}; gemv router {gemv or None}; "
        f"load average {os.getloadavg()}",
        flush=True,
    )
    print(
        f"[bench] mlxrs: commit {build['commit']}{' + local edits in crates/' if build['crates_modified'] else ''}, "
        f"extension built {build['extension_mtime']}",
        flush=True,
    )
    t0 = time.time()
    results = [
        bench_model(
            k,
            a.runs,
            a.prompt_tokens or MODELS[k]["prompt_tokens"],
            a.gen_tokens or MODELS[k]["gen_tokens"],
            blas,
            engines,
            gemv,
            a.quiet_below,
            a.quiet_wait,
        )
        for k in keys
    ]
    print("\ngreedy check (first measured run of each engine vs mlxrs; every run of an engine identical?):")
    for res in results:
        for e, c in res["checks"].items():
            same = "identical" if c["same_as_mlxrs"] else f"DIFFERENT from token {c['first_divergence']}"
            print(f"  {res['model']:5s} {e:16s} {c['n']} tokens {same}; stable across runs: {c['stable_across_runs']}")
    print("\nother processes' CPU use during the runs (median cores, of %d):" % (os.cpu_count() or 0))
    for res in results:
        print(
            "  "
            + res["model"]
            + ": "
            + ", ".join(f"{e} {statistics.median(s['others_cores'] for s in res['samples'][e]):.2f}" for e in engines)
        )
    print("\nper-token decode cost (median ms/token, external timing):")
    for res in results:
        print(
            "  "
            + res["model"]
            + ": "
            + ", ".join(f"{e} {res['median'][e]['decode_ms_per_token']:.2f}" for e in engines)
        )
        if res["mlxrs_internal_median"]:
            i = res["mlxrs_internal_median"]
            print(
                f"         mlxrs Completion.timings: prompt {i['prompt_seconds'] * 1000:.1f} ms, "
                f"generation {i['generation_seconds'] * 1000:.1f} ms"
            )
    print(
        f"\nmedians of {a.runs} alternating runs (total {time.time() - t0:.0f}s, load average now {os.getloadavg()}):\n"
    )
    print(table(results, engines))
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {
                    "command": sys.argv,
                    "cpu": cpu,
                    "cores": os.cpu_count(),
                    "openblas": blas,
                    "gemv_router": gemv,
                    "mlxrs_build": build,
                    "results": results,
                },
                indent=1,
            )
        )
        print(f"\n[bench] wrote {a.json}")


if __name__ == "__main__":
    main()
