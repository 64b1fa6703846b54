#!/usr/bin/env bash
# The run of record of the Hopper kernel against its peers: every row of issues 12 and 25,
# with FlashAttention-4 and FlexAttention in the same process, and PyTorch SDPA's backends
# where a whole-prompt case lets them run. Logs and JSON go to $OUT (record-<part>.log /
# .json); each part has its own time limit. PARTS names the parts to run (default: all);
# the issue-12 parts fit one 10-minute call, issue 25's rows another:
#
#   PARTS="whole sliding chunk-32k chunk-64k global" bash scripts/gpu_record.sh WHEEL_DIR [FA4_B_DIR]
#   PARTS="dims dims-described dims-f16 latency" bash scripts/gpu_record.sh WHEEL_DIR [FA4_B_DIR]
#
# Issue 25's parts: the head-dim 128 and 64 rows (32/8 heads, 16k) with the explicit additive
# mask (ours with and without its classification; FA4, SDPA); the same and the d256 8/8 rows
# with ours given the described mask (causal=True, or none for the dense rows), F32 Q, then
# F16 Q and output (what a half-precision model hands over); the 512-row latency row
# (causal d256 16/8) against cuDNN.
#
# FA4_B_DIR: the second half of FlashAttention-4's wheels (../shared/tools/fa4-wheels.sh),
# joined here with the first half an earlier call copied to /root/fa4. Without it, FA4 runs
# only where it is already on PYTHONPATH.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
prepare /tmp/gpu-record
if [ -n "${2:-}" ] && [ -f /root/fa4/big.part.aa ]; then
  step "FlashAttention-4"
  cat /root/fa4/big.part.aa "$2/big.part.ab" > "/root/fa4/$(cat "$2/big.name")" && rm /root/fa4/big.part.aa &&
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fa4 /root/fa4/*.whl
fi
[ -d /tmp/fa4 ] && export PYTHONPATH=/tmp/fa4:/tmp/fa4/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
use_wheels "$1" /tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
status=0
# part LIMIT NAME BENCH-ARGS...: one bench run, its summary printed (when PARTS names it).
part() {
  local limit=$1 name=$2
  shift 2
  [ -z "${PARTS:-}" ] || [[ " $PARTS " == *" $name "* ]] || return 0
  step "$name: $*"
  (cd /tmp && timeout "$limit" python3 -m mlx_native bench --device cuda --no-progress --json "$OUT/record-$name.json" \
    "$@" > "$OUT/record-$name.log" 2>&1) || status=1
  if grep -q '^summary:' "$OUT/record-$name.log"; then sed -n '/^summary:/,$p' "$OUT/record-$name.log"; else tail -n 20 "$OUT/record-$name.log"; fi
}
part "${T_WHOLE:-180}" whole --rows 16384 --cases causal-8h dense-8h --peers fa4 flex torch
part "${T_SLIDING:-120}" sliding --rows 8192 32768 --cases sliding --peers fa4 flex
part "${T_CHUNK:-90}" chunk-32k --rows 2048 --kv-len 32768 --cases sliding global --peers fa4 flex
part "${T_CHUNK:-90}" chunk-64k --rows 512 --kv-len 65536 --cases causal-8h --peers fa4 flex
part "${T_GLOBAL:-70}" global --rows 8192 --cases global --peers flex
part "${T_DIMS:-150}" dims --rows 16384 --cases dense-128 causal-128 causal-64 --peers fa4 torch
part "${T_DIMS:-150}" dims-described --rows 16384 --cases dense-128 causal-128 causal-64 causal-8h dense-8h --described --peers fa4
part "${T_DIMS:-150}" dims-f16 --rows 16384 --cases dense-128 causal-128 causal-64 causal-8h dense-8h --described --q-dtype float16 --peers fa4
part "${T_LATENCY:-60}" latency --rows 512 --cases sliding --described --peers fa4 torch
echo "gpu_record status $status ($(date +%T))"
# A device call returns a limited count of files: the logs and JSON as one archive.
(cd "$OUT" && tar -czf /tmp/gpu-record.tar.gz . && rm -rf ./* && mv /tmp/gpu-record.tar.gz .)
exit $status
