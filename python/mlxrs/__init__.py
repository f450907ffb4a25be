"""mlxrs: local LLM inference over MLX with a Rust core.

>>> import mlxrs
>>> info = mlxrs.runtime_info()
>>> info["backend"] in ("cpu", "cuda", "metal")
True
"""

from __future__ import annotations

import warnings
from typing import Any

from . import _loader, errors
from . import _native

_loader.register(_native)
# the BLAS into the process ahead of libmlx, so that an `import mlx.core` after this one binds MLX's
# CPU matrix products to it as mlxrs's own load does (Linux CPU; nothing elsewhere)
if _native._preload_blas():
    warnings.warn(
        "mlx.core was imported before mlxrs: MLX's CPU matrix products run on MLX's bundled reference "
        "BLAS in this process, not the optimized one mlxrs loads (slower; float32 results can differ in "
        "the last bits). Import mlxrs first.",
        RuntimeWarning,
        stacklevel=2,
    )

__version__: str = _native.__version__

from .session import Chunk, Completion, Session, Timings, Usage  # noqa: E402


def runtime_info() -> dict[str, Any]:
    """Load the native runtime if needed and describe it: versions, backend, device, where each
    native library came from, the BLAS in use (Linux CPU) and memory figures. When nothing is found
    before the native-pack cache and a pack source is known (`MLXRS_NATIVE_PACK_URL` with its
    sha256, or a published pack), loading fetches the pack first, with progress on stderr."""
    return dict(_native.runtime_info())


__all__ = ["runtime_info", "errors", "__version__", "Session", "Completion", "Chunk", "Usage", "Timings"]
