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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlxrs", description="Local LLM inference over MLX with a Rust core.")
    p.add_argument("--version", action="store_true", help="print mlxrs, MLX and mlx-c versions, backend and library paths")
    sub = p.add_subparsers(dest="command")
    info = sub.add_parser("info", help="print runtime information and run a tiny computation")
    info.set_defaults(func=_cmd_info)
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
