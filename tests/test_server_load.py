"""A loopback load test of a real `mlxrs serve` process (bounded in count and time): 32 concurrent
streaming clients over both protocols through a real HTTP client (aiohttp), 30% of them leaving
mid-stream. Every completed stream is well formed and equals its non-streamed answer; the server's
RSS comes back near its baseline; /stats is consistent: received = served + cancelled + rejected +
failed, nothing left running."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import aiohttp

from server_util import Server
from tinymodels import make_model

N_CLIENTS = 32
MAX_TOKENS = 24
QUESTIONS = [f"Question {i}: what is {i} plus {i * 3}?" for i in range(8)]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def body(proto: str, q: str, stream: bool) -> dict:
    b = {"messages": [{"role": "user", "content": q}], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    return b


async def sse_events(resp: aiohttp.ClientResponse):
    """(event, data) pairs of an SSE response, parsed strictly."""
    event = None
    async for raw in resp.content:
        line = raw.decode().rstrip("\n").rstrip("\r")
        if not line:
            event = None
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(": ")
        if field == "event":
            event = value
        elif field == "data":
            yield event, value


async def answer(session: aiohttp.ClientSession, url: str, proto: str, q: str) -> str:
    path = "/v1/chat/completions" if proto == "openai" else "/v1/messages"
    async with session.post(url + path, json=body(proto, q, False)) as r:
        assert r.status == 200, await r.text()
        j = await r.json()
    if proto == "openai":
        return j["choices"][0]["message"]["content"] or ""
    return "".join(b.get("text", "") for b in j["content"] if b["type"] == "text")


async def streamed(session: aiohttp.ClientSession, url: str, proto: str, q: str, leave_after: int | None):
    """The streamed text, or None when this client left after `leave_after` events."""
    path = "/v1/chat/completions" if proto == "openai" else "/v1/messages"
    text = []
    n = 0
    async with session.post(url + path, json=body(proto, q, True)) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        finished = False
        async for event, data in sse_events(r):
            n += 1
            if leave_after is not None and n >= leave_after:
                r.close()  # the client goes away mid-stream
                return None
            if proto == "openai":
                if data == "[DONE]":
                    assert finished
                    return "".join(text)
                j = json.loads(data)
                for ch in j["choices"]:
                    if ch["delta"].get("content"):
                        text.append(ch["delta"]["content"])
                    if ch.get("finish_reason"):
                        finished = True
            else:
                j = json.loads(data)
                assert j["type"] == event
                if event == "content_block_delta" and j["delta"]["type"] == "text_delta":
                    text.append(j["delta"]["text"])
                if event == "message_stop":
                    return "".join(text)
    raise AssertionError("the stream ended without its final event")


def test_32_concurrent_streams_with_disconnects():
    d = make_model("qwen3-float32", "qwen3")
    with Server(d, "--prompt-cache-bytes", "64M") as s:

        async def main() -> tuple[dict, list]:
            timeout = aiohttp.ClientTimeout(total=240)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                # the non-streamed answers, one by one (also the warm-up)
                want = {}
                for proto in ("openai", "anthropic"):
                    for q in QUESTIONS:
                        want[proto, q] = await answer(session, s.url, proto, q)
                base_rss = rss_bytes(s.proc.pid)
                rnd = random.Random(0)
                jobs = []
                for i in range(N_CLIENTS):
                    proto = "openai" if i % 2 == 0 else "anthropic"
                    q = QUESTIONS[i % len(QUESTIONS)]
                    leave = rnd.randint(2, 6) if rnd.random() < 0.3 else None
                    jobs.append((proto, q, leave))
                t0 = time.monotonic()
                results = await asyncio.gather(*(streamed(session, s.url, p, q, lv) for p, q, lv in jobs))
                took = time.monotonic() - t0
                return {"want": want, "base_rss": base_rss, "took": took}, list(zip(jobs, results))

        meta, results = asyncio.run(main())
        completed = [(j, r) for j, r in results if r is not None]
        left = [j for j, r in results if r is None]
        assert left and len(completed) >= N_CLIENTS // 2
        for (proto, q, _), text in completed:
            assert text == meta["want"][proto, q], (proto, q)
        # the engine has finished or cancelled every request
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            st = s.stats()["requests"]
            if (
                st["active"] == 0
                and st["queued"] == 0
                and st["served"] + st["cancelled"] >= 2 * len(QUESTIONS) + N_CLIENTS
            ):
                break
            time.sleep(0.1)
        st = s.stats()
        r = st["requests"]
        assert r["active"] == 0 and r["queued"] == 0, r
        assert r["received"] == r["served"] + r["cancelled"] + r["rejected"] + r["failed"], r
        assert r["failed"] == 0 and r["rejected"] == 0
        assert r["cancelled"] <= len(left)  # a client that left after its last token may have been served
        assert r["served"] >= 2 * len(QUESTIONS) + len(completed)
        # memory back near the baseline: at most the prompt cache (64 MiB) and 64 MiB of slack above it
        rss = rss_bytes(s.proc.pid)
        assert rss < meta["base_rss"] + (128 << 20), (rss, meta["base_rss"])
        assert st["prompt_cache"]["bytes"] <= 64 << 20


def test_concurrent_prompts_share_prefill_passes_at_stats():
    """Prompts arriving together are prefilled in shared passes (counted at /stats engine) and each
    answer equals the one it gets alone."""
    from concurrent.futures import ThreadPoolExecutor

    d = make_model("qwen3-float32", "qwen3")
    filler = "The committee reviewed the figures and the open tickets, item by item. " * 20
    prompts = [f"Request {i}: " + filler[: 900 + 37 * i] for i in range(8)]  # ~1 token per character

    def ask(s: Server, p: str) -> str:
        status, r = s.post("/v1/completions", {"prompt": p, "max_tokens": 6, "temperature": 0})
        assert status == 200, r
        return r["choices"][0]["text"]

    with Server(d, "--prompt-cache-bytes", "0") as s:
        alone = [ask(s, p) for p in prompts]
        base = s.stats()["engine"]
        assert base["prefill_max_rows"] == 1 and base["prefill_rows"] == base["prefill_steps"] > 0
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(lambda p: ask(s, p), prompts))
        e = s.stats()["engine"]
    assert together == alone
    steps, rows = e["prefill_steps"] - base["prefill_steps"], e["prefill_rows"] - base["prefill_rows"]
    assert rows >= len(prompts)  # every prompt in at least one pass
    assert e["prefill_max_rows"] >= 2 and rows > steps, e  # some passes were shared
    # the decode steps' host time grew by phase with the 8 generations' decode steps
    host, host0 = e["decode_host_seconds"], base["decode_host_seconds"]
    assert e["decode_steps"] > base["decode_steps"] and all(host[k] > host0[k] for k in ("build", "submit")), e
