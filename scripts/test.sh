#!/usr/bin/env bash
# Every test: set up (scripts/setup.sh), the lints (cargo clippy with warnings as errors, ruff with
# pyproject.toml's rules), then the Rust tests (cargo test --workspace) and the Python tests (pytest
# tests/). Stops at the first failing stage. Extra arguments go to pytest:
#   bash scripts/test.sh -k matmul -x
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

stage() {  # stage NAME CMD...: run CMD, stop everything with a clear line if it fails
    local name=$1; shift
    printf '\n==> %s\n' "$name"
    local start=$SECONDS rc=0
    "$@" || rc=$?
    if [ "$rc" -ne 0 ]; then
        printf '\n[test] FAILED: %s (exit %d)\n' "$name" "$rc" >&2
        exit "$rc"
    fi
    printf '[test] ok: %s (%ds)\n' "$name" $((SECONDS - start))
}

stage "setup (scripts/setup.sh)" bash scripts/setup.sh

# Rust tests load the native runtime the way an installed mlxrs does, pointed at this checkout's build.
case "$(uname -s)" in Darwin) LIBMLXC=libmlxc.dylib ;; *) LIBMLXC=libmlxc.so ;; esac
export MLXRS_LIBMLXC="$ROOT/python/mlxrs/$LIBMLXC"
export VIRTUAL_ENV="$ROOT/.venv"
export PATH="$VIRTUAL_ENV/bin:$PATH"

stage "lint: cargo clippy (warnings are errors)" cargo clippy --workspace --all-targets --quiet -- -D warnings
stage "lint: ruff" ruff check python tests bench scripts
stage "cargo test --workspace" cargo test --workspace
[ -d tests ] || { echo "[test] FAILED: there is no tests/ directory for pytest" >&2; exit 1; }
stage "pytest tests" python -m pytest -q tests ${1+"$@"}  # ${1+...}: bash 3.2 (macOS) with set -u
printf '\n[test] all stages passed\n'
