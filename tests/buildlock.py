"""One builder per cached test artefact while pytest-xdist runs the tests in several processes.

The tests build what they need once and keep it (tiny models in tests/.models, the llama.cpp sdist,
its templates and converter, torch in `MLXRS_TEST_CACHE`), each marked finished by a `.complete` file
or an atomic rename. Two workers asking for the same artefact at once would otherwise both build it
(deleting each other's half-written files): each builder holds `build_lock(target)` (a file lock
beside the target, `.NAME.lock`) around its check-and-build, so the second worker waits and then
finds the first one's result.

filelock's locks are reentrant per instance, and `build_lock` hands out one instance per path in a
process, so a builder may call another one on the same target (make_fit_model -> make_model)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from filelock import FileLock

_LOCKS: dict[Path, FileLock] = {}
F = TypeVar("F", bound=Callable[..., Any])


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
    when not passed): for the model makers whose first argument names the directory they write."""

    def wrap(fn: F) -> F:
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def locked(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            with build_lock(root / bound.arguments[arg]):
                return fn(*args, **kwargs)

        return locked  # type: ignore[return-value]

    return wrap
