#!/usr/bin/env bash
# Paged K/V in the Hopper CTA-pair forms (issue 29), in one device-machine call: install the
# wheels in WHEEL_DIR; the CUDA paged tests (tests/test_cuda_paged.py: the one-CTA forms'
# bit-identity cases, and the pair forms' against each sequence's contiguous call in the same
# pair form, with the launch trace naming every paged pair entry point) beside
# tests/test_cuda.py, then (OPTIONS=1) the run-options CUDA tests; then the paged speed rows (>= 0.95x of contiguous: ours on a
# shuffled block cache against ours on the same rows contiguous), blocks of 16 and 256 at
# PROMPT rows. Then (AMX=1, the default) issue 26's 2-core bfloat16 row on the host CPU,
# pinned to two cores, sampled twice (cores 0-1 and 8-9). Each step has its own time limit
# (T_TESTS, T_BENCH); pytest logs are verbose and written as they run.
#
#   bash scripts/gpu_paged_pairs.sh WHEEL_DIR
#
# $OUT (default /tmp/gpu-paged-pairs) gets pytest-paged-pairs.log, pytest-paged.log, pytest-cuda.log,
# bench-paged{16,256}.json and (AMX) bench-amx2-{a,b}.json, with their logs.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
HERE=$(cd "$(dirname "$0")/.." && pwd)
prepare /tmp/gpu-paged-pairs "${1:?wheel dir}" /tmp/site-paged-pairs
status=0
cd "$HERE"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"

# Two processes at once (the pair forms' cases, the rest), so that the machine's cores
# compile their kernel modules side by side.
step "pytest: tests/test_cuda_paged.py"
timeout "${T_TESTS:-300}" python3 -m pytest -v -p no:cacheprovider -rfE tests/test_cuda_paged.py -k "pair" \
  > "$OUT/pytest-paged-pairs.log" 2>&1 &
timeout "${T_TESTS:-300}" python3 -m pytest -v -p no:cacheprovider -rfE tests/test_cuda_paged.py -k "not pair" \
  tests/test_cuda.py > "$OUT/pytest-paged.log" 2>&1 &
wait -n || status=1
wait -n || status=1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT"/pytest-paged*.log | tail -n 40

if [ "${OPTIONS:-1}" = 1 ]; then
step "pytest: run options"
timeout "${T_TESTS:-300}" python3 -m pytest -q -p no:cacheprovider -rfE tests/test_run_options.py -k "cuda" \
  > "$OUT/pytest-cuda.log" 2>&1 || status=$((status | 2))
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest-cuda.log" | tail -n 25
fi

if [ "${BENCH:-1}" = 1 ]; then
  bench paged16 --device cuda --peers --rows "${PROMPT:-16384}" --cases paged-128 paged-256 --block-size 16
  bench paged256 --device cuda --peers --rows "${PROMPT:-16384}" --cases paged-128 paged-256 --block-size 256
fi
if [ "${AMX:-1}" = 1 ]; then
  export CUDA_VISIBLE_DEVICES=
  for pin in "a 0,1" "b 8,9"; do
    set -- $pin
    step "bench amx2-$1 (cores $2)"
    (cd /tmp && taskset -c "$2" timeout "${T_BENCH:-120}" python3 -m mlx_native bench --no-progress --device cpu \
      --threads 2 --dtype bfloat16 --peers torch --cases causal-128 --described \
      --json "$OUT/bench-amx2-$1.json") > "$OUT/bench-amx2-$1.log" 2>&1 || status=$((status | 8))
    sed -n '/^case /,$p' "$OUT/bench-amx2-$1.log" | head -n 12
  done
fi
echo "gpu_paged_pairs status $status"
exit $status
