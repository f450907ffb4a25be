"""What `python -m mlxrs get` and the native-pack download share around the transfer itself
(which is Rust: `mlxrs._native.download`, crates/mlxrs-core/src/download.rs): progress bars, a
lock file, the free-space check, sizes for people.

Environment (see docs/configuration.md):

- ``MLXRS_DOWNLOAD_RETRIES``: failed attempts in a row (no byte received) tolerated per file
  before giving up, keeping the partial file for the next run (default 5).
- ``MLXRS_FREE_SPACE_BYTES``: pretend the disk has this many bytes free. It exists so the tests
  can exercise the free-space refusal; do not set it otherwise.
"""

from __future__ import annotations

import collections
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

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


def _duration(s: float) -> str:
    s = int(s)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


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


class _Rate:
    """Bytes per second over the last few seconds."""

    def __init__(self, window: float = 5.0) -> None:
        self.window = window
        self.samples: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, t: float, done: int) -> float:
        self.samples.append((t, done))
        while len(self.samples) > 2 and t - self.samples[0][0] > self.window:
            self.samples.popleft()
        t0, d0 = self.samples[0]
        return (done - d0) / (t - t0) if t - t0 >= 0.25 else 0.0  # too short a window says nothing yet


class Progress:
    """A bar for the current file and one for the whole download, each with rate and ETA, on a
    terminal; plain lines (one per finished file) otherwise. `update` is the callback the
    transfer calls with (done, total) for the current file."""

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
        self.tty = self.stream.isatty() if tty is None else tty
        self.total_bytes = total_bytes
        self.n_files = n_files
        self.index = 0
        self.finished_bytes = 0  # of files already finished
        self.name = ""
        self.file_size = 0
        self.file_done = 0
        self.file_base = 0  # bytes of this file present before this run
        self.file_t0 = 0.0
        self.t0 = time.monotonic()
        self.overall = _Rate()
        self.current = _Rate()
        self.lines = 0  # lines of bars drawn (to redraw in place)
        self.last_draw = 0.0
        self.transferred = 0  # bytes moved this run, over all files
        self.rate_file = self.rate_total = 0.0

    def start_file(self, name: str, size: int) -> None:
        self.index += 1
        self.name, self.file_size, self.file_done = name, size, 0
        self.file_base = -1
        self.file_t0 = time.monotonic()
        self.current = _Rate()

    def update(self, done: int, total: int) -> None:
        if total:
            self.file_size = total
        if self.file_base < 0:
            self.file_base = done  # a resumed prefix: not part of the rate
        self.transferred += max(0, done - max(self.file_done, self.file_base))
        self.file_done = done
        now = time.monotonic()
        self.rate_file = self.current.add(now, done)
        self.rate_total = self.overall.add(now, self.transferred)
        if self.tty and not self.quiet and (now - self.last_draw >= 0.1 or done == total):
            self.last_draw = now
            self._draw()

    def finish_file(self, note: str = "") -> None:
        dt = time.monotonic() - self.file_t0
        got = max(0, self.file_done - max(self.file_base, 0))
        self.finished_bytes += self.file_size
        if self.quiet:
            return
        self._clear()
        rate = f", {human(got / dt)}/s" if dt > 0 and got else ""
        self.stream.write(f"  {self.name}  {human(self.file_size)}{note}{rate}\n")
        self.stream.flush()

    def close(self) -> None:
        self._clear()

    def _bar(self, label: str, done: int, total: int, rate: float, width: int = 24) -> str:
        frac = min(1.0, done / total) if total else 0.0
        fill = int(frac * width)
        eta = _duration((total - done) / rate) if rate > 0 and total > done else "--:--"
        return (
            f"{label} [{'#' * fill}{'.' * (width - fill)}] {frac * 100:5.1f}% "
            f"{human(done)}/{human(total)} {human(rate)}/s ETA {eta}"
        )

    def _draw(self) -> None:
        cols = shutil.get_terminal_size((100, 20)).columns
        name = self.name if len(self.name) <= 28 else "…" + self.name[-27:]
        rate_f, rate_t = self.rate_file, self.rate_total
        lines = [
            self._bar(f"  {name:<28}", self.file_done, self.file_size, rate_f),
            self._bar(
                f"  total {self.index}/{self.n_files}".ljust(30),
                self.finished_bytes + self.file_done,
                self.total_bytes,
                rate_t,
            ),
        ]
        out = ("\x1b[1A" * (self.lines - 1) if self.lines > 1 else "") + "\r"
        out += "\n".join("\x1b[2K" + ln[: cols - 1] for ln in lines)
        self.stream.write(out)
        self.stream.flush()
        self.lines = len(lines)

    def _clear(self) -> None:
        if self.tty and self.lines:
            self.stream.write(("\x1b[1A" * (self.lines - 1)) + "\r\x1b[J")
            self.stream.flush()
            self.lines = 0


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


__all__ = ["GiB", "RESERVE_BYTES", "human", "retries", "free_bytes", "check_space", "file_lock", "Progress", "transfer"]
