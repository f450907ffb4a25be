"""One builder per cached test artefact while pytest-xdist runs the tests in several processes.

The tests build what they need once and keep it (tiny models in tests/.models, the llama.cpp sdist,
its templates and converter, torch in `MLXRS_TEST_CACHE`), each marked finished by a `.complete` file
or an atomic rename. Two workers asking for the same artefact at once would otherwise both build it
(deleting each other's half-written files): each builder holds `build_lock(target)` (a file lock
beside the target, `.NAME.lock`) around its check-and-build, so the second worker waits and then
finds the first one's result.

filelock's locks are reentrant per instance, and `build_lock` hands out one instance per path in a
process, so a builder may call another one on the same target (make_fit_model -> make_model).

`cached_build` puts the user-level test cache (`MLXRS_TEST_CACHE`, default `~/.cache/mlxrs-tests`) in
front of a builder, so that a fresh clone restores the tiny models instead of writing them again (a
clean clone's pytest stage 598 -> 540 s, bench/RESULTS.md): an artefact is stored there once its
builder has made it, under the digest of everything its builder reads besides its arguments — the source of every test helper module
(tests/*.py but the test modules; a builder in a test module passes that module's source as key), the
installed distributions' versions and the Python build — and its arguments. So a changed helper,
argument or pinned package makes a new entry, and no builder may read the code under test (none imports
mlxrs). Entries of the two most recently used digests are kept. `MLXRS_TEST_BUILD_CACHE=0` turns it off."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import inspect
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from filelock import FileLock

_LOCKS: dict[Path, FileLock] = {}
F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
HERE = Path(__file__).resolve().parent
KEEP_DIGESTS = 2


def cache_root() -> Path:
    """The user-level test cache: downloads (the llama.cpp sdist, torch) and `cached_build`'s entries."""
    return Path(os.environ.get("MLXRS_TEST_CACHE") or Path.home() / ".cache" / "mlxrs-tests")


@functools.cache
def inputs_digest() -> str:
    """What every cached builder may read besides its arguments: the test helpers' sources (tests/*.py
    but test_*.py and conftest.py), the installed distributions and versions, the Python build."""
    h = hashlib.sha256()
    for f in sorted(HERE.glob("*.py")):
        if not f.name.startswith("test_") and f.name != "conftest.py":
            h.update(f"{f.name}\0".encode() + f.read_bytes() + b"\0")
    dists = sorted({f"{d.metadata['Name']}=={d.version}".lower() for d in importlib.metadata.distributions()})
    h.update("\n".join([*dists, sys.version, sys.platform]).encode())
    return h.hexdigest()[:24]


def _copy(src: Path, dst: Path) -> None:
    """`src` (a file or a directory, links followed) as `dst`, which appears whole or not at all."""
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.copy")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.unlink(missing_ok=True)
    try:
        if src.is_dir():
            shutil.copytree(src, tmp)
        else:
            shutil.copy2(src, tmp)
        tmp.rename(dst)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def _prune(current: Path) -> None:
    """Keep the KEEP_DIGESTS most recently used digests' entries (`current` among them)."""
    current.touch()
    digests = sorted((d for d in current.parent.iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime)
    for d in digests[:-KEEP_DIGESTS]:
        if d != current:
            shutil.rmtree(d, ignore_errors=True)


def cached_build(target: Path, build: Callable[[], T], *key: object) -> T:
    """`build()`, which makes `target` (a file or a directory) unless it is there and returns what its
    caller wants, with the test cache in front (the module's docstring): where `target` is missing and
    the cache holds it for these inputs and `key`, it is copied in first (so `build()` finds it made);
    where `build()` made it, it is stored. The caller holds `build_lock(target)`."""
    if os.environ.get("MLXRS_TEST_BUILD_CACHE") == "0":
        return build()
    digest = cache_root() / "built" / inputs_digest()
    entry = digest / hashlib.sha256(repr((target.name, key)).encode()).hexdigest()[:24] / target.name
    made_here = not target.exists()
    if made_here and entry.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            _copy(entry, target)
            made_here = False
            digest.touch()
        except OSError:  # an entry pruned meanwhile by another run: build it
            pass
    result = build()
    if made_here and target.exists() and not entry.exists():
        with build_lock(entry):
            if not entry.exists():
                entry.parent.mkdir(parents=True, exist_ok=True)
                _copy(target, entry)
        _prune(digest)
    return result


def build_lock(target: Path) -> FileLock:
    """The inter-process lock guarding the build of `target` (a directory or file)."""
    target = Path(target).absolute()
    lock = _LOCKS.get(target)
    if lock is None:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = _LOCKS[target] = FileLock(str(target.parent / f".{target.name}.lock"))
    return lock


def built_under(root: Path, arg: str = "name") -> Callable[[F], F]:
    """Decorator: the builder's call holds `build_lock(root / <its `arg` argument>)` (its default
    when not passed) and goes through `cached_build`, keyed by its arguments: for the model makers whose
    first argument names the directory they write."""

    def wrap(fn: F) -> F:
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def locked(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            target = root / bound.arguments[arg]
            with build_lock(target):
                key = (fn.__module__, fn.__qualname__, sorted((k, repr(v)) for k, v in bound.arguments.items()))
                return cached_build(target, lambda: fn(*args, **kwargs), *key)

        return locked  # type: ignore[return-value]

    return wrap
