"""Bad input over raw HTTP: every case gets the right status and its protocol's envelope, and the
server keeps serving. Also: API keys, body limits, methods, routes and a full queue."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import openai
import anthropic
import pytest

from server_util import Server, anthropic_error, openai_error

MODEL = "qwen3-float32"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(qwen3_dir):
    with Server(qwen3_dir, "--max-body-bytes", "20000") as s:
        yield s


def chat(**kw):
    return {"model": MODEL, "messages": HI, "max_tokens": 2, **kw}


def msg(**kw):
    return {"model": MODEL, "messages": HI, "max_tokens": 2, **kw}


def still_serving(server):
    status, body = server.post("/v1/chat/completions", chat())
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body


CHAT_BAD = [
    ("not json", b"{bad", None),
    ("not an object", b"[1, 2]", None),
    ("empty body", b"", None),
    ("NaN", b'{"model": "qwen3-float32", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', None),
    ("messages a string", chat(messages="hi"), "messages"),
    ("messages empty", chat(messages=[]), "messages"),
    ("messages missing", {"model": MODEL}, "messages"),
    ("message not an object", chat(messages=["hi"]), "messages[0]"),
    ("unknown role", chat(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
    ("missing role", chat(messages=[{"content": "hi"}]), "messages[0].role"),
    ("user content missing", chat(messages=[{"role": "user"}]), "messages[0].content"),
    ("content a number", chat(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    ("unknown part", chat(messages=[{"role": "user", "content": [{"type": "hologram"}]}]), "messages[0].content[0]"),
    ("temperature a string", chat(temperature="hot"), "temperature"),
    ("temperature negative", chat(temperature=-1), "temperature"),
    ("temperature huge", chat(temperature=1e308), "temperature"),
    (
        "temperature overflow",
        b'{"model": "qwen3-float32", "messages": [{"role": "user", "content": "hi"}], "temperature": 1e400}',
        "temperature",
    ),
    ("top_p above 1", chat(top_p=5), "top_p"),
    ("top_k huge", chat(top_k=10**12), "top_k"),
    ("max_tokens a string", chat(max_tokens="10"), "max_tokens"),
    ("max_tokens negative", chat(max_tokens=-1), "max_tokens"),
    ("max_tokens zero", chat(max_tokens=0), "max_tokens"),
    ("max_tokens a float", chat(max_tokens=2.5), "max_tokens"),
    ("max_tokens a bool", chat(max_tokens=True), "max_tokens"),
    ("seed huge", chat(seed=10**30), "seed"),
    ("stream a string", chat(stream="yes"), "stream"),
    ("n = 2", chat(n=2), "n"),
    ("stop a number", chat(stop=[1]), "stop"),
    ("logit_bias key", chat(logit_bias={"abc": 1}), "logit_bias"),
    ("logit_bias out of vocab", chat(logit_bias={"999999": 1}), "logit_bias"),
    ("logit_bias too big", chat(logit_bias={"5": 1000}), "logit_bias"),
    ("top_logprobs too many", chat(logprobs=True, top_logprobs=50), "top_logprobs"),
    ("presence_penalty", chat(presence_penalty=3), "presence_penalty"),
    ("tools not a list", chat(tools={"x": 1}), "tools"),
    ("tool without name", chat(tools=[{"type": "function", "function": {}}]), "tools[0]"),
    ("response_format xml", chat(response_format={"type": "xml"}), "response_format.type"),
    (
        "response_format schema not an object",
        chat(response_format={"type": "json_schema", "json_schema": {"schema": 3}}),
        "response_format.json_schema.schema",
    ),
]


@pytest.mark.parametrize("name, body, param", CHAT_BAD, ids=[c[0] for c in CHAT_BAD])
def test_bad_chat_requests(server, name, body, param):
    raw = body if isinstance(body, bytes) else json.dumps(body)
    status, resp = server.request("POST", "/v1/chat/completions", raw)
    err = openai_error(status, resp)
    assert err["type"] == "invalid_request_error"
    if param:
        assert err["param"] == param and err["message"].startswith(param), err
    still_serving(server)


MSG_BAD = [
    ("not json", b"{bad"),
    ("max_tokens missing", {"model": MODEL, "messages": HI}),
    ("max_tokens negative", msg(max_tokens=-5)),
    ("max_tokens a string", msg(max_tokens="5")),
    ("messages empty", msg(messages=[])),
    ("unknown role", msg(messages=[{"role": "tool", "content": "x"}])),
    ("system a number", msg(system=5)),
    ("temperature above 1", msg(temperature=1.5)),
    ("stop_sequences a string list of ints", msg(stop_sequences=[1, 2])),
    ("block without type", msg(messages=[{"role": "user", "content": [{"text": "x"}]}])),
    (
        "tool_use in a user message",
        msg(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "x", "input": {}}]}]),
    ),
    ("thinking malformed", msg(thinking={"type": "sometimes"})),
]


@pytest.mark.parametrize("name, body", MSG_BAD, ids=[c[0] for c in MSG_BAD])
def test_bad_messages_requests(server, name, body):
    raw = body if isinstance(body, bytes) else json.dumps(body)
    status, resp = server.request("POST", "/v1/messages", raw)
    err = anthropic_error(status, resp)
    assert err["type"] == "invalid_request_error"
    status, resp = server.post("/v1/messages", msg())
    assert status == 200 and resp["stop_reason"] == "max_tokens"


def test_bad_completions_requests(server):
    for body in [
        {"model": MODEL, "prompt": 5},
        {"model": MODEL, "prompt": ["a", "b"]},
        {"model": MODEL, "prompt": [1, -3]},
        {"model": MODEL, "prompt": ""},
        {"model": MODEL, "prompt": "x", "best_of": 3},
        {"model": MODEL, "prompt": "x", "suffix": "y"},
        {"model": MODEL, "prompt": "x", "logprobs": 99},
    ]:
        status, resp = server.post("/v1/completions", body)
        openai_error(status, resp)
    still_serving(server)


def test_unknown_model_404_both_envelopes(qwen3_dir):
    # any name is answered unless --strict-model-names (tests/test_server_compat.py)
    with Server(qwen3_dir, "--strict-model-names") as server:
        status, body = server.post("/v1/chat/completions", chat(model="gpt-4o"))
        assert openai_error(status, body, 404)["code"] == "model_not_found"
        status, body = server.post("/v1/messages", msg(model="claude"))
        assert anthropic_error(status, body, 404)["type"] == "not_found_error"


def test_unknown_route_and_wrong_method(server):
    status, body = server.get("/v1/nothing")
    openai_error(status, body, 404)
    status, body = server.get("/v1/chat/completions")
    err = openai_error(status, body, 405)
    assert "POST" in err["message"]
    status, body = server.request("PUT", "/v1/messages", "{}")
    anthropic_error(status, body, 405)
    still_serving(server)


def test_body_too_large(server):
    big = json.dumps(chat(messages=[{"role": "user", "content": "x" * 30000}]))
    status, body = server.request("POST", "/v1/chat/completions", big)
    err = openai_error(status, body, 413)
    assert "20000" in err["message"]
    status, body = server.request("POST", "/v1/messages", json.dumps(msg(system="y" * 30000)))
    assert anthropic_error(status, body, 413)["type"] == "request_too_large"
    # chunked, without Content-Length: the limit holds while reading
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    data = big.encode()
    for i in range(0, len(data), 4096):
        part = data[i : i + 4096]
        conn.send(f"{len(part):x}\r\n".encode() + part + b"\r\n")
    conn.send(b"0\r\n\r\n")
    r = conn.getresponse()
    body = json.loads(r.read())
    conn.close()
    openai_error(r.status, body, 413)
    still_serving(server)


def test_api_key(qwen3_dir):
    with Server(qwen3_dir, "--api-key", "sekrit") as s:
        with pytest.raises(openai.AuthenticationError) as e:
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert e.value.status_code == 401
        status, body = s.post("/v1/chat/completions", chat())
        assert openai_error(status, body, 401)["code"] == "invalid_api_key"
        status, body = s.post("/v1/messages", msg())
        assert anthropic_error(status, body, 401)["type"] == "authentication_error"
        ok = openai.OpenAI(base_url=s.url + "/v1", api_key="sekrit", max_retries=0)
        assert ok.chat.completions.create(model=MODEL, messages=HI, max_tokens=2).usage.completion_tokens == 2
        a = anthropic.Anthropic(base_url=s.url, api_key="sekrit", max_retries=0)
        assert a.messages.create(model=MODEL, messages=HI, max_tokens=2).usage.output_tokens == 2
        assert s.get("/health")[0] == 200  # open, for probes
        assert s.get("/stats")[0] == 401


def _long_stream(port: int, max_tokens: int = 100000) -> socket.socket:
    """Start a streaming chat that would run for a long time; returns the open socket."""
    body = json.dumps(
        {"model": MODEL, "messages": HI, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    ).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


def test_full_queue_is_429(qwen3_dir):
    with Server(qwen3_dir, "--max-concurrency", "1", "--max-queue", "1") as s:
        first = _long_stream(s.port)
        first.recv(4096)
        deadline = time.monotonic() + 10
        while s.stats()["requests"]["active"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)  # it is running (a request is queued until the engine admits it)
        results: dict[str, tuple[int, float]] = {}

        def waiter() -> None:
            t0 = time.monotonic()
            status, _ = s.post("/v1/chat/completions", chat())
            results["second"] = (status, time.monotonic() - t0)

        t = threading.Thread(target=waiter)
        t.start()
        deadline = time.monotonic() + 10
        while s.stats()["requests"]["queued"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        status, body = s.post("/v1/chat/completions", chat())
        err = openai_error(status, body, 429)
        assert "busy" in err["message"]
        status, body = s.post("/v1/messages", msg())
        assert anthropic_error(status, body, 429)["type"] == "rate_limit_error"
        first.close()  # the queued one runs once the first is cancelled
        t.join(30)
        assert results["second"][0] == 200
