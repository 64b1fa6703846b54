#!/usr/bin/env bash
# Quantised K/V on CUDA (issue 29), in one device-machine call: install the wheels in
# WHEEL_DIR; the CUDA quant tests (tests/test_cuda_quant.py: FP8 E4M3/E5M2 with and without
# descale factors, Q8_0, contiguous and paged, the Hopper one-CTA form and the portable one),
# then the kernel registry's quant entries and the CUDA paged and dense tests; then the
# issue's speed rows, ours against ours on the same values in 16 bits (`python -m mlx_native
# bench`): a chunk of CHUNK rows against a cache of CACHE rows (the >= 1.3x target: half the
# bytes) and whole prompts of PROMPT rows (>= 1.0x for FP8, >= 0.9x for Q8_0). Each step has
# its own time limit (T_QUANT, T_CUDA, T_BENCH); pytest logs are verbose and written as they
# run, so a cut-short call still says which cases passed. Then the paged rows (>= 0.95x of
# contiguous on CUDA): block sizes 16 and 256 at PROMPT rows. QUANT_K narrows the quant tests
# to a pytest -k expression (one process), CUDA_TESTS=0 leaves out the others, BENCH=0 the
# benches.
#
#   bash scripts/gpu_quant_check.sh WHEEL_DIR
#
# $OUT (default /tmp/gpu-quant) gets pytest-quant-{auto,portable,rest}.log, pytest-cuda.log, bench-chunk.json and
# bench-prompt.json (with their logs).
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
HERE=$(cd "$(dirname "$0")/.." && pwd)
prepare /tmp/gpu-quant "${1:?wheel dir}" /tmp/site-quant
status=0
cd "$HERE"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"

# Three processes at once (the library's form, the portable one, the rest), so that the
# machine's cores compile their kernel modules side by side.
step "pytest: tests/test_cuda_quant.py ${QUANT_K:-}"
if [ -n "${QUANT_K:-}" ]; then
  timeout "${T_QUANT:-240}" python3 -m pytest -v -p no:cacheprovider -rfE tests/test_cuda_quant.py -k "$QUANT_K" \
    > "$OUT/pytest-quant-k.log" 2>&1 || status=1
else
for part in auto portable rest; do
  sel=$part
  [ "$part" = rest ] && sel="not auto and not portable"
  timeout "${T_QUANT:-240}" python3 -m pytest -v -p no:cacheprovider -rfE tests/test_cuda_quant.py -k "$sel" \
    > "$OUT/pytest-quant-$part.log" 2>&1 &
done
for part in auto portable rest; do wait -n || status=1; done
fi
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT"/pytest-quant-*.log | tail -n 40

if [ "${CUDA_TESTS:-1}" = 1 ]; then
step "pytest: the registry's quant entries, CUDA paged, CUDA"
timeout "${T_CUDA:-150}" python3 -m pytest -q -p no:cacheprovider -rfE tests/test_kernel_coverage.py -k "kvq or registered" \
  > "$OUT/pytest-cuda.log" 2>&1 || status=$((status | 2))
timeout "${T_CUDA:-150}" python3 -m pytest -q -p no:cacheprovider -rfE tests/test_cuda_paged.py tests/test_cuda.py \
  >> "$OUT/pytest-cuda.log" 2>&1 || status=$((status | 2))
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest-cuda.log" | tail -n 25
fi

if [ "${BENCH:-1}" = 1 ]; then
  bench chunk --device cuda --peers --rows "${CHUNK:-2048}" --kv-len "${CACHE:-32768}" --cases fp8-128 q8-128
  bench prompt --device cuda --peers --rows "${PROMPT:-16384}" --cases fp8-128 fp8-256 q8-128
  bench paged16 --device cuda --peers --rows "${PROMPT:-16384}" --cases paged-128 paged-256 --block-size 16
  bench paged256 --device cuda --peers --rows "${PROMPT:-16384}" --cases paged-128 paged-256 --block-size 256
fi
echo "gpu_quant_check status $status"
exit $status
