"""A fake Hugging Face Hub on loopback for the `get` and native-pack tests.

It answers what `huggingface_hub` and `mlxrs get` ask for, with the real headers:

- `GET /api/models/{repo}` and `/api/models/{repo}/revision/{rev}` (`HfApi.model_info(...,
  files_metadata=True)`): id, sha, private, gated, siblings with size, blobId and lfs {sha256,
  size, pointerSize}. Unknown repo: 401 without a token, 404 with one (X-Error-Code RepoNotFound);
  unknown revision: 404 RevisionNotFound.
- `GET|HEAD /{repo}/resolve/{rev}/{path}`: small files are served directly (ETag = git blob id,
  X-Repo-Commit, Accept-Ranges, Range → 206 + Content-Range); LFS files answer 302 to
  `/cdn/{sha256}` with X-Linked-Etag (sha256), X-Linked-Size and X-Repo-Commit, like the Hub's CDN
  redirect. Gated repos: 401 without a token, 403 with a token that has no access (X-Error-Code
  GatedRepo). Missing files: 404 EntryNotFound.
- `GET /cdn/{sha256}` and `GET /files/{name}` (any extra bytes, e.g. a native pack): the content,
  with ETag, Accept-Ranges, Range → 206, and 416 past the end.

Fault modes, set on the instance while it runs (all keyed by file name):

- `cut[name] = [n, ...]`: the next responses for that file stop after n body bytes and the
  connection is closed (one entry used per response).
- `flip[name] = k`: the next k responses for that file carry one flipped byte (the middle byte of
  the file, when the response covers it).
- `status[name] = [code, ...]`: the next responses for that file are that status instead.
- `delay`: seconds to sleep after each 64 KiB chunk (to make transfers overlap).

`served[name]` counts the body bytes sent for each file, `log` records (method, path, Range).
"""

from __future__ import annotations

import collections
import hashlib
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import quote, unquote, urlsplit


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256(data)}\nsize {len(data)}\n").encode()


@dataclass
class Repo:
    repo_id: str
    files: dict[str, bytes]
    lfs: set[str] = field(default_factory=set)  # names stored with Git LFS
    revisions: dict[str, str] = field(default_factory=dict)  # branch/tag -> commit
    gated: bool = False
    private: bool = False
    allowed_tokens: set[str] = field(default_factory=set)
    # per-revision file sets (commit -> files); the default revision uses `files`
    files_at: dict[str, dict[str, bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.revisions:
            self.revisions = {"main": hashlib.sha1(self.repo_id.encode() + b"main").hexdigest()}
        if not self.lfs:
            self.lfs = {n for n in self.files if n.endswith((".safetensors", ".gguf", ".bin"))}

    @property
    def main(self) -> str:
        return self.revisions["main"]

    def commit_of(self, rev: str) -> str | None:
        if rev in self.revisions:
            return self.revisions[rev]
        if rev in self.revisions.values() or rev in self.files_at:
            return rev
        return None

    def tree(self, commit: str) -> dict[str, bytes]:
        return self.files_at.get(commit, self.files)

    def sibling(self, name: str, data: bytes) -> dict[str, Any]:
        if name in self.lfs:
            ptr = lfs_pointer(data)
            return {
                "rfilename": name,
                "size": len(data),
                "blobId": git_blob_sha1(ptr),
                "lfs": {"sha256": sha256(data), "size": len(data), "pointerSize": len(ptr)},
            }
        return {"rfilename": name, "size": len(data), "blobId": git_blob_sha1(data)}


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.extra: dict[str, bytes] = {}  # /files/{name}
        self.cut: dict[str, list[int]] = collections.defaultdict(list)
        self.flip: dict[str, int] = collections.defaultdict(int)
        self.status: dict[str, list[int]] = collections.defaultdict(list)
        self.delay = 0.0
        self.served: collections.Counter[str] = collections.Counter()
        self.log: list[tuple[str, str, str | None]] = []
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def add(self, repo: Repo) -> Repo:
        self.repos[repo.repo_id] = repo
        return repo

    def requests_for(self, name: str) -> list[tuple[str, str, str | None]]:
        with self.lock:
            return [r for r in self.log if r[1].endswith("/" + quote(name)) or r[1].endswith("/" + name)]

    def reset_counts(self) -> None:
        with self.lock:
            self.served.clear()
            self.log.clear()

    # -- plumbing ---------------------------------------------------------------------------------

    def _take(self, table: dict[str, Any], name: str) -> Any:
        with self.lock:
            v = table.get(name)
            if isinstance(v, list):
                return v.pop(0) if v else None
            if isinstance(v, int) and v > 0:
                table[name] = v - 1
                return True
            return None

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: object) -> None:  # quiet
                pass

            def token(self) -> str | None:
                a = self.headers.get("Authorization", "")
                return a[7:] if a.startswith("Bearer ") else None

            def reply(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def error(self, status: int, code: str | None, message: str) -> None:
                h = {"Content-Type": "application/json", "X-Error-Message": message}
                if code:
                    h["X-Error-Code"] = code
                self.reply(status, json.dumps({"error": message}).encode(), h)

            def do_HEAD(self) -> None:
                self.route()

            def do_GET(self) -> None:
                self.route()

            def route(self) -> None:
                path = urlsplit(self.path).path
                with hub.lock:
                    hub.log.append((self.command, path, self.headers.get("Range")))
                try:
                    if path.startswith("/api/models/"):
                        return self.api(unquote(path[len("/api/models/") :]))
                    if path.startswith("/cdn/"):
                        sha = path[len("/cdn/") :]
                        for repo in hub.repos.values():
                            for tree in [repo.files, *repo.files_at.values()]:
                                for name, data in tree.items():
                                    if sha256(data) == sha:
                                        return self.body(name, data, {"ETag": f'"{sha}"'})
                        return self.error(404, None, "no such object")
                    if path.startswith("/files/"):
                        name = unquote(path[len("/files/") :])
                        if name not in hub.extra:
                            return self.error(404, None, "not found")
                        return self.body(name, hub.extra[name], {"ETag": f'"{sha256(hub.extra[name])}"'})
                    if "/resolve/" in path:
                        return self.resolve(path)
                    self.error(404, None, "not found")
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True

            def access(self, repo: Repo) -> tuple[int, str, str] | None:
                tok = self.token()
                if not (repo.gated or repo.private) or (tok is not None and tok in repo.allowed_tokens):
                    return None
                if repo.private:
                    return (401 if tok is None else 404, "RepoNotFound", "Repository not found")
                if tok is None:
                    return (
                        401,
                        "GatedRepo",
                        f"Access to model {repo.repo_id} is restricted. You must have access "
                        "to it and be authenticated to access it. Please log in.",
                    )
                return (
                    403,
                    "GatedRepo",
                    f"Access to model {repo.repo_id} is restricted and you are not in the "
                    "authorized list. Visit the repo page to ask for access.",
                )

            def api(self, rest: str) -> None:
                repo_id, _, rev = rest.partition("/revision/")
                repo = hub.repos.get(repo_id)
                if repo is None:
                    return self.error(401 if self.token() is None else 404, "RepoNotFound", "Repository not found")
                denied = self.access(repo)
                if denied and repo.private:
                    return self.error(*denied)
                commit = repo.commit_of(unquote(rev) if rev else "main")
                if commit is None:
                    return self.error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                info = {
                    "_id": "0" * 24,
                    "id": repo_id,
                    "modelId": repo_id,
                    "author": repo_id.split("/")[0],
                    "sha": commit,
                    "lastModified": "2026-01-01T00:00:00.000Z",
                    "private": repo.private,
                    "gated": "manual" if repo.gated else False,
                    "disabled": False,
                    "tags": [],
                    "siblings": [repo.sibling(n, d) for n, d in repo.tree(commit).items()],
                }
                self.reply(200, json.dumps(info).encode(), {"Content-Type": "application/json"})

            def resolve(self, path: str) -> None:
                before, _, after = path.partition("/resolve/")
                repo = hub.repos.get(unquote(before.lstrip("/")))
                if repo is None:
                    return self.error(401 if self.token() is None else 404, "RepoNotFound", "Repository not found")
                denied = self.access(repo)
                if denied:
                    return self.error(*denied)
                rev, _, name = after.partition("/")
                rev, name = unquote(rev), unquote(name)
                commit = repo.commit_of(rev)
                if commit is None:
                    return self.error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                tree = repo.tree(commit)
                forced = hub._take(hub.status, name)
                if forced:
                    code = {404: "EntryNotFound", 401: "GatedRepo", 403: "GatedRepo"}.get(forced)
                    return self.error(forced, code, f"forced {forced}")
                if name not in tree:
                    return self.error(404, "EntryNotFound", f"{name} does not exist on {rev}")
                data = tree[name]
                common = {"X-Repo-Commit": commit, "Accept-Ranges": "bytes"}
                if name in repo.lfs:
                    ptr = lfs_pointer(data)
                    self.reply(
                        302,
                        b"",
                        {
                            **common,
                            "Location": f"/cdn/{sha256(data)}?X-Amz-Signature=fake",
                            "X-Linked-Etag": f'"{sha256(data)}"',
                            "X-Linked-Size": str(len(data)),
                            "ETag": f'"{git_blob_sha1(ptr)}"',
                        },
                    )
                    return
                self.body(name, data, {**common, "ETag": f'"{git_blob_sha1(data)}"'})

            def body(self, name: str, data: bytes, headers: dict[str, str]) -> None:
                size = len(data)
                start, end = 0, size - 1
                rng = self.headers.get("Range")
                status = 200
                if rng and rng.startswith("bytes="):
                    a, _, b = rng[6:].partition("-")
                    start = int(a) if a else 0
                    end = min(int(b), size - 1) if b else size - 1
                    if start >= size:
                        return self.reply(416, b"", {**headers, "Content-Range": f"bytes */{size}"})
                    status = 206
                forced = hub._take(hub.status, name)
                if forced:
                    return self.error(forced, None, f"forced {forced}")
                body = bytearray(data[start : end + 1])
                if hub._take(hub.flip, name):
                    mid = size // 2
                    if start <= mid <= end:
                        body[mid - start] ^= 0xFF
                cut = hub._take(hub.cut, name)
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Content-Type", "application/octet-stream")
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
                self.end_headers()
                if self.command == "HEAD":
                    return
                limit = len(body) if cut is None else min(cut, len(body))
                pos = 0
                while pos < limit:
                    chunk = body[pos : min(limit, pos + 65536)]
                    self.wfile.write(chunk)
                    self.wfile.flush()
                    with hub.lock:
                        hub.served[name] += len(chunk)
                    pos += len(chunk)
                    if hub.delay:
                        time.sleep(hub.delay)
                if cut is not None:
                    self.close_connection = True
                    try:
                        self.connection.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        return H


def payload(n: int, seed: int = 0) -> bytes:
    """n deterministic, incompressible-looking bytes."""
    out = bytearray()
    i = 0
    while len(out) < n:
        out += hashlib.sha256(b"%d:%d" % (seed, i)).digest()
        i += 1
    return bytes(out[:n])
