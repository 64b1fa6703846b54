#!/usr/bin/env bash
# A/B timing of two builds in one device-machine call: each wheel directory is installed in
# its own folder, then `python3 -m mlx_native bench --device cuda --no-progress --peers`
# (ours alone) with the given bench arguments runs A, B, A, B, so the machine's drift shows.
# Logs and JSON go to $OUT (bench-A1.json, bench-B1.json, ...).
#
#   bash scripts/gpu_ab.sh WHEEL_DIR_A WHEEL_DIR_B [bench arguments, e.g. --rows 8192 --cases global sliding]
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
OUT=${OUT:-/tmp/gpu-ab}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
A=$1 B=$2
shift 2
install_wheels "$A" /tmp/ab-A
install_wheels "$B" /tmp/ab-B
status=0
for run in A1 B1 A2 B2; do
  side=${run:0:1}
  echo "==== $run ($(date +%T))"
  (cd /tmp && PYTHONPATH=/tmp/ab-$side${PYTHONPATH:+:$PYTHONPATH} timeout 150 python3 -m mlx_native bench --device cuda \
    --no-progress --peers --json "$OUT/bench-$run.json" "$@" > "$OUT/bench-$run.log" 2>&1) || status=1
  sed -n '/^summary:/,/^wrote/p' "$OUT/bench-$run.log" | grep -vE "^(summary|wrote|-)"
done
exit $status
