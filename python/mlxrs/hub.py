"""`python -m mlxrs get ORG/REPO`: a Hugging Face model into the standard hub cache, over plain
HTTPS resolve URLs (no Xet), every file resumable and verified.

`huggingface_hub` answers the hub API (the repo's files with their sizes, LFS sha256 and git blob
ids, at one commit), the endpoint (`HF_ENDPOINT`), the token (`HF_TOKEN`, else the token file that
`hf auth login` writes); the cache location is `hub_cache()` (huggingface_hub's rule: `HF_HUB_CACHE`,
else `HF_HOME/hub`, else `~/.cache/huggingface/hub`, read at each call). The bytes go through `mlxrs._native.download` (Rust), which also
verifies them; this module lays them out as `huggingface_hub` does:

    models--ORG--REPO/blobs/<sha256 or git blob id>
    models--ORG--REPO/snapshots/<commit>/<file>   -> ../../blobs/<...> (relative symlink)
    models--ORG--REPO/refs/<revision>             (the commit; not written when the revision is one)

so `huggingface_hub` (`scan_cache_dir`, `snapshot_download(local_files_only=True)`), mlx-lm and
`mlxrs scan` find the result.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from .download import GiB, Progress, check_space, file_lock, free_bytes, human, transfer
from .errors import DownloadError, InvalidArgumentError


@dataclass(frozen=True)
class RepoFile:
    """One file of the repo at the commit being fetched."""

    path: str
    size: int
    blob: str  # the blob's name in the cache: the LFS sha256, else the git blob id
    sha256: str | None  # LFS files
    git_sha1: str | None  # small files: the git blob id


@dataclass
class GetResult:
    repo_id: str
    commit: str
    snapshot: Path
    files: list[str]
    transferred: int = 0  # bytes received this run
    fetched: list[str] = field(default_factory=list)  # files whose blob was transferred this run
    present: list[str] = field(default_factory=list)  # files whose blob was already complete


def hub_cache() -> Path:
    """The Hugging Face hub cache, resolved as `huggingface_hub.constants.HF_HUB_CACHE` is but read
    at each call (it reads the environment once, at import): HF_HUB_CACHE, else the legacy
    HUGGINGFACE_HUB_CACHE, else HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
    ~/.cache/huggingface/hub. The one answer for `get` and the registry."""

    def path(p: str) -> str:
        return os.path.expandvars(os.path.expanduser(p))

    home = path(os.getenv("HF_HOME", os.path.join(os.getenv("XDG_CACHE_HOME", path("~/.cache")), "huggingface")))
    return Path(path(os.getenv("HF_HUB_CACHE", os.getenv("HUGGINGFACE_HUB_CACHE", os.path.join(home, "hub")))))


def _hub() -> Any:
    try:
        import huggingface_hub
    except ImportError:
        raise DownloadError("`get` needs huggingface_hub for the hub API: pip install huggingface_hub") from None
    return huggingface_hub


def _api_error(e: Exception, repo_id: str, revision: str | None, endpoint: str, token: str | None) -> DownloadError:
    import huggingface_hub.errors as hf

    login = "run `hf auth login`, or export HF_TOKEN"
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, hf.OfflineModeIsEnabled):
        return DownloadError(f"HF_HUB_OFFLINE is set, and `get` needs the network: unset it to download {repo_id}")
    if isinstance(e, hf.GatedRepoError):
        if token:
            return DownloadError(
                f"{repo_id} is gated and your token has no access to it ({status}): accept its terms "
                f"on {endpoint}/{repo_id} with the same account, and check that the token "
                f"(`hf auth login` or HF_TOKEN) can read it"
            )
        return DownloadError(f"{repo_id} is gated ({status}): accept its terms on {endpoint}/{repo_id}, then {login}")
    if isinstance(e, hf.RevisionNotFoundError):
        return DownloadError(f"{repo_id} has no revision {revision!r} (a branch, tag or commit) on {endpoint}")
    if isinstance(e, hf.RepositoryNotFoundError):
        if token:
            return DownloadError(
                f"{repo_id} was not found on {endpoint} ({status}), or your token has no access to it: "
                f"check the repo id, and for a private repo that the token (`hf auth login` or "
                f"HF_TOKEN) belongs to an account that can read it"
            )
        return DownloadError(
            f"{repo_id} was not found on {endpoint} ({status}): check the repo id; if it is private "
            f"or gated it needs a token: {login}"
        )
    if status == 401:
        what = (
            "your token was refused (expired or revoked?): run `hf auth login` again"
            if token
            else f"it needs a Hugging Face token: {login}"
        )
        return DownloadError(f"{endpoint} answered 401 Unauthorized for {repo_id}: {what}")
    if status == 403:
        return DownloadError(
            f"{endpoint} answered 403 Forbidden for {repo_id}: your token has no access to it; "
            f"if it is gated, accept its terms on {endpoint}/{repo_id}, then {login}"
        )
    if status is not None:
        return DownloadError(f"{endpoint} answered {status} for {repo_id}: {str(e).strip().splitlines()[0]}")
    return DownloadError(f"could not reach {endpoint} for {repo_id}: {e}")


def list_files(repo_id: str, revision: str | None, endpoint: str, token: str | None) -> tuple[str, list[RepoFile]]:
    """The commit `revision` (None: the default branch) points to, and its files."""
    hub = _hub()
    import huggingface_hub.errors as hf

    api = hub.HfApi(endpoint=endpoint, token=token or False)
    try:
        info = api.model_info(repo_id, revision=revision, files_metadata=True)
    except Exception as e:  # noqa: BLE001 - every failure becomes one clear DownloadError
        if isinstance(e, (hf.HfHubHTTPError, hf.OfflineModeIsEnabled, OSError)) or type(e).__module__.split(".")[0] in (
            "httpx",
            "httpx2",
            "httpcore",
            "requests",
        ):
            raise _api_error(e, repo_id, revision, endpoint, token) from None
        raise
    if not info.sha:
        raise DownloadError(f"{endpoint} did not say which commit {repo_id}@{revision or 'main'} is")
    files = []
    for s in info.siblings or []:
        parts = s.rfilename.replace("\\", "/").split("/")
        if s.rfilename.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise DownloadError(f"{endpoint} listed an unsafe file name in {repo_id}: {s.rfilename!r}")
        if s.lfs is not None:
            files.append(RepoFile(s.rfilename, int(s.lfs.size), s.lfs.sha256, s.lfs.sha256, None))
        elif s.blob_id and s.size is not None:
            files.append(RepoFile(s.rfilename, int(s.size), s.blob_id, None, s.blob_id))
        else:
            raise DownloadError(f"{endpoint} gave no size or hash for {repo_id}/{s.rfilename}: cannot verify it")
    return str(info.sha), files


def select(files: Sequence[RepoFile], include: Sequence[str] | None) -> list[RepoFile]:
    """The files matching any of the `include` globs (all when none is given). A glob matches the
    path in the repo, or its base name when it has no '/'."""
    if not include:
        return list(files)
    out = []
    for f in files:
        base = f.path.rsplit("/", 1)[-1]
        if any(fnmatch.fnmatchcase(f.path, g) or ("/" not in g and fnmatch.fnmatchcase(base, g)) for g in include):
            out.append(f)
    return out


def _link(snapshot: Path, f: RepoFile, blobs: Path) -> None:
    """snapshots/<commit>/<path> -> ../../blobs/<blob>, relative, like huggingface_hub."""
    dst = snapshot / f.path
    dst.parent.mkdir(parents=True, exist_ok=True)
    target = os.path.relpath(blobs / f.blob, dst.parent)
    if dst.is_symlink() and os.readlink(dst) == target:
        return
    if dst.is_symlink() or dst.exists():
        dst.unlink()
    os.symlink(target, dst)


def _write_ref(repo_dir: Path, revision: str, commit: str) -> None:
    if revision == commit:
        return
    ref = repo_dir / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    if not ref.exists() or ref.read_text() != commit:
        tmp = ref.with_name(ref.name + f".tmp{os.getpid()}")
        tmp.write_text(commit)
        os.replace(tmp, ref)


def get(
    repo_id: str,
    revision: str | None = None,
    include: Sequence[str] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    endpoint: str | None = None,
    token: str | None = None,
    quiet: bool = False,
    stream: IO[str] | None = None,
    free_space: Callable[[Path], int] | None = None,
) -> GetResult:
    """Download `repo_id` at `revision` (default: main) into the hub cache; only the files matching
    an `include` glob when any is given. Resumes partial files, verifies every file, refuses to
    start without room for the rest plus 1 GiB, and holds a lock on the repo while it writes.
    `cache_dir`, `endpoint` and `token` default to what huggingface_hub uses; `free_space(path)`
    replaces the free-space probe (tests). Raises mlxrs.errors.DownloadError."""
    hub = _hub()
    from huggingface_hub import constants

    out = stream if stream is not None else sys.stderr
    if not repo_id or repo_id.count("/") > 1 or repo_id.startswith("/") or repo_id.endswith("/"):
        raise InvalidArgumentError(f"expected a Hugging Face repo id like ORG/NAME, got {repo_id!r}")
    endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
    if token is None:
        token = hub.get_token()
    cache = Path(cache_dir).expanduser() if cache_dir is not None else hub_cache()
    commit, all_files = list_files(repo_id, revision, endpoint, token)
    files = select(all_files, include)
    if not files:
        names = ", ".join(f.path for f in all_files[:12]) + (", …" if len(all_files) > 12 else "")
        raise DownloadError(
            f"no file of {repo_id}@{revision or 'main'} matches --include {' '.join(include or [])} "
            f"(its files: {names or 'none'})"
        )
    from huggingface_hub.file_download import repo_folder_name

    folder = repo_folder_name(repo_id=repo_id, repo_type="model")
    repo_dir = cache / folder
    blobs = repo_dir / "blobs"
    snapshot = repo_dir / "snapshots" / commit
    locks = cache / ".locks" / folder
    result = GetResult(repo_id, commit, snapshot, [f.path for f in files])

    def waiting() -> None:
        if not quiet:
            out.write(f"another `mlxrs get` of {repo_id} is writing to {repo_dir}; waiting for it to finish\n")
            out.flush()

    with file_lock(locks / "mlxrs-get.lock", on_wait=waiting):
        # one transfer per blob (two paths with the same content share it)
        unique: dict[str, RepoFile] = {}
        for f in files:
            unique.setdefault(f.blob, f)
        todo: list[RepoFile] = []
        remaining = 0
        for blob, f in unique.items():
            p = blobs / blob
            if p.is_file() and p.stat().st_size == f.size:
                continue
            if p.exists():
                p.unlink()  # the wrong size: not the blob it is named after
            part = blobs / (blob + ".incomplete")
            have = part.stat().st_size if part.is_file() else 0
            remaining += f.size - (have if have <= f.size else 0)
            todo.append(f)
        fetch_blobs = {f.blob for f in todo}
        result.present = [f.path for f in files if f.blob not in fetch_blobs]
        if todo:
            free = (free_space or free_bytes)(repo_dir)
            check_space(
                cache, remaining, free, hint="free some space, or point HF_HUB_CACHE at a larger volume before starting"
            )
        total = sum(f.size for f in todo)
        if not quiet:
            out.write(
                f"{repo_id} @ {commit[:12]}: {len(files)} file(s), {human(sum(f.size for f in files))}; "
                + (f"{len(todo)} to fetch ({human(remaining)} left to download)" if todo else "all present")
                + "\n"
            )
            out.flush()
        t0 = time.monotonic()
        bars = Progress(total, len(todo), stream=out, quiet=quiet)
        try:
            for f in todo:
                bars.start_file(f.path, f.size)
                url = hub.hf_hub_url(repo_id, f.path, revision=commit, endpoint=endpoint)
                # the per-blob lock huggingface_hub takes, so an `hf download` of the same repo waits too
                with file_lock(locks / f"{f.blob}.lock"):
                    r = transfer(
                        url,
                        blobs / f.blob,
                        name=f.path,
                        sha256=f.sha256,
                        git_sha1=f.git_sha1,
                        size=f.size,
                        token=token,
                        hub=True,
                        progress=bars,
                    )
                result.transferred += int(r["transferred"])
                note = ""
                if r["resumed_from"]:
                    note += f" (resumed at {human(int(r['resumed_from']))})"
                if r["refetched"]:
                    note += " (failed verification once, fetched again)"
                bars.finish_file(note)
                for g in files:
                    if g.blob == f.blob:
                        _link(snapshot, g, blobs)
                        result.fetched.append(g.path)
        finally:
            bars.close()
        for f in files:
            _link(snapshot, f, blobs)
        _write_ref(repo_dir, revision or "main", commit)
    if not quiet and todo:
        dt = time.monotonic() - t0
        rate = f", {human(result.transferred / dt)}/s" if dt > 0 else ""
        out.write(f"fetched {len(todo)} file(s), {human(result.transferred)} in {dt:.1f}s{rate}\n")
        out.flush()
    return result


def _cmd_get(args: argparse.Namespace) -> int:
    r = get(args.repo, revision=args.revision, include=args.include, quiet=args.quiet)
    print(r.snapshot)
    return 0


def add_parser(sub: Any) -> None:
    """`get` for the CLI (python/mlxrs/cli.py)."""
    sp = sub.add_parser(
        "get",
        help="download a Hugging Face model into the hub cache (resumable, verified)",
        description="Download ORG/REPO into the Hugging Face cache (HF_HUB_CACHE, else HF_HOME/hub, else "
        "~/.cache/huggingface/hub) over plain HTTPS: partial files resume, every file is verified "
        "(sha256 for LFS files, git blob sha1 for the others), and the download refuses to start "
        f"without room for the rest plus {GiB >> 30} GiB. Prints the snapshot directory. "
        "Token: HF_TOKEN, else `hf auth login`'s; endpoint: HF_ENDPOINT.",
    )
    sp.add_argument("repo", metavar="ORG/REPO", help="the model repo id, e.g. mlx-community/Qwen3-0.6B-4bit")
    sp.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    sp.add_argument(
        "--include",
        action="append",
        default=None,
        metavar="GLOB",
        help="only files matching GLOB (repeatable; a GLOB without '/' also matches base names)",
    )
    sp.add_argument("-q", "--quiet", action="store_true", help="no progress output (still prints the snapshot path)")
    sp.set_defaults(func=_cmd_get)


__all__ = ["get", "GetResult", "RepoFile", "list_files", "select", "add_parser"]
