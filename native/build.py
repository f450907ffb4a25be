#!/usr/bin/env python3
"""Build libmlxc for this Python's MLX and place it beside the extension module (python/mlxrs/).

Idempotent: a second run with nothing changed configures nothing, compiles nothing and copies nothing.
Usage: python native/build.py [--fetchcontent] [--build-dir DIR]
"""
from __future__ import annotations

import argparse
import filecmp
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LIBNAME = "libmlxc.dylib" if sys.platform == "darwin" else "libmlxc.so"
# our gemv router for the CPU backend (native/blas_gemv.c), Linux only
EXTRA = ["libmlxrs_blas.so"] if sys.platform.startswith("linux") else []


def mlx_cmake_dir() -> Path:
    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("MLX is not installed in this Python: pip install 'mlx[cpu]==0.32.4' (or mlx[cuda13])")
    d = Path(list(spec.submodule_search_locations)[0]) / "share" / "cmake" / "MLX"
    if not (d / "MLXConfig.cmake").is_file():
        raise SystemExit(f"no MLXConfig.cmake under {d}: this MLX wheel does not ship its CMake config")
    return d


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fetchcontent", action="store_true", help="build upstream mlx-c at the pinned commit (needs GitHub)")
    ap.add_argument("--build-dir", type=Path, default=HERE / "build")
    ap.add_argument("--dest", type=Path, default=ROOT / "python" / "mlxrs")
    args = ap.parse_args()
    cmake = shutil.which("cmake") or sys.exit("cmake not found: pip install cmake")
    src_opt = ""
    if not args.fetchcontent:
        out = subprocess.run([sys.executable, str(HERE / "fetch_mlxc.py")], check=True,
                             stdout=subprocess.PIPE, text=True).stdout
        src_opt = out.strip().splitlines()[-1]
    bdir: Path = args.build_dir
    # reconfigure (from scratch) when the source or the MLX it builds against changes
    # the patches and the signature-table generator feed the configure step: a change reconfigures
    inputs = sorted((HERE / "patches").glob("*.patch")) + [ROOT / "crates" / "mlxrs-sys" / "gen_bindings.py"]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in inputs)).hexdigest()
    signature = f"src={src_opt or 'fetchcontent'}\nmlx={mlx_cmake_dir()}\ninputs={digest}\n"
    stamp = bdir / ".mlxrs-configure"
    if (bdir / "CMakeCache.txt").exists() and (not stamp.exists() or stamp.read_text() != signature):
        shutil.rmtree(bdir)
    if not (bdir / "CMakeCache.txt").exists():
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        subprocess.run([cmake, "-S", str(HERE), "-B", str(bdir), *gen,
                        "-DCMAKE_BUILD_TYPE=Release",
                        f"-DMLX_DIR={mlx_cmake_dir()}",
                        f"-DMLXRS_PYTHON={sys.executable}",
                        f"-DMLXRS_MLXC_SOURCE_DIR={src_opt}"], check=True)
        stamp.write_text(signature)
    jobs = str(os.cpu_count() or 2)
    subprocess.run([cmake, "--build", str(bdir), "-j", jobs], check=True)
    for name in [LIBNAME, *EXTRA]:
        built = next(bdir.rglob(name), None)
        if built is None:
            raise SystemExit(f"build finished but {name} is not under {bdir}")
        target = args.dest / name
        if not target.exists() or not filecmp.cmp(built, target, shallow=False):
            shutil.copy2(built, target)
            print(f"installed {target}")
        else:
            print(f"up to date: {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
