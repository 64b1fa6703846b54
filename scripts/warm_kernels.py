#!/usr/bin/env python3
"""Compile the CUDA kernels a timing run will launch into the disk cache, by running each head
dim once on a small problem (described and explicit masks, F32 and F16 Q), so that the
timed processes find them there instead of compiling while they are timed. Honours
MLX_NATIVE_CUDA_DEFINES and MLX_NATIVE_CUDA_SOURCE_DIR as any run does (the cache is keyed on
the source and the options), so each variant of a kernel is warmed by its own process.

    python3 scripts/warm_kernels.py [--device cuda] [HEAD_DIM ...]        # default: 64 128 256
"""

import argparse
import sys

import numpy as np

import mlx_native as mx


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("dims", nargs="*", type=int, default=[64, 128, 256])
    a = ap.parse_args()
    dims, dev = a.dims, mx.Device(a.device)
    rng = np.random.default_rng(0)
    rows, heads, kv_heads = 256, 8, 2
    for d in dims:
        q = rng.uniform(-1, 1, (rows, heads, d)).astype(np.float32)
        k = rng.uniform(-1, 1, (rows, kv_heads, d)).astype(np.float16)
        v = rng.uniform(-1, 1, (rows, kv_heads, d)).astype(np.float16)
        # The pair forms (fixed length, TMA-addressable K/V), described and explicit masks.
        out = mx.PrefillPlan(q, k, v, causal=True, device=dev).run()
        mx.PrefillPlan(q.astype(np.float16), k, v, causal=True, device=dev, out_dtype=np.float16).run()
        mx.PrefillPlan(q, k, v, mx.causal_mask(rows, rows), device=dev).run()
        if not np.isfinite(np.asarray(out)).all():
            print(f"head dim {d}: the output is not finite", file=sys.stderr)
            return 1
    print(f"warm: head dims {dims}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
