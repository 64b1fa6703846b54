"""The front door's explicit query offset (``offset=``, SPEC 6 with the op's ``has_offset``):
query row r sits at cache position ``r + offset``, for causal and window masks, fixed and
variable length, against the float64 reference (``reference_prefill(..., offset=)``) on
every backend present; rows that see nothing; parts of a cache merged through lse (what
context parallelism does); and the mistakes, each a typed error."""

from __future__ import annotations

import numpy as np
import pytest

import mlx_native as mn
from mlx_native.reference import merge_reference, nmse, reference_prefill, visible_mask
from helpers import import_test_extra

BAR = 1e-5
LSE_TOL = 2e-3  # SPEC 8


def _qkv(rng, q_shape, kv_shape):
    q = rng.uniform(-1, 1, q_shape).astype(np.float32)
    k = rng.uniform(-1, 1, kv_shape).astype(np.float16)
    v = rng.uniform(-1, 1, kv_shape).astype(np.float16)
    return q, k, v


def _check(out, lse, ref, ref_lse):
    err = nmse(out, ref)
    assert err < BAR, f"NMSE {err:.2e}"
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)), "lse is -inf exactly where a row sees nothing"
    fin = np.isfinite(ref_lse)
    assert np.abs(lse[fin] - ref_lse[fin]).max(initial=0) < LSE_TOL


@pytest.mark.parametrize(
    "b,rows,kv,nh,nkv,hd,window,offset",
    [
        (None, 40, 150, 4, 2, 256, None, -20),  # rows 0..19 see nothing
        (None, 40, 150, 2, 1, 512, None, 37),  # a chunk of queries inside the cache
        (None, 40, 150, 4, 2, 256, None, 200),  # past the cache: every row sees all of it
        (None, 70, 150, 4, 2, 256, 30, 60),  # a window inside the cache
        (2, 33, 20, 4, 1, 512, None, 5),  # batched, a cache shorter than the prompt
        (2, 50, 64, 8, 2, 256, 16, -5),  # batched, a window starting before the cache
        (None, 64, 64, 4, 4, 256, 100, 0),  # the diagonal block of a fresh prefill
    ],
)
def test_offset_matches_the_reference(device, rng, b, rows, kv, nh, nkv, hd, window, offset):
    lead = () if b is None else (b,)
    q, k, v = _qkv(rng, lead + (rows, nh, hd), lead + (kv, nkv, hd))
    out, lse = mn.flash_attn_prefill(q, k, v, causal=True, window=window, offset=offset, return_lse=True, device=device)
    ref, ref_lse = reference_prefill(q, k, v, causal=True, window=window, offset=offset, scale=1 / np.sqrt(hd))
    _check(out, lse, ref, ref_lse)
    # The reference places the rows where the offset says (a test of the test): the
    # prompt-ends-the-cache placement gives another result unless the offsets agree.
    if offset != kv - rows:
        ref_end, _ = reference_prefill(q, k, v, causal=True, window=window, scale=1 / np.sqrt(hd))
        assert nmse(ref_end, ref) > 1e-3


def test_rows_that_see_nothing_are_plus_zero_with_lse_minus_inf(device, rng):
    q, k, v = _qkv(rng, (40, 4, 256), (64, 2, 256))
    # Offset -25: rows 0..24 sit before the cache; window 10 and offset 80: rows whose
    # window ends past the cache's last row by 10 or more (r + 80 - 10 >= 63: r >= 0) see nothing.
    for window, offset, blind in ((None, -25, range(25)), (10, 80, range(40)), (10, 60, range(13, 40))):
        out, lse = mn.flash_attn_prefill(q, k, v, causal=True, window=window, offset=offset, return_lse=True, device=device)
        seen = visible_mask(40, 64, True, window, offset).any(axis=1)
        assert list(np.flatnonzero(~seen)) == list(blind)
        rows = np.array(list(blind))
        assert np.all(out[rows] == 0) and not np.signbit(out[rows]).any(), "rows that see nothing are +0"
        assert np.all(np.isneginf(lse[:, rows]))
        assert np.all(np.isfinite(lse[:, seen]))


def test_an_offset_equal_to_the_implied_one_changes_no_bit(device, rng):
    q, k, v = _qkv(rng, (2, 30, 4, 512), (2, 90, 2, 512))
    for window in (None, 17):
        implied = mn.flash_attn_prefill(q, k, v, causal=True, window=window, return_lse=True, device=device)
        given = mn.flash_attn_prefill(q, k, v, causal=True, window=window, offset=60, return_lse=True, device=device)
        assert all(np.array_equal(a, b) for a, b in zip(implied, given))


def test_described_with_offset_equals_the_same_placement_as_an_explicit_mask(device, rng):
    q, k, v = _qkv(rng, (45, 4, 256), (100, 2, 256))
    for window, offset in ((None, 30), (25, -7), (8, 90)):
        mask = np.where(visible_mask(45, 100, True, window, offset), 0, -np.inf).astype(np.float16)
        described = mn.flash_attn_prefill(q, k, v, causal=True, window=window, offset=offset, device=device)
        explicit = mn.flash_attn_prefill(q, k, v, mask, device=device)
        assert np.array_equal(described, explicit), (window, offset)


def test_an_explicit_mask_is_added_on_the_pairs_the_offset_leaves_visible(device, rng):
    q, k, v = _qkv(rng, (2, 40, 4, 256), (2, 70, 2, 256))
    m = rng.uniform(-2, 1, (2, 1, 40, 70)).astype(np.float32)
    out, lse = mn.flash_attn_prefill(q, k, v, m, causal=True, window=20, offset=12, return_lse=True, device=device)
    ref, ref_lse = reference_prefill(q, k, v, m, causal=True, window=20, offset=12, scale=1 / 16)
    _check(out, lse, ref, ref_lse)


def test_variable_length_takes_one_offset_for_every_sequence(device, rng):
    # SPEC 7 with the op's offset: one offset for every sequence, so a sequence's cache may
    # be shorter than its prompt, and Lq = 0 / Lk = 0 still write nothing / zeros.
    lens = [(30, 80), (0, 10), (50, 20), (12, 0)]
    cq = np.concatenate([[0], np.cumsum([a for a, _ in lens])]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum([b for _, b in lens])]).astype(np.int32)
    q, k, v = _qkv(rng, (int(cq[-1]), 4, 256), (int(ck[-1]), 2, 256))
    for window, offset in ((None, 10), (16, -5), (None, 100)):
        out, lse = mn.flash_attn_prefill(q, k, v, causal=True, window=window, offset=offset, cu_seqlens_q=cq,
                                         cu_seqlens_k=ck, return_lse=True, device=device)  # fmt: skip
        ref, ref_lse = reference_prefill(q, k, v, causal=True, window=window, offset=offset, scale=1 / 16,
                                         cu_seqlens_q=cq, cu_seqlens_k=ck)  # fmt: skip
        _check(out, lse, ref, ref_lse)


@pytest.mark.parametrize("window,cuts", [(None, [0, 64, 100, 160]), (40, [0, 30, 95, 130, 160]), (200, [0, 80, 160])])
def test_parts_of_a_cache_with_their_offsets_merge_to_the_whole(device, rng, window, cuts):
    # A prompt of 60 rows ending a cache of 160: each part [c0, c1) of the cache is a cache
    # of its own, in which the prompt's row r sits at r + (160 - 60) - c0.
    q, k, v = _qkv(rng, (60, 4, 512), (160, 2, 512))
    whole, whole_lse = mn.flash_attn_prefill(q, k, v, causal=True, window=window, return_lse=True, device=device)
    parts = [
        mn.flash_attn_prefill(q, k[c0:c1], v[c0:c1], causal=True, window=window, offset=100 - c0, return_lse=True,
                              device=device)  # fmt: skip
        for c0, c1 in zip(cuts, cuts[1:])
    ]
    out, lse = parts[0]
    out64, lse64 = out.astype(np.float64), lse.astype(np.float64)
    for o, l in parts[1:]:
        out, lse = mn.merge_attention_states(out, lse, o, l)
        out64, lse64 = merge_reference(out64, lse64, o, l)
    ref, ref_lse = reference_prefill(q, k, v, causal=True, window=window, scale=1 / np.sqrt(512))
    _check(out, lse, ref, ref_lse)
    # The whole run rounds its P to half over other steps: agreement at the kernel's own error.
    assert nmse(out, whole) < 1e-6 and np.abs(lse - whole_lse).max() < LSE_TOL
    assert nmse(out, out64) < 1e-12, "the float32 merge keeps the float64 merge's result"


def test_the_plan_counts_the_pairs_the_offset_leaves_visible(rng):
    q, k, v = _qkv(rng, (40, 2, 256), (50, 1, 256))
    for window, offset in ((None, -10), (None, 7), (9, 30), (9, 45), (100, 200), (3, -45)):
        plan = mn.PrefillPlan(q, k, v, causal=True, window=window, offset=offset)
        assert plan.visible_pairs == int(visible_mask(40, 50, True, window, offset).sum()), (window, offset)
        assert plan.offset == offset and f"offset {offset}" in repr(plan)
    m = np.zeros((40, 50), np.float16)
    m[:, :5] = -np.inf
    plan = mn.PrefillPlan(q, k, v, m, causal=True, window=12, offset=20)
    assert plan.visible_pairs == int((visible_mask(40, 50, True, 12, 20) & (np.arange(50) >= 5)).sum())


def test_the_call_keeps_one_plan_per_offset(rng):
    q, k, v = _qkv(rng, (20, 2, 256), (40, 1, 256))
    a = mn.flash_attn_prefill(q, k, v, causal=True, offset=0)
    b = mn.flash_attn_prefill(q, k, v, causal=True, offset=15)
    assert not np.array_equal(a, b)
    assert nmse(b, reference_prefill(q, k, v, causal=True, offset=15, scale=1 / 16)[0]) < BAR
    assert np.array_equal(a, mn.flash_attn_prefill(q, k, v, causal=True, offset=0))


def test_offset_with_torch_tensors(rng):
    torch = import_test_extra("torch")
    q, k, v = _qkv(rng, (33, 4, 256), (50, 2, 256))
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    out, lse = mn.flash_attn_prefill(tq, tk, tv, causal=True, window=11, offset=-3, return_lse=True)
    assert isinstance(out, torch.Tensor)
    ref, ref_lse = reference_prefill(q, k, v, causal=True, window=11, offset=-3, scale=1 / 16)
    _check(out.numpy(), lse.numpy(), ref, ref_lse)


# ------------------------------------------------------------------ mistakes


def _raises(cls, builtin, match, fn, *args, **kw):
    with pytest.raises(cls, match=match) as e:
        fn(*args, **kw)
    assert isinstance(e.value, mn.MlxError) and isinstance(e.value, builtin)


@pytest.mark.parametrize("entry", [mn.flash_attn_prefill, mn.PrefillPlan])
def test_offset_mistakes(rng, entry):
    qkv = _qkv(rng, (16, 4, 256), (16, 2, 256))
    for bad in (2.0, True, "3", np.float32(1)):
        _raises(mn.ArgumentTypeError, TypeError, "offset must be an integer", entry, *qkv, causal=True, offset=bad)
    _raises(mn.InvalidArgumentError, ValueError, "pass causal=True or a window", entry, *qkv, offset=4)
    for bad in (2**31, -(2**31) - 1):
        _raises(mn.InvalidArgumentError, ValueError, "does not fit in int32", entry, *qkv, causal=True, offset=bad)
    # numpy integers are integers; a window alone implies causal.
    entry(*qkv, causal=True, offset=np.int64(3))
    entry(*qkv, window=4, offset=-2)
