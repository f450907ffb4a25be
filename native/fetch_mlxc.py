#!/usr/bin/env python3
"""Obtain a verified copy of mlx-c's sources for native/CMakeLists.txt.

mlx-c is not on PyPI and these build machines reach only package registries, so the sources come from a
crates.io package that vendors them (the crate's own sha256 is pinned below, as crates.io's index lists it).
Every file a build uses is then checked against the release manifest in this directory
(mlx-c-v<ver>.sha256, taken from the upstream tag); any mismatch stops the build and names the file.
Then our patch series (native/patches/*.patch, in order) is applied to a copy of the verified tree: it
brings v0.5.0 to MLX 0.32's C++ API and to upstream mlx-c's 0.32-era C signatures (each patch says
which MLX change it follows). Nothing of mlx-c is committed: the pristine copy lands in
native/_deps/mlx-c-v<ver>/, the patched one in native/_deps/mlx-c-v<ver>+mlxrs/ (both git-ignored).

Usage: fetch_mlxc.py [--src DIR]   (DIR: an mlx-c checkout of your own, verified the same way)
Prints the path of the patched source tree on its last line.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
MLXC_VERSION = "0.5.0"  # the verified copy; native/patches/ bring it to MLX 0.32.4 (native/README.md)
PATCHES = HERE / "patches"
# crates.io packages known to carry a byte-identical copy of mlx-c v0.5.0 under src/mlx-c/
CARRIERS = [
    ("pmetal-mlx-sys", "0.2.4", "8ed70541570cb839c7e50ec2833079c5d8f52316bc16e8f810aad367aad935be"),
]
CRATES_DL = os.environ.get("MLXRS_CRATES_DL", "https://static.crates.io/crates")


def manifest(version: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in (HERE / f"mlx-c-v{version}.sha256").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            digest, path = line.split(None, 1)
            out[path.lstrip("*")] = digest
    return out


def verify(root: Path, version: str) -> list[str]:
    """Return the manifest paths that are missing or differ under root (empty list: verified)."""
    bad = []
    for rel, digest in manifest(version).items():
        p = root / rel
        if not p.is_file() or hashlib.sha256(p.read_bytes()).hexdigest() != digest:
            bad.append(rel)
    return bad


def copy_verified(src: Path, dest: Path, version: str) -> None:
    """Copy exactly the manifest's files from src to dest (nothing else of the carrier comes along)."""
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for rel in manifest(version):
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / rel, tmp / rel)
    bad = verify(tmp, version)
    if bad:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(f"mlx-c v{version}: copy failed verification: {bad[0]}")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def patch_series() -> list[Path]:
    return sorted(PATCHES.glob("*.patch"))


def patched(pristine: Path) -> Path:
    """A copy of the verified tree with native/patches/ applied (redone when a patch changes)."""
    out = pristine.with_name(pristine.name + "+mlxrs")
    h = hashlib.sha256()
    for p in patch_series():
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    stamp = h.hexdigest()
    if (out / ".mlxrs-patches").is_file() and (out / ".mlxrs-patches").read_text() == stamp:
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(pristine, tmp)
    # git apply outside any repository: the ceiling keeps git from finding the checkout around native/
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tmp.parent))
    for p in patch_series():
        r = subprocess.run(["git", "apply", "-p1", "--whitespace=nowarn", str(p)], cwd=tmp, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise SystemExit(f"native/patches/{p.name} does not apply to the verified mlx-c v{MLXC_VERSION}:\n"
                             f"{r.stdout.strip()}")
    (tmp / ".mlxrs-patches").write_text(stamp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def fetch_crate(name: str, vers: str, sha: str) -> bytes:
    url = f"{CRATES_DL}/{name}/{name}-{vers}.crate"
    print(f"fetching {url}", file=sys.stderr)
    with urllib.request.urlopen(url, timeout=120) as r:
        data = r.read()
    got = hashlib.sha256(data).hexdigest()
    if got != sha:
        raise SystemExit(f"{name}-{vers}.crate: sha256 {got} != pinned {sha}")
    return data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, help="an mlx-c source tree of your own (verified before use)")
    ap.add_argument("--dest", type=Path, default=HERE / "_deps" / f"mlx-c-v{MLXC_VERSION}")
    args = ap.parse_args()
    dest: Path = args.dest
    src = args.src or (Path(os.environ["MLXRS_MLXC_SRC"]) if os.environ.get("MLXRS_MLXC_SRC") else None)

    if src is None and dest.is_dir() and not verify(dest, MLXC_VERSION):
        print(patched(dest))  # already fetched and still verifies: only the patches may be new
        return 0
    if src is not None:
        bad = verify(src, MLXC_VERSION)
        if bad:
            raise SystemExit(f"mlx-c at {src} does not match the v{MLXC_VERSION} manifest: first mismatch {bad[0]} "
                             f"({len(bad)} file(s) differ)")
        copy_verified(src, dest, MLXC_VERSION)
        print(patched(dest))
        return 0
    errors = []
    for name, vers, sha in CARRIERS:
        try:
            data = fetch_crate(name, vers, sha)
        except Exception as e:  # network or checksum: try the next carrier
            errors.append(f"{name} {vers}: {e}")
            continue
        stage = dest.parent / f".{name}-{vers}"
        shutil.rmtree(stage, ignore_errors=True)
        prefix = f"{name}-{vers}/src/mlx-c/"
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tf:
            for m in tf.getmembers():
                if m.isfile() and m.name.startswith(prefix):
                    rel = m.name[len(prefix):]
                    out = stage / rel
                    out.parent.mkdir(parents=True, exist_ok=True)
                    f = tf.extractfile(m)
                    assert f is not None
                    out.write_bytes(f.read())
        bad = verify(stage, MLXC_VERSION)
        if bad:
            errors.append(f"{name} {vers}: {bad[0]} does not match the v{MLXC_VERSION} manifest")
            shutil.rmtree(stage, ignore_errors=True)
            continue
        copy_verified(stage, dest, MLXC_VERSION)
        shutil.rmtree(stage, ignore_errors=True)
        print(patched(dest))
        return 0
    raise SystemExit("no verified copy of mlx-c v%s could be obtained:\n  %s\n"
                     "Pass --src /path/to/mlx-c (a checkout of the v%s tag) or set MLXRS_MLXC_SRC."
                     % (MLXC_VERSION, "\n  ".join(errors), MLXC_VERSION))


if __name__ == "__main__":
    sys.exit(main())
