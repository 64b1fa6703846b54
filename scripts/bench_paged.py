"""Paged K/V on the CPU (issue 29, SPEC 11): each case through the front door on a paged cache
(shuffled blocks of 16, 64 and 256 rows) against the same rows contiguous, the ratio being
issue 29's target (paged within 10% of contiguous on the CPU; docs/benchmarks.md, "Paged K/V
on the CPU").

    python scripts/bench_paged.py [--threads 2] [--repeats 5] [--isa avx512] [--json OUT]

Each time is the best of ``--repeats`` rounds after one warm-up call, the two layouts' calls
alternating within a round (a machine shared with other work slows both alike). The
contiguous call is varlen (``cu_seqlens_k``), as an engine's gathered copy would be; the
copy itself is not timed (what paging saves an engine is not in the ratio).

One sequence's prompt, or a chunk of it at the end of its cache, is a case of the benchmark
command: ``python -m mlx_native bench --cases paged-128 paged-256 [--block-size 64]
[--kv-len 4096]`` (ours paged against ours contiguous, and PyTorch on the gathered K/V). This
script stays for what those cases do not run: several sequences of different cache lengths
through one table (varlen), bfloat16 K/V under a float32 Q, and the three block sizes in one
run."""

from __future__ import annotations

import argparse
import json

import numpy as np

import mlx_native as mn
from mlx_native.bench.timing import best_in_turn

#: (name, query rows per sequence, cache rows per sequence, sequences, heads, KV heads, head dim)
CASES = [
    ("chunk 512 against 4096, d128 8/2", 512, 4096, 1, 8, 2, 128),
    ("prompt 2048, d128 8/2", 2048, 2048, 1, 8, 2, 128),
    ("4 chunks of 256 against 1024-3072, d64 8/2", 256, 3072, 4, 8, 2, 64),
]
BLOCK_SIZES = [16, 64, 256]


def paged_cache(rng, lens, bs, nkv, d, dtype):
    """Caches with each sequence's rows in shuffled blocks, the table and the lengths."""
    need = [-(-n // bs) for n in lens]
    order = rng.permutation(sum(need))
    k = np.zeros((sum(need), bs, nkv, d), dtype)
    v = np.zeros_like(k)
    table = np.zeros((len(lens), max(need)), np.int32)
    at = 0
    for b, (n, m) in enumerate(zip(lens, need)):
        table[b, :m] = order[at : at + m]
        at += m
        rows = rng.uniform(-1, 1, (2, m * bs, nkv, d)).astype(dtype)
        k[table[b, :m]] = rows[0].reshape(m, bs, nkv, d)
        v[table[b, :m]] = rows[1].reshape(m, bs, nkv, d)
    return k, v, table, np.asarray(lens, np.int32)


def gathered(cache, table, lens):
    """The sequences' rows one after the other (varlen K/V)."""
    return np.concatenate([cache[table[b]].reshape(-1, *cache.shape[2:])[:n] for b, n in enumerate(lens)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None, help="the CPU kernels' threads (default: the library's)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--isa", default=None, help="force one CPU path (a name of mn.cpu_info()['detected'])")
    ap.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.threads:
        mn.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    rows = []
    print(f"cpu: {mn.cpu_info()}")
    print("| case | K/V | block | contiguous ms | paged ms | paged / contiguous |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name, lq, lk, nseq, nh, nkv, d in CASES:
        # The chunks' caches differ in length (1024 .. lk), each chunk its cache's last rows.
        lens = [lk] if nseq == 1 else [int(x) for x in np.linspace(1024, lk, nseq)]
        for dt in a.dtypes:
            dtype = np.float16 if dt == "float16" else mn.dtypes.bfloat16_dtype()
            q = rng.uniform(-1, 1, (lq * nseq, nh, d)).astype(np.float32)
            cq = (np.arange(nseq + 1) * lq).astype(np.int32)
            for bs in BLOCK_SIZES:
                k, v, table, used = paged_cache(rng, lens, bs, nkv, d, dtype)
                kc, vc = gathered(k, table, used), gathered(v, table, used)
                ck = np.concatenate([[0], np.cumsum(used)]).astype(np.int32)
                kw = dict(causal=True, cu_seqlens_q=cq, cpu_isa=a.isa, device="cpu")
                cont = mn.PrefillPlan(q, kc, vc, cu_seqlens_k=ck, **kw)
                paged = mn.PrefillPlan(q, k, v, block_table=table, seqused_k=used, **kw)
                assert np.array_equal(np.asarray(cont.run()), np.asarray(paged.run())), name
                tc, tp = best_in_turn([cont.run, paged.run], a.repeats)
                rows.append(dict(case=name, kv=dt, block=bs, contiguous_ms=tc * 1e3, paged_ms=tp * 1e3))
                print(f"| {name} | {dt} | {bs} | {tc * 1e3:.2f} | {tp * 1e3:.2f} | {tp / tc:.3f} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(cpu=mn.cpu_info(), threads=a.threads, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
