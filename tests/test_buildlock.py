"""tests/buildlock.py, which keeps the parallel run's workers from building a cached artefact twice:
two processes asking for the same artefact at once build it once, and a builder that calls another
on the same target (make_fit_model -> make_model) does not wait on itself."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent

BUILDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from buildlock import built_under
    root = Path(sys.argv[2])

    @built_under(root)
    def make(name: str) -> Path:
        d = root / name
        if (d / ".complete").exists():
            return d
        d.mkdir(parents=True, exist_ok=True)
        with open(root / "builds.log", "a") as f:
            f.write(name + "\\n")
        time.sleep(1.5)  # a slow build: the other process asks meanwhile
        (d / ".complete").write_text("ok")
        return d

    @built_under(root)
    def make_again(name: str) -> Path:  # the same target, through a second builder
        return make(name)

    print(make_again(sys.argv[3]))
    """
)


def run_builders(root: Path, names: list[str]) -> list[str]:
    procs = [
        subprocess.Popen([sys.executable, "-c", BUILDER, str(HERE), str(root), n], stdout=subprocess.PIPE, text=True)
        for n in names
    ]
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        outs.append(out.strip())
    return outs


def test_two_processes_build_the_same_artefact_once(tmp_path: Path) -> None:
    assert run_builders(tmp_path, ["m", "m"]) == [str(tmp_path / "m")] * 2
    assert (tmp_path / "builds.log").read_text() == "m\n"
    assert (tmp_path / "m" / ".complete").exists()


def test_different_artefacts_build_side_by_side(tmp_path: Path) -> None:
    """Locks are per artefact: two different names both build (neither finds the other's)."""
    assert run_builders(tmp_path, ["a", "b"]) == [str(tmp_path / "a"), str(tmp_path / "b")]
    assert sorted((tmp_path / "builds.log").read_text().split()) == ["a", "b"]
