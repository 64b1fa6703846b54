#!/usr/bin/env bash
# A/B timing of CPU builds on the GPU machine's host (16-core Xeon with AMX), no GPU used, in
# one device-machine call: each build (a wheel folder, with the cffi/pycparser wheels) is
# installed in its own folder, then `python3 -m mlx_native bench --device cpu --peers torch`
# runs once per build per round (A, B, C, A, B, C, ...), so the host's drift shows in each
# build's spread and PyTorch's time is taken in the same process every time. The reports
# (ab-<build><round>.json) and logs go to /tmp/cpu-ab, packed into $OUT/cpu-ab.tar.gz (few
# files come back from the device machine); the table of every build's times and ratios
# (scripts/cpu_ab_table.py) is printed last and kept as $OUT/cpu-ab.md.
#
#   ROUNDS=3 THREADS=16 DTYPE=bfloat16 CASES="causal-128 causal-256" bash scripts/gpu_cpu_ab.sh DIR_A DIR_B ...
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
HERE=$(cd "$(dirname "$0")/.." && pwd)
prepare /tmp/gpu-cpu-ab
WORK=/tmp/cpu-ab
rm -rf "$WORK" && mkdir -p "$WORK"
export CUDA_VISIBLE_DEVICES=
ROUNDS=${ROUNDS:-3} THREADS=${THREADS:-$(nproc)} DTYPE=${DTYPE:-bfloat16} CASES=${CASES:-causal-128 causal-256}
letters=(A B C D E F)
[ $# -ge 1 ] && [ $# -le ${#letters[@]} ] || { echo "gpu_cpu_ab.sh: give 1 to ${#letters[@]} wheel folders" >&2; exit 2; }
dirs=("$@")
for i in "${!dirs[@]}"; do install_wheels "${dirs[$i]}" "/tmp/cpu-ab-${letters[$i]}"; done
lscpu | grep -E "Model name|^CPU\(s\)"
status=0
for r in $(seq 1 "$ROUNDS"); do
  for i in "${!dirs[@]}"; do
    b=${letters[$i]}
    step "round $r, build $b (${dirs[$i]}): $THREADS threads, $DTYPE, $CASES"
    # shellcheck disable=SC2086
    (cd /tmp && PYTHONPATH=/tmp/cpu-ab-$b timeout 120 python3 -m mlx_native bench --device cpu --no-progress \
      --rows 2048 --threads "$THREADS" --dtype "$DTYPE" --peers torch --cases $CASES --json "$WORK/ab-$b$r.json") \
      > "$WORK/ab-$b$r.log" 2>&1 || status=1
    grep -E "mlx-native, described|enable_gqa" "$WORK/ab-$b$r.log" | head -n 8
  done
done
python3 "$HERE/scripts/cpu_ab_table.py" "$WORK" "${dirs[@]}" | tee "$OUT/cpu-ab.md"
tar -czf "$OUT/cpu-ab.tar.gz" -C "$WORK" .
exit $status
