"""Tell the Rust resolver where the pip `mlx` package keeps libmlx before anything loads."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def mlx_lib_dir() -> Path | None:
    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        return None
    for base in spec.submodule_search_locations:
        d = Path(base) / "lib"
        if d.is_dir():
            return d
    return None


def register(native) -> None:  # type: ignore[no-untyped-def]
    d = mlx_lib_dir()
    if d is not None:
        native._register_mlx_lib_dir(str(d))
