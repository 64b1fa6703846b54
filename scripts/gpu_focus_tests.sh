#!/usr/bin/env bash
# The tests a change needs a GPU (or the Xeon's AMX tiles) for, in one short device-machine
# call: install the wheels in WHEEL_DIR, then run the named pytest files on the H200 (the
# Hopper form), and the CPU files again with CUDA_VISIBLE_DEVICES= (so that on this host the
# CPU's AMX kernels are what `device` fixtures get). Each run has its own time limit.
#
#   bash scripts/gpu_focus_tests.sh WHEEL_DIR "CUDA_TESTS" "CPU_TESTS"
#
# e.g. bash scripts/gpu_focus_tests.sh .gpu/whl-new "tests/test_cuda.py tests/test_hostile_input.py" \
#        "tests/test_edge_cases.py tests/test_cpu_amx.py"
# $OUT (default /tmp/gpu-focus) gets pytest-cuda.log and pytest-cpu.log.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
HERE=$(cd "$(dirname "$0")/.." && pwd)
prepare /tmp/gpu-focus "${1:?wheel dir}" /tmp/site-focus
status=0
cd "$HERE"
if [ -n "${2:-}" ]; then
  step "CUDA: $2"
  # shellcheck disable=SC2086
  timeout "${T_CUDA:-300}" python3 -m pytest -q -p no:cacheprovider -rfE $2 > "$OUT/pytest-cuda.log" 2>&1 || status=1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest-cuda.log" | tail -n 25
fi
if [ -n "${3:-}" ]; then
  step "CPU (CUDA hidden): $3"
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES= timeout "${T_CPU:-150}" python3 -m pytest -q -p no:cacheprovider -rfE $3 > "$OUT/pytest-cpu.log" 2>&1 || status=$((status | 2))
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest-cpu.log" | tail -n 25
fi
echo "gpu_focus_tests status $status"
exit $status
