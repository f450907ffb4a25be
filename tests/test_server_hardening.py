"""Issue #13, the HTTP half: request content that used to answer 500, the local-server guards
(Host, Origin, Content-Type, API key rules), the engine's state on /health, malformed HTTP, and
the bounded graceful shutdown. Requests go over real HTTP, to the app in this process (fast) or
to a `python -m mlxrs serve` subprocess; the official SDKs are clients too."""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time

import anthropic
import openai
import pytest

from cli_util import run_cli
from server_util import InProcess, Server, anthropic_error, free_port, openai_error, sse_events

MODEL = "qwen3-float32"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def app(qwen3_app):
    return qwen3_app


def _raw(obj: dict, **replace: str) -> bytes:
    """JSON with placeholders swapped for raw text Python's json would not write (NaN, \\ud800, 1e999…)."""
    text = json.dumps(obj)
    for k, v in replace.items():
        text = text.replace(json.dumps(k), v)
    return text.encode()


SUR = '"a\\ud800b"'  # the JSON escape of a lone surrogate
DEEP = "[" * 70 + "]" * 70
BIG = "1" + "0" * 400  # an integer beyond float range
CHAT = {"model": MODEL, "messages": HI, "max_tokens": 2}
MSG = {"model": MODEL, "messages": HI, "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": "P"}}}}
ATOOL = {"name": "f", "input_schema": {"type": "object", "properties": {"x": "P"}}}
CALL = {
    "role": "assistant",
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "A"}}],
}
USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"x": "P"}}]}

# (name, path, body, the parameter the message must name): each answered 500 before
CASES = [
    (
        "surrogate in content",
        "/v1/chat/completions",
        _raw({**CHAT, "messages": [{"role": "user", "content": "S"}]}, S=SUR),
        "messages[0].content",
    ),
    ("surrogate in model", "/v1/chat/completions", _raw({**CHAT, "model": "S"}, S=SUR), "model"),
    ("surrogate in prompt", "/v1/completions", _raw({"model": MODEL, "prompt": "S", "max_tokens": 2}, S=SUR), "prompt"),
    ("surrogate in stop", "/v1/chat/completions", _raw({**CHAT, "stop": ["S"]}, S=SUR), "stop[0]"),
    (
        "surrogate in a tool name",
        "/v1/chat/completions",
        _raw({**CHAT, "tools": [{"type": "function", "function": {"name": "S"}}]}, S=SUR),
        "tools[0].function.name",
    ),
    (
        "surrogate in a key",
        "/v1/chat/completions",
        _raw({**CHAT, "tools": [TOOL]}, P="{" + SUR + ": 1}"),
        "tools[0].function.parameters.properties.x",
    ),
    ("surrogate in system", "/v1/messages", _raw({**MSG, "system": "S"}, S=SUR), "system"),
    ("surrogate in model (anthropic)", "/v1/messages", _raw({**MSG, "model": "S"}, S=SUR), "model"),
    (
        "content part type an array",
        "/v1/chat/completions",
        json.dumps({**CHAT, "messages": [{"role": "user", "content": [{"type": []}]}]}).encode(),
        "messages[0].content[0]",
    ),
    (
        "content block type an array",
        "/v1/messages",
        json.dumps({**MSG, "messages": [{"role": "user", "content": [{"type": []}]}]}).encode(),
        "messages[0].content[0]",
    ),
    (
        "system block type an object",
        "/v1/messages",
        json.dumps({**MSG, "system": [{"type": {}}]}).encode(),
        "system[0]",
    ),
    (
        "NaN in tool parameters",
        "/v1/chat/completions",
        _raw({**CHAT, "tools": [TOOL]}, P="NaN"),
        "tools[0].function.parameters.properties.x",
    ),
    (
        "Infinity in input_schema",
        "/v1/messages",
        _raw({**MSG, "tools": [ATOOL]}, P="-Infinity"),
        "tools[0].input_schema.properties.x",
    ),
    (
        "huge int in input_schema",
        "/v1/messages",
        _raw({**MSG, "tools": [ATOOL]}, P=BIG),
        "tools[0].input_schema.properties.x",
    ),
    (
        "1e999 in tool_use.input",
        "/v1/messages",
        _raw({**MSG, "messages": [*HI, USE, *HI]}, P="1e999"),
        "messages[1].content[0].input.x",
    ),
    (
        "deep nesting in parameters",
        "/v1/chat/completions",
        _raw({**CHAT, "tools": [TOOL]}, P=DEEP),
        "tools[0].function.parameters.properties.x[0]",
    ),
    (
        "NaN in tool-call arguments",
        "/v1/chat/completions",
        json.dumps(
            {
                **CHAT,
                "messages": [
                    *HI,
                    {
                        **CALL,
                        "tool_calls": [{**CALL["tool_calls"][0], "function": {"name": "f", "arguments": '{"x": NaN}'}}],
                    },
                ],
            }
        ).encode(),
        "messages[1].tool_calls[0].function.arguments.x",
    ),
    (
        "deep tool-call arguments",
        "/v1/chat/completions",
        json.dumps(
            {
                **CHAT,
                "messages": [
                    *HI,
                    {
                        **CALL,
                        "tool_calls": [
                            {
                                **CALL["tool_calls"][0],
                                "function": {"name": "f", "arguments": json.dumps({"x": json.loads(DEEP)})},
                            }
                        ],
                    },
                ],
            }
        ).encode(),
        "messages[1].tool_calls[0].function.arguments.x",
    ),
    (
        "Infinity in chat_template_kwargs",
        "/v1/chat/completions",
        _raw({**CHAT, "chat_template_kwargs": {"k": "P"}}, P="Infinity"),
        "chat_template_kwargs.k",
    ),
    (
        "chat_template_kwargs.tools",
        "/v1/chat/completions",
        json.dumps({**CHAT, "chat_template_kwargs": {"tools": []}}).encode(),
        "chat_template_kwargs",
    ),
    (
        "chat_template_kwargs.messages",
        "/v1/chat/completions",
        json.dumps({**CHAT, "chat_template_kwargs": {"messages": []}}).encode(),
        "chat_template_kwargs",
    ),
    (
        "add_generation_prompt not a bool",
        "/v1/chat/completions",
        json.dumps({**CHAT, "chat_template_kwargs": {"add_generation_prompt": "yes"}}).encode(),
        "chat_template_kwargs.add_generation_prompt",
    ),
    ("10**400 temperature", "/v1/chat/completions", _raw({**CHAT, "temperature": "T"}, T=BIG), "temperature"),
    ("10**400 temperature (anthropic)", "/v1/messages", _raw({**MSG, "temperature": "T"}, T=BIG), "temperature"),
    ("10**400 logit_bias", "/v1/chat/completions", _raw({**CHAT, "logit_bias": {"5": "B"}}, B=BIG), "logit_bias.5"),
    ("max_tokens null (anthropic)", "/v1/messages", json.dumps({**MSG, "max_tokens": None}).encode(), "max_tokens"),
    (
        "tool_choice without tools (anthropic)",
        "/v1/messages",
        json.dumps({**MSG, "tool_choice": {"type": "tool", "name": "f"}}).encode(),
        "tool_choice",
    ),
    (
        "tool_choice malformed without tools (anthropic)",
        "/v1/messages",
        json.dumps({**MSG, "tool_choice": "auto"}).encode(),
        "tool_choice",
    ),
    (
        "tool_choice without tools (openai)",
        "/v1/chat/completions",
        json.dumps({**CHAT, "tool_choice": "required"}).encode(),
        "tool_choice",
    ),
]


@pytest.mark.parametrize("name, path, raw, param", CASES, ids=[c[0] for c in CASES])
def test_request_content_is_a_400_naming_the_parameter(app, name, path, raw, param):
    status, headers, body = app.request("POST", path, raw)
    if path == "/v1/messages":
        err = anthropic_error(status, body)
        assert err["type"] == "invalid_request_error"
    else:
        err = openai_error(status, body)
        assert err["param"].removesuffix("…") == param, err
    assert re.match(re.escape(param) + "…?:", err["message"]), err
    assert headers["Content-Type"].startswith("application/json")


def test_bad_gzip_body_is_an_envelope(app):
    status, _, body = app.request(
        "POST", "/v1/chat/completions", json.dumps(CHAT), headers={"Content-Encoding": "gzip"}
    )
    assert "cannot be read" in openai_error(status, body)["message"]
    status, _, body = app.request("POST", "/v1/messages", b"\x1f\x8bnot gzip", headers={"Content-Encoding": "gzip"})
    anthropic_error(status, body)
    status, _, body = app.request(
        "POST", "/v1/chat/completions", gzip.compress(json.dumps(CHAT).encode()), headers={"Content-Encoding": "gzip"}
    )
    assert status == 200 and body["usage"]["completion_tokens"] == 2  # real gzip still works


def test_malformed_http_is_a_json_envelope(qwen3_server):
    s = qwen3_server
    for raw in (
        b"GARBAGE\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header\r\n\r\n",
        b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: x\r\n\r\n",
    ):
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as sock:
            sock.sendall(raw)
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        head, _, payload = data.partition(b"\r\n\r\n")
        assert re.match(rb"HTTP/1\.[01] 400 ", head), data
        assert b"application/json" in head, data
        assert openai_error(400, json.loads(payload))["message"].startswith("malformed HTTP request"), data
    assert s.post("/v1/chat/completions", CHAT)[0] == 200


# -- local-server security -------------------------------------------------------------------------
def test_foreign_host_is_refused_dns_rebinding(app):
    for host in ("evil.example", "evil.example:8080", "127.0.0.1.evil.example", "192.168.1.20"):
        status, _, body = app.request("GET", "/stats", headers={"Host": host})
        err = openai_error(status, body, 403)
        assert err["code"] == "host_not_allowed" and "--allowed-hosts" in err["message"]
        status, _, body = app.post("/v1/messages", MSG, headers={"Host": host})
        assert anthropic_error(status, body, 403)["type"] == "permission_error"
    for host in ("localhost", "localhost:8080", "127.0.0.1:1", "[::1]:8080", "app.localhost"):
        assert app.request("GET", "/stats", headers={"Host": host})[0] == 200, host
    assert app.request("GET", "/health", headers={"Host": "evil.example"})[0] == 200  # probes


def test_allowed_hosts_extends_the_names(qwen3_dir):
    s = InProcess(qwen3_dir, allowed_hosts=["box.lan"])
    try:
        assert s.request("GET", "/stats", headers={"Host": "box.lan:8080"})[0] == 200
        assert s.request("GET", "/stats", headers={"Host": "evil.example"})[0] == 403
    finally:
        s.close()
    s = InProcess(qwen3_dir, allowed_hosts=["*"])
    try:
        assert s.request("GET", "/stats", headers={"Host": "evil.example"})[0] == 200
    finally:
        s.close()


@pytest.mark.parametrize(
    "ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None]
)
def test_browser_simple_posts_are_refused(app, ctype):
    """What a page elsewhere can POST without a CORS preflight never runs a generation."""
    raw = json.dumps(CHAT).encode()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages"):
        if ctype is None:  # no Content-Type at all (a Blob body)
            status, _, body = _no_content_type(app, path, raw)
        else:
            status, _, body = app.request("POST", path, raw, headers={"Content-Type": ctype})
        err = (anthropic_error if path == "/v1/messages" else openai_error)(status, body, 415)
        assert "application/json" in err["message"]


def _no_content_type(app, path, raw):
    async def go():
        async with app.client.session.post(
            app.client.make_url(path), data=raw, skip_auto_headers=["Content-Type"]
        ) as r:
            return r.status, dict(r.headers), await r.json()

    return app.loop.run_until_complete(go())


def test_foreign_origin_is_refused_same_origin_allowed(app):
    port = app.client.port
    status, _, body = app.post("/v1/chat/completions", CHAT, headers={"Origin": "http://evil.example"})
    assert openai_error(status, body, 403)["code"] == "origin_not_allowed"
    status, _, body = app.post("/v1/messages", MSG, headers={"Origin": "null"})
    anthropic_error(status, body, 403)
    # a page served from this server's own origin (same scheme, host and port)
    status, headers, body = app.post("/v1/chat/completions", CHAT, headers={"Origin": f"http://127.0.0.1:{port}"})
    assert status == 200 and "Access-Control-Allow-Origin" not in headers
    # no CORS preflight is answered by default
    status, _, body = app.request(
        "OPTIONS",
        "/v1/chat/completions",
        headers={"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"},
    )
    openai_error(status, body, 403)


def test_cors_origin_allows_a_page(qwen3_dir):
    s = InProcess(qwen3_dir, cors_origins=["http://localhost:3000"])
    try:
        pre = {
            "Origin": "http://localhost:3000",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        }
        status, headers, _ = s.request("OPTIONS", "/v1/chat/completions", headers=pre)
        assert status == 204 and headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
        assert "POST" in headers["Access-Control-Allow-Methods"]
        assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        status, headers, body = s.post("/v1/chat/completions", CHAT, headers={"Origin": "http://localhost:3000"})
        assert status == 200 and headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
        status, headers, body = s.post("/v1/messages", MSG, headers={"Origin": "http://localhost:3001"})
        assert status == 403 and "Access-Control-Allow-Origin" not in headers
    finally:
        s.close()


def test_sdks_work_through_the_guards(qwen3_dir):
    with Server(qwen3_dir, "--cors-origin", "http://localhost:3000") as s:
        for base in (s.url, f"http://localhost:{s.port}"):
            oa = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
            assert oa.chat.completions.create(model=MODEL, messages=HI, max_tokens=2).usage.completion_tokens == 2
            chunks = list(oa.completions.create(model=MODEL, prompt="hi", max_tokens=2, stream=True))
            assert chunks[-1].choices[0].finish_reason == "length"
            an = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
            assert an.messages.create(model=MODEL, messages=HI, max_tokens=2).stop_reason == "max_tokens"
            with an.messages.stream(model=MODEL, messages=HI, max_tokens=2) as st:
                assert st.get_final_message().usage.output_tokens == 2
        bad = openai.OpenAI(
            base_url=s.url + "/v1", api_key="x", max_retries=0, default_headers={"Host": "attacker.example"}
        )
        with pytest.raises(openai.PermissionDeniedError):
            bad.models.list()


def _serve_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    # in-process: the refusal comes before the model is loaded (and /nonexistent would fail the load)
    return run_cli("serve", "/nonexistent", "--port", str(free_port()), *args, env={**os.environ, **(env or {})})


def test_empty_api_key_is_refused():
    r = _serve_cli("--api-key", "")
    assert r.returncode == 2 and "--api-key is empty" in r.stderr, r.stderr
    r = _serve_cli("--api-key", "  ")
    assert r.returncode == 2, r.stderr
    r = _serve_cli(env={"MLXRS_API_KEY": ""})
    assert r.returncode == 2 and "MLXRS_API_KEY is empty" in r.stderr, r.stderr


def test_all_interfaces_without_a_key_warns_and_checks_host(qwen3_dir, qwen3_server):
    with Server(qwen3_dir, "--host", "0.0.0.0") as s:
        assert "without an API key" in s.stderr()
        assert s.get("/stats", headers={"Host": "192.168.7.7:" + str(s.port)})[0] == 403
        assert s.get("/stats")[0] == 200
    with Server(qwen3_dir, "--host", "0.0.0.0", "--api-key", "k") as s:
        assert "without an API key" not in s.stderr()
        auth = {"Authorization": "Bearer k", "Host": "192.168.7.7:" + str(s.port)}
        assert s.get("/stats", headers=auth)[0] == 200  # a key it cannot know guards it instead
    assert "without an API key" not in qwen3_server.stderr()  # loopback, the default


# -- the engine's state --------------------------------------------------------------------------
class _DeadEngine:
    """The session's info as the engine reports it once its thread has died."""

    def __init__(self, app):
        self.app = app

    def __enter__(self):
        sess = type(self.app.session)
        self.prop = sess.__dict__["info"]
        base = self.prop
        setattr(sess, "info", property(lambda s: {**base.fget(s), "engine": {"state": "dead", "error": "panic: boom"}}))
        return self

    def __exit__(self, *exc):
        setattr(type(self.app.session), "info", self.prop)


def test_health_and_requests_when_the_engine_died(qwen3_dir):
    app = InProcess(qwen3_dir)
    try:
        status, _, body = app.request("GET", "/health")
        assert status == 200 and body["status"] == "ok" and body["engine"] == {"state": "running", "error": None}
        with _DeadEngine(app):
            status, _, body = app.request("GET", "/health")
            assert status == 503 and body["status"] == "unavailable"
            assert body["engine"] == {"state": "dead", "error": "panic: boom"}
            status, _, body = app.post("/v1/chat/completions", CHAT)
            err = openai_error(status, body, 503)
            assert err["code"] == "engine_unavailable" and "panic: boom" in err["message"]
            status, _, body = app.post("/v1/completions", {"model": MODEL, "prompt": "hi", "stream": True})
            openai_error(status, body, 503)
            status, _, body = app.post("/v1/messages", {**MSG, "stream": True})
            assert anthropic_error(status, body, 503)["type"] == "api_error"
            stats = app.request("GET", "/stats")[2]
            assert stats["requests"]["engine_unavailable"] == 3 and stats["engine"]["state"] == "dead"
    finally:
        app.close()


def test_engine_error_from_the_engine_is_a_503(qwen3_dir, monkeypatch):
    from mlxrs.errors import EngineError

    app = InProcess(qwen3_dir)
    try:

        def start(*a, **k):
            raise EngineError("the engine thread panicked")

        monkeypatch.setattr(app.state.session, "_s", _Proxy(app.state.session._s, start=start))
        status, _, body = app.post("/v1/messages", MSG)
        err = anthropic_error(status, body, 503)
        assert "panicked" in err["message"]
        assert app.request("GET", "/stats")[2]["requests"]["engine_unavailable"] == 1
    finally:
        monkeypatch.undo()
        app.close()


class _Proxy:
    def __init__(self, inner, **over):
        self._inner, self._over = inner, over

    def __getattr__(self, name):
        return self._over.get(name) or getattr(self._inner, name)


@pytest.mark.skipif(
    not hasattr(__import__("mlxrs").Session, "_inject_engine_panic"),
    reason="needs the engine-death contract (Session._inject_engine_panic)",
)
def test_engine_panic_end_to_end(qwen3_dir):
    app = InProcess(qwen3_dir)
    try:
        app.session._inject_engine_panic()
        deadline = time.monotonic() + 10
        while app.request("GET", "/health")[0] != 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        status, _, body = app.request("GET", "/health")
        assert status == 503 and body["engine"]["state"] == "dead"
        openai_error(*app.post("/v1/chat/completions", CHAT)[::2], 503)
    finally:
        app.close()


# -- graceful shutdown -----------------------------------------------------------------------------
def _open_stream(port: int, path: str, body: dict) -> socket.socket:
    raw = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(raw)}\r\n\r\n".encode()
        + raw
    )
    return sock


def _read_all(sock: socket.socket) -> str:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data.decode(errors="replace")


def _dechunk(raw: str) -> str:
    head, _, body = raw.partition("\r\n\r\n")
    out, rest = [], body
    while rest:
        size, _, rest = rest.partition("\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out.append(rest[:n])
        rest = rest[n + 2 :]
    return head + "\n\n" + "".join(out)


def test_sigterm_ends_streams_well_formed_within_the_bound(qwen3_dir):
    with Server(qwen3_dir, "--shutdown-timeout", "1", "--max-concurrency", "2") as s:
        oa = _open_stream(s.port, "/v1/chat/completions", {**CHAT, "max_tokens": 100000, "stream": True})
        an = _open_stream(s.port, "/v1/messages", {**MSG, "max_tokens": 100000, "stream": True})
        deadline = time.monotonic() + 20
        while s.stats()["requests"]["active"] < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        queued: dict[str, object] = {}
        t = threading.Thread(target=lambda: queued.update(r=s.post("/v1/chat/completions", CHAT)))
        t.start()
        while s.stats()["requests"]["queued"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        t.join(10)
        status, body = queued["r"]  # type: ignore[misc]
        assert openai_error(status, body, 503)["code"] == "shutting_down"
        oa_raw, an_raw = _dechunk(_read_all(oa)), _dechunk(_read_all(an))
        s.proc.wait(10)
        took = time.monotonic() - t0
        assert s.proc.returncode == 0 and took < 1 + 4, (took, s.stderr())
        assert took >= 0.9  # the running streams had their second
        ev = sse_events(oa_raw)
        assert ev[-1] == (None, "[DONE]"), oa_raw[-500:]
        assert ev[-2][1]["choices"][0]["finish_reason"] == "length", ev[-2]
        names = [e for e, _ in sse_events(an_raw)]
        assert names[-2:] == ["message_delta", "message_stop"], an_raw[-500:]
        assert sse_events(an_raw)[-2][1]["delta"]["stop_reason"] == "max_tokens"
        assert re.search(r"ended early", s.stderr())


def test_sigterm_lets_a_short_stream_finish(qwen3_dir):
    with Server(qwen3_dir, "--shutdown-timeout", "30") as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=300, stream=True)
        it = iter(stream)
        first = next(it)
        assert first.choices[0].delta.role == "assistant"
        # running, not queued: wait for its first text (the role chunk comes before the engine admits it)
        while not (c := next(it)).choices or c.choices[0].delta.content is None:
            pass
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        chunks = [c, *it]
        s.proc.wait(30)
        assert time.monotonic() - t0 < 20
        assert chunks[-1].choices[0].finish_reason == "length"
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content is not None) >= 1
        assert "ended early" not in s.stderr()


# -- a huge prompt ---------------------------------------------------------------------------------
def _rss_mb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the RSS from /proc")
def test_huge_prompt_is_refused_without_tokenizing_it_all(app):
    """A 5 MB prompt far past the context ceiling is refused from the tokens of a prefix: before,
    tokenizing all of it left the process ~600 MB larger."""
    big = "hello world " * (5_000_000 // 12)
    before = _rss_mb()
    for path, body in [
        ("/v1/completions", {"prompt": big, "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": big}], "max_tokens": 2}),
        ("/v1/messages", {"messages": [{"role": "user", "content": big}], "max_tokens": 2}),
    ]:
        status, _, body = app.post(path, body)
        assert status == 400, body
        err = body["error"]
        assert err["type"] == "memory_admission" and err["message"].startswith("the prompt (more than"), err
    assert _rss_mb() - before < 200
    # one just past the ceiling is still measured exactly
    ceiling = app.state.context_tokens
    status, _, body = app.post("/v1/completions", {"prompt": [7] * ceiling, "max_tokens": 2})
    assert status == 400 and f"({ceiling} tokens)" in body["error"]["message"], body
