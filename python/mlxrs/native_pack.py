"""`python -m mlxrs native [--fetch]`: which native runtime would load and from where, and the
native pack — libmlxc, libmlx and their companions as one versioned tarball, unpacked into
`<mlxrs home>/native-v<ver>-<os>-<arch>-<backend>/` (`MLXRS_HOME`, else `~/.cache/mlxrs`), the
third place the resolver looks (crates/mlxrs-sys/src/resolve.rs).

The tarball comes from `MLXRS_NATIVE_PACK_URL`, else from the release URL baked into the build
with its sha256 (crates/mlxrs-core/src/native_pack.rs, `PUBLISHED`); a URL of your own is checked
against `MLXRS_NATIVE_PACK_SHA256`. The transfer is the same resumable, verified one `get` uses.
The runtime fetches the pack itself on first need (when nothing is found before the pack cache and
a source is known); `--fetch` does it ahead of time, through the same Rust code.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import IO, Any

from . import _native
from .download import Progress
from .errors import DownloadError, MlxrsError


def info(backend: str | None = None) -> dict[str, Any]:
    """`mlxrs._native.native_pack_info`: the pack for `backend` (None: this machine's)."""
    return dict(_native.native_pack_info(backend))


def missing_files(pack_dir: Path, files: list[str]) -> list[str]:
    return [f for f in files if not (pack_dir / f).is_file()]


def fetch(
    backend: str | None = None, *, force: bool = False, quiet: bool = False, stream: IO[str] | None = None
) -> Path:
    """Download, verify and unpack the native pack; returns its directory. Nothing is fetched when
    it is already complete (unless `force`). The work is `mlxrs._native.native_pack_install`, the
    same code the runtime runs when it fetches the pack on first need; this adds the messages and
    progress bars. Raises mlxrs.errors.DownloadError, e.g. with the two escapes when no pack is
    published for this platform."""
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

    def waiting() -> None:
        if not quiet:
            out.write(f"another process is fetching the {i['platform']} native pack; waiting for it\n")
            out.flush()

    if not quiet:
        out.write(f"fetching the native pack {i['archive']} from {i['url']}\n")
        out.flush()
    bars = Progress(0, 1, stream=out, quiet=quiet)
    bars.start_file(i["archive"], 0)
    try:
        r = _native.native_pack_install(i["backend"], force=force, progress=bars.update, on_wait=waiting)
        if r["fetched"]:
            bars.total_bytes = int(r["size"])
            bars.finish_file(" (resumed)" if r["resumed_from"] else "")
    finally:
        bars.close()
    if not quiet:
        out.write(f"unpacked into {pack_dir}\n" if r["fetched"] else f"the native pack is already in {pack_dir}\n")
    return pack_dir


def describe(backend: str | None = None, load: bool = True) -> str:
    """What `python -m mlxrs native` prints."""
    lines = []
    order = _native._resolution_order()
    found = order[0] if len(order) == 1 and ": " in order[0] and "\n" not in order[0] else None
    # nothing before Homebrew and a source known: the runtime fetches the pack on first need
    mine = info(None)
    first_need = (
        (found is None or found.startswith("homebrew:"))
        and not mine["problem"]
        and bool(mine["dir"])
        and bool(missing_files(Path(mine["dir"]), list(mine["files"])))
    )
    if first_need:
        lines.append(
            f"libmlxc that would load: the native pack's, fetched on first need from {mine['url']} into {mine['dir']}"
        )
        if found is not None:
            lines.append(f"  (before {found})")
    elif found is not None:
        lines.append(f"libmlxc that would load: {found}")
    else:
        lines.append("libmlxc that would load: none")
        lines.extend("  " + ln for ln in "\n".join(order).splitlines())
    if load and first_need:
        lines.append(
            "loaded: no (not loaded here, which would fetch the pack: `python -m mlxrs native --fetch` fetches it now)"
        )
    elif load:
        try:
            rt = _native.runtime_info()
        except MlxrsError as e:
            lines.append(f"loaded: no ({str(e).splitlines()[0]})")
        else:
            lines.append(
                f"loaded: libmlxc {rt['libmlxc']} (from {rt['source']}), mlx-c {rt['mlxc_version']}, "
                f"MLX {rt['mlx_version']}, backend {rt['backend']}"
            )
            lines.append(f"  libmlx: {rt['libmlx'] or 'resolved by the dynamic linker'}")
            if rt["backend"] == "cpu":
                lines.append(f"  BLAS: {rt['blas'] or 'reference (as linked by MLX)'}")
    i = info(backend)
    lines.append(f"native pack for this machine: {i['platform']} (v{i['version']})")
    if i["dir"]:
        d = Path(i["dir"])
        lacking = missing_files(d, list(i["files"]))
        state = (
            "present"
            if not lacking
            else ("not fetched" if not d.exists() else f"incomplete, lacks {', '.join(lacking)}")
        )
        lines.append(f"  directory: {d} ({state})")
    else:
        lines.append("  directory: none (set MLXRS_HOME)")
    if i["problem"]:
        lines.append(f"  source: {i['problem']}")
    else:
        lines.append(
            f"  source: {i['url']} ({'MLXRS_NATIVE_PACK_URL' if i['origin'] != 'release' else 'release'}), "
            f"sha256 {i['sha256']}"
        )
    return "\n".join(lines)


def _cmd_native(args: argparse.Namespace) -> int:
    if args.fetch:
        d = fetch(args.backend, force=args.force, quiet=args.quiet)
        order = _native._resolution_order()
        if order and not order[0].startswith("native-pack cache:") and len(order) == 1:
            print(
                f"note: {order[0]} is found before the pack; the pack is used where that is absent "
                f"(or with MLXRS_LIBMLXC={d / Path(info(args.backend)['files'][0])})",
                file=sys.stderr,
            )
        print(d)
        return 0
    print(describe(args.backend))
    return 0


def add_parser(sub: Any) -> None:
    """`native` for the CLI (python/mlxrs/cli.py)."""
    sp = sub.add_parser(
        "native",
        help="show which native runtime would load and from where; --fetch the native pack",
        description="Show which libmlxc the resolver would load (MLXRS_LIBMLXC, sidecar, native-pack cache, "
        "Homebrew) and what the loaded runtime is, and the native pack for this machine: its directory "
        "and where it comes from. --fetch downloads it (resumable, sha256-verified) from "
        "MLXRS_NATIVE_PACK_URL or the release URL and unpacks it.",
    )
    sp.add_argument("--fetch", action="store_true", help="download, verify and unpack the native pack")
    sp.add_argument(
        "--backend",
        choices=["cpu", "cuda", "metal"],
        default=None,
        help="which pack (default: metal on macOS; on Linux MLXRS_BACKEND, else cuda with an NVIDIA driver, else cpu)",
    )
    sp.add_argument("--force", action="store_true", help="with --fetch: fetch again even when the pack is present")
    sp.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    sp.set_defaults(func=_cmd_native)


__all__ = ["info", "fetch", "describe", "missing_files", "add_parser"]
