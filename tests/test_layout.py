"""Repository rules that hold the design together: where `unsafe` may appear, and the shape of the
workspace (three crates, run-time loading of libmlxc, the `mlxrs._native` module)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CRATES = ROOT / "crates"

# the only places allowed to contain `unsafe`
UNSAFE_ALLOWED = [CRATES / "mlxrs-sys", CRATES / "mlxrs-core" / "src" / "handle"]

UNSAFE_RE = re.compile(r"\bunsafe\s*(\{|fn\b|impl\b|extern\b|trait\b|\()")
_CHAR_RE = re.compile(r"'(?:\\(?:u\{[0-9a-fA-F]+\}|x[0-9a-fA-F]{2}|.)|[^\\'\n])'")
_RAW_RE = re.compile(r'b?r(#*)"')


def strip_rust(src: str) -> str:
    """`src` with comments (line, nested block, doc) and the contents of string and char literals
    blanked out; newlines are kept so offsets still map to lines."""
    out: list[str] = []
    i, n = 0, len(src)

    def blank(s: str) -> str:
        return "".join("\n" if c == "\n" else " " for c in s)

    while i < n:
        c = src[i]
        prev = src[i - 1] if i else " "
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            out.append(blank(src[i:j]))
            i = j
        elif src.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(blank(src[i:j]))
            i = j
        elif (m := _RAW_RE.match(src, i)) and not (prev.isalnum() or prev == "_"):
            close = '"' + m.group(1)
            j = src.find(close, m.end())
            j = n if j < 0 else j + len(close)
            out.append(blank(src[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(blank(src[i:j]))
            i = j
        elif c == "'" and (m := _CHAR_RE.match(src, i)):
            out.append(blank(m.group(0)))
            i = m.end()
        else:  # code, including lifetimes ('a)
            out.append(c)
            i += 1
    return "".join(out)


def rust_files() -> list[Path]:
    return sorted(p for p in CRATES.rglob("*.rs") if "target" not in p.relative_to(CRATES).parts)


def unsafe_sites(path: Path) -> list[int]:
    code = strip_rust(path.read_text(encoding="utf-8"))
    return [code.count("\n", 0, m.start()) + 1 for m in UNSAFE_RE.finditer(code)]


def test_strip_rust_separates_code_from_words() -> None:
    sample = """
        // unsafe { in a line comment }
        /// unsafe fn in a doc comment
        /* unsafe { /* nested */ unsafe impl } */
        let s = "unsafe { in a string \\" still string unsafe fn }";
        let r = r#"unsafe { "raw" }"#;
        let c = '"'; let d = '\\''; fn f<'a>(x: &'a str) {}
        let real = unsafe { g() };
        unsafe impl Send for X {}
        pub unsafe extern "C" fn h() {}
    """
    code = strip_rust(sample)
    assert len(code) == len(sample) and code.count("\n") == sample.count("\n")
    hits = [m.group(0) for m in UNSAFE_RE.finditer(code)]
    assert hits == ["unsafe {", "unsafe impl", "unsafe extern"], hits
    assert "fn f<'a>(x: &'a str)" in code  # lifetimes are code, not char literals
    assert "in a string" not in code and "raw" not in code and "doc comment" not in code


def test_unsafe_only_in_sys_and_handle() -> None:
    files = rust_files()
    assert files, "no Rust sources found"
    offenders: list[str] = []
    allowed_hits = 0
    for f in files:
        sites = unsafe_sites(f)
        if any(f.is_relative_to(a) for a in UNSAFE_ALLOWED):
            allowed_hits += len(sites)
        else:
            offenders += [f"{f.relative_to(ROOT)}:{line}" for line in sites]
    assert not offenders, "unsafe outside crates/mlxrs-sys and crates/mlxrs-core/src/handle: " + ", ".join(offenders)
    # the scan does see the unsafe code that is allowed (it is not vacuous)
    assert allowed_hits > 20, allowed_hits


def test_core_denies_unsafe_outside_handle() -> None:
    lib = strip_rust((CRATES / "mlxrs-core" / "src" / "lib.rs").read_text())
    assert re.search(r"#!\[(deny|forbid)\(unsafe_code\)\]", lib), "mlxrs-core must deny unsafe_code"
    # and the only module that opts back in is `handle`
    allows = re.findall(r"#\[allow\(unsafe_code\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)", lib)
    assert allows == ["handle"], allows


def test_workspace_layout() -> None:
    for crate in ("mlxrs-sys", "mlxrs-core", "mlxrs-py"):
        d = CRATES / crate
        assert (d / "Cargo.toml").is_file(), f"{crate}/Cargo.toml missing"
        assert (d / "src" / "lib.rs").is_file(), f"{crate}/src/lib.rs missing"
        assert tomllib.loads((d / "Cargo.toml").read_text())["package"]["name"] == crate
    ws = tomllib.loads((ROOT / "Cargo.toml").read_text())["workspace"]
    assert "crates/*" in ws["members"] or {f"crates/{c}" for c in ("mlxrs-sys", "mlxrs-core", "mlxrs-py")} <= set(
        ws["members"]
    )


def test_crate_dependencies_point_one_way() -> None:
    deps = {
        c: tomllib.loads((CRATES / c / "Cargo.toml").read_text()).get("dependencies", {})
        for c in ("mlxrs-sys", "mlxrs-core", "mlxrs-py")
    }
    assert not any(d.startswith("mlxrs") for d in deps["mlxrs-sys"])
    assert "mlxrs-sys" in deps["mlxrs-core"] and "mlxrs-py" not in deps["mlxrs-core"]
    assert "mlxrs-core" in deps["mlxrs-py"]
    assert "pyo3" not in deps["mlxrs-core"] and "pyo3" not in deps["mlxrs-sys"]


def test_libmlxc_is_loaded_at_run_time_not_linked() -> None:
    sys_toml = tomllib.loads((CRATES / "mlxrs-sys" / "Cargo.toml").read_text())
    assert "links" not in sys_toml["package"]
    assert "libloading" in sys_toml["dependencies"]
    for crate in CRATES.iterdir():
        build = crate / "build.rs"
        if build.exists():
            assert not re.search(r"rustc-link-lib=(dylib=)?mlx", build.read_text()), build


def test_pyproject_module_name() -> None:
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())
    maturin = py["tool"]["maturin"]
    assert maturin["module-name"] == "mlxrs._native"
    assert maturin["python-source"] == "python"
    assert Path(maturin["manifest-path"]) == Path("crates/mlxrs-py/Cargo.toml")
    lib = tomllib.loads((CRATES / "mlxrs-py" / "Cargo.toml").read_text())["lib"]
    assert lib["name"] == "_native" and "cdylib" in lib["crate-type"]
    assert (ROOT / "python" / "mlxrs" / "__init__.py").is_file()
    assert (ROOT / "python" / "mlxrs" / "py.typed").is_file()
