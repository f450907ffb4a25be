"""`mlxrs.Session`: load a model once, generate from Python.

>>> from mlxrs import Session                          # doctest: +SKIP
>>> with Session("path/to/model") as s:                # doctest: +SKIP
...     print(s.generate("Hello", max_tokens=8).text)
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator, Mapping, Sequence

from . import _native
from .errors import InvalidArgumentError

Message = Mapping[str, Any]

_SAMPLING_KEYS = {
    "temperature", "top_p", "top_k", "min_p", "min_tokens_to_keep", "repetition_penalty", "repetition_context_size",
    "presence_penalty", "frequency_penalty", "logit_bias", "seed", "max_tokens", "stop",
    "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs",
}


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    #: prompt tokens taken from the prompt-prefix cache instead of prefilled
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Timings:
    prompt_seconds: float
    generation_seconds: float
    prompt_tps: float
    generation_tps: float
    peak_memory: int


@dataclass
class TokenLogprob:
    id: int
    logprob: float | None
    top: list[tuple[int, float]]


@dataclass
class Chunk:
    """One streamed piece: the token id and the text it completes (may be empty)."""

    text: str
    token: int | None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    timings: Timings | None = None


@dataclass
class Completion:
    text: str
    tokens: list[int]
    finish_reason: str
    usage: Usage
    timings: Timings
    stop_string: str | None = None
    logprobs: list[TokenLogprob] | None = None


def _params(kwargs: dict[str, Any]) -> str:
    unknown = set(kwargs) - _SAMPLING_KEYS
    if unknown:
        raise InvalidArgumentError(f"unknown generation option(s): {', '.join(sorted(unknown))}")
    p = {k: v for k, v in kwargs.items() if v is not None}
    stop = p.get("stop")
    if isinstance(stop, str):
        p["stop"] = [stop]
    if "logit_bias" in p:
        p["logit_bias"] = {str(k): float(v) for k, v in dict(p["logit_bias"]).items()}
    try:
        return json.dumps(p, allow_nan=False)
    except ValueError:
        bad = sorted(k for k, v in p.items() if _has_nan(v))
        raise InvalidArgumentError(f"generation option(s) {', '.join(bad)} must be finite numbers") from None


def _has_nan(v: Any) -> bool:
    if isinstance(v, float):
        return v != v or v in (float("inf"), float("-inf"))
    if isinstance(v, Mapping):
        return any(_has_nan(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_has_nan(x) for x in v)
    return False


class Session:
    """A loaded model with its own engine thread (all MLX state lives there).

    `model` is a model directory (config.json, *.safetensors, tokenizer.json), a `.gguf` file
    (imported once into a cache keyed by its sha256), or None for the embedded default model
    (Gemma 3 270M, installed by the `mlxrs[demo]` extra).

    Thread-safe, and concurrent: generations started from several threads (or `generate_batch`,
    or `astream` tasks) are decoded together in one batch, up to `max_concurrency` at a time; more
    wait in a queue of `max_queue` (one more raises `BusyError`). Prompts that share a prefix with
    an earlier prompt or conversation reuse its KV cache (`prompt_cache_bytes`, 0 turns it off).
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        kv_bits: int | None = None,
        max_kv_size: int | None = None,
        prefill_step_size: int = 2048,
        kv_group_size: int = 64,
        max_concurrency: int | None = None,
        max_queue: int | None = None,
        prompt_cache_bytes: int | None = None,
        kv_budget_bytes: int | None = None,
    ) -> None:
        from .models import DEFAULT_MODEL_NAME, resolve_model

        if model is None:
            print(f"mlxrs: no model given; using the embedded default, {DEFAULT_MODEL_NAME}", file=sys.stderr)
        self.model_path = os.fspath(resolve_model(model))
        self._s = _native.Session(
            self.model_path, kv_bits=kv_bits, max_kv_size=max_kv_size,
            prefill_step_size=prefill_step_size, kv_group_size=kv_group_size,
            max_concurrency=max_concurrency, max_queue=max_queue, prompt_cache_bytes=prompt_cache_bytes,
            kv_budget_bytes=kv_budget_bytes,
        )

    # -- text <-> tokens ---------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._s.tokenize(text, add_special_tokens))

    def detokenize(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return str(self._s.detokenize(list(ids), skip_special_tokens))

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        # as transformers does: keys whose value is None are dropped from each message (OpenAI
        # clients send content=None next to tool_calls), and tools=None reaches the template as none
        msgs = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        return str(self._s.apply_chat_template(
            json.dumps(msgs), json.dumps(list(tools)) if tools is not None else None,
            add_generation_prompt, json.dumps(template_kwargs),
        ))

    def encode_prompt(
        self,
        prompt: str | Sequence[Message] | Sequence[int],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids for a string (tokenized as is, with the tokenizer's BOS rule), a list of
        messages (through the chat template) or ids (used as given)."""
        if isinstance(prompt, str):
            return self.tokenize(prompt)
        items = list(prompt)
        if items and all(isinstance(t, int) for t in items):
            return [int(t) for t in items]
        if not items or not all(isinstance(m, Mapping) for m in items):
            raise InvalidArgumentError("prompt must be a string, a list of token ids or a non-empty list of messages")
        text = self.apply_chat_template(items, tools=tools, **dict(template_kwargs or {}))
        return list(self._s.encode_rendered(text))

    # -- generation --------------------------------------------------------------------------------
    def _events(self, ids: list[int], kwargs: dict[str, Any]) -> Iterator[dict[str, Any]]:
        stream = self._s.start(ids, _params(kwargs))
        try:
            yield from stream
        finally:
            stream.cancel()

    def stream(
        self,
        prompt: str | Sequence[Message] | Sequence[int],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        **sampling: Any,
    ) -> Iterator[Chunk]:
        """Yield chunks as tokens are generated; the last chunk carries finish_reason and usage.
        Closing the iterator early cancels the generation."""
        ids = self.encode_prompt(prompt, tools=tools, template_kwargs=template_kwargs)
        for ev in self._events(ids, sampling):
            ch = _chunk(ev)
            if ch is not None:
                yield ch

    def generate(
        self,
        prompt: str | Sequence[Message] | Sequence[int],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        **sampling: Any,
    ) -> Completion:
        """Generate to the end and return the whole Completion."""
        ids = self.encode_prompt(prompt, tools=tools, template_kwargs=template_kwargs)
        want_lp = bool(sampling.get("logprobs")) or bool(sampling.get("top_logprobs"))
        return _collect(self._events(ids, sampling), want_lp)

    def generate_batch(
        self,
        prompts: Sequence[str | Sequence[Message] | Sequence[int]],
        **sampling: Any,
    ) -> list[Completion]:
        """Generate for several prompts at once (decoded together in one batch); the results in
        the prompts' order. Sampling options apply to every prompt."""
        streams = [self._s.start(self.encode_prompt(p), _params(sampling)) for p in prompts]
        want_lp = bool(sampling.get("logprobs")) or bool(sampling.get("top_logprobs"))
        try:
            return [_collect(iter(st), want_lp) for st in streams]
        finally:
            for st in streams:
                st.cancel()

    async def astream(
        self,
        prompt: str | Sequence[Message] | Sequence[int],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        **sampling: Any,
    ) -> AsyncIterator[Chunk]:
        """`stream` for asyncio: chunks arrive on the running loop without blocking it (one
        dispatcher thread serves every async stream); leaving the loop early cancels."""
        import asyncio

        from . import _dispatch

        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(None, lambda: self.encode_prompt(
            prompt, tools=tools, template_kwargs=template_kwargs))
        d = _dispatch.default()
        st = self._s.start(ids, _params(sampling), d.hub)
        q = d.register(st.id)
        finished = False
        try:
            while True:
                ev = await q.get()
                if isinstance(ev, BaseException):
                    finished = True
                    raise ev
                ch = _chunk(ev)
                if ch is not None:
                    finished = ch.finish_reason is not None
                    yield ch
                    if finished:
                        return
        finally:
            if not finished:
                st.cancel()
            d.unregister(st.id, finished)

    def chat(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        **template_kwargs: Any,
    ) -> Completion:
        """Generate a reply to `messages` through the chat template (template kwargs such as
        enable_thinking pass through)."""
        return self.generate(list(messages), tools=tools, template_kwargs=template_kwargs,
                             max_tokens=max_tokens, temperature=temperature)

    def logits(self, prompt: str | Sequence[int]) -> list[float]:
        """Last-position logits (float32) for a prompt, from a fresh cache, on the same prefill
        schedule as generation."""
        ids = self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        return list(self._s.logits(ids))

    # -- lifecycle ---------------------------------------------------------------------------------
    @property
    def info(self) -> dict[str, Any]:
        return dict(self._s.info())

    def close(self) -> None:
        self._s.close()

    def _inject_engine_panic(self) -> None:
        """Test-only: the engine thread panics at its next iteration (see `_native.Session`)."""
        self._s._inject_engine_panic()

    @property
    def closed(self) -> bool:
        return bool(self._s.closed)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _chunk(ev: Mapping[str, Any]) -> Chunk | None:
    """The Chunk an engine event stands for (None for progress and for an empty final flush)."""
    if ev["type"] == "token":
        if ev["id"] < 0 and not ev["text"]:
            return None
        return Chunk(text=ev["text"], token=ev["id"] if ev["id"] >= 0 else None,
                     logprob=ev["logprob"], top_logprobs=list(ev["top"]))
    if ev["type"] == "done":
        return Chunk(text="", token=None, finish_reason=ev["finish_reason"], usage=_usage(ev), timings=_timings(ev))
    return None


def _usage(ev: Mapping[str, Any]) -> Usage:
    return Usage(ev["prompt_tokens"], ev["completion_tokens"], ev.get("cached_tokens", 0))


def _collect(events: Iterator[dict[str, Any]], want_lp: bool) -> Completion:
    text: list[str] = []
    tokens: list[int] = []
    lps: list[TokenLogprob] = []
    for ev in events:
        if ev["type"] == "token":
            text.append(ev["text"])
            if ev["id"] >= 0:
                tokens.append(ev["id"])
                if want_lp:
                    lps.append(TokenLogprob(ev["id"], ev["logprob"], list(ev["top"])))
        elif ev["type"] == "done":
            return Completion(
                text="".join(text), tokens=tokens, finish_reason=ev["finish_reason"], usage=_usage(ev),
                timings=_timings(ev), stop_string=ev["stop_string"], logprobs=lps if want_lp else None,
            )
    raise RuntimeError("the engine ended the stream without a final event")


def _timings(ev: Mapping[str, Any]) -> Timings:
    return Timings(ev["prompt_seconds"], ev["generation_seconds"], ev["prompt_tps"], ev["generation_tps"],
                   ev["peak_memory"])
