"""OpenAI protocol: /v1/chat/completions and /v1/completions, translated from the engine's events."""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from .. import __version__
from .app import KEEPALIVE_SECONDS, STATE, Generation, ServerState, Step, TokenText, read_json, sse, start_sse, steps
from .common import (
    Sampling,
    bad,
    check_json,
    common_sampling,
    content_parts,
    message_objects,
    logit_bias,
    opt_bool,
    opt_int,
    opt_number,
    opt_object,
    parse_json,
    stop_list,
    type_name,
)
from .constrain import combine, extension, naming, openai_response_format, tool_call_schema
from .. import media
from ..errors import InvalidArgumentError
from .errors import ApiError
from .events import Content, Reasoning, ToolCall

FINGERPRINT = f"mlxrs-{__version__}"
ROLES = {"system", "developer", "user", "assistant", "tool"}
UNSUPPORTED_PARTS = {
    "image_url": "image input",
    "input_image": "image input",
    "input_audio": "audio input",
    "audio_url": "audio input",
    "video_url": "video input",
    "file": "file input",
    "input_file": "file input",
}


def _unsupported(state: ServerState, where: str, kind: str, what: str) -> ApiError:
    if kind == "audio input" and not state.audio:
        return ApiError(
            400,
            f"{where}: {kind} ({what!r} part) is not supported: model {state.model_id} has no audio "
            "tower and cannot take audio — send text only",
            param=where,
        )
    if state.vision and kind != "image input":
        return ApiError(
            400,
            f"{where}: {kind} content ({what!r} part) is not supported: model {state.model_id} takes "
            "text and images only",
            param=where,
        )
    return ApiError(
        400,
        f"{where}: {kind} content ({what!r} part) is not supported: {state.model_id} is a "
        "text-only model (no vision tower) — send text parts only",
        param=where,
    )


def _text_of(
    state: ServerState,
    content: Any,
    where: str,
    *,
    allow_none: bool = False,
    images: list[media.ImageRef] | None = None,
    audio: list[media.ImageRef] | None = None,
    videos: list[tuple[Any, str]] | None = None,
) -> str | None:
    """A message's content as text: a string, or an array of text parts (joined by newlines); with
    `images` (a model with a vision tower), an image part becomes the model's image marker and its
    source goes to `images`; with `videos` (a model whose tower takes video), a video part (a video
    file or its frames) becomes the video marker and its source goes to `videos`."""
    if content is None:
        if allow_none:
            return None
        raise bad(where, "content is required")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, f"expected a string or an array of content parts, got {type_name(content)}")
    texts = []
    for t, part, pw in content_parts(content, where, "content part"):
        if t in ("text", "input_text", "refusal"):
            v = part.get("text" if t != "refusal" else "refusal")
            if not isinstance(v, str):
                raise bad(pw, "a text part needs a string `text`")
            texts.append(v)
        elif t in ("image_url", "input_image") and images is not None and state.vision:
            images.append(media.ImageRef(_image_source(part, pw), pw))
            texts.append(state.vision["marker"])
        elif t in ("input_audio", "audio_url") and audio is not None and state.audio:
            try:
                audio.append(media.ImageRef(media.audio_source(part, pw), pw))
            except InvalidArgumentError as e:
                raise ApiError(400, str(e), param=pw) from None
            texts.append(state.audio["marker"])
        elif t in ("video_url", "video") and videos is not None and state.vision and state.vision.get("video_marker"):
            videos.append((_video_source(part, pw), pw))
            texts.append(state.vision["video_marker"])
        elif t in UNSUPPORTED_PARTS:
            raise _unsupported(state, pw, UNSUPPORTED_PARTS[t], t)
        else:
            raise bad(pw, f"unknown content part type {t!r}")
    return "\n".join(texts)


def _video_source(part: dict[str, Any], where: str) -> Any:
    """A video part's source: `{"type": "video_url", "video_url": {"url": ...}}` or `{"type":
    "video", "video": ...}`, a video file (a data URL, or a path / http(s) URL as the media policy
    allows) or a list of its frames (image URLs or data URLs)."""
    try:
        src = media.video_source(part, where)
    except InvalidArgumentError as e:
        raise ApiError(400, str(e), param=where) from None
    if isinstance(src, list):
        if not src or not all(isinstance(f, str) and f for f in src):
            raise bad(where, "a video given as its frames needs a non-empty list of image URLs or data URLs")
        return src
    if not isinstance(src, str) or not src:
        raise bad(where, "a video part needs a URL (a data URL, path or http(s) URL) or a list of frame URLs")
    return src


def _image_source(part: dict[str, Any], where: str) -> bytes | str:
    try:
        return media.image_source(part, where)
    except InvalidArgumentError as e:
        raise ApiError(400, str(e), param=where) from None


def convert_messages(
    state: ServerState,
    msgs: Any,
    images: list[media.ImageRef] | None = None,
    audio: list[media.ImageRef] | None = None,
    videos: list[tuple[Any, str]] | None = None,
) -> list[dict[str, Any]]:
    """OpenAI messages → the Hugging Face chat-template form (arguments as objects); image parts
    (a model with a vision tower) become image markers, their sources appended to `images`; a video
    part (a model whose tower takes video) the video marker, its frames appended to `videos`."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for i, w, m in message_objects(msgs):
        role = m.get("role")
        if not isinstance(role, str):
            raise bad(f"{w}.role", "is required (system, developer, user, assistant or tool)")
        if role not in ROLES:
            raise bad(f"{w}.role", f"unknown role {role!r} (expected system, developer, user, assistant or tool)")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role}
        if role == "assistant":
            calls = m.get("tool_calls")
            content = _text_of(state, m.get("content"), f"{w}.content", allow_none=bool(calls))
            if content is None and not calls:
                content = ""
            msg["content"] = content
            if calls is not None:
                if not isinstance(calls, list):
                    raise bad(f"{w}.tool_calls", f"expected an array, got {type_name(calls)}")
                tc = []
                for k, c in enumerate(calls):
                    cw = f"{w}.tool_calls[{k}]"
                    fn = c.get("function") if isinstance(c, dict) else None
                    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                        raise bad(cw, 'expected {"type": "function", "function": {"name", "arguments"}}')
                    args = fn.get("arguments", "{}")
                    if isinstance(args, str):
                        try:
                            parsed = parse_json(args) if args.strip() else {}
                        except ValueError:
                            parsed = args  # templates that print strings still get it
                        else:
                            check_json(parsed, f"{cw}.function.arguments", depth=7)  # its level in the body
                        args = parsed
                    cid = c.get("id") if isinstance(c.get("id"), str) else f"call_{i}_{k}"
                    names[cid] = fn["name"]
                    tc.append({"id": cid, "type": "function", "function": {"name": fn["name"], "arguments": args}})
                if tc:
                    msg["tool_calls"] = tc
            rc = m.get("reasoning_content", m.get("reasoning"))
            if isinstance(rc, str) and rc:
                msg["reasoning_content"] = rc
        elif role == "tool":
            msg["content"] = _text_of(state, m.get("content"), f"{w}.content", images=images, audio=audio)
            tid = m.get("tool_call_id")
            if tid is not None and not isinstance(tid, str):
                raise bad(f"{w}.tool_call_id", "expected a string")
            if tid:
                msg["tool_call_id"] = tid
                if tid in names:
                    msg["name"] = names[tid]
        else:
            msg["content"] = _text_of(
                state, m.get("content"), f"{w}.content", images=images, audio=audio, videos=videos
            )
        if isinstance(m.get("name"), str) and role != "tool":
            msg["name"] = m["name"]
        out.append(msg)
    return out


def convert_tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, list[str] | None]:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise bad("tool_choice", "requires `tools`")
        return None, None
    if not isinstance(tools, list):
        raise bad("tools", f"expected an array, got {type_name(tools)}")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if (
            not isinstance(t, dict)
            or t.get("type", "function") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not fn["name"]
        ):
            raise bad(f"tools[{i}]", 'expected {"type": "function", "function": {"name": …, "parameters": …}}')
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad(f"tools[{i}].function.parameters", "expected a JSON Schema object")
        names.append(fn["name"])
    if choice is not None:
        ok = choice in ("none", "auto", "required") or (
            isinstance(choice, dict)
            and isinstance(choice.get("function"), dict)
            and isinstance(choice["function"].get("name"), str)
        )
        if not ok:
            raise bad(
                "tool_choice", 'expected "none", "auto", "required" or {"type": "function", "function": {"name": …}}'
            )
        if isinstance(choice, dict) and choice["function"]["name"] not in names:
            raise bad("tool_choice", f"names {choice['function']['name']!r}, which is not in tools")
    if choice == "none" or not tools:
        return None, None
    return tools, names


TEMPLATE_ARGS = {"messages", "tools", "documents"}  # what the server itself passes to the template


def template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """chat_template_kwargs: extra variables for the chat template; not the ones the server sets."""
    kwargs = opt_object(body, "chat_template_kwargs") or {}
    for k in kwargs:
        if k in TEMPLATE_ARGS:
            raise bad("chat_template_kwargs", f"{k!r} cannot be set here: send it as the request's own field")
    opt_bool(kwargs, "add_generation_prompt", param="chat_template_kwargs.add_generation_prompt")
    return kwargs


def sampling(state: ServerState, body: dict[str, Any]) -> Sampling:
    s = common_sampling(body, temperature_max=2.0, defaults=state.gen_defaults, vocab=state.vocab)
    s.set("presence_penalty", opt_number(body, "presence_penalty", -2.0, 2.0))
    s.set("frequency_penalty", opt_number(body, "frequency_penalty", -2.0, 2.0))
    s.set("repetition_penalty", opt_number(body, "repetition_penalty", 0.0, 10.0))
    s.set("logit_bias", logit_bias(body.get("logit_bias"), state.vocab))
    s.set("stop", stop_list(body.get("stop"), "stop") or None)
    s.set("adapter", state.adapter_of(body.get("model")))
    n = opt_int(body, "n", 1)
    if n is not None and n > 1:
        raise bad("n", f"n > 1 is not supported (one choice per request), got {n}")
    return s


def max_tokens_of(body: dict[str, Any]) -> int | None:
    mt = opt_int(body, "max_completion_tokens", 1, param="max_completion_tokens")
    if mt is None:
        mt = opt_int(body, "max_tokens", 1)
    return mt


@dataclass
class Logprobs:
    want: bool = False
    top: int = 0
    entries: list[dict[str, Any]] = field(default_factory=list)


def _lp_entry(tt: TokenText, tid: int, lp: float | None, top: list[tuple[int, float]], n: int) -> dict[str, Any]:
    tok = tt(tid)
    return {
        "token": tok,
        "logprob": lp,
        "bytes": list(tok.encode()),
        "top_logprobs": [{"token": tt(t), "logprob": v, "bytes": list(tt(t).encode())} for t, v in top[:n]],
    }


def finish_reason(done: dict[str, Any], calls: bool) -> str:
    if done["finish_reason"] == "length":
        return "length"
    return "tool_calls" if calls else "stop"


def usage(done: dict[str, Any]) -> dict[str, Any]:
    p, c = int(done["prompt_tokens"]), int(done["completion_tokens"])
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": int(done.get("cached_tokens", 0))},
    }


def _tool_call_json(c: ToolCall, index: int | None = None) -> dict[str, Any]:
    d: dict[str, Any] = {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
    if index is not None:
        d = {"index": index, **d}
    return d


# -- /v1/chat/completions ------------------------------------------------------------------------
async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_json(request)
    gen, parser, lp, stream, include_usage = await start_chat(state, body)
    try:
        if stream:
            return await _stream_chat(request, state, gen, parser, lp, include_usage)
        return await _collect_chat(state, gen, parser, lp)
    finally:
        gen.cancel()


async def start_chat(state: ServerState, body: dict[str, Any]) -> tuple[Generation, Any, Logprobs, bool, bool]:
    """A chat request's generation, started: (generation, output parser, logprobs, stream,
    include_usage). /v1/responses goes through here too, its request translated to this one."""
    state.check_model(body.get("model"))
    images: list[media.ImageRef] = []
    arefs: list[media.ImageRef] = []
    videos: list[tuple[Any, str]] = []
    messages = convert_messages(state, body.get("messages"), images, arefs, videos)
    if images and videos:
        raise bad("messages", "a request takes images or videos, not both (as mlx-vlm's Qwen3.5)")
    if arefs and videos:
        raise bad("messages", "a request takes audio or videos, not both")
    tools, tool_names = convert_tools(body)
    s = sampling(state, body)
    stream = bool(opt_bool(body, "stream"))
    so = opt_object(body, "stream_options") or {}
    include_usage = bool(opt_bool(so, "include_usage", param="stream_options.include_usage"))
    lp = Logprobs(bool(opt_bool(body, "logprobs")), opt_int(body, "top_logprobs", 0, 20) or 0)
    if lp.top and not lp.want:
        raise bad("top_logprobs", "requires logprobs: true")
    choice = body.get("tool_choice")
    forced = {}
    if tools and (choice == "required" or isinstance(choice, dict)):
        forced = {
            "json_schema": tool_call_schema(tools, choice["function"]["name"] if isinstance(choice, dict) else None)
        }
    constraint, cparam = combine(
        response_format=openai_response_format(body), tool_choice=forced, mlxrs=extension(body)
    )
    for k, v in constraint.items():
        s.set(k, v)
    kwargs = template_kwargs(body)
    requested = max_tokens_of(body)
    loaded = await state.load_images(images)
    clips = await state.load_audio(arefs)
    vids = await state.load_videos(videos)
    rendered, ids = await state.render(messages, tools, kwargs, images=loaded, audio=clips, videos=vids)
    s.set("max_tokens", state.admit(len(ids), requested))
    if lp.want:
        s.set("logprobs", True)
        s.set("top_logprobs", lp.top or None)
    # constrained output starts at once (a template's open <think> is not continued)
    parser = state.parser(None if constraint else rendered, tool_names, tools)
    try:
        gen = await state.generate(ids, s.opts, loaded, clips, vids)
    except ApiError as e:
        raise naming(e, cparam) from None
    return gen, parser, lp, stream, include_usage


async def _collect_chat(state: ServerState, gen: Generation, parser: Any, lp: Logprobs) -> web.Response:
    tt = TokenText(state)
    content, reasoning, calls = [], [], []
    done: dict[str, Any] = {}
    async for step in steps(gen, parser):
        assert step is not None
        for e in step.events:
            if isinstance(e, Content):
                content.append(e.text)
            elif isinstance(e, Reasoning):
                reasoning.append(e.text)
            else:
                calls.append(e)
        if lp.want:
            lp.entries += [_lp_entry(tt, *t, lp.top) for t in step.tokens]
        if step.done:
            done = step.done
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(content) if content or not calls else None}
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = [_tool_call_json(c) for c in calls]
    return web.json_response(
        {
            "id": "chatcmpl-" + secrets.token_hex(12),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": state.model_id,
            "system_fingerprint": FINGERPRINT,
            "choices": [
                {
                    "index": 0,
                    "message": msg,
                    "logprobs": {"content": lp.entries} if lp.want else None,
                    "finish_reason": finish_reason(done, bool(calls)),
                }
            ],
            "usage": usage(done),
        }
    )


async def _stream_chat(
    request: web.Request, state: ServerState, gen: Generation, parser: Any, lp: Logprobs, include_usage: bool
) -> web.StreamResponse:
    tt = TokenText(state)
    resp = await start_sse(request)
    base = {
        "id": "chatcmpl-" + secrets.token_hex(12),
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": state.model_id,
        "system_fingerprint": FINGERPRINT,
    }

    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> bytes:
        d: dict[str, Any] = dict(
            base, choices=[{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]
        )
        if include_usage:
            d["usage"] = None
        return sse(d)

    def take_lp() -> Any:
        if not lp.want or not lp.entries:
            return None
        out = {"content": lp.entries}
        lp.entries = []
        return out

    n_calls = 0
    async with _openai_events(resp, gen):
        await resp.write(chunk({"role": "assistant", "content": ""}))
        async for step in steps(gen, parser, KEEPALIVE_SECONDS):
            if step is None:
                await resp.write(b": keep-alive\n\n")
                continue
            if lp.want:
                lp.entries += [_lp_entry(tt, *t, lp.top) for t in step.tokens]
            for e in step.events:
                if isinstance(e, Content):
                    delta: dict[str, Any] = {"content": e.text}
                elif isinstance(e, Reasoning):
                    delta = {"reasoning_content": e.text}
                else:
                    delta = {"tool_calls": [_tool_call_json(e, n_calls)]}
                    n_calls += 1
                await resp.write(chunk(delta, logprobs=take_lp()))
            if step.done:
                await resp.write(chunk({}, finish_reason(step.done, n_calls > 0), take_lp()))
                if include_usage:
                    await resp.write(sse(dict(base, choices=[], usage=usage(step.done))))
    return resp


@contextlib.asynccontextmanager
async def _openai_events(resp: web.StreamResponse, gen: Generation) -> AsyncIterator[None]:
    """Around the events of an OpenAI stream: `data: [DONE]` after them; an ApiError mid-stream sent
    as an error event, then [DONE]; a client that left cancels the generation."""
    try:
        yield
        await resp.write(b"data: [DONE]\n\n")
    except ApiError as e:
        await _write_quietly(resp, sse(e.body("openai")) + b"data: [DONE]\n\n")
    except ConnectionResetError:
        gen.cancel()


async def _write_quietly(resp: web.StreamResponse, data: bytes) -> None:
    try:
        await resp.write(data)
    except ConnectionResetError:
        pass


# -- /v1/completions -----------------------------------------------------------------------------
async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_json(request)
    state.check_model(body.get("model"))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = await state.tokenize(prompt)
        prompt_text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad_ids = [t for t in prompt if not 0 <= t < state.vocab]
        if bad_ids:
            raise bad("prompt", f"token id {bad_ids[0]} is outside the vocabulary (0..{state.vocab - 1})")
        ids = list(prompt)
        prompt_text = state.session.detokenize(ids)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad("prompt", "batched prompts are not supported: send one prompt per request")
    else:
        raise bad("prompt", "expected a string, an array of token ids, or a one-element array of either")
    if not ids:
        raise bad("prompt", "is empty: at least one token is needed")
    if body.get("suffix"):
        raise bad("suffix", "is not supported")
    best_of = opt_int(body, "best_of", 1)
    if best_of is not None and best_of > 1:
        raise bad("best_of", f"best_of > 1 is not supported, got {best_of}")
    s = sampling(state, body)
    echo = bool(opt_bool(body, "echo"))
    stream = bool(opt_bool(body, "stream"))
    so = opt_object(body, "stream_options") or {}
    include_usage = bool(opt_bool(so, "include_usage", param="stream_options.include_usage"))
    nlp = opt_int(body, "logprobs", 0, 20)
    requested = opt_int(body, "max_tokens", 1, None)
    s.set("max_tokens", state.admit(len(ids), 16 if requested is None else requested, param="prompt"))
    if nlp is not None:
        s.set("logprobs", True)
        s.set("top_logprobs", nlp or None)
    gen = await state.generate(ids, s.opts)
    try:
        return await _completion(request, state, gen, stream, include_usage, echo, prompt_text, nlp)
    finally:
        gen.cancel()


async def _completion(
    request: web.Request,
    state: ServerState,
    gen: Generation,
    stream: bool,
    include_usage: bool,
    echo: bool,
    prompt_text: str,
    nlp: int | None,
) -> web.StreamResponse:
    tt = TokenText(state)
    cid, created = "cmpl-" + secrets.token_hex(12), int(time.time())
    offset = [len(prompt_text) if echo else 0]

    def lp_block(step: Step, text_len: int) -> dict[str, Any] | None:
        if nlp is None:
            return None
        toks, lps, tops, offs = [], [], [], []
        for tid, lpv, top in step.tokens:
            t = tt(tid)
            toks.append(t)
            lps.append(lpv)
            tops.append({tt(a): b for a, b in top[:nlp]} if nlp else None)
            offs.append(offset[0])
            offset[0] += len(t)
        return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}

    def obj(text: str, finish: str | None, logprobs: Any, with_usage: Any = False) -> dict[str, Any]:
        d: dict[str, Any] = {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": state.model_id,
            "system_fingerprint": FINGERPRINT,
            "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}],
        }
        if with_usage is not False:
            d["usage"] = with_usage
        return d

    if not stream:
        pieces: list[str] = [prompt_text] if echo else []
        merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        done: dict[str, Any] = {}
        async for step in steps(gen, None):
            assert step is not None
            pieces += [e.text for e in step.events]
            block = lp_block(step, 0)
            if block:
                for k in merged:
                    merged[k] += block[k]
            if step.done:
                done = step.done
        reason = "length" if done["finish_reason"] == "length" else "stop"
        return web.json_response(obj("".join(pieces), reason, merged if nlp is not None else None, usage(done)))

    resp = await start_sse(request)
    async with _openai_events(resp, gen):
        if echo and prompt_text:
            await resp.write(sse(obj(prompt_text, None, None, None if include_usage else False)))
        async for step in steps(gen, None, KEEPALIVE_SECONDS):
            if step is None:
                await resp.write(b": keep-alive\n\n")
                continue
            text = "".join(e.text for e in step.events)
            block = lp_block(step, len(text))
            if step.done:
                reason = "length" if step.done["finish_reason"] == "length" else "stop"
                await resp.write(sse(obj(text, reason, block, None if include_usage else False)))
                if include_usage:
                    await resp.write(
                        sse(
                            {
                                "id": cid,
                                "object": "text_completion",
                                "created": created,
                                "model": state.model_id,
                                "choices": [],
                                "usage": usage(step.done),
                            }
                        )
                    )
            elif text or block:
                await resp.write(sse(obj(text, None, block, None if include_usage else False)))
    return resp


def setup(r: web.UrlDispatcher) -> None:
    r.add_post("/v1/chat/completions", chat_completions)
    r.add_post("/v1/completions", completions)
    r.add_post("/chat/completions", chat_completions)
    r.add_post("/completions", completions)
