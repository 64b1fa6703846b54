#!/usr/bin/env python3
"""Small CUDA cases for compute-sanitizer (memcheck, racecheck, synccheck): both head dims,
aligned and odd strides, partial tiles, GQA, all three tile classes, and (on Hopper) the
head-dim-512 CTA pairs. Exits non-zero when an output misses the float64 reference."""

import sys

import numpy as np

import mlx_native as mx
from mlx_native.reference import nmse, reference_attention
from mlx_native.testing import make_case, run_low_level

dev = mx.Device("cuda")
rng = np.random.default_rng(1)
worst = 0.0
for rows, nh, nkv, hd, kv, mask, pad in [
    (40, 4, 2, 256, 150, "peer", (4, 1, 2)),
    (70, 8, 1, 256, 200, "causal", (0, 0, 0)),
    (33, 4, 2, 512, 130, "peer", (0, 0, 0)),
    (20, 2, 2, 512, 77, "causal", (4, 1, 2)),
    (50, 16, 2, 512, 200, "peer", (0, 0, 0)),  # CTA pairs (Hopper): TMA multicast, clusters
    (40, 4, 2, 256, 2300, "peer", (0, 0, 0)),  # 36 steps: the walk reads a second table window
]:
    c = make_case(rng, rows, nh, nkv, hd, kv, mask=mask, pad=pad)
    out, blk = run_low_level(dev, c)
    e = nmse(out, reference_attention(c.q, c.k, c.v, c.mask))
    worst = max(worst, e)
    print(f"rows {rows} heads {nh}/{nkv} d{hd} kv {kv} {mask} pad {pad}: nmse {e:.2e}, blk classes {sorted(set(blk.ravel().tolist()))}")
# Split-KV through a plan (the front door's op): a chunk against a long cache, its parts in a
# workspace and the merge, with sinks and lse.
from mlx_native.reference import reference_prefill  # noqa: E402

for rows, nh, nkv, hd, kv in [(40, 4, 2, 256, 2300), (24, 8, 2, 128, 2600)]:
    q = rng.uniform(-1, 1, (rows, nh, hd)).astype(np.float32)
    k = rng.uniform(-1, 1, (kv, nkv, hd)).astype(np.float16)
    v = rng.uniform(-1, 1, (kv, nkv, hd)).astype(np.float16)
    sinks = rng.uniform(-1, 1, nh).astype(np.float32)
    plan = mx.PrefillPlan(q, k, v, device="cuda", causal=True, return_lse=True, sinks=sinks)
    out, lse = plan.run(q, k, v, sinks=sinks)
    ref, _ = reference_prefill(q, k, v, causal=True, sinks=sinks, scale=1 / np.sqrt(hd))
    e = nmse(out, ref)
    worst = max(worst, e)
    print(f"split rows {rows} heads {nh}/{nkv} d{hd} kv {kv}: workspace {plan.workspace_bytes} bytes, nmse {e:.2e}")
print("worst nmse", worst)
sys.exit(0 if worst < 1e-5 else 1)
