#!/usr/bin/env bash
# Issue 26's model row on the GPU machine's host CPU (CUDA hidden), in one step of a device
# call: `python -m mlx_native bench --transformers` in each dtype of DTYPES (default
# "bfloat16 float32"), Gemma 3- and Llama 3-shaped, 2048 tokens, 2 layers, SDPA and ours in
# the same process, the machine's default environment (no OMP_* or thread settings). Logs
# and JSON go to $OUT (forward-<dtype>.log / .json); each dtype has T_FORWARD seconds.
#
#   bash scripts/gpu_forward_cpu.sh WHEEL_DIR HF_WHEELS
#
# HF_WHEELS: transformers and its dependencies as wheels (scripts/gpu_transformers.sh says
# how to download them).
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
prepare /tmp/gpu-forward-cpu "${1:?wheel dir}" /tmp/site-forward
install_wheels "${2:?transformers wheels dir}" /tmp/site-forward-hf
status=0
for dt in ${DTYPES:-bfloat16 float32}; do
  step "transformers forward on the CPU: $dt, $(nproc) threads, gemma3 and llama, 2048 tokens, 2 layers"
  (cd /tmp && CUDA_VISIBLE_DEVICES= PYTHONPATH=$PYTHONPATH:/tmp/site-forward-hf timeout "${T_FORWARD:-110}" python3 -m mlx_native \
    bench --transformers --device cpu --rows 2048 --models gemma3 llama --layers 2 --dtype "$dt" \
    --json "$OUT/forward-$dt.json") > "$OUT/forward-$dt.log" 2>&1 || status=1
  tail -n 9 "$OUT/forward-$dt.log"
done
echo "gpu_forward_cpu status $status"
exit $status
