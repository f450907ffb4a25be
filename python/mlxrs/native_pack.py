"""`python -m mlxrs native [--fetch]`: which native runtime would load and from where, and the
native pack — libmlxc, libmlx and their companions as one versioned tarball, unpacked into
`<mlxrs home>/native-v<ver>-<os>-<arch>-<backend>/` (`MLXRS_HOME`, else `~/.cache/mlxrs`), the
third place the resolver looks (crates/mlxrs-sys/src/resolve.rs).

The tarball comes from `MLXRS_NATIVE_PACK_URL`, else from the release URL baked into the build
with its sha256 (crates/mlxrs-core/src/native_pack.rs, `PUBLISHED`); a URL of your own is checked
against `MLXRS_NATIVE_PACK_SHA256`. The transfer is the same resumable, verified one `get` uses.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tarfile
from pathlib import Path
from typing import IO, Any

from . import _native
from .download import Progress, file_lock, transfer
from .errors import DownloadError, MlxrsError


def info(backend: str | None = None) -> dict[str, Any]:
    """`mlxrs._native.native_pack_info`: the pack for `backend` (None: this machine's)."""
    return dict(_native.native_pack_info(backend))


def missing_files(pack_dir: Path, files: list[str]) -> list[str]:
    return [f for f in files if not (pack_dir / f).is_file()]


def _safe_members(tf: tarfile.TarFile, dest: Path) -> list[tarfile.TarInfo]:
    """Regular files, directories and links that stay inside `dest` (for Pythons without
    tarfile's "data" filter)."""
    root = dest.resolve()
    out = []
    for m in tf.getmembers():
        target = (dest / m.name).resolve()
        if m.name.startswith("/") or (target != root and root not in target.parents):
            raise DownloadError(f"the native pack holds a path outside its directory: {m.name!r}")
        if m.issym() or m.islnk():
            link = (target.parent / m.linkname).resolve() if m.issym() else (dest / m.linkname).resolve()
            if m.linkname.startswith("/") or (link != root and root not in link.parents):
                raise DownloadError(f"the native pack holds a link outside its directory: {m.name!r}")
        elif not (m.isfile() or m.isdir()):
            raise DownloadError(f"the native pack holds a special file: {m.name!r}")
        out.append(m)
    return out


def _extract(archive: Path, dest: Path) -> None:
    try:
        with tarfile.open(archive, "r:*") as tf:
            if hasattr(tarfile, "data_filter"):
                tf.extractall(dest, filter="data")
            else:  # pragma: no cover - Pythons before 3.10.12/3.11.4
                tf.extractall(dest, members=_safe_members(tf, dest))
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DownloadError(f"{archive.name} verified but could not be unpacked: {e}") from None


def _pack_root(tmp: Path, first: str) -> Path:
    """The directory holding libmlxc: the top of the archive, or its single top-level directory."""
    if (tmp / first).exists():
        return tmp
    entries = [p for p in tmp.iterdir()]
    if len(entries) == 1 and entries[0].is_dir():
        return entries[0]
    return tmp


def fetch(backend: str | None = None, *, force: bool = False, quiet: bool = False,
          stream: IO[str] | None = None) -> Path:
    """Download, verify and unpack the native pack; returns its directory. Nothing is fetched when
    it is already complete (unless `force`). Raises mlxrs.errors.DownloadError, e.g. with the two
    escapes when no pack is published for this platform."""
    out = stream if stream is not None else sys.stderr
    i = info(backend)
    if i["problem"]:
        raise DownloadError(i["problem"])
    if not i["dir"]:
        raise DownloadError("mlxrs has no cache directory: set MLXRS_HOME (or HOME)")
    pack_dir = Path(i["dir"])
    files: list[str] = list(i["files"])
    if not force and not missing_files(pack_dir, files):
        if not quiet:
            out.write(f"the native pack is already in {pack_dir}\n")
        return pack_dir
    home = pack_dir.parent
    home.mkdir(parents=True, exist_ok=True)

    def waiting() -> None:
        if not quiet:
            out.write(f"another process is fetching the {i['platform']} native pack; waiting for it\n")
            out.flush()

    with file_lock(home / ".locks" / f"{pack_dir.name}.lock", on_wait=waiting):
        if not force and not missing_files(pack_dir, files):
            return pack_dir
        archive = home / i["archive"]
        if not quiet:
            out.write(f"fetching the native pack {i['archive']} from {i['url']}\n")
            out.flush()
        bars = Progress(0, 1, stream=out, quiet=quiet)
        bars.start_file(i["archive"], 0)
        try:
            r = transfer(i["url"], archive, name=i["archive"], sha256=i["sha256"], progress=bars)
            bars.total_bytes = int(r["size"])
            bars.finish_file(" (resumed)" if r["resumed_from"] else "")
        finally:
            bars.close()
        tmp = home / f".{pack_dir.name}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            _extract(archive, tmp)
            root = _pack_root(tmp, files[0])
            lacking = missing_files(root, files)
            if lacking:
                raise DownloadError(f"the native pack {i['archive']} verified but lacks {', '.join(lacking)}; "
                                    f"it is not a pack for {i['platform']}")
            old = home / f".{pack_dir.name}.old{os.getpid()}"
            if pack_dir.exists() or pack_dir.is_symlink():
                os.replace(pack_dir, old)
            os.replace(root, pack_dir)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            archive.unlink(missing_ok=True)
    if not quiet:
        out.write(f"unpacked into {pack_dir}\n")
    return pack_dir


def describe(backend: str | None = None, load: bool = True) -> str:
    """What `python -m mlxrs native` prints."""
    lines = []
    order = _native._resolution_order()
    if len(order) == 1 and ": " in order[0] and "\n" not in order[0]:
        lines.append(f"libmlxc that would load: {order[0]}")
    else:
        lines.append("libmlxc that would load: none")
        lines.extend("  " + ln for ln in "\n".join(order).splitlines())
    if load:
        try:
            rt = _native.runtime_info()
        except MlxrsError as e:
            lines.append(f"loaded: no ({str(e).splitlines()[0]})")
        else:
            lines.append(f"loaded: libmlxc {rt['libmlxc']} (from {rt['source']}), mlx-c {rt['mlxc_version']}, "
                         f"MLX {rt['mlx_version']}, backend {rt['backend']}")
            lines.append(f"  libmlx: {rt['libmlx'] or 'resolved by the dynamic linker'}")
            if rt["backend"] == "cpu":
                lines.append(f"  BLAS: {rt['blas'] or 'reference (as linked by MLX)'}")
    i = info(backend)
    lines.append(f"native pack for this machine: {i['platform']} (v{i['version']})")
    if i["dir"]:
        d = Path(i["dir"])
        lacking = missing_files(d, list(i["files"]))
        state = "present" if not lacking else ("not fetched" if not d.exists() else f"incomplete, lacks {', '.join(lacking)}")
        lines.append(f"  directory: {d} ({state})")
    else:
        lines.append("  directory: none (set MLXRS_HOME)")
    if i["problem"]:
        lines.append(f"  source: {i['problem']}")
    else:
        lines.append(f"  source: {i['url']} ({'MLXRS_NATIVE_PACK_URL' if i['origin'] != 'release' else 'release'}), "
                     f"sha256 {i['sha256']}")
    return "\n".join(lines)


def _cmd_native(args: argparse.Namespace) -> int:
    if args.fetch:
        d = fetch(args.backend, force=args.force, quiet=args.quiet)
        order = _native._resolution_order()
        if order and not order[0].startswith("native-pack cache:") and len(order) == 1:
            print(f"note: {order[0]} is found before the pack; the pack is used where that is absent "
                  f"(or with MLXRS_LIBMLXC={d / Path(info(args.backend)['files'][0])})", file=sys.stderr)
        print(d)
        return 0
    print(describe(args.backend))
    return 0


def add_parser(sub: Any) -> None:
    """`native` for the CLI (python/mlxrs/cli.py)."""
    sp = sub.add_parser(
        "native", help="show which native runtime would load and from where; --fetch the native pack",
        description="Show which libmlxc the resolver would load (MLXRS_LIBMLXC, sidecar, native-pack cache, "
                    "Homebrew) and what the loaded runtime is, and the native pack for this machine: its directory "
                    "and where it comes from. --fetch downloads it (resumable, sha256-verified) from "
                    "MLXRS_NATIVE_PACK_URL or the release URL and unpacks it.")
    sp.add_argument("--fetch", action="store_true", help="download, verify and unpack the native pack")
    sp.add_argument("--backend", choices=["cpu", "cuda", "metal"], default=None,
                    help="which pack (default: metal on macOS; on Linux MLXRS_BACKEND, else cuda with an NVIDIA "
                         "driver, else cpu)")
    sp.add_argument("--force", action="store_true", help="with --fetch: fetch again even when the pack is present")
    sp.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    sp.set_defaults(func=_cmd_native)


__all__ = ["info", "fetch", "describe", "missing_files", "add_parser"]
