"""Start a real `python -m mlxrs serve` process on loopback for the server tests."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A server subprocess; `url` is its base URL (without /v1)."""

    def __init__(
        self,
        model: Path | str | None,
        *args: str,
        port: int | None = None,
        env: dict[str, str] | None = None,
        wait: bool = True,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.logdir = Path(tempfile.mkdtemp(prefix="mlxrs-serve-"))
        self.out = open(self.logdir / "stdout", "w+")
        self.err = open(self.logdir / "stderr", "w+")
        cmd = [
            sys.executable,
            "-m",
            "mlxrs",
            "serve",
            *([str(model)] if model is not None else []),
            "--port",
            str(self.port),
            *args,
        ]
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=self.err, env={**os.environ, **(env or {})})
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 120.0) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.stdout()}\n{self.stderr()}")
            try:
                status, _ = self.get("/health")
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"server did not come up:\n{self.stderr()}")

    def stdout(self) -> str:
        self.out.flush()
        return (self.logdir / "stdout").read_text()

    def stderr(self) -> str:
        self.err.flush()
        return (self.logdir / "stderr").read_text()

    def request(
        self,
        method: str,
        path: str,
        body: bytes | str | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 60.0,
    ) -> tuple[int, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        if isinstance(body, str):
            body = body.encode()
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        raw = r.read()
        conn.close()
        try:
            return r.status, json.loads(raw)
        except ValueError:
            return r.status, raw.decode(errors="replace")

    def get(self, path: str, **kw: Any) -> tuple[int, Any]:
        return self.request("GET", path, **kw)

    def post(self, path: str, obj: Any, **kw: Any) -> tuple[int, Any]:
        return self.request("POST", path, json.dumps(obj), **kw)

    def stats(self) -> dict[str, Any]:
        status, body = self.get("/stats")
        assert status == 200, body
        return body

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.out.close()
        self.err.close()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def openai_error(status: int, body: Any, code: int = 400) -> dict[str, Any]:
    """The `error` object of an OpenAI error envelope, after checking the status and the envelope's keys."""
    assert status == code, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def anthropic_error(status: int, body: Any, code: int = 400) -> dict[str, Any]:
    """The `error` object of an Anthropic error envelope, after checking the status and its shape."""
    assert status == code, body
    assert body["type"] == "error" and {"type", "message"} <= set(body["error"]), body
    return body["error"]


def openai_client(server: Server, timeout: float = 60) -> Any:
    """OpenAI's SDK pointed at a server (no retries: a failure shows at once)."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)


def sse_events(raw: str) -> list[tuple[str | None, Any]]:
    """(event name, data) pairs of an SSE body; data parsed as JSON where it is JSON."""
    out: list[tuple[str | None, Any]] = []
    for block in raw.split("\n\n"):
        event, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if not data:
            continue
        text = "\n".join(data)
        try:
            out.append((event, json.loads(text)))
        except ValueError:
            out.append((event, text))
    return out


class InProcess:
    """The server's aiohttp app in this process (aiohttp's test server on a loopback port, driven
    from a private event loop): fast enough for many requests (the fuzz tests). `kw` goes to
    ServerState (api_key, allowed_hosts, cors_origins, …)."""

    def __init__(self, model_dir: Path | str, **kw: Any) -> None:
        import asyncio

        from aiohttp.test_utils import TestClient, TestServer

        from mlxrs import Session, _native
        from mlxrs.server.app import ServerState, build_app

        self.session = Session(model_dir)
        plan = json.loads(_native.plan(str(model_dir), None, None, None))
        self.state = ServerState(
            self.session,
            model_id=Path(model_dir).name,
            aliases=[Path(model_dir).name],
            plan=plan,
            kv_bits=None,
            **{"api_key": None, **kw},
        )
        self.loop = asyncio.new_event_loop()
        self.client = TestClient(TestServer(build_app(self.state), host="127.0.0.1"), loop=self.loop)
        self.loop.run_until_complete(self.client.start_server())

    def request(
        self, method: str, path: str, body: bytes | str | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], Any]:
        """(status, headers, body as JSON where it is JSON, else text)."""

        async def go() -> tuple[int, dict[str, str], Any]:
            async with self.client.request(
                method, path, data=body, headers={"Content-Type": "application/json", **(headers or {})}
            ) as r:
                raw = await r.read()
                try:
                    return r.status, dict(r.headers), json.loads(raw)
                except ValueError:
                    return r.status, dict(r.headers), raw.decode(errors="replace")

        return self.loop.run_until_complete(go())

    def post(self, path: str, obj: Any, **kw: Any) -> tuple[int, dict[str, str], Any]:
        return self.request("POST", path, json.dumps(obj), **kw)

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.close()
        self.state.executor.shutdown(wait=False, cancel_futures=True)
        self.session.close()
