"""The CPU's AMX kernels, split by split (issue 26): for each choice of bf16 products (Q.K^T,
P.V) the time of one causal GQA prefill (32/8 heads, d128, as a model calls it: the mask
described) and its NMSE against the float64 reference (on a sample of rows), next to the
FMA kernels (AVX-512) and PyTorch's SDPA in the same dtype; then whether the hardware tiles
compute what the emulated ones do. Prints one line per measurement and writes JSON.

    python3 scripts/cpu_amx_splits.py OUT.json [ROWS]

Run on a CPU with AMX (elsewhere it measures the emulation, slowly, and says so)."""

from __future__ import annotations

import json
import sys
import time

import numpy as np

import mlx_native as mn
from mlx_native.dtypes import bfloat16_dtype
from mlx_native.reference import nmse, reference_prefill

SPLITS = {"bfloat16": [(1, 1), (2, 1), (1, 2), (2, 2)], "float16": [(2, 2), (2, 3), (3, 3), (4, 4)]}
SAMPLE_ROWS = 96


def best_ms(f, repeats=3):
    f()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main(out_path: str, rows: int = 2048) -> int:
    amx = "amx" in mn.cpu_info()["detected"]
    isa = "amx" if amx else "amx-emulated"
    if not amx:
        print("this CPU has no AMX: measuring the emulated tiles (slow, and their times mean nothing)")
        rows = min(rows, 256)
    nh, nkv, d = 32, 8, 128
    rng = np.random.default_rng(0)
    sample = np.unique(np.linspace(0, rows - 1, SAMPLE_ROWS).astype(int))
    results = []
    for dtype in ("bfloat16", "float16"):
        t = bfloat16_dtype() if dtype == "bfloat16" else np.float16
        q = rng.uniform(-1, 1, (rows, nh, d)).astype(t)
        k = rng.uniform(-1, 1, (rows, nkv, d)).astype(t)
        v = rng.uniform(-1, 1, (rows, nkv, d)).astype(t)
        # The reference of the sampled rows: each sees the cache up to its own position.
        ref = np.stack([reference_prefill(q[r : r + 1], k[: r + 1], v[: r + 1], causal=True, scale=d**-0.5)[0][0] for r in sample])

        def ours():
            return mn.flash_attn_prefill(q, k, v, causal=True)

        def err(o):
            return nmse(np.asarray(o, np.float32)[sample], ref)

        def record(label, ms, e, **kw):
            results.append(dict(dtype=dtype, impl=label, ms=ms, nmse=e, rows=rows, **kw))
            print(f"{dtype:9} {label:34} {ms:9.2f} ms  nmse {e:.2e}", flush=True)

        fma = next(i for i in mn.cpu_info()["detected"] if i != "amx")
        mn.force_cpu_isa(fma)
        try:
            record(f"mlx-native {fma}", best_ms(ours), err(ours()))
        finally:
            mn.force_cpu_isa(None)
        mn.force_cpu_isa(isa)
        try:
            for qk, pv in SPLITS[dtype]:
                mn.set_cpu_amx_products(dtype, qk, pv)
                record(f"mlx-native {isa} products {qk},{pv}", best_ms(ours), err(ours()), qk=qk, pv=pv)
            mn.set_cpu_amx_products(dtype)
            default = mn.cpu_amx_products(dtype)
            print(f"{dtype:9} default products {default}")
        finally:
            mn.set_cpu_amx_products(dtype)
            mn.force_cpu_isa(None)
        try:
            import torch
            import torch.nn.functional as F

            tt = getattr(torch, dtype)

            def heads(x):
                return torch.from_numpy(np.ascontiguousarray(x.astype(np.float32).transpose(1, 0, 2))).to(tt)[None]

            tq, tk, tv = heads(q), heads(k), heads(v)

            def sdpa():
                with torch.inference_mode():
                    return F.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True)

            o = sdpa()[0].transpose(0, 1).float().numpy()
            record("torch sdpa, is_causal, enable_gqa", best_ms(sdpa), err(o), torch=torch.__version__)
        except ImportError as e:
            print(f"no torch: {e}")
    # The hardware tiles against the emulated ones on a small case.
    agree = {}
    if amx:
        for dtype in ("bfloat16", "float16"):
            t = bfloat16_dtype() if dtype == "bfloat16" else np.float16
            q = rng.uniform(-1, 1, (70, 8, 128)).astype(np.float32)
            k = rng.uniform(-1, 1, (150, 2, 128)).astype(t)
            v = rng.uniform(-1, 1, (150, 2, 128)).astype(t)
            outs = []
            for i in ("amx", "amx-emulated"):
                mn.force_cpu_isa(i)
                try:
                    outs.append(mn.flash_attn_prefill(q, k, v, causal=True))
                finally:
                    mn.force_cpu_isa(None)
            same = bool(np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32)))
            agree[dtype] = dict(bit_identical=same, nmse=nmse(outs[0], outs[1]))
            print(f"{dtype:9} hardware vs emulated tiles: bit-identical {same}, nmse {agree[dtype]['nmse']:.2e}")
    with open(out_path, "w") as f:
        json.dump(dict(cpu=mn.cpu_info(), results=results, hardware_vs_emulation=agree), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], *(int(x) for x in sys.argv[2:3])))
