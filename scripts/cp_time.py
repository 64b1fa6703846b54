#!/usr/bin/env python3
"""Time a context-parallel prefill for real, over the processes torchrun starts (NCCL and a
GPU each, or gloo on the CPU), against the same layer on one device; check each rank's rows
against the one-device result. The measurement that scripts/cp_model.py predicts.

    torchrun --nproc-per-node 8 scripts/cp_time.py --seq-len 131072             # 8 GPUs
    torchrun --nproc-per-node 2 scripts/cp_time.py --device cpu --seq-len 2048  # CPU, gloo

Rank 0 prints the times (the slowest rank's, each the best of --repeats after a barrier)
and writes --json. The layer is the Gemma 4 26B global one by default (16/2 heads, dim 512,
F32 Q, F16 K/V, causal, scale 1), zigzag. It uses the installed mlx_native."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import mlx_native as mn
from mlx_native.distributed import context_parallel_prefill, shard_sequence
from mlx_native.reference import nmse


def _now(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _best_ms(fn, repeats: int, device) -> float:
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        t0 = _now(device)
        fn()
        best = min(best, 1e3 * (_now(device) - t0))
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--seq-len", type=int, default=131072)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=512)
    ap.add_argument("--window", type=int, default=None)
    ap.add_argument("--layout", choices=("zigzag", "contiguous"), default="zigzag")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-one-device", action="store_true", help="skip the one-device run (and the check)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if a.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")

    gen = torch.Generator(device=device).manual_seed(0)  # the same whole sequence on every rank
    n, nh, nkv, hd = a.seq_len, a.heads, a.kv_heads, a.head_dim
    q = torch.empty((n, nh, hd), dtype=torch.float32, device=device).uniform_(-1, 1, generator=gen)
    k = torch.empty((n, nkv, hd), dtype=torch.float16, device=device).uniform_(-1, 1, generator=gen)
    v = torch.empty((n, nkv, hd), dtype=torch.float16, device=device).uniform_(-1, 1, generator=gen)
    lq, lk, lv = (shard_sequence(x, world, rank, a.layout).contiguous() for x in (q, k, v))
    kw = dict(causal=True, window=a.window, scale=1.0, layout=a.layout, seq_len=n)

    with torch.inference_mode():
        out = context_parallel_prefill(lq, lk, lv, **kw)  # warm-up: kernels compiled, communicators set up
        ring_ms = _best_ms(lambda: context_parallel_prefill(lq, lk, lv, **kw), a.repeats, device)
        checked = None
        one_ms = None
        if not a.no_one_device:
            whole = mn.flash_attn_prefill(q, k, v, causal=True, window=a.window, scale=1.0)
            one_ms = _best_ms(lambda: mn.flash_attn_prefill(q, k, v, causal=True, window=a.window, scale=1.0), a.repeats, device)
            checked = nmse(out.float().cpu().numpy(), shard_sequence(whole, world, rank, a.layout).float().cpu().numpy())
            del whole
    # The slowest rank's time is the prefill's; the worst rank's NMSE.
    stats = torch.tensor([ring_ms, one_ms or 0.0, checked or 0.0], dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    ring_ms, one_ms_max, worst = stats.tolist()
    if rank == 0:
        res = dict(what="context-parallel prefill, measured (scripts/cp_time.py)", ranks=world, backend=dist.get_backend(),
                   device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", seq_len=n,
                   layer=dict(heads=nh, kv_heads=nkv, head_dim=hd, window=a.window, layout=a.layout),
                   ring_ms=ring_ms, one_device_ms=None if a.no_one_device else one_ms_max,
                   speedup=None if a.no_one_device else one_ms_max / ring_ms,
                   worst_rank_nmse_vs_one_device=None if a.no_one_device else worst)  # fmt: skip
        print(json.dumps(res, indent=1))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
