#!/usr/bin/env python3
"""The front door's op (`flash_attn_prefill`) on one device through the C ABI, against the
float64 reference of SPEC 6-8, on a matrix of cases: batches at strides, variable length,
causal and window with offsets, explicit masks (shared and per sequence) with their tables,
partial cache steps, every Q and O dtype, lse. Prints one line per case and exits non-zero
when a case misses its bar. A development check of a backend's kernels below the Python
API:

    python3 scripts/prefill_check.py [--device cuda] [--quick]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import mlx_native as mn
from mlx_native._lib import check, ffi, lib
from mlx_native.dtypes import bfloat16_dtype
from mlx_native.reference import peer_mask, reference_prefill

F32, F16 = np.dtype(np.float32), np.dtype(np.float16)


def strides_of(a: np.ndarray):
    return [s // a.itemsize for s in a.strides]


def run_case(dev, rng, *, batch, rows, kv, nh, nkv, hd, causal=False, window=None, mask=None, varlen=None,
             q_dtype=F32, o_dtype=F32, lse=True, scale=None):
    """One prefill; returns (nmse, lse error, output finite)."""
    scale = 1.0 / np.sqrt(hd) if scale is None else scale
    if varlen is not None:
        lq, lk = varlen
        cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
        ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
        tq, tk = int(cq[-1]), int(ck[-1])
        qb = rng.uniform(-1, 1, (tq, nh + 1, hd)).astype(np.float32)[:, 1:]  # a strided view
        kb = rng.uniform(-1, 1, (tk, nkv, hd + 8)).astype(np.float16)[:, :, 8:]
        vb = rng.uniform(-1, 1, (tk, nkv, hd)).astype(np.float16)
        batch, rows, kv = len(lq), tq, tk
    else:
        qb = rng.uniform(-1, 1, (batch, rows, nh + 1, hd)).astype(np.float32)[:, :, 1:]
        kb = rng.uniform(-1, 1, (batch, kv, nkv, hd + 8)).astype(np.float16)[:, :, :, 8:]
        vb = rng.uniform(-1, 1, (batch, kv, nkv, hd)).astype(np.float16)
    qd = bfloat16_dtype() if q_dtype == "bf16" else np.dtype(q_dtype)
    od = bfloat16_dtype() if o_dtype == "bf16" else np.dtype(o_dtype)
    q_host = qb.astype(qd)
    p = ffi.new("MlxnFlashAttnPrefillParams *")
    # Buffers: copies (device memory on CUDA); Q keeps a head stride past its heads.
    qbuf = dev.buffer(q_host)
    kbuf = dev.buffer(np.ascontiguousarray(kb))
    vbuf = dev.buffer(vb)
    qs, ks, vs = strides_of(q_host), strides_of(np.ascontiguousarray(kb)), strides_of(vb)
    if varlen is not None:
        p.q_strides = [0, qs[0], qs[1]]
        p.k_strides = [0, ks[0], ks[1]]
        p.v_strides = [0, vs[0], vs[1]]
        out_shape = (rows, nh, hd)
        lse_shape = (nh, rows)
        p.out_strides = [0, nh * hd, hd]
        p.lse_strides = [0, rows]
    else:
        p.q_strides = [qs[0], qs[1], qs[2]]
        p.k_strides = [ks[0], ks[1], ks[2]]
        p.v_strides = [vs[0], vs[1], vs[2]]
        out_shape = (batch, rows, nh, hd)
        lse_shape = (batch, nh, rows)
        p.out_strides = [rows * nh * hd, nh * hd, hd]
        p.lse_strides = [nh * rows, rows]
    obuf = dev.buffer(np.full(out_shape, np.nan, np.float32).astype(od), copy=True)
    lbuf = dev.buffer(np.full(lse_shape, 12345.0, np.float32), copy=True) if lse else None
    p.batch, p.rows, p.kv_len, p.n_heads, p.n_kv_heads, p.head_dim = batch, rows, kv, nh, nkv, hd
    p.causal = 1 if (causal or window) else 0
    p.window = window or 0
    p.scale = scale
    mbuf = blkbuf = cqb = ckb = None
    m = None
    if mask is not None:
        per_batch = mask == "per-batch"
        n_m = batch if per_batch else 1
        m = np.stack([peer_mask(rows, kv, rng) for _ in range(n_m)])
        m_full = np.full((n_m, rows, kv + 5), -np.inf, np.float16)  # a row stride past kv_len
        m_full[:, :, :kv] = m
        mbuf = dev.buffer(m_full)
        p.mask_strides = [rows * (kv + 5) if per_batch else 0, kv + 5]
        nbytes = ffi.new("uint64_t *")
        check(lib.mlxn_flash_attn_prefill_mask_table_bytes(p, nbytes))
        blkbuf = dev.empty((max(int(nbytes[0]), 1),), np.uint8)
    if varlen is not None:
        cqb, ckb = dev.buffer(cq), dev.buffer(ck)
    h = lambda b: 0 if b is None else b.handle  # noqa: E731
    with dev.encoder() as enc:
        if mbuf is not None:
            check(lib.mlxn_dispatch_flash_attn_prefill_mask_blk(enc.handle, mbuf.handle, blkbuf.handle, p))
        check(lib.mlxn_dispatch_flash_attn_prefill(enc.handle, qbuf.handle, kbuf.handle, vbuf.handle, obuf.handle,
                                                  h(mbuf), h(blkbuf), h(cqb), h(ckb), h(lbuf), 0, 0, 0, p))
    out = obuf.numpy().astype(np.float64)
    lse_out = lbuf.numpy() if lbuf is not None else None
    ref_mask = None if m is None else m
    if varlen is not None:
        ref, ref_lse = reference_prefill(q_host.astype(np.float32), kb, vb, causal=causal or window is not None,
                                         window=window, scale=scale, cu_seqlens_q=cq, cu_seqlens_k=ck)
    else:
        ref, ref_lse = reference_prefill(q_host.astype(np.float32), kb, vb, ref_mask, causal=causal or window is not None,
                                         window=window, scale=scale)
    ref_rounded = ref.astype(od).astype(np.float64) if od != F32 else ref
    finite = bool(np.isfinite(out).all())
    err = float(((out - ref_rounded) ** 2).sum() / max((ref_rounded ** 2).sum(), 1e-30))
    lse_err = 0.0
    if lse_out is not None:
        both_inf = np.isneginf(lse_out) & np.isneginf(ref_lse)
        diff = np.where(both_inf, 0.0, np.abs(lse_out - ref_lse))
        lse_err = float(np.nan_to_num(diff, nan=np.inf).max()) if diff.size else 0.0
    return err, lse_err, finite


CASES = [
    dict(name="one seq, causal, d256", batch=1, rows=100, kv=100, nh=4, nkv=2, hd=256, causal=True),
    dict(name="one seq, longer cache, causal, d512", batch=1, rows=70, kv=200, nh=4, nkv=1, hd=512, causal=True),
    dict(name="batch 3, window 40, d256", batch=3, rows=90, kv=130, nh=8, nkv=2, hd=256, window=40),
    dict(name="batch 2, shared mask, d256", batch=2, rows=77, kv=150, nh=4, nkv=4, hd=256, mask="shared"),
    dict(name="batch 2, per-batch mask + causal, d512", batch=2, rows=40, kv=70, nh=4, nkv=2, hd=512, mask="per-batch", causal=True),
    dict(name="varlen (0, 33, 70), causal, d256", varlen=([0, 33, 70], [10, 50, 70]), batch=0, rows=0, kv=0, nh=4, nkv=2, hd=256, causal=True),
    dict(name="varlen, window 16, d512", varlen=([20, 5], [20, 9]), batch=0, rows=0, kv=0, nh=2, nkv=1, hd=512, window=16),
    dict(name="q f16, out f16, causal", batch=1, rows=65, kv=65, nh=2, nkv=1, hd=256, causal=True, q_dtype=F16, o_dtype=F16),
    dict(name="q bf16, out bf16, mask", batch=1, rows=50, kv=90, nh=2, nkv=2, hd=256, mask="shared", q_dtype="bf16", o_dtype="bf16"),
    dict(name="q f32, out bf16, d512 causal", batch=2, rows=33, kv=40, nh=4, nkv=2, hd=512, causal=True, o_dtype="bf16"),
    dict(name="dense, no lse, kv 1", batch=1, rows=17, kv=1, nh=2, nkv=1, hd=256, lse=False),
    dict(name="empty cache (kv 0)", batch=2, rows=5, kv=0, nh=2, nkv=1, hd=256),
    dict(name="big: causal 1000, d256 16/8", batch=1, rows=1000, kv=1000, nh=16, nkv=8, hd=256, causal=True),
    dict(name="big: window 256 1500x2000, d256", batch=1, rows=1500, kv=2000, nh=8, nkv=8, hd=256, window=256),
    dict(name="big: causal 600 d512 16/2", batch=1, rows=600, kv=600, nh=16, nkv=2, hd=512, causal=True),
]


#: SPEC shapes for --time: (name, rows, kv, heads, kv heads, head dim, causal, window)
TIMED = [
    ("global d512 16/2 causal", 8192, 8192, 16, 2, 512, True, None),
    ("sliding d256 16/8 w1024", 8192, 8192, 16, 8, 256, True, 1024),
    ("causal d256 8/8", 16384, 16384, 8, 8, 256, True, None),
    ("dense d256 8/8", 16384, 16384, 8, 8, 256, False, None),
    ("causal d256 8/8, 512 rows vs 64k cache", 512, 65536, 8, 8, 256, True, None),
]


def time_described(dev, rng, repeat=10, trials=5):
    """The new op with described masks at the SPEC shapes: median over `trials` commits of
    `repeat` dispatches each, in useful TFLOP/s (SPEC 5)."""
    import time

    for name, rows, kv, nh, nkv, hd, causal, window in TIMED:
        q = dev.buffer(rng.uniform(-1, 1, (rows, nh, hd)).astype(np.float32))
        k = dev.buffer(rng.uniform(-1, 1, (kv, nkv, hd)).astype(np.float16))
        v = dev.buffer(rng.uniform(-1, 1, (kv, nkv, hd)).astype(np.float16))
        o = dev.empty((rows, nh, hd), np.float32)
        p = ffi.new("MlxnFlashAttnPrefillParams *")
        p.q_strides, p.k_strides, p.v_strides = [0, nh * hd, hd], [0, nkv * hd, hd], [0, nkv * hd, hd]
        p.out_strides = [0, nh * hd, hd]
        p.batch, p.rows, p.kv_len, p.n_heads, p.n_kv_heads, p.head_dim = 1, rows, kv, nh, nkv, hd
        p.causal, p.window, p.scale = int(causal), window or 0, 1.0
        # Visible pairs, row by row (a window or causal row sees a count, no mask needed).
        off = kv - rows
        r = np.arange(rows)
        hi = np.minimum(kv - 1, r + off) if causal else np.full(rows, kv - 1)
        lo = np.maximum(0, r + off - window + 1) if window else np.zeros(rows, int)
        pairs = int(np.maximum(hi - lo + 1, 0).sum())

        def once(n):
            with dev.encoder() as enc:
                for _ in range(n):
                    check(lib.mlxn_dispatch_flash_attn_prefill(enc.handle, q.handle, k.handle, v.handle, o.handle,
                                                              0, 0, 0, 0, 0, 0, 0, 0, p))

        once(1)
        times = []
        for _ in range(trials):
            t = time.perf_counter()
            once(repeat)
            times.append((time.perf_counter() - t) / repeat)
        ms = float(np.median(times)) * 1e3
        print(f"{name:42} {ms:8.3f} ms  {4 * hd * nh * pairs / ms / 1e9:7.1f} TFLOP/s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--quick", action="store_true", help="skip the big cases")
    ap.add_argument("--time", action="store_true", help="also time the SPEC shapes with described masks")
    a = ap.parse_args(argv)
    dev = mn.Device(a.device)
    rng = np.random.default_rng(0)
    if a.time:
        time_described(dev, rng)
    print(f"prefill check on {dev.description}")
    bad = 0
    for c in CASES:
        c = dict(c)
        name = c.pop("name")
        if a.quick and name.startswith("big"):
            continue
        try:
            err, lse_err, finite = run_case(dev, rng, **c)
        except mn.MlxError as e:
            print(f"{name:45} ERROR {type(e).__name__}: {e}")
            bad += 1
            continue
        od = c.get("o_dtype", F32)
        bar = 1e-5 if od == F32 else 2e-5
        ok = finite and err < bar and lse_err < 2e-3
        bad += not ok
        print(f"{name:45} nmse {err:9.2e}  lse err {lse_err:9.2e}  {'ok' if ok else 'FAIL'}")
    print("all ok" if not bad else f"{bad} case(s) failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
