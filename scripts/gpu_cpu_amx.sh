#!/usr/bin/env bash
# The CPU's AMX kernels on the GPU machine's host (a 16-core Xeon with AMX-BF16), in one
# device-machine call, no GPU used (CUDA_VISIBLE_DEVICES=): install the wheels in WHEEL_DIR;
# `python3 -m mlx_native info`; the AMX tests (tests/test_cpu_amx.py) and the CPU
# correctness tests, on the AMX kernels (the CPU's best path there, and forced in the
# fixtures); the split products timed and checked (scripts/cpu_amx_splits.py); then issue
# 26's table with `python3 -m mlx_native bench` against PyTorch SDPA in the same process:
# causal GQA d128 32/8 and d256 16/8 at 2048 rows in bfloat16, float16 and float32, and the
# dense d256 16/8, sliding d256 16/8 w1024 and global d512 16/2 cases (float32, the earlier
# targets), on all 16 cores and on 2 (taskset -c 0,1, 2 threads; PINNED_TWO=0 leaves those
# out); and, where WHEEL_DIR brings transformers, the forward of Gemma 3- and Llama 3-shaped
# models in bfloat16 and float32 with SDPA and with ours ($OUT/forward-*.json). Every step has its own
# time limit (8.3 minutes if every one ran out; about 4 expected). $OUT gets run.log,
# splits.json and bench-cpu-amx.json (every bench report, keyed threads-dtype); the table is
# printed last.
#
#   bash scripts/gpu_cpu_amx.sh WHEEL_DIR
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
HERE=$(cd "$(dirname "$0")/.." && pwd)
prepare /tmp/gpu-cpu-amx "$1" /tmp/site-cpu-amx
WORK=/tmp/cpu-amx
rm -rf "$WORK" && mkdir -p "$WORK"
export CUDA_VISIBLE_DEVICES=
LOG="$OUT/run.log"
status=0
{
  step "machine"
  lscpu | grep -E "Model name|^CPU\(s\)"
  echo "AMX flags: $(grep -o -w 'amx[a-z0-9_]*' /proc/cpuinfo | sort -u | tr '\n' ' ')"
  (cd /tmp && python3 -m mlx_native info) || exit 3
  python3 -c "import torch; print('torch', torch.__version__, 'threads', torch.get_num_threads())"

  step "pytest: AMX tests and CPU correctness (the AMX kernels are the CPU's default here)"
  timeout "${PYTEST_TIMEOUT:-140}" python3 -m pytest -q -p no:cacheprovider -rfEs "$HERE/tests/test_cpu_amx.py" \
    "$HERE/tests/test_correctness.py" "$HERE/tests/test_front_door.py" "$HERE/tests/test_front_door_transforms.py" \
    "$HERE/tests/test_front_door_offset.py" "$HERE/tests/test_edge_cases.py" > "$WORK/pytest.log" 2>&1 || status=4
  grep -E "passed|failed|SKIPPED|FAILED|Error" "$WORK/pytest.log" | tail -n 25

  step "splits: time and NMSE per choice of products, 16 threads, d128 32/8 causal 2048 rows"
  (cd /tmp && timeout "${SPLITS_TIMEOUT:-45}" python3 "$HERE/scripts/cpu_amx_splits.py" "$OUT/splits.json" 2048) || status=$((status + 10))

  # bench NAME LIMIT THREADS DTYPE CASES...: one bench run, its report at $WORK/NAME.json.
  bench() {
    local name=$1 limit=$2 threads=$3 dtype=$4
    shift 4
    local pin=""
    [ "$threads" = 2 ] && pin="taskset -c 0,1"
    step "bench $name: $threads threads, $dtype, $*"
    (cd /tmp && timeout "$limit" $pin python3 -m mlx_native bench --device cpu --no-progress --rows 2048 \
      --threads "$threads" --dtype "$dtype" --peers torch --cases "$@" --json "$WORK/$name.json") > "$WORK/$name.log" 2>&1 ||
      status=$((status + 100))
    sed -n '/^case /,$p' "$WORK/$name.log" | head -n 40
  }
  N=$(nproc)
  bench "$N-bfloat16" 40 "$N" bfloat16 causal-128 causal-256
  bench "$N-float16" 35 "$N" float16 causal-128 causal-256
  bench "$N-float32" 50 "$N" float32 causal-128 causal-256 dense sliding global
  if [ "${PINNED_TWO:-1}" = 1 ]; then
    bench 2-bfloat16 60 2 bfloat16 causal-128 causal-256
    bench 2-float16 50 2 float16 causal-128 causal-256
    bench 2-float32 80 2 float32 causal-128 causal-256 dense sliding global
  fi

  # Issue 26's model row: a transformers forward (Gemma 3 12B- and Llama 3 8B-shaped layers,
  # 2048 tokens) with SDPA and with ours, on every core, default environment; only where
  # WHEEL_DIR brought transformers (scripts/gpu_transformers.sh says how to download it).
  if python3 -c "import transformers" 2>/dev/null; then
    for dt in bfloat16 float32; do
      step "transformers forward: $dt, $N threads, gemma3 and llama, 2048 tokens, 2 layers"
      (cd /tmp && timeout "${FORWARD_TIMEOUT:-150}" python3 -m mlx_native bench --transformers --device cpu --rows 2048 \
        --models gemma3 llama --layers 2 --dtype "$dt" --json "$OUT/forward-$dt.json") > "$WORK/forward-$dt.log" 2>&1 ||
        status=$((status + 1000))
      tail -n 8 "$WORK/forward-$dt.log"
    done
  fi

  python3 - "$WORK" "$OUT/bench-cpu-amx.json" <<'EOF'
import json, os, sys
work, out = sys.argv[1], sys.argv[2]
runs = {}
for f in sorted(os.listdir(work)):
    if f.endswith(".json"):
        with open(os.path.join(work, f)) as fh:
            runs[f[:-5]] = json.load(fh)
with open(out, "w") as fh:
    json.dump(runs, fh, indent=1)
print(f"wrote {out}: {', '.join(runs)}")
EOF
  step "issue 26's table (ratio = torch ms / ours ms)"
  python3 "$HERE/scripts/cpu_amx_summary.py" "$OUT/bench-cpu-amx.json"
  echo "gpu_cpu_amx status $status ($(date +%T)): 4 tests failed, +10 splits, +100 per bench that failed or ran out, +1000 per forward"
  exit $status
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
