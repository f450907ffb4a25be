"""OpenAI Responses API: POST /v1/responses, translated into a chat request (openai.start_chat)
and the engine's events translated back into a response object or the Responses event stream.

Responses are kept in memory (the last MAX_STORED, least recently used dropped first) so that a
request may continue one with `previous_response_id`.
"""

from __future__ import annotations

import collections
import contextlib
import re
import secrets
import time
from typing import Any

from aiohttp import web

from .app import KEEPALIVE_SECONDS, STATE, Generation, ServerState, read_json, sse, start_sse, steps
from .common import bad, opt_int, opt_object, opt_str, type_name
from .errors import ApiError
from .events import Content, Reasoning
from .openai import start_chat

MAX_STORED = 256
TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}


class Store:
    """Finished responses by id: the conversation that led to each (chat messages, without the
    request's `instructions`) and its output, for `previous_response_id`."""

    def __init__(self, size: int = MAX_STORED) -> None:
        self.size = size
        self.items: collections.OrderedDict[str, list[dict[str, Any]]] = collections.OrderedDict()

    def get(self, rid: str) -> list[dict[str, Any]] | None:
        v = self.items.get(rid)
        if v is not None:
            self.items.move_to_end(rid)
        return v

    def put(self, rid: str, messages: list[dict[str, Any]]) -> None:
        self.items[rid] = messages
        while len(self.items) > self.size:
            self.items.popitem(last=False)


def _store(state: ServerState) -> Store:
    st = getattr(state, "responses_store", None)
    if st is None:
        st = state.responses_store = Store()  # type: ignore[attr-defined]
    return st


def _parts(content: Any, where: str) -> Any:
    """Responses content parts → chat content parts (input_text/output_text → text, input_image →
    image_url)."""
    if not isinstance(content, list):
        return content
    out = []
    for j, p in enumerate(content):
        if isinstance(p, dict) and p.get("type") in TEXT_PARTS:
            kind = TEXT_PARTS[p["type"]]
            out.append({"type": kind, kind: p.get("text", p.get(kind))})
        elif isinstance(p, dict) and p.get("type") == "input_image":
            url = p.get("image_url")
            if not isinstance(url, str):
                raise bad(
                    f"{where}[{j}].image_url",
                    "an input_image needs `image_url` (a data: URL, or an "
                    "http(s) URL or file path where the server allows them); "
                    "file_id is not supported",
                )
            out.append({"type": "image_url", "image_url": {"url": url}})
        else:
            out.append(p)  # chat's own checks name what is not supported
    return out


def input_items(value: Any) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """`input` → (chat messages, for each message the input item it came from and what its
    `content` is called there), so that what the chat path refuses is named as the request names it."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}], [("input", "")]
    if not isinstance(value, list):
        raise bad("input", f"expected a string or an array of input items, got {type_name(value)}")
    msgs: list[dict[str, Any]] = []
    origins: list[tuple[str, str]] = []
    for i, item in enumerate(value):
        w = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(w, f"expected an input item object, got {type_name(item)}")
        t = item.get("type", "message")
        if t == "message":
            if item.get("role") not in ("user", "assistant", "system", "developer"):
                raise bad(f"{w}.role", 'expected "user", "assistant", "system" or "developer"')
            msgs.append({"role": item["role"], "content": _parts(item.get("content"), f"{w}.content")})
            origins.append((w, ".content"))
        elif t == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise bad(w, "a function_call item needs a string `name` and `call_id`")
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"},
            }
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant":  # the message and calls of one turn
                last.setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origins.append((w, ".content"))
        elif t == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad(w, "a function_call_output item needs a string `call_id`")
            out = item.get("output")
            msgs.append(
                {
                    "role": "tool",
                    "tool_call_id": item["call_id"],
                    "content": _parts(out if out is not None else "", f"{w}.output"),
                }
            )
            origins.append((w, ".output"))
        elif t == "reasoning":
            continue  # earlier reasoning is not fed back
        else:
            raise bad(
                f"{w}.type",
                f"input items of type {t!r} are not supported (message, function_call, function_call_output)",
            )
    return msgs, origins


def chat_tools(body: dict[str, Any]) -> tuple[Any, Any]:
    """Responses `tools` / `tool_choice` → the chat forms."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    out = None
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools", f"expected an array, got {type_name(tools)}")
        out = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else type_name(t)
                raise bad(
                    f"tools[{i}]",
                    f"tool type {kind!r} is not supported: only function tools "
                    '({"type": "function", "name": …, "parameters": …})',
                )
            fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
            out.append({"type": "function", "function": fn})
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return out, choice


def response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """`text.format` → the chat `response_format`."""
    text = opt_object(body, "text") or {}
    fmt = opt_object(text, "format", param="text.format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        js = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": js}
    return {k: v for k, v in fmt.items()}


def chat_body(
    state: ServerState, body: dict[str, Any]
) -> tuple[dict[str, Any], list[dict[str, Any]], list[tuple[str, str]]]:
    """(the chat request, the conversation to store: earlier turns + this input, no instructions,
    and where each chat message came from: its input item and what its content is called there)."""
    history: list[dict[str, Any]] = []
    prev = opt_str(body, "previous_response_id")
    if prev is not None:
        found = _store(state).get(prev)
        if found is None:
            raise ApiError(
                404,
                f"previous_response_id: no response {prev!r} is kept here (the server keeps the "
                f"last {MAX_STORED} responses in memory, and none across restarts)",
                param="previous_response_id",
                code="response_not_found",
            )
        history = list(found)
    if body.get("input") is None:
        raise bad("input", "is required")
    items, item_origins = input_items(body["input"])
    conversation = history + items
    instructions = opt_str(body, "instructions")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    origins = (
        ([("instructions", "")] if instructions else []) + [("previous_response_id", "")] * len(history) + item_origins
    )
    tools, choice = chat_tools(body)
    chat: dict[str, Any] = {
        "model": body.get("model"),
        "messages": messages,
        "tools": tools,
        "tool_choice": choice,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "response_format": response_format(body),
        "max_tokens": opt_int(body, "max_output_tokens", 1),
        "chat_template_kwargs": body.get("chat_template_kwargs"),
    }
    return {k: v for k, v in chat.items() if v is not None}, conversation, origins


# chat parameters named as the Responses request names them, in errors
RENAMED = [("response_format.json_schema", "text.format"), ("response_format", "text.format")]


def _renamed(e: ApiError, origins: list[tuple[str, str]] | None = None) -> ApiError:
    def rename(new: str) -> None:
        assert e.param is not None
        e.message = e.message.replace(e.param, new, 1)
        e.param = new

    for chat, ours in RENAMED:
        if e.param and e.param.startswith(chat):
            rename(ours + e.param[len(chat) :])
            return e
    if e.param is None:  # errors from the engine name the part at the start of their message
        found = re.match(r"messages\[\d+\][\w.\[\]]*", e.message)
        e.param = found[0] if found else None
    m = re.fullmatch(r"messages\[(\d+)\](\.content)?(.*)", e.param or "", re.S)
    if m and origins is not None and int(m[1]) < len(origins):
        item, content = origins[int(m[1])]
        rename(item + (content if m[2] else "") + m[3])
    return e


def _usage(done: dict[str, Any]) -> dict[str, Any]:
    p, c = int(done["prompt_tokens"]), int(done["completion_tokens"])
    return {
        "input_tokens": p,
        "input_tokens_details": {"cached_tokens": int(done.get("cached_tokens", 0))},
        "output_tokens": c,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": p + c,
    }


class Builder:
    """The response object and its output items, built from parser events."""

    def __init__(self, state: ServerState, body: dict[str, Any]) -> None:
        self.id = "resp_" + secrets.token_hex(12)
        self.created = int(time.time())
        self.state = state
        self.body = body
        self.output: list[dict[str, Any]] = []

    def response(self, status: str, done: dict[str, Any] | None = None) -> dict[str, Any]:
        b = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "model": self.state.model_id,
            "instructions": b.get("instructions"),
            "max_output_tokens": b.get("max_output_tokens"),
            "temperature": b.get("temperature"),
            "top_p": b.get("top_p"),
            "tools": b.get("tools") or [],
            "tool_choice": b.get("tool_choice", "auto"),
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "previous_response_id": b.get("previous_response_id"),
            "text": b.get("text") or {"format": {"type": "text"}},
            "truncation": "disabled",
            "metadata": b.get("metadata") or {},
            "store": b.get("store", True),
            "output": self.output if status != "in_progress" else [],
            "usage": _usage(done) if done else None,
        }

    def new_item(self, kind: str, **fields: Any) -> dict[str, Any]:
        prefix = {"message": "msg_", "function_call": "fc_", "reasoning": "rs_"}[kind]
        item = {"id": prefix + secrets.token_hex(12), "type": kind, "status": "in_progress", **fields}
        self.output.append(item)
        return item

    def as_messages(self) -> list[dict[str, Any]]:
        """The output as chat messages (for the store)."""
        text = "".join(p["text"] for it in self.output if it["type"] == "message" for p in it["content"])
        calls = [
            {"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
            for it in self.output
            if it["type"] == "function_call"
        ]
        msg: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
        if calls:
            msg["tool_calls"] = calls
        return [msg]


async def responses(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_json(request)
    chat, conversation, origins = chat_body(state, body)
    stream = bool(body.get("stream"))
    try:
        gen, parser, _, _, _ = await start_chat(state, chat)
    except ApiError as e:
        raise _renamed(e, origins) from None
    b = Builder(state, body)
    try:
        if stream:
            resp = await _stream(request, b, gen, parser)
        else:
            resp = await _collect(b, gen, parser)
    finally:
        gen.cancel()
    if body.get("store", True) is not False:
        _store(state).put(b.id, conversation + b.as_messages())
    return resp


def _finish(item: dict[str, Any]) -> None:
    item["status"] = "completed"


async def _collect(b: Builder, gen: Generation, parser: Any) -> web.Response:
    msg: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    done: dict[str, Any] = {}
    async for step in steps(gen, parser):
        assert step is not None
        for e in step.events:
            if isinstance(e, Content):
                if msg is None:
                    msg = b.new_item("message", role="assistant", content=[])
                    msg["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                msg["content"][0]["text"] += e.text
            elif isinstance(e, Reasoning):
                if reasoning is None:
                    reasoning = b.new_item("reasoning", summary=[], content=[{"type": "reasoning_text", "text": ""}])
                reasoning["content"][0]["text"] += e.text
            else:
                b.new_item("function_call", call_id=e.id, name=e.name, arguments=e.arguments)
        if step.done:
            done = step.done
    for it in b.output:
        _finish(it)
    status = "incomplete" if done["finish_reason"] == "length" else "completed"
    return web.json_response(b.response(status, done))


async def _stream(request: web.Request, b: Builder, gen: Generation, parser: Any) -> web.StreamResponse:
    resp = await start_sse(request)
    seq = 0
    open_item: dict[str, Any] | None = None

    async def send(event: str, data: dict[str, Any]) -> None:
        nonlocal seq
        await resp.write(sse({"type": event, "sequence_number": seq, **data}, event=event))
        seq += 1

    def index(item: dict[str, Any]) -> int:
        return b.output.index(item)

    async def close() -> None:
        nonlocal open_item
        it, open_item = open_item, None
        if it is None:
            return
        _finish(it)
        if it["type"] == "message":
            part = it["content"][0]
            await send(
                "response.output_text.done",
                {
                    "item_id": it["id"],
                    "output_index": index(it),
                    "content_index": 0,
                    "text": part["text"],
                    "logprobs": [],
                },
            )
            await send(
                "response.content_part.done",
                {"item_id": it["id"], "output_index": index(it), "content_index": 0, "part": part},
            )
        elif it["type"] == "reasoning":
            await send(
                "response.reasoning_text.done",
                {"item_id": it["id"], "output_index": index(it), "content_index": 0, "text": it["content"][0]["text"]},
            )
        await send("response.output_item.done", {"output_index": index(it), "item": it})

    async def open_(kind: str, **fields: Any) -> dict[str, Any]:
        nonlocal open_item
        await close()
        it = b.new_item(kind, **fields)
        await send("response.output_item.added", {"output_index": index(it), "item": dict(it)})
        open_item = it
        return it

    try:
        await send("response.created", {"response": b.response("in_progress")})
        await send("response.in_progress", {"response": b.response("in_progress")})
        async for step in steps(gen, parser, KEEPALIVE_SECONDS):
            if step is None:
                await resp.write(b": keep-alive\n\n")
                continue
            for e in step.events:
                if isinstance(e, Content):
                    it = open_item
                    if it is None or it["type"] != "message":
                        it = await open_("message", role="assistant", content=[])
                        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                        await send(
                            "response.content_part.added",
                            {"item_id": it["id"], "output_index": index(it), "content_index": 0, "part": dict(part)},
                        )
                        it["content"].append(part)
                    it["content"][0]["text"] += e.text
                    await send(
                        "response.output_text.delta",
                        {
                            "item_id": it["id"],
                            "output_index": index(it),
                            "content_index": 0,
                            "delta": e.text,
                            "logprobs": [],
                        },
                    )
                elif isinstance(e, Reasoning):
                    it = open_item
                    if it is None or it["type"] != "reasoning":
                        it = await open_("reasoning", summary=[], content=[{"type": "reasoning_text", "text": ""}])
                    it["content"][0]["text"] += e.text
                    await send(
                        "response.reasoning_text.delta",
                        {"item_id": it["id"], "output_index": index(it), "content_index": 0, "delta": e.text},
                    )
                else:
                    it = await open_("function_call", call_id=e.id, name=e.name, arguments="")
                    it["arguments"] = e.arguments
                    await send(
                        "response.function_call_arguments.delta",
                        {"item_id": it["id"], "output_index": index(it), "delta": e.arguments},
                    )
                    await send(
                        "response.function_call_arguments.done",
                        {"item_id": it["id"], "output_index": index(it), "name": e.name, "arguments": e.arguments},
                    )
                    await close()
            if step.done:
                await close()
                status = "incomplete" if step.done["finish_reason"] == "length" else "completed"
                await send(f"response.{status}", {"response": b.response(status, step.done)})
    except ApiError as e:
        err = e.body("openai")["error"]
        with contextlib.suppress(ConnectionResetError):  # the client left: nothing to tell
            await send("error", {"code": err["code"], "message": err["message"], "param": err["param"]})
    except ConnectionResetError:
        gen.cancel()
    return resp


def setup(r: web.UrlDispatcher) -> None:
    r.add_post("/v1/responses", responses)
    r.add_post("/responses", responses)
