#!/usr/bin/env python3
"""A model of context-parallel prefill over P GPUs, from pieces measured on one
(scripts/cp_pieces.py) and a link bandwidth: per ring step each rank computes its blocks
(the measured calls and merges) while its next K/V hop travels; a step lasts as long as the
slowest rank's max(compute, transfer), the ring being lockstep. It predicts the time per
step, the total, the speedup over one GPU, the efficiency against linear scaling, and the
share of the time that communication leaves uncovered. A model, not a measurement.

    python3 scripts/cp_model.py cp_pieces.json                        # NVLink 4: 450 GB/s a direction
    python3 scripts/cp_model.py cp_pieces.json --bandwidth-gbs 380    # a measured value
    python3 scripts/cp_model.py cp_pieces.json --json cp_model.json --markdown
    python3 scripts/cp_model.py --assume-tflops 290 --assume-memory-gbs 4000   # no pieces: rates assumed

One GPU's time is the measured whole-sequence run where the pieces have it, else the sum
of every block's measured time over all ranks (the same work, in pieces). What it leaves
out: NCCL's kernels taking SMs from the attention while they overlap, the links of a
topology other than all-to-all (an NVSwitch), and the time ranks wait for a slower one
beyond the lockstep."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List, Optional

from mlx_native.distributed import ring_schedule

#: NVLink 4 (H100/H200): 900 GB/s per GPU both directions together, 450 GB/s each way.
NVLINK4_GBS = 450.0


def _lookup_blocks(case: dict) -> Dict[tuple, float]:
    return {(b["rows"], b["kv_rows"], b["offset"]): b["ms"] for b in case["blocks"]}


def predict_case(pieces: dict, case: dict, ranks: int, bandwidth_gbs: float, latency_us: float) -> dict:
    """The model of one sequence length over ``ranks`` ranks."""
    layer = pieces["layer"]
    n = case["seq_len"]
    sch = ring_schedule(n, ranks, layer["layout"], layer["causal"], layer["window"])
    block_ms = _lookup_blocks(case)
    merge_ms = {m["rows"]: m["ms"] for m in case["merges"]}
    pack_ms = next((p["ms"] for p in case.get("packs", []) if p["ranks"] == ranks), 0.0)
    row_bytes = pieces["kv_bytes_per_row"]
    bytes_per_ms = bandwidth_gbs * 1e9 / 1e3

    steps: List[dict] = []
    reached = [set() for _ in range(ranks)]  # row ranges a partial reached: the first is taken, not merged
    busy = [0.0] * ranks
    for t in range(sch.n_steps):
        compute, transfer = [], []
        for r in range(ranks):
            st = sch.steps[r][t]
            c = 0.0
            for w in st.work:
                for b in w.blocks:
                    key = (b.q1 - b.q0, b.k1 - b.k0, b.offset)
                    if key not in block_ms:
                        raise SystemExit(f"the pieces have no block {key} of N {n} over {ranks} ranks: measure them with cp_pieces.py")
                    c += block_ms[key]
                    rows = set(range(b.q0, b.q1))
                    if rows & reached[r]:
                        c += merge_ms[b.q1 - b.q0]
                    reached[r] |= rows
            sent = sum(x.rows for x in st.sends) * row_bytes
            got = sum(x.rows for x in st.recvs) * row_bytes
            hop = max(sent, got) / bytes_per_ms + (latency_us / 1e3 if (st.sends or st.recvs) else 0.0)
            compute.append(c)
            transfer.append(hop)
            busy[r] += c
        length = max(max(c, x) for c, x in zip(compute, transfer))
        steps.append(dict(step=t, ms=length, compute_ms=max(compute), transfer_ms=max(transfer),
                          uncovered_ms=max(0.0, length - max(compute))))  # fmt: skip
    total = pack_ms + sum(s["ms"] for s in steps)
    whole = next((w for w in pieces.get("one_device", []) if w["seq_len"] == n), None)
    if whole is not None:
        one, one_from = whole["ms"], "measured whole sequence"
    else:
        one = sum(block_ms[(b.q1 - b.q0, b.k1 - b.k0, b.offset)] for rk in sch.steps for s in rk for w in s.work for b in w.blocks)
        one_from = "sum of the blocks"
    speedup = one / total
    hop_bytes = max(sch.rows) * row_bytes
    return dict(
        seq_len=n, ranks=ranks, chunk_rows=n // (2 * ranks if layer["layout"] == "zigzag" else ranks),
        steps=steps, total_ms=total, one_gpu_ms=one, one_gpu_from=one_from, speedup=speedup,
        efficiency=speedup / ranks, uncovered_share=sum(s["uncovered_ms"] for s in steps) / total,
        hop_bytes=hop_bytes, hop_ms=hop_bytes / bytes_per_ms, imbalance=max(busy) / (sum(busy) / ranks),
        hops=sch.transfers(),
    )  # fmt: skip


def predict(pieces: dict, bandwidth_gbs: float = NVLINK4_GBS, latency_us: float = 10.0, ranks: Optional[List[int]] = None) -> dict:
    out = []
    for case in pieces["cases"]:
        for p in ranks or pieces["ranks"]:
            out.append(predict_case(pieces, case, p, bandwidth_gbs, latency_us))
    return dict(what="model, not measurement (scripts/cp_model.py)", device=pieces.get("device"), layer=pieces["layer"],
                bandwidth_gbs=bandwidth_gbs, latency_us=latency_us, predictions=out)  # fmt: skip


def assumed_pieces(seq_lens: List[int], ranks: List[int], tflops: float, memory_gbs: float, heads: int = 16,
                   kv_heads: int = 2, head_dim: int = 512) -> dict:
    """Pieces as cp_pieces.py writes them, from assumed rates instead of measurements: every
    block and the whole sequence at ``tflops`` useful TFLOP/s, merges and packing at
    ``memory_gbs`` (a merge reads the running result and the partial and writes the
    result: three passes over float32 ``[rows, heads, dim]``). Causal, zigzag."""
    flops_per_pair = 4 * head_dim * heads
    row_bytes = 2 * kv_heads * head_dim * 2
    cases = []
    for n in seq_lens:
        shapes = {}
        for p in ranks:
            for rank in ring_schedule(n, p, "zigzag", True, None).steps:
                for st in rank:
                    for w in st.work:
                        for b in w.blocks:
                            shapes[(b.q1 - b.q0, b.k1 - b.k0, b.offset)] = b.pairs
        blocks = [dict(rows=r, kv_rows=k, offset=o, pairs=x, ms=x * flops_per_pair / tflops / 1e9) for (r, k, o), x in shapes.items()]
        merges = [dict(rows=r, ms=3 * r * heads * head_dim * 4 / memory_gbs / 1e6) for r in {r for r, _, _ in shapes}]
        packs = [dict(ranks=p, rows=n // p, ms=3 * (n // p) * row_bytes / 2 / memory_gbs / 1e6) for p in ranks]
        cases.append(dict(seq_len=n, blocks=blocks, merges=merges, packs=packs))
    whole = [dict(seq_len=n, ms=n * (n + 1) / 2 * flops_per_pair / tflops / 1e9) for n in seq_lens]
    layer = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, q_dtype="float32", kv_dtype="float16", causal=True,
                 window=None, scale=1.0, layout="zigzag")  # fmt: skip
    return dict(device=f"assumed: {tflops:g} useful TFLOP/s, {memory_gbs:g} GB/s memory", backend="none", layer=layer,
                ranks=ranks, kv_bytes_per_row=row_bytes, cases=cases, one_device=whole)  # fmt: skip


def _table(model: dict, markdown: bool) -> str:
    head = ["N", "GPUs", "chunk rows", "longest step ms: compute / hop", "total ms", "one GPU ms", "speedup", "efficiency", "uncovered comm"]
    rows = []
    for p in model["predictions"]:
        c = max(s["compute_ms"] for s in p["steps"])
        h = max(s["transfer_ms"] for s in p["steps"])
        one = f"{p['one_gpu_ms']:.1f}" + ("" if p["one_gpu_from"].startswith("measured") else " (sum)")
        rows.append([f"{p['seq_len'] // 1024}k" if p["seq_len"] >= 1024 else str(p["seq_len"]), str(p["ranks"]),
                     str(p["chunk_rows"]), f"{c:.2f} / {h:.3f}", f"{p['total_ms']:.1f}", one, f"{p['speedup']:.2f}x",
                     f"{100 * p['efficiency']:.1f}%", f"{100 * p['uncovered_share']:.2f}%"])  # fmt: skip
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    return "\n".join("  ".join(x.rjust(w) for x, w in zip(r, widths)) for r in [head] + rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pieces", nargs="?", help="the JSON of scripts/cp_pieces.py")
    ap.add_argument("--assume-tflops", type=float, help="no pieces: every block at this many useful TFLOP/s")
    ap.add_argument("--assume-memory-gbs", type=float, default=4000.0, help="with --assume-tflops: merges at this rate")
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[131072, 262144, 524288], help="with --assume-tflops")
    ap.add_argument("--bandwidth-gbs", type=float, default=NVLINK4_GBS,
                    help="GB/s a GPU sends (and receives) at once; default NVLink 4's 450 (900 both ways)")  # fmt: skip
    ap.add_argument("--latency-us", type=float, default=10.0, help="fixed cost of a step's hops")
    ap.add_argument("--ranks", type=int, nargs="+", help="default: those the pieces were measured for")
    ap.add_argument("--json", help="write the predictions here")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    a = ap.parse_args(argv)
    if a.bandwidth_gbs <= 0 or a.latency_us < 0:
        ap.error("the bandwidth must be positive and the latency not negative")
    if (a.pieces is None) == (a.assume_tflops is None):
        ap.error("pass a pieces JSON (scripts/cp_pieces.py) or --assume-tflops, one of them")
    if a.pieces is not None:
        with open(a.pieces) as f:
            pieces = json.load(f)
    else:
        pieces = assumed_pieces(a.seq_lens, a.ranks or [2, 4, 8], a.assume_tflops, a.assume_memory_gbs)
    model = predict(pieces, a.bandwidth_gbs, a.latency_us, a.ranks)
    print(f"model, not measurement: pieces of {pieces.get('device')} ({pieces.get('backend')}), "
          f"{a.bandwidth_gbs:g} GB/s a direction, {a.latency_us:g} us a step")  # fmt: skip
    print(_table(model, a.markdown))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(model, f, indent=1)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
