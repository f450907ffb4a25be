#!/usr/bin/env bash
# On the GPU machine (the `device` tool, .device/ carried): bench/qmv_variants.py under Nsight Compute
# (each kernel variant's GPU time per 8B decode shape, and its error), then the Nsight Compute sections
# (throughput, occupancy, warp states) of one kernel. Output under $OUT (or /tmp/qmv).
#   bash bench/device_qmv_variants.sh [VARIANTS] [DETAIL]   VARIANTS comma-separated (default all),
#                                                           DETAIL the variant whose 28672-row kernel is
#                                                           detailed (default engine)
set -euo pipefail
. bench/device_site.sh
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
O=${OUT:-/tmp/qmv}; mkdir -p "$O"
V=${1:-base,onep,unroll4,onep_u4,engine}; D=${2:-engine}
"$NCU" --kernel-name regex:qmv_ --metrics gpu__time_duration.sum --clock-control none --csv --log-file /tmp/v.csv \
    python3 bench/qmv_variants.py --variants "$V" --checks "$O/checks.json" 2>&1 | { grep -v "^==PROF==\|^check" || true; } | tail -5
python3 bench/qmv_variants.py --report /tmp/v.csv --json "$O/variants.json" | tee "$O/variants.txt"
"$NCU" --kernel-name "regex:qmv_${D}_bfloat16_t_1_4096_28672" --launch-count 1 --clock-control none --section SpeedOfLight \
    --section Occupancy --section WarpStateStats --section LaunchStats python3 bench/qmv_variants.py --variants "$D" --reps 1 \
    2>/dev/null | grep -v "^==PROF==\|^check" > "$O/detail.txt" || true
grep -E "Duration|Throughput|Registers|Occupancy|Warp Cycles" "$O/detail.txt" || true
