#!/bin/sh
# scripts/test.sh's RUSTC_WORKSPACE_WRAPPER: cargo runs it as `clippy-driver.sh <rustc> <arguments>`
# for the workspace's own crates (never the dependencies), and it compiles them with clippy's lints,
# warnings as errors — `cargo clippy -- -D warnings` inside an ordinary build. Passing `-D warnings`
# here rather than in RUSTFLAGS leaves the dependencies' builds (and so setup.sh's) untouched.
exec clippy-driver "$@" -D warnings
