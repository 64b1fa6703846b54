#!/usr/bin/env bash
# One measured step of the speed issue (25) at head dims 128 and 64, in one device-machine call
# (about 8 minutes; each stage has its own time limit, and the optional ones are skipped when
# the call runs late): the warp-specialised pipeline over 128-row tiles (hopper branch)
# against main.
#
#   1. install main's and the branch's wheels; warm each timed build's kernel cache in the
#      background (scripts/warm_kernels.py), so no timed process compiles;
#   2. a smoke run of each new form on the branch (a hang or a wrong result stops the
#      branch's timing there, and says so);
#   3. the CUDA tests that cover the change, on the branch, in the Hopper form and in the
#      portable one (MLX_NATIVE_CUDA_ARCH=sm_90);
#   4. the A/B timing, two rounds (A B C D, A B C D), at 16384 rows, ours only, the described
#      mask and F32 Q (the issue's table): dense d128 32/8, causal d128 32/8, causal d64 32/8,
#      causal d256 8/8 (code this step leaves as it was: the machine's drift). Builds:
#        A main; B the branch; C the branch with 64-row tiles (MLXN_WS_N_D*=64: what the
#        128-row tiles give); D the branch without the intra-warpgroup overlap
#        (MLXN_WS_OVERLAP=0: what the overlap gives);
#   5. one round of main and the branch with F16 Q and output, and with the explicit
#      additive mask (the bench's default; "attention only" is the attention alone);
#   6. the table: every build's best time per case, its useful TFLOP/s and main's time over it.
#
#   bash scripts/gpu_hopper_step.sh MAIN_WHEEL_DIR BRANCH_WHEEL_DIR
#   MAIN_PAIR=0 bash scripts/gpu_hopper_step.sh BRANCH_WHEEL_DIR BRANCH_WHEEL_DIR   (main = the one-CTA forms)
#
# A change of the CUDA sources alone needs no second wheel: BRANCH_SRC=DIR gives builds B, C
# and D the sources in DIR (MLX_NATIVE_CUDA_SOURCE_DIR; e.g. the working tree's shaders/
# beside main's wheel). DEFS_C / DEFS_D and NAME_C / NAME_D replace C's and D's defines and
# names (DEFS_B / NAME_B B's); TEST_BUILD (default B) is the build the CUDA tests run. ROWS
# gives the timed sizes (default 16384; others are tabled as "case @rows"). BUILDS and CASES narrow the
# timing (e.g. BUILDS="A B" CASES="causal-64 causal-128" ROUNDS=1), T_TESTS=0 skips the
# tests, EXTRA=0 the F16-Q and explicit-mask rounds, SMOKE_DIMS="256" smokes other head dims
# (scripts/gpu_smoke_dims.py), TESTS_K the tests' -k expression (default "cuda"), T_SMOKE the
# smoke's limit (default 180 s: a build with other sources or defines compiles its kernels
# there, beside the background warm-ups; 60 s timed out at head dim 64 on 2026-12-07).
#
# Logs and JSON go to $OUT (default /tmp/gpu-hopper-step), packed at the end into
# hopper-step.tar.gz: bench-<build><round>.json.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
HERE=$(cd "$(dirname "$0")/.." && pwd)
prepare /tmp/gpu-hopper-step
MAIN=${1:?main wheel dir} BRANCH=${2:?branch wheel dir}
T0=$(date +%s)
late() { [ $(($(date +%s) - T0)) -gt "$1" ]; }  # late SECONDS: the call has run longer than that
status=0

step "install"
install_wheels "$MAIN" /tmp/hs-main
install_wheels "$BRANCH" /tmp/hs-branch
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/device.txt"

# A build: the wheel's folder, the kernel defines it runs with, and its CTA-pair setting.
# MAIN may be the branch's own wheel: with MLX_NATIVE_CUDA_PAIR=0 it runs the one-CTA forms,
# whose machine code at 64 and 128 is main's (ptxas and the disassembly compared), with the
# branch's bench (main's has no --described); d256 then runs its one-CTA form too.
declare -A SITE=([A]=/tmp/hs-main [B]=/tmp/hs-branch [C]=/tmp/hs-branch [D]=/tmp/hs-branch)
declare -A DEFS=([A]="" [B]="${DEFS_B:-}" [C]="${DEFS_C--DMLXN_WS_N_D64=64 -DMLXN_WS_N_D128=64}" [D]="${DEFS_D--DMLXN_WS_OVERLAP=0}")
declare -A PAIR=([A]="${MAIN_PAIR:-}" [B]="" [C]="" [D]="")
declare -A NAME=([A]="main${MAIN_PAIR:+ (one-CTA forms)}" [B]="${NAME_B:-branch}" [C]="${NAME_C:-branch, 64-row tiles}" [D]="${NAME_D:-branch, no overlap}")
declare -A SRC=([A]="" [B]="${BRANCH_SRC:-}" [C]="${BRANCH_SRC:-}" [D]="${BRANCH_SRC:-}")
# run_build BUILD CMD...: CMD in /tmp with the build's package, sources, defines and pair setting.
run_build() {
  local b=$1
  shift
  (cd /tmp && MLX_NATIVE_CUDA_PAIR="${PAIR[$b]}" MLX_NATIVE_CUDA_DEFINES="${DEFS[$b]}" \
    PYTHONPATH=${SITE[$b]}${PYTHONPATH:+:$PYTHONPATH} env ${SRC[$b]:+MLX_NATIVE_CUDA_SOURCE_DIR=${SRC[$b]}} "$@")
}
TB=${TEST_BUILD:-B}

step "warm the kernel caches (background)"
for b in ${BUILDS:-A B C D}; do run_build $b timeout 200 python3 "$HERE/scripts/warm_kernels.py" > "$OUT/warm-$b.log" 2>&1 & done

step "smoke: the branch's pair forms at head dims ${SMOKE_DIMS:-64 and 128}"
SMOKE='
import numpy as np, mlx_native as mx
from mlx_native.reference import nmse, reference_prefill
from mlx_native.dtypes import bfloat16_dtype
rng = np.random.default_rng(0)
for d, causal in [(128, True), (64, True), (128, False)]:
    q = rng.uniform(-1, 1, (1000, 8, d)).astype(np.float32)
    k = rng.uniform(-1, 1, (1000, 2, d)).astype(np.float16)
    v = rng.uniform(-1, 1, (1000, 2, d)).astype(np.float16)
    out = mx.PrefillPlan(q, k, v, causal=causal, device="cuda").run()
    e = nmse(out, reference_prefill(q, k, v, causal=causal, scale=1 / np.sqrt(d))[0])
    print(f"d{d} causal={causal}: nmse {e:.2e}")
    assert e < 1e-5
# The row sums and what reads them: lse, sinks, a fully masked row, BF16 K/V, a 2-sequence batch.
for d, kvt in [(64, np.float16), (128, np.float16), (64, "bf16")]:
    bf = kvt == "bf16"
    kvt = bfloat16_dtype() if bf else kvt
    q = rng.uniform(-1, 1, (2, 700, 8, d)).astype(np.float32)
    k = rng.uniform(-1, 1, (2, 700, 2, d)).astype(kvt)
    v = rng.uniform(-1, 1, (2, 700, 2, d)).astype(kvt)
    sinks = rng.uniform(-1, 1, 8).astype(np.float32)
    out, lse = mx.PrefillPlan(q, k, v, causal=True, window=300, sinks=sinks, return_lse=True, device="cuda").run()
    ro, rl = reference_prefill(q, k, v, causal=True, window=300, sinks=sinks, scale=1 / np.sqrt(d))
    e, le = nmse(out, ro), np.abs(np.asarray(lse) - rl).max()
    kind = "bf16" if bf else "f16"
    print(f"d{d} {kind} batch, window, sinks, lse: nmse {e:.2e}, lse off {le:.1e}")
    assert e < (5e-5 if bf else 1e-5) and le < (1e-2 if bf else 2e-3)
'
# SMOKE_DIMS (e.g. "256"): scripts/gpu_smoke_dims.py at those head dims instead (the
# described and explicit masks, window, sinks, lse, BF16 K/V, a batch).
if [ -n "${SMOKE_DIMS:-}" ]; then SMOKE_CMD=("$HERE/scripts/gpu_smoke_dims.py" $SMOKE_DIMS); else SMOKE_CMD=(-c "$SMOKE"); fi
if run_build "$TB" env MLX_NATIVE_CUDA_TRACE=1 timeout "${T_SMOKE:-180}" python3 "${SMOKE_CMD[@]}" > "$OUT/smoke.log" 2>&1; then
  grep -v "^mlx_native cuda:" "$OUT/smoke.log"
  echo "pair launches: $(grep -c "variant Some" "$OUT/smoke.log") of $(grep -c "^mlx_native cuda:" "$OUT/smoke.log")"
  SMOKE_OK=1
else
  echo "SMOKE FAILED (rc $?): the branch's timings are skipped"; tail -n 15 "$OUT/smoke.log"
  SMOKE_OK=0
  status=1
fi

if [ "$SMOKE_OK" = 1 ] && [ "${T_TESTS:-150}" != 0 ]; then
  step "CUDA tests, Hopper form (build $TB: ${NAME[$TB]})"
  (cd "$HERE" && MLX_NATIVE_CUDA_DEFINES="${DEFS[$TB]}" PYTHONPATH=${SITE[$TB]} env ${SRC[$TB]:+MLX_NATIVE_CUDA_SOURCE_DIR=${SRC[$TB]}} timeout "${T_TESTS:-150}" python3 -m pytest -q -p no:cacheprovider -rfE \
    -k "${TESTS_K:-cuda}" tests/test_cuda.py tests/test_cuda_split_kv.py tests/test_correctness.py \
    tests/test_front_door_transforms.py tests/test_front_door_offset.py > "$OUT/pytest.log" 2>&1) || status=$((status | 2))
  tail -n 8 "$OUT/pytest.log"
  step "CUDA tests, portable form (branch, MLX_NATIVE_CUDA_ARCH=sm_90)"
  (cd "$HERE" && MLX_NATIVE_CUDA_ARCH=sm_90 PYTHONPATH=${SITE[$TB]} env ${SRC[$TB]:+MLX_NATIVE_CUDA_SOURCE_DIR=${SRC[$TB]}} timeout "${T_PORTABLE:-60}" python3 -m pytest -q \
    -p no:cacheprovider -rfE -k cuda tests/test_correctness.py tests/test_cuda_split_kv.py > "$OUT/pytest-portable.log" 2>&1) ||
    status=$((status | 4))
  tail -n 4 "$OUT/pytest-portable.log"
fi

wait  # the warm-ups
grep -h "warm:\|Error\|error" "$OUT"/warm-*.log | sort | uniq -c

# bench BUILD TAG LIMIT ARGS...: one bench run of ours alone, its JSON as bench-<TAG>.json.
bench() {
  local b=$1 tag=$2 limit=$3
  shift 3
  echo "== $tag ${NAME[$b]} ($(date +%T))"
  run_build $b timeout "$limit" python3 -m mlx_native bench --device cuda --no-progress --peers --rows ${ROWS:-16384} \
    --json "$OUT/bench-$tag.json" "$@" > "$OUT/bench-$tag.log" 2>&1 || { echo "   (rc $?: $OUT/bench-$tag.log)"; status=$((status | 8)); }
}
CASES=${CASES:-dense-128 causal-128 causal-64 causal-8h}
BUILDS=${BUILDS:-A B C D}
[ "$SMOKE_OK" = 1 ] || BUILDS="A"
step "A/B, described mask, F32 Q, two rounds"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for b in $BUILDS; do bench $b "$b$round" 90 --cases $CASES --described --repeats 2; done
done
if ! late 400 && [ "$SMOKE_OK" = 1 ] && [ "${EXTRA:-1}" = 1 ]; then
  step "F16 Q and output, and the explicit mask: main and the branch, one round"
  for b in A B; do bench $b "${b}h" 80 --cases dense-128 causal-128 causal-64 --described --q-dtype float16 --repeats 2; done
  late 460 || for b in A B; do bench $b "${b}x" 80 --cases causal-128 causal-64 --repeats 2; done
fi

step "table"
python3 - "$OUT" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
names = {"A": "main", "B": os.environ.get("NAME_B", "branch"), "C": os.environ.get("NAME_C", "64-row tiles"), "D": os.environ.get("NAME_D", "no overlap")}
runs = {}  # (tag kind, build) -> {case: [ms...]}, and NMSE
for f in sorted(glob.glob(os.path.join(out, "bench-*.json"))):
    tag = os.path.basename(f)[6:-5]
    build, kind = tag[0], ("f32" if tag[1:].isdigit() else {"h": "f16", "x": "explicit"}[tag[1]])
    rep = json.load(open(f))
    for d in rep["results"]:
        if d["impl"] != "mlx-native, attention only" or d["ms"] is None:
            continue
        case = d["case"] if d["rows"] == 16384 else f'{d["case"]} @{d["rows"]}'
        r = runs.setdefault((kind, build), {}).setdefault(case, dict(ms=[], tf=[], nmse=0.0))
        r["ms"].append(d["ms"])
        r["tf"].append(d["gflops"] / 1e3)
    for d in rep["results"]:
        if d["impl"] == "mlx-native" and d.get("nmse_worst_row") is not None:
            r = runs.get((kind, build), {}).get(d["case"] if d["rows"] == 16384 else f'{d["case"]} @{d["rows"]}')
            if r is not None:
                r["nmse"] = max(r["nmse"], d["nmse_worst_row"])
for kind, title in [("f32", "described mask, F32 Q"), ("f16", "described mask, F16 Q and output"), ("explicit", "explicit mask, attention alone")]:
    builds = [b for b in "ABCD" if (kind, b) in runs]
    if not builds:
        continue
    print(f"\n{title}: ms per round (best useful TFLOP/s), main's best time over the build's")
    cases = sorted({c for b in builds for c in runs[(kind, b)]}, key=lambda c: ["dense-128", "causal-128", "causal-64", "causal-8h"].index(c) if c in ["dense-128", "causal-128", "causal-64", "causal-8h"] else 9)
    print("| case | " + " | ".join(names[b] for b in builds) + " |")
    print("| --- |" + " ---: |" * len(builds))
    for c in cases:
        base = runs.get((kind, "A"), {}).get(c)
        cells = []
        for b in builds:
            r = runs[(kind, b)].get(c)
            if r is None:
                cells.append("-")
                continue
            best = min(r["ms"])
            ratio = f", {min(base['ms']) / best:.2f}x" if base and b != "A" else ""
            cells.append(" / ".join(f"{m:.3f}" for m in r["ms"]) + f" ({max(r['tf']):.0f}{ratio}; nmse {r['nmse']:.1e})")
        print(f"| {c} | " + " | ".join(cells) + " |")
EOF
echo "gpu_hopper_step status $status ($(($(date +%s) - T0)) s)"
# A device call returns a limited count of files: the logs and JSON as one archive (the
# table above is in the call's output).
(cd "$OUT" && tar -czf /tmp/hopper-step.tar.gz . && rm -rf ./* && mv /tmp/hopper-step.tar.gz .)
exit $status
