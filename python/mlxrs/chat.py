"""`python -m mlxrs chat`: talk to a model in the terminal (docs/cli.md).

Attaches to a server already answering on --port (the probe `serve` uses), or --url; otherwise
starts one in this process on a free port. Talks to it over the OpenAI chat endpoint (streamed SSE
over http.client: no client SDK needed). Ctrl-C while an answer streams closes the connection,
which cancels the generation on the server; Ctrl-C at the prompt clears the line, Ctrl-D leaves.
Over a pipe (stdin not a terminal) it reads stdin as one question and prints the answer.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Generator
from urllib.parse import urlsplit

HELP = """commands:
  /reset          forget the conversation (the system prompt stays)
  /system TEXT    set the system prompt (/system alone clears it)
  /save FILE      write the conversation as a chat-completions request body (JSON)
  /load FILE      read a conversation written by /save (or a JSON list of messages)
  /tools FILE     offer the tools in FILE (a JSON array of OpenAI tools; /tools alone: none)
  /tool TEXT      answer the model's next unanswered tool call with TEXT (then it goes on)
  /image FILE     attach a PNG, JPEG, WebP or GIF to the next message (/image alone: drop them)
  /reasoning      show the last answer's reasoning;  /reasoning on|off  stream it or fold it away
  /model          the model served;  /stats  the server's figures
  /help           this;  /quit (or Ctrl-D) leave
Enter sends; Esc then Enter (or Alt-Enter), or a line ending in \\, starts a new line.
Ctrl-C stops an answer."""

DIM, BOLD, MAGENTA, RESET = "\x1b[2m", "\x1b[1m", "\x1b[35m", "\x1b[0m"


class ApiError(Exception):
    pass


class Client:
    """A minimal OpenAI-compatible client over http.client (streaming, cancellable)."""

    def __init__(self, url: str, api_key: str | None) -> None:
        u = urlsplit(url.rstrip("/"))
        if u.scheme not in ("http", "https") or not u.hostname:
            raise SystemExit(f"error: --url {url!r}: expected http://HOST:PORT")
        self.url = url.rstrip("/")
        self.https = u.scheme == "https"
        self.host = u.hostname
        self.port = u.port or (443 if self.https else 80)
        self.base = u.path.removesuffix("/v1")
        self.api_key = api_key
        self.conn: http.client.HTTPConnection | None = None

    def _connect(self, timeout: float | None) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=timeout)

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def get(self, path: str) -> Any:
        conn = self._connect(30)
        try:
            conn.request("GET", self.base + path, headers=self._headers())
            r = conn.getresponse()
            body = r.read()
        finally:
            conn.close()
        return _decode(r.status, body)

    def stream_chat(self, body: dict[str, Any]) -> Generator[dict[str, Any], None, None]:
        """The chunks of a streamed chat completion. Closing the generator (or an exception in the
        consumer, Ctrl-C) closes the connection: the server cancels the generation."""
        conn = self._connect(None)
        self.conn = conn
        try:
            conn.request(
                "POST", self.base + "/v1/chat/completions", body=json.dumps(body).encode(), headers=self._headers()
            )
            r = conn.getresponse()
            if r.status != 200:
                _decode(r.status, r.read())
            data: list[str] = []
            while True:
                line = r.readline()
                if not line:
                    return
                text = line.decode("utf-8").rstrip("\r\n")
                if text.startswith("data:"):
                    data.append(text[5:].strip())
                elif not text and data:
                    payload = "\n".join(data)
                    data = []
                    if payload == "[DONE]":
                        return
                    ev = json.loads(payload)
                    if isinstance(ev, dict) and "error" in ev:
                        raise ApiError((ev["error"] or {}).get("message", "error"))
                    yield ev
        finally:
            self.conn = None
            conn.close()


def load_tools(path: str, flag: str = "--tools") -> list[dict[str, Any]]:
    """The tools in a JSON file: an array of OpenAI tools, or a request body with `tools` (what
    /save writes). Refused, naming the file and the entry, unless each has a function name."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag} {path}: {e}") from None
    tools = data.get("tools") if isinstance(data, dict) else data
    if not isinstance(tools, list):
        raise ValueError(f'{flag} {path}: expected a JSON array of tools (or an object with "tools")')
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (
            isinstance(t, dict)
            and t.get("type") == "function"
            and isinstance(fn, dict)
            and isinstance(fn.get("name"), str)
            and fn["name"]
        ):
            raise ValueError(
                f'{flag} {path}: tools[{i}]: expected {{"type": "function", "function": '
                f'{{"name": ..., "parameters": {{...}}}}}}'
            )
    return tools


IMAGE_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)


def image_data_url(path: str) -> str:
    """A local image file as the data: URL an OpenAI image_url part carries (its type from its bytes)."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    mt = next((m for magic, m in IMAGE_MAGIC if data.startswith(magic)), None)
    if mt is None and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        mt = "image/webp"
    if mt is None:
        raise ValueError(f"{path}: not a PNG, JPEG, WebP or GIF image")
    return f"data:{mt};base64," + base64.b64encode(data).decode()


def _decode(status: int, body: bytes) -> Any:
    try:
        data = json.loads(body)
    except ValueError:
        data = body.decode(errors="replace")
    if status != 200:
        msg = data.get("error", {}).get("message") if isinstance(data, dict) else None
        raise ApiError(f"HTTP {status}: {msg or data}")
    return data


# -- the server: attach or start one ---------------------------------------------------------------
def _in_process_server(args: argparse.Namespace, api_key: str | None) -> tuple[str, Any]:
    """Load MODEL and serve it on a free loopback port from a thread: (url, a stop function)."""
    import asyncio
    import logging
    import socket

    from aiohttp import web

    from .cli import build_parser
    from .server import _model_label, make_state
    from .server.app import build_app

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    sargs = build_parser().parse_args(["serve", *([args.model] if args.model else []), "--port", str(port)])
    _, model_id = _model_label(args.model)
    state = make_state(sargs, api_key, model_id)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(build_app(state), handler_cancellation=True, access_log=None)
    ready = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        ready.set()
        loop.run_forever()

    threading.Thread(target=serve, name="mlxrs-chat-server", daemon=True).start()
    ready.wait(60)

    def stop() -> None:
        fut = asyncio.run_coroutine_threadsafe(runner.cleanup(), loop)
        try:
            fut.result(5)
        except Exception:
            pass
        loop.call_soon_threadsafe(loop.stop)
        state.executor.shutdown(wait=False, cancel_futures=True)
        state.session.close()

    return f"http://127.0.0.1:{port}", stop


def connect(args: argparse.Namespace, api_key: str | None, say: Any) -> tuple[str, Any]:
    """(base URL, stop function or None): --url, else the server on --port, else one started here."""
    if args.url:
        return args.url, None
    from .server import probe_v1

    listening, answers, model = probe_v1("127.0.0.1", args.port, api_key)
    if answers:
        say(f"attached to http://127.0.0.1:{args.port} ({model or 'model unknown'})")
        return f"http://127.0.0.1:{args.port}", None
    if listening:
        say(f"port {args.port} is held by another program: starting a server of my own")
    say("loading the model…")
    return _in_process_server(args, api_key)


# -- the conversation ------------------------------------------------------------------------------
class Chat:
    def __init__(self, client: Client, args: argparse.Namespace, color: bool) -> None:
        self.client = client
        self.args = args
        self.color = color
        self.system: str | None = args.system
        self.messages: list[dict[str, Any]] = []
        self.tools: list[dict[str, Any]] | None = None
        self.images: list[str] = []  # data: URLs for the next message (/image)
        self.show_reasoning = True  # stream the reasoning (dimmed); off: one "(thinking…)" marker
        self.last_reasoning = ""
        self.model = "default"
        self.ceiling: int | None = None
        self.modalities: list[str] | None = None  # what the model takes (None: the server does not say)
        try:
            cards = client.get("/v1/models")["data"]
            self.model = cards[0]["id"]
            self.ceiling = cards[0].get("context_length")
            self.modalities = cards[0].get("input_modalities")
        except (ApiError, OSError, KeyError, IndexError, TypeError):
            pass

    def _c(self, code: str, text: str) -> str:
        return f"{code}{text}{RESET}" if self.color else text

    def request(self) -> dict[str, Any]:
        msgs = ([{"role": "system", "content": self.system}] if self.system else []) + self.messages
        body: dict[str, Any] = {
            "model": self.model,
            "messages": msgs,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.args.temperature is not None:
            body["temperature"] = self.args.temperature
        if self.args.max_tokens is not None:
            body["max_tokens"] = self.args.max_tokens
        if self.tools:
            body["tools"] = self.tools
        return body

    def ask(self, text: str, out: Any, plain: bool = False) -> bool:
        """Send `text`, stream the answer to `out`; False when it was cancelled or failed (the
        question is then dropped from the conversation)."""
        content: Any = text
        if self.images:  # OpenAI content parts: the images, then the text
            content = [{"type": "image_url", "image_url": {"url": u}} for u in self.images]
            content.append({"type": "text", "text": text})
            self.images = []
        self.messages.append({"role": "user", "content": content})
        return self.turn(out, plain)

    def unanswered_calls(self) -> list[dict[str, Any]]:
        """The tool calls of the last assistant message that no tool message answers yet."""
        for i in range(len(self.messages) - 1, -1, -1):
            m = self.messages[i]
            if m["role"] == "assistant":
                done = {t.get("tool_call_id") for t in self.messages[i + 1 :] if t["role"] == "tool"}
                return [c for c in m.get("tool_calls") or [] if c.get("id") not in done]
            if m["role"] != "tool":
                return []
        return []

    def tool_reply(self, text: str, out: Any) -> bool:
        """Answer the next unanswered tool call with `text`; once all are answered, the model goes on."""
        calls = self.unanswered_calls()
        if not calls:
            out.write("no tool call to answer\n")
            return False
        c = calls[0]
        self.messages.append({"role": "tool", "tool_call_id": c.get("id"), "content": text})
        if len(calls) > 1:
            out.write(f"answered {c['function']['name']}; {len(calls) - 1} more tool call(s) to answer\n")
            return True
        return self.turn(out)

    def turn(self, out: Any, plain: bool = False) -> bool:
        """Stream the model's next message to `out` and append it; False when it was cancelled or
        failed (the message that asked is then dropped)."""
        content: list[str] = []
        reasoning: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        usage: dict[str, Any] | None = None
        finish = None
        t0 = time.monotonic()
        first: float | None = None
        # what the terminal shows: "reasoning" (dimmed), "call" (a tool call being printed, its
        # arguments as they stream), "content", or None at the start of a line
        shown: str | None = None
        paren = False  # the open tool call's "(" is printed

        def show(kind: str | None, text: str = "") -> None:
            nonlocal shown, paren
            if plain:
                if kind == "content":
                    out.write(text)
                return
            if kind != shown:
                if shown == "call":
                    out.write(self._c(MAGENTA, "" if paren else "(") + self._c(MAGENTA, ")"))
                if shown is not None:
                    out.write("\n")
                if kind == "reasoning":
                    out.write(self._c(DIM, "(thinking) " if self.show_reasoning else "(thinking…)"))
                elif kind == "call":
                    out.write(self._c(MAGENTA, "tool call: "))
                    paren = False
                shown = kind
            if kind == "reasoning" and not self.show_reasoning:
                return
            if text:
                out.write(
                    self._c(MAGENTA, text) if kind == "call" else self._c(DIM, text) if kind == "reasoning" else text
                )

        mark = len(self.messages) - 1  # the message that asked: dropped when this turn fails
        stream = self.client.stream_chat(self.request())
        try:
            for ev in stream:
                if ev.get("usage"):
                    usage = ev["usage"]
                for ch in ev.get("choices") or []:
                    d = ch.get("delta") or {}
                    if first is None and (d.get("content") or d.get("reasoning_content") or d.get("tool_calls")):
                        first = time.monotonic()
                    if d.get("reasoning_content"):
                        reasoning.append(d["reasoning_content"])
                        show("reasoning", d["reasoning_content"])
                    if d.get("content"):
                        content.append(d["content"])
                        show("content", d["content"])
                    for tc in d.get("tool_calls") or []:
                        i = tc.get("index", 0)
                        if i not in calls:  # a new call: its own line
                            calls[i] = {
                                "id": tc.get("id"),
                                "type": "function",
                                "function": {"name": "", "arguments": ""},
                            }
                            show(None)
                            show("call")
                        slot, fn = calls[i], tc.get("function") or {}
                        slot["function"]["name"] += fn.get("name") or ""
                        show("call", fn.get("name") or "")
                        if fn.get("arguments"):
                            slot["function"]["arguments"] += fn["arguments"]
                            show("call", ("" if paren else "(") + fn["arguments"])
                            paren = True
                    if ch.get("finish_reason"):
                        finish = ch["finish_reason"]
                    out.flush()
        except KeyboardInterrupt:
            stream.close()  # closes the connection: the server cancels the generation
            del self.messages[mark:]
            if not plain:
                out.write(self._c(DIM, "\n[cancelled]\n"))
                out.flush()
            return False
        except (ApiError, OSError, ValueError) as e:
            del self.messages[mark:]
            sys.stderr.write(f"\nerror: {e}\n")
            return False
        if shown is None and not plain:
            out.write("\n")  # an empty answer: an empty line
        show(None)
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
        if calls:
            msg["tool_calls"] = [calls[i] for i in sorted(calls)]
        self.messages.append(msg)
        self.last_reasoning = "".join(reasoning)
        if plain:  # stdout: the content alone; the calls (if any) on stderr
            out.write("\n")
            out.flush()
            for c in msg.get("tool_calls", []):
                sys.stderr.write(f"tool call: {c['function']['name']}({c['function']['arguments']})\n")
            return True
        out.write(self._c(DIM, self.status_line(usage, finish, t0, first)) + "\n")
        out.flush()
        return True

    def status_line(self, usage: dict[str, Any] | None, finish: str | None, t0: float, first: float | None) -> str:
        parts = []
        if usage:
            n = int(usage.get("completion_tokens", 0))
            dt = time.monotonic() - (first or t0)
            parts.append(f"{n} tokens" + (f", {n / dt:.1f} tok/s" if dt > 0 and n > 1 else ""))
            used = int(usage.get("prompt_tokens", 0)) + n
            parts.append(f"context {used}" + (f"/{self.ceiling}" if self.ceiling else ""))
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
            parts.append(f"prefix cache {cached}/{usage.get('prompt_tokens', 0)} prompt tokens")
        if finish and finish != "stop":
            parts.append(f"finish: {finish}")
        return "[" + " · ".join(parts) + "]"

    # -- commands
    def command(self, line: str, out: Any) -> bool:
        """Run a /command; False to leave."""
        cmd, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        if cmd in ("/quit", "/exit"):
            return False
        if cmd == "/reset":
            self.messages = []
            out.write("conversation cleared\n")
        elif cmd == "/system":
            self.system = arg or None
            out.write(f"system prompt {'set' if arg else 'cleared'}\n")
        elif cmd == "/save" and arg:
            saved: dict[str, Any] = {"model": self.model, "messages": self.request()["messages"]}
            if self.tools:
                saved["tools"] = self.tools
            Path(arg).write_text(json.dumps(saved, indent=2, ensure_ascii=False) + "\n")
            out.write(f"saved {len(self.messages)} messages to {arg}\n")
        elif cmd == "/tools":
            try:
                self.tools = load_tools(arg, "/tools") if arg else None
            except ValueError as e:
                out.write(f"{e}\n")
                return True
            names = [t["function"]["name"] for t in self.tools or []]
            out.write(f"tools offered: {', '.join(names)}\n" if names else "no tools offered\n")
        elif cmd == "/reasoning":
            if arg in ("on", "off"):
                self.show_reasoning = arg == "on"
                out.write(f"reasoning {'shown as it streams' if self.show_reasoning else 'folded away'}\n")
            elif arg:
                out.write("/reasoning [on|off]\n")
            else:
                out.write(self._c(DIM, self.last_reasoning or "(no reasoning in the last answer)") + "\n")
        elif cmd == "/tool" and arg:
            self.tool_reply(arg, out)
        elif cmd == "/image":
            if not arg:
                out.write(f"dropped {len(self.images)} attached image(s)\n")
                self.images = []
            elif self.modalities is not None and "image" not in self.modalities:
                out.write(f"{self.model} takes no images (its input: {', '.join(self.modalities)})\n")
            else:
                try:
                    self.images.append(image_data_url(arg))
                except ValueError as e:
                    out.write(f"{e}\n")
                    return True
                out.write(f"attached {Path(arg).name} ({len(self.images)} image(s) go with the next message)\n")
        elif cmd == "/load" and arg:
            try:
                data = json.loads(Path(arg).read_text())
                msgs = data["messages"] if isinstance(data, dict) else data
                if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m for m in msgs):
                    raise ValueError("expected a list of messages")
            except (OSError, ValueError, KeyError, TypeError) as e:
                out.write(f"cannot load {arg}: {e}\n")
                return True
            tools = None
            if isinstance(data, dict) and data.get("tools") is not None:
                try:
                    tools = load_tools(arg, "/load")
                except ValueError as e:
                    out.write(f"cannot load {e}\n")
                    return True
            sys_msgs = [m for m in msgs if m["role"] == "system"]
            self.system = sys_msgs[0].get("content") if sys_msgs else self.system
            self.messages = [m for m in msgs if m["role"] != "system"]
            self.tools = tools or self.tools
            out.write(f"loaded {len(self.messages)} messages" + (f" and {len(tools)} tools" if tools else "") + "\n")
        elif cmd == "/model":
            out.write(
                f"{self.model} at {self.client.url}"
                + (f", context ceiling {self.ceiling} tokens" if self.ceiling else "")
                + "\n"
            )
        elif cmd == "/stats":
            try:
                out.write(format_stats(self.client.get("/stats")) + "\n")
            except (ApiError, OSError) as e:
                out.write(f"/stats: {e}\n")
        else:
            out.write(HELP + "\n")
        out.flush()
        return True


def format_stats(s: dict[str, Any]) -> str:
    rq, rec, pc = s.get("requests") or {}, s.get("recent") or {}, s.get("prompt_cache") or {}
    plan = s.get("memory_plan") or {}
    gib = 1 << 30
    return "\n".join(
        [
            f"model {s.get('model')}, context ceiling {s.get('context_tokens')} tokens",
            f"generation {rec.get('generation_tokens_per_second')} tok/s, prompt {rec.get('prompt_tokens_per_second')} "
            f"tok/s (last {rec.get('window')} requests)",
            f"memory: weights {plan.get('weightsBytes', 0) / gib:.2f} GiB of a {plan.get('usableBytes', 0) / gib:.2f} GiB "
            f"budget",
            f"requests: {rq.get('active')} active, {rq.get('queued')} queued, {rq.get('served')} served, "
            f"{rq.get('cancelled')} cancelled",
            f"prefix cache: {pc.get('hits', 0)} hits, {pc.get('misses', 0)} misses, {pc.get('entries', 0)} entries, "
            f"{(s.get('tokens') or {}).get('cached', 0)} cached prompt tokens",
        ]
    )


def _read_lines(read: Any) -> str:
    """Plain input(): a line ending in a backslash continues on the next one."""
    line = read("> ")
    while line.endswith("\\"):
        line = line[:-1] + "\n" + read(". ")
    return str(line)


def _prompt_reader() -> Callable[[], str]:
    """A function that reads one (possibly multi-line) input or raises EOFError/KeyboardInterrupt."""
    try:
        from prompt_toolkit import PromptSession
        from prompt_toolkit.key_binding import KeyBindings
    except ImportError:  # the `chat` extra is not installed: plain input()
        return lambda: _read_lines(input)
    kb = KeyBindings()

    @kb.add("escape", "enter")
    def _newline(event: Any) -> None:
        event.current_buffer.insert_text("\n")

    @kb.add("enter")
    def _submit(event: Any) -> None:
        buf = event.current_buffer
        if buf.document.text_before_cursor.endswith("\\"):  # a trailing backslash: a new line instead
            buf.delete_before_cursor(1)
            buf.insert_text("\n")
        else:
            buf.validate_and_handle()

    session: Any = PromptSession(multiline=True, key_bindings=kb)
    return lambda: session.prompt("> ", prompt_continuation=". ")


def run(args: argparse.Namespace) -> int:
    api_key = args.api_key if args.api_key is not None else os.environ.get("MLXRS_API_KEY")
    interactive = sys.stdin.isatty()
    try:
        tools = load_tools(args.tools) if args.tools else None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    def say(m: str) -> None:
        print(m, file=sys.stdout if interactive else sys.stderr, flush=True)

    try:
        url, stop = connect(args, api_key, say)
    except Exception as e:  # a model that cannot load: one line
        from .errors import MlxrsError

        if isinstance(e, MlxrsError):
            print(f"error: {e}", file=sys.stderr)
            return 1
        raise
    try:
        chat = Chat(
            Client(url, api_key), args, color=interactive and sys.stdout.isatty() and not os.environ.get("NO_COLOR")
        )
        chat.tools = tools
        if not interactive:
            text = sys.stdin.read()
            if not text.strip():
                print("error: nothing to ask on stdin", file=sys.stderr)
                return 2
            return 0 if chat.ask(text.rstrip("\n"), sys.stdout, plain=True) else 1
        say(f"chatting with {chat.model} — /help for commands, Ctrl-D to leave")
        read = _prompt_reader()
        while True:
            try:
                line = read()
            except KeyboardInterrupt:
                continue
            except EOFError:
                break
            if not line.strip():
                continue
            if line.startswith("/"):
                if not chat.command(line, sys.stdout):
                    break
                continue
            chat.ask(line, sys.stdout)
        return 0
    finally:
        if stop:
            stop()


def add_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    cp = sub.add_parser(
        "chat",
        help="talk to a model in the terminal (attaches to a running server or starts one)",
        description="Chat with MODEL in the terminal. Attaches to the server answering on --port "
        "(or --url); when none does, loads MODEL and serves it in this process on a free "
        "port. Over a pipe: reads stdin as one question, prints the answer. "
        "See docs/cli.md.",
    )
    cp.add_argument(
        "model",
        nargs="?",
        default=None,
        help="model to load when no server answers (as for `serve`; default: the embedded Gemma 3 270M)",
    )
    cp.add_argument("--url", default=None, help="an OpenAI-compatible server to talk to, e.g. http://127.0.0.1:8080")
    cp.add_argument("--port", type=int, default=8080, help="the local port to look for a server on (default 8080)")
    cp.add_argument("--api-key", default=None, help="the server's API key (default: MLXRS_API_KEY)")
    cp.add_argument("--system", default=None, metavar="TEXT", help="a system prompt")
    cp.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the model's)")
    cp.add_argument("--max-tokens", type=int, default=None, help="max_tokens per answer (default: the server's)")
    cp.add_argument(
        "--tools",
        default=None,
        metavar="FILE",
        help="offer the tools in FILE (a JSON array of OpenAI tools, or a /save file with tools)",
    )
    cp.set_defaults(func=run)
