"""Numerical edge cases and limits, each with the result docs/reliability.md documents:
NaN and Inf in Q, K, V and the mask; an all -inf mask; -65504 as "masked"; Q that
overflows half; one row; one cache row; the largest shapes whose indices fit in i32 and the
first that does not; more memory than exists; missing backends."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import mlx_native as mx
from mlx_native.reference import nmse, reference_attention

from conftest import TARGETS, target_device

ROWS, NH, NKV, HD, KV_LEN, KVP = 70, 4, 2, 256, 150, 192
BQ = 32
GROUP = NH // NKV


# Every target, and the AMX kernels on the emulated tiles where the CPU has no AMX (the same
# arithmetic as the hardware's: an infinity in K or V meets the products' operand splits).
EDGE_TARGETS = TARGETS + ([] if ("cpu", "amx") in TARGETS else [("cpu", "amx-emulated")])


@pytest.fixture(params=EDGE_TARGETS, ids=[f"{b}-{i}" if i else b for b, i in EDGE_TARGETS])
def device(request):
    with target_device(request.param) as d:
        yield d


def _problem(rng):
    """Q, K, V (cache padded to KVP with zeros) and a mask with every tile class: a
    skipped (-inf) tile, a zero tile, mixed tiles, -inf padding columns."""
    q = rng.uniform(-1, 1, (ROWS, NH, HD)).astype(np.float32)
    k = np.zeros((KVP, NKV, HD), np.float16)
    v = np.zeros((KVP, NKV, HD), np.float16)
    k[:KV_LEN] = rng.uniform(-1, 1, (KV_LEN, NKV, HD))
    v[:KV_LEN] = rng.uniform(-1, 1, (KV_LEN, NKV, HD))
    m = rng.uniform(-1, 1, (ROWS, KVP)).astype(np.float16)
    m[rng.random((ROWS, KVP)) < 0.2] = -np.inf
    m[0:32, 64:128] = -np.inf  # tile (0, 1): skipped
    m[32:64, 0:64] = 0  # tile (1, 0): no mask add
    m[:, KV_LEN:] = -np.inf
    return q, k, v, m


def _run(dev, q, k, v, m, blk=None, scale=1.0):
    """The low-level dispatch on contiguous copies; returns (out, blk table)."""
    qb, kb, vb, mb = (dev.buffer(np.ascontiguousarray(x), copy=True) for x in (q, k, v, m))
    rows, kvp = m.shape
    bq = mx.queries_per_threadgroup(q.shape[2])
    table = dev.empty((-(-rows // bq), kvp // 64), np.uint8) if blk is None else dev.buffer(blk, copy=True)
    out = dev.buffer(np.full(q.shape, 12345.0, np.float32), copy=True)
    p = mx.FlashAttnPrefillTensorParams(
        rows=rows, n_heads=q.shape[1], n_kv_heads=k.shape[1], head_dim=q.shape[2], kv_pad=kvp,
        q_row_stride=q.shape[1] * q.shape[2], q_head_stride=q.shape[2],
        k_row_stride=k.shape[1] * k.shape[2], k_head_stride=k.shape[2],
        v_row_stride=v.shape[1] * v.shape[2], v_head_stride=v.shape[2], scale=scale,
    )
    with dev.encoder() as enc:
        if blk is None:
            mx.dispatch_flash_attn_prefill_blk(enc, mb, table, rows=rows, kv_pad=kvp, bq=bq)
        mx.dispatch_flash_attn_prefill_tensor_f16(enc, qb, kb, vb, mb, table, out, p)
    return out.numpy(), table.numpy()


def _reference(q, k, v, m, scale=1.0, exclude=None):
    """Float64 reference (SPEC section 3); ``exclude[r, h, j]`` hides cache row j from
    (r, h) only."""
    with np.errstate(over="ignore", invalid="ignore"):
        return _reference_inner(q, k, v, m, scale, exclude)


def _reference_inner(q, k, v, m, scale, exclude):
    qh = (np.float32(scale) * q).astype(np.float16).astype(np.float64)
    kf, vf, mf = k.astype(np.float64), v.astype(np.float64), m.astype(np.float64)
    out = np.zeros(q.shape)
    for h in range(q.shape[1]):
        g = h // (q.shape[1] // k.shape[1])
        s = qh[:, h] @ kf[:, g].T + mf
        if exclude is not None:
            s[exclude[:, h]] = -np.inf
        mx_ = s.max(axis=1, keepdims=True)
        ok = np.isfinite(mx_[:, 0])
        p = np.zeros_like(s)
        p[ok] = np.exp(s[ok] - mx_[ok])
        out[ok, h] = (p[ok] @ vf[:, g]) / p[ok].sum(axis=1, keepdims=True)
    return out


def _computed(table, r, j):
    """Whether the kernel computes cache row j for query row r (its tile is not skipped)."""
    return table[r // BQ, j // 64] != 0


def _maybe_computed(table, r, j, tall=128):
    """Whether a backend with query tiles of up to ``tall`` rows may compute cache row j for
    row r: SPEC section 1 lets it skip a step only when every table row of its tile says
    0, so it computes the tile for rows whose own entry is 0 when a neighbour's is not."""
    per = tall // BQ
    g = r // tall
    return bool(table[g * per : (g + 1) * per, j // 64].any())


# ------------------------------------------------------------------ non-finite inputs


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf, 70000.0], ids=["nan", "inf", "-inf", "overflow"])
def test_non_finite_q_poisons_exactly_its_row_and_head(device, rng, value):
    q, k, v, m = _problem(rng)
    r, h, d = 37, 3, 100
    q[r, h, d] = value
    out, _ = _run(device, q, k, v, m)
    assert np.isnan(out[r, h]).all(), "the (row, head) of the bad value is NaN"
    clean = q.copy()
    clean[r, h, d] = 0
    ref = _reference(clean, k, v, m)
    rest = np.ones((ROWS, NH), bool)
    rest[r, h] = False
    assert np.isfinite(out[rest]).all()
    assert nmse(out[rest], ref[rest]) < 5e-4


@pytest.mark.parametrize("j", [20, 70, 140], ids=["mixed-tile", "skipped-for-some-rows", "last-tile"])
def test_nan_in_k_poisons_the_rows_that_compute_its_tile(device, rng, j):
    q, k, v, m = _problem(rng)
    g = 1
    k[j, g, 7] = np.nan
    out, table = _run(device, q, k, v, m)
    clean = k.copy()
    clean[j, g, 7] = 0
    ref = _reference(q, clean, v, m)
    hit = np.zeros((ROWS, NH), bool)  # rows whose table entry makes them compute it
    may = np.zeros((ROWS, NH), bool)  # rows a backend with taller query tiles may also
    for r in range(ROWS):
        hit[r, g * GROUP : (g + 1) * GROUP] = _computed(table, r, j)
        may[r, g * GROUP : (g + 1) * GROUP] = _maybe_computed(table, r, j)
    assert hit.any()
    assert np.isnan(out[hit]).all()
    sure = ~may
    assert np.isfinite(out[sure]).all() and nmse(out[sure], ref[sure]) < 5e-4
    # In between: NaN (the tile was computed) or exact (it was skipped).
    between = may & ~hit
    each = np.isnan(out[between]).all(axis=-1) | np.isclose(out[between], ref[between], rtol=1e-2, atol=2e-3).all(axis=-1)
    assert each.all()
    if j == 70:
        assert not hit[:32].any(), "rows 0..31 skip that tile by their own entry"


def test_inf_in_k_poisons_rows_whose_score_is_inf_or_nan(device, rng):
    q, k, v, m = _problem(rng)
    j, g, d = 100, 0, 5
    q[:, :, d] = np.where(rng.random((ROWS, NH)) < 0.5, 0.5, -0.5)  # half the scores +inf
    q[40, 0, d] = 0.0  # 0 * inf: a NaN score
    k[j, g, d] = np.inf
    out, table = _run(device, q, k, v, m)
    qh = q.astype(np.float16).astype(np.float64)
    clean = k.copy()
    clean[j, g, d] = 0
    with np.errstate(invalid="ignore"):
        s = np.einsum("rhd,d->rh", qh, k[j, g].astype(np.float64)) + m[:, j, None].astype(np.float64)
    poisoned = np.zeros((ROWS, NH), bool)
    excluded = np.zeros((ROWS, NH, KVP), bool)
    for r in range(ROWS):
        for h in range(g * GROUP, (g + 1) * GROUP):
            if _computed(table, r, j):
                poisoned[r, h] = np.isnan(s[r, h]) or s[r, h] == np.inf
                excluded[r, h, j] = s[r, h] == -np.inf  # a -inf score masks that cache row
    assert poisoned.sum() > 10 and excluded.sum() > 10 and poisoned[40, 0]
    assert np.isnan(out[poisoned]).all()
    ref = _reference(q, clean, v, m, exclude=excluded)
    assert np.isfinite(out[~poisoned]).all() and nmse(out[~poisoned], ref[~poisoned]) < 5e-4


@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
def test_non_finite_v_poisons_one_output_dim_of_the_rows_that_compute_its_tile(device, rng, value):
    q, k, v, m = _problem(rng)
    j, g, d = 90, 1, 33
    v[j, g, d] = value
    out, table = _run(device, q, k, v, m)
    clean = v.copy()
    clean[j, g, d] = 0
    ref = _reference(q, k, clean, m)
    hit = np.zeros(out.shape, bool)
    may = np.zeros(out.shape, bool)
    for r in range(ROWS):
        hit[r, g * GROUP : (g + 1) * GROUP, d] = _computed(table, r, j)
        may[r, g * GROUP : (g + 1) * GROUP, d] = _maybe_computed(table, r, j)
    assert hit.any()
    bad = out[hit]
    assert np.isnan(bad).all() if np.isnan(value) else (~np.isfinite(bad)).all()
    sure = ~may
    assert np.isfinite(out[sure]).all(), np.argwhere(~np.isfinite(out) & sure)[:10].tolist()
    assert nmse(out[sure], ref[sure]) < 5e-4
    between = may & ~hit
    assert (~np.isfinite(out[between]) | np.isclose(out[between], ref[between], rtol=1e-2, atol=2e-3)).all()


@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "+inf"])
def test_nan_or_plus_inf_in_the_mask_poisons_that_row_in_every_head(device, rng, value):
    q, k, v, m = _problem(rng)
    r, j = 50, 10
    m[r, j] = value
    out, table = _run(device, q, k, v, m)
    assert table[r // BQ, j // 64] == 1, "a NaN or +inf tile is never skipped"
    assert np.isnan(out[r]).all()
    clean = m.copy()
    clean[r] = 0
    ref = _reference(q, k, v, clean)
    others = np.arange(ROWS) != r
    assert nmse(out[others], ref[others]) < 5e-4


# ------------------------------------------------------------------ masks


def test_an_all_minus_inf_mask_gives_zeros_with_either_table(device, rng):
    q, k, v, m = _problem(rng)
    m[:] = -np.inf
    out, table = _run(device, q, k, v, m)
    assert not table.any(), "every tile skipped"
    assert (out == 0).all() and not np.signbit(out).any()
    ones, _ = _run(device, q, k, v, m, blk=np.ones_like(table))
    assert np.array_equal(out.view(np.uint32), ones.view(np.uint32)), "bit-identical zeros"
    # And through the high-level API, with a boolean mask hiding everything.
    hl = mx.flash_attn_prefill(q, k[:KV_LEN], v[:KV_LEN], np.zeros((ROWS, KV_LEN), bool), device=device)
    assert (hl == 0).all()


def test_minus_65504_in_a_row_that_also_sees_something_is_the_same_as_minus_inf(device, rng):
    q, k, v, m = _problem(rng)
    m[:, 3] = 0  # every row sees cache row 3
    ref_out, _ = _run(device, q, k, v, m)
    m65 = m.copy()
    m65[np.isneginf(m65)] = -65504
    out, _ = _run(device, q, k, v, m65)
    # exp(-65504 - M) is 0 in f32: those entries drop out exactly.
    assert np.array_equal(out.view(np.uint32), ref_out.view(np.uint32))


def test_minus_65504_over_whole_tiles_skips_them_and_gives_zeros(device, rng):
    q, k, v, m = _problem(rng)
    m[:] = -65504
    out, table = _run(device, q, k, v, m)
    assert not table.any()
    assert (out == 0).all()


def test_a_row_masked_only_by_minus_65504_attends_as_a_shifted_softmax(device, rng):
    """Row 40 is -65504 everywhere, but the other rows of its query tile (32..63) see
    cache rows in tiles 0 and 2 (tile 1 is -inf for every row, skipped by any backend):
    those tiles are computed for row 40 too, where
    exp(s - 65504 - M) is a plain softmax shifted by a constant. Row 40 attends over the
    cache rows of the computed tiles, not over nothing (the float64 reference of the same
    mask attends over all of them)."""
    q, k, v, m = _problem(rng)
    m[:, 64:128] = -np.inf  # cache rows 64..127 skipped for every query row
    r = 40
    m[r] = -65504
    out, table = _run(device, q, k, v, m)
    assert table[1, 0] != 0 and table[1, 1] == 0 and table[1, 2] != 0, table[1]
    computed = np.array([_computed(table, r, j) for j in range(KVP)])
    shifted = np.where(computed, 0, -np.inf).astype(np.float16)[None, :]
    want = _reference(q[r : r + 1], k, v, shifted)[0]
    assert np.abs(out[r]).max() > 0.01, "not zeros"
    assert nmse(out[r], want) < 5e-4
    full = reference_attention(q[r : r + 1], k, v, m[r : r + 1])[0]
    assert nmse(out[r], full) > 1e-3, "and not the reference of the mask as written"


# ------------------------------------------------------------------ Q past the half range


def test_q_that_overflows_half_after_scaling(device, rng):
    q, k, v, m = _problem(rng)
    q[5, 1, 9] = 65519.0  # rounds to 65504: finite
    q[6, 2, 9] = 65520.0  # rounds to inf
    q[7, 0, 9] = 300.0  # times scale 256 = 76800: inf
    out, _ = _run(device, q, k, v, m, scale=256.0)
    assert np.isnan(out[7, 0]).all() and np.isnan(out[5, 1]).all(), "scaled by 256 both overflow"
    out, _ = _run(device, q, k, v, m, scale=1.0)
    assert np.isfinite(out[5, 1]).all() and np.isnan(out[6, 2]).all() and np.isfinite(out[7, 0]).all()
    ok = np.ones((ROWS, NH), bool)
    ok[6, 2] = False
    assert nmse(out[ok], _reference(q, k, v, m)[ok]) < 5e-4
    # The check finds them before anything runs.
    mx.check_q_fits_half(np.where(np.isfinite(q), q, 0).clip(-65519, 65519), scale=1.0)
    with pytest.raises(mx.InvalidArgumentError, match=r"q\[6, 2, 9\] = 65520.0"):
        mx.check_q_fits_half(q, scale=1.0)
    big = np.zeros((2, 1, 256), np.float32)
    big[1, 0, 3] = 65520.0 * 16
    mx.check_q_fits_half(big / 2)  # the default scale, 1/sqrt(head_dim) = 1/16: fits
    with pytest.raises(mx.InvalidArgumentError, match=r"q\[1, 0, 3\] = 1048320.0 times scale 0.0625"):
        mx.check_q_fits_half(big)
    with pytest.raises(mx.InvalidArgumentError, match=r"q\[5, 1, 9\].*scale 256"):
        mx.check_q_fits_half(q, scale=256.0)
    with pytest.raises(mx.InvalidArgumentError, match="scale"):
        mx.check_q_fits_half(q[:1], scale=float("inf"))


def test_check_finite_refuses_what_would_poison_the_output(device, rng):
    q, k, v, m = _problem(rng)
    k, v, m = k[:KV_LEN], v[:KV_LEN], m[:, :KV_LEN]
    good = mx.flash_attn_prefill(q, k, v, m, scale=1.0, check_finite=True, device=device)
    assert np.array_equal(good, mx.flash_attn_prefill(q, k, v, m, scale=1.0, device=device))
    cases = []
    for name, arr, idx, val in [("q", q, (1, 2, 3), np.nan), ("q", q, (1, 2, 3), 1e6), ("k", k, (4, 1, 0), np.inf),
                                ("v", v, (9, 0, 8), -np.inf), ("mask", m, (2, 3), np.nan), ("mask", m, (2, 3), np.inf)]:
        bad = arr.copy()
        bad[idx] = val
        kw = dict(q=q, k=k, v=v, mask=m)
        kw[name] = bad
        cases.append((name, idx, kw))
    for name, idx, kw in cases:
        with pytest.raises(mx.InvalidArgumentError, match=rf"{name}\[{', '.join(map(str, idx))}\]"):
            mx.flash_attn_prefill(kw["q"], kw["k"], kw["v"], kw["mask"], scale=1.0, check_finite=True, device=device)
    # -inf in the mask is what masking is: allowed.
    mm = m.copy()
    mm[:, :7] = -np.inf
    mx.flash_attn_prefill(q, k, v, mm, check_finite=True, device=device)


# ------------------------------------------------------------------ tiny and huge shapes


@pytest.mark.parametrize("rows,kv_len,nh,nkv,hd", [(1, 1, 1, 1, 256), (1, 1, 8, 2, 512), (1, 300, 4, 1, 256),
                                                   (300, 1, 2, 2, 256), (33, 1, 16, 8, 512)])
def test_one_row_and_one_cache_row(device, rng, rows, kv_len, nh, nkv, hd):
    q = rng.uniform(-1, 1, (rows, nh, hd)).astype(np.float32)
    k = rng.uniform(-1, 1, (kv_len, nkv, hd)).astype(np.float16)
    v = rng.uniform(-1, 1, (kv_len, nkv, hd)).astype(np.float16)
    for causal in (False, True):
        if causal and kv_len < rows:  # SPEC 6: a causal prompt is the end of its cache
            with pytest.raises(mx.InvalidArgumentError, match="cannot be shorter"):
                mx.flash_attn_prefill(q, k, v, causal=causal, device=device)
            continue
        out = mx.flash_attn_prefill(q, k, v, causal=causal, scale=1.0, device=device)
        ref = reference_attention(q, k, v, None if not causal else mx.causal_mask(rows, kv_len))
        assert nmse(out, ref) < 5e-4
        if kv_len == 1 and rows <= 1:
            # One visible cache row: the output is that V row, up to rounding.
            g = np.arange(nh) // (nh // nkv)
            assert np.allclose(out[0], v[0, g].astype(np.float32), rtol=1e-3, atol=1e-3)


def _dispatch_params(dev, p, sizes):
    """Dispatch p over fresh buffers of the given element counts; returns the output."""
    q = dev.buffer(np.random.default_rng(0).uniform(-1, 1, sizes[0]).astype(np.float32))
    k = dev.buffer(np.random.default_rng(1).uniform(-1, 1, sizes[1]).astype(np.float16))
    v = dev.buffer(np.random.default_rng(2).uniform(-1, 1, sizes[2]).astype(np.float16))
    mask = dev.buffer(np.zeros(sizes[3], np.float16))
    blk = dev.buffer(np.ones(sizes[4], np.uint8))
    out = dev.empty(sizes[5])
    with dev.encoder() as enc:
        mx.dispatch_flash_attn_prefill_tensor_f16(enc, q, k, v, mask, blk, out, p)
    return out.numpy(), q.numpy(), k.numpy(), v.numpy()


I32 = 2**31 - 1


def _tiny(**kw):
    base = dict(rows=1, n_heads=1, n_kv_heads=1, head_dim=256, kv_pad=64, q_row_stride=256, q_head_stride=256,
                k_row_stride=256, k_head_stride=256, v_row_stride=256, v_head_stride=256, scale=1.0)
    base.update(kw)
    return mx.FlashAttnPrefillTensorParams(**base)


def test_strides_at_the_i32_limit_run_one_past_is_refused(device):
    sizes = (256, 64 * 256, 64 * 256, 64, 1, 256)
    # One row and one head: these strides are multiplied by zero, so they are legal at the
    # largest value the i32 rule accepts, and the kernel reads only what the buffers hold.
    largest = _tiny(q_row_stride=I32 - 3, q_head_stride=I32 - 3, k_head_stride=I32, v_head_stride=I32)
    out, q, k, v = _dispatch_params(device, largest, sizes)
    ref = reference_attention(q.reshape(1, 1, 256), k.reshape(64, 1, 256), v.reshape(64, 1, 256))
    assert nmse(out.reshape(1, 1, 256), ref) < 5e-4
    for field in ("q_row_stride", "q_head_stride", "k_row_stride", "k_head_stride", "v_row_stride", "v_head_stride"):
        with pytest.raises(mx.InvalidArgumentError, match="exceeds i32"):
            _dispatch_params(device, _tiny(**{field: 2**31}), sizes)
        with pytest.raises(mx.InvalidArgumentError, match="32 unsigned bits"):
            _dispatch_params(device, _tiny(**{field: 2**32}), sizes)


@pytest.mark.parametrize(
    "kw,at_limit",
    [
        (dict(rows=I32, q_row_stride=0), "mask holds"),
        (dict(n_heads=I32, n_kv_heads=I32, q_head_stride=0, k_head_stride=0, v_head_stride=0), "out holds"),
        (dict(kv_pad=2**31 - 64), "k holds"),
    ],
    ids=["rows", "heads", "kv_pad"],
)
def test_dimensions_at_the_i32_limit_are_size_errors_past_it_i32_errors(device, kw, at_limit):
    sizes = (256, 64 * 256, 64 * 256, 64, 1, 256)
    with pytest.raises(mx.InvalidArgumentError, match=at_limit):
        _dispatch_params(device, _tiny(**kw), sizes)
    past = {key: (2**31 if val == I32 else val + 64 if key == "kv_pad" else val) for key, val in kw.items()}
    with pytest.raises(mx.InvalidArgumentError, match="exceeds i32"):
        _dispatch_params(device, _tiny(**past), sizes)


def test_the_largest_kv_pad_runs(device, rng):
    """kv_pad = 2^31 - 64 for real: every cache row the same K/V row (row strides 0), a
    4 GiB mask of which the kernel reads only the last tile (the table skips the others).
    Mask element indices reach 2^31 - 1, byte offsets pass 2^32: 32-bit index arithmetic in
    any backend would show here."""
    kvp = 2**31 - 64
    steps = kvp // 64
    q = rng.uniform(-1, 1, 256).astype(np.float32)
    kv = rng.uniform(-1, 1, 256).astype(np.float16)
    mask = device.empty((kvp,), np.float16)
    tail = np.full(64, -np.inf, np.float16)
    tail[[0, 17, 40, 63]] = 0.25
    mask.view((kvp - 64) * 2, (64,)).write(tail)
    blk = np.zeros(steps, np.uint8)
    blk[-1] = 1
    qb, kb = device.buffer(q), device.buffer(kv)
    out = device.empty(256)
    with device.encoder() as enc:
        mx.dispatch_flash_attn_prefill_tensor_f16(
            enc, qb, kb, kb, mask, device.buffer(blk), out, _tiny(kv_pad=kvp, k_row_stride=0, v_row_stride=0)
        )
    assert np.allclose(out.numpy(), kv.astype(np.float32), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("bq", [2**31 - 1, 2**31 - 64, 2**30 + 1])
def test_blk_tiles_taller_than_the_mask(device, rng, bq):
    """bq near the i32 limit: rows + bq passes 2^31 (a 32-bit tile count would wrap)."""
    m = rng.uniform(-1, 1, (40, 128)).astype(np.float16)
    m[:, 64:] = -np.inf
    mb = device.buffer(m)
    blk = device.buffer(np.full((1, 2), 9, np.uint8), copy=True)
    with device.encoder() as enc:
        mx.dispatch_flash_attn_prefill_blk(enc, mb, blk, rows=40, kv_pad=128, bq=bq)
    assert blk.numpy().tolist() == [[1, 0]]


def test_kv_pad_of_the_largest_lengths():
    assert mx.kv_pad(2**32 - 64) == 2**32 - 64
    with pytest.raises(mx.InvalidArgumentError, match="cannot be padded"):
        mx.kv_pad(2**32 - 63)


# ------------------------------------------------------------------ resources


def test_more_memory_than_exists_is_an_allocation_error(device, cpu):
    limit = mx.cpu_info()["memory"]
    if sys.platform.startswith("linux"):
        assert limit > 0
        with pytest.raises(mx.BufferAllocationError, match=f"{limit + 4096} bytes"):
            cpu.empty(limit + 4096, np.uint8)
    # A petabyte exceeds any device.
    with pytest.raises(mx.BufferAllocationError) as e:
        device.empty(2**50, np.uint8)
    assert isinstance(e.value, MemoryError)
    # The device still works afterwards.
    assert device.empty(16).numpy().shape == (16,)


def test_without_a_visible_gpu_auto_is_the_cpu_and_gpus_are_clean_errors():
    code = (
        "import mlx_native as mx, sys\n"
        "d = mx.Device('auto')\n"
        "print(d.backend)\n"
        "for name in ('cuda', 'metal'):\n"
        "    if name in mx.backends():\n"
        "        continue\n"
        "    try:\n"
        "        mx.Device(name)\n"
        "        print('opened', name)\n"
        "    except mx.DeviceNotFoundError as e:\n"
        "        print(type(e).__name__)\n"
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split()
    assert lines[0] in ("cpu", "metal"), r.stdout
    assert "opened" not in r.stdout
    assert all(x in ("BackendUnavailableError", "DeviceNotFoundError") for x in lines[1:]), r.stdout
