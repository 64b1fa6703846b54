#!/usr/bin/env python3
"""One launch of each attention kernel at a moderate size, for Nsight Compute (through
scripts/gpu_check.sh or scripts/gpu_profile.sh):

- dense head dim 256 (8/8 heads, 8192 rows), described;
- causal head dim 256 (8/8 heads, 16384 rows), described: the FlashAttention-4 comparison;
- the global layer (head dim 512, 16/2 heads, 8192 rows, causal): described, then as an
  explicit additive mask (the classifier's launch, then the attention's);
- the sliding layer (head dim 256, 16/8 heads, window 1024, 8192 rows), described;
- only when named by --case (issue 25's rows at the common head dims, 16384 rows, described):
  causal d64 32/8 (`causal64`), causal d128 32/8 (`causal128`), dense d128 32/8 (`dense128`).

    python3 scripts/profile_case.py [--quick] [--case FORM ...]
    # --quick: 4096 rows for the global layer, no causal 16k; --case: only the cases of these
    # forms (dense, causal, sliding: head dim 256; global, explicit: head dim 512)
"""

import sys

import numpy as np

import mlx_native as mx

args = sys.argv[1:]
quick = "--quick" in args
only = {args[i + 1] for i, a in enumerate(args[:-1]) if a == "--case"}
dev = mx.Device("cuda")
rng = np.random.default_rng(0)
cases = [(8192, 8, 8, 256, "dense")]
if not quick:
    cases.append((16384, 8, 8, 256, "causal"))
g = 4096 if quick else 8192
cases += [(g, 16, 2, 512, "causal"), (g, 16, 2, 512, "explicit"), (8192, 16, 8, 256, "sliding")]
common = [(16384, 32, 8, 64, "causal"), (16384, 32, 8, 128, "causal"), (16384, 32, 8, 128, "dense")]
cases += [c for c in common if f"{c[4]}{c[3]}" in only]
names = {
    (256, "dense"): "dense",
    (256, "causal"): "causal",
    (256, "sliding"): "sliding",
    (512, "causal"): "global",
    (512, "explicit"): "explicit",
    (64, "causal"): "causal64",
    (128, "causal"): "causal128",
    (128, "dense"): "dense128",
}
if only:
    cases = [c for c in cases if names[(c[3], c[4])] in only]
for rows, nh, nkv, hd, form in cases:
    q = rng.uniform(-1, 1, (rows, nh, hd)).astype(np.float32)
    k = rng.uniform(-1, 1, (rows, nkv, hd)).astype(np.float16)
    v = rng.uniform(-1, 1, (rows, nkv, hd)).astype(np.float16)
    if form == "explicit":
        mask = np.triu(np.full((rows, rows), -np.inf, np.float16), 1)
        plan = mx.PrefillPlan(q, k, v, mask, scale=1.0, device=dev)
    elif form == "sliding":  # the Gemma sliding layer, window 1024, described
        plan = mx.PrefillPlan(q, k, v, causal=True, window=1024, scale=1.0, device=dev)
    else:
        plan = mx.PrefillPlan(q, k, v, causal=form == "causal", scale=1.0, device=dev)
    plan.run()
    print(rows, nh, nkv, hd, form, "ran", flush=True)
