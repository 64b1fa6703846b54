#!/usr/bin/env python3
"""One launch of each attention kernel at a moderate size, for Nsight Compute:
dense head dim 256 (8/8 heads, 8192 rows) and the global layer (head dim 512, 16/2, causal,
4096 rows)."""

import numpy as np

import mlx_native as mx

dev = mx.Device("cuda")
rng = np.random.default_rng(0)
for rows, nh, nkv, hd, causal in [(8192, 8, 8, 256, False), (4096, 16, 2, 512, True)]:
    q = rng.uniform(-1, 1, (rows, nh, hd)).astype(np.float32)
    k = rng.uniform(-1, 1, (rows, nkv, hd)).astype(np.float16)
    v = rng.uniform(-1, 1, (rows, nkv, hd)).astype(np.float16)
    plan = mx.PrefillPlan(q, k, v, causal=causal, scale=1.0, device=dev)
    plan.run()
    print(rows, nh, nkv, hd, "causal" if causal else "dense", "ran")
