"""Issue 28's kernel features against the float64 reference on every backend present (the
CPU, CUDA and Metal kernels all compute them): two-sided windows (FlashAttention's
``window_size=(left, right)``, causal or not), ALiBi slopes given as data (``alibi_slopes``
``[H]`` or ``[B, H]``: ``-slope * |p - j|``) and float32 K/V (read natively by the CPU;
converted to float16 on the device elsewhere, so the reference there takes the half-rounded
K/V). Fixed and variable length, GQA, partial tiles, explicit masks with their tile tables
beside the description, offsets (chunked prefill), rows that see nothing (+0.0 and lse
-inf), lse; and the mistakes, each a typed error. (tests/test_cuda.py runs the CUDA forms
one by one at every head dim; tests/test_cuda_split_kv.py under a split.)"""

from __future__ import annotations

import numpy as np
import pytest

import mlx_native as mn
from mlx_native.reference import nmse, reference_prefill, visible_mask

BAR = 1e-5
LSE_TOL = 2e-3  # SPEC 8


def _qkv(rng, q_shape, kv_shape, kv_dtype=np.float16, dv=None):
    q = rng.uniform(-1, 1, q_shape).astype(np.float32)
    k = rng.uniform(-1, 1, kv_shape).astype(kv_dtype)
    v_shape = kv_shape if dv is None else kv_shape[:-1] + (dv,)
    v = rng.uniform(-1, 1, v_shape).astype(kv_dtype)
    return q, k, v


def _check(out, lse, ref, ref_lse):
    err = nmse(out, ref)
    assert err < BAR, f"NMSE {err:.2e}"
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)), "lse is -inf exactly where a row sees nothing"
    fin = np.isfinite(ref_lse)
    assert np.abs(lse[fin] - ref_lse[fin]).max(initial=0) < LSE_TOL
    # A row that sees nothing is +0.0 (not -0.0, not NaN).
    dead = np.isneginf(ref_lse)
    if dead.any():
        rows = np.moveaxis(out, -2, -3)[dead]  # [.., H, rows, D] -> the dead (head, row) pairs
        assert np.all(rows == 0) and not np.signbit(rows).any()


WINDOWS = [
    ((5, 3), False),  # two-sided, both bounded
    ((0, 0), False),  # only the query's own position
    ((-1, 2), False),  # unbounded left, a few rows to the right
    ((7, -1), False),  # unbounded right
    ((40, 70), False),  # wider than a tile on both sides
    ((0, 6), False),  # no left side: the query's own position and 6 to its right
    ((9, 0), False),  # right side 0 without causal (causal's band, cache shorter than the prompt too)
    ((2, 400), False),  # a right side past every cache
    ((500, 300), False),  # both sides past the sequence: dense
    ((-1, -1), False),  # no window at all (dense)
    ((3, 9), True),  # causal caps the right side at 0
    ((-1, 5), True),  # plain causal
    ((0, -1), True),  # causal, the diagonal alone
    (20, True),  # the int shorthand: (19, 0) causal
]


@pytest.mark.parametrize("window,causal", WINDOWS, ids=[f"{w}-{'c' if c else 'nc'}" for w, c in WINDOWS])
@pytest.mark.parametrize(
    "b,rows,kv,nh,nkv,hd",
    [
        (None, 70, 130, 4, 2, 64),  # partial tiles, GQA 2, a longer cache
        (2, 45, 45, 4, 1, 128),  # batched, GQA 4, a fresh prefill
        (None, 100, 60, 2, 2, 256),  # a cache shorter than the prompt (not causal only)
    ],
)
def test_windows_match_the_reference(device, rng, window, causal, b, rows, kv, nh, nkv, hd):
    if causal and kv < rows:
        pytest.skip("causal needs the cache at least as long as the prompt")
    lead = () if b is None else (b,)
    q, k, v = _qkv(rng, lead + (rows, nh, hd), lead + (kv, nkv, hd))
    out, lse = mn.flash_attn_prefill(q, k, v, causal=causal, window=window, return_lse=True, device=device)
    ref, ref_lse = reference_prefill(q, k, v, causal=causal, window=window, scale=1 / np.sqrt(hd))
    _check(out, lse, ref, ref_lse)


def test_the_reference_window_is_flash_attentions(rng):
    # p - left <= j <= p + right with p = r + lk - lq (bottom-right aligned), -1 unbounded.
    lq, lk = 5, 9
    seen = visible_mask(lq, lk, False, (2, 1))
    for r in range(lq):
        p = r + lk - lq
        assert list(np.flatnonzero(seen[r])) == [j for j in range(lk) if p - 2 <= j <= p + 1]
    assert np.array_equal(visible_mask(lq, lk, True, 3), visible_mask(lq, lk, False, (2, 0)))
    assert np.array_equal(visible_mask(lq, lk, True, (2, 7)), visible_mask(lq, lk, False, (2, 0)))
    assert visible_mask(lq, lk, False, (-1, -1)).all()


@pytest.mark.parametrize("window", [(3, 2), (-1, 0), (10, -1)])
def test_windows_with_variable_length(device, rng, window):
    cq = np.array([0, 17, 17, 90, 130], np.int32)  # an empty sequence, a cache shorter than its prompt
    ck = np.array([0, 40, 52, 60, 200], np.int32)
    q, k, v = _qkv(rng, (130, 4, 64), (200, 2, 64))
    out, lse = mn.flash_attn_prefill(
        q, k, v, window=window, cu_seqlens_q=cq, cu_seqlens_k=ck, return_lse=True, device=device
    )
    ref, ref_lse = reference_prefill(q, k, v, window=window, cu_seqlens_q=cq, cu_seqlens_k=ck, scale=1 / 8)
    _check(out, lse, ref, ref_lse)


def test_a_window_equal_to_the_causal_shorthand_changes_no_bit(device, rng):
    q, k, v = _qkv(rng, (70, 4, 128), (130, 2, 128))
    a = mn.flash_attn_prefill(q, k, v, causal=True, window=16, device=device)
    b = mn.flash_attn_prefill(q, k, v, causal=True, window=(15, 4), device=device)
    c = mn.flash_attn_prefill(q, k, v, window=(15, 0), device=device)
    assert np.array_equal(a, b) and np.array_equal(a, c)


def test_an_offset_places_a_two_sided_window(device, rng):
    q, k, v = _qkv(rng, (40, 2, 64), (150, 1, 64))
    out, lse = mn.flash_attn_prefill(q, k, v, window=(6, 9), offset=-10, return_lse=True, device=device)
    ref, ref_lse = reference_prefill(q, k, v, window=(6, 9), offset=-10, scale=1 / 8)
    _check(out, lse, ref, ref_lse)
    assert np.isneginf(lse).any(), "the first rows see nothing"


@pytest.mark.parametrize("window", [(20, 15), (0, 40), (64, 0), (-1, 3)])
def test_a_chunk_of_the_prompt_with_a_two_sided_window(device, rng, window):
    # Chunked prefill: 48 query rows placed at 130 of a cache of 300 (both sides inside it),
    # at 290 (the right side reaches past the cache's end) and at -20 (the first rows see
    # nothing on the left).
    q, k, v = _qkv(rng, (48, 4, 128), (300, 2, 128))
    for offset in (130, 290, -20):
        out, lse = mn.flash_attn_prefill(q, k, v, window=window, offset=offset, return_lse=True, device=device)
        ref, ref_lse = reference_prefill(q, k, v, window=window, offset=offset, scale=128**-0.5)
        _check(out, lse, ref, ref_lse)


def _explicit_mask(rng, b, rows, kv):
    """An additive float16 mask that varies row by row, with whole 64-column tiles at -inf
    (skipped by the table), tiles of zeros (the table's 2) and a row that sees nothing."""
    m = np.where(rng.random((b, rows, kv)) < 0.15, -np.inf, rng.uniform(-2, 1, (b, rows, kv))).astype(np.float16)
    m[:, :, 64:128] = -np.inf
    m[:, :, 192:256] = 0
    m[:, 3] = -np.inf
    return m


@pytest.mark.parametrize("window,causal", [((5, 3), False), ((0, 0), False), ((30, -1), False), ((-1, 70), False),
                                           ((100, 9), True)])  # fmt: skip
@pytest.mark.parametrize("hd", [64, 256])
def test_two_sided_windows_with_an_explicit_mask(device, rng, window, causal, hd):
    # The described mask's band and the explicit mask's tile table together: a tile is
    # computed where both let it, the mask added on the band's pairs only.
    b, rows, kv = 2, 90, 300
    q, k, v = _qkv(rng, (b, rows, 4, hd), (b, kv, 2, hd))
    mask = _explicit_mask(rng, b, rows, kv)
    kw = dict(causal=causal, window=window)
    out, lse = mn.flash_attn_prefill(q, k, v, mask, return_lse=True, device=device, **kw)
    ref, ref_lse = reference_prefill(q, k, v, mask, scale=1 / np.sqrt(hd), **kw)
    _check(out, lse, ref, ref_lse)


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (20, 7)), (True, 64)])
def test_alibi_slopes_with_an_explicit_mask(device, rng, causal, window):
    # Given slopes beside an explicit mask: the mask added unscaled, -slope * |p - j| as well.
    b, rows, kv, nh = 2, 70, 260, 4
    q, k, v = _qkv(rng, (b, rows, nh, 64), (b, kv, 2, 64))
    mask = _explicit_mask(rng, b, rows, kv)
    slopes = rng.uniform(0.01, 0.3, (b, nh)).astype(np.float32)
    kw = dict(causal=causal, window=window, alibi_slopes=slopes)
    out, lse = mn.flash_attn_prefill(q, k, v, mask, return_lse=True, device=device, **kw)
    ref, ref_lse = reference_prefill(q, k, v, mask, scale=1 / 8, **kw)
    _check(out, lse, ref, ref_lse)


def test_the_plan_counts_two_sided_pairs(rng):
    q, k, v = _qkv(rng, (70, 2, 64), (130, 1, 64))
    for window in [(5, 3), (-1, 2), (7, -1), (0, 0)]:
        plan = mn.PrefillPlan(q, k, v, window=window)
        assert plan.visible_pairs == int(visible_mask(70, 130, False, window).sum()), window


@pytest.mark.parametrize("shape", ["h", "bh"])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (9, 4)), (True, 12)])
def test_alibi_slopes_match_the_reference(device, rng, shape, causal, window):
    b, nh = 2, 4
    q, k, v = _qkv(rng, (b, 50, nh, 64), (b, 90, 2, 64))
    slopes = rng.uniform(0.01, 0.5, (nh,) if shape == "h" else (b, nh)).astype(np.float32)
    out, lse = mn.flash_attn_prefill(
        q, k, v, causal=causal, window=window, alibi_slopes=slopes, return_lse=True, device=device
    )
    ref, ref_lse = reference_prefill(q, k, v, causal=causal, window=window, alibi_slopes=slopes, scale=1 / 8)
    _check(out, lse, ref, ref_lse)
    plain, _ = reference_prefill(q, k, v, causal=causal, window=window, scale=1 / 8)
    assert nmse(plain, ref) > 1e-3, "the slopes change the result (a test of the test)"


def test_alibi_slopes_with_variable_length_take_each_sequences_row(device, rng):
    cq = np.array([0, 30, 30, 75], np.int32)
    ck = np.array([0, 50, 60, 140], np.int32)
    q, k, v = _qkv(rng, (75, 4, 64), (140, 4, 64))
    slopes = rng.uniform(0.05, 1.0, (3, 4)).astype(np.float32)
    out, lse = mn.flash_attn_prefill(
        q, k, v, causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck, alibi_slopes=slopes, return_lse=True, device=device
    )
    ref, ref_lse = reference_prefill(
        q, k, v, causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck, alibi_slopes=slopes, scale=1 / 8
    )
    _check(out, lse, ref, ref_lse)


def test_alibi_slopes_with_causal_equal_max_bias_s_on_the_description(device, rng):
    # max_bias without a mask adds slope * (j - p) on a causal description: the same as
    # alibi_slopes = those slopes (-slope * |p - j| with j <= p), bit for bit.
    from mlx_native.reference import alibi_slopes

    q, k, v = _qkv(rng, (40, 8, 64), (100, 2, 64))
    slopes = alibi_slopes(8, 8.0).astype(np.float32)
    a = mn.flash_attn_prefill(q, k, v, causal=True, max_bias=8.0, device=device)
    b = mn.flash_attn_prefill(q, k, v, causal=True, alibi_slopes=slopes, device=device)
    assert np.array_equal(a, b)


@pytest.mark.parametrize("hd,dv", [(64, 64), (128, 128), (256, 256), (576, 512)])
@pytest.mark.parametrize("causal", [False, True])
def test_float32_kv_match_the_reference(device, rng, hd, dv, causal):
    q, k, v = _qkv(rng, (37, 4, hd), (80, 2, hd), kv_dtype=np.float32, dv=dv)
    out, lse = mn.flash_attn_prefill(q, k, v, causal=causal, return_lse=True, device=device)
    if device.backend == "cpu":
        kr, vr = k, v  # read as they are
    else:
        kr, vr = k.astype(np.float16), v.astype(np.float16)  # converted to half first
    ref, ref_lse = reference_prefill(q, kr, vr, causal=causal, scale=1 / np.sqrt(hd))
    _check(out, lse, ref, ref_lse)


def test_float32_kv_on_the_cpu_are_read_unrounded(rng):
    # Values half cannot hold: the CPU result follows the float32 K/V, not their half rounding.
    q, k, v = _qkv(rng, (20, 2, 64), (64, 1, 64), kv_dtype=np.float32)
    k, v = k * np.float32(1 + 2**-13), v + np.float32(2**-14)
    out = mn.flash_attn_prefill(q, k, v, device="cpu")
    exact, _ = reference_prefill(q, k, v, scale=1 / 8)
    assert nmse(out, exact) < BAR
    halved = mn.flash_attn_prefill(q, k.astype(np.float16), v.astype(np.float16), device="cpu")
    assert not np.array_equal(out, halved), "float32 K/V are not rounded to half first"
    # V's low bits reach the output: a shift of every V value by 2^-12 (below half's spacing
    # of 2^-11 above 0.5 only in part) moves every output by exactly that much.
    shifted = mn.flash_attn_prefill(q, k, v + np.float32(2**-12), device="cpu")
    assert np.abs((shifted - out) - 2**-12).max() < 2**-16


def test_float32_kv_with_windows_slopes_and_varlen(device, rng):
    cq = np.array([0, 20, 64], np.int32)
    ck = np.array([0, 70, 100], np.int32)
    q, k, v = _qkv(rng, (64, 4, 128), (100, 2, 128), kv_dtype=np.float32)
    slopes = rng.uniform(0.0, 0.3, (4,)).astype(np.float32)
    kw = dict(window=(8, 3), cu_seqlens_q=cq, cu_seqlens_k=ck, alibi_slopes=slopes)
    out, lse = mn.flash_attn_prefill(q, k, v, return_lse=True, device=device, **kw)
    kr, vr = (k, v) if device.backend == "cpu" else (k.astype(np.float16), v.astype(np.float16))
    ref, ref_lse = reference_prefill(q, kr, vr, scale=128**-0.5, **kw)
    _check(out, lse, ref, ref_lse)


def test_torch_tensors_take_windows_slopes_and_float32_kv(rng):
    torch = pytest.importorskip("torch")
    q, k, v = _qkv(rng, (2, 30, 4, 64), (2, 50, 2, 64), kv_dtype=np.float32)
    slopes = rng.uniform(0.0, 0.3, (2, 4)).astype(np.float32)
    tq, tk, tv, ts = (torch.from_numpy(x) for x in (q, k, v, slopes))
    out, lse = mn.flash_attn_prefill(tq, tk, tv, window=(4, 6), alibi_slopes=ts, return_lse=True)
    ref, ref_lse = reference_prefill(q, k, v, window=(4, 6), alibi_slopes=slopes, scale=1 / 8)
    _check(out.numpy(), lse.numpy(), ref, ref_lse)
    # The operator traces: its fake implementation takes the new arguments too.
    f = torch.compile(lambda a, b, c, s: mn.flash_attn_prefill(a, b, c, window=(4, 6), alibi_slopes=s), fullgraph=True)
    assert torch.equal(f(tq, tk, tv, ts), out)


def _raises(cls, builtin, match, fn, *args, **kw):
    with pytest.raises(cls, match=match) as e:
        fn(*args, **kw)
    assert isinstance(e.value, builtin)


@pytest.mark.parametrize("entry", [mn.flash_attn_prefill, mn.PrefillPlan])
def test_window_and_slope_mistakes(rng, entry):
    q, k, v = _qkv(rng, (2, 20, 4, 64), (2, 30, 2, 64))
    bad = mn.InvalidArgumentError
    _raises(bad, ValueError, "at least 1", entry, q, k, v, window=0)
    _raises(bad, ValueError, "left side must be >= -1", entry, q, k, v, window=(-2, 3))
    _raises(bad, ValueError, "right side must be >= -1", entry, q, k, v, window=(3, -5))
    _raises(bad, ValueError, "\\(left, right\\)", entry, q, k, v, window=(1, 2, 3))
    _raises(mn.ArgumentTypeError, TypeError, "left side must be an integer", entry, q, k, v, window=(1.5, 2))
    _raises(mn.ArgumentTypeError, TypeError, "right side must be an integer", entry, q, k, v, window=(1, "2"))
    s = np.full((4,), 0.1, np.float32)
    _raises(bad, ValueError, "pass one", entry, q, k, v, causal=True, max_bias=8.0, alibi_slopes=s)
    _raises(mn.UnsupportedDtypeError, TypeError, "alibi_slopes must be float32", entry, q, k, v,
            alibi_slopes=s.astype(np.float64))  # fmt: skip
    _raises(bad, ValueError, "alibi_slopes must have shape \\(4,\\) or \\(2, 4\\)", entry, q, k, v,
            alibi_slopes=np.zeros((3, 4), np.float32))  # fmt: skip
    _raises(bad, ValueError, "alibi_slopes must have shape", entry, q, k, v, alibi_slopes=np.zeros((8,), np.float32))
    _raises(bad, ValueError, "NaN or an infinity", entry, q, k, v, alibi_slopes=np.array([0.1, np.nan, 0, 0], np.float32))
    _raises(bad, ValueError, "NaN or an infinity", entry, q, k, v, alibi_slopes=np.array([0.1, np.inf, 0, 0], np.float32))
    _raises(mn.UnsupportedDtypeError, TypeError, "float16, bfloat16 or float32", entry, q, k.astype(np.float64),
            v.astype(np.float64))  # fmt: skip


def test_a_plan_with_slopes_needs_them_at_each_run(rng):
    q, k, v = _qkv(rng, (20, 4, 64), (30, 2, 64))
    s = np.full((4,), 0.1, np.float32)
    plan = mn.PrefillPlan(q, k, v, causal=True, alibi_slopes=s)
    with pytest.raises(mn.InvalidArgumentError, match="pass alibi_slopes"):
        plan.run(q, k, v)
    with pytest.raises(mn.InvalidArgumentError, match="was made for"):
        plan.run(q, k, v, alibi_slopes=np.full((1, 4), 0.1, np.float32))
    a = plan.run(q, k, v, alibi_slopes=s)
    b = plan.run(q, k, v, alibi_slopes=s * 2)
    assert not np.array_equal(a, b), "each run reads its own slopes"
    with pytest.raises(mn.InvalidArgumentError, match="no ALiBi slopes"):
        mn.PrefillPlan(q, k, v, causal=True).run(q, k, v, alibi_slopes=s)
