"""tests/buildlock.py, which keeps the parallel run's workers from building a cached artefact twice:
two processes asking for the same artefact at once build it once, and a builder that calls another
on the same target (make_fit_model -> make_model) does not wait on itself; and its user-level cache
(`cached_build`): an artefact made once is restored in another tree (a fresh clone) without building,
as a copy, and built again where its arguments, the helpers' sources or the packages differ."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import buildlock
from buildlock import built_under, cached_build

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
    env = {**os.environ, "MLXRS_TEST_CACHE": str(root / "cache")}  # not the user's cache
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BUILDER, str(HERE), str(root), n], stdout=subprocess.PIPE, text=True, env=env
        )
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


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    c = tmp_path / "cache"
    monkeypatch.setenv("MLXRS_TEST_CACHE", str(c))
    monkeypatch.delenv("MLXRS_TEST_BUILD_CACHE", raising=False)
    return c


def tree_builder(root: Path, log: list[str]):  # noqa: ANN201
    """A model maker as tests/tinymodels.py's: writes root/name once (marked complete), logging each build."""

    @built_under(root)
    def make(name: str, size: int = 3) -> Path:
        d = root / name
        if (d / ".complete").exists():
            return d
        d.mkdir(parents=True)
        (d / "weights.bin").write_bytes(bytes(range(size)))
        (d / "sub").mkdir()
        (d / "sub" / "config.json").write_text(f'{{"size": {size}}}')
        (d / ".complete").write_text("ok")
        log.append(f"{name}:{size}")
        return d

    return make


def files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_a_fresh_tree_restores_what_another_built(tmp_path: Path, cache: Path) -> None:
    log: list[str] = []
    first = tree_builder(tmp_path / "clone1", log)("m", size=5)
    assert log == ["m:5"]
    restored = tree_builder(tmp_path / "clone2", log)("m", size=5)  # another clone, the same inputs
    assert log == ["m:5"], "restored, not built again"
    assert restored == tmp_path / "clone2" / "m" and files(restored) == files(first)
    # a copy: changing the restored tree changes neither the cache nor a third clone's copy
    (restored / "weights.bin").write_bytes(b"changed")
    third = tree_builder(tmp_path / "clone3", log)("m", size=5)
    assert log == ["m:5"] and files(third) == files(first)


def test_other_arguments_or_inputs_build_again(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    tree_builder(tmp_path / "a", log)("m", size=5)
    tree_builder(tmp_path / "b", log)("m", size=6)  # another argument: another entry
    assert log == ["m:5", "m:6"]
    assert files(tmp_path / "b" / "m")["weights.bin"] == bytes(range(6))
    # a changed helper source or package version is another digest: built again, and only the
    # KEEP_DIGESTS most recently used digests' entries stay
    for i, digest in enumerate(["d1", "d2", "d3"]):
        monkeypatch.setattr(buildlock, "inputs_digest", lambda digest=digest: digest)
        tree_builder(tmp_path / f"c{i}", log)("m", size=5)
    assert log == ["m:5", "m:6", "m:5", "m:5", "m:5"]
    kept = sorted(p.name for p in (cache / "built").iterdir())
    assert len(kept) == buildlock.KEEP_DIGESTS and "d3" in kept and "d1" not in kept


def test_a_file_artefact_and_the_switch(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[Path] = []

    def gguf(root: Path) -> Path:
        g = root / "x.gguf"

        def build() -> Path:
            if not g.exists():
                root.mkdir(parents=True, exist_ok=True)
                g.write_bytes(b"GGUF" + bytes(100))
                built.append(g)
            return g

        return cached_build(g, build, "key")

    assert gguf(tmp_path / "one").read_bytes() == b"GGUF" + bytes(100)
    assert gguf(tmp_path / "two").read_bytes() == b"GGUF" + bytes(100)
    assert built == [tmp_path / "one" / "x.gguf"]
    monkeypatch.setenv("MLXRS_TEST_BUILD_CACHE", "0")  # off: built, and nothing stored or restored
    gguf(tmp_path / "three")
    assert built[-1] == tmp_path / "three" / "x.gguf"
