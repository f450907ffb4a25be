# Sourced by bench/device_*.sh on the GPU machine: MLX's CUDA bundle and the mlxrs wheel carried in
# .device/ (bench/device_run.sh's header says how to build both) unpacked into $SITE (/tmp/site) once
# while the machine stays warm; PYTHONPATH and LD_LIBRARY_PATH point there.
SITE=/tmp/site
if [ ! -d "$SITE/mlxrs" ]; then
    mkdir -p "$SITE"
    tar xJf .device/mlx-cuda13-*-cp312.tar.xz -C "$SITE"
    if ls .device/mlxrs-*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-deps --target "$SITE" .device/mlxrs-*.whl
    fi
fi
export PYTHONPATH="$SITE" LD_LIBRARY_PATH="$SITE/mlx/lib:${LD_LIBRARY_PATH:-}"
