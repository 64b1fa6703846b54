"""The CUDA backend: its kernels compile with NVRTC everywhere (no GPU needed; CI requires
it), and where a GPU is present, CUDA arrays of PyTorch and CuPy are used in place,
larger shapes than the shared suite's match the reference on every row, and the skip
table changes no bit. (The shared suite runs on CUDA too: its `device` fixture covers
every backend `backends()` lists.)"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import numpy as np
import pytest

import mlx_native as mx
from mlx_native.reference import nmse, peer_mask, random_qkv, reference_attention, reference_prefill

from helpers import KERNEL_DIMS, import_test_extra, make_case, run_low_level

HAS_CUDA = "cuda" in mx.backends()
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="no usable CUDA GPU here")

ENTRY_POINTS = ("flash_attn_prefill_tensor_f16_d256", "flash_attn_prefill_tensor_f16_d512", "flash_attn_prefill_blk", "flash_attn_prefill_mask_blk")
#: Head dims of SPEC 10 beside 256 and 512: their kernels, F16 and BF16 K/V.
OTHER_DIMS = ("d16", "d32", "d48", "d64", "d80", "d96", "d112", "d128", "d160", "d192", "d224", "d576_512")


def test_kernels_compile_with_nvrtc_through_the_c_abi():
    # CI sets MLX_NATIVE_REQUIRE_NVRTC=1 and installs NVRTC: there a missing compiler fails.
    # (The Rust suite also compiles for sm_80 and holds each form to its register budget;
    # this is the C ABI's path to the same report, at Hopper's architecture.)
    try:
        report = mx.cuda_compile_check("sm_90a")
    except mx.BackendUnavailableError as e:
        if os.environ.get("MLX_NATIVE_REQUIRE_NVRTC") == "1":
            pytest.fail(f"NVRTC is required here and could not be loaded: {e}")
        pytest.skip(f"NVRTC not found: {e}")
    pairs = [f"flash_attn_prefill{t}_d{d}{b}_pair_{m}" for d in (256, 512) for m in ("heads", "queries")
             for t, b in (("_tensor_f16", ""), ("", "_bf16"))]
    # Head dims 64 and 128: the tiled pipeline's pair forms (mainloop_sm90_pipe.cuh).
    pairs += [f"flash_attn_prefill_d{d}{b}_pair_{m}" for d in (64, 128) for b in ("", "_bf16") for m in ("heads", "queries")]
    # Head dim 128's shape without the explicit mask's tiles (192-row tiles) lost to these and
    # is compiled only where the host launches it (attention_geometry.rs WIDE_LAUNCHED, off).
    assert "_pair_heads_wide" not in report and "_pair_queries_wide" not in report
    dims = [f"flash_attn_prefill_{d}{b}" for d in OTHER_DIMS for b in ("", "_bf16")]
    for entry in ENTRY_POINTS + tuple(pairs) + tuple(dims):
        assert f"entry point {entry}" in report, report
    # Paged K/V's entry points are a module of their own, compiled for a paged launch only
    # (MLXN_PAGED_ENTRIES; the Rust suite compiles and checks it): not in the one every call
    # loads.
    assert "_paged" not in report
    # NVRTC 13.0 (what CI installs) returns ptxas's resource report; some builds return
    # none, and then there is nothing to read spills from. The forms without the score
    # transforms spill nothing; those with them (`_xf`) a little at most.
    function = None
    for line in report.splitlines():
        if "Compiling entry function '" in line:
            function = line.split("'")[1]
        if "spill stores" in line:
            stores = int(line.split(" bytes spill stores")[0].rsplit(" ", 1)[1])
            # The Hopper form at head dim 128 runs two CTAs an SM within 128 registers and
            # spills a little there (still the faster form: mainloop_sm90.cuh, HCfg).
            allowed = function.endswith("_xf") or function in ("flash_attn_prefill_d128", "flash_attn_prefill_d128_bf16")
            # The warp-specialised pair forms at head dim 256 hold O, S and P in the
            # consumers' 240 registers and spill up to about 60 words (measured faster:
            # docs/benchmarks.md, 2026-12-01 18:05).
            ws = "d256" in function and "_pair_" in function
            # The pair forms at head dim 64: three consumer warpgroups of 160 registers leave
            # the producer warpgroup 32, where its walk spills (measured 1.20x faster than two
            # consumer warpgroups that spill nothing: docs/benchmarks.md, 2026-12-06).
            ws64 = "_d64" in function and "_pair_" in function
            # The wide d128 pair forms (192-row tiles: 96 scores and 48 words of P beside O in
            # the consumers' 240 registers, the producer's walk in 24) spill 408 / 684 bytes
            # (heads / queries) with NVRTC 13.0.
            wide = function.endswith("_wide")
            assert stores <= (768 if wide else 384 if ws64 else 256 if ws else 128 if allowed else 0), line


def test_bad_architecture_names_are_refused():
    with pytest.raises(mx.InvalidArgumentError, match="architecture"):
        mx.cuda_compile_check("sm_90a; rm")


@pytest.mark.skipif(HAS_CUDA, reason="checks the answer where no GPU is usable")
def test_cuda_arrays_need_a_cuda_device():
    assert mx.Device().backend == "cpu"
    with pytest.raises(mx.InvalidArgumentError):
        mx.Device("cpu").wait_stream(1)


# ---------------------------------------------------------------- on a GPU

def _row_nmse(out, ref):
    """NMSE of every (row, head) against the reference (rows of zeros compared plainly)."""
    out = np.asarray(out, np.float64)
    num = ((out - ref) ** 2).sum(axis=-1)
    den = (ref**2).sum(axis=-1)
    return np.where(den > 0, num / np.where(den > 0, den, 1), num)


ALIGNED, ODD = (0, 0, 0), (4, 1, 2)  # view padding: 16-byte aligned K/V rows, or odd strides

# (rows, n_heads, n_kv_heads, head_dim, kv_len, mask, window, scale, view padding)
BIG_CASES = [
    (300, 16, 2, 512, 300, "causal", None, 1.0, ALIGNED),  # global layer shape, causal skip
    (257, 16, 8, 256, 700, "causal", 128, 1.0, ALIGNED),  # sliding layer, longer cache
    (200, 8, 1, 256, 333, "peer", None, 4.0, ODD),  # GQA 8: 4 heads per CTA; big scores: rescales
    (190, 4, 4, 512, 250, "peer", None, 3.0, ALIGNED),  # d512 without sharing: 64 queries per CTA
    (131, 6, 2, 256, 129, "zero", None, 1.0, ODD),  # group 3: one head per CTA
]


@needs_gpu
@pytest.mark.parametrize("case", BIG_CASES, ids=lambda c: f"r{c[0]}-h{c[1]}/{c[2]}-d{c[3]}-kv{c[4]}-{c[5]}-pad{c[8][1]}")
def test_larger_shapes_match_on_every_row_and_skipping_changes_no_bit(rng, case):
    rows, nh, nkv, hd, kv_len, mask, window, scale, pad = case
    dev = mx.Device("cuda")
    c = make_case(rng, rows, nh, nkv, hd, kv_len, scale=scale, mask=mask, window=window, pad=pad)
    out, blk = run_low_level(dev, c)
    ref = reference_attention(c.q, c.k, c.v, c.mask, scale=scale)
    assert np.isfinite(out).all()
    worst = _row_nmse(out, ref).max()
    assert worst < 1e-5, f"worst row nmse {worst:.3e}"
    ones, _ = run_low_level(dev, c, blk_override=np.ones_like(blk))
    assert np.array_equal(out.view(np.uint32), ones.view(np.uint32))
    cpu_blk = mx.flash_attn_prefill_blk(c.mask, bq=mx.queries_per_threadgroup(hd), device=mx.Device("cpu"))
    assert np.array_equal(blk, cpu_blk)


# On Hopper, two CTAs (a cluster) receive each K/V tile once, through TMA multicast: the
# two halves of a KV head's query heads where their number is even ("heads"), else two
# neighbouring query tiles ("queries"; mx.force_cuda_pair("queries") forces it). The output
# must be the one-CTA form's bit for bit. (Until 2026-12-03 this test set MLX_NATIVE_CUDA_PAIR
# in the process, which the library had read already: it compared the pair form with itself.)
# (rows, n_heads, n_kv_heads, head_dim, kv_len, mask, window, scale)
PAIR_CASES = [
    (300, 16, 2, 512, 300, "peer", None, 1.0),  # the global layer's heads, every tile class
    (77, 8, 1, 512, 130, "causal", None, 0.7),  # one KV head, partial tiles
    (129, 32, 2, 512, 200, "peer", None, 2.0),  # groups of 16: two pairs per KV head
    (90, 8, 2, 512, 190, "causal", None, 1.0),  # groups of 4: 2 heads x 32 queries per CTA
    (100, 4, 2, 512, 150, "peer", None, 1.5),  # groups of 2: 1 head x 64 queries per CTA
    (150, 3, 1, 512, 200, "peer", None, 1.0),  # group of 3: query pairs, 3 tiles (one CTA empty)
    (257, 16, 8, 256, 700, "causal", 128, 1.0),  # sliding-layer heads, window
    (200, 8, 8, 256, 333, "peer", None, 4.0),  # no sharing: query pairs; big scores
    (300, 4, 4, 256, 300, "causal", None, 1.0),  # 3 query tiles: the last pair has an empty CTA
    (131, 16, 1, 256, 129, "zero", None, 1.0),  # groups of 16 at 256: 8 heads x 16 queries
]


@needs_gpu
@pytest.mark.parametrize("mode", ["auto", "queries"])
@pytest.mark.parametrize("case", PAIR_CASES, ids=lambda c: f"r{c[0]}-h{c[1]}/{c[2]}-d{c[3]}-kv{c[4]}-{c[5]}")
def test_cta_pair_forms_match_the_one_cta_form_bit_for_bit(rng, case, mode):
    rows, nh, nkv, hd, kv_len, mask, window, scale = case
    dev = mx.Device("cuda")
    c = make_case(rng, rows, nh, nkv, hd, kv_len, scale=scale, mask=mask, window=window, pad=ALIGNED)
    try:
        mx.force_cuda_pair("1" if mode == "auto" else mode)
        pair, blk = run_low_level(dev, c)
        worst = _row_nmse(pair, reference_attention(c.q, c.k, c.v, c.mask, scale=scale)).max()
        assert worst < 1e-5, f"worst row nmse {worst:.3e}"
        # K stored head-major ([KV head][row][dim]): other strides for the tensor map.
        k_hm = np.ascontiguousarray(c.k.transpose(1, 0, 2)).transpose(1, 0, 2)
        pair_hm, _ = run_low_level(dev, dataclasses.replace(c, k=k_hm, k_base=k_hm))
        # Every step computed (all-ones table): still the same bits.
        pair_ones, _ = run_low_level(dev, c, blk_override=np.ones_like(blk))
        mx.force_cuda_pair("0")
        single, _ = run_low_level(dev, c)
    finally:
        mx.force_cuda_pair(None)
    for got in (pair, pair_hm, pair_ones):
        assert np.array_equal(got.view(np.uint32), single.view(np.uint32))


# Head dims 64 and 128: the pair forms run the tiled pipeline (mainloop_sm90_pipe.cuh: tiles of
# 128 cache rows, two table steps each, so its running maxima move at other points than the
# one-CTA form's). They match the reference and the one-CTA form to rounding, not bit for
# bit; K's layout changes no bit of their output. The low-level tensor op (run_low_level)
# has only head dims 256 and 512, so these run through the front door, which classifies the
# explicit mask's tiles itself; the described mask runs the producer's own classes.
# (rows, n_heads, n_kv_heads, head_dim, kv_len, mask, window, scale)
TILED_PAIR_CASES = [
    (300, 32, 8, 128, 300, "peer", None, 1.0),  # the issue's heads (groups of 4): every tile class; a half tile at the end
    (77, 8, 8, 128, 130, "causal", None, 0.7),  # no sharing: query pairs; the last tile's second step past the cache
    (257, 16, 8, 64, 700, "causal", 128, 1.0),  # window: tiles whose first step the walk skips
    (200, 8, 1, 64, 333, "peer", None, 4.0),  # groups of 8: 4 heads x 32 queries a CTA; big scores: rescales
    (131, 6, 2, 128, 129, "zero", None, 1.0),  # group of 3: query pairs; a partial last step
    (300, 4, 4, 64, 300, "causal", None, 1.0),  # 3 query tiles: the last pair has an empty CTA
]
# Head dim 64's pair CTAs hold 192 (query, head) rows (three consumer warpgroups:
# WS_CONSUMERS_D64 in attention_geometry.rs). A CTA of one head spans 6 of the explicit mask
# table's 32-row tile rows, a query pair 12, more than the walk carries (4, 8): with an
# explicit mask such launches run the one-CTA form (pair_walk_fits); the described mask,
# which reads no table, still runs the pipeline.
D64_PAIR_CTA_ROWS = 192


def _runs_hopper_form(dev) -> bool:
    """Whether this GPU runs the Hopper (wgmma) form with its CTA pairs: compute capability
    9.0 and the library's NVRTC target left at sm_90a (``MLX_NATIVE_CUDA_ARCH=sm_90`` forces
    the portable form, which has no pairs)."""
    return "(sm_90," in dev.description and os.environ.get("MLX_NATIVE_CUDA_ARCH", "sm_90a") in ("", "sm_90a")


def _front_door(dev, c, k=None, **described):
    n = c.kv_len
    k = c.k if k is None else k
    mask = None if described else c.mask[:, :n]
    return mx.flash_attn_prefill(c.q, k[:n], c.v[:n], mask, scale=c.scale, device=dev, **described)


@needs_gpu
@pytest.mark.parametrize("mode", ["auto", "queries"])
@pytest.mark.parametrize("case", TILED_PAIR_CASES, ids=lambda c: f"r{c[0]}-h{c[1]}/{c[2]}-d{c[3]}-kv{c[4]}-{c[5]}")
def test_tiled_pair_forms_match_the_reference_and_the_layout_changes_no_bit(rng, case, mode):
    rows, nh, nkv, hd, kv_len, mask, window, scale = case
    dev = mx.Device("cuda")
    if not _runs_hopper_form(dev):
        pytest.skip("the tiled pipeline is the Hopper form's; this GPU, or MLX_NATIVE_CUDA_ARCH, runs the portable one")
    c = make_case(rng, rows, nh, nkv, hd, kv_len, scale=scale, mask=mask, window=window, pad=ALIGNED)
    described = dict(causal=True, window=window) if mask == "causal" else None
    try:
        mx.force_cuda_pair("1" if mode == "auto" else mode)
        pair = _front_door(dev, c)
        ref = reference_attention(c.q, c.k[:kv_len], c.v[:kv_len], c.mask[:, :kv_len], scale=scale)
        assert np.isfinite(pair).all()
        worst = _row_nmse(pair, ref).max()
        assert worst < 1e-5, f"worst row nmse {worst:.3e}"
        k_hm = np.ascontiguousarray(c.k.transpose(1, 0, 2)).transpose(1, 0, 2)
        assert np.array_equal(_front_door(dev, c, k=k_hm).view(np.uint32), pair.view(np.uint32))
        if described:
            got = _front_door(dev, c, **described)
            assert _row_nmse(got, ref).max() < 1e-5, "the described mask's classes"
        mx.force_cuda_pair("0")
        single = _front_door(dev, c)
    finally:
        mx.force_cuda_pair(None)
    if hd == 64 and nh == nkv and D64_PAIR_CTA_ROWS == 192:
        # The explicit mask ran the one-CTA form (above): the same bits; the described mask
        # ran the pipeline, checked below.
        assert np.array_equal(single.view(np.uint32), pair.view(np.uint32)), "the one-CTA form"
        assert described, "a case of this kind needs the described mask to test the pipeline"
        pair = got
    # Its first tile's maxima are over 128 cache rows, the one-CTA form's over 64: some row
    # rounds its P differently. The same bits would mean the launch fell back to the one-CTA
    # form (it does where a cluster cannot be placed), and nothing above tested the pipeline.
    assert not np.array_equal(single.view(np.uint32), pair.view(np.uint32)), "the tiled pipeline did not run"
    assert _row_nmse(pair, single).max() < 1e-5


# Issue 28 on every CUDA form: two-sided windows (FlashAttention's window_size without
# causal: p - left <= j <= p + right, -1 unbounded) and ALiBi slopes given as data
# (-slope * |p - j|), at every head dim with F16 and BF16 K/V, in the one-CTA forms ("0"),
# the CTA pairs where they fit ("1": head pairs, else query pairs; at head dims 64 and 128 the
# tiled pipeline, at 256 the warp-specialised pipeline) and query pairs ("queries"), against
# the float64 reference. Variable-length batches run the one-CTA forms whatever the setting.
# (tests/test_front_door_windows_alibi.py runs the same features on every backend;
# tests/test_cuda_split_kv.py under a split.)
ISSUE28_DIMS = KERNEL_DIMS
# (left, right): both sides, the query alone, no left side, no right side, right 0 without
# causal, left 0, wider than a 128-row tile, past every sequence (dense).
TWO_SIDED = [(5, 3), (0, 0), (-1, 2), (7, -1), (9, 0), (0, 9), (100, 37), (600, 500)]


def _bf16():
    from mlx_native.dtypes import bfloat16_dtype

    return bfloat16_dtype()


@contextlib.contextmanager
def _issue28_cases(rng, pair, b, rows, kv, nh, nkv, dk, dv):
    """Under the CTA-pair setting `pair` (restored on leaving, a failure included): random
    batched q (float32), k and v in each K/V dtype (float16, then bfloat16, drawn as the loop
    reaches them), with whether they are BF16."""

    def draws():
        for kv_dtype in (np.float16, _bf16()):
            q = rng.uniform(-1, 1, (b, rows, nh, dk)).astype(np.float32)
            k = rng.uniform(-1, 1, (b, kv, nkv, dk)).astype(kv_dtype)
            v = rng.uniform(-1, 1, (b, kv, nkv, dv)).astype(kv_dtype)
            yield q, k, v, kv_dtype != np.float16

    mx.force_cuda_pair(pair)
    try:
        yield draws()
    finally:
        mx.force_cuda_pair(None)


def _tiled_mask(rng, b, rows, kv):
    """An additive float16 mask: random values, a fifth -inf, and cache rows 64-127 all -inf
    (a column of tiles the table skips)."""
    mask = np.where(rng.random((b, rows, kv)) < 0.2, -np.inf, rng.uniform(-2, 1, (b, rows, kv)))
    mask = mask.astype(np.float16)
    mask[:, :, 64:128] = -np.inf
    return mask


def _issue28_check(out, lse, ref, ref_lse, bf16):
    """Output and lse against the reference (BF16 K/V round Q and P to bfloat16: looser
    bars), lse -inf exactly where a row sees nothing, and such a row +0.0."""
    out = np.asarray(out, np.float32)
    err = nmse(out, ref)
    assert err < (5e-5 if bf16 else 1e-5), f"NMSE {err:.2e}"
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    assert np.abs(lse[fin] - ref_lse[fin]).max(initial=0) < (2e-2 if bf16 else 2e-3)
    dead = np.isneginf(ref_lse)
    if dead.any():
        rows = np.moveaxis(out, -2, -3)[dead]
        assert np.all(rows == 0) and not np.signbit(rows).any()


@needs_gpu
@pytest.mark.parametrize("pair", ["0", "1", "queries"])
@pytest.mark.parametrize("dk,dv", ISSUE28_DIMS, ids=[f"d{a}" if a == b else f"d{a}_{b}" for a, b in ISSUE28_DIMS])
def test_two_sided_windows_on_every_form(rng, dk, dv, pair):
    dev = mx.Device("cuda")
    b, rows, kv, nh, nkv = 2, 150, 230, 8, 2
    with _issue28_cases(rng, pair, b, rows, kv, nh, nkv, dk, dv) as cases:
        for q, k, v, bf16 in cases:
            scale = 1 / np.sqrt(dk)
            for window in TWO_SIDED:
                out, lse = mx.flash_attn_prefill(q, k, v, window=window, return_lse=True, device=dev)
                ref, ref_lse = reference_prefill(q, k, v, window=window, scale=scale)
                _issue28_check(out, lse, ref, ref_lse, bf16)
            # A chunk of the prompt (an offset: row r at r + 40 of the cache), and an explicit
            # mask with its tile table beside a two-sided window.
            out, lse = mx.flash_attn_prefill(q, k, v, window=(30, 20), offset=40, return_lse=True, device=dev)
            ref, ref_lse = reference_prefill(q, k, v, window=(30, 20), offset=40, scale=scale)
            _issue28_check(out, lse, ref, ref_lse, bf16)
            mask = _tiled_mask(rng, b, rows, kv)
            mask[:, :, 128:192] = 0  # tiles of zeros (the table's 2)
            out, lse = mx.flash_attn_prefill(q, k, v, mask, window=(60, 45), return_lse=True, device=dev)
            ref, ref_lse = reference_prefill(q, k, v, mask, window=(60, 45), scale=scale)
            _issue28_check(out, lse, ref, ref_lse, bf16)
            # Variable length (the one-CTA forms): an empty sequence, a cache shorter than
            # its prompt.
            cq = np.array([0, 70, 70, 200, 300], np.int32)
            ck = np.array([0, 150, 180, 240, 460], np.int32)
            qv, kvv, vv = q.reshape(-1, nh, dk), k.reshape(-1, nkv, dk), v.reshape(-1, nkv, dv)
            for window in ((3, 80), (-1, 0), (45, -1)):
                kw = dict(window=window, cu_seqlens_q=cq, cu_seqlens_k=ck)
                out, lse = mx.flash_attn_prefill(qv, kvv, vv, return_lse=True, device=dev, **kw)
                ref, ref_lse = reference_prefill(qv, kvv, vv, scale=scale, **kw)
                _issue28_check(out, lse, ref, ref_lse, bf16)


@needs_gpu
@pytest.mark.parametrize("pair", ["0", "1", "queries"])
@pytest.mark.parametrize("dk,dv", ISSUE28_DIMS, ids=[f"d{a}" if a == b else f"d{a}_{b}" for a, b in ISSUE28_DIMS])
def test_alibi_slopes_on_every_form(rng, dk, dv, pair):
    dev = mx.Device("cuda")
    b, rows, kv, nh, nkv = 2, 130, 200, 8, 2
    with _issue28_cases(rng, pair, b, rows, kv, nh, nkv, dk, dv) as cases:
        for q, k, v, bf16 in cases:
            scale = 1 / np.sqrt(dk)
            mask = _tiled_mask(rng, b, rows, kv)
            for shape in ((nh,), (b, nh)):
                slopes = rng.uniform(0.01, 0.4, shape).astype(np.float32)
                for kw in (
                    dict(),  # dense: the bias on both sides of the query
                    dict(causal=True),
                    dict(window=(40, 25)),
                    dict(causal=True, window=50, softcap=3.0),  # after softcap
                    dict(mask=mask),  # beside an explicit mask (added unscaled)
                    dict(mask=mask, window=(70, 10)),
                ):
                    kw = dict(kw, alibi_slopes=slopes)
                    m = kw.pop("mask", None)
                    out, lse = mx.flash_attn_prefill(q, k, v, m, return_lse=True, device=dev, **kw)
                    ref, ref_lse = reference_prefill(q, k, v, m, scale=scale, **kw)
                    _issue28_check(out, lse, ref, ref_lse, bf16)
            # Variable length: each sequence its row of [batch, heads] slopes.
            cq = np.array([0, 60, 60, 260], np.int32)
            ck = np.array([0, 90, 100, 400], np.int32)
            slopes = rng.uniform(0.05, 0.5, (3, nh)).astype(np.float32)
            qv, kvv, vv = q.reshape(-1, nh, dk), k.reshape(-1, nkv, dk), v.reshape(-1, nkv, dv)
            for kw in (dict(causal=True), dict(window=(12, 30))):
                kw = dict(kw, cu_seqlens_q=cq, cu_seqlens_k=ck, alibi_slopes=slopes)
                out, lse = mx.flash_attn_prefill(qv, kvv, vv, return_lse=True, device=dev, **kw)
                ref, ref_lse = reference_prefill(qv, kvv, vv, scale=scale, **kw)
                _issue28_check(out, lse, ref, ref_lse, bf16)


@needs_gpu
@pytest.mark.parametrize("dk", [64, 128, 256])
def test_a_causal_band_written_two_sided_changes_no_bit(rng, dk):
    # window=(w - 1, 0) without causal is causal's window=w: the same sides in the launch
    # block, the same walk, the same bits, in the pair forms and the one-CTA forms alike.
    dev = mx.Device("cuda")
    q = rng.uniform(-1, 1, (2, 300, 8, dk)).astype(np.float32)
    k = rng.uniform(-1, 1, (2, 300, 2, dk)).astype(np.float16)
    v = rng.uniform(-1, 1, (2, 300, 2, dk)).astype(np.float16)
    try:
        for pair in ("0", "1"):
            mx.force_cuda_pair(pair)
            for w in (1, 70, 1000):
                a = mx.flash_attn_prefill(q, k, v, causal=True, window=w, device=dev)
                b = mx.flash_attn_prefill(q, k, v, window=(w - 1, 0), device=dev)
                assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), (pair, w)
            a = mx.flash_attn_prefill(q, k, v, causal=True, device=dev)
            b = mx.flash_attn_prefill(q, k, v, window=(-1, 0), device=dev)
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), pair
    finally:
        mx.force_cuda_pair(None)


@needs_gpu
def test_torch_in_torch_out_in_place_and_strided(rng):
    torch = import_test_extra("torch")
    rows, nh, nkv, hd, kv_len = 100, 8, 2, 256, 130  # kv_len not a multiple of 64: padded on the GPU
    q, k, v = random_qkv(rows, nh, nkv, hd, kv_len, rng)
    # A strided q: every other head of a wider tensor, used in place.
    qw = torch.zeros((rows, 2 * nh, hd), dtype=torch.float32, device="cuda")
    qw[:, ::2] = torch.from_numpy(q).cuda()
    tq, tk, tv = qw[:, ::2], torch.from_numpy(k).cuda(), torch.from_numpy(v).cuda()
    out = mx.flash_attn_prefill(tq, tk, tv, causal=True, scale=1.0)
    assert isinstance(out, torch.Tensor) and out.is_cuda and out.dtype == torch.float32
    assert tuple(out.shape) == (rows, nh, hd)
    ref = reference_attention(q, k, v, mx.causal_mask(rows, kv_len))
    assert nmse(out.cpu().numpy(), ref) < 1e-5
    host = mx.flash_attn_prefill(q, k, v, causal=True, scale=1.0, device=mx.Device("cuda"))
    assert isinstance(host, np.ndarray)
    assert np.array_equal(host, out.cpu().numpy()), "the same kernel on the same data"


@needs_gpu
def test_torch_side_stream_is_waited_for(rng):
    torch = import_test_extra("torch")
    rows, nh, hd = 256, 4, 256
    q, k, v = random_qkv(rows, nh, nh, hd, rows, rng)
    side = torch.cuda.Stream()
    tk, tv = torch.from_numpy(k).cuda(), torch.from_numpy(v).cuda()
    base = torch.from_numpy(q).cuda()
    big = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        for _ in range(20):  # keep the stream busy before q is written
            big = torch.tanh(big @ big)
        tq = base * 1.0 + big[0, 0] * 0.0  # q is written on the side stream, late
        out = mx.flash_attn_prefill(tq, tk, tv, causal=True, scale=1.0)  # on the side stream, after q
    torch.cuda.synchronize()
    ref = reference_attention(q, k, v, mx.causal_mask(rows, rows))
    assert nmse(out.cpu().numpy(), ref) < 1e-5


@needs_gpu
def test_device_buffer_wraps_torch_memory_in_place():
    torch = import_test_extra("torch")
    dev = mx.Device("cuda")
    t = torch.arange(64, dtype=torch.float32, device="cuda")
    b = dev.buffer(t)
    assert b.shape == (64,) and b.dtype == np.float32
    t[5] = -1.0
    torch.cuda.synchronize()
    assert b.numpy()[5] == -1.0, "the buffer is the tensor's memory"
    c = dev.buffer(t, copy=True)
    t[6] = -2.0
    torch.cuda.synchronize()
    assert c.numpy()[6] == 6.0
    with pytest.raises(mx.InvalidArgumentError, match="non-contiguous"):
        dev.buffer(t[::2])


@needs_gpu
def test_wrapping_memory_that_is_not_this_devices_is_refused():
    torch = import_test_extra("torch")
    from mlx_native._lib import ffi, lib

    dev = mx.Device("cuda")
    t = torch.zeros(16, dtype=torch.float32, device="cuda")
    out = ffi.new("uint64_t *")
    dims = ffi.new("uint64_t[]", [16])
    host = np.zeros(16, np.float32)
    for addr, n in ((host.ctypes.data, 64), (t.data_ptr() + (1 << 44), 64), (t.data_ptr(), 1 << 40)):
        status = lib.mlxn_buffer_wrap_device(dev.handle, addr, n, 0, dims, 1, out)
        assert status == mx.InvalidArgumentError.code, ffi.string(lib.mlxn_last_error())


@needs_gpu
def test_cupy_in_cupy_out(rng):
    cupy = pytest.importorskip("cupy")
    q, k, v = random_qkv(70, 4, 2, 512, 70, rng)
    m = peer_mask(70, 70, rng)
    out = mx.flash_attn_prefill(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), m, scale=1.0)
    assert isinstance(out, cupy.ndarray) and out.dtype == np.float32
    assert nmse(out.get(), reference_attention(q, k, v, m)) < 1e-5


@needs_gpu
def test_two_wrappers_of_one_tensor_overlap():
    torch = import_test_extra("torch")
    dev = mx.Device("cuda")
    n = 40 * 4 * 256
    t = torch.zeros(2 * n, dtype=torch.float32, device="cuda")
    q, out = dev.buffer(t[:n]), dev.buffer(t[1024 : 1024 + n])
    k = dev.empty(128 * 512, np.float16)
    mask = dev.empty((40, 128), np.float16)
    blk = dev.empty((2, 2), np.uint8)
    p = mx.FlashAttnPrefillTensorParams(40, 4, 2, 256, 128, 1024, 256, 512, 256, 512, 256)
    with pytest.raises(mx.InvalidArgumentError, match="out overlaps q"):
        with dev.encoder() as enc:
            mx.dispatch_flash_attn_prefill_tensor_f16(enc, q, k, k, mask, blk, out, p)
