"""The aiohttp application: routing, authentication, body limits, error envelopes, memory
admission and /health, /stats, /v1/models; a thin async client of the engine for generation.

The engine (Rust) schedules: up to `--max-concurrency` generations are decoded together in one
batch, more wait in its bounded queue (`--max-queue`; one more answers 429 with Retry-After), and a
prompt that shares a prefix with an earlier one reuses its KV cache. Events come back through one
dispatcher thread (mlxrs._dispatch) to the loop. A client that disconnects cancels its generation
(honoured by the engine at its next prefill chunk or decode step).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping, Sequence, TypeVar

from aiohttp import web, web_protocol

from .. import _dispatch, _native
from ..session import Session, _params
from .common import loads_strict
from ..errors import EngineError, InvalidArgumentError, MlxrsError
from ..media import ImageRef as MediaRef
from ..media import MediaPolicy, load_async
from .errors import ApiError, admission_error, engine_error, from_exception
from . import adapt
from .events import OutputParser, output_format_for, schemas_of, think_markers_for

log = logging.getLogger("mlxrs.server")

STATE: web.AppKey["ServerState"] = web.AppKey("mlxrs_state")

DEFAULT_MAX_BODY = 32 << 20
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}
WILDCARD_HOSTS = {"", "0.0.0.0", "::", "*"}
KEEPALIVE_SECONDS = 10.0
PREFIX_CHARS_PER_TOKEN = 16  # longer prompts are first measured by a prefix this many chars per token
DEFAULT_MAX_TOKENS = 4096  # a chat request without max_tokens (--max-tokens)

T = TypeVar("T")


@dataclass
class Stats:
    """What the HTTP layer counts itself; the engine counts generations (ServerState.stats_body)."""

    started: float = field(default_factory=time.time)
    rejected_admission: int = 0
    errors: int = 0
    clamped: int = 0
    engine_unavailable: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    recent: collections.deque[tuple[int, float, int, float]] = field(
        default_factory=lambda: collections.deque(maxlen=20)
    )  # (gen tokens, gen s, prompt tokens, prompt s)


class ServerState:
    """What the handlers share: the session, the model's names, the plan and the queue."""

    def __init__(
        self,
        session: Session,
        *,
        model_id: str,
        aliases: Sequence[str],
        plan: Mapping[str, Any],
        kv_bits: int | None,
        api_key: str | None,
        max_body: int = DEFAULT_MAX_BODY,
        budget_source: str = "",
        host: str = "127.0.0.1",
        allowed_hosts: Sequence[str] = (),
        cors_origins: Sequence[str] = (),
        shutdown_timeout: float = 10.0,
        listed_aliases: Sequence[str] = (),
        strict_names: bool = False,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        media_policy: MediaPolicy | None = None,
    ) -> None:
        self.session = session
        # where images may come from (--allow-local-media, --allow-remote-media) and their limits
        self.media = media_policy or MediaPolicy()
        self.model_id = model_id
        # --alias names: answered and listed in /v1/models; any other name is answered too unless
        # --strict-model-names (clients send their own defaults: gpt-4o-mini, claude-sonnet-4-5, …)
        self.listed_aliases = list(dict.fromkeys(a for a in listed_aliases if a and a != model_id))
        self.aliases = {a.lower() for a in (*aliases, *self.listed_aliases) if a} | {model_id.lower()}
        self.strict_names = strict_names
        # LoRA adapters (--adapter): several are picked per request by model name (adapter_of)
        self.adapters = list(getattr(session, "adapters", {}) or {})
        self.adapter_ids = [f"{model_id}:{a}" for a in self.adapters]
        self.aliases |= {a.lower() for a in (*self.adapters, *self.adapter_ids)}
        self.default_max_tokens = default_max_tokens
        self.plan = dict(plan)
        self.kv_bits = kv_bits
        self.api_key = api_key
        self.max_body = max_body
        self.budget_source = budget_source
        info = session.info
        self.info = info
        self.vocab = int(info["vocab_size"])
        # the model's image input (None: no vision tower)
        self.vision = info.get("vision")
        # the model's audio input (None: no audio tower)
        self.audio = info.get("audio")
        self.model_context = int(info.get("max_position_embeddings") or 0) or None
        ceiling = int(plan["maxSafeContext"])
        if self.model_context:
            ceiling = min(ceiling, self.model_context)
        self.context_tokens = ceiling
        self.stats = Stats()
        self.dispatcher = _dispatch.default()
        self.executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="mlxrs-server")
        model_dir = Path(session.model_path)
        self.template = session.chat_template or session.info.get("chat_template")
        # what the chat template cannot render is adapted (server/adapt.py)
        self.caps = (
            adapt.probe(lambda m, t: session.apply_chat_template(m, tools=t))
            if self.template is not None
            else adapt.Caps()
        )
        if self.caps.adapted():
            log.info(
                "the chat template lacks %s: such requests are adapted (docs/server-api.md)",
                ", ".join(self.caps.adapted()),
            )
        self.think = think_markers_for(self.template)
        self.output_format = output_format_for(self.template)
        self.gen_defaults = _generation_defaults(model_dir)
        self.created = int(time.time())
        self.closing = False
        self.shutdown_timeout = shutdown_timeout
        self.generations: set[Generation] = set()
        # Host names a request may address (DNS rebinding): loopback names, the bound address,
        # --allowed-hosts; any name when --allowed-hosts '*', or when bound to every interface
        # with an API key (which a rebinding page cannot know)
        names = {h.strip().lower().strip("[]") for h in allowed_hosts if h.strip()}
        self.any_host = "*" in names or (host in WILDCARD_HOSTS and bool(api_key))
        self.allowed_hosts = (
            names | LOOPBACK_NAMES | ({host.lower().strip("[]")} if host not in WILDCARD_HOSTS else set())
        )
        self.cors_origins = {o.strip().rstrip("/").lower() for o in cors_origins if o.strip()}

    # -- names -------------------------------------------------------------------------------
    def check_model(self, name: Any, param: str = "model") -> None:
        if name is None:
            return
        if not isinstance(name, str):
            raise ApiError(400, f"{param}: expected a string", param=param)
        if self.strict_names and name.lower() not in self.aliases:
            with_adapters = (
                f" (with its adapters {', '.join(self.adapters)}: {', '.join(f'`{i}`' for i in self.adapter_ids)})"
                if self.adapters
                else ""
            )
            raise ApiError(
                404,
                f"The model `{name}` does not exist: this server serves `{self.model_id}`{with_adapters}",
                param=param,
                code="model_not_found",
            )

    def adapter_of(self, name: Any) -> str | None:
        """The adapter a request's model name picks: `MODEL:NAME` or `NAME`; None (the base model,
        or the one adapter a single-adapter server applies to everything) otherwise."""
        if len(self.adapters) < 2 or not isinstance(name, str):
            return None
        if name in self.adapters:
            return name
        base, sep, ad = name.rpartition(":")
        if sep and ad in self.adapters:
            return ad
        if sep and base and self.strict_names:
            raise ApiError(
                404,
                f"The adapter `{ad}` is not loaded: this server has {', '.join(self.adapters)}",
                param="model",
                code="model_not_found",
            )
        return None

    # -- prompts ------------------------------------------------------------------------------
    async def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template_kwargs: Mapping[str, Any],
        param: str = "messages",
        *,
        images: Sequence[tuple[bytes, str]] = (),
        audio: Sequence[Any] = (),
        videos: Sequence[Any] = (),
    ) -> tuple[str, list[int]]:
        """Chat template → (rendered text, token ids), off the event loop; what the template
        cannot render is adapted first (server/adapt.py). With `images` (each image's bytes and its
        place in the request), the rendered text's image markers are expanded to the model's image
        tokens (their count must be the images'; a model whose count of image tokens depends on the
        image's size reads each one's from its header: a 400 naming the part when it cannot).
        `videos` (`mlxrs.video.Video`s, from `load_videos`): the video markers expanded by each
        video's frame count, size and frame times."""
        msgs, tools = adapt.adapt(self.caps, messages, tools)

        def work() -> tuple[str, list[int]]:
            text = self.session.apply_chat_template(msgs, tools=tools, **dict(template_kwargs))
            if images:
                sizes: list[tuple[int, int]] | None = None
                if self.vision and self.vision.get("sized"):
                    sizes = []
                    for data, where in images:
                        try:
                            sizes.extend(self.session._s.image_sizes([(data, where)], json.dumps(self.media.params())))
                        except InvalidArgumentError as e:
                            raise ApiError(400, str(e), param=where) from None
                try:
                    text = self.session._s.expand_image_markers(text, len(images), sizes)
                except InvalidArgumentError as e:
                    raise ApiError(
                        400, f"{param}: {e} (does the chat template render image parts?)", param=param
                    ) from None
            if audio:
                try:
                    text = self.session._s.expand_audio_markers(text, [c.tokens for c in audio])
                except InvalidArgumentError as e:
                    raise ApiError(400, f"{param}: {e}", param=param) from None
            if videos:  # each video's marker expanded by its frame count, size and frame times
                shapes = []
                for v in videos:
                    try:
                        ((h, w),) = self.session._s.image_sizes(v.frames[:1], json.dumps(self.media.params()))
                    except InvalidArgumentError as e:
                        raise ApiError(400, str(e), param=v.where) from None
                    shapes.append((len(v.frames), h, w, v.times))
                try:
                    text = self.session._s.expand_video_markers(text, shapes)
                except InvalidArgumentError as e:
                    raise ApiError(400, f"{param}: {e}", param=param) from None
            return text, self._encode(text, lambda t: list(self.session._s.encode_rendered(t)), param)

        return await self._blocking(work)

    async def load_images(self, refs: Sequence[MediaRef]) -> list[tuple[bytes, str]]:
        """The bytes of a request's images (each with its place in the request), under the media
        policy: a 400 naming the part for what is not allowed, too large or unreachable."""
        out = []
        for r in refs:
            try:
                out.append((await load_async(r, self.media), r.where))
            except InvalidArgumentError as e:
                raise ApiError(400, str(e), param=r.where) from None
        return out

    async def load_videos(self, refs: Sequence[tuple[Any, str]]) -> list[Any]:
        """A request's videos (`mlxrs.video.Video`s), each (its source, its place): a list of frame
        URLs loaded as images are, or a video file (a data URL, or a path / http(s) URL as the
        media policy allows; its byte limit raised to video's) decoded and sampled off the event
        loop. A 400 naming the part for what is not allowed, too large or undecodable, or when the
        decoder (the `mlxrs[video]` extra) is not installed."""
        from .. import video as vid

        policy = replace(self.media, max_bytes=max(self.media.max_bytes, vid.DEFAULT_MAX_VIDEO_BYTES))
        sampling = vid.Sampling.of(self.vision)
        out = []
        for src, where in refs:
            if vid.is_frames(src):
                frames = await self.load_images([MediaRef(f, w) for f, w in vid.frame_refs(src, f"{where}.frames")])
                out.append(vid.Video(frames, None, where))
                continue
            try:
                data = await load_async(MediaRef(src, where), policy)
                max_px = self.media.max_pixels

                def decode(d: bytes = data, w: str = where) -> Any:
                    return vid.decode(d, w, sampling, max_pixels=min(max_px, vid.DEFAULT_MAX_FRAME_PIXELS))

                out.append(await asyncio.get_running_loop().run_in_executor(None, decode))
            except InvalidArgumentError as e:
                raise ApiError(400, str(e), param=where) from None
        return out

    async def load_audio(self, refs: Sequence[MediaRef]) -> list[Any]:
        """A request's audio clips decoded and featurized (native `AudioClip`s), under the media
        policy (its byte limit raised to audio's): a 400 naming the part for what is not allowed,
        too large, not WAV or undecodable."""
        from ..media import DEFAULT_MAX_AUDIO_BYTES

        policy = replace(self.media, max_bytes=max(self.media.max_bytes, DEFAULT_MAX_AUDIO_BYTES))
        out = []
        for r in refs:
            try:
                data = await load_async(r, policy)

                def clips(d: bytes = data, w: str = r.where) -> list[Any]:
                    return list(self.session._s.audio_clips([(d, w)]))

                out.extend(await self._blocking(clips))
            except InvalidArgumentError as e:
                raise ApiError(400, str(e), param=r.where) from None
        return out

    async def tokenize(self, text: str, param: str = "prompt") -> list[int]:
        return await self._blocking(lambda: self._encode(text, self.session.tokenize, param))

    def _encode(self, text: str, encode: Callable[[str], list[int]], param: str) -> list[int]:
        """encode(text), but a text far past the context ceiling is refused from the tokens of a
        prefix: tokenizing megabytes only to refuse them would leave the process hundreds of MB
        larger (the allocator keeps what the tokenizer took)."""
        limit = self.context_tokens * PREFIX_CHARS_PER_TOKEN
        if len(text) > limit:
            n = len(encode(text[:limit]))
            if n > self.context_tokens + 8:  # a cut word adds a token or two at most
                raise self.over_ceiling(f"more than {n - 8}", param)
        return encode(text)

    async def _blocking(self, fn: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self.executor, fn)
        except Exception as e:  # template errors (raise_exception), bad ids, …
            raise from_exception(e) from None

    def parser(
        self, rendered: str | None, tool_names: Sequence[str] | None, tools: Sequence[dict[str, Any]] | None = None
    ) -> OutputParser:
        """The output parser of one request; `tools` (OpenAI-style) type the values of the
        XML-style call formats by their schemas. `rendered` is None under a constraint: the output
        is then the constrained text itself (a forced call is bare JSON), never harmony's channels."""
        in_reasoning = bool(rendered) and rendered.rstrip().endswith(self.think[0])  # type: ignore[union-attr]
        return OutputParser(
            tools=tool_names,
            think=self.think,
            in_reasoning=in_reasoning,
            schemas=schemas_of(tools),
            harmony=self.output_format == "harmony" and rendered is not None,
        )

    # -- admission ----------------------------------------------------------------------------
    def admit(self, n_prompt: int, max_tokens: int | None, param: str = "messages") -> int:
        """The max_tokens a request may have: 400 (memory_admission) when the prompt leaves no
        generation slot under the context ceiling; a max_tokens past it is clamped to the room."""
        ceiling = self.context_tokens
        room = ceiling - n_prompt
        if room < 1:
            raise self.over_ceiling(str(n_prompt), param)
        if max_tokens is None:
            return min(self.default_max_tokens, room)
        if max_tokens > room:
            self.stats.clamped += 1
            log.info(
                "max_tokens %d clamped to %d (context ceiling %d, prompt %d tokens)",
                max_tokens,
                room,
                ceiling,
                n_prompt,
            )
            return room
        return max_tokens

    # -- the engine ---------------------------------------------------------------------------
    def engine(self) -> dict[str, Any]:
        """{"state": "running" | "dead" | "closed", "error": str | None}: whether it can generate."""
        if self.session.closed:
            return {"state": "closed", "error": None}
        try:
            info = self.session.info
            info = info() if callable(info) else info
            eng = info.get("engine") if isinstance(info, Mapping) else None
        except Exception as e:  # an engine that died may not answer
            return {"state": "dead", "error": f"{type(e).__name__}: {e}"}
        if not isinstance(eng, Mapping):
            return {"state": "running", "error": None}
        return {"state": str(eng.get("state", "running")), "error": eng.get("error")}

    def engine_unavailable(self, e: BaseException | None = None) -> ApiError:
        """The 503 for a request the engine cannot serve (counted in /stats)."""
        self.stats.engine_unavailable += 1
        eng = self.engine()
        if e is not None and eng["state"] == "running":
            eng = {"state": "dead", "error": str(e)}
        return engine_error(eng["state"], eng["error"])

    def over_ceiling(self, n_prompt: str, param: str) -> ApiError:
        self.stats.rejected_admission += 1
        return admission_error(
            f"the prompt ({n_prompt} tokens) leaves no room to generate within the context ceiling of "
            f"{self.context_tokens} tokens (memory budget {self.plan['usableBytes']} bytes; see /stats) — shorten "
            "the prompt, raise --memory-budget, or serve with --kv-quant 4|8",
            param=param,
        )

    # -- generation ---------------------------------------------------------------------------
    async def generate(
        self,
        ids: list[int],
        opts: dict[str, Any],
        images: list[tuple[bytes, str]] | None = None,
        audio: list[Any] | None = None,
        videos: list[Any] | None = None,
    ) -> "Generation":
        """Hand the request to the engine (it queues and batches); 429 when its queue is full,
        503 while shutting down or when the engine cannot generate."""
        if self.closing:
            raise shutting_down()
        if self.engine()["state"] != "running":
            raise self.engine_unavailable()
        try:
            params = _params(opts, self.vocab)
            if images or videos:
                params = json.dumps({**json.loads(params), **self.media.params()})
            frames = [v.frames for v in videos or []]
            stream = self.session._s.start(
                ids, params, self.dispatcher.hub, images or None, audio or None, None, frames or None
            )
        except EngineError as e:
            raise self.engine_unavailable(e) from None
        except Exception as e:
            raise from_exception(e) from None
        return Generation(self, stream, len(ids))

    def end_generations(self, *, running: bool) -> int:
        """Shutdown: end the generations still waiting for the engine (each answers 503) and, with
        `running`, the ones decoding too (each ends with a final event). How many were ended."""
        ended = 0
        for gen in list(self.generations):
            if running or not gen.started:
                gen.queue.put_nowait(SHUTDOWN)
                ended += 1
        return ended

    def finished(self, done: Mapping[str, Any] | None) -> None:
        if done is None or done.get("finish_reason") == "cancelled":
            return
        self.stats.prompt_tokens += int(done["prompt_tokens"])
        self.stats.cached_tokens += int(done.get("cached_tokens", 0))
        self.stats.completion_tokens += int(done["completion_tokens"])
        self.stats.recent.append(
            (
                int(done["completion_tokens"]),
                float(done["generation_seconds"]),
                int(done["prompt_tokens"]),
                float(done["prompt_seconds"]),
            )
        )

    def stats_body(self) -> dict[str, Any]:
        st = self.stats
        gen_t = sum(r[0] for r in st.recent)
        gen_s = sum(r[1] for r in st.recent)
        pr_t = sum(r[2] for r in st.recent)
        pr_s = sum(r[3] for r in st.recent)
        try:
            engine = self.session.info
        except Exception:  # closed while shutting down
            engine = {}
        return {
            "model": self.model_id,
            "model_path": str(Path(self.session.model_path).resolve()),
            "context_tokens": self.context_tokens,
            "model_context": self.model_context,
            "kv_bits": self.kv_bits,
            "memory_plan": self.plan,
            "memory_budget_source": self.budget_source,
            "memory_limit_bytes": _native.memory_limit(),  # MLX's: the plan's allocatorLimitBytes
            # the engine's counts: received = served + cancelled + rejected + failed + active + queued
            "requests": {
                "received": engine.get("requests", 0),
                "served": engine.get("served", 0),
                "cancelled": engine.get("cancelled", 0),
                "rejected": engine.get("rejected", 0),
                "failed": engine.get("failed", 0),
                "active": engine.get("running", 0),
                "queued": max(0, int(engine.get("inflight", 0)) - int(engine.get("running", 0))),
                "rejected_memory_admission": st.rejected_admission,
                "clamped_max_tokens": st.clamped,
                "errors": st.errors,
                "engine_unavailable": st.engine_unavailable,
            },
            "scheduler": {"max_concurrency": engine.get("max_concurrency"), "max_queue": engine.get("max_queue")},
            "prompt_cache": engine.get("prompt_cache"),
            # streamed MoE experts (None when resident): hits, misses, hit rate, bytes read (per token),
            # read throughput, the cache's budget and fill
            "experts": engine.get("experts"),
            "tokens": {"prompt": st.prompt_tokens, "cached": st.cached_tokens, "completion": st.completion_tokens},
            "recent": {
                "window": len(st.recent),
                "generation_tokens_per_second": round(gen_t / gen_s, 2) if gen_s > 0 else None,
                "prompt_tokens_per_second": round(pr_t / pr_s, 2) if pr_s > 0 else None,
            },
            "engine": {
                **{
                    k: engine.get(k)
                    for k in (
                        "prompt_tokens_total",
                        "generated_tokens_total",
                        "decode_steps",
                        "stacked_decode_steps",
                        "prefill_steps",
                        "prefill_rows",
                        "prefill_max_rows",
                        "decode_host_seconds",
                    )
                },
                **self.engine(),
            },
            "uptime_seconds": round(time.time() - st.started, 1),
        }


def shutting_down() -> ApiError:
    return ApiError(
        503,
        "the server is shutting down: retry on another instance or after it restarts",
        code="shutting_down",
        headers={"Retry-After": "5"},
    )


SHUTDOWN = object()  # queued into a Generation by ServerState.end_generations


class Generation:
    """One generation: its engine events as an async iterator (delivered by the dispatcher
    thread, no thread of its own), cancellable."""

    def __init__(self, state: ServerState, stream: Any, n_prompt: int = 0) -> None:
        self.state = state
        self.stream = stream
        self.queue = state.dispatcher.register(stream.id)
        self.done: dict[str, Any] | None = None
        self.ended = False
        self.started = False  # the engine has sent an event (it is no longer queued)
        self.n_prompt = n_prompt
        self.n_generated = 0
        state.generations.add(self)

    def cancel(self) -> None:
        """Stop the generation (if it still runs) and drop whatever it still sends."""
        self.state.generations.discard(self)
        if not self.ended:
            self.ended = True
            self.stream.cancel()
            self.state.dispatcher.unregister(self.stream.id, False)

    def _end(self) -> None:
        self.state.generations.discard(self)
        if not self.ended:
            self.ended = True
            self.state.dispatcher.unregister(self.stream.id, True)
            self.state.finished(self.done)

    def _shutdown(self) -> dict[str, Any]:
        """The server is stopping: cancel; a queued generation answers 503, a running one gets a
        final event that reports the cut as the length limit (finish_reason "length")."""
        self.cancel()
        if not self.started:
            raise shutting_down()
        return {
            "type": "done",
            "finish_reason": "length",
            "stop_string": None,
            "shutdown": True,
            "prompt_tokens": self.n_prompt,
            "completion_tokens": self.n_generated,
            "cached_tokens": 0,
        }

    async def events(self, keepalive: float | None = None) -> AsyncIterator[dict[str, Any] | None]:
        """Engine events (progress/token/done); None after `keepalive` seconds of silence."""
        try:
            while True:
                try:
                    item = await asyncio.wait_for(self.queue.get(), keepalive) if keepalive else await self.queue.get()
                except asyncio.TimeoutError:
                    yield None
                    continue
                if item is SHUTDOWN:
                    self.done = self._shutdown()
                    yield self.done
                    return
                self.started = True
                if isinstance(item, BaseException):
                    self._end()
                    self.state.stats.errors += 1
                    if isinstance(item, EngineError):
                        raise self.state.engine_unavailable(item)
                    raise from_exception(item)
                if item["type"] == "token" and item["id"] >= 0:
                    self.n_generated += 1
                if item["type"] == "done":
                    self.done = item
                    self._end()
                    yield item
                    return
                yield item
        finally:
            self.cancel()  # when the consumer left early: cancel, drop what still comes


# -- middleware ----------------------------------------------------------------------------------
def protocol_of(request: web.Request) -> str:
    return "anthropic" if request.path.startswith("/v1/messages") else "openai"


OPEN_PATHS = {"/health"}
# the chat page and its assets: served without the API key (the page asks for it and sends it with
# its API calls); the Host guard applies
STATIC_DIR = Path(__file__).with_name("static")
PAGE_FILES = {"chat.js": "text/javascript", "chat.css": "text/css"}
PAGE_PATHS = {"/", "/index.html", *(f"/static/{n}" for n in PAGE_FILES)}
# the page runs only its own script and style and talks only to this server: model output that
# slipped into the DOM as markup still could not run or load anything (images: its own, and the
# data: URLs of the images the user attaches, shown as thumbnails — nothing from elsewhere)
PAGE_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": PAGE_CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    proto = protocol_of(request)
    try:
        return await handler(request)
    except ApiError as e:
        resp = e.response(proto)
        if request.content.exception() is not None:  # a body that cannot be read (bad gzip): do not drain it
            resp.force_close()
        return resp
    except web.HTTPException as e:
        if e.status < 400:
            raise
        if isinstance(e, web.HTTPNotFound):
            return ApiError(404, f"no such endpoint: {request.method} {request.path}").response(proto)
        return from_exception(e).response(proto)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return from_exception(e).response(proto)


def _host_name(host: str) -> str:
    """The name in a Host header, without its port ("[::1]:8080" → "::1")."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return (host.rsplit(":", 1)[0] if host.count(":") == 1 else host).rstrip(".")


def cors_origin(request: web.Request) -> str | None:
    """The request's Origin when --cors-origin allows it (answered with CORS headers)."""
    origin = request.headers.get("Origin")
    if origin is None:
        return None
    allowed = request.app[STATE].cors_origins
    return origin if origin.rstrip("/").lower() in allowed or "*" in allowed else None


def check_origin(request: web.Request) -> None:
    """403 for what a web page elsewhere could send: a Host this server does not answer to (DNS
    rebinding), an Origin that is neither this server nor a --cors-origin."""
    state = request.app[STATE]
    host = request.headers.get("Host")
    if host is not None and not state.any_host and request.path not in OPEN_PATHS:
        name = _host_name(host)
        if name not in state.allowed_hosts and not name.endswith(".localhost"):
            raise ApiError(
                403,
                f"Host {host!r} is not one this server answers to (a DNS-rebinding guard): "
                f"pass --allowed-hosts {name} to allow it",
                code="host_not_allowed",
            )
    origin = request.headers.get("Origin")
    if origin is None or cors_origin(request):
        return
    same = host is not None and origin.lower().split("://", 1)[-1].rstrip("/") == host.lower()
    if not same:
        raise ApiError(
            403,
            f"cross-origin request from {origin!r} refused: pass --cors-origin {origin} to allow "
            "a web page there to call this server",
            code="origin_not_allowed",
        )


def _preflight(request: web.Request) -> web.Response:
    """A CORS preflight from an allowed origin (check_origin has refused any other)."""
    return web.Response(
        status=204,
        headers={
            "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Allow-Headers": request.headers.get(
                "Access-Control-Request-Headers", "authorization, content-type, x-api-key"
            ),
            "Access-Control-Max-Age": "600",
        },
    )


async def _cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    origin = cors_origin(request)
    if origin:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Vary"] = "Origin"


@web.middleware
async def guard_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    state = request.app[STATE]
    check_origin(request)
    if (
        request.method == "OPTIONS"
        and "Access-Control-Request-Method" in request.headers
        and request.headers.get("Origin")
    ):
        if not cors_origin(request):
            raise ApiError(
                403,
                "CORS preflight refused: this server allows no cross-origin callers (--cors-origin)",
                code="origin_not_allowed",
            )
        return _preflight(request)
    if (
        state.api_key
        and request.path not in OPEN_PATHS
        and not (request.method == "GET" and request.path in PAGE_PATHS)
    ):
        given = None
        auth = request.headers.get("Authorization", "")
        if auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        given = given or request.headers.get("x-api-key")
        if given != state.api_key:
            raise ApiError(
                401,
                "missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`"
                if not given
                else "incorrect API key provided",
            )
    if request.content_length is not None and request.content_length > state.max_body:
        raise ApiError(
            413,
            f"request body of {request.content_length} bytes is larger than the limit of "
            f"{state.max_body} bytes (--max-body-bytes)",
        )
    return await handler(request)


async def read_json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object: 415 unless sent as application/json (what a web page elsewhere
    cannot send without a CORS preflight), 400 for anything else, 413 over the limit."""
    ctype = request.content_type
    if ctype != "application/json" and not (ctype.startswith("application/") and ctype.endswith("+json")):
        shown = request.headers.get("Content-Type")
        raise ApiError(
            415,
            f"Content-Type must be application/json, got {shown!r}"
            if shown
            else "Content-Type must be application/json (the header is missing)",
        )
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        state = request.app[STATE]
        raise ApiError(
            413, f"request body is larger than the limit of {state.max_body} bytes (--max-body-bytes)"
        ) from None
    except web.HTTPException as e:
        raise ApiError(
            e.status if 400 <= e.status < 500 else 400, f"request body cannot be read: {e.text or e.reason}"
        ) from None
    except Exception as e:  # a Content-Encoding the body does not have (bad gzip, …)
        raise ApiError(
            400,
            f"request body cannot be read ({request.headers.get('Content-Encoding') or 'identity'} "
            f"encoding): {type(e).__name__}: {e}",
        ) from None
    if not raw.strip():
        raise ApiError(400, "request body is empty: expected a JSON object")
    body = loads_strict(raw)
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


# -- plain endpoints -----------------------------------------------------------------------------
async def health(request: web.Request) -> web.Response:
    """200 while the server can generate; 503 once its engine has stopped or while it shuts down."""
    state = request.app[STATE]
    engine = state.engine()
    status = "shutting_down" if state.closing else "ok" if engine["state"] == "running" else "unavailable"
    return web.json_response(
        {"status": status, "model": state.model_id, "context_tokens": state.context_tokens, "engine": engine},
        status=200 if status == "ok" else 503,
    )


async def page(request: web.Request) -> web.Response:
    """The chat page (docs/chat.md): static files shipped in the package, no CDN."""
    name = request.match_info.get("name", "index.html")
    ctype = "text/html" if name == "index.html" else PAGE_FILES.get(name)
    if ctype is None:
        raise web.HTTPNotFound()
    return web.Response(
        body=(STATIC_DIR / name).read_bytes(), content_type=ctype, charset="utf-8", headers=PAGE_HEADERS
    )


async def stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE].stats_body())


def _model_card(state: ServerState, anthropic: bool, name: str | None = None) -> dict[str, Any]:
    """The card of the served model, under `name` (one of its --alias names) or its own id."""
    mid = name or state.model_id
    if anthropic:
        return {
            "type": "model",
            "id": mid,
            "display_name": mid,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(state.created)),
        }
    return {
        "id": mid,
        "object": "model",
        "created": state.created,
        "owned_by": "mlxrs",
        "context_length": state.context_tokens,
        "input_modalities": ["text"]
        + (["image"] if state.vision else [])
        + (["video"] if state.vision and state.vision.get("video_marker") else [])
        + (["audio"] if state.audio else []),
    }


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    anthropic = "anthropic-version" in request.headers
    ids = [state.model_id, *state.listed_aliases, *state.adapter_ids]
    cards = [_model_card(state, anthropic, i) for i in ids]
    if anthropic:
        return web.json_response({"data": cards, "has_more": False, "first_id": ids[0], "last_id": ids[-1]})
    return web.json_response({"object": "list", "data": cards})


async def model_one(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = request.match_info["model"]
    state.check_model(name)
    listed = name if name in state.listed_aliases or name in state.adapter_ids else None
    return web.json_response(_model_card(state, "anthropic-version" in request.headers, listed))


def build_app(state: ServerState) -> web.Application:
    from . import anthropic, embeddings, openai, responses

    app = web.Application(middlewares=[error_middleware, guard_middleware], client_max_size=state.max_body)
    app[STATE] = state
    app.on_response_prepare.append(_cors_headers)
    r = app.router
    r.add_get("/health", health)
    r.add_get("/", page)
    r.add_get("/index.html", page)
    r.add_get("/static/{name}", page)
    r.add_get("/stats", stats)
    r.add_get("/v1/models", models)
    r.add_get("/v1/models/{model}", model_one)
    openai.setup(r)
    anthropic.setup(r)
    responses.setup(r)
    embeddings.setup(r)
    return app


class _JsonErrorHandler(web_protocol.RequestHandler):
    """aiohttp answers what it cannot parse as HTTP (and a few other protocol errors) itself, in
    plain text: here those answers carry the OpenAI error envelope."""

    def handle_error(
        self, request: Any, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs; raises once a response has started
        text = " ".join((message or "").split()) or "error"
        err = ApiError(status, f"malformed HTTP request: {text}" if status == 400 else text)
        resp = err.response("openai")
        resp.force_close()
        return resp


class _JsonErrorServer(web.Server):
    def __call__(self) -> web_protocol.RequestHandler:
        return _JsonErrorHandler(self, loop=self._loop, **self._kwargs)


class Runner(web.AppRunner):
    """web.AppRunner whose protocol-level errors are JSON envelopes too."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorServer
        return server


# -- helpers -------------------------------------------------------------------------------------
def _generation_defaults(model_dir: Path) -> dict[str, Any]:
    """Sampling defaults the model ships in generation_config.json (temperature, top_p, top_k, min_p),
    read by the tokenizer's reader (crates/mlxrs-core/src/tokenizer.rs)."""
    try:
        g = json.loads(_native.generation_config(str(model_dir)))
    except MlxrsError:
        return {}
    if not isinstance(g, dict):
        return {}
    out: dict[str, Any] = {}
    if g.get("do_sample") is False:
        out["temperature"] = 0.0
    for k in ("temperature", "top_p", "top_k", "min_p"):
        v = g.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in out:
            out[k] = v
    return out


def sse(data: Any, event: str | None = None) -> bytes:
    body = json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\ndata: {body}\n\n" if event else f"data: {body}\n\n").encode()


async def start_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        }
    )
    await resp.prepare(request)
    return resp


# -- the shared event stream ---------------------------------------------------------------------
@dataclass
class Step:
    """What one engine event adds: semantic events, the tokens behind them (for logprobs), and
    the engine's final event on the last step."""

    events: list[Any]
    tokens: list[tuple[int, float | None, list[tuple[int, float]]]]
    done: dict[str, Any] | None = None


async def steps(
    gen: Generation, parser: OutputParser | None, keepalive: float | None = None
) -> AsyncIterator[Step | None]:
    """Engine events → Steps (None on keepalive ticks). Without a parser, text is content as is."""
    from .events import Content

    async for ev in gen.events(keepalive):
        if ev is None:
            yield None
            continue
        t = ev["type"]
        if t == "token":
            text = ev["text"]
            evs = (parser.feed(text) if parser else [Content(text)]) if text else []
            tok = [(ev["id"], ev["logprob"], list(ev["top"]))] if ev["id"] >= 0 else []
            if evs or tok:
                yield Step(evs, tok)
        elif t == "done":
            yield Step(parser.finish() if parser else [], [], ev)


class TokenText:
    """Token id → its text (for logprobs), memoised."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.cache: dict[int, str] = {}

    def __call__(self, tid: int) -> str:
        s = self.cache.get(tid)
        if s is None:
            s = self.cache[tid] = self.state.session.detokenize([tid])
        return s
