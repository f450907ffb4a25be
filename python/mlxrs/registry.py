"""The model registry: `mlxrs scan` records every loadable model it finds in the Hugging Face hub
cache and in `MLXRS_MODEL_DIRS`, `mlxrs ls` lists them, and `serve`/`fit`/`Session` accept a
registry name (or a unique substring of one) wherever a path is expected.

Everything is read from metadata: config.json, the chat template, the safetensors headers (the
8-byte length and the JSON header, never tensor data) and GGUF headers, by the Rust readers the loader
uses (a model directory through `_native.describe`, crates/mlxrs-core/src/describe.rs). The hub cache is listed by `huggingface_hub.scan_cache_dir()`.
The registry is a sqlite database at `$MLXRS_HOME/registry.sqlite` (default
`~/.cache/mlxrs/registry.sqlite`), updated incrementally: a model whose files are unchanged since the
last scan (its fingerprint: the hub's blob names and sizes, or the files' sizes and mtimes) is neither
read again nor rewritten; names are looked up through indexes.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import os
import sqlite3
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .errors import ModelLoadError
from .hub import hub_cache

SCHEMA_VERSION = 2  # 2: the fingerprint column, incremental scans, name indexes
SCAN_HINT = "(try `mlxrs scan`)"
#: How deep below an `MLXRS_MODEL_DIRS` entry model directories and .gguf files are looked for.
MODEL_DIRS_DEPTH = 3


#: llama.cpp's `general.file_type` (enum llama_ftype in llama.h).
GGUF_FILE_TYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    19: "IQ2_XXS",
    20: "IQ2_XS",
    21: "Q2_K_S",
    22: "IQ3_XS",
    23: "IQ3_XXS",
    24: "IQ1_S",
    25: "IQ4_NL",
    26: "IQ3_S",
    27: "IQ3_M",
    28: "IQ2_S",
    29: "IQ2_M",
    30: "IQ4_XS",
    31: "IQ1_M",
    32: "BF16",
    36: "TQ1_0",
    37: "TQ2_0",
}


@dataclass
class Entry:
    """One registered model."""

    path: str
    name: str
    source: str  # "hf-cache" | "model-dirs"
    format: str  # "safetensors" | "gguf"
    repo_id: str | None = None
    revision: str | None = None
    is_main: bool = False
    model_type: str | None = None
    supported: bool = False
    note: str | None = None
    params: int | None = None
    weight_bytes: int | None = None
    dtype: str | None = None
    quantization: str | None = None
    context_length: int | None = None
    chat_template: bool = False
    tools: bool = False
    files: tuple[str, ...] = ()
    scanned_at: float = 0.0
    stale: bool = False

    def gone(self) -> list[str]:
        """The files of this entry that no longer exist."""
        p = Path(self.path)
        if not p.exists():
            return [self.path]
        if self.format == "gguf":
            return []
        return [f for f in self.files if not (p / f).exists()]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["files"] = list(self.files)
        return d


# ---- locations --------------------------------------------------------------------------------


def model_dirs() -> list[Path]:
    """The extra roots of `MLXRS_MODEL_DIRS` (os.pathsep-separated)."""
    raw = os.environ.get("MLXRS_MODEL_DIRS", "")
    return [Path(p).expanduser() for p in raw.split(os.pathsep) if p.strip()]


def db_path() -> Path:
    from .models import mlxrs_home

    return mlxrs_home() / "registry.sqlite"


# ---- metadata readers -------------------------------------------------------------------------


def gguf_architectures() -> dict[str, str]:
    """GGUF `general.architecture` → the HF model_type mlxrs imports it as (from the Rust
    architecture table, models/arch.rs, through the extension)."""
    from . import _native

    return dict(_native.GGUF_ARCHITECTURES)


def inspect_dir(d: Path) -> Entry:
    """An entry for a model directory, loadable or not (crates/mlxrs-core's `describe`: config.json,
    the safetensors headers and the chat template through the loader's readers); raises ValueError
    saying why it is not a model directory."""
    from . import _native
    from .errors import MlxrsError

    try:
        f = _native.describe(str(d))
    except MlxrsError as e:
        raise ValueError(str(e)) from None
    return Entry(
        path=str(d),
        name=d.name,
        source="model-dirs",
        format="safetensors",
        model_type=f["model_type"],
        supported=f["supported"],
        note=f["note"],
        params=f["params"],
        weight_bytes=f["weight_bytes"],
        dtype=f["dtype"],
        quantization=f["quantization"],
        context_length=f["context_length"],
        chat_template=f["chat_template"],
        tools=f["tools"],
        files=tuple(f["files"]),
    )


def inspect_gguf(p: Path) -> Entry:
    """An entry for a .gguf file (its header only); raises ValueError when it does not parse."""
    from . import _native
    from .errors import MlxrsError

    try:
        _version, meta_json, tensors, data_offset = _native._gguf_header(None, str(p))
    except MlxrsError as e:
        raise ValueError(str(e)) from None
    meta = json.loads(meta_json)
    arch = meta.get("general.architecture")
    model_type = gguf_architectures().get(arch) if isinstance(arch, str) else None
    params = sum(math.prod(shape) if shape else 1 for _n, shape, _t, _o in tensors)
    ft = meta.get("general.file_type")
    quant = GGUF_FILE_TYPES.get(ft, f"file_type {ft}") if isinstance(ft, int) else None
    ctx = meta.get(f"{arch}.context_length")
    template = meta.get("tokenizer.chat_template")
    notes = []
    if model_type is None:
        notes.append(f"GGUF architecture {arch!r} cannot be imported")
    if "tokenizer.ggml.tokens" not in meta:
        notes.append("no tokenizer in the GGUF")
    return Entry(
        path=str(p),
        name=p.name,
        source="model-dirs",
        format="gguf",
        model_type=model_type or arch,
        supported=not notes,
        note="; ".join(notes) or None,
        params=params,
        weight_bytes=max(p.stat().st_size - int(data_offset), 0),
        dtype=None,
        quantization=quant,
        context_length=ctx if isinstance(ctx, int) else None,
        chat_template=isinstance(template, str) and bool(template),
        tools=isinstance(template, str) and "tools" in template,
        files=(p.name,),
    )


# ---- scanning ---------------------------------------------------------------------------------


@dataclass
class ScanResult:
    entries: list[Entry]
    skipped: list[tuple[str, str]]  # (path, why)
    roots: list[str]
    read: int = 0  # models read this scan (new, or changed since the last one)
    unchanged: int = 0  # models (and skipped paths) whose fingerprint matched: neither read nor rewritten
    removed: int = 0  # rows dropped: their files are gone


@dataclass
class _Found:
    """A model directory or .gguf file a walk found, before it is read."""

    path: Path
    kind: str  # "dir" | "gguf"
    fingerprint: str
    name: str | None = None  # hub entries: the repo id (and the file within it for a GGUF)
    repo_id: str | None = None
    revision: str | None = None
    is_main: bool = False


def _digest(parts: Sequence[object]) -> str:
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:32]


def _stat_fingerprint(paths: Sequence[Path]) -> str:
    """The names, sizes and modification times of `paths` (a change to any is a change of model)."""
    parts: list[object] = []
    for p in sorted(paths):
        try:
            st = p.stat()
        except OSError:
            continue
        parts.append((p.name, st.st_size, st.st_mtime_ns))
    return _digest(parts)


def _hub_found(hub: Path, out: ScanResult) -> Iterator[_Found]:
    """The model snapshots and GGUF files of the hub cache, as huggingface_hub lists them. The
    fingerprint of a snapshot is its files' blob names (content hashes) and sizes, and its refs."""
    if not hub.is_dir():
        return
    from huggingface_hub import scan_cache_dir

    try:
        info = scan_cache_dir(hub)
    except Exception as e:  # CacheNotFound and friends: nothing to list
        out.skipped.append((str(hub), f"not a Hugging Face hub cache: {e}"))
        return
    for w in info.warnings:  # a corrupted repo: reported, the rest is listed
        out.skipped.append((str(getattr(w, "path", hub)), str(w)))
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: r.commit_hash):
            snap = rev.snapshot_path
            files = {f.file_path.relative_to(snap).as_posix(): f for f in rev.files}
            is_main = "main" in rev.refs
            listing = [(rel, f.blob_path.name, f.size_on_disk) for rel, f in sorted(files.items())]
            if "config.json" in files or any(r.endswith(".safetensors") and "/" not in r for r in files):
                yield _Found(
                    snap, "dir", _digest([listing, is_main]), repo.repo_id, repo.repo_id, rev.commit_hash, is_main
                )
            for rel in sorted(r for r in files if r.endswith(".gguf")):
                f = files[rel]
                yield _Found(
                    f.file_path,
                    "gguf",
                    _digest([rel, f.blob_path.name, f.size_on_disk, is_main]),
                    f"{repo.repo_id}/{rel}",
                    repo.repo_id,
                    rev.commit_hash,
                    is_main,
                )


def _dir_found(root: Path, out: ScanResult) -> Iterator[_Found]:
    """The model directories (config.json) and .gguf files under an `MLXRS_MODEL_DIRS` entry, at most
    MODEL_DIRS_DEPTH levels down; a model directory is not searched further."""
    if not root.exists():
        out.skipped.append((str(root), "MLXRS_MODEL_DIRS entry does not exist"))
        return
    candidates: list[tuple[Path, int]] = [(root, 0)]
    while candidates:
        p, depth = candidates.pop(0)
        if p.is_file():
            if p.suffix.lower() == ".gguf":
                yield _Found(p, "gguf", _stat_fingerprint([p]))
            continue
        if (p / "config.json").exists():
            try:
                files = [f for f in p.iterdir() if f.is_file()]
            except OSError as e:
                out.skipped.append((str(p), e.strerror or str(e)))
                continue
            yield _Found(p, "dir", _stat_fingerprint(files))
            continue
        if depth >= MODEL_DIRS_DEPTH:
            continue
        try:
            kids = sorted(p.iterdir())
        except OSError as e:
            out.skipped.append((str(p), e.strerror or str(e)))
            continue
        for k in kids:
            if k.name.startswith("."):
                continue
            if k.is_dir() or k.suffix.lower() == ".gguf":
                candidates.append((k, depth + 1))


def _read(f: _Found) -> Entry:
    """The entry for what a walk found (raises ValueError or OSError saying why it is not one)."""
    e = inspect_gguf(f.path) if f.kind == "gguf" else inspect_dir(f.path)
    if f.repo_id:
        e.name, e.repo_id, e.revision, e.is_main, e.source = (
            f.name or f.repo_id,
            f.repo_id,
            f.revision,
            f.is_main,
            "hf-cache",
        )
    return e


def _why_skipped(f: _Found, why: Exception) -> str:
    if f.kind == "dir" and f.repo_id:
        return f"{f.repo_id}@{(f.revision or '')[:7]}: {why}"
    return str(why)


def scan(*, hub: Path | None = None, extra: Sequence[Path] | None = None, db: Path | None = None) -> ScanResult:
    """Walk the hub cache and `MLXRS_MODEL_DIRS` and bring the registry up to date: read what is new
    or changed since the last scan (and write its row), keep what is unchanged as it is, and drop
    what is gone."""
    hub = hub or hub_cache()
    extra = list(model_dirs() if extra is None else extra)
    out = ScanResult([], [], [str(hub), *map(str, extra)])
    found: dict[str, _Found] = {}  # one per path (a directory listed twice, or inside the hub cache too)
    walks = [_hub_found(hub, out), *(_dir_found(root, out) for root in extra)]
    for walk in walks:
        for f in walk:
            found.setdefault(str(f.path.resolve()), f)
    con = _connect(db or db_path())
    try:
        with con:
            known = dict(con.execute("SELECT path, fingerprint FROM models").fetchall())
            known_skipped = {p: (fp, why) for p, fp, why in con.execute("SELECT path, fingerprint, why FROM skipped")}
            keep: set[str] = set()
            for f in found.values():
                key = str(f.path)
                keep.add(key)
                if known.get(key) == f.fingerprint:
                    out.unchanged += 1
                    continue
                if key in known_skipped and known_skipped[key][0] == f.fingerprint:
                    out.unchanged += 1
                    out.skipped.append((key, known_skipped[key][1]))
                    continue
                out.read += 1
                try:
                    e = _read(f)
                except (OSError, ValueError) as why:
                    out.skipped.append((key, _why_skipped(f, why)))
                    con.execute("DELETE FROM models WHERE path = ?", (key,))
                    con.execute(
                        "INSERT OR REPLACE INTO skipped VALUES (?, ?, ?)", (key, f.fingerprint, out.skipped[-1][1])
                    )
                    continue
                e.scanned_at = time.time()
                row = e.to_json()
                row["files"] = json.dumps(row["files"])
                row["fingerprint"] = f.fingerprint
                cols = (*_COLUMNS, "fingerprint")
                con.execute(
                    f"INSERT OR REPLACE INTO models ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
                    [row[c] for c in cols],
                )
                con.execute("DELETE FROM skipped WHERE path = ?", (key,))
            for path in set(known) - keep:
                con.execute("DELETE FROM models WHERE path = ?", (path,))
                out.removed += 1
            for path in set(known_skipped) - keep:
                con.execute("DELETE FROM skipped WHERE path = ?", (path,))
            # paths a walk reported without a fingerprint (a missing MLXRS_MODEL_DIRS entry, a
            # corrupted hub repo) are not rows of the skipped table
            for k, v in (("scanned_at", str(time.time())), ("roots", json.dumps(out.roots))):
                con.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (k, v))
            rows = (
                con.execute(
                    f"SELECT {', '.join(_COLUMNS)} FROM models WHERE path IN ({', '.join('?' * len(keep))})",
                    sorted(keep),
                ).fetchall()
                if keep
                else []
            )
    finally:
        con.close()
    order = {str(f.path): i for i, f in enumerate(found.values())}
    out.entries = sorted((_entry(r) for r in rows), key=lambda e: order.get(e.path, 0))
    return out


# ---- the database -----------------------------------------------------------------------------

_COLUMNS = (
    "path",
    "name",
    "source",
    "format",
    "repo_id",
    "revision",
    "is_main",
    "model_type",
    "supported",
    "note",
    "params",
    "weight_bytes",
    "dtype",
    "quantization",
    "context_length",
    "chat_template",
    "tools",
    "files",
    "scanned_at",
)


def _connect(path: Path) -> sqlite3.Connection:
    """The registry database, created (or, from an older schema, recreated: a rescan fills it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    con = sqlite3.connect(str(path), timeout=30)
    with con:
        con.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)")
        version = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        if version is not None and version[0] != str(SCHEMA_VERSION):
            con.execute("DROP TABLE IF EXISTS models")
            con.execute("DROP TABLE IF EXISTS skipped")
        con.execute(
            "CREATE TABLE IF NOT EXISTS models (path TEXT PRIMARY KEY, name TEXT NOT NULL, source TEXT NOT NULL, "
            "format TEXT NOT NULL, repo_id TEXT, revision TEXT, is_main INTEGER NOT NULL DEFAULT 0, model_type TEXT, "
            "supported INTEGER NOT NULL, note TEXT, params INTEGER, weight_bytes INTEGER, dtype TEXT, "
            "quantization TEXT, context_length INTEGER, chat_template INTEGER NOT NULL DEFAULT 0, "
            "tools INTEGER NOT NULL DEFAULT 0, files TEXT NOT NULL DEFAULT '[]', scanned_at REAL, "
            "fingerprint TEXT NOT NULL DEFAULT '')"
        )
        con.execute("CREATE INDEX IF NOT EXISTS models_name ON models (name COLLATE NOCASE)")
        con.execute("CREATE INDEX IF NOT EXISTS models_repo_id ON models (repo_id COLLATE NOCASE)")
        con.execute("CREATE TABLE IF NOT EXISTS skipped (path TEXT PRIMARY KEY, fingerprint TEXT, why TEXT)")
        con.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
    return con


def _entry(r: Sequence[Any]) -> Entry:
    d = dict(zip(_COLUMNS, r))
    d["files"] = tuple(json.loads(d["files"] or "[]"))
    for b in ("is_main", "supported", "chat_template", "tools"):
        d[b] = bool(d[b])
    e = Entry(**d)
    e.stale = bool(e.gone())
    return e


def _query(db: Path | None, where: str = "", args: Sequence[Any] = ()) -> list[Entry]:
    path = db or db_path()
    if not path.exists():
        return []
    con = _connect(path)
    try:
        rows = con.execute(f"SELECT {', '.join(_COLUMNS)} FROM models {where} ORDER BY name, revision", args).fetchall()
    finally:
        con.close()
    return [_entry(r) for r in rows]


#: The exact-name lookup: a name or repo id (any case, through their indexes) or a path.
EXACT_WHERE = "WHERE name = ?1 COLLATE NOCASE OR repo_id = ?1 COLLATE NOCASE OR path = ?1"


def entries(db: Path | None = None) -> list[Entry]:
    """Every registered model (stale ones marked), or [] when nothing was scanned yet."""
    return _query(db)


# ---- name resolution --------------------------------------------------------------------------


def looks_like_name(model: str) -> bool:
    """Whether an argument that is not an existing path may be a registry name (not an absolute
    path, nor one starting with `.` or `~`)."""
    return bool(model) and not os.path.isabs(model) and not model.startswith((".", "~"))


def match(pattern: str, pool: Sequence[Entry]) -> list[Entry]:
    """Entries `pattern` names: an exact name, repo id, `repo@revision` or path wins; else a glob
    (when it has * ? or [); else every entry whose name contains it (case-insensitive)."""
    pat = pattern.strip()
    low = pat.lower()
    repo, _, rev = low.partition("@")
    exact = [
        e
        for e in pool
        if low in (e.name.lower(), (e.repo_id or "").lower(), e.path.lower())
        or (rev and repo in (e.name.lower(), (e.repo_id or "").lower()) and (e.revision or "").lower().startswith(rev))
    ]
    if exact:
        return exact
    if any(c in pat for c in "*?["):
        return [e for e in pool if fnmatch.fnmatch(e.name.lower(), low)]
    return [e for e in pool if low in e.name.lower()]


def _one_revision(cands: list[Entry]) -> list[Entry]:
    """Revisions of one model: the one refs/main points to, else the most recently modified."""
    keys = {(e.repo_id, e.name) for e in cands}
    if len(cands) > 1 and len(keys) == 1 and all(e.repo_id for e in cands):
        main = [e for e in cands if e.is_main]
        if main:
            return main[:1]
        return [max(cands, key=lambda e: Path(e.path).stat().st_mtime if Path(e.path).exists() else 0)]
    return cands


def _label(e: Entry) -> str:
    rev = f"@{e.revision[:7]}" if e.revision else ""
    return f"{e.name}{rev} ({e.path})" + (" [stale]" if e.stale else "")


def resolve_name(name: str, db: Path | None = None) -> Path:
    """The path of the registered model `name` designates (exact name, repo id, or a unique
    substring). Raises ModelLoadError on a miss, an ambiguous name, or a stale entry."""
    cands = _query(db, EXACT_WHERE, (name.strip(),))  # the indexed lookup first
    pool = cands or entries(db)
    cands = cands or match(name, pool)
    if not cands:
        if not pool:
            raise ModelLoadError(
                f"{name!r} is not a model directory or file, and the registry is empty: no models match {SCAN_HINT}"
            )
        raise ModelLoadError(f"{name!r} is not a model directory or file, and no models match {SCAN_HINT}")
    live = [e for e in cands if not e.stale]
    if not live:
        e = cands[0]
        gone = ", ".join(cands[0].gone()[:3])
        raise ModelLoadError(
            f"{name!r} matches {_label(e)}, a stale registry entry whose files are gone "
            f"({gone}) — download it again or run `mlxrs scan` to drop it"
        )
    live = _one_revision(live)
    if len(live) > 1:
        shown = "\n  ".join(_label(e) for e in live[:20])
        more = f"\n  … and {len(live) - 20} more" if len(live) > 20 else ""
        raise ModelLoadError(
            f"{name!r} is ambiguous: it matches {len(live)} models:\n  {shown}{more}\n"
            f"use a longer name, ORG/REPO@REVISION, or a path"
        )
    return Path(live[0].path)


# ---- output -----------------------------------------------------------------------------------


def human_count(n: int | None) -> str:
    if n is None:
        return "-"
    for div, suf in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            v = n / div
            return f"{v:.1f}{suf}" if v < 100 else f"{v:.0f}{suf}"
    return str(n)


def human_bytes(n: int | None) -> str:
    """`ls`'s and `fit`'s sizes: download.human with two digits ("-" for unknown)."""
    from .download import human

    return "-" if n is None else human(n, 2)


def table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def format_entries(es: Sequence[Entry]) -> str:
    rows = []
    for e in es:
        chat = ("tools" if e.tools else "yes") if e.chat_template else "-"
        rows.append(
            [
                e.name,
                (e.revision or "-")[:7],
                e.model_type or "-",
                "yes" if e.supported else "no",
                human_count(e.params),
                e.quantization or e.dtype or "-",
                human_bytes(e.weight_bytes),
                str(e.context_length or "-"),
                chat,
                "stale" if e.stale else "ok",
            ]
        )
    return table(rows, ["NAME", "REV", "TYPE", "MLXRS", "PARAMS", "QUANT", "SIZE", "CTX", "CHAT", "STATUS"])
