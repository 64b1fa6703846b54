#!/usr/bin/env bash
# Where the attention kernel's warps wait, instruction by instruction (one device-machine
# call): Nsight Compute's warp-state sampling of one launch of a profile_case.py case, the
# kernel's summary metrics, and the SASS instructions with the most stall samples (with
# their reasons). Logs go to $OUT (ncu-details.txt, ncu-source.csv, ncu-top.txt).
#
#   bash scripts/gpu_profile_source.sh [CASE]    # CASE: dense, causal (default), sliding, global, explicit
#   KERNEL_RE=flash_attn_prefill_d64 bash scripts/gpu_profile_source.sh causal64   # also causal128, dense128
# (KERNEL_RE: the launches profiled, a regex on the kernel's name; default the tensor op's.)
#
# Uses the installed mlx_native (PYTHONPATH) and MLX_NATIVE_CUDA_SOURCE_DIR if set.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"
HERE=$(cd "$(dirname "$0")/.." && pwd)
prepare /tmp/gpu-profile
CASE=${1:-causal}
rep=/tmp/profile-$CASE
rm -f "$rep.ncu-rep"
timeout "${NCU_TIMEOUT:-240}" ncu --clock-control none -k "regex:${KERNEL_RE:-flash_attn_prefill_tensor}" -c 1 \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --section WarpStateStats --section SourceCounters --section LaunchStats --section Occupancy \
  --metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,sm__cycles_elapsed.avg \
  -o "$rep" python3 "$HERE/scripts/profile_case.py" --case "$CASE" > "$OUT/ncu-run.log" 2>&1
echo "ncu exit $?"
ncu -i "$rep.ncu-rep" --page details > "$OUT/ncu-details.txt" 2>&1
grep -E "Duration|gmma_cycles|pipe_xu|pipe_fma|pipe_alu|Executed Ipc A|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|Shared|Registers|Warp Cycles Per Issued|inst_executed.sum|cycles_elapsed" "$OUT/ncu-details.txt" | head -30
ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu-source.csv" 2>&1 ||
  ncu -i "$rep.ncu-rep" --page source --csv > "$OUT/ncu-source.csv" 2>&1
python3 - "$OUT/ncu-source.csv" > "$OUT/ncu-top.txt" 2>&1 <<'EOF'
# The instructions with the most warp-stall samples, with the columns of their main reasons.
import csv, sys
rows = list(csv.reader(open(sys.argv[1], errors="replace")))
head_i = next(i for i, r in enumerate(rows) if any("Sampling" in c for c in r))
head, body = rows[head_i], rows[head_i + 1:]
col = next(i for i, c in enumerate(head) if "Sampling (All" in c)
src = next((i for i, c in enumerate(head) if c.strip() == "Source"), 1)
def num(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0
total = sum(num(r[col]) for r in body if len(r) > col)
print(f"{len(body)} instructions, {total:.0f} samples; columns: {head}")
reasons = [i for i, c in enumerate(head) if c.startswith("stall_") or "Stall" in c and i != col][:40]
for r in sorted((r for r in body if len(r) > col), key=lambda r: -num(r[col]))[:60]:
    top = sorted(((num(r[i]), head[i]) for i in reasons), reverse=True)[:3]
    print(f"{num(r[col]) / max(total, 1) * 100:5.1f}%  {r[0]:>8}  {r[src][:70]:70}  " + ", ".join(f"{n}={v:.0f}" for v, n in top if v))
EOF
head -70 "$OUT/ncu-top.txt"
