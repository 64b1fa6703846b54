"""Head dims on the CPU: each head dim's time through the front door as built (its own kernel,
or zero-padded to the next kernel size) against the padding it had before the kernels at
16, 32, 48, 160 and 224 (to 64, 192 or 256), on a few shapes (docs/benchmarks.md, "Head
dims: kernels of their own or zero padding").

    python scripts/bench_head_dims.py [--threads 2] [--repeats 3] [--json OUT]

"Before" pads q, k and v to the old kernel size itself, as the front door did, so both
columns include the padding's copy where there is one. Each time is the best of
``--repeats`` calls after one warm-up call, the two ways' calls alternating (a machine
shared with other work slows both alike)."""

from __future__ import annotations

import argparse
import json

import numpy as np

import mlx_native as mn
from mlx_native.bench.timing import best_in_turn
from mlx_native.head_dims import KERNEL_HEAD_DIMS

#: The head dims timed: the new kernels' and those padded around them.
DIMS = [16, 24, 32, 40, 48, 56, 136, 144, 152, 160, 168, 184, 200, 216, 224, 232, 248]
#: The kernel sizes before this change (F16 K/V), square ones.
OLD_KERNELS = [64, 80, 96, 112, 128, 192, 256, 512]
#: (name, rows = cache rows, query heads, KV heads, causal).
SHAPES = [("causal 1024, 8/2 heads", 1024, 8, 2, True), ("full 512, 8/8 heads", 512, 8, 8, False)]


def _next(sizes, d):
    return min(s for s in sizes if s >= d)


def _pad(x, width):
    out = np.zeros(x.shape[:-1] + (width,), x.dtype)
    out[..., : x.shape[-1]] = x
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    mn.set_num_threads(args.threads)
    kernels = sorted(KERNEL_HEAD_DIMS["float16"])
    rng = np.random.default_rng(0)
    rows_out = []
    print(f"threads {args.threads}, best of {args.repeats}; K/V float16, Q float32")
    print("| shape | head dim | runs on (now) | padding work | now ms | before: runs on | before ms | before / now |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, n, nh, nkv, causal in SHAPES:
        for d in DIMS:
            q = rng.uniform(-1, 1, (n, nh, d)).astype(np.float32)
            k = rng.uniform(-1, 1, (n, nkv, d)).astype(np.float16)
            v = rng.uniform(-1, 1, (n, nkv, d)).astype(np.float16)
            scale = 1 / np.sqrt(d)
            now_on, old_on = _next(kernels, d), _next(OLD_KERNELS, d)

            def now_fn():
                return mn.flash_attn_prefill(q, k, v, causal=causal, scale=scale)

            def before():
                qp, kp, vp = _pad(q, old_on), _pad(k, old_on), _pad(v, old_on)
                return np.ascontiguousarray(mn.flash_attn_prefill(qp, kp, vp, causal=causal, scale=scale)[..., :d])

            now, old = best_in_turn([now_fn, before], args.repeats)
            row = dict(shape=name, head_dim=d, now_on=now_on, now_ms=now * 1e3, before_on=old_on,
                       before_ms=old * 1e3)  # fmt: skip
            rows_out.append(row)
            print(f"| {name} | {d} | {now_on} | {now_on / d - 1:+.0%} | {now * 1e3:.1f} | {old_on} | {old * 1e3:.1f} "
                  f"| {old / now:.2f}x |", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(threads=args.threads, repeats=args.repeats, rows=rows_out), f, indent=1)


if __name__ == "__main__":
    main()
