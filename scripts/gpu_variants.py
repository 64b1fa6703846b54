#!/usr/bin/env python3
"""Time kernel variants (a development tool): each `-D` set of MLX_NATIVE_CUDA_DEFINES in
its own process, on a few bench cases; ours only, attention alone, median of trials.

    python3 scripts/gpu_variants.py --cases global-8192,dense-16384 base NOKV NOQK+NOPV ...

A case is `<bench case>-<rows>` (`global-8192`, `dense-8h-16384`) or a name of the former
gpu_bench.py (`causal-16384` and `dense-16384` are the 8/8-head cases): see
`mlx_native.bench.sized_case`. Inputs and timing are the benchmark's (`python -m mlx_native
bench`): `--repeat` attention runs recorded in one encoder, the commit timed, per run; the
median of `--trials` commits, measured twice (the spread is the difference).

A variant `A+B` compiles with -DMLXN_EXP_A -DMLXN_EXP_B; `base` with neither; `NOPAIR`
sets MLX_NATIVE_CUDA_PAIR=0 (the one-CTA forms), `QPAIR` MLX_NATIVE_CUDA_PAIR=queries
(query pairs only), `PAIR=x` MLX_NATIVE_CUDA_PAIR=x.
"""
import argparse
import json
import os
import subprocess
import sys

# Shorthands for MLX_NATIVE_CUDA_PAIR settings.
ALIASES = {"NOPAIR": "PAIR=0", "QPAIR": "PAIR=queries"}


def child(cases, repeat, trials):
    import numpy as np

    import mlx_native as mx
    from mlx_native.bench import OURS_ATTENTION, case_inputs, ours_variants, sized_case
    from mlx_native.bench.timing import per_call_seconds
    from mlx_native.reference import useful_flops

    dev = mx.Device("cuda")
    rng = np.random.default_rng(0)
    res = {}
    for name in cases:
        case, rows = sized_case(name)
        q, k, v, mask = case_inputs(case, rows, rng)
        plan = mx.PrefillPlan(q, k, v, mask, scale=1.0, device=dev)
        flops = useful_flops(case.head_dim, case.n_heads, plan.visible_pairs)
        (attn,) = [vt for vt in ours_variants(plan, dev, calls=repeat, batched=True) if vt.label == OURS_ATTENTION]
        ms = [1e3 * float(np.median(per_call_seconds(attn, trials))) for _ in range(2)]
        best = min(ms)
        res[name] = (best, flops / best / 1e9, abs(ms[0] - ms[1]) / best)
        del plan, attn
    print(json.dumps(res))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="global-8192,dense-16384")
    ap.add_argument("--repeat", type=int, default=10, help="attention runs per commit")
    ap.add_argument("--trials", type=int, default=5, help="commits; the median is kept")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("variants", nargs="*", default=["base"])
    a = ap.parse_args()
    cases = a.cases.split(",")
    if a.child:
        return child(cases, a.repeat, a.trials)
    for var in a.variants:
        names = [ALIASES.get(n, n) for n in var.split("+") if n and n != "base"]
        defs = " ".join(f"-DMLXN_EXP_{n}" for n in names if not n.startswith("PAIR="))
        env = dict(os.environ, MLX_NATIVE_CUDA_DEFINES=defs)
        for n in names:
            if n.startswith("PAIR="):
                env["MLX_NATIVE_CUDA_PAIR"] = n[5:]
        r = subprocess.run([sys.executable, __file__, "--child", "--cases", a.cases, "--repeat", str(a.repeat),
                            "--trials", str(a.trials)], env=env, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"{var:28} FAILED\n{r.stderr[-3000:]}", flush=True)
            continue
        res = json.loads(r.stdout.strip().splitlines()[-1])
        cells = "  ".join(f"{n}: {ms:7.3f} ms {tf:6.1f} TF/s (spread {sp:.1%})" for n, (ms, tf, sp) in res.items())
        print(f"{var:28} {cells}", flush=True)


if __name__ == "__main__":
    main()
