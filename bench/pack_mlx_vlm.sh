#!/usr/bin/env bash
# Pack mlx-vlm 0.7.10 (the multimodal oracle) for the GPU test machine, which reaches no package
# registry: mlx-vlm, mlx-audio and what they import that the machine lacks (Pillow, miniaudio, cffi,
# PyYAML, requests and its dependencies), as CPython 3.12 manylinux x86-64 wheels installed into one
# directory, tarred to OUTDIR/mlx-vlm-site-cp312.tar.xz. The machine has numpy, transformers (5.17),
# tokenizers, safetensors and huggingface_hub; MLX and mlx-lm come in pack-mlx-cuda.sh's bundle.
# bench/device_run.sh unpacks it beside MLX when it is there (`parity --media` needs it).
#   bash bench/pack_mlx_vlm.sh .device
set -euo pipefail
OUT=${1:-.device}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
python3 -m pip install -q --no-deps --target "$TMP/site" --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --only-binary=:all: \
    mlx-vlm==0.7.10 mlx-audio==0.6.2 pillow miniaudio cffi pycparser pyyaml requests certifi idna urllib3 \
    charset-normalizer
find "$TMP/site" -name __pycache__ -prune -exec rm -rf {} +
rm -rf "$TMP/site/bin"
mkdir -p "$OUT"
tar cJf "$OUT/mlx-vlm-site-cp312.tar.xz" -C "$TMP/site" .
du -h "$OUT/mlx-vlm-site-cp312.tar.xz"
