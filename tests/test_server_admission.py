"""Memory admission with a small --memory-budget, client disconnects, and the port probe."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import anthropic
import openai
import pytest

from mlxrs import _native
from server_util import Server, free_port, sse_events
from tinymodels import make_model

MODEL = "qwen3-float32"
CEILING = 64


@pytest.fixture(scope="module")
def model_dir():
    return make_model("qwen3-float32", "qwen3")


@pytest.fixture(scope="module")
def budget(model_dir) -> int:
    """The budget whose maximum safe context is exactly CEILING tokens (the planner's own total)."""
    return int(json.loads(_native.plan(str(model_dir), CEILING))["totalBytes"])


@pytest.fixture(scope="module")
def server(model_dir, budget):
    with Server(model_dir, "--memory-budget", str(budget)) as s:
        yield s


def oa(s: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)


def an(s: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0, timeout=60)


def words(n: int) -> str:
    return " ".join(["fox"] * n)


def test_ceiling_at_stats(server, budget, model_dir):
    st = server.stats()
    assert st["context_tokens"] == CEILING
    plan = st["memory_plan"]
    assert plan["maxSafeContext"] == CEILING and plan["usableBytes"] == budget and plan["fits"] is False
    assert plan == json.loads(_native.plan(str(model_dir), None, None, str(budget)))
    # the plan's allocator limit is MLX's memory limit in the serving process (read back from MLX)
    assert st["memory_limit_bytes"] == plan["allocatorLimitBytes"] == budget - plan["reserveBytes"]
    assert "does not fit the memory budget" in server.stderr()  # warned, and serving


def test_prompt_that_cannot_fit_is_400_in_both_envelopes(server):
    with pytest.raises(openai.BadRequestError) as e:
        oa(server).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": words(200)}], max_tokens=5
        )
    err = e.value.body
    assert e.value.status_code == 400
    assert err["type"] == "memory_admission" and err["code"] == "context_over_budget"
    assert "64 tokens" in err["message"]
    with pytest.raises(anthropic.BadRequestError) as e2:
        an(server).messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": words(200)}])
    body = e2.value.body
    assert body["type"] == "error"
    assert body["error"]["type"] == "memory_admission" and body["error"]["code"] == "context_over_budget"
    status, body = server.post("/v1/completions", {"model": MODEL, "prompt": list(range(5, 5 + CEILING))})
    assert status == 400 and body["error"]["code"] == "context_over_budget"
    # one token short of the ceiling leaves exactly one token of room
    status, body = server.post(
        "/v1/completions", {"model": MODEL, "prompt": list(range(5, 4 + CEILING)), "max_tokens": 50, "temperature": 0}
    )
    assert status == 200 and body["usage"]["completion_tokens"] == 1 and body["choices"][0]["finish_reason"] == "length"
    assert server.stats()["requests"]["rejected_memory_admission"] >= 3


def test_max_tokens_clamped_to_the_room_openai(server):
    r = oa(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": words(10)}], max_tokens=100000, temperature=0
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == CEILING - r.usage.prompt_tokens
    # streamed, and without max_tokens (the room is the default)
    chunks = list(
        oa(server).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": words(20)}],
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    u = chunks[-1].usage
    assert u.completion_tokens == CEILING - u.prompt_tokens
    assert server.stats()["requests"]["clamped_max_tokens"] >= 1


def test_max_tokens_clamped_to_the_room_anthropic(server):
    m = an(server).messages.create(
        model=MODEL, max_tokens=5000, extra_body={"temperature": 0}, messages=[{"role": "user", "content": words(7)}]
    )
    assert m.stop_reason == "max_tokens"
    assert m.usage.output_tokens == CEILING - m.usage.input_tokens
    with an(server).messages.stream(
        model=MODEL, max_tokens=5000, extra_body={"temperature": 0}, messages=[{"role": "user", "content": words(3)}]
    ) as s:
        final = s.get_final_message()
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == CEILING - final.usage.input_tokens


def test_budget_too_small_warns_and_serves(model_dir):
    with Server(model_dir, "--memory-budget", "1000") as s:
        assert s.stats()["context_tokens"] == 0
        assert "does not hold the weights" in s.stderr()
        status, body = s.post(
            "/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
        )
        assert status == 400 and body["error"]["code"] == "context_over_budget"


def test_bad_budget_is_refused_before_loading(model_dir):
    p = subprocess.run(
        [sys.executable, "-m", "mlxrs", "serve", str(model_dir), "--port", str(free_port()), "--memory-budget", "lots"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1 and 'memory budget "lots"' in p.stderr


# -- client disconnects ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def talker_dir():
    """A random model that talks for long at temperature 0: 1158 tokens of visible text, then EOS
    (the qwen3 one only emits newlines, which the detokenizer holds back until the end)."""
    return make_model("llama-float32", "llama")


def _start_stream(port: int, path: str, body: dict) -> socket.socket:
    raw = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n".encode()
        + f"Content-Length: {len(raw)}\r\n\r\n".encode()
        + raw
    )
    return sock


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"stream": True, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}),
        (
            "/v1/messages",
            {"stream": True, "temperature": 0, "max_tokens": 100000, "messages": [{"role": "user", "content": "hi"}]},
        ),
    ],
)
def test_disconnect_frees_the_engine(talker_dir, path, body):
    with Server(talker_dir) as s:
        base = s.stats()
        sock = _start_stream(s.port, path, body)
        got = b""
        while got.count(b"\n\n") < 4:  # a few events in: it is generating (~4000 tokens to go)
            got += sock.recv(4096)
        sock.close()
        t0 = time.monotonic()
        status, r = s.post(
            "/v1/chat/completions", {"max_tokens": 3, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
        )
        elapsed = time.monotonic() - t0
        assert status == 200 and r["usage"]["completion_tokens"] == 3
        deadline = time.monotonic() + 10
        while s.stats()["requests"]["cancelled"] < base["requests"]["cancelled"] + 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        st = s.stats()
        assert st["requests"]["cancelled"] == base["requests"]["cancelled"] + 1
        # the abandoned generation stopped early: far fewer tokens than its 1158 were made
        assert st["engine"]["generated_tokens_total"] - 3 < 500
        assert elapsed < 3.0, elapsed


def test_non_streaming_disconnect_cancels(talker_dir):
    with Server(talker_dir) as s:
        sock = _start_stream(
            s.port, "/v1/chat/completions", {"temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
        )
        deadline = time.monotonic() + 10
        while s.stats()["requests"]["active"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        sock.close()
        deadline = time.monotonic() + 10
        while s.stats()["requests"]["cancelled"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        st = s.stats()
        assert st["requests"]["cancelled"] == 1 and st["requests"]["active"] == 0
        assert st["tokens"]["completion"] < 1158


# -- the port probe ----------------------------------------------------------------------------------
def test_second_serve_on_the_same_port(server, model_dir):
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "mlxrs", "serve", str(model_dir), "--port", str(server.port)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1
    assert p.stderr.strip() == (
        f"port {server.port} is already serving {MODEL} — reuse it, stop it, or pass --port <other>"
    )
    assert p.stdout.splitlines()[0].startswith(f"mlxrs serve: {MODEL}")
    assert time.monotonic() - t0 < 60


def test_port_held_by_something_else(model_dir):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        p = subprocess.run(
            [sys.executable, "-m", "mlxrs", "serve", str(model_dir), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert p.returncode == 1
    assert p.stderr.strip().startswith(f"port {port} is held by another program")
    assert "--port <other>" in p.stderr


def test_stats_events_are_sse(server):
    # a streamed completion through the ceiling still ends with [DONE]
    status, raw = server.request(
        "POST",
        "/v1/completions",
        json.dumps({"model": MODEL, "prompt": "fox", "max_tokens": 3, "temperature": 0, "stream": True}),
    )
    events = sse_events(raw)
    assert events[-1] == (None, "[DONE]") and events[-2][1]["choices"][0]["finish_reason"] == "length"


def test_kv_quant_is_planned_and_served(model_dir):
    with Server(model_dir, "--kv-quant", "8") as s:
        st = s.stats()
        assert st["kv_bits"] == 8
        assert st["memory_plan"] == json.loads(_native.plan(str(model_dir), None, 8))
        assert st["memory_plan"]["kvBytes"] < json.loads(_native.plan(str(model_dir)))["kvBytes"] / 3
        r = oa(s).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
        )
        assert r.usage.completion_tokens == 4
