"""`python -m mlxrs get` against a fake Hugging Face Hub on loopback (tests/fakehub.py): the hub
cache layout read back by huggingface_hub, resume after a cut connection (within a run and across
runs) without refetching verified bytes, a flipped byte refetched then reported, 401/403/404
messages, the disk-space refusal, two concurrent `get`s of one repo, --include and --revision."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from fakehub import FakeHub, Repo, git_blob_sha1, payload, sha256

huggingface_hub = pytest.importorskip("huggingface_hub")

from mlxrs import hub as mhub  # noqa: E402
from mlxrs.download import GiB, Progress  # noqa: E402
from mlxrs.errors import DownloadError  # noqa: E402

MODEL = payload(3_000_000, seed=1)
SHARD2 = payload(1_200_000, seed=2)
CONFIG = b'{"model_type": "llama", "hidden_size": 64}\n'
TOKENIZER = payload(40_000, seed=3)  # a small (non-LFS) file: git blob sha1
README = b"# a model\n"


def files() -> dict[str, bytes]:
    return {
        "config.json": CONFIG,
        "tokenizer.json": TOKENIZER,
        "model-00001-of-00002.safetensors": MODEL,
        "model-00002-of-00002.safetensors": SHARD2,
        "README.md": README,
        "sub/dir/notes.txt": README,  # same content as README.md: one blob, two paths
    }


@pytest.fixture
def fake():
    with FakeHub() as h:
        h.add(Repo("org/model", files()))
        h.add(
            Repo("org/gated", {"config.json": CONFIG, "w.safetensors": SHARD2}, gated=True, allowed_tokens={"hf_good"})
        )
        h.add(Repo("org/private", {"config.json": CONFIG}, private=True, allowed_tokens={"hf_good"}))
        yield h


@pytest.fixture
def env(tmp_path: Path, fake: FakeHub) -> dict[str, str]:
    e = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HF_", "MLXRS_", "HUGGINGFACE_"))
        and k.lower() not in ("http_proxy", "https_proxy", "all_proxy")
    }
    e.update(
        HF_ENDPOINT=fake.url,
        HF_HOME=str(tmp_path / "hf"),
        MLXRS_HOME=str(tmp_path / "mlxrs"),
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
        HF_HUB_DISABLE_TELEMETRY="1",
    )
    return e


def cache_of(env: dict[str, str]) -> Path:
    return Path(env["HF_HUB_CACHE"]) if "HF_HUB_CACHE" in env else Path(env["HF_HOME"]) / "hub"


def get(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mlxrs", "get", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def ok(r: subprocess.CompletedProcess[str]) -> Path:
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    return Path(r.stdout.strip().splitlines()[-1])


def fail(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, r.stderr
    return lines[0]


def check_snapshot(snap: Path, want: dict[str, bytes]) -> None:
    blobs = snap.parent.parent / "blobs"
    for name, data in want.items():
        p = snap / name
        assert p.is_symlink(), name
        target = os.readlink(p)
        assert not os.path.isabs(target) and target.startswith("../"), target  # relative, like huggingface_hub
        assert p.resolve().parent == blobs.resolve()
        assert p.read_bytes() == data, name
    assert not list(blobs.glob("*.incomplete"))


def read_back(cache: Path, repo_id: str, commit: str, want: dict[str, bytes], refs: set[str]) -> None:
    info = huggingface_hub.scan_cache_dir(cache)
    assert not info.warnings, info.warnings
    (repo,) = [r for r in info.repos if r.repo_id == repo_id]
    assert repo.repo_type == "model"
    (rev,) = repo.revisions
    assert rev.commit_hash == commit
    assert set(rev.refs) == refs
    assert {f.file_name for f in rev.files} == {n.rsplit("/", 1)[-1] for n in want}
    unique = {sha256(d): len(d) for d in want.values()}
    assert repo.size_on_disk == sum(unique.values())
    assert rev.nb_files == len(want)
    assert {f.blob_path.name for f in rev.files} <= {
        sha256(d) if n.endswith(".safetensors") else git_blob_sha1(d) for n, d in want.items()
    }


def test_get_lays_out_the_hub_cache_and_huggingface_hub_reads_it(fake: FakeHub, env: dict[str, str]) -> None:
    r = get(env, "org/model")
    snap = ok(r)
    repo = fake.repos["org/model"]
    cache = cache_of(env)  # HF_HOME/hub: HF_HUB_CACHE is not set
    assert snap == cache / "models--org--model" / "snapshots" / repo.main
    check_snapshot(snap, files())
    assert (cache / "models--org--model" / "refs" / "main").read_text() == repo.main
    # blobs are named like huggingface_hub names them: LFS sha256, else the git blob id
    blobs = {p.name for p in (cache / "models--org--model" / "blobs").iterdir()}
    assert blobs == {
        sha256(MODEL),
        sha256(SHARD2),
        git_blob_sha1(CONFIG),
        git_blob_sha1(TOKENIZER),
        git_blob_sha1(README),
    }
    read_back(cache, "org/model", repo.main, files(), {"main"})
    # huggingface_hub resolves the same snapshot offline
    again = huggingface_hub.snapshot_download("org/model", cache_dir=cache, local_files_only=True)
    assert Path(again) == snap
    # every file crossed the wire exactly once (the shared blob once for both paths)
    assert fake.served["model-00001-of-00002.safetensors"] == len(MODEL)
    assert fake.served["model-00002-of-00002.safetensors"] == len(SHARD2)
    assert fake.served["config.json"] == len(CONFIG)
    assert fake.served["README.md"] + fake.served["sub/dir/notes.txt"] == len(README)
    # LFS files went through the CDN redirect
    assert any(p.startswith("/cdn/") for _, p, _ in fake.log)
    assert "fetched 5 file(s)" in r.stderr
    # a second run transfers nothing
    fake.reset_counts()
    r2 = get(env, "org/model")
    assert ok(r2) == snap
    assert sum(fake.served.values()) == 0
    assert "all present" in r2.stderr
    assert not [p for _, p, _ in fake.log if "/resolve/" in p]


def test_a_connection_cut_mid_file_is_resumed_in_the_same_run(fake: FakeHub, env: dict[str, str]) -> None:
    name = "model-00001-of-00002.safetensors"
    fake.cut[name] = [1_000_000, 500_000]  # two cuts in a row, each after some progress
    snap = ok(get(env, "org/model"))
    check_snapshot(snap, files())
    # identical bytes, and nothing fetched twice: the body bytes sent add up to the file
    assert fake.served[name] == len(MODEL)
    ranges = [rng for _, p, rng in fake.log if p.startswith("/cdn/" + sha256(MODEL))]
    assert ranges == [None, "bytes=1000000-", "bytes=1500000-"]


def test_a_cut_run_leaves_a_partial_file_that_the_next_run_resumes(fake: FakeHub, env: dict[str, str]) -> None:
    name = "model-00001-of-00002.safetensors"
    env = {**env, "MLXRS_DOWNLOAD_RETRIES": "0"}
    fake.cut[name] = [1_234_567]
    msg = fail(get(env, "org/model"))
    assert name in msg and "1234567 bytes received so far are kept" in msg, msg
    assert "run the same command again to resume" in msg
    blobs = cache_of(env) / "models--org--model" / "blobs"
    part = blobs / (sha256(MODEL) + ".incomplete")
    assert part.stat().st_size == 1_234_567
    assert part.read_bytes() == MODEL[:1_234_567]
    done_before = {n: c for n, c in fake.served.items() if n != name}
    fake.reset_counts()
    r = get(env, "org/model")
    snap = ok(r)
    check_snapshot(snap, files())
    assert "resumed at" in r.stderr
    # the second run asked only for the rest of the cut file, and nothing for files already verified
    assert fake.served[name] == len(MODEL) - 1_234_567
    assert [rng for _, p, rng in fake.log if p.startswith("/cdn/" + sha256(MODEL))] == ["bytes=1234567-"]
    for n in done_before:
        assert fake.served[n] == 0, n
    read_back(cache_of(env), "org/model", fake.repos["org/model"].main, files(), {"main"})


def test_a_flipped_byte_is_detected_and_refetched(fake: FakeHub, env: dict[str, str]) -> None:
    fake.flip["model-00001-of-00002.safetensors"] = 1  # sha256 (LFS)
    fake.flip["tokenizer.json"] = 1  # git blob sha1
    r = get(env, "org/model")
    snap = ok(r)
    check_snapshot(snap, files())
    assert fake.served["model-00001-of-00002.safetensors"] == 2 * len(MODEL)
    assert fake.served["tokenizer.json"] == 2 * len(TOKENIZER)
    assert r.stderr.count("failed verification once, fetched again") == 2, r.stderr


def test_a_file_that_fails_verification_twice_is_named_and_dropped(fake: FakeHub, env: dict[str, str]) -> None:
    fake.flip["tokenizer.json"] = 2
    msg = fail(get(env, "org/model"))
    assert msg.startswith("error: tokenizer.json failed verification twice"), msg
    assert f"expected git-blob sha1 {git_blob_sha1(TOKENIZER)}" in msg
    blobs = cache_of(env) / "models--org--model" / "blobs"
    assert not (blobs / git_blob_sha1(TOKENIZER)).exists()
    assert not (blobs / (git_blob_sha1(TOKENIZER) + ".incomplete")).exists()
    assert fake.served["tokenizer.json"] == 2 * len(TOKENIZER)
    # nothing is left half-done: a clean rerun completes
    snap = ok(get(env, "org/model"))
    check_snapshot(snap, files())


def test_gated_repo_without_a_token_is_401_with_what_to_do(fake: FakeHub, env: dict[str, str]) -> None:
    msg = fail(get(env, "org/gated"))
    assert "401 Unauthorized" in msg and "hf auth login" in msg and "HF_TOKEN" in msg, msg
    assert "config.json" in msg  # names the file


def test_gated_repo_with_a_token_without_access_is_403_with_what_to_do(fake: FakeHub, env: dict[str, str]) -> None:
    msg = fail(get({**env, "HF_TOKEN": "hf_other"}, "org/gated"))
    assert "403 Forbidden" in msg and "accept its terms" in msg and "HF_TOKEN" in msg, msg


def test_the_token_comes_from_HF_TOKEN_or_the_token_file(fake: FakeHub, env: dict[str, str]) -> None:
    ok(get({**env, "HF_TOKEN": "hf_good"}, "org/gated", "--include", "config.json"))
    token_file = Path(env["HF_HOME"]) / "token"  # where `hf auth login` writes it
    token_file.parent.mkdir(parents=True, exist_ok=True)
    token_file.write_text("hf_good\n")
    snap = ok(get(env, "org/gated"))
    assert (snap / "w.safetensors").read_bytes() == SHARD2  # only a request with the token gets these bytes


def test_missing_and_private_repos_say_what_to_do(fake: FakeHub, env: dict[str, str]) -> None:
    msg = fail(get(env, "org/nope"))
    assert "org/nope was not found" in msg and "hf auth login" in msg, msg
    msg = fail(get(env, "org/private"))
    assert "org/private was not found" in msg and "hf auth login" in msg, msg
    msg = fail(get({**env, "HF_TOKEN": "hf_other"}, "org/private"))
    assert "your token has no access" in msg, msg
    ok(get({**env, "HF_TOKEN": "hf_good"}, "org/private"))


def test_a_missing_file_is_a_404_naming_it(fake: FakeHub, env: dict[str, str]) -> None:
    fake.status["tokenizer.json"] = [404]
    msg = fail(get(env, "org/model"))
    assert "tokenizer.json: 404 Not Found" in msg, msg
    assert "check the repo id, the revision and the file name" in msg


def test_an_unknown_revision_is_named(fake: FakeHub, env: dict[str, str]) -> None:
    msg = fail(get(env, "org/model", "--revision", "v9"))
    assert "org/model has no revision 'v9'" in msg, msg


def test_disk_space_refusal_before_any_transfer(fake: FakeHub, env: dict[str, str]) -> None:
    msg = fail(get({**env, "MLXRS_FREE_SPACE_BYTES": str(100 << 20)}, "org/model"))
    assert "not enough disk space" in msg and "1.0 GiB reserve" in msg and "HF_HUB_CACHE" in msg, msg
    assert sum(fake.served.values()) == 0
    assert not [p for _, p, _ in fake.log if "/resolve/" in p or p.startswith("/cdn/")]


def test_free_space_credits_complete_blobs_and_partial_prefixes_exactly(fake: FakeHub, env: dict[str, str]) -> None:
    name = "model-00001-of-00002.safetensors"
    fake.cut[name] = [1_000_000]
    fail(get({**env, "MLXRS_DOWNLOAD_RETRIES": "0"}, "org/model"))
    # what the first run completed before the cut, and the cut file's prefix, are credited
    blobs = cache_of(env) / "models--org--model" / "blobs"
    have = {p.name: p.stat().st_size for p in blobs.iterdir()}
    unique = {(sha256(d) if n.endswith(".safetensors") else git_blob_sha1(d)): len(d) for n, d in files().items()}
    remaining = sum(
        size - have.get(b, have.get(b + ".incomplete", 0)) for b, size in unique.items() if have.get(b) != size
    )
    assert remaining < sum(unique.values()) - 1_000_000
    msg = fail(get({**env, "MLXRS_FREE_SPACE_BYTES": str(remaining + GiB - 1)}, "org/model"))
    assert f"({remaining} bytes) still to download" in msg, msg
    snap = ok(get({**env, "MLXRS_FREE_SPACE_BYTES": str(remaining + GiB)}, "org/model"))
    check_snapshot(snap, files())


def test_free_space_probe_can_be_injected_in_process(fake: FakeHub, tmp_path: Path) -> None:
    with pytest.raises(DownloadError, match="not enough disk space"):
        mhub.get("org/model", cache_dir=tmp_path / "c", endpoint=fake.url, token="", quiet=True, free_space=lambda p: 0)
    res = mhub.get(
        "org/model", cache_dir=tmp_path / "c", endpoint=fake.url, token="", quiet=True, free_space=lambda p: 10 * GiB
    )
    assert res.commit == fake.repos["org/model"].main
    assert res.transferred == sum({sha256(d): len(d) for d in files().values()}.values())
    assert sorted(res.fetched) == sorted(files())


def test_two_concurrent_gets_of_one_repo_do_not_corrupt_the_cache(fake: FakeHub, env: dict[str, str]) -> None:
    fake.delay = 0.02  # ~1.5 s of transfer so the two runs overlap
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "mlxrs", "get", "org/model"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 0, o + e
    snaps = {Path(o.strip().splitlines()[-1]) for o, _ in outs}
    assert len(snaps) == 1
    (snap,) = snaps
    check_snapshot(snap, files())
    # one of them waited for the other, then found everything present: each byte was sent once
    assert sum("waiting for it to finish" in e for _, e in outs) == 1, outs
    assert fake.served["model-00001-of-00002.safetensors"] == len(MODEL)
    assert fake.served["tokenizer.json"] == len(TOKENIZER)
    read_back(cache_of(env), "org/model", fake.repos["org/model"].main, files(), {"main"})


def test_include_and_revision(fake: FakeHub, env: dict[str, str], tmp_path: Path) -> None:
    repo = fake.repos["org/model"]
    old = "1" * 40
    repo.revisions["v1"] = old
    repo.files_at[old] = {"config.json": b'{"old": true}\n', "model.safetensors": SHARD2}
    env = {**env, "HF_HUB_CACHE": str(tmp_path / "elsewhere")}
    snap = ok(get(env, "org/model", "--include", "*.json"))
    assert sorted(p.name for p in snap.iterdir()) == ["config.json", "tokenizer.json"]
    assert snap.parent.parent.parent == tmp_path / "elsewhere"  # HF_HUB_CACHE wins over HF_HOME
    assert sum(fake.served[n] for n in ("model-00001-of-00002.safetensors", "README.md")) == 0
    snap_v1 = ok(get(env, "org/model", "--revision", "v1"))
    assert snap_v1.name == old
    assert (snap_v1 / "config.json").read_bytes() == b'{"old": true}\n'
    refs = snap.parent.parent / "refs"
    assert (refs / "main").read_text() == repo.main and (refs / "v1").read_text() == old
    # a commit as the revision writes no ref
    ok(get(env, "org/model", "--revision", old))
    assert sorted(p.name for p in refs.iterdir()) == ["main", "v1"]
    msg = fail(get(env, "org/model", "--include", "*.gguf"))
    assert "no file of org/model@main matches --include *.gguf" in msg and "config.json" in msg, msg
    info = huggingface_hub.scan_cache_dir(tmp_path / "elsewhere")
    assert not info.warnings
    (r,) = info.repos
    assert {rev.commit_hash for rev in r.revisions} == {repo.main, old}


def progress_run(**kw: Any) -> tuple[str, Progress]:
    """Two files through `Progress` (the second resumed at 500 bytes) into a StringIO."""
    s = io.StringIO()
    bars = Progress(2000, 2, stream=s, **kw)
    bars.start_file("a.safetensors", 1000)
    for done in (0, 300, 600, 1000):
        bars.update(done, 1000)
    bars.finish_file()
    bars.start_file("b.safetensors", 1000)
    bars.update(500, 1000)  # resumed at 500: not counted as transferred
    bars.update(1000, 1000)
    bars.finish_file(" (resumed at 500 B)")
    bars.close()
    return s.getvalue(), bars


def test_progress_bars_show_rate_and_eta_on_a_terminal() -> None:
    out, bars = progress_run(tty=True)
    assert "a.safetensors" in out and "total 1/2" in out and "total 2/2" in out
    assert "/s" in out and "%" in out and "<" in out  # tqdm's rate and elapsed<remaining
    assert "b.safetensors  1000 B (resumed at 500 B)" in out
    assert bars.transferred == 1500
    # not a terminal: one plain line per finished file, no bar and no escape codes
    out, bars = progress_run(tty=False)
    assert out.splitlines()[0].startswith("  a.safetensors  1000 B") and "\r" not in out and "\x1b" not in out
    assert out.splitlines()[1].startswith("  b.safetensors  1000 B (resumed at 500 B)")
    assert len(out.splitlines()) == 2 and bars.transferred == 1500
    assert progress_run(tty=True, quiet=True)[0] == ""


def test_mlxrs_progress_forces_bars_on_or_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """A StringIO is not a terminal: no bars, unless MLXRS_PROGRESS=1; MLXRS_PROGRESS=0 wins over a
    terminal."""
    from mlxrs import download

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("MLXRS_PROGRESS", raising=False)
    assert "%" not in progress_run()[0]
    assert download.bars_enabled(Tty()) and not download.bars_enabled(io.StringIO())
    monkeypatch.setenv("MLXRS_PROGRESS", "1")
    assert "%" in progress_run()[0]
    monkeypatch.setenv("MLXRS_PROGRESS", "0")
    assert not download.bars_enabled(Tty())
    s = Tty()
    bar = download.ByteBar("converting x.gguf", stream=s)
    bar(50, 100, "blk.0.attn_q.weight")
    bar(100, 100, "output.weight")
    assert s.getvalue() == ""


def test_byte_bar_draws_the_gguf_import_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxrs import download

    monkeypatch.delenv("MLXRS_PROGRESS", raising=False)
    s = io.StringIO()
    bar = download.ByteBar("converting x.gguf", enabled=True, stream=s)
    bar(512, 2048, "blk.0.attn_q.weight")
    bar(2048, 2048, "output.weight")
    out = s.getvalue()
    assert "converting x.gguf" in out and "100%" in out and "2.00k" in out and "output.weight" in out


def test_ctrl_c_style_interrupt_keeps_the_partial_file(fake: FakeHub, tmp_path: Path) -> None:
    # an exception from the progress callback stops the transfer and propagates; the partial stays
    from mlxrs import _native

    class Stop(Exception):
        pass

    seen = []

    def progress(done: int, total: int) -> None:
        seen.append(done)
        if done >= 500_000:
            raise Stop

    fake.delay = 0.02  # ~1 s for the file: the callback (at most every 100 ms) sees it midway
    url = f"{fake.url}/org/model/resolve/main/model-00001-of-00002.safetensors"
    dest = tmp_path / "blob"
    with pytest.raises(Stop):
        _native.download(url, dest, sha256=sha256(MODEL), size=len(MODEL), progress=progress)
    part = tmp_path / "blob.incomplete"
    kept = part.stat().st_size
    assert 500_000 <= kept < len(MODEL)
    r = _native.download(url, dest, sha256=sha256(MODEL), size=len(MODEL))
    assert (r["resumed_from"], r["transferred"], r["refetched"]) == (kept, len(MODEL) - kept, False)
    assert dest.read_bytes() == MODEL and not part.exists()


def test_concurrent_threads_in_one_process_share_the_lock(fake: FakeHub, tmp_path: Path) -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            mhub.get("org/model", cache_dir=tmp_path / "c", endpoint=fake.url, token="", quiet=True)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=run) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errors, errors
    check_snapshot(tmp_path / "c" / "models--org--model" / "snapshots" / fake.repos["org/model"].main, files())
    assert fake.served["model-00001-of-00002.safetensors"] == len(MODEL)


def test_ctrl_c_stops_get_keeps_the_partial_file_and_the_rerun_resumes(fake: FakeHub, env: dict[str, str]) -> None:
    import signal
    import time

    fake.delay = 0.2  # ~10 s for the big file: time to interrupt it even on a loaded machine
    # SIGINT at its default in the child even when this test runs with it ignored (a background job)
    p = subprocess.Popen(
        [sys.executable, "-m", "mlxrs", "get", "org/model"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    part = cache_of(env) / "models--org--model" / "blobs" / (sha256(MODEL) + ".incomplete")
    t0 = time.monotonic()
    while not (part.exists() and part.stat().st_size > 300_000) and time.monotonic() - t0 < 60:
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, (p.returncode, out, err)
    assert "Traceback" not in err, err
    kept = part.stat().st_size
    assert 300_000 < kept < len(MODEL)
    fake.delay = 0.0
    # the interrupted connection's handler may still be writing its last chunk into a closed socket
    # (it counts it as served): wait until the count settles before taking it
    served_before = -1
    while fake.served["model-00001-of-00002.safetensors"] != served_before:
        served_before = fake.served["model-00001-of-00002.safetensors"]
        time.sleep(0.3)
    snap = ok(get(env, "org/model"))  # the lock was released; the partial file is resumed
    check_snapshot(snap, files())
    assert fake.served["model-00001-of-00002.safetensors"] - served_before == len(MODEL) - kept
