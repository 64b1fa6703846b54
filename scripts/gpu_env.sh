# Sourced by the device-machine scripts (scripts/gpu_*.sh): what each of them needs there.

# install_wheels DIR TARGET: the wheels in DIR into the folder TARGET, for PYTHONPATH. The
# machine's Python is a virtual environment without network that is not ours to change, so
# wheels go into folders of their own (--target), never into it; exits 2 when one fails.
install_wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$2" "$1"/*.whl || exit 2
}

# use_wheels DIR TARGET: install_wheels, then TARGET first on PYTHONPATH (so the build in
# DIR is the mlx_native the script imports).
use_wheels() {
  install_wheels "$1" "$2"
  export PYTHONPATH=$2${PYTHONPATH:+:$PYTHONPATH}
}

# prepare DEFAULT_OUT [WHEEL_DIR TARGET]: what every script does first. OUT (the caller's,
# else DEFAULT_OUT) is made and made absolute, since the scripts run steps in other
# folders; Python's output is unbuffered, so logs show each line as it comes; given a wheel
# folder, use_wheels installs it.
prepare() {
  OUT=${OUT:-$1}
  mkdir -p "$OUT"
  OUT=$(cd "$OUT" && pwd)
  export PYTHONUNBUFFERED=1
  if [ $# -ge 3 ]; then use_wheels "$2" "$3"; fi
}

# bench NAME ARGS...: one `python -m mlx_native bench` run (5 repeats, ARGS as given: the
# device, the peers, the cases), run from /tmp (the installed wheel, not the checkout),
# within T_BENCH seconds (default 120); its report at $OUT/bench-NAME.json, its log beside
# it, its table printed; a failure sets bit 4 of the caller's `status`.
bench() {
  local name=$1
  shift
  step "bench $name: $*"
  (cd /tmp && timeout "${T_BENCH:-120}" python3 -m mlx_native bench --no-progress --described \
    --repeats 5 "$@" --json "$OUT/bench-$name.json") > "$OUT/bench-$name.log" 2>&1 || status=$((status | 4))
  sed -n '/^case /,$p' "$OUT/bench-$name.log" | head -n 30
}

# step TITLE: a step's heading in the log, with the time.
step() { echo "==== $* ($(date +%T))"; }
