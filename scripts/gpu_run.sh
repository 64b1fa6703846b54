#!/usr/bin/env bash
# One device-machine call: install the wheels in WHEEL_DIR, run the whole pytest suite (it
# covers every backend backends() lists, CUDA included) and `python -m mlx_native bench
# --device cuda` (the shapes of docs/spec.md section 4 against PyTorch SDPA's CUDA
# backends). Logs and the bench JSON go to $OUT.
#
#   bash scripts/gpu_run.sh WHEEL_DIR [--quick]
#
# --quick: the benchmark at 2048 rows, global and sliding layers only.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
HERE=$(cd "$(dirname "$0")/.." && pwd)
prepare /tmp/gpu-run "$1" /tmp/site
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import mlx_native as mx; print(mx.version(), mx.backends(), mx.Device('auto'))" | tee -a "$OUT/device.txt" || exit 3
status=0
echo "==== pytest ($(date +%T))"
# The Metal emulator tests need g++ and test no CUDA code: they run in CI.
timeout "${PYTEST_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider -rfE \
  --ignore="$HERE/tests/test_metal_emulator.py" "$HERE/tests" > "$OUT/pytest.log" 2>&1 || status=4
tail -n 15 "$OUT/pytest.log"
echo "==== bench ($(date +%T))"
if [ "${2:-}" = "--quick" ]; then
  BENCH_ARGS="--rows 2048 --cases global sliding"
else
  BENCH_ARGS=""
fi
(cd /tmp && timeout "${BENCH_TIMEOUT:-270}" python3 -m mlx_native bench --device cuda --no-progress \
  $BENCH_ARGS --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1) || status=$((status + 10))
cat "$OUT/bench.log"
echo "gpu_run status $status ($(date +%T))"
exit $status
