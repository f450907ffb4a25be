#!/usr/bin/env bash
# On the GPU test machine (the `device` tool, .device/ carried as for bench/device_run.sh): the planner
# against MLX's peaks with the prefill as the engine runs it on a GPU (every layer evaluated, one queued
# ahead), a second pass over the cases that varied most, a subset with whole chunks as one graph
# (MLXRS_PREFILL_EVAL_LAYERS=0, the default before), then prefill/decode speed and peaks on 1B- and
# 3B-shaped bf16 models in the three modes (bench/prefill_eval_speed.py). Results under $OUT.
set -uo pipefail
SITE=/tmp/site
OUT=${OUT:-/tmp/out}
mkdir -p "$SITE" "$OUT"
tar xJf .device/mlx-cuda13-*-cp312.tar.xz -C "$SITE"
python3 -m pip install -q --no-deps --target "$SITE" .device/mlxrs-*.whl
export PYTHONPATH="$SITE" LD_LIBRARY_PATH="$SITE/mlx/lib:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m mlxrs --version
CASES=(fit-llama-f32:512 fit-llama-f32:1000 fit-llama-f32:2048 fit-llama-f32:3000 fit-llama-f32:4000
       fit-llama-bf16:512 fit-llama-bf16:2048 fit-llama-bf16:4000 fit-gemma3-f32:1000 fit-gemma3-f32:2048
       fit-gemma3-f32:4000 fit-qwen3-bf16:512 fit-qwen3-bf16:2048 fit-qwen3-bf16:4000)
SOME=(fit-llama-f32:2048 fit-llama-f32:4000 fit-llama-bf16:4000 fit-gemma3-f32:2048 fit-qwen3-bf16:4000)
python3 bench/fit_calibration.py --out "$OUT/fit.json" --cases "${CASES[@]}" 2>&1 | tee "$OUT/fit.txt"
python3 bench/fit_calibration.py --out "$OUT/fit_again.json" --cases "${SOME[@]}" 2>&1 | tee "$OUT/fit_again.txt"
MLXRS_PREFILL_EVAL_LAYERS=0 python3 bench/fit_calibration.py --out "$OUT/fit_whole.json" --cases "${SOME[@]}" 2>&1 \
  | tee "$OUT/fit_whole.txt"
python3 bench/prefill_eval_speed.py --shapes 1b 3b --prompts 2048 8000 --modes 1a 1 0 --runs 2 --gen 32 \
  --out "$OUT/speed.json" 2>&1 | tee "$OUT/speed.log"
