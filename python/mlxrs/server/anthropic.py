"""Anthropic protocol: /v1/messages (streamed with the Messages event sequence) and
/v1/messages/count_tokens, translated from the engine's events (never from OpenAI frames)."""

from __future__ import annotations

import json
import secrets
from typing import Any

from aiohttp import web

from .app import KEEPALIVE_SECONDS, STATE, Generation, ServerState, read_json, sse, start_sse, steps
from .common import bad, common_sampling, content_parts, message_objects, opt_bool, opt_int, stop_list, type_name
from .constrain import anthropic_output_config, combine, extension, naming, tool_call_schema
from .. import media
from ..errors import InvalidArgumentError
from .errors import ApiError
from .events import Content, Reasoning, ToolCall

MEDIA_BLOCKS = {
    "image": "image",
    "video": "video",
    "video_url": "video",
    "audio": "audio",
    "input_audio": "audio",
    "audio_url": "audio",
}


def _no_media(state: ServerState, where: str, block_type: str) -> ApiError:
    kind = MEDIA_BLOCKS.get(block_type, block_type)
    if kind == "audio" and getattr(state, "audio", None):
        return ApiError(
            400,
            f"{where}: {block_type!r} content blocks are not supported: the Messages API has no audio "
            f"blocks — send audio to model {state.model_id} through POST /v1/chat/completions as an "
            "OpenAI input_audio part",
            param=where,
        )
    if kind == "video" and state.vision and state.vision.get("video_marker"):
        return ApiError(
            400,
            f"{where}: {block_type!r} content blocks are not supported: the Messages API has no video "
            f"blocks — send video to model {state.model_id} through POST /v1/chat/completions as a "
            "video_url part (a video file or its frames)",
            param=where,
        )
    if state.vision and kind != "image":
        return ApiError(
            400,
            f"{where}: {block_type!r} content blocks are not supported: model {state.model_id} "
            f"cannot take {kind} input (the Messages API has no {kind} blocks; mlxrs takes text and "
            "images) — send text and image blocks only",
            param=where,
        )
    return ApiError(
        400,
        f"{where}: {block_type!r} content blocks are not supported: {state.model_id} is a "
        f"text-only model (no vision tower) and cannot take {kind} input — send text blocks only",
        param=where,
    )


def _image(state: ServerState, b: dict[str, Any], where: str, images: list[media.ImageRef] | None) -> str:
    """An image block as the model's image marker, its source appended to `images`; a 400 naming
    the block when the model has no vision tower."""
    if images is None or not state.vision:
        raise _no_media(state, where, "image")
    try:
        images.append(media.ImageRef(media.image_source(b, where), where))
    except InvalidArgumentError as e:
        raise ApiError(400, str(e), param=where) from None
    return str(state.vision["marker"])


def _document_text(state: ServerState, block: dict[str, Any], where: str) -> str:
    src = block.get("source")
    st = src.get("type") if isinstance(src, dict) else None
    if st == "text" and isinstance(src.get("data"), str):  # type: ignore[union-attr]
        return str(src["data"])  # type: ignore[index]
    if st == "content":
        return _blocks_text(state, src.get("content"), f"{where}.source.content")  # type: ignore[union-attr]
    raise ApiError(
        400,
        f"{where}: document blocks with a {st!r} source are not supported (only plain-text "
        'documents: source {"type": "text"}); file, base64 and URL sources cannot be read',
        param=where,
    )


def _blocks_text(state: ServerState, content: Any, where: str, images: list[media.ImageRef] | None = None) -> str:
    """Text of a string or of text blocks (tool results, system, documents); with `images`, image
    blocks become image markers (a model with a vision tower); other media is a 400."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise bad(where, f"expected a string or an array of content blocks, got {type_name(content)}")
    parts = []
    for t, b, bw in content_parts(content, where, "content block"):
        if t == "text":
            if not isinstance(b.get("text"), str):
                raise bad(bw, "a text block needs a string `text`")
            parts.append(b["text"])
        elif t == "document":
            parts.append(_document_text(state, b, bw))
        elif t == "image":
            parts.append(_image(state, b, bw, images))
        elif t in MEDIA_BLOCKS:
            raise _no_media(state, bw, t)
        else:
            raise bad(bw, f"unsupported content block type {t!r}")
    return "\n".join(parts)


def convert_messages(
    state: ServerState, body: dict[str, Any], images: list[media.ImageRef] | None = None
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        if not isinstance(system, (str, list)):
            raise bad("system", f"expected a string or an array of text blocks, got {type_name(system)}")
        text = _blocks_text(state, system, "system")
        if text:
            out.append({"role": "system", "content": text})
    msgs = body.get("messages")
    names: dict[str, str] = {}
    for i, w, m in message_objects(msgs):
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise bad(
                f"{w}.role",
                f'unknown role {role!r}: expected "user" or "assistant" '
                "(the system prompt goes in the top-level `system`)",
            )
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad(f"{w}.content", f"expected a string or an array of content blocks, got {type_name(content)}")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        tool_msgs: list[dict[str, Any]] = []
        for j, (t, b, bw) in enumerate(content_parts(content, f"{w}.content", "content block")):
            if t == "text":
                if not isinstance(b.get("text"), str):
                    raise bad(bw, "a text block needs a string `text`")
                texts.append(b["text"])
            elif t == "document":
                texts.append(_document_text(state, b, bw))
            elif t in ("thinking", "redacted_thinking"):
                if role != "assistant":
                    raise bad(bw, f"{t} blocks belong to assistant messages")
                # earlier turns' thinking is not fed back (Anthropic semantics)
            elif t == "tool_use":
                if role != "assistant":
                    raise bad(bw, "tool_use blocks belong to assistant messages")
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise bad(bw, "a tool_use block needs a string `name` and an object `input`")
                cid = str(b["id"]) if isinstance(b.get("id"), str) else f"toolu_{i}_{j}"
                names[cid] = b["name"]
                calls.append(
                    {"id": cid, "type": "function", "function": {"name": b["name"], "arguments": b.get("input") or {}}}
                )
            elif t == "tool_result":
                if role != "user":
                    raise bad(bw, "tool_result blocks belong to user messages")
                tid = b.get("tool_use_id")
                if not isinstance(tid, str):
                    raise bad(bw, "a tool_result block needs a string `tool_use_id`")
                text = _blocks_text(state, b.get("content"), f"{bw}.content", images)
                if b.get("is_error") and not text.lower().startswith("error"):
                    text = "Error: " + text
                tm: dict[str, Any] = {"role": "tool", "tool_call_id": tid, "content": text}
                if tid in names:
                    tm["name"] = names[tid]
                tool_msgs.append(tm)
            elif t == "image" and role == "user":
                texts.append(_image(state, b, bw, images))
            elif t in MEDIA_BLOCKS:
                raise _no_media(state, bw, t)
            else:
                raise bad(bw, f"unsupported content block type {t!r}")
        if role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        else:
            out.extend(tool_msgs)
            if texts or not tool_msgs:
                out.append({"role": "user", "content": "\n".join(texts)})
    return out


def convert_tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, list[str] | None]:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
            raise bad("tool_choice", 'expected {"type": "auto" | "any" | "tool" | "none"}')
        if choice["type"] in ("any", "tool") and tools is None:
            raise bad("tool_choice", f"{choice['type']!r} requires `tools`")
    if tools is None:
        return None, None
    if not isinstance(tools, list):
        raise bad("tools", f"expected an array, got {type_name(tools)}")
    out, names = [], []
    for i, t in enumerate(tools):
        w = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad(w, f"expected a tool object, got {type_name(t)}")
        if t.get("type") not in (None, "custom") and "input_schema" not in t:
            raise bad(
                w,
                f"server tool type {t.get('type')!r} is not supported: declare client tools with "
                "`name`, `description` and `input_schema`",
            )
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise bad(f"{w}.name", "is required")
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise bad(f"{w}.input_schema", "expected a JSON Schema object")
        fn: dict[str, Any] = {"name": t["name"], "parameters": schema}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
        names.append(t["name"])
    if choice is not None:
        if choice["type"] == "tool" and choice.get("name") not in names:
            raise bad("tool_choice.name", f"{choice.get('name')!r} is not one of the tools")
        if choice["type"] == "none":
            return None, None
    if not out:
        return None, None
    return out, names


def template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    th = body.get("thinking")
    if th is None:
        return {}
    if not isinstance(th, dict) or th.get("type") not in ("enabled", "disabled", "adaptive"):
        raise bad("thinking", 'expected {"type": "enabled", "budget_tokens": N} or {"type": "disabled"}')
    if th["type"] == "enabled":
        opt_int(th, "budget_tokens", 1, param="thinking.budget_tokens")
    return {"enable_thinking": th["type"] != "disabled"}


async def _prepare(
    state: ServerState, body: dict[str, Any], images: list[media.ImageRef] | None = None
) -> tuple[str, list[int], list[str] | None, list[tuple[bytes, str]]]:
    """(rendered prompt, its ids, the tools' names, the images' bytes each with its place)."""
    state.check_model(body.get("model"))
    refs: list[media.ImageRef] = [] if images is None else images
    messages = convert_messages(state, body, refs)
    tools, names = convert_tools(body)
    loaded = await state.load_images(refs)
    rendered, ids = await state.render(messages, tools, template_kwargs(body), images=loaded)
    return rendered, ids, names, loaded


def stop_reason(done: dict[str, Any], calls: bool) -> tuple[str, str | None]:
    if done["finish_reason"] == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if done.get("stop_string"):
        return "stop_sequence", done["stop_string"]
    return "end_turn", None


def _tool_id(c: ToolCall) -> str:
    return "toolu_" + c.id.removeprefix("call_")


def _input(c: ToolCall) -> dict[str, Any]:
    v = json.loads(c.arguments)
    return v if isinstance(v, dict) else {}


async def messages(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_json(request)
    if body.get("max_tokens") is None:
        raise bad("max_tokens", "is required (an integer >= 1)")
    requested = opt_int(body, "max_tokens", 1)
    images: list[media.ImageRef] = []
    rendered, ids, names, loaded = await _prepare(state, body, images)
    s = common_sampling(body, temperature_max=1.0, defaults=state.gen_defaults, vocab=state.vocab)
    s.set("adapter", state.adapter_of(body.get("model")))
    choice = body.get("tool_choice")
    forced = {}
    if names and isinstance(choice, dict) and choice.get("type") in ("any", "tool"):
        tools, _ = convert_tools(body)
        assert tools is not None
        forced = {"json_schema": tool_call_schema(tools, choice.get("name") if choice["type"] == "tool" else None)}
    constraint, cparam = combine(output_config=anthropic_output_config(body), tool_choice=forced, mlxrs=extension(body))
    for k, v in constraint.items():
        s.set(k, v)
    s.set("stop", stop_list(body.get("stop_sequences"), "stop_sequences") or None)
    stream = bool(opt_bool(body, "stream"))
    s.set("max_tokens", state.admit(len(ids), requested))
    # constrained output starts at once (a template's open <think> is not continued)
    parser = state.parser(None if constraint else rendered, names, convert_tools(body)[0] if names else None)
    try:
        gen = await state.generate(ids, s.opts, loaded)
    except ApiError as e:
        raise naming(e, cparam) from None
    mid = "msg_" + secrets.token_hex(12)
    try:
        if stream:
            return await _stream(request, state, gen, parser, mid, len(ids))
        return await _collect(state, gen, parser, mid)
    finally:
        gen.cancel()


async def _collect(state: ServerState, gen: Generation, parser: Any, mid: str) -> web.Response:
    blocks: list[dict[str, Any]] = []
    calls = False
    done: dict[str, Any] = {}
    async for step in steps(gen, parser):
        assert step is not None
        for e in step.events:
            last = blocks[-1] if blocks else None
            if isinstance(e, Content):
                if last and last["type"] == "text":
                    last["text"] += e.text
                else:
                    blocks.append({"type": "text", "text": e.text})
            elif isinstance(e, Reasoning):
                if last and last["type"] == "thinking":
                    last["thinking"] += e.text
                else:
                    blocks.append({"type": "thinking", "thinking": e.text, "signature": ""})
            else:
                calls = True
                blocks.append({"type": "tool_use", "id": _tool_id(e), "name": e.name, "input": _input(e)})
        if step.done:
            done = step.done
    reason, seq = stop_reason(done, calls)
    return web.json_response(
        {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "model": state.model_id,
            "content": blocks,
            "stop_reason": reason,
            "stop_sequence": seq,
            "usage": usage(done),
        }
    )


def usage(done: dict[str, Any]) -> dict[str, int]:
    """Anthropic's usage: input_tokens are the prompt tokens that were processed, cache_read the
    ones taken from the prompt-prefix cache (their sum is the prompt)."""
    cached = int(done.get("cached_tokens", 0))
    return {
        "input_tokens": int(done["prompt_tokens"]) - cached,
        "output_tokens": int(done["completion_tokens"]),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


async def _stream(
    request: web.Request, state: ServerState, gen: Generation, parser: Any, mid: str, n_prompt: int
) -> web.StreamResponse:
    resp = await start_sse(request)
    index = -1
    open_type: str | None = None
    calls = False

    async def send(event: str, data: dict[str, Any]) -> None:
        await resp.write(sse(dict(type=event, **data), event=event))

    async def close_block() -> None:
        nonlocal open_type
        if open_type is not None:
            await send("content_block_stop", {"index": index})
            open_type = None

    async def open_block(block: dict[str, Any]) -> None:
        nonlocal index, open_type
        await close_block()
        index += 1
        open_type = block["type"]
        await send("content_block_start", {"index": index, "content_block": block})

    try:
        await send(
            "message_start",
            {
                "message": {
                    "id": mid,
                    "type": "message",
                    "role": "assistant",
                    "model": state.model_id,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": n_prompt, "output_tokens": 0},
                }
            },
        )
        await send("ping", {})
        async for step in steps(gen, parser, KEEPALIVE_SECONDS):
            if step is None:
                await send("ping", {})
                continue
            for e in step.events:
                if isinstance(e, Content):
                    if open_type != "text":
                        await open_block({"type": "text", "text": ""})
                    await send("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": e.text}})
                elif isinstance(e, Reasoning):
                    if open_type != "thinking":
                        await open_block({"type": "thinking", "thinking": "", "signature": ""})
                    await send(
                        "content_block_delta", {"index": index, "delta": {"type": "thinking_delta", "thinking": e.text}}
                    )
                else:
                    calls = True
                    await open_block({"type": "tool_use", "id": _tool_id(e), "name": e.name, "input": {}})
                    await send(
                        "content_block_delta",
                        {"index": index, "delta": {"type": "input_json_delta", "partial_json": e.arguments}},
                    )
                    await close_block()
            if step.done:
                await close_block()
                reason, seq = stop_reason(step.done, calls)
                await send(
                    "message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq}, "usage": usage(step.done)}
                )
                await send("message_stop", {})
    except ApiError as e:
        try:
            await resp.write(sse(e.body("anthropic"), event="error"))
        except ConnectionResetError:
            pass
    except ConnectionResetError:
        gen.cancel()
    return resp


async def count_tokens(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_json(request)
    _, ids, _, _ = await _prepare(state, body)
    return web.json_response({"input_tokens": len(ids)})


def setup(r: web.UrlDispatcher) -> None:
    r.add_post("/v1/messages", messages)
    r.add_post("/v1/messages/count_tokens", count_tokens)
