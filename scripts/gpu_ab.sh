#!/usr/bin/env bash
# A/B timing of builds in one device-machine call: each build is installed in its own
# folder, then `python3 -m mlx_native bench --device cuda --no-progress --peers` (ours alone)
# with the given bench arguments runs once per build per round, for two rounds (A, B, A, B),
# so the machine's drift shows. A build is a wheel directory, optionally with a folder of
# kernel sources that replace the built-in ones (MLX_NATIVE_CUDA_SOURCE_DIR): DIR:SOURCES.
# Logs and JSON go to $OUT (bench-<build><round>.json, builds lettered A, B, C, ...).
#
#   bash scripts/gpu_ab.sh WHEEL_DIR_A WHEEL_DIR_B [bench arguments, e.g. --rows 8192 --cases global sliding]
#   bash scripts/gpu_ab.sh BUILD_A BUILD_B BUILD_C ... -- [bench arguments]
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
prepare /tmp/gpu-ab
builds=()
if [[ " $* " == *" -- "* ]]; then
  while [ "$1" != "--" ]; do builds+=("$1"); shift; done
  shift
else
  builds=("$1" "$2")
  shift 2
fi
letters=(A B C D E F G H)
if [ ${#builds[@]} -lt 1 ] || [ ${#builds[@]} -gt ${#letters[@]} ]; then
  echo "gpu_ab.sh: give 1 to ${#letters[@]} builds (got ${#builds[@]})" >&2
  exit 2
fi
for i in "${!builds[@]}"; do
  install_wheels "${builds[$i]%%:*}" "/tmp/ab-${letters[$i]}"
done
status=0
for round in 1 2; do
  for i in "${!builds[@]}"; do
    side=${letters[$i]} build=${builds[$i]}
    src=""
    [[ "$build" == *:* ]] && src=$(cd "${build#*:}" && pwd)
    echo "==== $side$round ${build} ($(date +%T))"
    (cd /tmp && MLX_NATIVE_CUDA_SOURCE_DIR=$src PYTHONPATH=/tmp/ab-$side${PYTHONPATH:+:$PYTHONPATH} timeout 150 \
      python3 -m mlx_native bench --device cuda --no-progress --peers --json "$OUT/bench-$side$round.json" "$@" \
      > "$OUT/bench-$side$round.log" 2>&1) || status=1
    sed -n '/^summary:/,/^wrote/p' "$OUT/bench-$side$round.log" | grep -vE "^(summary|wrote|-)"
  done
done
exit $status
