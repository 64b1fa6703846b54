"""The CPU's AMX kernels (tiles for both products, issue 26) against the float64 reference,
on the software tile unit (``amx-emulated``: any CPU) and on the tiles themselves where this
CPU has them (``amx``; skipped, with the reason, elsewhere): every head dim with float16 and
bfloat16 K/V, every Q and output dtype, GQA, partial tiles, strided views, described masks
(causal, window, offset), explicit masks with every tile class and SPEC 3's bit-identity,
rows that see nothing, variable length, lse, softcap, ALiBi, sinks; the split products'
setting; the hardware against the emulation; the AMX peak.

Shapes are small: the emulated tiles compute TDPBF16PS element by element."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import mlx_native as mn
from mlx_native.reference import nmse, reference_attention, reference_prefill

from helpers import KERNEL_DIMS, make_case, run_low_level

BF16 = ml_dtypes.bfloat16
NP = {"float32": np.float32, "float16": np.float16, "bfloat16": BF16}
DIMS = KERNEL_DIMS
#: The default splits keep the FMA kernels' accuracy: their cases stay below 1e-6 with an
#: F32 output (tests/test_correctness.py bars them at 1e-5).
EXPECTED = 1e-6
#: F16 / BF16 outputs against the reference rounded the same way (tests/test_front_door.py).
BARS = {"float32": EXPECTED, "float16": 1.5e-6, "bfloat16": 6.5e-5}
#: One product of P (P rounded to bfloat16, as PyTorch rounds it) with BF16 Q and K/V: about
#: 2e-6 with an F32 output, where the exact products give 5e-7.
BF16_P = 5e-6
LSE_TOL = 2e-3  # SPEC 8
HAS_AMX = "amx" in mn.cpu_info()["detected"]


@pytest.fixture(params=["amx-emulated", "amx"])
def amx(request):
    """Each AMX path: forced for the test, the default restored after."""
    if request.param == "amx" and not HAS_AMX:
        pytest.skip("this CPU has no AMX")
    mn.force_cpu_isa(request.param)
    try:
        assert mn.cpu_info()["isa"] == request.param
        yield request.param
    finally:
        mn.force_cpu_isa(None)


def _qkv(rng, rows, kv, nh, nkv, dk, dv=None, kv_dtype=np.float16, q_dtype=np.float32):
    dv = dk if dv is None else dv
    q = rng.uniform(-1, 1, (rows, nh, dk)).astype(q_dtype)
    k = rng.uniform(-1, 1, (kv, nkv, dk)).astype(kv_dtype)
    v = rng.uniform(-1, 1, (kv, nkv, dv)).astype(kv_dtype)
    return q, k, v


def _close(out, lse, ref, ref_lse=None, bar=EXPECTED):
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all()
    err = nmse(out, ref)
    assert err < bar, f"NMSE {err:.2e} over {bar:g}"
    if lse is not None:
        lse = np.asarray(lse)
        assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)), "lse -inf exactly where a row sees nothing"
        fin = np.isfinite(ref_lse)
        assert np.abs(lse[fin] - ref_lse[fin]).max(initial=0) < LSE_TOL
    return err


# ------------------------------------------------------------------ head dims and dtypes


@pytest.mark.parametrize("dk,dv", DIMS, ids=[f"d{a}" if a == b else f"d{a}-{b}" for a, b in DIMS])
@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16", "float32"])
def test_every_head_dim_and_kv_dtype(amx, rng, dk, dv, kv_dtype):
    # GQA 2, partial query tiles (21 rows) and cache steps (45 rows), lse.
    q, k, v = _qkv(rng, 21, 45, 4, 2, dk, dv, NP[kv_dtype])
    out, lse = mn.flash_attn_prefill(q, k, v, causal=True, return_lse=True)
    assert out.shape == (21, 4, dv)
    _close(out, lse, *reference_prefill(q, k, v, causal=True, scale=1 / np.sqrt(dk)))


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("q_dtype", ["float32", "float16", "bfloat16"])
def test_every_q_and_output_dtype(amx, rng, q_dtype, kv_dtype):
    q, k, v = _qkv(rng, 40, 70, 4, 2, 128, kv_dtype=NP[kv_dtype], q_dtype=NP[q_dtype])
    ref, _ = reference_prefill(q, k, v, causal=True, window=50, scale=0.2)
    out32 = mn.flash_attn_prefill(q, k, v, causal=True, window=50, scale=0.2, out_dtype="float32")
    _close(out32, None, ref)
    for out_dtype in ("float16", "bfloat16"):
        out = mn.flash_attn_prefill(q, k, v, causal=True, window=50, scale=0.2, out_dtype=out_dtype)
        assert out.dtype == NP[out_dtype]
        _close(out, None, ref.astype(NP[out_dtype]).astype(np.float64), bar=BARS[out_dtype])
        # The kernel rounds its own F32 result to nearest even (SPEC 9).
        assert np.array_equal(out.view(np.uint16), out32.astype(NP[out_dtype]).view(np.uint16))


@pytest.mark.parametrize("hd", [16, 48, 128, 160, 224])
def test_gqa_and_strided_views(amx, rng, hd):
    # Head dims whose K rows are less than a tile's 32 columns (16), not a multiple of them
    # (48: dkp 64), and the wide new sizes, from views with odd offsets.
    rows, nh, nkv, kv = 30, 8, 2, 100
    qb = rng.uniform(-1, 1, size=(rows, nh * 2, hd + 8)).astype(np.float32)
    kb = rng.uniform(-1, 1, size=(kv, nkv, 2, hd + 3)).astype(np.float16)
    vb = rng.uniform(-1, 1, size=(kv * 2, nkv, hd)).astype(np.float16)
    q, k, v = qb[:, ::2, 8:], kb[:, :, 1, 3:], vb[::2]
    out = mn.flash_attn_prefill(q, k, v, causal=True, scale=0.5)
    ref = reference_attention(np.ascontiguousarray(q), k, v, mn.causal_mask(rows, kv), scale=0.5)
    _close(out, None, ref)


@pytest.mark.parametrize("window,offset", [(None, None), (40, None), (None, -20), (30, 60)])
def test_causal_window_and_offset(amx, rng, window, offset):
    # A prompt of 70 rows in a cache of 150, 8/2 heads.
    q, k, v = _qkv(rng, 70, 150, 8, 2, 96)
    kw = dict(causal=True, window=window, offset=offset, scale=0.3)
    out, lse = mn.flash_attn_prefill(q, k, v, return_lse=True, **kw)
    ref, ref_lse = reference_prefill(q, k, v, **kw)
    _close(out, lse, ref, ref_lse)
    # Rows that see nothing (offset -20: rows 0-19) are zeros, +0.
    seen = np.isfinite(ref_lse).any(axis=0)
    assert (out[~seen].view(np.uint32) == 0).all()


def test_variable_length(amx, rng):
    q, k, v = _qkv(rng, 90, 200, 4, 2, 64, kv_dtype=BF16)
    cu_q = np.array([0, 30, 30, 31, 90], np.int32)
    cu_k = np.array([0, 30, 50, 51, 200], np.int32)
    kw = dict(causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, scale=0.25)
    out, lse = mn.flash_attn_prefill(q, k, v, return_lse=True, **kw)
    _close(out, lse, *reference_prefill(q, k, v, **kw))


# ------------------------------------------------------------------ explicit masks and the table


@pytest.mark.parametrize("hd", [256, 512])
def test_peer_mask_hits_every_tile_class_and_the_table_changes_no_bit(amx, rng, hd):
    c = make_case(rng, 70, 4, 2, hd, 300, mask="peer")
    out, blk = run_low_level(mn.Device("cpu"), c)
    assert set(np.unique(blk).tolist()) == {0, 1, 2}
    _close(out, None, reference_attention(c.q, c.k, c.v, c.mask))
    ones, _ = run_low_level(mn.Device("cpu"), c, blk_override=np.ones_like(blk))
    assert np.array_equal(out.view(np.uint32), ones.view(np.uint32))


def test_fully_masked_rows_are_zero(amx, rng):
    c = make_case(rng, 40, 4, 2, 256, 150, mask="peer")
    c.mask[[0, 7, 39]] = -np.inf
    out, _ = run_low_level(mn.Device("cpu"), c)
    assert (out[[0, 7, 39]].view(np.uint32) == 0).all()
    _close(out, None, reference_attention(c.q, c.k, c.v, c.mask))


def test_explicit_mask_with_causal_and_bf16(amx, rng):
    q, k, v = _qkv(rng, 45, 150, 4, 2, 192, kv_dtype=BF16)
    mask = rng.uniform(-1, 1, (45, 150)).astype(np.float16)
    mask[:, 64:128] = 0
    mask[3] = -np.inf
    out, lse = mn.flash_attn_prefill(q, k, v, mask, causal=True, return_lse=True, scale=0.2)
    ref, ref_lse = reference_prefill(q, k, v, mask, causal=True, scale=0.2)
    _close(out, lse, ref, ref_lse)
    assert (out[3].view(np.uint32) == 0).all()


# ------------------------------------------------------------------ SPEC 10's transforms


@pytest.mark.parametrize("nh", [6, 12])
def test_alibi_softcap_and_sinks(amx, rng, nh):
    # ALiBi's second slope sequence starts past the largest power of two below nh.
    q, k, v = _qkv(rng, 33, 80, nh, nh // 2 if nh == 6 else 3, 128)
    sinks = rng.uniform(-2, 2, nh).astype(np.float32)
    kw = dict(causal=True, scale=0.3, softcap=4.0, max_bias=8.0)
    out, lse = mn.flash_attn_prefill(q, k, v, return_lse=True, sinks=sinks, **kw)
    _close(out, lse, *reference_prefill(q, k, v, sinks=sinks, **kw))
    # ALiBi on an explicit mask: the slopes scale it.
    mask = -np.abs(np.arange(80)[None, :] - np.arange(33)[:, None] - 47).astype(np.float16)
    out, lse = mn.flash_attn_prefill(q, k, v, mask, return_lse=True, max_bias=8.0, scale=0.3)
    _close(out, lse, *reference_prefill(q, k, v, mask, max_bias=8.0, scale=0.3))


def test_sinks_on_rows_that_see_nothing(amx, rng):
    q, k, v = _qkv(rng, 20, 64, 4, 2, 64, kv_dtype=BF16)
    mask = np.zeros((20, 64), np.float16)
    mask[[2, 19]] = -np.inf
    sinks = np.array([0.5, -1.0, 2.0, 4.0], np.float32)
    out, lse = mn.flash_attn_prefill(q, k, v, mask, return_lse=True, sinks=sinks, scale=0.125)
    _close(out, lse, *reference_prefill(q, k, v, mask, sinks=sinks, scale=0.125))
    assert (out[[2, 19]].view(np.uint32) == 0).all()
    assert (lse[:, [2, 19]] == sinks[:, None]).all()


# ------------------------------------------------------------------ the splits


@pytest.mark.parametrize(
    "kv_dtype,choices,default",
    [("float16", [(1, 1), (2, 3), (3, 3), (4, 4)], (4, 4)), ("bfloat16", [(1, 1), (2, 1), (1, 2), (2, 2)], (2, 2))],
)
def test_each_split_is_within_spec_and_the_default_is_exact_enough(amx, rng, kv_dtype, choices, default):
    q, k, v = _qkv(rng, 64, 64, 4, 2, 128, kv_dtype=NP[kv_dtype])
    ref, _ = reference_prefill(q, k, v, causal=True, scale=1 / np.sqrt(128))
    assert mn.cpu_amx_products(kv_dtype) == default
    errors = {}
    try:
        for c in choices:
            mn.set_cpu_amx_products(kv_dtype, *c)
            assert mn.cpu_amx_products(kv_dtype) == c
            errors[c] = nmse(mn.flash_attn_prefill(q, k, v, causal=True), ref)
    finally:
        mn.set_cpu_amx_products(kv_dtype)
    assert mn.cpu_amx_products(kv_dtype) == default
    assert all(e < 5e-4 for e in errors.values()), errors  # SPEC 3's bar
    assert errors[default] < EXPECTED and errors[default] <= errors[(1, 1)] / 10, errors
    with pytest.raises(mn.InvalidArgumentError, match="AMX products must be 1 to"):
        mn.set_cpu_amx_products(kv_dtype, 5, 1)
    with pytest.raises(mn.InvalidArgumentError, match="give both qk and pv"):
        mn.set_cpu_amx_products(kv_dtype, 2)
    assert mn.cpu_amx_products(kv_dtype) == default


def test_bf16_q_is_read_exactly_and_beats_pytorchs_accuracy(amx, rng):
    """A bfloat16 model's call (Q, K, V bfloat16): Q read exactly (the scores scaled in
    f32), so one product of Q gives the bits of two; the default (P exact) no further from
    float64 than PyTorch's SDPA in the same dtype, lse within SPEC 8's bar; one product of P
    (rounded to bfloat16 as PyTorch rounds it) within BF16_P, lse still within the bar (it
    takes the sum before the rounding)."""
    from helpers import import_test_extra

    torch = import_test_extra("torch")
    import torch.nn.functional as F

    q, k, v = _qkv(rng, 256, 256, 8, 2, 128, kv_dtype=BF16, q_dtype=BF16)
    ref, ref_lse = reference_prefill(q, k, v, causal=True, scale=1 / np.sqrt(128))
    assert mn.cpu_amx_products("bfloat16") == (2, 2), "F32 and F16 Q keep the exact products"
    out, lse = mn.flash_attn_prefill(q, k, v, causal=True, return_lse=True)
    assert out.dtype == BF16
    ours = _close(out, lse, ref, ref_lse, bar=BARS["bfloat16"])

    def heads(x):
        return torch.from_numpy(np.ascontiguousarray(x.astype(np.float32).transpose(1, 0, 2))).to(torch.bfloat16)[None]

    with torch.inference_mode():
        o = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True, enable_gqa=True)
    theirs = nmse(o[0].transpose(0, 1).float().numpy(), ref)
    assert ours <= theirs, f"ours {ours:.3e}, PyTorch's {theirs:.3e}"
    outs = {}
    try:
        for c in [(2, 2), (1, 2), (1, 1)]:
            mn.set_cpu_amx_products("bfloat16", *c)
            outs[c] = mn.flash_attn_prefill(q, k, v, causal=True, out_dtype="float32", return_lse=True)
    finally:
        mn.set_cpu_amx_products("bfloat16")
    assert np.array_equal(outs[(2, 2)][0].view(np.uint32), outs[(1, 2)][0].view(np.uint32)), "Q has no low part"
    exact = _close(*outs[(2, 2)], ref, ref_lse)
    one = _close(*outs[(1, 1)], ref, ref_lse, bar=BF16_P)
    assert exact < one / 2, (exact, one)


def test_bf16_kv_has_no_low_part_to_multiply():
    with pytest.raises(mn.InvalidArgumentError, match="1 to 2 each with bfloat16"):
        mn.set_cpu_amx_products("bfloat16", 3, 3)
    with pytest.raises(mn.InvalidArgumentError, match="kv_dtype must be"):
        mn.cpu_amx_products("float32")


# ------------------------------------------------------------------ the hardware and the emulation


def test_the_emulated_path_is_forceable_but_never_detected():
    assert "amx-emulated" not in mn.cpu_info()["detected"]
    mn.force_cpu_isa("amx-emulated")
    try:
        assert mn.cpu_info()["isa"] == "amx-emulated"
    finally:
        mn.force_cpu_isa(None)
    if not HAS_AMX:
        with pytest.raises(mn.InvalidArgumentError, match="not available here"):
            mn.force_cpu_isa("amx")


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_the_hardware_tiles_agree_with_the_emulation(rng, kv_dtype):
    if not HAS_AMX:
        pytest.skip("this CPU has no AMX")
    q, k, v = _qkv(rng, 70, 150, 8, 2, 128, kv_dtype=NP[kv_dtype])
    outs = {}
    for isa in ("amx", "amx-emulated"):
        mn.force_cpu_isa(isa)
        try:
            outs[isa] = mn.flash_attn_prefill(q, k, v, causal=True, return_lse=True)
        finally:
            mn.force_cpu_isa(None)
    (o1, l1), (o2, l2) = outs["amx"], outs["amx-emulated"]
    # The same products in the same order: equal up to the order of the hardware's own
    # additions, if it differs from the SDM's pseudo-code (the emulation's).
    assert nmse(o1, o2) < 1e-12
    assert np.abs(l1 - l2).max() < 1e-5


def test_the_amx_peak_is_measured_where_the_tiles_are():
    if HAS_AMX:
        one, every = mn.cpu_amx_peak(1), mn.cpu_amx_peak()
        assert one > mn.cpu_fma_peak(1), "AMX-BF16 does several times the FMA units' work"
        assert every >= one * 0.5
    else:
        with pytest.raises(mn.BackendUnavailableError, match="no AMX tiles"):
            mn.cpu_amx_peak(1)
    with pytest.raises(mn.InvalidArgumentError):
        mn.cpu_amx_peak(-1)
