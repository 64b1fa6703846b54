#!/usr/bin/env bash
# How busy the tensor pipe is in one launch (one device-machine call, about a minute): the
# metrics whose names this Nsight Compute offers for the chip's tensor pipes (queried, not
# assumed: `sm__pipe_tensor_op_gmma_cycles_active` read n/a with the percentage suffix on
# 2026-12-07), each as .avg.pct_of_peak_sustained_active and .sum, beside the XU and FMA pipes
# and the kernel's cycles. Logs go to $OUT (tensor-metrics.txt, tensor-pipe.txt).
#
#   PYTHONPATH=SITE KERNEL_RE=flash_attn_prefill_d128 bash scripts/gpu_tensor_pipe.sh causal128
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
HERE=$(cd "$(dirname "$0")/.." && pwd)
prepare /tmp/gpu-tensor-pipe
CASE=${1:-causal128}
ncu --query-metrics --chip gh100 > "$OUT/ncu-query.txt" 2>&1 || ncu --query-metrics > "$OUT/ncu-query.txt" 2>&1
grep -iE "tensor|gmma|hmma" "$OUT/ncu-query.txt" > "$OUT/tensor-metrics.txt"
head -40 "$OUT/tensor-metrics.txt"
names=$(awk '{print $1}' "$OUT/tensor-metrics.txt" | grep -E "^(sm|smsp)__" | grep -iE "pipe.*(cycles_active|inst_executed)|inst_executed_pipe" | sort -u | head -12)
m="sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__cycles_elapsed.avg,smsp__inst_executed.sum"
for n in $names; do m="$m,$n.avg.pct_of_peak_sustained_active,$n.sum"; done
echo "metrics: $m"
timeout "${NCU_TIMEOUT:-180}" ncu --clock-control none -k "regex:${KERNEL_RE:-flash_attn_prefill_d128}" -c 1 \
  --metrics "$m" python3 "$HERE/scripts/profile_case.py" --case "$CASE" > "$OUT/tensor-pipe.txt" 2>&1
echo "ncu exit $?"
grep -E "pct|sum|avg|==PROF==|rror" "$OUT/tensor-pipe.txt" | head -60
