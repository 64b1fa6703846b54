#!/usr/bin/env bash
# One device-machine call that checks a build of main as it ships (no gate opened): install
# the wheels in WHEEL_DIR; SPEC 10 against the float64 reference in the Hopper and portable
# forms with the timings of its rows; the CUDA tests of the suite (kernels, every head dim,
# the front door, the query offset, the torch operators); the head-dim benchmark against
# the peers installed (FlashAttention-4 where its wheels are on PYTHONPATH); the context-
# parallel pieces on one GPU. Each step has its own time limit so the whole fits in one
# 10-minute call. Logs and JSON go to $OUT.
#
#   bash scripts/gpu_release.sh WHEEL_DIR
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
HERE=$(cd "$(dirname "$0")/.." && pwd)
prepare /tmp/gpu-release "$1" /tmp/site
status=0
step "SPEC 10, Hopper form"
timeout "${T_FEATURES:-120}" python3 "$HERE/scripts/prefill_check_features.py" --device cuda --quick --time \
  > "$OUT/features-sm90a.log" 2>&1 || status=1
tail -n 30 "$OUT/features-sm90a.log"
step "SPEC 10, portable form"
MLX_NATIVE_CUDA_ARCH=sm_90 timeout "${T_PORTABLE:-70}" python3 "$HERE/scripts/prefill_check_features.py" \
  --device cuda --quick > "$OUT/features-sm90.log" 2>&1 || status=$((status + 2))
tail -n 6 "$OUT/features-sm90.log"
step "pytest, CUDA tests"
timeout "${T_PYTEST:-220}" python3 -m pytest -q -p no:cacheprovider -rfE -k "cuda" "$HERE/tests/test_cuda.py" \
  "$HERE/tests/test_correctness.py" "$HERE/tests/test_front_door_offset.py" "$HERE/tests/test_front_door_transforms.py" \
  "$HERE/tests/test_front_door.py" "$HERE/tests/test_torch_op.py" "$HERE/tests/test_cuda_split_kv.py" > "$OUT/pytest.log" 2>&1 || status=$((status + 4))
tail -n 12 "$OUT/pytest.log"
step "bench, head dims"
(cd /tmp && timeout "${T_BENCH:-120}" python3 -m mlx_native bench --device cuda --no-progress --rows 16384 \
  --cases causal-128 causal-64 causal-8h --json "$OUT/bench-dims.json" > "$OUT/bench-dims.log" 2>&1) ||
  status=$((status + 8))
if grep -q '^summary:' "$OUT/bench-dims.log"; then sed -n '/^summary:/,$p' "$OUT/bench-dims.log"; else tail -n 30 "$OUT/bench-dims.log"; fi
step "context-parallel pieces"
timeout "${T_CP:-60}" python3 "$HERE/scripts/cp_pieces.py" --quick --json "$OUT/cp-pieces.json" \
  > "$OUT/cp-pieces.log" 2>&1 || status=$((status + 16))
tail -n 20 "$OUT/cp-pieces.log"
echo "gpu_release status $status ($(date +%T))"
exit $status
