#!/usr/bin/env bash
# Everything the CUDA backend needs a GPU for, in one go (one device-machine call):
# install the wheel, list the device, run the whole pytest suite (it runs on every backend
# that backends() lists, CUDA included), `python -m mlx_native bench --device cuda` (against
# PyTorch SDPA), and compute-sanitizer (memcheck, racecheck, synccheck) on small cases. Logs
# and JSON go to $OUT (default /tmp/gpu-check).
#
#   bash scripts/gpu_check.sh [WHEEL_DIR] [--quick]
#
# WHEEL_DIR holds the mlx_native wheel (and any wheels it needs that the machine lacks,
# cffi for instance); without it the installed package is used (pass "" to give --quick
# alone). --quick: the benchmark at 2048 rows, global and sliding layers only (and the
# profile at its smaller sizes). ONLY="sanitizer ncu" (say) runs only the stages named
# (pytest pytest-portable sass bench sanitizer ncu).
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
HERE=$(cd "$(dirname "$0")/.." && pwd)
prepare /tmp/gpu-check
WHEELS=${1:-}
QUICK=${2:-}
status=0
stage() { echo; echo "==== $* ($(date +%T))"; }
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }

stage device
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv 2>&1 | tee "$OUT/device.txt"

if [ -n "$WHEELS" ]; then
  stage install
  use_wheels "$WHEELS" /tmp/site
fi
python3 -c "import mlx_native as mx, os; print(mx.version(), mx.backends(), mx.Device('cuda'), os.environ.get('MLX_NATIVE_NVRTC'))" 2>&1 | tee -a "$OUT/device.txt" || exit 3

if want pytest; then
  stage pytest
  timeout ${PYTEST_TIMEOUT:-200} python3 -m pytest -q -rfEs -p no:cacheprovider "$HERE/tests" 2>&1 | tee "$OUT/pytest.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=4
fi

if want pytest-portable; then
  stage pytest-portable
  # The portable mma.sync form of the attention (what GPUs before Hopper run), on this GPU;
  # test_kernel_coverage.py requires every entry point of that form (`_xf` included) launched.
  MLX_NATIVE_CUDA_ARCH=sm_90 timeout ${PYTEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider \
    "$HERE/tests/test_correctness.py" "$HERE/tests/test_cuda.py" "$HERE/tests/test_cuda_split_kv.py" \
    "$HERE/tests/test_kernel_coverage.py" -k "cuda" 2>&1 | tail -3
  [ "${PIPESTATUS[0]}" = 0 ] || status=8
fi

if want sass; then
  stage sass
  CUBIN=$(ls -t "${MLX_NATIVE_CUDA_CACHE:-$HOME/.cache/mlx_native/cuda}"/flash_attn_prefill_tensor-*.cubin 2>/dev/null | head -1)
  if [ -n "$CUBIN" ]; then
    cuobjdump --dump-sass "$CUBIN" > /tmp/sass.txt 2>&1
    echo "$CUBIN: $(grep -c HGMMA /tmp/sass.txt) HGMMA, $(grep -c HMMA /tmp/sass.txt) HMMA, $(grep -c LDSM /tmp/sass.txt) LDSM, $(grep -cE 'LDL|STL' /tmp/sass.txt) LDL/STL"
  fi
fi

if want bench; then
  stage bench
  # The benchmark against PyTorch SDPA's CUDA backends; --quick: the global and sliding layers
  # at 2048 rows only. The JSON is rewritten after every size, so a timeout leaves the rest.
  if [ "$QUICK" = "--quick" ]; then
    BENCH_ARGS="--rows 2048 --cases global sliding"
  else
    BENCH_ARGS=""
  fi
  (cd /tmp && timeout "${BENCH_TIMEOUT:-270}" python3 -m mlx_native bench --device cuda --no-progress \
    $BENCH_ARGS --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1)
  rc=$?
  [ $rc = 0 ] || status=6
  # The summary (ours with and without the mask classification, against the best peers), or
  # the end of the log when there is none.
  if grep -q '^summary:' "$OUT/bench.log"; then sed -n '/^summary:/,$p' "$OUT/bench.log"; else tail -n 40 "$OUT/bench.log"; fi
  echo "bench exit $rc (the whole table: $OUT/bench.log)"
fi

if want sanitizer; then
  stage sanitizer
  for tool in memcheck racecheck synccheck; do
    timeout ${SANITIZER_TIMEOUT:-90} compute-sanitizer --tool $tool --error-exitcode 9 python3 "$HERE/scripts/gpu_small_case.py" > "$OUT/sanitizer-$tool.log" 2>&1
    rc=$?
    echo "$tool: exit $rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|worst nmse' "$OUT/sanitizer-$tool.log" | tr '\n' ' ')"
    [ $rc = 0 ] || status=5
  done
fi

if want ncu; then
  stage ncu
  if [ "${SKIP_NCU:-}" != 1 ] && command -v ncu >/dev/null; then
    timeout ${NCU_TIMEOUT:-150} ncu --clock-control none -k "regex:flash_attn_prefill_[td]" -c ${NCU_LAUNCHES:-3} \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section LaunchStats --section Occupancy \
      --metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio,smsp__average_warps_issue_stalled_misc_per_issue_active.ratio,smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio,smsp__inst_executed.sum \
      python3 "$HERE/scripts/profile_case.py" $QUICK > "$OUT/ncu.txt" 2>&1
    echo "ncu exit $?"
    grep -E "flash_attn_prefill_[td]|Duration|Executed Ipc A|gmma_cycles|pipe_alu|pipe_fma|pipe_xu|issue_stalled|inst_executed.sum" "$OUT/ncu.txt" | grep -v "==PROF==" | awk '{print $1, $NF}' | head -60
  fi
fi

stage summary
[ -f "$OUT/pytest.log" ] && grep -E "passed|failed|error" "$OUT/pytest.log" | tail -3
echo "gpu_check status $status"
exit $status
