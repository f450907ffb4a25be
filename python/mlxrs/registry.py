"""The model registry: `mlxrs scan` records every loadable model it finds in the Hugging Face hub
cache and in `MLXRS_MODEL_DIRS`, `mlxrs ls` lists them, and `serve`/`fit`/`Session` accept a
registry name (or a unique substring of one) wherever a path is expected.

Everything is read from metadata: config.json, tokenizer_config.json, the safetensors headers (the
8-byte length and the JSON header, never tensor data) and GGUF headers. The registry is a sqlite
database at `$MLXRS_HOME/registry.sqlite` (default `~/.cache/mlxrs/registry.sqlite`).
"""
from __future__ import annotations

import fnmatch
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

SCHEMA_VERSION = 1
SCAN_HINT = "(try `mlxrs scan`)"
#: How deep below an `MLXRS_MODEL_DIRS` entry model directories and .gguf files are looked for.
MODEL_DIRS_DEPTH = 3


#: llama.cpp's `general.file_type` (enum llama_ftype in llama.h).
GGUF_FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
    19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
    26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16",
    36: "TQ1_0", 37: "TQ2_0",
}

_ST_DTYPE_BITS = {"F64": 64, "I64": 64, "U64": 64, "F32": 32, "I32": 32, "U32": 32, "F16": 16, "BF16": 16,
                  "I16": 16, "U16": 16, "I8": 8, "U8": 8, "BOOL": 8, "F8_E4M3": 8, "F8_E5M2": 8}
_ST_DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


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

def hub_cache() -> Path:
    """The Hugging Face hub cache, resolved as huggingface_hub does: HF_HUB_CACHE, else
    HF_HOME/hub, else ~/.cache/huggingface/hub (XDG_CACHE_HOME honoured like huggingface_hub)."""
    env = os.environ.get("HF_HUB_CACHE")
    if env:
        return Path(env).expanduser()
    home = os.environ.get("HF_HOME")
    if home:
        return Path(home).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def model_dirs() -> list[Path]:
    """The extra roots of `MLXRS_MODEL_DIRS` (os.pathsep-separated)."""
    raw = os.environ.get("MLXRS_MODEL_DIRS", "")
    return [Path(p).expanduser() for p in raw.split(os.pathsep) if p.strip()]


def db_path() -> Path:
    from .models import mlxrs_home

    return mlxrs_home() / "registry.sqlite"


# ---- metadata readers -------------------------------------------------------------------------

def safetensors_header(path: Path) -> dict[str, Any]:
    """The validated header of a safetensors file, {name: {"dtype", "shape", "data_offsets"}}: the
    one reader the loader and the planner use (crates/mlxrs-core/src/safetensors.rs), which refuses
    offsets, dtypes and shapes that disagree. Raises ValueError saying why."""
    from . import _native
    from .errors import MlxrsError

    try:
        return dict(json.loads(_native._safetensors_header(str(path))))
    except MlxrsError as e:
        raise ValueError(str(e)) from None


def _weight_files(d: Path) -> list[str]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            wm = json.loads(index.read_text()).get("weight_map", {})
            files = sorted(set(wm.values()))
            if files:
                return files
        except (OSError, ValueError):
            pass
    return sorted(p.name for p in d.glob("*.safetensors"))


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    tc = cfg.get("text_config")
    return tc if isinstance(tc, dict) else cfg


def _quantization(cfg: dict[str, Any]) -> str | None:
    q = cfg.get("quantization")
    if isinstance(q, dict) and q.get("bits"):
        mode = q.get("mode", "affine")
        return f"{q['bits']}-bit" + (f" g{q['group_size']}" if q.get("group_size") else "") + \
            ("" if mode == "affine" else f" {mode}")
    qc = cfg.get("quantization_config")
    if isinstance(qc, dict):
        method = qc.get("quant_method") or qc.get("quant_type") or "quantized"
        bits = qc.get("bits") or qc.get("weight_bits")
        return f"{method} {bits}-bit" if bits else str(method)
    return None


def _chat_template(d: Path) -> str | None:
    """The chat template text: tokenizer_config.json's chat_template (string or named list),
    else chat_template.jinja / chat_template.json."""
    texts: list[str] = []
    try:
        tc = json.loads((d / "tokenizer_config.json").read_text())
        ct = tc.get("chat_template") if isinstance(tc, dict) else None
        if isinstance(ct, str):
            texts.append(ct)
        elif isinstance(ct, list):
            texts += [str(t.get("template", "")) for t in ct if isinstance(t, dict)]
    except (OSError, ValueError):
        pass
    jinja = d / "chat_template.jinja"
    if jinja.is_file():
        texts.append(jinja.read_text(errors="replace"))
    cj = d / "chat_template.json"
    if cj.is_file():
        try:
            v = json.loads(cj.read_text())
            texts.append(str(v.get("chat_template", "")) if isinstance(v, dict) else "")
        except ValueError:
            pass
    text = "\n".join(t for t in texts if t)
    return text or None


def _supported_types() -> list[str]:
    from . import _native

    return list(_native.SUPPORTED_MODEL_TYPES)


def gguf_architectures() -> dict[str, str]:
    """GGUF `general.architecture` → the HF model_type mlxrs imports it as (from the Rust
    architecture table, models/arch.rs, through the extension)."""
    from . import _native

    return dict(_native.GGUF_ARCHITECTURES)


def inspect_dir(d: Path, supported: Sequence[str]) -> Entry:
    """An entry for a model directory; raises ValueError saying why it is not loadable."""
    cfg_path = d / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except OSError as e:
        raise ValueError(f"config.json: {e.strerror or e}") from None
    except ValueError as e:
        raise ValueError(f"config.json is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError("config.json is not a JSON object")
    files = _weight_files(d)
    if not files:
        raise ValueError("no *.safetensors weights")
    tensors: dict[str, tuple[str, list[int], int]] = {}
    for f in files:
        fp = d / f
        if not fp.exists():
            raise ValueError(f"{f} is missing (an incomplete download?)")
        try:
            head = safetensors_header(fp)
        except (OSError, ValueError) as e:
            raise ValueError(f"{f}: {e}") from None
        for k, t in head.items():
            if k == "__metadata__" or not isinstance(t, dict):
                continue
            offs = t.get("data_offsets") or [0, 0]
            tensors[k] = (str(t.get("dtype", "")), [int(x) for x in t.get("shape", [])], int(offs[1]) - int(offs[0]))
    tcfg = _text_config(cfg)
    quant = cfg.get("quantization") if isinstance(cfg.get("quantization"), dict) else None
    params = 0
    for k, (dt, shape, _) in tensors.items():
        n = math.prod(shape) if shape else 1
        base = k.rsplit(".", 1)[0]
        if k.endswith((".scales", ".biases")) and f"{base}.weight" in tensors and f"{base}.scales" in tensors:
            continue  # quantization parameters, not model parameters
        if quant and f"{base}.scales" in tensors and dt in ("U32", "U8", "I32"):
            q = quant.get(base, quant) if isinstance(quant.get(base), dict) else quant
            n = n * _ST_DTYPE_BITS.get(dt, 32) // int(q.get("bits", 4))
        params += n
    # the float dtype: torch_dtype, else the most common float dtype in the headers
    dtype = tcfg.get("torch_dtype") or cfg.get("torch_dtype") or cfg.get("dtype")
    if not isinstance(dtype, str):
        counts: dict[str, int] = {}
        for dt, _, nb in tensors.values():
            if dt in _ST_DTYPE_NAMES:
                counts[dt] = counts.get(dt, 0) + nb
        dtype = _ST_DTYPE_NAMES[max(counts, key=lambda x: counts[x])] if counts else None
    model_type = cfg.get("model_type")
    notes = []
    ok = isinstance(model_type, str) and model_type in supported
    if not ok:
        notes.append(f"model_type {model_type!r} is not supported" if model_type else "config.json has no model_type")
    if not (d / "tokenizer.json").is_file():
        ok = False
        notes.append("no tokenizer.json")
    template = _chat_template(d)
    ctx = None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        v = tcfg.get(key, cfg.get(key))
        if isinstance(v, int) and v > 0:
            ctx = v
            break
    return Entry(
        path=str(d), name=d.name, source="model-dirs", format="safetensors",
        model_type=model_type if isinstance(model_type, str) else None, supported=ok,
        note="; ".join(notes) or None, params=params, weight_bytes=sum(t[2] for t in tensors.values()),
        dtype=dtype, quantization=_quantization(cfg), context_length=ctx,
        chat_template=template is not None, tools=bool(template and "tools" in template), files=tuple(files),
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
        path=str(p), name=p.name, source="model-dirs", format="gguf", model_type=model_type or arch,
        supported=not notes, note="; ".join(notes) or None, params=params,
        weight_bytes=max(p.stat().st_size - int(data_offset), 0), dtype=None, quantization=quant,
        context_length=ctx if isinstance(ctx, int) else None,
        chat_template=isinstance(template, str) and bool(template),
        tools=isinstance(template, str) and "tools" in template, files=(p.name,),
    )


# ---- scanning ---------------------------------------------------------------------------------

@dataclass
class ScanResult:
    entries: list[Entry]
    skipped: list[tuple[str, str]]  # (path, why)
    roots: list[str]


def _hub_repos(hub: Path) -> Iterator[tuple[str, Path]]:
    if not hub.is_dir():
        return
    for d in sorted(hub.iterdir()):
        if d.is_dir() and d.name.startswith("models--"):
            yield d.name[len("models--"):].replace("--", "/"), d


def _scan_hub(hub: Path, supported: Sequence[str], out: ScanResult) -> None:
    for repo_id, d in _hub_repos(hub):
        refs: dict[str, str] = {}
        refs_dir = d / "refs"
        if refs_dir.is_dir():
            for r in refs_dir.rglob("*"):
                if r.is_file():
                    try:
                        refs[r.read_text().strip()] = str(r.relative_to(refs_dir))
                    except OSError:
                        pass
        snaps = d / "snapshots"
        if not snaps.is_dir():
            continue
        for snap in sorted(snaps.iterdir()):
            if not snap.is_dir():
                continue
            rev = snap.name
            is_main = refs.get(rev) == "main"
            if (snap / "config.json").exists() or any(snap.glob("*.safetensors")):
                try:
                    e = inspect_dir(snap, supported)
                except ValueError as why:
                    out.skipped.append((str(snap), f"{repo_id}@{rev[:7]}: {why}"))
                else:
                    e.name, e.repo_id, e.revision, e.is_main, e.source = repo_id, repo_id, rev, is_main, "hf-cache"
                    out.entries.append(e)
            for g in sorted(snap.rglob("*.gguf")):
                try:
                    e = inspect_gguf(g)
                except (OSError, ValueError) as why:
                    out.skipped.append((str(g), str(why)))
                    continue
                rel = g.relative_to(snap).as_posix()
                e.name, e.repo_id, e.revision, e.is_main, e.source = f"{repo_id}/{rel}", repo_id, rev, is_main, "hf-cache"
                out.entries.append(e)


def _scan_dir(root: Path, supported: Sequence[str], out: ScanResult) -> None:
    if root.is_file():
        candidates: list[tuple[Path, int]] = [(root, 0)]
    elif root.is_dir():
        candidates = [(root, 0)]
    else:
        out.skipped.append((str(root), "MLXRS_MODEL_DIRS entry does not exist"))
        return
    while candidates:
        p, depth = candidates.pop(0)
        if p.is_file():
            if p.suffix.lower() == ".gguf":
                try:
                    out.entries.append(inspect_gguf(p))
                except (OSError, ValueError) as why:
                    out.skipped.append((str(p), str(why)))
            continue
        if (p / "config.json").exists():
            try:
                out.entries.append(inspect_dir(p, supported))
            except ValueError as why:
                out.skipped.append((str(p), str(why)))
            continue  # a model directory is not searched further
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


def scan(*, hub: Path | None = None, extra: Sequence[Path] | None = None, db: Path | None = None) -> ScanResult:
    """Walk the hub cache and `MLXRS_MODEL_DIRS`, and replace the registry's contents with what is
    found there."""
    supported = _supported_types()
    hub = hub or hub_cache()
    extra = list(model_dirs() if extra is None else extra)
    out = ScanResult([], [], [str(hub), *map(str, extra)])
    _scan_hub(hub, supported, out)
    for root in extra:
        _scan_dir(root, supported, out)
    # one entry per path (a directory listed twice, or inside the hub cache too)
    seen: dict[str, Entry] = {}
    for e in out.entries:
        seen.setdefault(str(Path(e.path).resolve()), e)
    out.entries = list(seen.values())
    now = time.time()
    for e in out.entries:
        e.scanned_at = now
    _write(db or db_path(), out)
    return out


# ---- the database -----------------------------------------------------------------------------

_COLUMNS = ("path", "name", "source", "format", "repo_id", "revision", "is_main", "model_type", "supported",
            "note", "params", "weight_bytes", "dtype", "quantization", "context_length", "chat_template",
            "tools", "files", "scanned_at")


def _connect(path: Path) -> sqlite3.Connection:
    path.parent.mkdir(parents=True, exist_ok=True)
    con = sqlite3.connect(str(path), timeout=30)
    con.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)")
    con.execute(
        "CREATE TABLE IF NOT EXISTS models (path TEXT PRIMARY KEY, name TEXT NOT NULL, source TEXT NOT NULL, "
        "format TEXT NOT NULL, repo_id TEXT, revision TEXT, is_main INTEGER NOT NULL DEFAULT 0, model_type TEXT, "
        "supported INTEGER NOT NULL, note TEXT, params INTEGER, weight_bytes INTEGER, dtype TEXT, "
        "quantization TEXT, context_length INTEGER, chat_template INTEGER NOT NULL DEFAULT 0, "
        "tools INTEGER NOT NULL DEFAULT 0, files TEXT NOT NULL DEFAULT '[]', scanned_at REAL)")
    con.execute("CREATE TABLE IF NOT EXISTS skipped (path TEXT PRIMARY KEY, why TEXT)")
    return con


def _write(path: Path, res: ScanResult) -> None:
    con = _connect(path)
    try:
        with con:
            con.execute("DELETE FROM models")
            con.execute("DELETE FROM skipped")
            for e in res.entries:
                row = e.to_json()
                row["files"] = json.dumps(row["files"])
                con.execute(f"INSERT INTO models ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})",
                            [row[c] for c in _COLUMNS])
            con.executemany("INSERT OR REPLACE INTO skipped VALUES (?, ?)", res.skipped)
            for k, v in (("schema_version", str(SCHEMA_VERSION)), ("scanned_at", str(time.time())),
                         ("roots", json.dumps(res.roots))):
                con.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (k, v))
    finally:
        con.close()


def entries(db: Path | None = None) -> list[Entry]:
    """Every registered model (stale ones marked), or [] when nothing was scanned yet."""
    path = db or db_path()
    if not path.exists():
        return []
    con = _connect(path)
    try:
        rows = con.execute(f"SELECT {', '.join(_COLUMNS)} FROM models ORDER BY name, revision").fetchall()
    finally:
        con.close()
    out = []
    for r in rows:
        d = dict(zip(_COLUMNS, r))
        d["files"] = tuple(json.loads(d["files"] or "[]"))
        for b in ("is_main", "supported", "chat_template", "tools"):
            d[b] = bool(d[b])
        e = Entry(**d)
        e.stale = bool(e.gone())
        out.append(e)
    return out


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
    exact = [e for e in pool
             if low in (e.name.lower(), (e.repo_id or "").lower(), e.path.lower())
             or (rev and repo in (e.name.lower(), (e.repo_id or "").lower())
                 and (e.revision or "").lower().startswith(rev))]
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
    pool = entries(db)
    cands = match(name, pool)
    if not cands:
        if not pool:
            raise ModelLoadError(f"{name!r} is not a model directory or file, and the registry is empty: "
                                 f"no models match {SCAN_HINT}")
        raise ModelLoadError(f"{name!r} is not a model directory or file, and no models match {SCAN_HINT}")
    live = [e for e in cands if not e.stale]
    if not live:
        e = cands[0]
        gone = ", ".join(cands[0].gone()[:3])
        raise ModelLoadError(f"{name!r} matches {_label(e)}, a stale registry entry whose files are gone "
                             f"({gone}) — download it again or run `mlxrs scan` to drop it")
    live = _one_revision(live)
    if len(live) > 1:
        shown = "\n  ".join(_label(e) for e in live[:20])
        more = f"\n  … and {len(live) - 20} more" if len(live) > 20 else ""
        raise ModelLoadError(f"{name!r} is ambiguous: it matches {len(live)} models:\n  {shown}{more}\n"
                             f"use a longer name, ORG/REPO@REVISION, or a path")
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
    if n is None:
        return "-"
    for div, suf in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= div:
            return f"{n / div:.2f} {suf}"
    return f"{n} B"


def table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def format_entries(es: Sequence[Entry]) -> str:
    rows = []
    for e in es:
        chat = ("tools" if e.tools else "yes") if e.chat_template else "-"
        rows.append([
            e.name, (e.revision or "-")[:7], e.model_type or "-", "yes" if e.supported else "no",
            human_count(e.params), e.quantization or e.dtype or "-", human_bytes(e.weight_bytes),
            str(e.context_length or "-"), chat, "stale" if e.stale else "ok",
        ])
    return table(rows, ["NAME", "REV", "TYPE", "MLXRS", "PARAMS", "QUANT", "SIZE", "CTX", "CHAT", "STATUS"])
