#!/usr/bin/env bash
# One device-machine call on the explicit-mask path of the Hopper kernel: which form the
# explicit global and sliding layers launch (MLX_NATIVE_CUDA_TRACE), their time with the
# installed library's kernels, with the one-CTA forms (MLX_NATIVE_CUDA_PAIR=0), and with this
# checkout's kernel sources (MLX_NATIVE_CUDA_SOURCE_DIR=shaders), which must also pass the
# CUDA tests and SPEC 10 first. With a second wheel directory (a build of this checkout),
# then the CUDA kernel mutations against that build. Logs and JSON go to $OUT.
#
#   bash scripts/gpu_mask_path.sh WHEEL_DIR [CHECKOUT_WHEEL_DIR] [ROWS]
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
HERE=$(cd "$(dirname "$0")/.." && pwd)
ROWS=${3:-8192}
prepare /tmp/gpu-mask-path "$1" /tmp/site
status=0
bench() {  # NAME [ENV=VALUE ...]: ours alone, the explicit-mask layers
  local name=$1
  shift
  (cd /tmp && env "$@" timeout 120 python3 -m mlx_native bench --device cuda --no-progress --rows "$ROWS" \
    --cases global sliding --peers --json "$OUT/bench-$name.json" > "$OUT/bench-$name.log" 2>&1) || status=$((status + 1))
  grep -E "^(summary|  *(global|sliding))|ms" "$OUT/bench-$name.log" | tail -n 8
}
step "the checkout's sources: CUDA tests (Hopper form)"
MLX_NATIVE_CUDA_SOURCE_DIR="$HERE/shaders" timeout 150 python3 -m pytest -x -q -p no:cacheprovider -rfE -k cuda \
  "$HERE/tests/test_planted.py" "$HERE/tests/test_correctness.py" "$HERE/tests/test_cuda.py" \
  "$HERE/tests/test_front_door.py" "$HERE/tests/test_front_door_offset.py" > "$OUT/pytest-src.log" 2>&1 || status=$((status + 100))
tail -n 4 "$OUT/pytest-src.log"
step "the checkout's sources: SPEC 10, both forms"
MLX_NATIVE_CUDA_SOURCE_DIR="$HERE/shaders" timeout 130 python3 "$HERE/scripts/prefill_check_features.py" --device cuda \
  --quick > "$OUT/features-src.log" 2>&1 || status=$((status + 200))
tail -n 3 "$OUT/features-src.log"
MLX_NATIVE_CUDA_SOURCE_DIR="$HERE/shaders" MLX_NATIVE_CUDA_ARCH=sm_90 timeout 80 python3 \
  "$HERE/scripts/prefill_check_features.py" --device cuda --quick > "$OUT/features-src-sm90.log" 2>&1 || status=$((status + 400))
tail -n 3 "$OUT/features-src-sm90.log"
step "launches of the explicit layers (installed)"
bench trace MLX_NATIVE_CUDA_TRACE=1
grep -hoE "mlx_native cuda: [a-z0-9_]+ variant [A-Za-z0-9()]+ grid [^b]*|no tensor map" "$OUT/bench-trace.log" | sort | uniq -c
step "installed"
bench installed
step "installed, one-CTA forms"
bench nopair MLX_NATIVE_CUDA_PAIR=0
step "checkout's sources"
bench src MLX_NATIVE_CUDA_SOURCE_DIR="$HERE/shaders"
step "installed again"
bench installed2
if [ -n "${2:-}" ]; then
  step "kernel mutations, this checkout's build"
  install_wheels "$2" /tmp/site-src
  PYTHONPATH=/tmp/site-src timeout 200 python3 "$HERE/scripts/mutate_kernels.py" --family cuda --gpu-jobs 6 \
    --scratch /tmp/mut-src --json "$OUT/mut-cuda.json" > "$OUT/mut-cuda.log" 2>&1 || status=$((status + 1000))
  grep -E "survived|no-compile|timeout|^cuda:" "$OUT/mut-cuda.log"
fi
exit $status
