#!/usr/bin/env bash
# Every test: set up (scripts/setup.sh), the lints (cargo clippy with warnings as errors, inside the builds
# below; cargo fmt --check, ruff with pyproject.toml's rules, ruff format --check, mypy --strict on
# python/mlxrs), then the Rust tests (cargo test --workspace) and the Python tests (pytest tests/, in
# parallel: pytest-xdist). Stops at the first failing stage.
# Extra arguments go to pytest:
#   bash scripts/test.sh -k matmul -x
#   bash scripts/test.sh -n 0          # the Python tests serially, in one process
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

# cargo clippy's lints run inside the builds the tests need anyway: clippy-driver, warnings as errors
# (scripts/clippy-driver.sh), is cargo's RUSTC_WORKSPACE_WRAPPER — what `cargo clippy` sets up over
# `cargo check` — so it compiles the workspace's own crates and lints them; the dependencies are built
# as always. Setup's build of the extension lints the libraries (the test build's `testing` feature),
# `cargo test --workspace --all-features` the libraries, tests and examples with every feature, and the
# stage after it the extension as the wheel builds it (no features): what `cargo clippy --workspace
# --all-targets --all-features` and `cargo clippy -p mlxrs-py` check, without clippy's own check build
# of every dependency beside setup's (~100 CPU-seconds; bench/RESULTS.md). setup.sh counts the wrapper
# in its build stamp: an extension built without it is rebuilt (the workspace's crates only).
if ! command -v clippy-driver >/dev/null; then
    echo "[test] FAILED: clippy-driver not found (rustup component add clippy)" >&2
    exit 1
fi
export RUSTC_WORKSPACE_WRAPPER="$ROOT/scripts/clippy-driver.sh"

# Downloads the tests need start now too, niced, to overlap setup's CPU-bound builds instead of a
# pytest worker's time: Chromium for the chat page's tests (a test-only dependency, so installed here
# and not by setup.sh; without one those tests skip, saying so), and tests/prefetch.py (torch and the
# llama.cpp sdist for the tests that run llama.cpp's converter) once setup's pip step has installed
# what it imports. Neither is waited for: a test that needs one waits on its build lock, and one that
# finds it missing fetches it itself. apt waits for the other's dpkg lock (setup.sh's OpenBLAS).
BG_LOG=$(mktemp "${TMPDIR:-/tmp}/mlxrs-prefetch.XXXXXX")
BG_PIDS=()
if [ "$(uname -s)" = Linux ] && ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        printf '\n==> installing chromium for the chat page tests (apt-get, in the background)\n'
        (
            export DEBIAN_FRONTEND=noninteractive
            apt=(nice -n 10 apt-get -o DPkg::Lock::Timeout=600 -y -q)
            "${apt[@]}" install chromium >/dev/null 2>&1 \
                || { "${apt[@]}" update >/dev/null 2>&1 && "${apt[@]}" install chromium >/dev/null 2>&1; } \
                || echo '[test] could not install chromium: the chat page browser tests will skip'
        ) >>"$BG_LOG" 2>&1 &
        BG_PIDS+=($!)
    else
        printf '[test] no chromium (Debian/Ubuntu: apt-get install chromium): the chat page browser tests will skip\n' >&2
    fi
fi
(
    stamp="$ROOT/.venv/.mlxrs-stamps/pip"  # written by setup.sh once pip has installed the requirements
    for _ in $(seq 1800); do [ -s "$stamp" ] && break; sleep 1; done
    nice -n 10 "$ROOT/.venv/bin/python" tests/prefetch.py \
        || echo '[test] tests/prefetch.py failed: the tests that need its downloads fetch them themselves'
) >>"$BG_LOG" 2>&1 &
BG_PIDS+=($!)
WHEEL_OUT=  # the wheel lint's output directory, below
trap 'for p in "${BG_PIDS[@]}"; do pkill -P "$p"; kill "$p"; done 2>/dev/null || true
      rm -rf "$BG_LOG" ${WHEEL_OUT:+"$WHEEL_OUT"}' EXIT
background_report() {  # what the background downloads said so far; whether they are still running
    local p running=0
    for p in "${BG_PIDS[@]}"; do kill -0 "$p" 2>/dev/null && running=1; done
    cat "$BG_LOG"
    [ "$running" = 0 ] || echo '[test] downloads still running (the tests that need them wait for them)'
}

stage "setup (scripts/setup.sh; its build of the extension runs clippy's lints)" bash scripts/setup.sh

# Rust tests load the native runtime the way an installed mlxrs does, pointed at this checkout's build.
case "$(uname -s)" in Darwin) LIBMLXC=libmlxc.dylib ;; *) LIBMLXC=libmlxc.so ;; esac
export MLXRS_LIBMLXC="$ROOT/python/mlxrs/$LIBMLXC"
export VIRTUAL_ENV="$ROOT/.venv"
export PATH="$VIRTUAL_ENV/bin:$PATH"

stage "lint: cargo fmt --check (rustfmt.toml)" cargo fmt --all -- --check
stage "lint: ruff" ruff check python tests bench scripts
stage "lint: ruff format --check" ruff format --check python tests bench scripts
stage "lint: mypy --strict (the package)" python -m mypy --strict python/mlxrs
# in setup.sh's profile (fasttest: release without LTO): the dependencies are the extension's build's,
# already compiled, so only the workspace's test harnesses compile (a clean clone: ~60 s here instead of
# ~100 s for the test profile's own build of every dependency), and the tests run optimized, as shipped.
# (Run beside pytest, niced, into the cores pytest's workers leave idle, it saved nothing: 939 s against
# 920 one after the other, pytest taking what cargo test did not; bench/RESULTS.md, "test time".)
stage "cargo test --workspace (with clippy's lints of every target, all features)" \
    cargo test --workspace --all-features --profile fasttest
# the extension as the wheel builds it: crates/mlxrs-py alone is compiled again (maturin's environment,
# as setup's build; tests/test_wheel.py's build of the same then finds it done)
WHEEL_OUT=$(mktemp -d "${TMPDIR:-/tmp}/mlxrs-lint-wheel.XXXXXX")
stage "lint: cargo clippy, the extension without features (as the wheel builds it)" \
    maturin build --quiet --profile fasttest --interpreter "$VIRTUAL_ENV/bin/python" --auditwheel skip --out "$WHEEL_OUT"
rm -rf "$WHEEL_OUT"
[ -d tests ] || { echo "[test] FAILED: there is no tests/ directory for pytest" >&2; exit 1; }
# pytest-xdist spreads the test files over MLXRS_TEST_WORKERS processes (default `auto`: one per
# core), each file whole in one worker (--dist loadfile: a module's servers and sessions are made
# once; tests/buildlock.py serializes the builds of the shared caches). Arguments after these win:
# `bash scripts/test.sh -n 0` runs serially in this process.
# One OpenBLAS thread per worker: the workers already take every core, and OpenBLAS's idle threads
# spin (sched_yield) beside the other worker's (bench/RESULTS.md, "test time": sys time halved, the
# wall time 3-8% less). OPENBLAS_NUM_THREADS from the environment wins.
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
background_report
stage "pytest tests" python -m pytest -q -n "${MLXRS_TEST_WORKERS:-auto}" --dist loadfile --durations=20 tests ${1+"$@"}  # ${1+...}: bash 3.2 (macOS) with set -u
printf '\n[test] all stages passed\n'
