#!/usr/bin/env bash
# A build of main checked on the GPU machine in one short device call, after merges that
# touched the kernels or their host code: the CUDA tests in the Hopper form (every entry
# point launched: tests/test_kernel_coverage.py), the same in the portable mma.sync form
# (MLX_NATIVE_CUDA_ARCH=sm_90), the CPU's AMX tests on the host's Xeon (CUDA hidden), and,
# where HF_WHEELS holds transformers and its dependencies (scripts/gpu_transformers.sh says
# how to download them), a bfloat16 transformers forward on the host's CPU, Gemma 3- and
# Llama 3-shaped, 2048 tokens, with SDPA and with ours (issue 26's model row). Each step has
# its own time limit; the defaults sum to about 6 minutes. Logs go to $OUT.
#
#   bash scripts/gpu_merge_check.sh WHEEL_DIR [HF_WHEELS]
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
HERE=$(cd "$(dirname "$0")/.." && pwd)
prepare /tmp/gpu-merge-check "${1:?wheel dir}" /tmp/site-merge
cd "$HERE"
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import mlx_native as mn; print(mn.version(), mn.backends())" || exit 3

CUDA_TESTS="tests/test_cuda.py tests/test_cuda_split_kv.py tests/test_kernel_coverage.py"
step "CUDA, Hopper form: $CUDA_TESTS"
# shellcheck disable=SC2086
timeout "${T_HOPPER:-210}" python3 -m pytest -q -p no:cacheprovider -rfE -k cuda $CUDA_TESTS > "$OUT/hopper.log" 2>&1 ||
  status=1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/hopper.log" | tail -n 20

step "CUDA, portable form (MLX_NATIVE_CUDA_ARCH=sm_90): tests/test_cuda.py tests/test_kernel_coverage.py"
MLX_NATIVE_CUDA_ARCH=sm_90 timeout "${T_PORTABLE:-110}" python3 -m pytest -q -p no:cacheprovider -rfE -k cuda \
  tests/test_cuda.py tests/test_kernel_coverage.py > "$OUT/portable.log" 2>&1 || status=$((status | 2))
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/portable.log" | tail -n 20

step "CPU (CUDA hidden): tests/test_cpu_amx.py"
CUDA_VISIBLE_DEVICES= timeout "${T_CPU:-60}" python3 -m pytest -q -p no:cacheprovider -rfE tests/test_cpu_amx.py \
  > "$OUT/cpu-amx.log" 2>&1 || status=$((status | 4))
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/cpu-amx.log" | tail -n 10

if [ -n "${2:-}" ]; then
  # The model row, bfloat16 (scripts/gpu_forward_cpu.sh: forward-bfloat16.log / .json in $OUT).
  OUT=$OUT DTYPES=bfloat16 T_FORWARD=${T_FORWARD:-100} bash "$HERE/scripts/gpu_forward_cpu.sh" "$1" "$2" ||
    status=$((status | 8))
fi
echo "gpu_merge_check status $status (1 Hopper, 2 portable, 4 CPU, 8 forward)"
exit $status
