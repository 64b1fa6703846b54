"""A quick check of the CUDA pair forms at some head dims against the float64 reference,
for a device call that times a kernel variant (scripts/gpu_hopper_step.sh runs it as its
smoke step): the described masks, an explicit additive mask, a window with sinks and lse,
BF16 K/V and a two-sequence batch. Prints one line a case and the launches' entry points;
exits non-zero at the first result off the reference.

    MLX_NATIVE_CUDA_TRACE=1 python3 scripts/gpu_smoke_dims.py 256 128
"""
import os
import sys

import numpy as np

import mlx_native as mx
from mlx_native.dtypes import bfloat16_dtype
from mlx_native.reference import nmse, reference_prefill

# SMOKE_DEVICE=cpu: the same cases on the CPU (a check of the script itself).
DEVICE = os.environ.get("SMOKE_DEVICE", "cuda")


def check(name, out, ref, lse=None, ref_lse=None, bf16=False):
    e = nmse(out, ref)
    le = 0.0 if lse is None else float(np.abs(np.asarray(lse) - ref_lse).max())
    print(f"{name}: nmse {e:.2e}" + ("" if lse is None else f", lse off {le:.1e}"), flush=True)
    assert e < (5e-5 if bf16 else 1e-5) and le < (1e-2 if bf16 else 2e-3), name


def main(dims):
    rng = np.random.default_rng(0)
    for d in dims:
        hq, hk = (8, 8) if d >= 256 else (8, 2)
        for causal in (True, False):
            q = rng.uniform(-1, 1, (1000, hq, d)).astype(np.float32)
            k = rng.uniform(-1, 1, (1000, hk, d)).astype(np.float16)
            v = rng.uniform(-1, 1, (1000, hk, d)).astype(np.float16)
            out = mx.PrefillPlan(q, k, v, causal=causal, device=DEVICE).run()
            check(f"d{d} causal={causal}", out, reference_prefill(q, k, v, causal=causal, scale=1 / np.sqrt(d))[0])
        # An explicit additive mask (the mask tiles), with rows fully masked.
        q = rng.uniform(-1, 1, (700, hq, d)).astype(np.float32)
        k = rng.uniform(-1, 1, (900, hk, d)).astype(np.float16)
        v = rng.uniform(-1, 1, (900, hk, d)).astype(np.float16)
        mask = np.where(rng.uniform(size=(700, 900)) < 0.3, -np.inf, rng.uniform(-2, 0, (700, 900))).astype(np.float16)
        mask[5:9] = -np.inf
        out = mx.PrefillPlan(q, k, v, mask, device=DEVICE).run()
        check(f"d{d} explicit mask", out, reference_prefill(q, k, v, mask, scale=1 / np.sqrt(d))[0])
        # The row sums and what reads them: lse, sinks, a window, BF16 K/V, a batch of two.
        for kvt in (np.float16, "bf16"):
            bf = kvt == "bf16"
            kvt = bfloat16_dtype() if bf else kvt
            q = rng.uniform(-1, 1, (2, 700, hq, d)).astype(np.float32)
            k = rng.uniform(-1, 1, (2, 700, hk, d)).astype(kvt)
            v = rng.uniform(-1, 1, (2, 700, hk, d)).astype(kvt)
            sinks = rng.uniform(-1, 1, hq).astype(np.float32)
            plan = mx.PrefillPlan(q, k, v, causal=True, window=300, sinks=sinks, return_lse=True, device=DEVICE)
            out, lse = plan.run()
            ro, rl = reference_prefill(q, k, v, causal=True, window=300, sinks=sinks, scale=1 / np.sqrt(d))
            check(f"d{d} {'bf16' if bf else 'f16'} batch, window, sinks, lse", out, ro, lse, rl, bf)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [64, 128, 256])
