# Sourced by the device-machine scripts (scripts/gpu_*.sh): what each of them needs there.

# install_wheels DIR TARGET: the wheels in DIR into the folder TARGET, for PYTHONPATH. The
# machine's Python is a virtual environment without network that is not ours to change, so
# wheels go into folders of their own (--target), never into it; exits 2 when one fails.
install_wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$2" "$1"/*.whl || exit 2
}

# step TITLE: a step's heading in the log, with the time.
step() { echo "==== $* ($(date +%T))"; }
