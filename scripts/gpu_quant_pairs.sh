#!/usr/bin/env bash
# FP8 K/V in the Hopper CTA-pair forms (issue 29; shaders/flash_attn_prefill/quant_pipe.cuh),
# in one device-machine call: install the wheels in WHEEL_DIR (built with
# QUANT_PAIRS_LAUNCHED true in rust/src/backend/cuda/attention_geometry.rs); the quant pair
# tests (tests/test_cuda_quant_pairs.py: the F16 pair forms' bits on the same values, the
# reference with descale factors, which plans take them, the launch trace) beside the
# library-form quant tests (tests/test_cuda_quant.py -k auto); then (BENCH=1) the issue's FP8
# rows, ours against ours on the same values in 16 bits: a chunk of CHUNK rows against a
# cache of CACHE rows (>= 1.3x) and whole prompts of PROMPT rows (>= 1.0x). Each step has its
# own time limit (T_TESTS, T_BENCH); pytest logs are verbose and written as they run.
#
#   bash scripts/gpu_quant_pairs.sh WHEEL_DIR
#
# $OUT (default /tmp/gpu-quant-pairs) gets pytest-quant-pairs.log, pytest-quant-auto.log,
# bench-chunk.json and bench-prompt.json, with their logs.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
HERE=$(cd "$(dirname "$0")/.." && pwd)
prepare /tmp/gpu-quant-pairs "${1:?wheel dir}" /tmp/site-quant-pairs
status=0
cd "$HERE"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"

# Two processes at once, so that the machine's cores compile their kernel modules side by side.
step "pytest: tests/test_cuda_quant_pairs.py, tests/test_cuda_quant.py -k auto"
timeout "${T_TESTS:-300}" python3 -m pytest -v -p no:cacheprovider -rfE tests/test_cuda_quant_pairs.py \
  > "$OUT/pytest-quant-pairs.log" 2>&1 &
timeout "${T_TESTS:-300}" python3 -m pytest -v -p no:cacheprovider -rfE tests/test_cuda_quant.py -k auto \
  > "$OUT/pytest-quant-auto.log" 2>&1 &
wait -n || status=1
wait -n || status=1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT"/pytest-quant-*.log | tail -n 40

if [ "${BENCH:-1}" = 1 ]; then
  bench chunk --device cuda --peers --rows "${CHUNK:-2048}" --kv-len "${CACHE:-32768}" --cases fp8-128
  bench prompt --device cuda --peers --rows "${PROMPT:-16384}" --cases fp8-128 fp8-256
fi
echo "gpu_quant_pairs status $status"
exit $status
