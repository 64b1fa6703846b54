#!/usr/bin/env bash
# cargo mutants over the op layer and the CPU backend, one source file at a time, so a run
# cut short keeps what it finished (docs/reliability.md, "cargo mutants"). Each mutant is
# built with only the test targets that judge it (the lib's unit tests, validation, the CPU
# kernels' tests, the planted cases, the property tests, the host allocations), without
# debug info: 15-45 s a mutant on a 2-core machine instead of minutes. Results:
# OUT/<dir>_<file>/mutants.out
# (caught.txt, missed.txt, timeout.txt, unviable.txt).
#
#   bash scripts/cargo_mutants.sh [FILE ...]   # default: every file of rust/src/ops and rust/src/backend/cpu
#   JOBS=2 OUT=/tmp/cargo-mutants bash scripts/cargo_mutants.sh rust/src/backend/cpu/simd.rs
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cargo-mutants}
JOBS=${JOBS:-1}
mkdir -p "$OUT"
export CARGO_PROFILE_DEV_DEBUG=0 CARGO_PROFILE_TEST_DEBUG=0
TARGETS="--lib --test validation --test flash_attn_cpu --test planted --test fuzz --test prefill_cpu --test prefill_score_transforms --test host_memory"
ARGS=()
for t in $TARGETS; do ARGS+=("--cargo-arg=$t"); done
FILES=("$@")
[ ${#FILES[@]} -gt 0 ] || FILES=(rust/src/ops/*.rs rust/src/backend/cpu/*.rs)
for f in "${FILES[@]}"; do
  name=$(basename "$(dirname "$f")")_$(basename "$f" .rs)
  echo "=== $f ($(date +%T))"
  # --gitignore true: the copies leave out the virtual environments and build outputs (GBs each).
  cargo mutants -d . -j "$JOBS" --gitignore true --timeout 120 --build-timeout 300 -f "$f" -o "$OUT/$name" \
    --no-shuffle "${ARGS[@]}" 2>&1 |
    grep -E "^(MISSED|TIMEOUT|Found|ok|[0-9]+ mutants|Error)" || true
done
