"""`python -m mlxrs ...`: the command line."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path


def _version_text() -> str:
    import mlxrs

    try:
        info = mlxrs.runtime_info()
    except mlxrs.errors.MlxrsError as e:
        return f"mlxrs {mlxrs.__version__}\nnative runtime: not loaded\n{e}"
    lines = [
        f"mlxrs {info['mlxrs_version']}",
        f"MLX {info['mlx_version']}, mlx-c {info['mlxc_version']}",
        f"backend: {info['backend']} (device {info['device']})",
        f"libmlxc: {info['libmlxc']} (from {info['source']})",
        f"libmlx: {info['libmlx'] or 'resolved by the dynamic linker'}",
    ]
    if info["backend"] == "cpu":
        if info["mlx_loaded_first"]:
            lines.append("BLAS: reference (as linked by MLX: mlx.core was imported before mlxrs)")
        else:
            lines.append(f"BLAS: {info['blas'] or 'reference (as linked by MLX)'}")
        if info["blas_gemv"]:
            lines.append(f"gemv router: {info['blas_gemv']}")
    return "\n".join(lines)


def _cmd_info(_args: argparse.Namespace) -> int:
    import mlxrs
    from mlxrs import _native

    print(_version_text())
    print(f"tiny computation: [[0,1,2],[3,4,5]] @ ones(3,2) = {_native._tiny_matmul()}")
    info = mlxrs.runtime_info()
    print(f"active memory: {info['active_memory']} bytes, peak {info['peak_memory']} bytes")
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from mlxrs.models import convert_gguf

    out = convert_gguf(args.model, args.out_dir, dtype=args.dtype, progress=False if args.quiet else None)
    print(f"wrote {out} ({args.dtype})")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from mlxrs.server import run

    return run(args)


def _bytes_arg(s: str) -> int:
    """'2G', '512M', '1048576' → bytes."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    v = s.strip().upper().removesuffix("B").removesuffix("I")
    num, unit = (v[:-1], v[-1]) if v and v[-1] in units else (v, "")
    try:
        n = int(float(num) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count: {s!r} (e.g. 2G, 512M, 1048576)") from None
    if n < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return n


def _add_serve(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    sp = sub.add_parser(
        "serve",
        help="serve a model over HTTP (OpenAI- and Anthropic-compatible)",
        description="Serve MODEL over HTTP: OpenAI /v1/chat/completions, /v1/completions, "
        "/v1/models; Anthropic /v1/messages; /health and /stats. "
        "See docs/server-config.md.",
    )
    sp.add_argument(
        "model",
        nargs="?",
        default=None,
        help="model directory, .gguf file, or registry name / unique substring (see `scan`; "
        "default: the embedded Gemma 3 270M)",
    )
    sp.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    sp.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    sp.add_argument(
        "--api-key",
        default=None,
        help="require this key (Authorization: Bearer KEY or x-api-key: KEY); also MLXRS_API_KEY; must not be empty",
    )
    sp.add_argument(
        "--allowed-hosts",
        default="",
        metavar="NAME[,NAME…]",
        help="Host names the server answers to besides localhost and the --host address "
        "(a DNS-rebinding guard; '*' turns the check off)",
    )
    sp.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a web origin (e.g. http://localhost:3000; '*' for any) whose pages may call the "
        "server; repeatable; default: none",
    )
    sp.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, how long running generations may continue before they are ended (default 10)",
    )
    sp.add_argument(
        "--kv-quant",
        type=int,
        choices=[4, 8],
        default=None,
        help="quantize the KV cache to 4 or 8 bits (a longer context in the same memory)",
    )
    sp.add_argument(
        "--memory-budget",
        default=None,
        metavar="BYTES|FRACTION",
        help="memory the model may use: bytes (e.g. 12G, 8000000000) or a fraction of device "
        "memory in (0, 1]; default 0.75",
    )
    sp.add_argument(
        "--stream-experts",
        action="store_true",
        help="a mixture-of-experts model keeps its experts in the safetensors files and reads the "
        "routed ones per step into an expert cache (automatic when the weights exceed "
        "--memory-budget); see docs/design/paged-experts.md",
    )
    sp.add_argument(
        "--expert-cache-bytes",
        type=_bytes_arg,
        default=None,
        metavar="BYTES",
        help="the streamed experts' cache, e.g. 4G; implies --stream-experts (default: what the memory plan leaves)",
    )
    sp.add_argument(
        "--expert-prefetch",
        choices=["on", "off"],
        default=None,
        help="streamed experts: while a MoE layer computes, read the experts the next layer's router "
        "picks for this layer's input (default: on)",
    )
    sp.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="[NAME=]PATH",
        help="a LoRA/DoRA adapter directory in mlx-lm's format (repeatable). One is fused into the "
        "weights and serves every request; several are kept beside the base and a request picks one "
        "by its model name, MODEL:NAME or NAME (any other name: the base model)",
    )
    sp.add_argument(
        "--max-concurrency", type=int, default=32, help="generations decoded together in one batch at most (default 32)"
    )
    sp.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="requests that may wait beyond those before new ones get 429 (default 64)",
    )
    sp.add_argument(
        "--prefill-batch-tokens",
        type=int,
        default=None,
        metavar="N",
        help="prompt tokens one batched prefill step may run over all the prompts it covers (several "
        "waiting prompts' chunks in one forward pass; 0: one prompt at a time; default: the prefill "
        "step, 2048, which the memory plan's transient covers)",
    )
    sp.add_argument(
        "--prompt-cache-bytes",
        type=_bytes_arg,
        default=None,
        metavar="BYTES",
        help="memory for the prompt-prefix cache, e.g. 2G (0: off; default: half of the KV memory the plan leaves)",
    )
    sp.add_argument(
        "--max-body-bytes",
        type=int,
        default=32 << 20,
        help="largest request body accepted, larger ones get 413 (default 32 MiB)",
    )
    sp.add_argument(
        "--alias",
        action="append",
        default=[],
        metavar="NAME",
        help="another name for the model, listed in /v1/models; repeatable (any name is answered "
        "unless --strict-model-names)",
    )
    sp.add_argument(
        "--strict-model-names",
        action="store_true",
        help="answer 404 model_not_found for a model name that is neither the model's nor an --alias",
    )
    sp.add_argument(
        "--max-tokens",
        type=int,
        default=4096,
        metavar="N",
        help="max_tokens of a chat request that sets none (default 4096, or the context left if smaller)",
    )
    sp.add_argument(
        "--allow-local-media",
        action="store_true",
        help="let requests name images by local file path (file:// or a path); off by default",
    )
    sp.add_argument(
        "--allow-remote-media",
        action="store_true",
        help="fetch http(s) image URLs named in requests (size and time limited); off by default",
    )
    sp.add_argument(
        "--max-image-bytes",
        type=_bytes_arg,
        default=20 << 20,
        metavar="BYTES",
        help="largest encoded image accepted (default 20M)",
    )
    sp.add_argument(
        "--max-image-pixels",
        type=int,
        default=50_000_000,
        metavar="N",
        help="most pixels (width x height, read from the header before decoding) an image may have (default 50000000)",
    )
    sp.add_argument(
        "--media-fetch-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="time limit of one remote image fetch (default 10)",
    )
    sp.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|NAME",
        help="a Jinja chat template file used instead of the model's own, or the name of one "
        "mlxrs ships: chatml, gemma",
    )
    sp.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log verbosity on stderr (debug adds an access log)",
    )
    sp.set_defaults(func=_cmd_serve)


def _cmd_scan(args: argparse.Namespace) -> int:
    import json

    from mlxrs import registry

    res = registry.scan()
    if args.json:
        print(
            json.dumps(
                {
                    "roots": res.roots,
                    "models": [e.to_json() for e in res.entries],
                    "skipped": [{"path": p, "why": w} for p, w in res.skipped],
                },
                indent=2,
            )
        )
        return 0
    ok = sum(e.supported for e in res.entries)
    print(f"scanned {', '.join(res.roots)}")
    print(f"{len(res.entries)} models ({ok} loadable by mlxrs), registry {registry.db_path()}")
    for p, why in res.skipped:
        print(f"skipped {p}: {why}")
    if res.entries:
        print(registry.format_entries(sorted(res.entries, key=lambda e: (e.name.lower(), e.revision or ""))))
    return 0


def _cmd_ls(args: argparse.Namespace) -> int:
    import json

    from mlxrs import registry

    pool = registry.entries()
    es = registry.match(args.pattern, pool) if args.pattern else pool
    if args.json:
        print(json.dumps([e.to_json() for e in es], indent=2))
        return 0 if es or not args.pattern else 1
    if not es:
        what = f"{args.pattern!r}: no models match" if args.pattern else "the registry is empty:"
        print(f"{what} {registry.SCAN_HINT}", file=sys.stderr)
        return 1 if args.pattern else 0
    print(registry.format_entries(es))
    stale = [e for e in es if e.stale]
    if stale:
        print(
            f"{len(stale)} stale {'entry' if len(stale) == 1 else 'entries'} (files gone): "
            f"{', '.join(e.name for e in stale)} — run `mlxrs scan` to drop them"
        )
    return 0


def _fit_target(model: str | None) -> tuple["Path", str]:
    """What `fit` plans for MODEL: a directory or .gguf file as given (a .gguf is planned as its bf16
    import, from its header), a registry name, or the embedded default."""
    from pathlib import Path

    from mlxrs import registry
    from mlxrs.errors import ModelLoadError
    from mlxrs.models import resolve_model

    if model is None:
        return resolve_model(None), "the embedded default"
    p = Path(model)
    if p.exists():
        return p, str(model)
    if registry.looks_like_name(model):
        found = registry.resolve_name(model)
        return found, f"{model} → {found}"
    raise ModelLoadError(f"{model} does not exist")


def _cmd_fit(args: argparse.Namespace) -> int:
    import json

    from mlxrs import fit

    path, label = _fit_target(args.model)
    if args.skus:
        plans = fit.sku_plans(path, args.ctx, args.kv_quant, args.memory_budget)
        print(json.dumps(plans, indent=2) if args.json else fit.describe_skus(label, plans))
        return 0
    from mlxrs.server import adapter_args

    p = fit.plan(
        path,
        args.ctx,
        args.kv_quant,
        args.memory_budget,
        stream_experts=args.stream_experts or args.expert_cache_bytes is not None,
        expert_cache_bytes=args.expert_cache_bytes,
        expert_prefetch=None if args.expert_prefetch is None else args.expert_prefetch == "on",
        adapters=list(adapter_args(args.adapter).values()),
    )
    print(json.dumps(p, indent=2) if args.json else fit.describe(path, label, p, args.kv_quant, args.memory_budget))
    return 0


def _add_registry(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    sc = sub.add_parser(
        "scan",
        help="record the models in the Hugging Face cache and MLXRS_MODEL_DIRS",
        description="Walk the Hugging Face hub cache (HF_HUB_CACHE, else HF_HOME/hub, else "
        "~/.cache/huggingface/hub) and the directories of MLXRS_MODEL_DIRS, and record "
        "every model found in the registry ($MLXRS_HOME/registry.sqlite).",
    )
    sc.add_argument("--json", action="store_true", help="print what was found as JSON")
    sc.set_defaults(func=_cmd_scan)
    ls = sub.add_parser("ls", help="list the registered models (see `scan`)")
    ls.add_argument(
        "pattern", nargs="?", default=None, help="a name, ORG/REPO[@REVISION], substring or glob to filter by"
    )
    ls.add_argument("--json", action="store_true", help="print the entries as JSON")
    ls.set_defaults(func=_cmd_ls)
    ft = sub.add_parser(
        "fit",
        help="will MODEL and a context fit the memory budget?",
        description="Plan the memory of MODEL (directory, .gguf file or registry name) from its "
        "config and safetensors headers, without loading it: weights, KV cache, prefill "
        "transient, reserve, the budget and the largest context that fits.",
    )
    ft.add_argument(
        "model",
        nargs="?",
        default=None,
        help="model directory, .gguf file, or registry name / unique substring (default: the embedded Gemma 3 270M)",
    )
    ft.add_argument(
        "--ctx", type=int, default=None, metavar="N", help="context tokens to evaluate (default: the model's maximum)"
    )
    ft.add_argument("--kv-quant", type=int, choices=[4, 8], default=None, help="plan a 4- or 8-bit KV cache")
    ft.add_argument(
        "--memory-budget",
        default=None,
        metavar="BYTES|FRACTION",
        help="bytes (e.g. 12G) or a fraction of device memory in (0, 1]; default 0.75",
    )
    ft.add_argument(
        "--stream-experts",
        action="store_true",
        help="plan a mixture-of-experts model with its experts streamed from disk (automatic when it does not fit)",
    )
    ft.add_argument(
        "--expert-cache-bytes",
        type=_bytes_arg,
        default=None,
        metavar="BYTES",
        help="the streamed experts' cache to plan, implies --stream-experts (default: what the budget leaves)",
    )
    ft.add_argument(
        "--expert-prefetch",
        choices=["on", "off"],
        default=None,
        help="plan streamed experts read ahead (the next layer's beside one step's; default: on)",
    )
    ft.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="[NAME=]PATH",
        help="a LoRA adapter directory to be served with the model (repeatable): its tensors count as weights",
    )
    ft.add_argument(
        "--skus",
        action="store_true",
        help="evaluate the Apple Silicon lineup and common NVIDIA GPUs instead of this machine",
    )
    ft.add_argument("--json", action="store_true", help="print the MemoryPlan (schemaVersion 1) as JSON")
    ft.set_defaults(func=_cmd_fit)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlxrs", description="Local LLM inference over MLX with a Rust core.")
    p.add_argument(
        "--version", action="store_true", help="print mlxrs, MLX and mlx-c versions, backend and library paths"
    )
    sub = p.add_subparsers(dest="command")
    info = sub.add_parser("info", help="print runtime information and run a tiny computation")
    info.set_defaults(func=_cmd_info)
    _add_serve(sub)
    from mlxrs import chat, hub, native_pack

    chat.add_parser(sub)  # chat

    hub.add_parser(sub)  # get
    native_pack.add_parser(sub)  # native
    conv = sub.add_parser("convert", help="import a GGUF file (llama.cpp) into a model directory")
    conv.add_argument("model", help="path to a .gguf file")
    conv.add_argument("out_dir", help="output directory (must not exist or be empty)")
    conv.add_argument(
        "--dtype",
        default="bf16",
        choices=["bf16", "f16", "f32", "q8", "q4"],
        help="weights dtype: bf16 (default), f16, f32, or MLX affine q8/q4 (group 64)",
    )
    conv.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no progress bar (drawn only when stderr is a terminal, or with MLXRS_PROGRESS=1)",
    )
    conv.set_defaults(func=_cmd_convert)
    _add_registry(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        print(_version_text())
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # one clear line for mlxrs errors, never a traceback to the user
        from mlxrs.errors import MlxrsError

        if isinstance(e, MlxrsError):
            print(f"error: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    raise SystemExit(main())
