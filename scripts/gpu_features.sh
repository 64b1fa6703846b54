#!/usr/bin/env bash
# One device-machine call for SPEC 10 on CUDA: install the wheels in WHEEL_DIR, check every
# head dim, BF16 K/V, softcap, ALiBi and sinks against the float64 reference
# (scripts/prefill_check_features.py) in the Hopper and the portable (sm_90: mma.sync)
# forms, re-check the SPEC 6-9 cases at 256 and 512, and time the targets' rows.
#
#   bash scripts/gpu_features.sh WHEEL_DIR
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
HERE=$(cd "$(dirname "$0")/.." && pwd)
prepare /tmp/gpu-features "$1" /tmp/site
status=0
echo "==== SPEC 10 check, Hopper form ($(date +%T))"
timeout 240 python3 "$HERE/scripts/prefill_check_features.py" --device cuda --time 2>&1 | tee "$OUT/features-sm90a.log" || status=1
echo "==== SPEC 10 check, portable form ($(date +%T))"
MLX_NATIVE_CUDA_ARCH=sm_90 timeout 150 python3 "$HERE/scripts/prefill_check_features.py" --device cuda --quick 2>&1 | tee "$OUT/features-sm90.log" | tail -n 40 || status=$((status + 2))
echo "==== SPEC 6-9 check, Hopper form ($(date +%T))"
timeout 100 python3 "$HERE/scripts/prefill_check.py" --device cuda --quick 2>&1 | tee "$OUT/check-sm90a.log" | tail -n 16 || status=$((status + 4))
echo "gpu_features status $status ($(date +%T))"
exit $status
