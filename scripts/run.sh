#!/usr/bin/env bash
# The main job: set up (scripts/setup.sh), then `python -m mlxrs <args>` (default: `info`, which prints
# the runtime information and runs a tiny computation).
#   bash scripts/run.sh              # python -m mlxrs info
#   bash scripts/run.sh --version    # python -m mlxrs --version
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
bash scripts/setup.sh
if [ $# -eq 0 ]; then set -- info; fi
exec "$ROOT/.venv/bin/python" -m mlxrs "$@"
