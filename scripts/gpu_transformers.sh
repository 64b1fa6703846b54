#!/usr/bin/env bash
# One device-machine call for the PyTorch operators and the transformers backend: install
# mlx_native and transformers from WHEEL_DIR into a virtual environment that sees the
# machine's own packages (its CUDA build of torch), run the GPU-only tests of the operators,
# the transformers backend and the torch front door, then the forward benchmark on CUDA
# (`python3 -m mlx_native bench --transformers`) and the front door's overhead on CUDA (a call
# now goes through the operator). Logs and JSON go to $OUT.
#
#   bash scripts/gpu_transformers.sh WHEEL_DIR
#
# WHEEL_DIR, made on a machine with the network (the device machine has none): mlx_native,
# cffi and pycparser, transformers and its dependencies for CPython 3.12 (numpy left out:
# the machine has it):
#   maturin build --release -o gpu-wheels; pip download -d gpu-wheels cffi pycparser "transformers==5.24.*" \
#     --python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64
#   rm gpu-wheels/numpy-*.whl
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
HERE=$(cd "$(dirname "$0")/.." && pwd)
WHEELS=$(cd "$1" && pwd)
prepare /tmp/gpu-transformers
# Into a folder on PYTHONPATH, not a virtual environment: the machine's python is itself a
# virtual environment's (its CUDA build of torch), which a new one would not see.
rm -rf /tmp/hfsite
use_wheels "$WHEELS" /tmp/hfsite
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import mlx_native as mn, torch, transformers; print(mn.version(), mn.backends(), torch.__version__, \
torch.cuda.is_available(), transformers.__version__)" | tee -a "$OUT/device.txt" || exit 3
status=0
echo "==== pytest ($(date +%T))"
timeout "${PYTEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -rfEs "$HERE/tests/test_torch_op.py" \
  "$HERE/tests/test_transformers.py" "$HERE/tests/test_front_door_torch.py" > "$OUT/pytest.log" 2>&1 || status=4
tail -n 25 "$OUT/pytest.log"
echo "==== bench --transformers ($(date +%T))"
(cd /tmp && timeout "${BENCH_TIMEOUT:-300}" python3 -m mlx_native bench --transformers --device cuda \
  --json "$OUT/bench-transformers.json" > "$OUT/bench-transformers.log" 2>&1) || status=$((status + 10))
cat "$OUT/bench-transformers.log"
echo "==== bench --overhead ($(date +%T))"
(cd /tmp && timeout "${OVERHEAD_TIMEOUT:-120}" python3 -m mlx_native bench --overhead --device cuda \
  --json "$OUT/overhead.json" > "$OUT/overhead.log" 2>&1) || status=$((status + 100))
cat "$OUT/overhead.log"
echo "gpu_transformers status $status ($(date +%T))"
exit $status
