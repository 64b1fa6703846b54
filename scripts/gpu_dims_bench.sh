#!/usr/bin/env bash
# After scripts/gpu_features.sh on the same machine (its wheels installed in /tmp/site):
# the benchmark at the head dims of most LLMs (128, 64) and the SPEC's, against the CUDA
# peers installed (SDPA's backends, FlexAttention, FlashAttention-4 where its wheels are).
#
#   bash scripts/gpu_dims_bench.sh [ROWS]
set -uo pipefail
OUT=${OUT:-/tmp/gpu-features}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
ROWS=${1:-16384}
(cd /tmp && timeout 300 python3 -m mlx_native bench --device cuda --no-progress --rows "$ROWS" \
  --cases causal-128 causal-64 causal-8h --json "$OUT/bench-dims.json" > "$OUT/bench-dims.log" 2>&1)
status=$?
if grep -q '^summary:' "$OUT/bench-dims.log"; then sed -n '/^summary:/,$p' "$OUT/bench-dims.log"; else tail -n 40 "$OUT/bench-dims.log"; fi
echo "gpu_dims_bench status $status ($(date +%T))"
exit $status
