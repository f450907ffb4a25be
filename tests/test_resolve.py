"""Native runtime resolution seen from Python: a wrong MLXRS_LIBMLXC is explained, not a crash;
MLXRS_BLAS selects the BLAS preloaded for MLX's CPU backend. Each case runs in a fresh interpreter
(the runtime loads once per process)."""
from __future__ import annotations

import ctypes.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mlxrs

OPENBLAS_CANDIDATES = [
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
]


def run_py(args: list[str], **env_over: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLXRS_")}
    for k, v in env_over.items():
        if v is not None:
            env[k] = v
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=120)


def info_in_subprocess(**env: str | None) -> dict[str, object]:
    r = run_py(["-c", "import json, mlxrs; print(json.dumps(mlxrs.runtime_info()))"], **env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_version_with_missing_libmlxc_names_the_path_without_a_traceback() -> None:
    bad = "/nonexistent/libmlxc.so"
    r = run_py(["-m", "mlxrs", "--version"], MLXRS_LIBMLXC=bad)
    out = r.stdout + r.stderr
    assert r.returncode in (0, 1), (r.returncode, out)  # a clean exit, not a signal
    assert "Traceback" not in out, out
    assert bad in out, out
    assert "MLXRS_LIBMLXC" in out
    assert f"mlxrs {mlxrs.__version__}" in r.stdout  # the version itself is still printed


def test_missing_libmlxc_is_a_native_runtime_error_and_a_retry_can_succeed() -> None:
    good = str(Path(mlxrs.__file__).with_name("libmlxc.so"))
    code = (
        "import os, mlxrs\n"
        "from mlxrs.errors import NativeRuntimeError\n"
        "try:\n"
        "    mlxrs.runtime_info()\n"
        "except NativeRuntimeError as e:\n"
        "    print('ERR', e)\n"
        f"os.environ['MLXRS_LIBMLXC'] = {good!r}\n"
        "print('SOURCE', mlxrs.runtime_info()['source'])\n"
    )
    r = run_py(["-c", code], MLXRS_LIBMLXC="/nonexistent/libmlxc.so")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any(ln.startswith("ERR ") and "/nonexistent/libmlxc.so" in ln for ln in lines), r.stdout
    # a failed load may be retried in the same process (here with the variable fixed)
    assert "SOURCE MLXRS_LIBMLXC" in lines, r.stdout


def test_default_resolution_uses_the_sidecar() -> None:
    info = info_in_subprocess()
    sidecar = Path(mlxrs.__file__).with_name("libmlxc.so")
    assert info["source"] == "sidecar"
    assert Path(str(info["libmlxc"])).resolve() == sidecar.resolve()
    assert info["mlx_version"] == mlxrs._native.BUILT_FOR_MLX
    assert info["mlxc_version"] == mlxrs._native.BUILT_FOR_MLXC


def openblas_present() -> bool:
    return ctypes.util.find_library("openblas") is not None or any(Path(p).exists() for p in OPENBLAS_CANDIDATES)


def test_blas_off_and_default() -> None:
    off = info_in_subprocess(MLXRS_BLAS="off")
    assert off["blas"] is None
    if not openblas_present():
        pytest.skip("no libopenblas.so.0 on this machine: the default has nothing to preload")
    default = info_in_subprocess()
    if sys.platform != "linux" or off["backend"] != "cpu":
        assert default["blas"] is None  # only Linux CPU builds of MLX get a BLAS preloaded
        return
    blas = default["blas"]
    assert isinstance(blas, str), default
    assert "openblas" in Path(blas).name, blas
    assert Path(blas).exists(), blas
    # an explicit library is used as given
    explicit = info_in_subprocess(MLXRS_BLAS=blas)
    assert explicit["blas"] == blas
