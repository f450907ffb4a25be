#!/usr/bin/env bash
# On the GPU machine (the `device` tool, .device/ carried as for bench/device_run.sh): the GPU time of
# each kernel of a few decode steps (Nsight Compute, bench/gpu_profile.py) for mlx-lm and mlxrs on
# bench_device.py's models.
#   bash bench/device_profile.sh [MODELS] [GEN]     MODELS e.g. 8b_q4,1b_bf16 (default 8b_q4), GEN 5
# MLXRS_PROFILE_ENVS="A=1 B=0;C=2": also mlxrs under each ';'-separated environment.
# PROFILE_BATCH=N: N rows decoded together (gpu_profile.py run --batch N).
# Reports (text and JSON) go to $OUT (or /tmp/prof).
set -euo pipefail
. bench/device_site.sh
export PYTHONPATH="$SITE:bench:tests"
NCU=$(command -v ncu || ls -d /usr/local/cuda*/bin/ncu 2>/dev/null | head -1 || true)
[ -n "$NCU" ] || { echo "no ncu on this machine"; exit 2; }
O=${OUT:-/tmp/prof}; mkdir -p "$O"
GEN=${2:-5}
for KIND in $(echo "${1:-8b_q4}" | tr , ' '); do
    M=/tmp/m/$KIND
    [ -f "$M/config.json" ] || python3 -c "from pathlib import Path; from bench_device import make_model, BITS; s, k = '$KIND'.split('_'); make_model(Path('$M'), s, BITS[k])"
    IFS=';' read -ra ENVS <<< "${MLXRS_PROFILE_ENVS:-}"
    RUNS=("mlx-lm|" "mlxrs|")
    for e in "${ENVS[@]}"; do RUNS+=("mlxrs|$e"); done
    i=0
    for r in "${RUNS[@]}"; do
        ENGINE=${r%%|*}; E=${r#*|}; i=$((i+1))
        TAG="${KIND}_${ENGINE}_$i"
        echo "== $TAG ${E:-(default environment)}"
        env $E "$NCU" --profile-from-start off --metrics gpu__time_duration.sum --clock-control none --csv \
            --log-file "/tmp/k_$TAG.csv" python3 bench/gpu_profile.py run --engine "$ENGINE" --gen "$GEN" --batch "${PROFILE_BATCH:-0}" "$M" \
            | grep -v '^==PROF==' | tail -3
        python3 bench/gpu_profile.py report --steps "$GEN" --json "$O/$TAG.json" "/tmp/k_$TAG.csv" | tee "$O/$TAG.txt"
    done
done
