#!/usr/bin/env python3
"""SPEC 10 on one device through the C ABI: every head dim (16 to 512, and Q/K 576 with V/O
512, V a view of K), F16 and BF16 K/V, softcap, ALiBi (on an explicit mask and by distance
under a described one), attention sinks (lse included, rows that see nothing), against a
float64 reference of its own (the formulas of SPEC 10, written out here, so this check does
not lean on the package's reference). One line per case; exits non-zero when a case misses
its bar (NMSE 1e-5, lse 2e-3 absolute). With --time, the targets' timed rows: head dim 128
and 64 causal, softcap and sinks against none, BF16 against F16 K/V.

    python3 scripts/prefill_check_features.py [--device cuda] [--quick] [--time]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import mlx_native as mn
from mlx_native._lib import check, ffi, lib
from mlx_native.dtypes import bfloat16_dtype

BF16 = bfloat16_dtype()
DT_CODE = {"f16": 1, "bf16": 2}


def alibi_slopes(n_heads: int, max_bias: float) -> np.ndarray:
    if max_bias <= 0:
        return np.ones(n_heads)
    n2 = 2 ** int(np.floor(np.log2(n_heads)))
    m0, m1 = 2.0 ** (-max_bias / n2), 2.0 ** (-max_bias / 2 / n2)
    h = np.arange(n_heads)
    return np.where(h < n2, m0 ** (h + 1), m1 ** (2 * (h - n2) + 1))


def reference(q, k, v, *, scale, causal, window, mask, softcap, max_bias, sinks, offset=None):
    """float64 SPEC 10 for one sequence: q [rows, H, Dk] (float), k [kv, Hkv, Dk], v [kv, Hkv,
    Dv] (their own values, float64), mask [rows, kv] or None. Returns o [rows, H, Dv], lse [H, rows]."""
    rows, nh, _ = q.shape
    kv, nkv, dv = v.shape
    qh = (scale * q.astype(np.float32)).astype(np.float16).astype(np.float64)
    off = kv - rows if offset is None else offset
    r = np.arange(rows)[:, None] + off
    j = np.arange(kv)[None, :]
    vis = np.ones((rows, kv), bool)
    if causal:
        vis &= j <= r
    if window:
        vis &= j > r - window
    slopes = alibi_slopes(nh, max_bias)
    o = np.zeros((rows, nh, dv))
    lse = np.full((nh, rows), -np.inf)
    g = nh // nkv
    for h in range(nh):
        s = qh[:, h, :] @ k[:, h // g, :].T
        if softcap > 0:
            s = softcap * np.tanh(s / softcap)
        if mask is not None:
            s = s + slopes[h] * mask.astype(np.float64)
        elif max_bias > 0 and causal:
            s = s + slopes[h] * (j - r)
        s = np.where(vis, s, -np.inf)
        sigma = -np.inf if sinks is None else float(sinks[h])
        m = np.maximum(s.max(axis=1), sigma)
        m_safe = np.where(np.isfinite(m), m, 0.0)
        e = np.exp(s - m_safe[:, None])
        den = e.sum(axis=1) + np.exp(sigma - m_safe)
        with np.errstate(invalid="ignore", divide="ignore"):
            o[:, h, :] = np.where(den[:, None] > 0, (e @ v[:, h // g, :]) / np.where(den > 0, den, 1)[:, None], 0)
            lse[h] = np.where(den > 0, m_safe + np.log(np.where(den > 0, den, 1)), -np.inf)
    return o, lse


def strides_of(a: np.ndarray):
    return [s // a.itemsize for s in a.strides]


def run_case(dev, rng, *, rows, kv, nh, nkv, dk, dv=None, kv_dtype="f16", causal=False, window=None,
             mask=False, softcap=0.0, max_bias=0.0, sinks=False, masked_rows=False, v_view=False, varlen=None):
    """One prefill (one sequence, or a variable-length batch); (nmse, lse error, finite)."""
    dv = dk if dv is None else dv
    scale = 1.0 / np.sqrt(dk)
    kvd = np.float16 if kv_dtype == "f16" else BF16
    lens = varlen or [(rows, kv)]
    tq, tk = sum(a for a, _ in lens), sum(b for _, b in lens)
    q = rng.uniform(-1, 1, (tq, nh, dk)).astype(np.float32)
    k = (rng.uniform(-1, 1, (tk, nkv, dk)) * 2).astype(kvd)
    v = k[:, :, :dv] if v_view else rng.uniform(-1, 1, (tk, nkv, dv)).astype(kvd)
    m = None
    if mask:
        m = rng.uniform(-2, 2, (tq, tk)).astype(np.float16)
        m[rng.random((tq, tk)) < 0.2] = -np.inf
        if masked_rows:
            m[::7] = -np.inf  # rows that see nothing
    sk = rng.uniform(-1, 3, nh).astype(np.float32) if sinks else None
    p = ffi.new("MlxnFlashAttnPrefillParams *")
    p.q_strides = [0] + strides_of(q)[:2]
    p.k_strides = [0] + strides_of(k)[:2]
    p.v_strides = [0] + strides_of(v)[:2]
    p.out_strides = [0, nh * dv, dv]
    p.lse_strides = [0, tq]
    p.batch, p.rows, p.kv_len, p.n_heads, p.n_kv_heads = len(lens), tq, tk, nh, nkv
    p.head_dim, p.head_dim_v = dk, dv
    p.causal, p.window, p.scale = int(causal or bool(window)), window or 0, scale
    p.softcap, p.max_bias = softcap, max_bias
    qb, kb = dev.buffer(q), dev.buffer(k)
    # V a view of K: the same buffer, K's strides, its first dv columns.
    vb = kb if v_view else dev.buffer(v)
    ob = dev.buffer(np.full((tq, nh, dv), np.nan, np.float32), copy=True)
    lb = dev.buffer(np.full((nh, tq), 12345.0, np.float32), copy=True)
    mb = blk = cq = ck = sb = None
    if varlen:
        cq = dev.buffer(np.concatenate([[0], np.cumsum([a for a, _ in lens])]).astype(np.int32))
        ck = dev.buffer(np.concatenate([[0], np.cumsum([b for _, b in lens])]).astype(np.int32))
    if m is not None:
        mb = dev.buffer(m)
        p.mask_strides = [0, tk]
        n = ffi.new("uint64_t *")
        check(lib.mlxn_flash_attn_prefill_mask_table_bytes(p, n))
        blk = dev.empty((max(int(n[0]), 1),), np.uint8)
    if sk is not None:
        sb = dev.buffer(sk)
    h = lambda b: 0 if b is None else b.handle  # noqa: E731
    with dev.encoder() as enc:
        if mb is not None:
            check(lib.mlxn_dispatch_flash_attn_prefill_mask_blk(enc.handle, mb.handle, blk.handle, p))
        check(lib.mlxn_dispatch_flash_attn_prefill(enc.handle, qb.handle, kb.handle, vb.handle, ob.handle, h(mb),
                                                  h(blk), h(cq), h(ck), lb.handle, h(sb), 0, 0, p))
    out, lse = ob.numpy().astype(np.float64), lb.numpy().astype(np.float64)
    ref, ref_lse = np.zeros_like(out), np.zeros_like(lse)
    a0 = b0 = 0
    for lq, lk in lens:
        o1, l1 = reference(q[a0:a0 + lq], k[b0:b0 + lk].astype(np.float64), v[b0:b0 + lk].astype(np.float64),
                           scale=scale, causal=causal or bool(window), window=window,
                           mask=None if m is None else m[a0:a0 + lq, b0:b0 + lk], softcap=softcap,
                           max_bias=max_bias, sinks=sk)
        ref[a0:a0 + lq], ref_lse[:, a0:a0 + lq] = o1, l1
        a0, b0 = a0 + lq, b0 + lk
    finite = bool(np.isfinite(out).all())
    nmse = float(((out - ref) ** 2).sum() / max((ref ** 2).sum(), 1e-30))
    both = np.isneginf(lse) & np.isneginf(ref_lse)
    lse_err = float(np.nan_to_num(np.where(both, 0, np.abs(lse - ref_lse)), nan=np.inf).max())
    return nmse, lse_err, finite


def cases(quick: bool):
    dims = [(d, d) for d in (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)] + [(576, 512)]
    out = []
    for dk, dv in dims:
        for kd in ("f16", "bf16"):
            out.append((f"d{dk}/{dv} {kd} causal 77x93 4/2", dict(rows=77, kv=93, nh=4, nkv=2, dk=dk, dv=dv,
                                                                 kv_dtype=kd, causal=True)))
        out.append((f"d{dk}/{dv} f16 mask + window 40, 3/1", dict(rows=50, kv=130, nh=3, nkv=1, dk=dk, dv=dv,
                                                                 mask=True, window=40)))
    out += [
        ("d128 softcap 30 causal", dict(rows=90, kv=90, nh=4, nkv=1, dk=128, causal=True, softcap=30.0)),
        ("d256 softcap 5 mask", dict(rows=70, kv=100, nh=2, nkv=2, dk=256, mask=True, softcap=5.0)),
        ("d512 softcap 50 bf16 causal", dict(rows=40, kv=66, nh=4, nkv=2, dk=512, causal=True, softcap=50.0,
                                             kv_dtype="bf16")),
        ("d128 alibi 8 on a mask, 6 heads", dict(rows=60, kv=80, nh=6, nkv=3, dk=128, mask=True, max_bias=8.0)),
        ("d256 alibi 8 by distance, causal", dict(rows=100, kv=140, nh=4, nkv=2, dk=256, causal=True, max_bias=8.0)),
        ("d64 alibi 4 by distance, window 30", dict(rows=90, kv=90, nh=12, nkv=4, dk=64, window=30, max_bias=4.0)),
        ("d512 alibi 8 by distance, causal", dict(rows=50, kv=70, nh=4, nkv=1, dk=512, causal=True, max_bias=8.0)),
        ("d128 sinks causal", dict(rows=70, kv=70, nh=4, nkv=2, dk=128, causal=True, sinks=True)),
        ("d256 sinks, rows that see nothing", dict(rows=50, kv=64, nh=2, nkv=1, dk=256, mask=True, sinks=True,
                                                   masked_rows=True)),
        ("d512 sinks + softcap, window 20", dict(rows=45, kv=60, nh=4, nkv=2, dk=512, window=20, sinks=True,
                                                 softcap=20.0)),
        ("d96 varlen sinks + softcap + alibi", dict(rows=0, kv=0, nh=4, nkv=2, dk=96, causal=True, sinks=True,
                                                     softcap=10.0, max_bias=8.0, varlen=[(30, 40), (0, 5), (17, 17)])),
        ("d576/512 V a view of K, causal", dict(rows=60, kv=75, nh=8, nkv=1, dk=576, dv=512, causal=True,
                                                v_view=True)),
        ("d576/512 bf16 V a view of K, mask", dict(rows=33, kv=70, nh=2, nkv=1, dk=576, dv=512, mask=True,
                                                   v_view=True, kv_dtype="bf16")),
    ]
    if not quick:
        out += [
            ("big: d128 causal 1500 32/8", dict(rows=1500, kv=1500, nh=32, nkv=8, dk=128, causal=True)),
            ("big: d64 bf16 window 200 1200x2000", dict(rows=1200, kv=2000, nh=16, nkv=4, dk=64, window=200,
                                                        kv_dtype="bf16")),
            ("big: d256 sinks + softcap causal 1000", dict(rows=1000, kv=1000, nh=8, nkv=4, dk=256, causal=True,
                                                           sinks=True, softcap=30.0)),
        ]
    return out


#: (name, rows, heads, kv heads, head dim, kv dtype, softcap, sinks, window)
TIMED = [
    ("d128 causal 16k 32/8", 16384, 32, 8, 128, "f16", 0.0, False, 0),
    ("d128 causal 16k 32/8 bf16", 16384, 32, 8, 128, "bf16", 0.0, False, 0),
    ("d64 causal 16k 32/8", 16384, 32, 8, 64, "f16", 0.0, False, 0),
    ("d256 causal 16k 8/8", 16384, 8, 8, 256, "f16", 0.0, False, 0),
    ("d256 causal 16k 8/8 softcap+sinks", 16384, 8, 8, 256, "f16", 30.0, True, 0),
    ("d256 causal 16k 8/8 bf16", 16384, 8, 8, 256, "bf16", 0.0, False, 0),
    ("d512 causal 8k 16/2", 8192, 16, 2, 512, "f16", 0.0, False, 0),
    ("d512 causal 8k 16/2 softcap+sinks", 8192, 16, 2, 512, "f16", 30.0, True, 0),
    ("d512 causal 8k 16/2 bf16", 8192, 16, 2, 512, "bf16", 0.0, False, 0),
    ("d128 causal 16k 32/8 softcap+sinks", 16384, 32, 8, 128, "f16", 30.0, True, 0),
]


def time_cases(dev, rng, repeat=5, trials=5):
    for name, rows, nh, nkv, hd, kd, softcap, sinks, window in TIMED:
        kvd = np.float16 if kd == "f16" else BF16
        q = dev.buffer(rng.uniform(-1, 1, (rows, nh, hd)).astype(np.float32))
        k = dev.buffer(rng.uniform(-1, 1, (rows, nkv, hd)).astype(kvd))
        v = dev.buffer(rng.uniform(-1, 1, (rows, nkv, hd)).astype(kvd))
        o = dev.empty((rows, nh, hd), np.float32)
        sb = dev.buffer(np.zeros(nh, np.float32)) if sinks else None
        p = ffi.new("MlxnFlashAttnPrefillParams *")
        p.q_strides, p.k_strides, p.v_strides = [0, nh * hd, hd], [0, nkv * hd, hd], [0, nkv * hd, hd]
        p.out_strides = [0, nh * hd, hd]
        p.batch, p.rows, p.kv_len, p.n_heads, p.n_kv_heads, p.head_dim = 1, rows, rows, nh, nkv, hd
        p.causal, p.window, p.scale, p.softcap = 1, window, 1.0 / np.sqrt(hd), softcap
        pairs = rows * (rows + 1) // 2

        def once(n):
            with dev.encoder() as enc:
                for _ in range(n):
                    check(lib.mlxn_dispatch_flash_attn_prefill(enc.handle, q.handle, k.handle, v.handle, o.handle, 0,
                                                              0, 0, 0, 0, 0 if sb is None else sb.handle, 0, 0, p))

        once(1)
        ts = []
        for _ in range(trials):
            t = time.perf_counter()
            once(repeat)
            ts.append((time.perf_counter() - t) / repeat)
        ms = float(np.median(ts)) * 1e3
        print(f"{name:40} {ms:8.3f} ms  {4 * hd * nh * pairs / ms / 1e9:7.1f} TFLOP/s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--quick", action="store_true", help="skip the big cases")
    ap.add_argument("--time", action="store_true", help="also time the targets' rows")
    ap.add_argument("--only", default="", help="only cases whose name contains this")
    a = ap.parse_args(argv)
    dev = mn.Device(a.device)
    rng = np.random.default_rng(0)
    print(f"SPEC 10 check on {dev.description}")
    bad = 0
    for name, c in cases(a.quick):
        if a.only not in name:
            continue
        try:
            nmse, lse_err, finite = run_case(dev, rng, **c)
        except mn.MlxError as e:
            print(f"{name:42} ERROR {type(e).__name__}: {e}")
            bad += 1
            continue
        ok = finite and nmse <= 1e-5 and lse_err < 2e-3
        bad += not ok
        print(f"{name:42} nmse {nmse:9.2e}  lse err {lse_err:9.2e}  {'ok' if ok else 'FAIL'}")
    if a.time:
        time_cases(dev, rng)
    print("all ok" if not bad else f"{bad} case(s) failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
