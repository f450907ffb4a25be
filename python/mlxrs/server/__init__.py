"""`python -m mlxrs serve`: an OpenAI- and Anthropic-compatible HTTP server over one model.

See docs/server-api.md (endpoints, errors) and docs/server-config.md (flags, memory admission).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("mlxrs.server")


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "::", "*") else host


def probe_v1(host: str, port: int, api_key: str | None = None, timeout: float = 3.0) -> tuple[bool, bool, str | None]:
    """(something listens on `port`, it answers `/v1` as an OpenAI-compatible server, its model
    names or None). An mlxrs server that wants a key it was not given is named from /health."""
    h = _connect_host(host)
    try:
        with socket.create_connection((h, port), timeout=timeout):
            pass
    except OSError:
        return False, False, None
    model = None
    answers_v1 = False
    try:
        conn = http.client.HTTPConnection(h, port, timeout=timeout)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        conn.request("GET", "/v1/models", headers=headers)
        r = conn.getresponse()
        body = r.read(1 << 20)
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        if isinstance(data, dict):
            if r.status == 200 and isinstance(data.get("data"), list):
                answers_v1 = True
                ids = [m.get("id") for m in data["data"] if isinstance(m, dict) and m.get("id")]
                model = ", ".join(str(i) for i in ids) or None
            elif r.status in (401, 403) and "error" in data:
                answers_v1 = True
        conn.close()
        if answers_v1 and model is None:  # mlxrs answers /health without a key
            conn = http.client.HTTPConnection(h, port, timeout=timeout)
            conn.request("GET", "/health")
            r = conn.getresponse()
            try:
                health = json.loads(r.read(1 << 16))
                model = health.get("model") if isinstance(health, dict) else None
            except ValueError:
                pass
            conn.close()
    except (OSError, http.client.HTTPException):
        pass
    return True, answers_v1, model


def probe_port(host: str, port: int, api_key: str | None = None, timeout: float = 3.0) -> str | None:
    """Why `port` cannot be served, or None when nothing listens there.

    Something that answers `/v1` (an OpenAI-compatible server: /v1/models, or its error envelope)
    is named by its model; anything else is "held by another program"."""
    listening, answers_v1, model = probe_v1(host, port, api_key, timeout)
    if not listening:
        return None  # nothing listens (bind problems are reported when binding)
    if answers_v1:
        name = model or "a model (its API key is required to say which)"
        return f"port {port} is already serving {name} — reuse it, stop it, or pass --port <other>"
    return (
        f"port {port} is held by another program (it does not answer /v1 as an OpenAI-compatible server) "
        "— stop it, or pass --port <other>"
    )


def _api_key(flag: str | None) -> tuple[str | None, str | None]:
    """(the API key or None, why it is refused): an empty key would silently turn auth off."""
    key, source = (flag, "--api-key") if flag is not None else (os.environ.get("MLXRS_API_KEY"), "MLXRS_API_KEY")
    if key is not None and not key.strip():
        return None, (
            f"{source} is empty: give a non-empty key, or leave it out to serve without one (loopback only is advised)"
        )
    return key, None


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host.lower() == "localhost"


def _model_label(model: str | None) -> tuple[str, str]:
    """(first output line, model id) for MODEL."""
    if model is None:
        from ..models import DEFAULT_MODEL_NAME

        return (f"mlxrs serve: {DEFAULT_MODEL_NAME} — the embedded default (no MODEL given)", "gemma-3-270m")
    p = Path(model)
    mid = p.stem if p.suffix.lower() == ".gguf" else (p.name or str(model))
    return f"mlxrs serve: {mid} ({p.resolve() if p.exists() else model})", mid


def _chat_template(arg: str | None) -> str | Path | None:
    """--chat-template: a file, else the name of a template mlxrs ships; None when it is neither."""
    from ..session import TEMPLATE_NAMES

    if arg is None or Path(arg).is_file():
        return Path(arg) if arg else None
    return arg if arg in TEMPLATE_NAMES else None


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("aiohttp.access").setLevel(
        logging.INFO if str(args.log_level).lower() == "debug" else logging.WARNING
    )
    api_key, why = _api_key(args.api_key)
    if why:
        print(f"error: {why}", file=sys.stderr, flush=True)
        return 2
    if args.shutdown_timeout < 0:
        print("error: --shutdown-timeout must be >= 0", file=sys.stderr, flush=True)
        return 2
    if args.max_tokens < 1:
        print("error: --max-tokens must be >= 1", file=sys.stderr, flush=True)
        return 2
    try:
        from ..video import decode_seconds

        decode_seconds()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    if args.chat_template is not None and _chat_template(args.chat_template) is None:
        from ..session import TEMPLATE_NAMES

        print(
            f"error: --chat-template {args.chat_template}: no such file (nor one of the names "
            f"{', '.join(TEMPLATE_NAMES)})",
            file=sys.stderr,
            flush=True,
        )
        return 2
    first, model_id = _model_label(args.model)
    print(first, flush=True)
    why = probe_port(args.host, args.port, api_key)
    if why:
        print(why, file=sys.stderr, flush=True)
        return 1

    from ..errors import MlxrsError
    from .app import build_app

    try:
        state = make_state(args, api_key, model_id)
    except MlxrsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    session = state.session
    _report_plan(state)
    if not is_loopback(args.host) and not api_key:
        log.warning(
            "*** listening on %s without an API key: anyone who can reach this address can use the "
            "model. Pass --api-key (or MLXRS_API_KEY) unless this network is trusted. ***",
            args.host,
        )
        if not state.any_host:
            log.warning(
                "without an API key only these Host names are answered: %s (--allowed-hosts to add the "
                "names clients use, or '*')",
                ", ".join(sorted(state.allowed_hosts)),
            )
    try:
        return asyncio.run(_serve(state, build_app(state), args.host, args.port))
    finally:
        state.executor.shutdown(wait=False, cancel_futures=True)
        session.close()


def make_state(args: argparse.Namespace, api_key: str | None, model_id: str) -> Any:
    """Load MODEL (args.model) under its memory plan: the ServerState the app serves (raises MlxrsError)."""
    from .. import _native
    from ..fit import adapter_bytes
    from ..models import resolve_model
    from ..session import Session
    from .app import ServerState

    model_dir = resolve_model(args.model)
    # the planner reads config.json and the safetensors headers only: a bad --memory-budget
    # is reported before any weight is loaded
    stream = bool(getattr(args, "stream_experts", False))
    expert_cache = getattr(args, "expert_cache_bytes", None)
    adapters = adapter_args(getattr(args, "adapter", None) or [])
    # the adapters' tensors are resident beside the weights: the plan counts them (fit.adapter_bytes)
    plan = json.loads(
        _native.plan(
            str(model_dir),
            None,
            args.kv_quant,
            args.memory_budget,
            stream_experts=stream or expert_cache is not None,
            expert_cache_bytes=expert_cache,
            expert_prefetch=_expert_prefetch(args),
            adapter_bytes=adapter_bytes(list(adapters.values())),
        )
    )
    # a MoE model whose weights exceed the budget is planned (and served) with its experts
    # streamed from the files into an expert cache of the plan's size
    streamed = plan["strategy"] == "streamed-experts"
    # the KV every running sequence may reserve: what the plan leaves beside the weights, the
    # reserve and one prefill's transient; the prompt cache may use half of it by default and
    # gives way when sequences need the room
    kv_budget = max(
        0,
        int(plan["usableBytes"]) - int(plan["weightsBytes"]) - int(plan["reserveBytes"]) - int(plan["transientBytes"]),
    )
    cache_bytes = args.prompt_cache_bytes if args.prompt_cache_bytes is not None else kv_budget // 2
    # MLX's allocator works under the plan's limit (the budget less the reserve) from the load on
    _native.set_memory_limit(int(plan["allocatorLimitBytes"]))
    session = Session(
        model_dir,
        kv_bits=args.kv_quant,
        max_concurrency=args.max_concurrency,
        max_queue=args.max_queue,
        prefill_batch_tokens=args.prefill_batch_tokens,
        prompt_cache_bytes=cache_bytes,
        kv_budget_bytes=kv_budget,
        stream_experts=streamed,
        expert_cache_bytes=int(plan["expertCacheBytes"]) if streamed else None,
        expert_prefetch=_expert_prefetch(args) if streamed else None,
        chat_template=_chat_template(args.chat_template),
        adapters=adapters or None,
    )
    dev_bytes, dev_source = _native.device_memory()
    budget_source = (
        f"--memory-budget {args.memory_budget}"
        if args.memory_budget is not None
        else f"0.75 × device memory ({dev_bytes} bytes, {dev_source})"
    )
    aliases = [model_id, str(args.model or ""), session.model_path, Path(session.model_path).name]
    return ServerState(
        session,
        model_id=model_id,
        aliases=aliases,
        plan=plan,
        kv_bits=args.kv_quant,
        api_key=api_key,
        max_body=args.max_body_bytes,
        budget_source=budget_source,
        host=args.host,
        allowed_hosts=[h for h in args.allowed_hosts.split(",") if h.strip()],
        cors_origins=args.cors_origin,
        shutdown_timeout=args.shutdown_timeout,
        listed_aliases=args.alias,
        strict_names=args.strict_model_names,
        default_max_tokens=args.max_tokens,
        media_policy=_media_policy(args),
    )


def adapter_args(values: list[str]) -> dict[str, str]:
    """`--adapter PATH` / `--adapter NAME=PATH` (repeatable) as `{name: path}`; an unnamed adapter
    is named after its directory. Raises InvalidArgumentError on a repeated name."""
    from ..errors import InvalidArgumentError

    out: dict[str, str] = {}
    for v in values:
        name, sep, path = v.partition("=")
        if not sep or not name or os.path.sep in name:
            name, path = os.path.basename(os.path.normpath(v)) or "adapter", v
        if name in out:
            raise InvalidArgumentError(f"--adapter: two adapters are named {name!r} (name them: --adapter NAME=PATH)")
        out[name] = path
    return out


def _expert_prefetch(args: Any) -> bool | None:
    """`--expert-prefetch on|off` (None: the default)."""
    v = getattr(args, "expert_prefetch", None)
    return None if v is None else v == "on"


def _media_policy(args: Any) -> Any:
    """Where images may come from, from the serve flags (defaults when a caller's args lack them)."""
    from ..media import DEFAULT_FETCH_TIMEOUT, DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS, MediaPolicy

    return MediaPolicy(
        allow_local=bool(getattr(args, "allow_local_media", False)),
        allow_remote=bool(getattr(args, "allow_remote_media", False)),
        max_bytes=int(getattr(args, "max_image_bytes", DEFAULT_MAX_IMAGE_BYTES)),
        max_pixels=int(getattr(args, "max_image_pixels", DEFAULT_MAX_IMAGE_PIXELS)),
        timeout=float(getattr(args, "media_fetch_timeout", DEFAULT_FETCH_TIMEOUT)),
    )


def _report_plan(state: Any) -> None:
    p = state.plan
    gib = 1 << 30
    log.info(
        "memory plan: weights %.2f GiB, budget %.2f GiB (%s), context ceiling %d tokens%s",
        p["weightsBytes"] / gib,
        p["usableBytes"] / gib,
        state.budget_source,
        state.context_tokens,
        f" (model context {state.model_context})" if state.model_context else "",
    )
    if p["strategy"] == "streamed-experts":
        log.info(
            "experts streamed from the safetensors files (%.2f GiB), expert cache %.2f GiB (%.0f%% of them); "
            "predicted %.1f MiB read per token at uniform routing",
            p["streamedExpertBytes"] / gib,
            p["expertCacheBytes"] / gib,
            100 * p["expertCacheFraction"],
            p["predictedExpertBytesPerToken"] / (1 << 20),
        )
    if p["maxSafeContext"] == 0:
        log.warning(
            "the memory budget (%d bytes) does not hold the weights (%d bytes) plus the reserve and one "
            "token of context: serving anyway, and every request will get 400 context_over_budget — "
            "raise --memory-budget or use a smaller model",
            p["usableBytes"],
            p["weightsBytes"],
        )
    elif not p["fits"]:
        log.warning(
            "the model's full context (%d tokens) does not fit the memory budget: serving with a ceiling of "
            "%d tokens (prompts beyond it get 400 context_over_budget; max_tokens is clamped to the room "
            "left)",
            p["contextTokens"],
            state.context_tokens,
        )


async def _serve(state: Any, app: Any, host: str, port: int) -> int:
    from aiohttp import web

    from .app import Runner

    # after the shutdown timeout (ServerState.end_generations) handlers need only write their last
    # event: a short wait for them
    runner = Runner(
        app, handler_cancellation=True, access_log=logging.getLogger("aiohttp.access"), shutdown_timeout=2.0
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as e:
        print(
            f"port {port} cannot be opened on {host}: {e.strerror or e} — pass --port <other>",
            file=sys.stderr,
            flush=True,
        )
        await runner.cleanup()
        return 1
    shown = f"[{host}]" if ":" in host else host
    print(
        f"listening on http://{shown}:{port} — OpenAI /v1/chat/completions, /v1/completions, /v1/responses, /v1/embeddings; "
        f"Anthropic /v1/messages; context ceiling {state.context_tokens} tokens",
        flush=True,
    )
    stop, hurry = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        (hurry if stop.is_set() else stop).set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal)
        except (NotImplementedError, RuntimeError):
            pass
    await stop.wait()
    await shutdown(state, runner, hurry)
    return 0


async def shutdown(state: Any, runner: Any, hurry: asyncio.Event) -> None:
    """Stop accepting; queued requests answer 503; running generations get --shutdown-timeout
    seconds to finish (a second signal cuts it short) and are then ended with a final event."""
    state.closing = True
    for site in list(runner.sites):
        await site.stop()
    queued = state.end_generations(running=False)
    running = len(state.generations) - queued
    log.info(
        "shutting down: %d queued request(s) answered 503; %d running generation(s) get up to %g s",
        queued,
        max(0, running),
        state.shutdown_timeout,
    )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + state.shutdown_timeout
    while state.generations and loop.time() < deadline and not hurry.is_set():
        await asyncio.sleep(0.05)
    cut = state.end_generations(running=True)
    if cut:
        log.warning('shutdown timeout: %d generation(s) ended early (finish_reason "length")', cut)
    await runner.cleanup()
