#!/usr/bin/env python3
"""The CUDA kernel against PyTorch SDPA on the shapes that matter, in one run.

For each case: our time (mask classification + attention, and attention alone), useful
TFLOP/s (SPEC section 5), the ratio to every SDPA backend that accepts the case (with the
same mask, and with is_causal where the mask is plain causal), and the NMSE against a
float64 reference on sampled (row, head) pairs (the worst row is reported).

    python scripts/gpu_bench.py [--cases global-2048,...] [--json out.json] [--repeat 10]

Our time: `repeat` runs recorded in one encoder and committed once (the commit launches
them back to back on the device's stream and waits), wall-clock around the commit, per
run; the median of `trials` such commits. Peers: CUDA events around each call, median.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone

import numpy as np

import mlx_native as mx
from mlx_native.bench_cuda_peers import best_with_mask, sdpa_peers
from mlx_native.reference import useful_flops

# name: (rows, n_heads, n_kv_heads, head_dim, kind, window)
CASES = {
    "global-2048": (2048, 16, 2, 512, "causal", None),
    "global-8192": (8192, 16, 2, 512, "causal", None),
    "sliding-2048": (2048, 16, 8, 256, "window", 1024),
    "sliding-8192": (8192, 16, 8, 256, "window", 1024),
    "causal-16384": (16384, 8, 8, 256, "causal", None),
    "dense-16384": (16384, 8, 8, 256, "zero", None),
}

DESCRIPTION = {
    "global-2048": "global d512 16/2 causal, 2048 rows",
    "global-8192": "global d512 16/2 causal, 8192 rows",
    "sliding-2048": "sliding d256 16/8 window 1024, 2048 rows",
    "sliding-8192": "sliding d256 16/8 window 1024, 8192 rows",
    "causal-16384": "causal d256 8/8, 16384 rows",
    "dense-16384": "dense d256 8/8 zero mask, 16384 rows",
}


def sampled_nmse(q, k, v, mask, out, heads, rows):
    """Worst and mean per-row NMSE of ``out`` against float64 on (rows x heads)."""
    group = q.shape[1] // k.shape[1]
    worst, total = 0.0, []
    for h in heads:
        g = h // group
        kg = k[:, g, :].astype(np.float64)
        vg = v[:, g, :].astype(np.float64)
        for r in rows:
            qh = q[r, h].astype(np.float32).astype(np.float16).astype(np.float64)
            s = kg @ qh + mask[r].astype(np.float64)
            m = s.max()
            if not np.isfinite(m):
                ref = np.zeros(q.shape[2])
            else:
                p = np.exp(s - m)
                ref = (p @ vg) / p.sum()
            o = out[r, h].astype(np.float64)
            den = float((ref**2).sum())
            e = float(((o - ref) ** 2).sum()) / (den if den else 1.0)
            worst = max(worst, e)
            total.append(e)
    return worst, float(np.mean(total))


def time_ours(plan, dev, repeat, trials, classify=True):
    with dev.encoder() as enc:  # warm: compile, first touch
        plan.encode(enc)
    per = []
    for _ in range(trials):
        enc = dev.encoder()
        for _ in range(repeat):
            plan.encode(enc, classify=classify)
        t0 = time.perf_counter()
        enc.commit()
        per.append((time.perf_counter() - t0) * 1e3 / repeat)
        enc.close()
    return float(np.median(per))


def case_inputs(name, rng):
    """Random Q, K, V and the mask of a case (the cache as long as the prompt)."""
    rows, nh, nkv, hd, kind, window = CASES[name]
    kv = rows
    q = rng.uniform(-1, 1, size=(rows, nh, hd)).astype(np.float32)
    k = rng.uniform(-1, 1, size=(kv, nkv, hd)).astype(np.float16)
    v = rng.uniform(-1, 1, size=(kv, nkv, hd)).astype(np.float16)
    if kind == "zero":
        mask = np.zeros((rows, kv), np.float16)
    else:
        mask = mx.causal_mask(rows, kv, window)
    return q, k, v, mask


def run_case(name, dev, args, rng):
    rows, nh, nkv, hd, kind, window = CASES[name]
    q, k, v, mask = case_inputs(name, rng)
    plan = mx.PrefillPlan(q, k, v, mask, device=dev)
    flops = useful_flops(hd, nh, plan.visible_pairs)
    ms = time_ours(plan, dev, args.repeat, args.trials)
    ms_attn = time_ours(plan, dev, args.repeat, args.trials, classify=False)
    out = plan.run()
    sample_rows = sorted(set(np.linspace(0, rows - 1, args.sample_rows).astype(int).tolist()) | {1, rows // 2 + 3})
    heads = sorted({0, nh // 2, nh - 1})
    worst, mean = sampled_nmse(q, k, v, mask, out, heads, sample_rows)
    peers = {}
    if not args.no_peers:
        peers = sdpa_peers(q, k, v, mask, causal=(kind == "causal"), warmup=2, repeat=args.peer_repeat)
    del plan
    return {
        "case": name,
        "description": DESCRIPTION[name],
        "rows": rows,
        "n_heads": nh,
        "n_kv_heads": nkv,
        "head_dim": hd,
        "mask": kind,
        "window": window,
        "visible_pairs": int(flops / (4 * hd * nh)),
        "useful_flops": flops,
        "ours_ms": ms,
        "ours_attention_only_ms": ms_attn,
        "ours_tflops": flops / ms / 1e9,
        "nmse_worst_row": worst,
        "nmse_mean_row": mean,
        "nmse_sampled": {"heads": heads, "rows": len(sample_rows)},
        "peers": {
            k2: dict(r, tflops=flops / r["ms"] / 1e9, ours_speedup=r["ms"] / ms) if "ms" in r else r
            for k2, r in peers.items()
        },
    }


def table(results):
    lines = []
    head = f"{'case':42} {'ours ms':>8} {'TFLOP/s':>8} {'attn ms':>8} {'best peer +mask':>24} {'x':>6} {'is_causal best':>22} {'x':>6} {'worst-row NMSE':>14}"
    lines.append(head)
    for r in results:
        best = best_with_mask(r["peers"])
        bm = f"{best[0].split('+')[0][5:]} {best[1]:.2f}ms" if best else "-"
        bx = f"{best[1] / r['ours_ms']:.1f}" if best else "-"
        ic = [(k, p["ms"]) for k, p in r["peers"].items() if "+is_causal" in k and "ms" in p]
        icb = min(ic, key=lambda x: x[1]) if ic else None
        ics = f"{icb[0].split('+')[0][5:]} {icb[1]:.2f}ms" if icb else "-"
        icx = f"{icb[1] / r['ours_ms']:.2f}" if icb else "-"
        lines.append(
            f"{r['description']:42} {r['ours_ms']:8.3f} {r['ours_tflops']:8.1f} {r['ours_attention_only_ms']:8.3f} "
            f"{bm:>24} {bx:>6} {ics:>22} {icx:>6} {r['nmse_worst_row']:14.2e}"
        )
    lines.append("")
    lines.append("every peer (ms, useful TFLOP/s, ours faster by):")
    for r in results:
        for k2, p in r["peers"].items():
            if "ms" in p:
                lines.append(f"  {r['case']:13} {k2:28} {p['ms']:9.3f} ms {p['tflops']:7.1f} TFLOP/s  x{p['ours_speedup']:.2f}")
            else:
                lines.append(f"  {r['case']:13} {k2:28} refused: {p['refused'][:110]}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--json", default=None)
    ap.add_argument("--repeat", type=int, default=10, help="our runs per commit")
    ap.add_argument("--trials", type=int, default=5, help="commits; the median is reported")
    ap.add_argument("--peer-repeat", type=int, default=10)
    ap.add_argument("--sample-rows", type=int, default=48)
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    dev = mx.Device("cuda")
    rng = np.random.default_rng(args.seed)
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": dev.description,
        "mlx_native": mx.version(),
        "python": platform.python_version(),
        "command": " ".join([sys.executable.split("/")[-1]] + sys.argv),
    }
    try:
        import torch

        meta["torch"] = torch.__version__
        meta["cudnn"] = torch.backends.cudnn.version()
    except ImportError:
        pass
    print(json.dumps(meta), flush=True)
    results = []
    for name in args.cases.split(","):
        r = run_case(name.strip(), dev, args, rng)
        results.append(r)
        print(f"{name}: ours {r['ours_ms']:.3f} ms ({r['ours_tflops']:.1f} TFLOP/s), worst-row nmse {r['nmse_worst_row']:.2e}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "results": results}, f, indent=1)
    print(table(results))
    return 0 if all(r["nmse_worst_row"] < 1e-5 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
