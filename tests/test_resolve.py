"""Native runtime resolution seen from Python: a wrong MLXRS_LIBMLXC is explained, not a crash;
MLXRS_BLAS selects the BLAS preloaded for MLX's CPU backend. Each case runs in a fresh interpreter
(the runtime loads once per process)."""

from __future__ import annotations

import ctypes.util
import json
import os
import re
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


def tiny_computation(stdout: str) -> list[list[float]]:
    """The result `mlxrs info` prints on its "tiny computation" line."""
    line = next(ln for ln in stdout.splitlines() if ln.startswith("tiny computation: "))
    assert line.startswith("tiny computation: [[0,1,2],[3,4,5]] @ ones(3,2) = "), line
    return json.loads(line.split(" = ", 1)[1])  # type: ignore[no-any-return]


def test_info_computes_through_mlx() -> None:
    """`mlxrs info`: the runtime's description, a matmul through MLX (numpy's result), the memory counters."""
    import numpy as np
    from cli_util import run_cli

    r = run_cli("info")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"mlxrs {mlxrs.__version__}\n"), r.stdout
    want = np.arange(6, dtype=np.float64).reshape(2, 3) @ np.ones((3, 2))
    np.testing.assert_array_equal(np.array(tiny_computation(r.stdout)), want)
    assert re.search(r"^active memory: \d+ bytes, peak \d+ bytes$", r.stdout, re.M), r.stdout


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
    assert info["mlxc_version"] == mlxrs._native.BUILT_FOR_MLXC + "+mlxrs"  # v0.5.0 + native/patches


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


GEMV_SCRIPT = r"""
import ctypes, json, sys
sys.path.insert(0, sys.argv[2])  # tests/, for arrays_util
import numpy as np
import mlxrs
from arrays_util import op

info = mlxrs.runtime_info()
out = {"blas": info["blas"], "blas_gemv": info["blas_gemv"], "calls": None, "err": []}
calls = (lambda: ctypes.CDLL(info["blas_gemv"]).mlxrs_blas_gemv_calls()) if info["blas_gemv"] else (lambda: None)
c0 = calls()
rng = np.random.default_rng(0)
# matrix-vector products of every orientation the router rewrites, with batches; numpy in float64
cases = [((1, 300), (300, 77)), ((77, 300), (300, 1)), ((1, 1), (1, 5)), ((3, 1, 64), (3, 64, 40)),
         ((2, 40, 64), (2, 64, 1)), ((1, 1), (1, 1)), ((5, 64), (64, 40))]
for sa, sb in cases:
    a = rng.standard_normal(sa).astype(np.float32)
    b = rng.standard_normal(sb).astype(np.float32)
    got = op("matmul", a, b)[0]
    want = a.astype(np.float64) @ b.astype(np.float64)
    out["err"].append(float(np.abs(got - want).max()))
out["calls"] = None if c0 is None else calls() - c0
# a float32 model's greedy tokens and last-token logits (decoding is all matrix-vector products,
# including the attention's q K^T and p V on transposed and strided operands)
with mlxrs.Session(sys.argv[1]) as s:
    prompt = list(range(5, 40))
    out["tokens"] = s.generate(prompt, max_tokens=24, temperature=0).tokens
    out["logits"] = s.logits(prompt + out["tokens"][:-1])
print(json.dumps(out))
"""


def test_gemv_router_matches_numpy_and_plain_openblas(tmp_path: Path) -> None:
    """libmlxrs_blas (native/blas_gemv.c) sends MLX's float32 matrix-vector products to BLAS gemv:
    they match numpy, the router is really called, and a float32 model decodes the same tokens with
    the same logits as with OpenBLAS's sgemm alone (MLXRS_BLAS_GEMV=off)."""
    import numpy as np
    from tinymodels import make_model

    default = info_in_subprocess()
    if sys.platform != "linux" or default["backend"] != "cpu" or not default["blas"]:
        pytest.skip("the gemv router applies to Linux CPU builds with an optimized BLAS")
    assert default["blas_gemv"] and Path(str(default["blas_gemv"])).name == "libmlxrs_blas.so", default
    model = make_model("llama-float32", "llama")

    def run(**env: str) -> dict[str, object]:
        r = run_py(["-c", GEMV_SCRIPT, str(model), str(Path(__file__).parent)], **env)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

    on, off = run(), run(MLXRS_BLAS_GEMV="off")
    assert on["blas_gemv"] and off["blas_gemv"] is None and on["blas"] == off["blas"]
    for res in (on, off):
        assert max(res["err"]) < 1e-4, res["err"]  # type: ignore[type-var]
    # MLX calls BLAS once per matrix of a batch: 1 + 1 + 1 + 3 + 2 + 1 matrix-vector products; the
    # last case, a real matrix product, stays with sgemm
    assert on["calls"] == 9, on["calls"]
    assert on["tokens"] == off["tokens"]
    np.testing.assert_allclose(np.array(on["logits"]), np.array(off["logits"]), atol=1e-4, rtol=0)


ORDER_SCRIPT = r"""
import ctypes, json, sys, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    if sys.argv[1] == "mlx-first":
        import mlx.core as mx
        import mlxrs
    else:
        import mlxrs
        import mlx.core as mx
# MLX's own op first (a float32 matrix-vector product), before mlxrs loads its runtime
a = mx.array([[1.0, 2.0, 3.0]] * 64)
y = a @ mx.ones((3, 1))
mx.eval(y)
info = mlxrs.runtime_info()
calls = ctypes.CDLL(info["blas_gemv"]).mlxrs_blas_gemv_calls() if info["blas_gemv"] else None
print(json.dumps({"blas": info["blas"], "blas_gemv": info["blas_gemv"], "first": info["mlx_loaded_first"],
                  "calls": calls, "sum": float(y.sum()), "warnings": [str(w.message) for w in caught]}))
"""


def test_mlx_imported_after_mlxrs_uses_its_blas_and_before_it_is_told() -> None:
    """`import mlxrs` puts the BLAS and the gemv router ahead of libmlx, so an `import mlx.core` after it
    (before mlxrs loads its runtime: tests/conftest.py's order, a notebook's) binds MLX's products to
    them; `import mlx.core` first leaves MLX on its bundled BLAS, which runtime_info and a
    RuntimeWarning say (the BLAS is not reported as in use)."""
    default = info_in_subprocess()
    if sys.platform != "linux" or default["backend"] != "cpu" or not default["blas_gemv"]:
        pytest.skip("the BLAS preload applies to Linux CPU builds with an optimized BLAS")
    res = {}
    for order in ("mlxrs-first", "mlx-first"):
        r = run_py(["-c", ORDER_SCRIPT, order])
        assert r.returncode == 0, r.stderr
        res[order] = json.loads(r.stdout.strip().splitlines()[-1])
        assert res[order]["sum"] == 64 * 6.0
    after, before = res["mlxrs-first"], res["mlx-first"]
    assert after["blas"] == default["blas"] and after["first"] is False and after["warnings"] == []
    assert after["calls"] == 1, after  # MLX's own product went through the router
    assert before["first"] is True and before["blas"] is None and before["blas_gemv"] is None, before
    assert any("imported before mlxrs" in w for w in before["warnings"]), before["warnings"]
