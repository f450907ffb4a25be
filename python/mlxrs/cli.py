"""`python -m mlxrs ...`: the command line."""
from __future__ import annotations

import argparse
import sys


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
        lines.append(f"BLAS: {info['blas'] or 'reference (as linked by MLX)'}")
    return "\n".join(lines)


def _cmd_info(_args: argparse.Namespace) -> int:
    import numpy as np

    import mlxrs
    from mlxrs import _arrays

    print(_version_text())
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.ones((3, 2), dtype=np.float32)
    out = _arrays.op("matmul", a, b)[0]
    print(f"tiny computation: [[0,1,2],[3,4,5]] @ ones(3,2) = {out.tolist()}")
    info = mlxrs.runtime_info()
    print(f"active memory: {info['active_memory']} bytes, peak {info['peak_memory']} bytes")
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from mlxrs.models import convert_gguf

    out = convert_gguf(args.model, args.out_dir, dtype=args.dtype, progress=not args.quiet)
    print(f"wrote {out} ({args.dtype})")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from mlxrs.server import run

    return run(args)


def _add_serve(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    sp = sub.add_parser("serve", help="serve a model over HTTP (OpenAI- and Anthropic-compatible)",
                        description="Serve MODEL over HTTP: OpenAI /v1/chat/completions, /v1/completions, "
                                    "/v1/models; Anthropic /v1/messages; /health and /stats. "
                                    "See docs/server-config.md.")
    sp.add_argument("model", nargs="?", default=None,
                    help="model directory or .gguf file (default: the embedded Gemma 3 270M)")
    sp.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    sp.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    sp.add_argument("--api-key", default=None,
                    help="require this key (Authorization: Bearer KEY or x-api-key: KEY); also MLXRS_API_KEY")
    sp.add_argument("--kv-quant", type=int, choices=[4, 8], default=None,
                    help="quantize the KV cache to 4 or 8 bits (a longer context in the same memory)")
    sp.add_argument("--memory-budget", default=None, metavar="BYTES|FRACTION",
                    help="memory the model may use: bytes (e.g. 12G, 8000000000) or a fraction of device "
                         "memory in (0, 1]; default 0.75")
    sp.add_argument("--max-queue", type=int, default=32,
                    help="requests that may wait for the engine before new ones get 429 (default 32)")
    sp.add_argument("--max-body-bytes", type=int, default=32 << 20,
                    help="largest request body accepted, larger ones get 413 (default 32 MiB)")
    sp.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                    help="log verbosity on stderr (debug adds an access log)")
    sp.set_defaults(func=_cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlxrs", description="Local LLM inference over MLX with a Rust core.")
    p.add_argument("--version", action="store_true", help="print mlxrs, MLX and mlx-c versions, backend and library paths")
    sub = p.add_subparsers(dest="command")
    info = sub.add_parser("info", help="print runtime information and run a tiny computation")
    info.set_defaults(func=_cmd_info)
    _add_serve(sub)
    from mlxrs import hub, native_pack

    hub.add_parser(sub)  # get
    native_pack.add_parser(sub)  # native
    conv = sub.add_parser("convert", help="import a GGUF file (llama.cpp) into a model directory")
    conv.add_argument("model", help="path to a .gguf file")
    conv.add_argument("out_dir", help="output directory (must not exist or be empty)")
    conv.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32", "q8", "q4"],
                      help="weights dtype: bf16 (default), f16, f32, or MLX affine q8/q4 (group 64)")
    conv.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    conv.set_defaults(func=_cmd_convert)
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
