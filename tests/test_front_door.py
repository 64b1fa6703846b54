"""The front door, ``flash_attn_prefill`` and ``PrefillPlan`` (issue 11), against the float64
reference of SPEC 6-8 (``mlx_native.reference.reference_prefill``) on every backend present:
batches fixed and variable length, every mask form, every dtype pair, lse and the merge,
layouts used in place, plans run on new data.

Accuracy bars. F32 output: NMSE < 1e-5. F16 and BF16 outputs are compared with the
reference rounded to the same dtype. Rounding to nearest moves a value by at most half an
ulp, at most 2^-11 of it in float16 and 2^-8 in bfloat16, so with the F32 result's own
error e (NMSE e^2, about 4e-8 here: e ~ 2e-4) the two rounded values differ by at most
e + 2 half-ulps: NMSE <= (2e-4 + 2^-10)^2 ~ 1.5e-6 in float16 and (2e-4 + 2^-7)^2 ~ 6.5e-5
in bfloat16, the worst case of every element at its worst. The kernel's own rounding is
checked exactly: its F16/BF16 output is its F32 output rounded to nearest even, bit for
bit (SPEC 9: written by the kernel, no second pass)."""

from __future__ import annotations

import tracemalloc

import ml_dtypes
import numpy as np
import pytest

import mlx_native as mn
from mlx_native.arrays import Operand
from mlx_native.reference import merge_reference, nmse, reference_prefill, visible_mask

BARS = {"float32": 1e-5, "float16": 1.5e-6, "bfloat16": 6.5e-5}
NP = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
LSE_TOL = 2e-3  # SPEC 8


def _qkv(rng, q_shape, kv_shape, q_dtype="float32"):
    q = rng.uniform(-1, 1, q_shape).astype(NP[q_dtype])
    k = rng.uniform(-1, 1, kv_shape).astype(np.float16)
    v = rng.uniform(-1, 1, kv_shape).astype(np.float16)
    return q, k, v


def _check(out, ref, dtype="float32"):
    assert out.dtype == NP[dtype], out.dtype
    err = nmse(out, ref.astype(NP[dtype]) if dtype != "float32" else ref)
    assert err < BARS[dtype], f"NMSE {err:.2e} over {BARS[dtype]:g} ({dtype})"


def _check_lse(lse, ref):
    assert lse.dtype == np.float32 and lse.shape == ref.shape
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref)), "rows that see nothing have lse -inf, and only they"
    fin = np.isfinite(ref)
    assert np.abs(lse[fin] - ref[fin]).max(initial=0) < LSE_TOL


# ------------------------------------------------------------------ fixed-length batches


@pytest.mark.parametrize(
    "b,rows,kv,nh,nkv,hd,causal,window",
    [
        (None, 70, 70, 4, 2, 256, True, None),  # fresh prefill, 3-D
        (None, 40, 130, 2, 1, 512, True, 32),  # the prompt at the end of a longer cache
        (2, 33, 97, 4, 4, 256, False, None),  # batched, no mask
        (3, 20, 75, 8, 2, 256, True, 7),  # batched, window
        (2, 0, 50, 2, 1, 256, True, None),  # Lq = 0
    ],
)
def test_fixed_length_matches_the_reference(device, rng, b, rows, kv, nh, nkv, hd, causal, window):
    lead = () if b is None else (b,)
    q, k, v = _qkv(rng, lead + (rows, nh, hd), lead + (kv, nkv, hd))
    out, lse = mn.flash_attn_prefill(q, k, v, causal=causal, window=window, return_lse=True, device=device)
    ref, ref_lse = reference_prefill(q, k, v, causal=causal, window=window, scale=1 / np.sqrt(hd))
    assert out.shape == q.shape and out.flags.c_contiguous
    assert lse.shape == (lead + (nh, rows))
    _check(out, ref)
    _check_lse(lse, ref_lse)


def test_the_default_scale_is_one_over_sqrt_head_dim(device, rng):
    q, k, v = _qkv(rng, (30, 2, 512), (30, 1, 512))
    out = mn.flash_attn_prefill(q, k, v, causal=True, device=device)
    assert np.array_equal(out, mn.flash_attn_prefill(q, k, v, causal=True, scale=1 / np.sqrt(512), device=device))
    assert nmse(out, mn.flash_attn_prefill(q, k, v, causal=True, scale=1.0, device=device)) > 1e-3


# ------------------------------------------------------------------ variable length


@pytest.mark.parametrize(
    "lens,causal,window",
    [
        ([(5, 5), (0, 7), (30, 70), (1, 1)], True, None),  # Lq = 0, Lk > Lq
        ([(12, 40), (33, 33), (0, 0)], True, 9),  # an empty sequence, window
        ([(10, 0), (20, 64), (3, 100)], False, None),  # Lk = 0: zeros, lse -inf
    ],
)
def test_variable_length_matches_the_reference(device, rng, lens, causal, window):
    cq = np.concatenate([[0], np.cumsum([a for a, _ in lens])]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum([b for _, b in lens])]).astype(np.int32)
    q, k, v = _qkv(rng, (int(cq[-1]), 4, 256), (int(ck[-1]), 2, 256))
    out, lse = mn.flash_attn_prefill(q, k, v, causal=causal, window=window, cu_seqlens_q=cq, cu_seqlens_k=ck,
                                     return_lse=True, device=device)  # fmt: skip
    ref, ref_lse = reference_prefill(q, k, v, causal=causal, window=window, scale=1 / 16, cu_seqlens_q=cq, cu_seqlens_k=ck)
    assert lse.shape == (4, int(cq[-1]))
    _check(out, ref)
    _check_lse(lse, ref_lse)
    # int64 offsets give the same.
    again = mn.flash_attn_prefill(q, k, v, causal=causal, window=window, cu_seqlens_q=cq.astype(np.int64),
                                  cu_seqlens_k=ck.astype(np.int64), device=device)  # fmt: skip
    assert np.array_equal(again, out)


# ------------------------------------------------------------------ masks


def _mask_case(rng, rows=40, kv=100, b=2):
    q, k, v = _qkv(rng, (b, rows, 4, 256), (b, kv, 2, 256))
    m = rng.uniform(-2, 1, (b, 1, rows, kv)).astype(np.float32)
    m[rng.random(m.shape) < 0.3] = -np.inf
    m[:, :, :, :64][:, :, :32] = -np.inf  # whole tiles masked
    return q, k, v, m


@pytest.mark.parametrize("form", ["[B,1,S,K]", "[B,S,K]", "[1,1,S,K]", "[S,K]", "[1,S,K]", "expanded heads"])
def test_explicit_mask_forms(device, rng, form):
    q, k, v, m = _mask_case(rng)
    shared = m[:1]
    given, ref_mask = {
        "[B,1,S,K]": (m, m),
        "[B,S,K]": (m[:, 0], m),
        "[1,1,S,K]": (shared, shared),
        "[S,K]": (shared[0, 0], shared),
        "[1,S,K]": (shared[:, 0], shared),
        "expanded heads": (np.broadcast_to(m, (2, 4) + m.shape[2:]), m),
    }[form]
    out = mn.flash_attn_prefill(q, k, v, given, device=device)
    ref, _ = reference_prefill(q, k, v, ref_mask, scale=1 / 16)
    _check(out, ref)


@pytest.mark.parametrize("causal,window", [(True, None), (True, 20), (False, None)])
def test_mask_added_on_the_visible_pairs(device, rng, causal, window):
    q, k, v, m = _mask_case(rng, rows=40, kv=90)
    out, lse = mn.flash_attn_prefill(q, k, v, m, causal=causal, window=window, return_lse=True, device=device)
    ref, ref_lse = reference_prefill(q, k, v, m, causal=causal, window=window, scale=1 / 16)
    _check(out, ref)
    _check_lse(lse, ref_lse)


def test_bool_mask_true_may_attend(device, rng):
    q, k, v = _qkv(rng, (30, 2, 512), (70, 1, 512))
    allowed = rng.random((30, 70)) < 0.5
    allowed[3] = False
    out = mn.flash_attn_prefill(q, k, v, allowed, device=device)
    ref, _ = reference_prefill(q, k, v, np.where(allowed, 0, -np.inf), scale=1 / np.sqrt(512))
    assert (out[3] == 0).all()
    _check(out, ref)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64", "float16"])
def test_finfo_min_masks_give_the_result_of_minus_inf(device, rng, dtype, recwarn):
    """transformers' masks: 0 where allowed, finfo(dtype).min elsewhere. Converted masks map
    values at or below -65504 to -inf (no overflow warning); a float16 one is used in place,
    where -65504 equals -inf bit for bit in every row that sees something."""
    q, k, v = _qkv(rng, (40, 2, 256), (100, 1, 256))
    allowed = visible_mask(40, 100, causal=True) & (rng.random((40, 100)) < 0.8)
    allowed[:, 60] = True  # every row sees something
    dt = NP.get(dtype, np.float64)
    low = ml_dtypes.finfo(dt).min if dtype == "bfloat16" else np.finfo(dt).min
    m = np.where(allowed, 0, low).astype(dt)
    out = mn.flash_attn_prefill(q, k, v, m, device=device)
    inf = mn.flash_attn_prefill(q, k, v, np.where(allowed, 0, -np.inf).astype(np.float16), device=device)
    assert np.array_equal(out, inf)
    assert not [w for w in recwarn.list if "overflow" in str(w.message)]


def test_described_masks_allocate_no_mask(rng):
    """No [rows, kv] array exists for causal or window, host or device (CPU: host memory
    traced during a call of 4096 x 4096, whose float16 mask would be 32 MiB)."""
    rows = 4096
    q, k, v = _qkv(rng, (rows, 1, 256), (rows, 1, 256))
    mn.flash_attn_prefill(q, k, v, causal=True, window=64, scale=1.0)  # warm: plan cached
    out_bytes = q.nbytes
    for window in (None, 64):
        tracemalloc.start()
        mn.flash_attn_prefill(q, k, v, causal=True, window=window, scale=1.0)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < out_bytes + (1 << 20), f"peak {peak >> 10} KiB for a {out_bytes >> 10} KiB output"


# ------------------------------------------------------------------ dtypes


@pytest.mark.parametrize("q_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("out_dtype", ["float32", "float16", "bfloat16"])
def test_dtype_pairs(device, rng, q_dtype, out_dtype):
    q, k, v = _qkv(rng, (50, 4, 256), (80, 2, 256), q_dtype)
    out = mn.flash_attn_prefill(q, k, v, causal=True, out_dtype=out_dtype, device=device)
    ref, _ = reference_prefill(q, k, v, causal=True, scale=1 / 16)
    _check(out, ref, out_dtype)
    # The kernel rounds its own F32 result to nearest even (SPEC 9): bit for bit.
    f32 = mn.flash_attn_prefill(q, k, v, causal=True, out_dtype="float32", device=device)
    assert np.array_equal(out.view(np.uint8), f32.astype(NP[out_dtype]).view(np.uint8))


def test_out_dtype_defaults_to_q_and_takes_dtype_objects(rng):
    q, k, v = _qkv(rng, (8, 1, 256), (8, 1, 256), "bfloat16")
    assert mn.flash_attn_prefill(q, k, v).dtype == ml_dtypes.bfloat16
    assert mn.flash_attn_prefill(q, k, v, out_dtype=np.float16).dtype == np.float16
    assert mn.flash_attn_prefill(q, k, v, out_dtype=np.dtype("float32")).dtype == np.float32


# ------------------------------------------------------------------ lse and the merge


@pytest.mark.parametrize("batched", [False, True])
def test_two_halves_of_a_cache_merge_to_the_whole(device, rng, batched):
    lead = (2,) if batched else ()
    rows, kv = 40, 150
    q, k, v = _qkv(rng, lead + (rows, 4, 256), lead + (kv, 2, 256))
    m = rng.uniform(-1, 1, lead + (rows, kv)).astype(np.float32)
    m[..., 5, :80] = -np.inf  # row 5 sees nothing in the first half
    m[..., 6, 80:] = -np.inf  # row 6 nothing in the second
    m[..., 7, :] = -np.inf  # row 7 nothing at all
    if batched:
        m = m[:, None]
    halves = []
    for sl in (slice(0, 80), slice(80, kv)):
        halves.append(mn.flash_attn_prefill(q, k[..., sl, :, :], v[..., sl, :, :], m[..., sl], return_lse=True, device=device))
    (o1, l1), (o2, l2) = halves
    out, lse = mn.merge_attention_states(o1, l1, o2, l2)
    whole, whole_lse = mn.flash_attn_prefill(q, k, v, m, return_lse=True, device=device)
    ref, ref_lse = reference_prefill(q, k, v, m, scale=1 / 16)
    # Each side carries the kernel's own rounding (P in half, the lazy rescale), so the merge
    # and the whole agree as closely as each agrees with the reference.
    assert nmse(out, whole) < 1e-6 and nmse(out, ref) < BARS["float32"]
    _check_lse(lse, ref_lse)
    assert (out[..., 7, :, :] == 0).all() and np.isneginf(lse[..., 7]).all()
    assert np.abs(lse[np.isfinite(lse)] - whole_lse[np.isfinite(lse)]).max() < LSE_TOL


def test_merge_matches_spec_8_and_is_exact_where_nothing_is_seen(rng):
    o1, o2 = rng.normal(size=(2, 5, 3, 8)).astype(np.float32)
    l1, l2 = rng.normal(size=(2, 3, 5)).astype(np.float32)
    l1[0, 1] = l2[0, 1] = -np.inf  # row 1 of head 0 sees nothing on either side
    l1[1, 2] = -np.inf  # row 2 of head 1 only on the second
    o1[1, 0] = o2[1, 0] = 0
    out, lse = mn.merge_attention_states(o1, l1, o2, l2)
    ref, ref_lse = merge_reference(o1, l1, o2, l2)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    assert np.allclose(out, ref, atol=1e-6) and np.allclose(lse, ref_lse)
    assert (out[1, 0] == 0).all() and np.isneginf(lse[0, 1])
    assert np.allclose(out[2, 1], o2[2, 1], atol=1e-6) and lse[1, 2] == l2[1, 2]


def test_merge_refuses_mismatched_shapes(rng):
    o = np.zeros((5, 3, 8), np.float32)
    lse = np.zeros((3, 5), np.float32)
    with pytest.raises(mn.InvalidArgumentError, match="lse1 must have shape"):
        mn.merge_attention_states(o, lse.T, o, lse)
    with pytest.raises(mn.InvalidArgumentError, match="o1 has shape"):
        mn.merge_attention_states(o, lse, o[:4], lse)


# ------------------------------------------------------------------ layouts in place


def test_strided_views_are_used_in_place(device, rng, monkeypatch):
    """A [B, H, S, D] array passes as .transpose(0, 2, 1, 3) (torch: .transpose(1, 2)) and
    views with padding as they are: nothing is copied."""
    q4 = rng.uniform(-1, 1, (2, 4, 30, 256 + 8)).astype(np.float32)[..., 8:]  # [B, H, S, D], padded dim
    kb = rng.uniform(-1, 1, (2, 2, 3, 60, 256)).astype(np.float16)
    k4, v4 = kb[:, :, 0], kb[:, :, 2]  # [B, Hkv, S, D] views
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q4, k4, v4))
    monkeypatch.setattr(Operand, "made_contiguous", lambda self: pytest.fail("an input was copied"))
    out = mn.flash_attn_prefill(q, k, v, causal=True, device=device)
    monkeypatch.undo()
    ref, _ = reference_prefill(np.ascontiguousarray(q), k, v, causal=True, scale=1 / 16)
    _check(out, ref)
    assert out.shape == (2, 30, 4, 256) and out.flags.c_contiguous


def test_a_last_axis_that_is_not_contiguous_is_copied(device, rng):
    q, k, v = _qkv(rng, (20, 2, 256), (30, 1, 256))
    qt = np.asfortranarray(q)  # last axis strided
    ref = mn.flash_attn_prefill(q, k, v, causal=True, device=device)
    assert np.array_equal(mn.flash_attn_prefill(qt, k, v, causal=True, device=device), ref)
    assert np.array_equal(mn.flash_attn_prefill(q[::-1][::-1], k, v[::-1][::-1], causal=True, device=device), ref)


# ------------------------------------------------------------------ plans


def test_a_plan_runs_on_new_data_of_its_layouts(device, rng):
    q, k, v, m = _mask_case(rng)
    plan = mn.PrefillPlan(q, k, v, m, causal=True, return_lse=True, device=device)
    for _ in range(2):
        q2, k2, v2, m2 = _mask_case(rng)
        out, lse = plan.run(q2, k2, v2, m2)
        ref, ref_lse = reference_prefill(q2, k2, v2, m2, causal=True, scale=1 / 16)
        _check(out, ref)
        _check_lse(lse, ref_lse)
    out, _ = plan.run()  # the planned arrays
    _check(out, reference_prefill(q, k, v, m, causal=True, scale=1 / 16)[0])


def test_a_plan_writes_given_outputs(device, rng):
    q, k, v = _qkv(rng, (2, 30, 4, 256), (2, 60, 2, 256))
    plan = mn.PrefillPlan(q, k, v, causal=True, return_lse=True, out_dtype="float16", device=device)
    out, lse = np.empty((2, 30, 4, 256), np.float16), np.empty((2, 4, 30), np.float32)
    got = plan.run(q, k, v, out=out, lse=lse)
    assert got[0] is out and got[1] is lse
    ref, ref_lse = reference_prefill(q, k, v, causal=True, scale=1 / 16)
    _check(out, ref, "float16")
    _check_lse(lse, ref_lse)
    with pytest.raises(mn.InvalidArgumentError, match="out must be a writable contiguous float16 array"):
        plan.run(q, k, v, out=np.empty((2, 30, 4, 256), np.float32))


def test_a_plan_from_layouts_alone(device, rng):
    q, k, v = _qkv(rng, (30, 4, 256), (50, 2, 256))
    spec = mn.PrefillPlan(mn.ArraySpec(q.shape, "float32"), mn.ArraySpec.like(k), mn.ArraySpec.like(v),
                          mn.ArraySpec((30, 50), np.float16), causal=True, device=device)  # fmt: skip
    m = rng.uniform(-1, 1, (30, 50)).astype(np.float16)
    out = spec.run(q, k, v, m)
    _check(out, reference_prefill(q, k, v, m, causal=True, scale=1 / 16)[0])
    assert spec.visible_pairs is None  # an explicit mask planned without data
    with pytest.raises(mn.InvalidArgumentError, match="made from layouts"):
        spec.run()


def test_a_plan_refuses_other_layouts(rng):
    q, k, v = _qkv(rng, (30, 4, 256), (50, 2, 256))
    plan = mn.PrefillPlan(q, k, v, causal=True)
    with pytest.raises(mn.InvalidArgumentError, match="this plan was made for float32 \\(30, 4, 256\\)"):
        plan.run(q[:20], k, v)
    with pytest.raises(mn.InvalidArgumentError, match="strides"):
        plan.run(np.ascontiguousarray(q.transpose(1, 0, 2)).transpose(1, 0, 2), k, v)
    with pytest.raises(mn.InvalidArgumentError, match="no explicit mask"):
        plan.run(q, k, v, np.zeros((30, 50), np.float16))
    with pytest.raises(mn.InvalidArgumentError, match="pass q, k and v"):
        plan.run(q)


def test_encode_records_runs_on_the_planned_arrays(device, rng):
    q, k, v, m = _mask_case(rng)
    plan = mn.PrefillPlan(q, k, v, m, window=16, device=device)
    with device.encoder() as enc:
        plan.encode(enc, classify=False)  # the first recording classifies all the same
        plan.encode(enc, classify=False)
    out = plan.encoded_result()
    _check(out, reference_prefill(q, k, v, m, window=16, causal=True, scale=1 / 16)[0])
    assert np.array_equal(out, plan.run())


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 5), (True, 1000)])
def test_visible_pairs_count_what_the_mask_leaves(rng, causal, window):
    q, k, v = _qkv(rng, (2, 37, 1, 256), (2, 90, 1, 256))
    plan = mn.PrefillPlan(q, k, v, causal=causal, window=window)
    assert plan.visible_pairs == 2 * int(visible_mask(37, 90, causal, window).sum())
    m = rng.random((2, 1, 37, 90)) < 0.6
    masked = mn.PrefillPlan(q, k, v, m, causal=causal, window=window)
    assert masked.visible_pairs == int((m[:, 0] & visible_mask(37, 90, causal, window)).sum())
    lens = [(5, 9), (0, 3), (20, 20), (12, 58)]
    cq, ck = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in zip(*lens))
    qv, kv, vv = _qkv(rng, (37, 1, 256), (90, 1, 256))
    varlen = mn.PrefillPlan(qv, kv, vv, causal=causal, window=window, cu_seqlens_q=cq, cu_seqlens_k=ck)
    assert varlen.visible_pairs == sum(int(visible_mask(a, b, causal, window).sum()) for a, b in lens)


def test_the_one_call_keeps_one_plan_per_layout(rng):
    from mlx_native import attention

    mn.clear_plan_cache()
    q, k, v = _qkv(rng, (30, 4, 256), (50, 2, 256))
    a = mn.flash_attn_prefill(q, k, v, causal=True)
    b = mn.flash_attn_prefill(q.copy(), k.copy(), v.copy(), causal=True)
    assert len(attention._cache) == 1 and np.array_equal(a, b) and a is not b
    mn.flash_attn_prefill(q, k, v, causal=True, window=3)
    mn.flash_attn_prefill(q[:20], k, v, causal=True)
    mn.flash_attn_prefill(q, k, v, causal=True, scale=1.0)
    assert len(attention._cache) == 4
    for _ in range(attention.PLAN_CACHE_SIZE + 3):
        mn.flash_attn_prefill(q[:1], k[:1], v[:1], scale=float(_ + 1))
    assert len(attention._cache) == attention.PLAN_CACHE_SIZE
    mn.clear_plan_cache()
    assert not attention._cache


def test_device_as_a_name_or_a_device(rng):
    q, k, v = _qkv(rng, (10, 2, 256), (10, 1, 256))
    ref = mn.flash_attn_prefill(q, k, v, causal=True)
    assert np.array_equal(mn.flash_attn_prefill(q, k, v, causal=True, device="cpu"), ref)
    assert np.array_equal(mn.flash_attn_prefill(q, k, v, causal=True, device=mn.Device("cpu")), ref)
    assert mn.PrefillPlan(q, k, v).device.backend == "cpu"  # host arrays: the CPU backend


def test_check_finite_looks_at_every_input(rng):
    q, k, v = _qkv(rng, (2, 10, 2, 256), (2, 20, 1, 256))
    m = np.zeros((2, 1, 10, 20), np.float32)
    mn.flash_attn_prefill(q, k, v, m, check_finite=True)
    bad_q = q.copy()
    bad_q[1, 2, 0, 5] = 2e6  # times 1/16: beyond half
    with pytest.raises(mn.InvalidArgumentError, match=r"q\[1, 2, 0, 5\]"):
        mn.flash_attn_prefill(bad_q, k, v, m, check_finite=True)
    bad_m = m.copy()
    bad_m[0, 0, 3, 4] = np.nan
    with pytest.raises(mn.InvalidArgumentError, match=r"mask\[0, 0, 3, 4\]"):
        mn.flash_attn_prefill(q, k, v, bad_m, check_finite=True)
