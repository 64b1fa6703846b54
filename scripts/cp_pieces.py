#!/usr/bin/env python3
"""Measure, on one device, the pieces a context-parallel prefill is made of, for the model of
multi-GPU scaling (scripts/cp_model.py): every distinct partial attention (block) of the
ring schedule of each sequence length N and rank count P, the merge of a partial into a
rank's result, the packing of K/V, the bytes a hop moves, and the whole sequence on one device.

    python3 scripts/cp_pieces.py --json cp_pieces.json            # H200: ~2 min (128k-512k, P 2/4/8)
    python3 scripts/cp_pieces.py --quick --json cp_pieces.json    # 128k only, seconds
    python3 scripts/cp_pieces.py --device cpu --quick --json x.json   # tiny sizes on the CPU

The layer is the Gemma 4 26B global one by default (16 query heads, 2 KV heads, head dim
512, F32 Q, F16 K/V, causal), zigzag layout; the blocks are those mlx_native.distributed
computes (``ring_schedule``), each timed as the ``flash_attn_prefill`` call the ring makes
(CUDA events on the GPU). It uses the installed mlx_native (run it from anywhere)."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time

import torch

import mlx_native as mn
from mlx_native.distributed import ring_schedule
from mlx_native.distributed.accumulate import merge_into

# Blocks with more (query, key) pairs than this are timed once after the warm-up (a 512k
# sequence's blocks take seconds each); smaller ones take the best of --repeats.
ONCE_PAIRS = 2**33


class Timer:
    """Wall time of a callable: CUDA events on the GPU, perf_counter on the CPU."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def ms(self, fn, repeats: int) -> float:
        best = math.inf
        for _ in range(max(1, repeats)):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                best = min(best, start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                best = min(best, 1e3 * (time.perf_counter() - t0))
        return best


def _inputs(rows: int, kv_rows: int, a, device: str, gen: torch.Generator):
    q = torch.empty((rows, a.heads, a.head_dim), dtype=torch.float32, device=device).uniform_(-1, 1, generator=gen)
    kv = torch.empty((kv_rows, 2, a.kv_heads, a.head_dim), dtype=torch.float16, device=device).uniform_(-1, 1, generator=gen)
    return q, kv


def _block_call(q, kv, offset, a):
    described = offset is not None
    return lambda: mn.flash_attn_prefill(q, kv[:, 0], kv[:, 1], causal=described, window=a.window if described else None,
                                         offset=offset, scale=1.0, return_lse=True, out_dtype=torch.float32)  # fmt: skip


def _merge_ms(rows: int, a, timer: Timer) -> float:
    """One partial of ``rows`` query rows merged into a running result (as the ring does)."""
    acc_o = torch.zeros((rows, a.heads, a.head_dim), dtype=torch.float32, device=a.device)
    acc_l = torch.zeros((a.heads, rows), dtype=torch.float32, device=a.device)
    o, lse = torch.ones_like(acc_o), torch.zeros_like(acc_l)
    return timer.ms(lambda: merge_into(acc_o, acc_l, o, lse), a.repeats)


def _pack_ms(rows: int, a, timer: Timer) -> float:
    """A rank's K and V packed into one message (once per prefill)."""
    kk = torch.zeros((rows, a.kv_heads, a.head_dim), dtype=torch.float16, device=a.device)
    return timer.ms(lambda: torch.stack((kk, kk), dim=1), a.repeats)


def measure(a) -> dict:
    device = a.device
    timer = Timer(device)
    gen = torch.Generator(device=device).manual_seed(0)
    kv_bytes_per_row = 2 * a.kv_heads * a.head_dim * 2  # K and V, float16

    # Warm up every kernel form (compiled on first use) on small shapes.
    q, kv = _inputs(256, 256, a, device, gen)
    for off in (None, 0):
        _block_call(q, kv, off, a)()
    del q, kv

    cases, full = [], []
    for n in a.seq_lens:
        shapes = {}
        for p in a.ranks:
            sch = ring_schedule(n, p, a.layout, a.causal, a.window)
            for rank in sch.steps:
                for step in rank:
                    for work in step.work:
                        for b in work.blocks:
                            shapes[(b.q1 - b.q0, b.k1 - b.k0, b.offset)] = b.pairs
        blocks = []
        for (rows, kv_rows, off), pairs in sorted(shapes.items(), key=lambda x: (x[0][0], x[0][1], x[0][2] is None, x[0][2] or 0)):
            q, kv = _inputs(rows, kv_rows, a, device, gen)
            call = _block_call(q, kv, off, a)
            reps = 1 if pairs > ONCE_PAIRS else a.repeats
            if reps == 1:
                call()  # this shape's own warm-up (allocations, caches)
            ms = timer.ms(call, reps)
            tflops = 4 * a.head_dim * a.heads * pairs / ms / 1e9
            blocks.append(dict(rows=rows, kv_rows=kv_rows, offset=off, pairs=pairs, ms=ms, tflops=tflops))
            print(f"N {n:>7}  block {rows:>7} x {kv_rows:>7}  {'offset ' + str(off) if off is not None else 'no mask':>14}"
                  f"  {ms:10.3f} ms  {tflops:8.2f} useful TFLOP/s", flush=True)  # fmt: skip
            del q, kv, call
        merges = []
        for rows in sorted({r for r, _, _ in shapes}):
            ms = _merge_ms(rows, a, timer)
            merges.append(dict(rows=rows, ms=ms))
            print(f"N {n:>7}  merge {rows:>7} rows  {ms:10.3f} ms", flush=True)
        packs = []
        for p in a.ranks:
            rows = max(ring_schedule(n, p, a.layout, a.causal, a.window).rows)
            packs.append(dict(ranks=p, rows=rows, ms=_pack_ms(rows, a, timer)))
        cases.append(dict(seq_len=n, blocks=blocks, merges=merges, packs=packs))
        if not a.no_full:
            q, kv = _inputs(n, n, a, device, gen)
            call = lambda: mn.flash_attn_prefill(q, kv[:, 0], kv[:, 1], causal=a.causal, window=a.window, scale=1.0,  # noqa: E731
                                                 out_dtype=torch.float32)  # fmt: skip
            pairs = mn.PrefillPlan(q, kv[:, 0], kv[:, 1], causal=a.causal, window=a.window).visible_pairs
            if pairs > ONCE_PAIRS:
                call()
            ms = timer.ms(call, 1 if pairs > ONCE_PAIRS else a.repeats)
            full.append(dict(seq_len=n, ms=ms, pairs=pairs, tflops=4 * a.head_dim * a.heads * pairs / ms / 1e9))
            print(f"N {n:>7}  whole sequence on one device  {ms:10.3f} ms", flush=True)
            del q, kv, call
        if device == "cuda":
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if device == "cuda" else mn.cpu_info().get("model", "cpu")
    return dict(
        what="pieces of a context-parallel prefill (scripts/cp_pieces.py), measured on one device",
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        device=name,
        backend=device,
        mlx_native=mn.__version__,
        torch=torch.__version__,
        layer=dict(heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim, q_dtype="float32", kv_dtype="float16",
                   causal=a.causal, window=a.window, scale=1.0, layout=a.layout),  # fmt: skip
        ranks=list(a.ranks),
        kv_bytes_per_row=kv_bytes_per_row,
        cases=cases,
        one_device=full,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="the smallest sequence only (CPU: tiny sizes)")
    ap.add_argument("--seq-lens", type=int, nargs="+", help="default 131072 262144 524288 (CPU: 1024 2048)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=512)
    ap.add_argument("--window", type=int, default=None, help="a sliding-window layer instead of the causal global one")
    ap.add_argument("--no-causal", dest="causal", action="store_false")
    ap.add_argument("--layout", choices=("zigzag", "contiguous"), default="zigzag")
    ap.add_argument("--repeats", type=int, default=3, help="best of this many runs for blocks below 2^33 pairs")
    ap.add_argument("--no-full", action="store_true", help="skip the whole sequence on one device")
    ap.add_argument("--json", help="write the pieces here")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not (torch.cuda.is_available() and "cuda" in mn.backends()):
        print("no usable CUDA device (pass --device cpu for tiny sizes on the CPU)", file=sys.stderr)
        return 2
    if a.seq_lens is None:
        a.seq_lens = [131072, 262144, 524288] if a.device == "cuda" else [1024, 2048]
        if a.quick:
            a.seq_lens = a.seq_lens[:1]
    if a.quick and a.device == "cpu":
        a.ranks = [p for p in a.ranks if p <= 4] or a.ranks
    t0 = time.perf_counter()
    with torch.inference_mode():
        pieces = measure(a)
    pieces["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"measured in {pieces['seconds']} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(pieces, f, indent=1)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
