"""Type stubs for `mlxrs._native`, the PyO3 extension built from crates/mlxrs-py.

Checked against the built module by tests/test_stubs.py (`python -m mypy.stubtest mlxrs._native`):
every name the module exports must be declared here with its real signature. Add new exports in
the section they belong to (module constants, runtime, test hooks, classes at the end) and to
`__all__` (PyO3 lists every added function and class there, private ones included).
"""

import os
from collections.abc import Sequence
from typing import Final, TypedDict, type_check_only

__all__ = [
    "__version__",
    "BUILT_FOR_MLX",
    "BUILT_FOR_MLXC",
    "runtime_info",
    "_register_mlx_lib_dir",
    "_resolution_order",
    "_array_roundtrip",
    "_op",
]

# ---- module constants -------------------------------------------------------------------------

__version__: Final[str]
"""mlxrs's version (the Cargo workspace version)."""
BUILT_FOR_MLX: Final[str]
"""The MLX release (pip `mlx` version) this build expects, e.g. "0.30.6"."""
BUILT_FOR_MLXC: Final[str]
"""The mlx-c release this build was written against, e.g. "0.5.0"."""

# ---- runtime ----------------------------------------------------------------------------------

@type_check_only
class _RuntimeInfo(TypedDict):
    mlxrs_version: str
    mlx_version: str
    mlxc_version: str
    backend: str  # "cpu" | "cuda" | "metal"
    device: str  # "cpu" | "gpu"
    source: str  # "MLXRS_LIBMLXC" | "sidecar" | "native-pack cache" | "homebrew"
    libmlxc: str
    libmlx: str | None
    blas: str | None
    memory_size: int | None
    active_memory: int
    peak_memory: int

def runtime_info() -> _RuntimeInfo:
    """Load the native runtime if needed and describe it. Raises mlxrs.errors.NativeRuntimeError
    when libmlxc cannot be found, opened or does not match this build."""

def _register_mlx_lib_dir(dir: str | os.PathLike[str]) -> None:
    """Tell the resolver about a directory that may hold libmlx (before the first load)."""

def _resolution_order() -> list[str]:
    """Where the resolver finds libmlxc ("<source>: <path>"), or its explanation of every place it tried."""

# ---- test hooks: raw arrays as (bytes, shape, MLX dtype name) ---------------------------------

_RawArray = tuple[bytes, list[int], str]
_RawArrayIn = tuple[bytes, Sequence[int], str]

def _array_roundtrip(data: bytes, shape: Sequence[int], dtype: str) -> _RawArray:
    """Copy a buffer into an MLX array and back out."""

def _op(name: str, inputs: Sequence[_RawArrayIn], params: str = "{}") -> list[_RawArray]:
    """Run one op of the core's surface by name (see crates/mlxrs-core/src/handle/dispatch.rs);
    `params` is a JSON object."""

# ---- classes ----------------------------------------------------------------------------------
