"""``python -m mlx_native demo``: a Gemma-4-26B-shaped prefill (its sliding and global
layers), checked against the float64 reference on a sample of heads, timed."""

from __future__ import annotations

import time
from typing import Optional

import numpy as np

from .masks import causal_mask
from .plan import PrefillPlan
from .device import Device
from .reference import nmse, random_qkv, reference_attention, useful_flops

#: SPEC section 4, Gemma 4 26B-A4B.
GEMMA4_26B_LAYERS = [
    dict(name="26B sliding", n_heads=16, n_kv_heads=8, head_dim=256, window=1024),
    dict(name="26B global", n_heads=16, n_kv_heads=2, head_dim=512, window=None),
]


def time_best(fn, repeats: int) -> float:
    """Best wall time of ``repeats`` calls after one warm-up, in seconds."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def time_on_device(plan: PrefillPlan, dev: Device, repeats: int, runs: int = 10) -> float:
    """Seconds per run of the plan on its device-resident buffers: ``runs`` recorded on one
    encoder and committed at once (the commit waits), best of ``repeats`` after a warm-up.
    This is the kernels' own time, with no transfer of the host arrays."""

    def batch():
        enc = dev.encoder()
        for _ in range(runs):
            plan.encode(enc)
        enc.commit()

    return time_best(batch, repeats) / runs


def run_demo(rows: int = 2048, device: Optional[str] = None, repeats: int = 3, seed: int = 0, sample_heads: int = 2) -> list:
    dev = Device(device or "auto")
    rng = np.random.default_rng(seed)
    on_gpu = dev.backend != "cpu"
    print(f"mlx-native demo on {dev.description}: Gemma 4 26B layers, {rows} rows, fresh prefill")
    if on_gpu:
        print("ms: the prefill on device-resident arrays; host ms: plan.run on the host arrays (the output copied back)")
    host_col = f" {'host ms':>9}" if on_gpu else ""
    print(f"{'layer':12} {'heads':>6} {'dim':>4} {'mask':>12} {'ms':>9} {'GFLOP/s':>9}{host_col} {'NMSE':>10}")
    results = []
    for layer in GEMMA4_26B_LAYERS:
        nh, nkv, hd, w = layer["n_heads"], layer["n_kv_heads"], layer["head_dim"], layer["window"]
        q, k, v = random_qkv(rows, nh, nkv, hd, rows, rng)
        plan = PrefillPlan(q, k, v, causal=True, window=w, scale=1.0, device=dev)  # SPEC 4: scale 1
        host_seconds = time_best(plan.run, repeats)
        seconds = time_on_device(plan, dev, repeats) if on_gpu else host_seconds
        out = plan.run().copy()
        heads = sorted({0, nh - 1} | set(rng.choice(nh, size=min(sample_heads, nh), replace=False).tolist()))
        ref = reference_attention(q, k, v, causal_mask(rows, rows, w), heads=heads)
        err = nmse(out[:, heads], ref[:, heads])
        gflops = useful_flops(hd, nh, plan.visible_pairs) / seconds / 1e9
        mask_desc = f"window {w}" if w else "causal"
        host = f" {host_seconds * 1e3:9.2f}" if on_gpu else ""
        print(f"{layer['name']:12} {nh:>3}/{nkv:<2} {hd:>4} {mask_desc:>12} {seconds * 1e3:9.2f} {gflops:9.1f}{host} {err:10.2e}")
        results.append(dict(layer=layer["name"], ms=seconds * 1e3, host_ms=host_seconds * 1e3, gflops=gflops, nmse=err,
                            heads_checked=heads))  # fmt: skip
    worst = max(r["nmse"] for r in results)
    print(f"worst NMSE {worst:.2e} (SPEC bar 5e-4): {'OK' if worst <= 5e-4 else 'FAIL'}")
    return results
