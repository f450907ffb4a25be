"""Server fixtures shared by the server and chat tests (conftest.py loads this module as a plugin).

Session-scoped servers are one process each for the whole run, shared by every module that asks for
them: a test may not assume a fresh server (compare /stats against a reading taken before, as the
tests do). Tests that need their own options start their own `Server`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from scriptedmodel import make_looping_model, make_scripted_model
from server_util import InProcess, Server
from tinymodels import make_model


@pytest.fixture(scope="session")
def qwen3_dir() -> Path:
    """The tiny random Qwen3 (float32) most server tests serve."""
    return make_model("qwen3-float32", "qwen3")


@pytest.fixture(scope="session")
def qwen3_server(qwen3_dir: Path) -> Iterator[Server]:
    """`mlxrs serve` on qwen3_dir with the default options."""
    with Server(qwen3_dir) as s:
        yield s


@pytest.fixture(scope="module")
def qwen3_app(qwen3_dir: Path) -> Iterator[InProcess]:
    """The server's app on qwen3_dir in this process (one per module: it holds a Session here)."""
    s = InProcess(qwen3_dir)
    yield s
    s.close()


@pytest.fixture(scope="session")
def scripted_dir() -> Path:
    """tests/scriptedmodel.py's model: reasoning, tool calls and answers on cue."""
    return make_scripted_model()


@pytest.fixture(scope="session")
def scripted_server(scripted_dir: Path) -> Iterator[Server]:
    """`mlxrs serve` on scripted_dir with the default options."""
    with Server(scripted_dir) as s:
        yield s


@pytest.fixture(scope="session")
def looping_server() -> Iterator[Server]:
    """`mlxrs serve` on tests/scriptedmodel.py's looping model (it talks until stopped)."""
    with Server(make_looping_model()) as s:
        yield s
