"""How `scripts/test.sh`'s parallel run (pytest-xdist, `--dist loadfile`) hands out the tests
(conftest.py loads this module as a plugin).

`--dist loadfile` keeps each test file whole in one worker, so a module's fixtures (servers,
sessions, the oracle's loaded models) are made once. Two refinements, both about the wall time only
(which tests run, and in which process each file's tests run together, is unchanged):

- the files in SPREAD are long runs of independent tests that share nothing costly but models
  written once on disk (tests/buildlock.py): each of their tests is a unit of its own, so both
  workers share them instead of one worker running the whole file at the end;
- units are handed out longest first (FIRST: the files that took longest in a serial run, in that
  order, then the others by their number of tests, as xdist orders them), so that no long file
  starts last while the other worker runs dry.

An outdated list only makes the schedule less even, never a test wrong."""

from __future__ import annotations

from typing import Any

import pytest

# the slowest files, slowest first: the sums of their tests' times in a parallel run (junit XML,
# 2026-12-01; bench/RESULTS.md, "test time"). test_wheel's one long fixture (maturin build, then a
# venv) goes first: it is a single chain that cannot be shared out.
FIRST = [
    "test_wheel.py",
    "test_gemma_real.py",
    "test_fit.py",
    "test_parity.py",
    "test_scheduler.py",
    "test_chat.py",
    "test_paged_experts.py",
    "test_get.py",
    "test_lora.py",
    "test_session.py",
    "test_gguf_import_gemma4.py",
    "test_server_compat.py",
    "test_oracle.py",
]
# files of long, independent tests: each test is scheduled on its own
SPREAD = {"test_fit.py"}


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0].rsplit("/", 1)[-1]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    rank = {name: i for i, name in enumerate(FIRST)}

    class LongestFirst(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return nodeid if _file(nodeid) in SPREAD else nodeid.split("::", 1)[0]

        def _assign_work_unit(self, node: Any) -> None:
            best = min(self.workqueue, key=lambda s: (rank.get(_file(s), len(rank)), -len(self.workqueue[s])))
            self.workqueue.move_to_end(best, last=False)
            super()._assign_work_unit(node)

    return LongestFirst(config, log)
