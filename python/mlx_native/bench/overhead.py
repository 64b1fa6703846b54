"""``python -m mlx_native bench --overhead``: what the front door costs over the kernels, in
one process: one call of ``flash_attn_prefill``, a plan's ``run`` and the kernels alone, for
a causal, a window and an explicit mask, from 2048 rows; and how much memory a
described-mask call takes against the ``[rows, kv]`` mask it never builds.

- The kernels alone: many runs recorded on one encoder (``plan.encode``) and committed once,
  per run; on the CPU this is the run without its Python part, on CUDA the kernels back to
  back on the library's stream.
- A call and a run on CUDA: many in a row on the caller's stream (torch CUDA tensors),
  then one synchronisation, per run; on the CPU each returns when done.
- Each is timed in turn, round-robin, the best of ``repeats`` kept (a load that comes and
  goes falls on all three alike).
- Memory: the growth of traced host memory (tracemalloc) and of the process's RSS during
  one call, less its output, against the bytes of a float16 ``[rows, kv]`` mask; on CUDA
  also the growth of PyTorch's allocated device memory.

Targets (issue 11): a call <= 1.10x a plan's run, a run <= 1.05x the kernels alone.
"""

from __future__ import annotations

import sys
import time
import tracemalloc
from typing import List, Optional, Sequence

import numpy as np

from .. import Device, PrefillPlan, flash_attn_prefill
from ..masks import causal_mask

#: Target ratios.
CALL_OVER_RUN = 1.10
RUN_OVER_KERNELS = 1.05
#: The shapes: Gemma 4 26B's sliding layer (16/8 heads, dim 256), at scale 1 (SPEC 4).
N_HEADS, N_KV_HEADS, HEAD_DIM, WINDOW = 16, 8, 256, 1024
CASES = ("causal", "window", "explicit")
#: A device measurement repeats the call until about this long.
DEVICE_TARGET_S = 0.05


def _inputs(rows: int, dev: Device, rng):
    q = rng.uniform(-1, 1, (rows, N_HEADS, HEAD_DIM)).astype(np.float32)
    k = rng.uniform(-1, 1, (rows, N_KV_HEADS, HEAD_DIM)).astype(np.float16)
    v = rng.uniform(-1, 1, (rows, N_KV_HEADS, HEAD_DIM)).astype(np.float16)
    mask = causal_mask(rows, rows, WINDOW)  # the explicit case: the window as an array
    if dev.backend != "cuda":
        return (q, k, v, mask), None
    import torch  # CUDA: the caller's tensors, used in place

    if not torch.cuda.is_available():
        raise RuntimeError("the CUDA overhead benchmark needs a CUDA build of PyTorch (torch tensors on the GPU)")
    cuda = f"cuda:{dev.index}"
    return tuple(torch.from_numpy(x).to(cuda) for x in (q, k, v, mask)), torch


def _kwargs(case: str) -> dict:
    return dict(causal=True, window=WINDOW if case == "window" else None, scale=1.0)


def run_overhead(
    rows: Sequence[int] = (2048,),
    device: Optional[str] = None,
    repeats: int = 3,
    cases: Sequence[str] = CASES,
    seed: int = 0,
    out=None,
) -> List[dict]:
    """Time a call, a plan's run and the kernels alone per case and size; print the table
    and return its rows (seconds per run, the ratios, the memory growth)."""
    out = out or sys.stdout
    dev = Device(device or "auto")
    rng = np.random.default_rng(seed)
    results = []
    print(f"front-door overhead on {dev.description}: {N_HEADS}/{N_KV_HEADS} heads, dim {HEAD_DIM}, kv = rows", file=out)
    print(f"{'case':9} {'rows':>6} {'kernels ms':>11} {'run ms':>9} {'call ms':>9} {'run/kern':>9} {'call/run':>9} "
          f"{'mem/mask':>9}", file=out)  # fmt: skip
    for r in rows:
        (q, k, v, m), torch = _inputs(r, dev, rng)
        for case in cases:
            mask = m if case == "explicit" else None
            kw = _kwargs(case)
            plan = PrefillPlan(q, k, v, mask, device=dev, **kw)
            sync = torch.cuda.synchronize if torch is not None else (lambda: None)
            dev_arg = None if torch is not None else dev

            def call(n):
                for _ in range(n):
                    flash_attn_prefill(q, k, v, mask, device=dev_arg, **kw)
                sync()

            def run(n):
                for _ in range(n):
                    plan.run(q, k, v, mask)
                sync()

            def kernels(n):
                with dev.encoder() as enc:
                    for _ in range(n):
                        plan.encode(enc)

            for fn in (call, run, kernels):
                fn(1)  # warm: kernels built, the call's plan cached, pages touched
            t0 = time.perf_counter()
            kernels(1)
            once = time.perf_counter() - t0
            n = 1 if dev.backend == "cpu" else int(np.clip(round(DEVICE_TARGET_S / max(once, 1e-6)), 2, 200))
            best = {"call": float("inf"), "run": float("inf"), "kernels": float("inf")}
            for _ in range(repeats):
                for name, fn in (("kernels", kernels), ("run", run), ("call", call)):
                    time.sleep(0.02)
                    t0 = time.perf_counter()
                    fn(n)
                    best[name] = min(best[name], (time.perf_counter() - t0) / n)
            mem = _memory(q, k, v, mask, kw, dev_arg, torch) if case != "explicit" else None
            d = dict(case=case, rows=r, kv_len=r, calls_per_timing=n, **{f"{k_}_s": v_ for k_, v_ in best.items()})
            d.update(run_over_kernels=best["run"] / best["kernels"], call_over_run=best["call"] / best["run"])
            if mem:
                d.update(mem)
            results.append(d)
            mm = "-" if mem is None else f"{mem['host_growth_over_mask']:.3f}"
            print(f"{case:9} {r:>6} {best['kernels'] * 1e3:11.3f} {best['run'] * 1e3:9.3f} {best['call'] * 1e3:9.3f} "
                  f"{d['run_over_kernels']:9.3f} {d['call_over_run']:9.3f} {mm:>9}", file=out)  # fmt: skip
    worst_run = max(d["run_over_kernels"] for d in results)
    worst_call = max(d["call_over_run"] for d in results)
    ok = worst_run <= RUN_OVER_KERNELS and worst_call <= CALL_OVER_RUN
    print(f"worst run/kernels {worst_run:.3f} (target {RUN_OVER_KERNELS}), call/run {worst_call:.3f} (target "
          f"{CALL_OVER_RUN}): {'OK' if ok else 'over target'}", file=out)  # fmt: skip
    for d in results:
        if "host_growth_bytes" in d:
            extra = f", device {d['device_growth_bytes'] / 2**20:.1f} MiB" if "device_growth_bytes" in d else ""
            print(f"memory of a {d['case']} call at {d['rows']} rows: host {d['host_growth_bytes'] / 2**20:.2f} MiB "
                  f"beyond its output, RSS +{d['rss_growth_bytes'] / 2**20:.2f} MiB{extra}; a float16 mask would be "
                  f"{d['mask_bytes'] / 2**20:.1f} MiB", file=out)  # fmt: skip
    return results


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    except OSError:  # pragma: no cover - not Linux
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _memory(q, k, v, mask, kw, dev_arg, torch) -> dict:
    """The memory one warmed-up described-mask call takes beyond its output."""
    rows, kv_len = q.shape[0], k.shape[0]
    out_bytes = rows * N_HEADS * HEAD_DIM * 4
    dev_growth = None
    if torch is not None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    rss0 = _rss()
    tracemalloc.start()
    o = flash_attn_prefill(q, k, v, mask, device=dev_arg, **kw)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss = _rss() - rss0
    if torch is not None:
        torch.cuda.synchronize()
        dev_growth = torch.cuda.max_memory_allocated() - base - out_bytes
        host = peak
    else:
        host = peak - out_bytes
    del o
    d = dict(host_growth_bytes=max(0, host), rss_growth_bytes=max(0, rss - (0 if torch is not None else out_bytes)),
             mask_bytes=rows * kv_len * 2)  # fmt: skip
    d["host_growth_over_mask"] = d["host_growth_bytes"] / d["mask_bytes"]
    if dev_growth is not None:
        d["device_growth_bytes"] = max(0, dev_growth)
    return d
