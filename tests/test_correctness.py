"""Every backend against the float64 reference (SPEC section 3) on random cases."""

from __future__ import annotations

import numpy as np
import pytest

import mlx_native as mx
from mlx_native.reference import nmse, peer_mask, random_qkv, reference_attention

from helpers import CASES, case_id, make_case, run_low_level

#: The SPEC bar, and what these kernels actually reach (far less; a regression shows).
SPEC_BAR = 5e-4
EXPECTED = 1e-5


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_low_level_strided_matches_reference(device, rng, case):
    rows, nh, nkv, hd, kv_len, scale, mask, window = case
    c = make_case(rng, rows, nh, nkv, hd, kv_len, scale=scale, mask=mask, window=window)
    out, blk = run_low_level(device, c)
    ref = reference_attention(c.q, c.k, c.v, c.mask, scale=scale)
    err = nmse(out, ref)
    assert np.isfinite(out).all()
    assert err <= SPEC_BAR
    assert err < EXPECTED, f"nmse {err:.3e}"


def test_peer_mask_hits_all_three_tile_classes_and_matches(device, rng):
    c = make_case(rng, 300, 2, 1, 256, 700, mask="peer")
    out, blk = run_low_level(device, c)
    assert set(np.unique(blk).tolist()) == {0, 1, 2}
    assert nmse(out, reference_attention(c.q, c.k, c.v, c.mask)) < EXPECTED


@pytest.mark.parametrize("hd", [256, 512])
def test_skip_table_changes_no_bit(device, rng, hd):
    c = make_case(rng, 70, 4, 2, hd, 300, mask="peer")
    out, blk = run_low_level(device, c)
    assert 0 in blk and 2 in blk, "the case must exercise skipping and mask-free tiles"
    ones, _ = run_low_level(device, c, blk_override=np.ones_like(blk))
    assert np.array_equal(out.view(np.uint32), ones.view(np.uint32))


@pytest.mark.parametrize("hd", [256, 512])
def test_fully_masked_rows_are_zero(device, rng, hd):
    c = make_case(rng, 40, 4, 2, hd, 150, mask="peer")
    c.mask[[0, 7, 39]] = -np.inf
    out, _ = run_low_level(device, c)
    assert np.isfinite(out).all()
    assert (out[[0, 7, 39]] == 0).all()
    assert nmse(out, reference_attention(c.q, c.k, c.v, c.mask)) < EXPECTED


def test_no_row_past_rows_is_written(device, rng):
    c = make_case(rng, 21, 2, 2, 512, 90, mask="peer")
    sentinel = np.float32(-12345.5)
    out, _ = run_low_level(device, c, extra_out_rows=5, sentinel=sentinel)
    assert (out[21:] == sentinel).all()
    assert not (out[:21] == sentinel).any()


@pytest.mark.parametrize(
    "rows,nh,nkv,hd,kv_len,window,causal",
    [
        (50, 4, 1, 256, 50, None, True),
        (40, 2, 2, 512, 130, 32, True),  # continues a longer cache
        (33, 8, 2, 256, 97, None, False),
    ],
)
def test_high_level_matches_reference(device, rng, rows, nh, nkv, hd, kv_len, window, causal):
    q, k, v = random_qkv(rows, nh, nkv, hd, kv_len, rng)
    user = peer_mask(rows, kv_len, rng) if not causal else None
    out = mx.flash_attn_prefill(q, k, v, user, causal=causal, window=window, device=device)
    mask = np.zeros((rows, kv_len), np.float16) if user is None else user.copy()
    if causal:
        mask = mask + mx.causal_mask(rows, kv_len, window)
    ref = reference_attention(q, k, v, mask, scale=1 / np.sqrt(hd))  # the default scale
    assert out.shape == (rows, nh, hd) and out.dtype == np.float32
    assert nmse(out, ref) < EXPECTED


def test_high_level_accepts_strided_views(device, rng):
    rows, nh, nkv, hd, kv_len = 30, 4, 2, 256, 128
    qb = rng.uniform(-1, 1, size=(rows, nh * 2, hd + 8)).astype(np.float32)
    kb = rng.uniform(-1, 1, size=(kv_len, nkv, 2, hd + 3)).astype(np.float16)
    vb = rng.uniform(-1, 1, size=(kv_len * 2, nkv, hd)).astype(np.float16)
    q, k, v = qb[:, ::2, 8:], kb[:, :, 1, 3:], vb[::2]
    out = mx.flash_attn_prefill(q, k, v, causal=True, scale=0.5, device=device)
    ref = reference_attention(np.ascontiguousarray(q), k, v, mx.causal_mask(rows, kv_len), scale=0.5)
    assert nmse(out, ref) < EXPECTED


def test_high_level_bool_mask_and_rows_that_see_nothing(device, rng):
    rows, kv_len = 20, 70
    q, k, v = random_qkv(rows, 2, 1, 512, kv_len, rng)
    allowed = rng.random((rows, kv_len)) < 0.5
    allowed[3] = False
    out = mx.flash_attn_prefill(q, k, v, allowed, scale=1.0, device=device)
    ref = reference_attention(q, k, v, np.where(allowed, 0, -np.inf).astype(np.float16))
    assert (out[3] == 0).all()
    assert nmse(out, ref) < EXPECTED


def test_cache_shorter_than_prompt_is_an_error_when_causal(device, rng):
    # SPEC 6: the prompt is the end of its cache, so kv_len < rows is invalid when causal;
    # an explicit mask can still say the same (its first rows see nothing).
    q, k, v = random_qkv(40, 2, 2, 256, 10, rng)
    with pytest.raises(mx.InvalidArgumentError, match="cannot be shorter"):
        mx.flash_attn_prefill(q, k, v, causal=True, device=device)
    allowed = np.arange(10)[None, :] <= np.arange(40)[:, None] - 30
    out = mx.flash_attn_prefill(q, k, v, allowed, device=device)
    assert (out[:30] == 0).all()
    assert np.abs(out[30:]).sum() > 0


def test_code_paths_agree_with_each_other(rng):
    """Every backend and CPU instruction set computes nearly the same bits."""
    from conftest import TARGETS

    q, k, v = random_qkv(48, 4, 2, 256, 200, rng)
    outs = {}
    for backend, isa in TARGETS:
        mx.force_cpu_isa(isa)
        try:
            outs[(backend, isa)] = mx.flash_attn_prefill(q, k, v, causal=True, device=mx.Device(backend))
        finally:
            mx.force_cpu_isa(None)
    first = next(iter(outs.values()))
    for target, o in outs.items():
        assert nmse(o, first) < 1e-8, target
