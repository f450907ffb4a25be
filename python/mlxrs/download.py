"""What `python -m mlxrs get` and the native-pack download share around the transfer itself
(which is Rust: `mlxrs._native.download`, crates/mlxrs-core/src/download.rs): progress bars (tqdm:
mlxrs draws no bar of its own), a lock file, the free-space check, sizes for people.

Environment (see docs/configuration.md):

- ``MLXRS_DOWNLOAD_RETRIES``: failed attempts in a row (no byte received) tolerated per file
  before giving up, keeping the partial file for the next run (default 5).
- ``MLXRS_PROGRESS``: ``1`` draws progress bars even when stderr is not a terminal, ``0`` never
  draws them (default: on a terminal only).
- ``MLXRS_FREE_SPACE_BYTES``: pretend the disk has this many bytes free. It exists so the tests
  can exercise the free-space refusal; do not set it otherwise.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm  # type: ignore[import-untyped]  # no stubs shipped (types-tqdm is not a dependency)

from . import _native
from .errors import DownloadError, InvalidArgumentError

GiB = 1 << 30
#: Kept free beyond what a download needs.
RESERVE_BYTES = GiB


def human(n: float, digits: int = 1) -> str:
    """1536 -> '1.5 KiB' (`digits` after the point; bytes are whole): mlxrs's one byte formatter in
    Python (`get`'s progress, `ls` and `fit` with two digits)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    return f"{n:.{digits}f} TiB"  # pragma: no cover


def retries() -> int:
    """`MLXRS_DOWNLOAD_RETRIES` (default 5)."""
    v = os.environ.get("MLXRS_DOWNLOAD_RETRIES", "").strip()
    if not v:
        return 5
    try:
        n = int(v)
    except ValueError:
        raise InvalidArgumentError(f"MLXRS_DOWNLOAD_RETRIES must be a whole number >= 0 (got {v!r})") from None
    if n < 0:
        raise InvalidArgumentError(f"MLXRS_DOWNLOAD_RETRIES must be a whole number >= 0 (got {v!r})")
    return n


def free_bytes(path: Path) -> int:
    """Free bytes on the file system that holds `path` (or would: its nearest existing parent).
    `MLXRS_FREE_SPACE_BYTES` overrides the answer (for tests)."""
    fake = os.environ.get("MLXRS_FREE_SPACE_BYTES", "").strip()
    if fake:
        try:
            return int(fake)
        except ValueError:
            raise InvalidArgumentError(f"MLXRS_FREE_SPACE_BYTES must be a number of bytes (got {fake!r})") from None
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def check_space(where: Path, needed: int, free: int, *, hint: str) -> None:
    """Refuse unless `free` holds `needed` plus the reserve."""
    want = needed + RESERVE_BYTES
    if free < want:
        raise DownloadError(
            f"not enough disk space in {where}: {human(needed)} ({needed} bytes) still to download plus a "
            f"{human(RESERVE_BYTES)} reserve needs {human(want)} ({want} bytes), but only {human(free)} "
            f"({free} bytes) is free — {hint}"
        )


@contextmanager
def file_lock(path: Path, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """An exclusive `flock` on `path` (created if needed), held for the `with` block; `on_wait` is
    called once when another process holds it. The same kind of lock `huggingface_hub` (filelock)
    takes, so the two exclude each other on the same file."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


PROGRESS_ENV = "MLXRS_PROGRESS"


def bars_enabled(stream: IO[str], quiet: bool = False) -> bool:
    """Whether to draw progress bars on `stream`: never when `quiet`; `MLXRS_PROGRESS=1` forces them
    on, `0` off; otherwise only on a terminal."""
    if quiet:
        return False
    v = os.environ.get(PROGRESS_ENV, "").strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    return stream.isatty()


def bar(desc: str, total: int | None, *, stream: IO[str], enabled: bool, position: int = 0, leave: bool = False) -> Any:
    """mlxrs's one kind of progress bar (tqdm): bytes with a binary prefix, rate and ETA, redrawn at
    most ten times a second; erased when closed unless `leave`."""
    return tqdm(
        total=total or None,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=stream,
        disable=not enabled,
        leave=leave,
        mininterval=0.1,
        position=position,
        dynamic_ncols=True,
    )


class Progress:
    """A bar for the current file and one for the whole download (tqdm, when `bars_enabled`), and
    one plain line per finished file (unless `quiet`). `update` is the callback the transfer calls
    with (done, total) for the current file."""

    def __init__(
        self,
        total_bytes: int,
        n_files: int,
        *,
        stream: IO[str] | None = None,
        quiet: bool = False,
        tty: bool | None = None,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.quiet = quiet
        self.enabled = bars_enabled(self.stream, quiet) if tty is None else (tty and not quiet)
        self.total_bytes = total_bytes
        self.n_files = n_files
        self.index = 0
        self.name = ""
        self.file_size = 0
        self.file_done = 0
        self.file_base = 0  # bytes of this file present before this run
        self.file_t0 = 0.0
        self.transferred = 0  # bytes moved this run, over all files
        self.total_bar = bar("total", total_bytes, stream=self.stream, enabled=self.enabled and n_files > 1, position=1)
        self.file_bar: Any | None = None

    def start_file(self, name: str, size: int) -> None:
        self.index += 1
        self.name, self.file_size, self.file_done = name, size, 0
        self.file_base = -1
        self.file_t0 = time.monotonic()
        if self.file_bar is not None:
            self.file_bar.close()
        short = name if len(name) <= 28 else "…" + name[-27:]
        self.file_bar = bar(short, size, stream=self.stream, enabled=self.enabled)
        self.total_bar.set_description(f"total {self.index}/{self.n_files}", refresh=False)

    def update(self, done: int, total: int) -> None:
        if total:
            self.file_size = total
        if self.file_base < 0:
            self.file_base = done  # a resumed prefix: not part of the rate
        moved = max(0, done - max(self.file_done, self.file_base))
        self.transferred += moved
        self.file_done = done
        if self.file_bar is not None:
            if total and self.file_bar.total != total:
                self.file_bar.total = total
            self.file_bar.update(done - self.file_bar.n)
        self.total_bar.update(moved)

    def finish_file(self, note: str = "") -> None:
        dt = time.monotonic() - self.file_t0
        got = max(0, self.file_done - max(self.file_base, 0))
        if self.file_bar is not None:
            self.file_bar.close()
            self.file_bar = None
        if self.quiet:
            return
        rate = f", {human(got / dt)}/s" if dt > 0 and got else ""
        tqdm.write(f"  {self.name}  {human(self.file_size)}{note}{rate}", file=self.stream)
        self.stream.flush()

    def close(self) -> None:
        if self.file_bar is not None:
            self.file_bar.close()
            self.file_bar = None
        self.total_bar.close()


class ByteBar:
    """A progress callback `(done, total, what)` drawing one bar labelled `label` on stderr (the GGUF
    import, the native pack fetched on first need): `enabled` None follows `bars_enabled`; the bar
    stays when done unless `leave` is False."""

    def __init__(
        self, label: str, enabled: bool | None = None, stream: IO[str] | None = None, *, leave: bool = True
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        on = bars_enabled(self.stream) if enabled is None else enabled
        self.bar = bar(label, None, stream=self.stream, enabled=on, leave=leave)

    def __call__(self, done: int, total: int, what: str = "") -> None:
        if total and self.bar.total != total:
            self.bar.total = total
        if what:
            self.bar.set_postfix_str(what[:40], refresh=False)
        self.bar.update(done - self.bar.n)
        if total and done >= total:
            self.bar.refresh()  # the finished bar drawn once (updates within tqdm's mininterval are not)
            self.bar.close()


_native_bars: dict[str, ByteBar] = {}


def native_progress(name: str, done: int, total: int) -> None:
    """The progress of a transfer the Rust core makes on its own (the native pack fetched on first
    need), drawn as the other bars are; the extension calls it (crates/mlxrs-py/src/lib.rs)."""
    b = _native_bars.get(name)
    if b is None:
        b = _native_bars[name] = ByteBar(f"  {name}", leave=False)  # the core prints the file's line after it
    b(done, total)
    if total and done >= total:
        _native_bars.pop(name, None)


def transfer(
    url: str,
    dest: Path,
    *,
    name: str,
    sha256: str | None = None,
    git_sha1: str | None = None,
    size: int | None = None,
    token: str | None = None,
    hub: bool = False,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """One verified, resumable file transfer (see `mlxrs._native.download`)."""
    return dict(
        _native.download(
            url,
            dest,
            sha256=sha256,
            git_sha1=git_sha1,
            size=size,
            name=name,
            token=token,
            hub=hub,
            retries=retries(),
            progress=progress.update if progress is not None else None,
        )
    )


__all__ = [
    "GiB",
    "RESERVE_BYTES",
    "human",
    "retries",
    "free_bytes",
    "check_space",
    "file_lock",
    "Progress",
    "ByteBar",
    "bar",
    "bars_enabled",
    "transfer",
]
