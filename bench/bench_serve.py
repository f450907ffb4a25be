"""Serving side by side: `mlx_lm.server` (the pinned mlx-lm, --decode-concurrency 32) and
`mlxrs serve` (prompt cache on, and off; batched prefill on, and off) on the same model and the same
request mix, one server at a time in one run, and the ratios.

    python bench/bench_serve.py --model tiny --concurrency 16,32 --tokens 128
    python bench/bench_serve.py --model fit-llama-f32 --concurrency 16,32 --engines "mlx_lm.server,mlxrs" --rounds 3
    python bench/bench_serve.py --model tiny --engines "mlxrs,mlxrs (batch prefill off)"
    python bench/bench_serve.py --model tiny --engines "mlxrs,mlxrs MLXRS_SDPA_NEW_SHAPES=fused"  # env A/B
    python bench/bench_serve.py --model fit-llama-f32 --agent-turns 10 --agent-start 2000 --agent-end 8000

Scenarios:
- concurrency N: N streaming /v1/completions requests at once (distinct prompts of ~60 tokens,
  greedy, max_tokens --tokens): aggregate completion tokens/s (usage from
  stream_options.include_usage, or the chunks counted) over the wall time of the wave, p50/p99 time
  to the first chunk with text (completions: no output parser holds text back on either side).
- agent: one chat conversation of --agent-turns turns whose history grows from about --agent-start
  to --agent-end tokens (a long system prompt, then user turns of filler text, each answered by a
  fixed assistant turn); every turn resends the whole history; time to first token = the latency
  of a non-streamed request for one token (prefill + one step on both servers).
--model: `tiny` (tests' 2-layer model), a FIT_MODELS name from tests/tinymodels.py (fit-llama-f32 is
~88M parameters, float32), or a model directory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

FILLER = (
    "The committee reviewed the quarterly figures, the supply schedule and the open tickets, and asked "
    "for a short summary of each item with the owner, the risk and the next date. "
)


def model_dir(name: str) -> Path:
    from tinymodels import FIT_MODELS, make_fit_model, make_model

    if name == "tiny":
        return make_model("qwen3-float32", "qwen3")
    d = make_fit_model(name) if name in FIT_MODELS else Path(name)
    _ensure_template(d)
    return d


def _ensure_template(d: Path) -> None:
    """FIT_MODELS and bench_device.py's models have no chat template: give them the tests' qwen3 one
    (both servers read it)."""
    from chat_templates import TEMPLATES

    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if "chat_template" not in cfg:
        cfg["chat_template"] = TEMPLATES["qwen3"]
        cfg_path.write_text(json.dumps(cfg))


MODEL_NAME = ["default_model"]  # what requests name: both servers serve the model they loaded under it


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    def __init__(self, cmd: list[str], port: int, env: dict[str, str] | None = None) -> None:
        self.port = port
        self.log = tempfile.NamedTemporaryFile("w+", prefix="bench-serve-", suffix=".log", delete=False)
        self.p = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env or os.environ.copy())
        import urllib.request

        t0 = time.monotonic()
        while time.monotonic() - t0 < 300:
            if self.p.poll() is not None:
                raise SystemExit(f"{cmd[:4]} exited: see {self.log.name}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
                return
            except OSError:
                time.sleep(0.2)
        raise SystemExit(f"{cmd[:4]} did not come up: see {self.log.name}")

    def stop(self) -> None:
        self.p.terminate()
        try:
            self.p.wait(20)
        except subprocess.TimeoutExpired:
            self.p.kill()


def start(engine: str, d: Path) -> Proc:
    port = free_port()
    py = sys.executable
    if engine == "mlx_lm.server":
        # the same BLAS as mlxrs (OpenBLAS and its gemv router preloaded on Linux CPU), as the
        # parity oracle runs: MLX's CPU wheel alone links a slow reference BLAS
        from oracle_server import blas_env

        return Proc(
            [
                py,
                "-m",
                "mlx_lm",
                "server",
                "--model",
                str(d),
                "--port",
                str(port),
                "--decode-concurrency",
                "32",
                "--max-tokens",
                "100000",
            ],
            port,
            env=blas_env(),
        )
    extra = ["--prompt-cache-bytes", "0"] if engine == "mlxrs (cache off)" else []
    env = os.environ.copy()
    if engine == "mlxrs (batch prefill off)":
        env["MLXRS_BATCH_PREFILL"] = "0"  # one prompt per prefill pass
    else:
        env.pop("MLXRS_BATCH_PREFILL", None)
    # "mlxrs NAME=VALUE ...": mlxrs under those environment variables (an A/B in the same run)
    for kv in engine.split()[1:] if engine.startswith("mlxrs ") else []:
        if "=" in kv:
            k, v = kv.split("=", 1)
            env[k] = v
    cmd = [py, "-m", "mlxrs", "serve", str(d), "--port", str(port), "--log-level", "warning", *extra]
    return Proc(cmd, port, env=env)


async def complete(session: Any, port: int, prompt: str, max_tokens: int) -> tuple[float, int]:
    """(time to the first text, completion tokens) of one streamed completion."""
    body = {
        "model": MODEL_NAME[0],
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft = None
    chunks = 0
    usage = None
    async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {await r.text()}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            j = json.loads(line[6:])
            if j.get("usage"):
                usage = j["usage"]
            for ch in j.get("choices") or []:
                if ch.get("text"):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    chunks += 1
    n = int(usage["completion_tokens"]) if usage else chunks
    return (ttft if ttft is not None else time.perf_counter() - t0), n


async def one_token(session: Any, port: int, messages: list[dict[str, str]]) -> float:
    """Latency of a non-streamed chat request for one token."""
    body = {"model": MODEL_NAME[0], "messages": messages, "max_tokens": 1, "temperature": 0.0}
    t0 = time.perf_counter()
    async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {await r.text()}")
        await r.read()
    return time.perf_counter() - t0


async def wave(port: int, n: int, tokens: int) -> dict[str, float]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        prompts = [f"Request {i}: " + FILLER[: 200 + 7 * i] for i in range(n)]
        t0 = time.perf_counter()
        res = await asyncio.gather(*(complete(s, port, p, tokens) for p in prompts))
        wall = time.perf_counter() - t0
    ttfts = sorted(r[0] for r in res)
    toks = sum(r[1] for r in res)
    p99 = ttfts[min(len(ttfts) - 1, int(round(0.99 * (len(ttfts) - 1))))]
    return {
        "tokens": toks,
        "wall_s": wall,
        "tok_s": toks / wall,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": p99,
    }


async def agent(port: int, turns: int, start_tokens: int, end_tokens: int) -> dict[str, Any]:
    import aiohttp

    # ~4.3 characters per token for this filler with a byte-level BPE; the tests' tiny tokenizers
    # are near one token per character, so lengths are given in characters / chars_per_token
    chars_per_token = float(os.environ.get("BENCH_CHARS_PER_TOKEN", "1.0"))
    system = (FILLER * (1 + int(start_tokens * chars_per_token) // len(FILLER)))[: int(start_tokens * chars_per_token)]
    step = max(1, int((end_tokens - start_tokens) * chars_per_token / max(1, turns - 1)))
    msgs: list[dict[str, str]] = [{"role": "system", "content": system}]
    ttfts = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        for t in range(turns):
            msgs.append({"role": "user", "content": f"Turn {t}. " + (FILLER * (1 + step // len(FILLER)))[:step]})
            ttfts.append(await one_token(s, port, msgs))
            msgs.append({"role": "assistant", "content": f"Noted, item {t}: the owner and the date are set."})
    return {
        "ttft_s": ttfts,
        "mean_ttft_s": statistics.mean(ttfts),
        "mean_ttft_after_first_s": statistics.mean(ttfts[1:]) if turns > 1 else ttfts[0],
    }


def run_engine(eng: str, d: Path, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    """One server of `eng` started, warmed up, each scenario run, stopped."""
    MODEL_NAME[0] = "default_model" if eng == "mlx_lm.server" else d.name
    p = start(eng, d)
    try:
        r: dict[str, Any] = {}
        asyncio.run(wave(p.port, 2, 8))  # warm-up
        if eng != "mlxrs (cache off)":
            for n in [int(x) for x in args.concurrency.split(",") if x]:
                r[f"concurrency_{n}"] = asyncio.run(wave(p.port, n, args.tokens))
                print(tag + eng, n, json.dumps(r[f"concurrency_{n}"]), flush=True)
        if args.agent_turns:
            r["agent"] = asyncio.run(agent(p.port, args.agent_turns, args.agent_start, args.agent_end))
            print(tag + eng, "agent", json.dumps(r["agent"]), flush=True)
        return r
    finally:
        p.stop()


def ratios_of(engines: dict[str, Any]) -> dict[str, dict[str, float]]:
    """mlxrs over its references in one round's results."""
    ref = engines.get("mlx_lm.server", {})
    ours = engines.get("mlxrs", {})
    ratios: dict[str, dict[str, float]] = {}
    for k, v in ours.items():
        if k.startswith("concurrency_") and k in ref:
            ratios[k] = {"tok_s": v["tok_s"] / ref[k]["tok_s"], "ttft_p99": v["ttft_p99_s"] / ref[k]["ttft_p99_s"]}
    nobatch = engines.get("mlxrs (batch prefill off)", {})
    for k, v in ours.items():
        if k.startswith("concurrency_") and k in nobatch:
            off = nobatch[k]
            ratios[f"{k}_batch_prefill_on_over_off"] = {
                "tok_s": v["tok_s"] / off["tok_s"],
                "ttft_p50": v["ttft_p50_s"] / off["ttft_p50_s"],
                "ttft_p99": v["ttft_p99_s"] / off["ttft_p99_s"],
            }
    if "agent" in ours:
        off = engines.get("mlxrs (cache off)", {}).get("agent")
        a = {}
        if off:
            a["cache_off_over_on_ttft"] = off["mean_ttft_after_first_s"] / ours["agent"]["mean_ttft_after_first_s"]
        if "agent" in ref:
            a["mlx_lm_over_mlxrs_ttft"] = (
                ref["agent"]["mean_ttft_after_first_s"] / ours["agent"]["mean_ttft_after_first_s"]
            )
        ratios["agent"] = a
    return ratios


def median_ratios(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, Any]]:
    """Each ratio's median over the rounds that have it."""
    metrics = {k: sorted({m for r in rounds for m in r.get(k, {})}) for k in {k for r in rounds for k in r}}
    return {
        k: {m: statistics.median(r[k][m] for r in rounds if m in r.get(k, {})) for m in ms} for k, ms in metrics.items()
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--concurrency", default="16,32")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--agent-turns", type=int, default=0)
    ap.add_argument("--agent-start", type=int, default=2000)
    ap.add_argument("--agent-end", type=int, default=8000)
    ap.add_argument("--engines", default="mlx_lm.server,mlxrs,mlxrs (cache off)")
    ap.add_argument("--rounds", type=int, default=1, help="repeat every engine this many times, alternating")
    ap.add_argument("--out")
    args = ap.parse_args()
    d = model_dir(args.model)
    engines = args.engines.split(",")
    out: dict[str, Any] = {"model": str(d), "date": time.strftime("%Y-%m-%d"), "args": vars(args), "rounds": []}
    for rnd in range(args.rounds):
        res: dict[str, Any] = {}
        for eng in engines:
            if eng == "mlxrs (cache off)" and not args.agent_turns:
                continue
            res[eng] = run_engine(eng, d, args, f"round {rnd + 1}: " if args.rounds > 1 else "")
        out["rounds"].append({"engines": res, "ratios": ratios_of(res)})
    out["engines"] = out["rounds"][0]["engines"]
    ratios = out["rounds"][0]["ratios"]
    if args.rounds > 1:
        # the median of each ratio over the rounds (each round restarts every server: the engines
        # alternate, so a drift of the machine reaches both sides)
        ratios = median_ratios([r["ratios"] for r in out["rounds"]])
        for k, v in ratios.items():
            per = [r["ratios"].get(k, {}) for r in out["rounds"]]
            v["per_round"] = {m: [round(x[m], 3) for x in per if m in x] for m in v}
    out["ratios"] = ratios
    print(json.dumps(ratios, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
