"""python/mlxrs/_native.pyi matches the built extension (mypy's stubtest), and is precise enough
for mypy to catch misuse. The test build's `_op` (the `testing` feature) is neither in the wheel nor
in the stub, nor in the module's `__all__`: stubtest passes over a private name not listed there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import mlxrs

STUB = Path(mlxrs.__file__).with_name("_native.pyi")


def run(
    args: list[str], env_over: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "MYPYPATH"}
    env.update(env_over or {})
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def test_stubtest_passes() -> None:
    assert STUB.is_file()
    from mlxrs import _native

    assert hasattr(_native, "_op"), "the test build has the op dispatch (maturin develop --features testing)"
    r = run(["-m", "mypy.stubtest", "mlxrs._native"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Success" in r.stdout, r.stdout


def test_stubtest_would_catch_a_wrong_stub(tmp_path: Path) -> None:
    # the same check against a copy of the stub with one signature wrong must fail
    pkg = tmp_path / "mlxrs"
    pkg.mkdir()
    (pkg / "__init__.pyi").write_text("")
    wrong = STUB.read_text().replace('params: str = "{}"', "params: str")
    assert wrong != STUB.read_text()
    (pkg / "_native.pyi").write_text(wrong)
    r = run(["-m", "mypy.stubtest", "mlxrs._native"], {"MYPYPATH": str(tmp_path)}, cwd=tmp_path)
    assert r.returncode != 0, r.stdout
    assert "mlxrs._native._sample" in r.stdout, r.stdout


def test_mypy_uses_the_stub_precisely(tmp_path: Path) -> None:
    good = tmp_path / "good.py"
    good.write_text(
        textwrap.dedent("""
        from mlxrs import _native

        info = _native.runtime_info()
        backend: str = info["backend"]
        blas: str | None = info["blas"]
        peak: int = info["peak_memory"]
        data, shape, dtype = _native._array_roundtrip(b"\\0" * 4, [1], "float32")
        first: int = shape[0]
        rows: list[list[float]] = _native._tiny_matmul()
        raw: bytes = data
        version: str = _native.__version__ + _native.BUILT_FOR_MLX + _native.BUILT_FOR_MLXC
        order: list[str] = _native._resolution_order()
    """)
    )
    bad = tmp_path / "bad.py"
    bad.write_text(
        textwrap.dedent("""
        from mlxrs import _native

        info = _native.runtime_info()
        n: int = info["blas"]
        info["no_such_key"]
        _native._op("add", [(b"", [1], "float32")])
        _native._array_roundtrip(b"", [1])
        _native._sample("not a list of floats")
    """)
    )
    cache = tmp_path / ".mypy_cache"
    r = run(["-m", "mypy", "--strict", "--follow-imports=silent", "--cache-dir", str(cache), str(good)])
    assert r.returncode == 0, r.stdout + r.stderr
    r = run(["-m", "mypy", "--strict", "--follow-imports=silent", "--cache-dir", str(cache), str(bad)])
    assert r.returncode == 1, r.stdout
    out = r.stdout
    assert "bad.py:5: error" in out and "int" in out, out  # str | None is not int
    assert "bad.py:6: error" in out and "no_such_key" in out, out
    assert "bad.py:7: error" in out and "_op" in out, out  # the wheel has no _op: nor does the stub
    assert "bad.py:8: error" in out, out
    assert "bad.py:9: error" in out, out
    shutil.rmtree(cache, ignore_errors=True)
