#!/usr/bin/env bash
# One device-machine call for the front door's kernels: install the wheels in WHEEL_DIR,
# check the new op against the float64 reference (scripts/prefill_check.py) in the Hopper
# and the portable (sm_90: mma.sync) forms, run the CUDA tests of the suite, and time the
# SPEC's global and sliding layers. Logs go to $OUT.
#
#   bash scripts/gpu_prefill.sh WHEEL_DIR [ROWS]
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
HERE=$(cd "$(dirname "$0")/.." && pwd)
prepare /tmp/gpu-prefill "$1" /tmp/site
ROWS=${2:-8192}
status=0
echo "==== prefill check, Hopper form ($(date +%T))"
timeout 150 python3 "$HERE/scripts/prefill_check.py" --device cuda 2>&1 | tee "$OUT/check-sm90a.log" | tail -n 20 || status=1
echo "==== prefill check, portable form ($(date +%T))"
MLX_NATIVE_CUDA_ARCH=sm_90 timeout 100 python3 "$HERE/scripts/prefill_check.py" --device cuda --quick 2>&1 | tee "$OUT/check-sm90.log" | tail -n 14 || status=$((status + 2))
echo "==== pytest, CUDA tests ($(date +%T))"
timeout 200 python3 -m pytest -q -x -p no:cacheprovider -k "cuda" "$HERE/tests/test_cuda.py" "$HERE/tests/test_correctness.py" > "$OUT/pytest.log" 2>&1 || status=$((status + 4))
tail -n 8 "$OUT/pytest.log"
echo "==== bench ($(date +%T))"
(cd /tmp && timeout 150 python3 -m mlx_native bench --device cuda --no-progress --rows "$ROWS" --cases global sliding \
  --peers torch --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1) || status=$((status + 8))
if grep -q '^summary:' "$OUT/bench.log"; then sed -n '/^summary:/,$p' "$OUT/bench.log"; else tail -n 30 "$OUT/bench.log"; fi
echo "gpu_prefill status $status ($(date +%T))"
exit $status
