"""Lifetimes across the C ABI: closed, freed, foreign and doubly-closed objects are errors
(never a crash); wrapped arrays live as long as a buffer or a pending dispatch needs them
and no longer; encoders dropped without a commit leak nothing."""

from __future__ import annotations

import gc
import resource
import sys
import weakref

import numpy as np
import pytest

import mlx_native as mx
from mlx_native.device import live_handles
from mlx_native.reference import nmse, reference_attention

from helpers import make_case


def _params(rows=40, nh=4, nkv=2, hd=256, kvp=128):
    return mx.FlashAttnPrefillTensorParams(
        rows=rows, n_heads=nh, n_kv_heads=nkv, head_dim=hd, kv_pad=kvp,
        q_row_stride=nh * hd, q_head_stride=hd, k_row_stride=nkv * hd, k_head_stride=hd,
        v_row_stride=nkv * hd, v_head_stride=hd, scale=1.0,
    )


def _inputs(rng, rows=40, nh=4, nkv=2, hd=256, kv_len=100):
    c = make_case(rng, rows, nh, nkv, hd, kv_len, mask="peer", pad=(0, 0, 0))
    q, k, v = (np.ascontiguousarray(x) for x in (c.q, c.k, c.v))
    return q, k, v, c.mask, reference_attention(q, k, v, c.mask)


def _buffers(dev, q, k, v, mask, rows=40, nh=4, hd=256, kvp=128):
    bq = mx.queries_per_threadgroup(hd)
    return dict(
        q=dev.buffer(q), k=dev.buffer(k), v=dev.buffer(v), mask=dev.buffer(mask),
        blk=dev.empty((-(-rows // bq), kvp // 64), np.uint8), out=dev.empty((rows, nh, hd)),
    )


def _record(enc, b, p=None):
    p = p or _params()
    mx.dispatch_flash_attn_prefill_blk(enc, b["mask"], b["blk"], rows=p.rows, kv_pad=p.kv_pad,
                                       bq=mx.queries_per_threadgroup(p.head_dim))
    mx.dispatch_flash_attn_prefill_tensor_f16(enc, b["q"], b["k"], b["v"], b["mask"], b["blk"], b["out"], p)


def test_every_method_of_a_closed_device_is_an_error(rng):
    q, k, v, mask, _ = _inputs(rng)
    d = mx.Device("cpu")
    d.close()
    calls = [
        lambda: d.empty(4),
        lambda: d.buffer(np.zeros(4, np.float32)),
        lambda: d.buffer(np.zeros(4, np.float32), copy=True),
        lambda: d.encoder(),
        lambda: d.close(),
        lambda: mx.flash_attn_prefill_tensor_available(d, 256),
        lambda: mx.flash_attn_prefill(q, k, v, device=d),
        lambda: mx.PrefillPlan(q, k, v, device=d),
        lambda: mx.flash_attn_prefill_blk(mask, 32, device=d),
    ]
    for i, call in enumerate(calls):
        with pytest.raises(mx.InvalidHandleError, match="closed|never issued"):
            call()
    with d:  # leaving the block does not close it again
        pass


def test_every_method_of_a_freed_buffer_is_an_error(device, rng):
    q, k, v, mask, _ = _inputs(rng)
    b = _buffers(device, q, k, v, mask)
    p = _params()
    for name in ("q", "k", "v", "mask", "blk", "out"):
        fresh = _buffers(device, q, k, v, mask)
        dead = fresh[name]
        dead.free()
        for call in (dead.numpy, lambda: dead.nbytes, lambda: dead.write(np.zeros(dead.shape, dead.dtype)),
                     lambda: dead.view(0, 1), dead.free):
            with pytest.raises(mx.InvalidHandleError):
                call()
        args = dict(b, **{name: dead})
        enc = device.encoder()
        with pytest.raises(mx.InvalidHandleError):
            mx.dispatch_flash_attn_prefill_tensor_f16(enc, args["q"], args["k"], args["v"], args["mask"], args["blk"], args["out"], p)
        if name in ("mask", "blk"):
            with pytest.raises(mx.InvalidHandleError):
                mx.dispatch_flash_attn_prefill_blk(enc, args["mask"], args["blk"], rows=40, kv_pad=128, bq=32)
        assert enc.pending == 0
        enc.close()


def test_every_method_of_a_closed_encoder_is_an_error(device, rng):
    q, k, v, mask, _ = _inputs(rng)
    b = _buffers(device, q, k, v, mask)
    enc = device.encoder()
    enc.close()
    calls = [
        enc.commit,
        enc.close,
        lambda: enc.pending,
        lambda: _record(enc, b),
        lambda: mx.dispatch_flash_attn_prefill_tensor_f16(enc, b["q"], b["k"], b["v"], b["mask"], b["blk"], b["out"], _params()),
    ]
    for call in calls:
        with pytest.raises(mx.InvalidHandleError):
            call()
    # As a context manager after close: the commit on exit raises, nothing else breaks.
    with pytest.raises(mx.InvalidHandleError):
        with enc:
            pass


def test_buffers_and_encoders_outlive_their_device_handle(device, rng):
    q, k, v, mask, ref = _inputs(rng)
    d = mx.Device(device.backend)
    b = _buffers(d, q, k, v, mask)
    enc = d.encoder()
    _record(enc, b)
    d.close()
    enc.commit()
    assert nmse(b["out"].numpy(), ref) < 5e-4
    enc.close()


def test_buffers_of_another_device_are_refused_in_every_position(device, rng):
    q, k, v, mask, _ = _inputs(rng)
    other = mx.Device(device.backend)
    mine, theirs = _buffers(device, q, k, v, mask), _buffers(other, q, k, v, mask)
    with device.encoder() as enc:  # a valid table in mine
        mx.dispatch_flash_attn_prefill_blk(enc, mine["mask"], mine["blk"], rows=40, kv_pad=128, bq=32)
    out_before = mine["out"].numpy()
    for name in ("q", "k", "v", "mask", "blk", "out"):
        args = dict(mine, **{name: theirs[name]})
        enc = device.encoder()
        with pytest.raises(mx.InvalidArgumentError, match="buffer of device"):
            mx.dispatch_flash_attn_prefill_tensor_f16(enc, args["q"], args["k"], args["v"], args["mask"], args["blk"], args["out"], _params())
        if name in ("mask", "blk"):
            with pytest.raises(mx.InvalidArgumentError, match="buffer of device"):
                mx.dispatch_flash_attn_prefill_blk(enc, args["mask"], args["blk"], rows=40, kv_pad=128, bq=32)
        assert enc.pending == 0
        enc.commit()
        enc.close()
    assert np.array_equal(mine["out"].numpy(), out_before)


def test_a_pending_dispatch_keeps_its_arrays_alive(device, rng):
    q, k, v, mask, ref = _inputs(rng)
    out = device.empty((40, 4, 256))
    enc = device.encoder()
    arrays = [q, k, v, mask]
    watch = [weakref.ref(a) for a in arrays]
    b = _buffers(device, q, k, v, mask)
    b["out"] = out
    _record(enc, b)
    # The caller lets go of everything but the encoder and the output: arrays, buffers,
    # and even the buffer handles (freed explicitly).
    for name in ("q", "k", "v", "mask", "blk"):
        b[name].free()
    del q, k, v, mask, arrays, b
    gc.collect()
    if device.backend == "cpu":
        assert all(w() is not None for w in watch), "an array a pending dispatch reads was collected"
    junk = [np.full(1 << 16, np.nan, np.float32) for _ in range(16)]  # reuse freed memory, if any
    enc.commit()
    enc.close()
    assert nmse(out.numpy(), ref) < 5e-4
    del junk
    gc.collect()
    # After the commit nothing holds them any more.
    assert all(w() is None for w in watch), "the arrays outlived the dispatch"


def test_a_view_keeps_its_base_and_array_alive(device):
    arr = np.arange(64, dtype=np.float32)
    watch = weakref.ref(arr)
    base = device.buffer(arr)
    view = base.view(16, (4,), np.float32)
    del arr, base
    gc.collect()
    _ = [np.zeros(64, np.float32) for _ in range(64)]
    assert view.numpy().tolist() == [4.0, 5.0, 6.0, 7.0]
    del view
    gc.collect()
    assert watch() is None


def _rss_peak_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def test_encoders_dropped_without_a_commit_leak_nothing(device, rng):
    q, k, v, mask, _ = _inputs(rng)
    b = _buffers(device, q, k, v, mask)
    p = _params()
    start = live_handles()

    def cycle(i):
        # A fresh 160 KB output each time: a leaked encoder would keep it.
        out = device.empty((40, 4, 256))
        enc = device.encoder()
        mx.dispatch_flash_attn_prefill_tensor_f16(enc, b["q"], b["k"], b["v"], b["mask"], b["blk"], out, p)
        if i % 3 == 0:
            enc.close()
        elif i % 3 == 1:
            try:
                with enc:
                    mx.dispatch_flash_attn_prefill_blk(enc, b["mask"], b["blk"], rows=40, kv_pad=128, bq=32)
                    raise KeyError(i)
            except KeyError:
                pass
        # else: dropped with its work pending; the finalizer frees it.

    for i in range(300):
        cycle(i)
    gc.collect()
    assert live_handles() == start
    peak = _rss_peak_bytes()
    n = 3000
    for i in range(n):
        cycle(i)
    gc.collect()
    assert live_handles() == start, "handles leaked"
    grown = _rss_peak_bytes() - peak
    # A leaked cycle would keep 160 KB: 3000 of them, 480 MB. Allow noise, not a leak.
    assert grown < 32 << 20, f"peak RSS grew by {grown >> 20} MB over {n} cycles"


def test_handles_balance_after_a_mixed_workload(device, rng):
    mx.clear_plan_cache()
    gc.collect()
    start = live_handles()
    q, k, v, mask, ref = _inputs(rng)
    out = mx.flash_attn_prefill(q, k, v, mask, scale=1.0, device=device)
    assert nmse(out, ref) < 5e-4
    mx.clear_plan_cache()  # the one call keeps its plan (and its handles) for the next call
    plan = mx.PrefillPlan(q, k, v, mask, scale=1.0, device=device)
    plan.run()
    with device.encoder() as enc:
        plan.encode(enc)  # the encoder path's buffers, freed with the plan
    b = _buffers(device, q, k, v, mask)
    with device.encoder() as enc:
        _record(enc, b)
    views = [b["out"].view(4 * i, (8,)) for i in range(10)]
    del plan, b, views, enc
    gc.collect()
    assert live_handles() == start
