#!/usr/bin/env bash
# Set up (or refresh) a development checkout. Idempotent, and quick when nothing changed:
#   1. .venv (python3 -m venv) if missing
#   2. scripts/requirements-dev.txt into it (skipped while the file, Python and platform are unchanged);
#      the extension's Rust build (step 5) starts first, in the background, so that it compiles
#      while pip installs
#   3. Linux: OpenBLAS from apt when missing (root only; a warning otherwise)
#   4. libmlxc: python native/build.py (itself a no-op when nothing changed), in the background
#      while step 5 runs
#   5. the extension module: maturin develop --profile fasttest --features testing (the test build:
#      Cargo.toml's release profile without LTO, with the op dispatch `_native._op` the tests use,
#      which the wheel leaves out; skipped while crates/, Cargo.toml, Cargo.lock and pyproject.toml
#      are unchanged)
# Environment: PYTHON (interpreter for the venv, default python3);
#              MLXRS_NATIVE_ARGS (extra arguments for native/build.py, e.g. --fetchcontent).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
VENV="$ROOT/.venv"
STAMP_DIR="$VENV/.mlxrs-stamps"  # inside the venv: a new venv starts from scratch

say()  { printf '[setup] %s\n' "$*"; }
warn() { printf '[setup] warning: %s\n' "$*" >&2; }
die()  { printf '[setup] error: %s\n' "$*" >&2; exit 1; }
if command -v sha256sum >/dev/null; then SHA=(sha256sum); else SHA=(shasum -a 256); fi
sha()  { "${SHA[@]}" | cut -d' ' -f1; }

# --- 1. virtual environment -------------------------------------------------------------------
PYTHON=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c '' 2>/dev/null; then
    command -v "$PYTHON" >/dev/null || die "$PYTHON not found: install Python >= 3.10"
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
        || die "$("$PYTHON" -V 2>&1) is too old: mlxrs needs Python >= 3.10 (set PYTHON=/path/to/python3.x)"
    say "creating .venv with $("$PYTHON" -V 2>&1)"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV" || die "python3 -m venv failed (Debian/Ubuntu: apt-get install python3-venv)"
fi
export VIRTUAL_ENV="$VENV"
export PATH="$VENV/bin:$PATH"
mkdir -p "$STAMP_DIR"

# --- 5a. the extension's Rust build, in the background while pip installs ----------------------
# `testing`: crates/mlxrs-py's op dispatch (`mlxrs._native._op`, tests/arrays_util.py); wheels are
# built without it (.github/workflows/wheels.yml, tests/test_wheel.py). `fasttest`: Cargo.toml's
# release profile without LTO, the one tests/test_wheel.py's wheel build reuses.
FEATURES=testing
PROFILE=fasttest
REQS="$ROOT/scripts/requirements-dev.txt"
command -v cargo >/dev/null || die "cargo not found: install Rust with rustup (https://rustup.rs)"
src_hash=$( {
    { find crates -type f -not -path '*/target/*' -print0; printf '%s\0' Cargo.toml Cargo.lock pyproject.toml; } \
        | LC_ALL=C sort -z | xargs -0 "${SHA[@]}"
    rustc -V; python -V; echo "features: $FEATURES, profile: $PROFILE"
    # scripts/test.sh builds the workspace's crates through clippy (scripts/clippy-driver.sh)
    echo "wrapper: ${RUSTC_WORKSPACE_WRAPPER:-}, rustflags: ${RUSTFLAGS:-}"
} | sha )
have_ext=$(ls python/mlxrs/_native*.so python/mlxrs/_native*.pyd 2>/dev/null | head -n1 || true)
EXT_PID=
EXT_LOG=$(mktemp "${TMPDIR:-/tmp}/mlxrs-ext.XXXXXX")
EXT_OUT=$(mktemp -d "${TMPDIR:-/tmp}/mlxrs-ext-wheel.XXXXXX")
NATIVE_PID=
NATIVE_LOG=
# leaving early (a failure below): stop the background builds rather than leave them running
trap '[ -z "$EXT_PID" ] || kill "$EXT_PID" 2>/dev/null; [ -z "$NATIVE_PID" ] || kill "$NATIVE_PID" 2>/dev/null
      rm -rf "$EXT_LOG" "$EXT_OUT" ${NATIVE_LOG:+"$NATIVE_LOG"}' EXIT
if [ -z "$have_ext" ] || [ "$(cat "$STAMP_DIR/maturin" 2>/dev/null)" != "$src_hash" ]; then
    BUILD_EXT=1
    # `maturin build` runs the very cargo build step 5's `maturin develop` runs (same profile,
    # features and interpreter), without installing anything: step 5 then finds it done. It needs
    # only maturin, installed ahead of the rest (its line in requirements-dev.txt).
    if ! python -c 'import maturin' 2>/dev/null; then
        maturin_req=$(grep -E '^maturin' "$REQS") || die "no maturin line in $REQS"
        python -m pip install --disable-pip-version-check -q "$maturin_req" || die "pip install $maturin_req failed"
    fi
    say "building the extension's Rust code in the background: maturin build --profile $PROFILE --features $FEATURES"
    maturin build --profile "$PROFILE" --features "$FEATURES" --interpreter "$VENV/bin/python" \
        --auditwheel skip --out "$EXT_OUT" >"$EXT_LOG" 2>&1 &
    EXT_PID=$!
else
    BUILD_EXT=0
fi

# --- 2. Python dependencies -------------------------------------------------------------------
req_hash=$( { cat "$REQS"; python -V; uname -sm; } | sha )
if [ "$(cat "$STAMP_DIR/pip" 2>/dev/null)" != "$req_hash" ]; then
    say "installing Python dependencies (scripts/requirements-dev.txt)"
    # --no-compile: no bytecode for the ~18,000 modules installed (~200 MB of source, most never imported:
    # transformers' model files, pandas, scipy), compiled by pip on the core the Rust build wants; Python
    # compiles and caches what is imported, on first import
    python -m pip install --disable-pip-version-check --no-compile -q -r "$REQS" || die "pip install failed"
    echo "$req_hash" > "$STAMP_DIR/pip"
else
    say "Python dependencies up to date"
fi

# --- 3. optimized BLAS (Linux CPU) -------------------------------------------------------------
if [ "$(uname -s)" = Linux ]; then
    ldconfig_bin=$(command -v ldconfig || echo /sbin/ldconfig)
    if ! "$ldconfig_bin" -p 2>/dev/null | grep -q 'libopenblas\.so\.0'; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
            say "installing libopenblas0-pthread (MLX's CPU wheel links reference BLAS; mlxrs preloads OpenBLAS)"
            export DEBIAN_FRONTEND=noninteractive
            apt=(apt-get -o DPkg::Lock::Timeout=600 -y -q)  # waits for scripts/test.sh's chromium install
            "${apt[@]}" install libopenblas0-pthread >/dev/null 2>&1 \
                || { "${apt[@]}" update >/dev/null 2>&1 && "${apt[@]}" install libopenblas0-pthread >/dev/null 2>&1; } \
                || warn "could not install libopenblas0-pthread; matmuls will use MLX's reference BLAS (slow)"
        else
            warn "OpenBLAS not found; matmuls will use MLX's reference BLAS (slow)." \
                 "Install it (Debian/Ubuntu: apt-get install libopenblas0-pthread) or set MLXRS_BLAS=/path/to/libopenblas.so.0"
        fi
    fi
fi

# --- 4. libmlxc --------------------------------------------------------------------------------
# Built in the background while step 5 builds the extension: the two builds share nothing (the
# Rust crates load libmlxc at run time), and each leaves a core idle for long stretches (cmake's
# configure, a crate's single-threaded front end, the links). Its output is shown when both are done.
command -v cc >/dev/null || command -v gcc >/dev/null || command -v clang >/dev/null \
    || die "no C compiler found (Debian/Ubuntu: apt-get install build-essential)"
say "native: python native/build.py${MLXRS_NATIVE_ARGS:+ $MLXRS_NATIVE_ARGS} (in the background)"
NATIVE_LOG=$(mktemp "${TMPDIR:-/tmp}/mlxrs-native.XXXXXX")
# shellcheck disable=SC2086  # MLXRS_NATIVE_ARGS is a list of arguments
python native/build.py ${MLXRS_NATIVE_ARGS:-} >"$NATIVE_LOG" 2>&1 &
NATIVE_PID=$!
native_done() {  # wait for step 4, show its output, stop on its failure
    local rc=0
    wait "$NATIVE_PID" || rc=$?
    NATIVE_PID=
    cat "$NATIVE_LOG"
    rm -f "$NATIVE_LOG"
    [ "$rc" -eq 0 ] || die "native/build.py failed (see docs/troubleshooting.md)"
}

# --- 5. the extension module -------------------------------------------------------------------
if [ "$BUILD_EXT" = 1 ]; then
    rc=0
    wait "$EXT_PID" || rc=$?
    EXT_PID=
    cat "$EXT_LOG"
    if [ "$rc" -ne 0 ]; then
        native_done
        die "maturin build (the extension's Rust build) failed"
    fi
    say "installing the extension module: maturin develop --profile $PROFILE --features $FEATURES"
    if ! maturin develop --profile "$PROFILE" --features "$FEATURES"; then
        native_done
        die "maturin develop failed"
    fi
    echo "$src_hash" > "$STAMP_DIR/maturin"
else
    say "extension module up to date ($have_ext)"
fi
native_done
say "ready: $VENV"
