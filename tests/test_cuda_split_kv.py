"""Split-KV on CUDA: a few query rows against a long cache leave most of the GPU idle, so the
kernel cuts each CTA's walk over the cache into parts that run side by side, and a second
kernel merges them (SPEC 8, sinks included). Each part is checked against the float64
reference on every feature: head dims, GQA, causal, windows (two-sided too), offset,
explicit masks that vary row by row (fully masked rows: +0 bit for bit), batches, variable
length, lse, sinks, softcap, ALiBi (max_bias and given slopes), output dtypes, bfloat16
K/V, and the bit identity of a computed and an all-ones tile table.
``test_every_case_with_the_split_forced`` runs this file again with every prefill split into
2, 4 and 16 parts (``MLX_NATIVE_CUDA_KV_SPLITS``), empty parts included. On a machine
without a CUDA GPU the tests are skipped (CI), and the Rust suite checks the split's plan
(``kv_split``'s unit tests)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import mlx_native as mn
from mlx_native.dtypes import bfloat16_dtype
from mlx_native.reference import nmse, reference_prefill

from helpers import import_test_extra, planned_run, random_qkv_dims as _qkv

HAS_CUDA = "cuda" in mn.backends()
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="no usable CUDA GPU here")
FORCED = os.environ.get("MLX_NATIVE_CUDA_KV_SPLITS")
BF16 = bfloat16_dtype()


def _run(q, k, v, mask=None, **kw):
    """The call on CUDA through a plan (host arrays: uploaded, run, downloaded): the output,
    lse and the plan (its workspace says whether it split)."""
    plan = mn.PrefillPlan(q, k, v, mask, device="cuda", return_lse=True, **{k_: v_ for k_, v_ in kw.items() if k_ != "sinks"},
                          sinks=kw.get("sinks"))  # fmt: skip
    out, lse = plan.run(q, k, v, mask, sinks=kw.get("sinks"))
    return np.asarray(out, dtype=np.float32), np.asarray(lse), plan


def _check(out, lse, ref, ref_lse, bar=1e-5, lse_bar=2e-3):
    assert np.isfinite(out).all()
    assert nmse(out, ref) < bar
    seen = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), seen)
    assert np.abs(lse[seen] - ref_lse[seen]).max() < lse_bar


def _splits(plan):
    if FORCED is None or int(FORCED) >= 2:
        assert plan.workspace_bytes > 0, "this shape should split"


@needs_gpu
@pytest.mark.parametrize("dk,dv", [(64, 64), (80, 80), (128, 128), (256, 256), (512, 512), (576, 512)])
def test_a_chunk_against_a_long_cache_splits_and_matches(rng, dk, dv):
    # BF16 K/V round P to bfloat16 (8 bits): over 4096 cache rows that alone gives about
    # 1e-5; the split must not add to it (a bar on the split against the whole walk).
    # With BF16 K/V the products take Q and P in bfloat16 (8 significant bits: 2^-8
    # relative), so the scores of these long rows move by several 1e-3 and lse with them,
    # split or whole alike: the bars are the whole walk's error plus a little.
    # A part's row sum rounds its own P: lse may move by up to the unit roundoff of P's
    # type either way (half 2^-11, bfloat16 2^-8) against the whole walk's.
    for kv_dtype, bar, lse_bar, u in ((np.float16, 1e-5, 2e-3, 2.0**-11), (BF16, 5e-5, 1e-2, 2.0**-8)):
        q, k, v = _qkv(rng, 40, 4096, 4, 2, dk, dv, kv_dtype)
        out, lse, plan = _run(q, k, v, causal=True, scale=0.3)
        _splits(plan)
        ref, ref_lse = reference_prefill(q, k, v, causal=True, scale=0.3)
        _check(out, lse, ref, ref_lse, bar, lse_bar)
        plan = mn.PrefillPlan(q, k, v, device="cuda", causal=True, scale=0.3, return_lse=True)
        (split, split_lse), (whole, whole_lse) = planned_run(plan), planned_run(plan, split=False)
        errors = [nmse(split, ref), nmse(whole, ref), np.abs(split_lse - ref_lse).max(), np.abs(whole_lse - ref_lse).max()]
        assert errors[0] <= 1.5 * errors[1] + 1e-8, errors
        assert errors[2] <= errors[3] + max(1e-3, u), errors


@needs_gpu
@pytest.mark.parametrize("nh,nkv", [(1, 1), (3, 1), (8, 8), (16, 2), (16, 1), (6, 3)])
def test_gqa_groups_under_a_split(rng, nh, nkv):
    q, k, v = _qkv(rng, 33, 2500, nh, nkv, 256, 256)
    out, lse, plan = _run(q, k, v, causal=True, scale=0.2)
    _splits(plan)
    _check(out, lse, *reference_prefill(q, k, v, causal=True, scale=0.2))


@needs_gpu
@pytest.mark.parametrize("dim", [128, 256])
def test_windows_offsets_and_score_transforms_under_a_split(rng, dim):
    # Walks of at least 32 steps (2048 cache rows), so that each splits by itself.
    q, k, v = _qkv(rng, 70, 5000, 8, 2, dim, dim)
    sinks = rng.uniform(-2, 2, 8).astype(np.float32)
    for kw in (
        dict(window=2600),
        dict(window=2600, offset=2200),  # the chunk in the middle of the cache
        dict(causal=True, offset=3000, softcap=4.0, max_bias=5.0, sinks=sinks),
        dict(causal=True, softcap=4.0, max_bias=5.0, sinks=sinks),
        dict(window=3000, sinks=sinks, max_bias=2.0),
    ):
        kw = dict(scale=0.25, **kw)
        out, lse, plan = _run(q, k, v, **kw)
        _splits(plan)
        ref, ref_lse = reference_prefill(q, k, v, causal=True, **{a: b for a, b in kw.items() if a != "causal"})
        _check(out, lse, ref, ref_lse)


@needs_gpu
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_two_sided_windows_and_alibi_slopes_under_a_split(rng, dim):
    # Issue 28: FlashAttention's window_size without causal, and ALiBi slopes given as data,
    # over walks of at least 32 steps (each splits by itself).
    q, k, v = _qkv(rng, 70, 5000, 8, 2, dim, dim)
    slopes = rng.uniform(0.001, 0.02, 8).astype(np.float32)
    for kw in (
        dict(window=(2500, 1000), offset=2200),  # both sides inside the cache
        dict(window=(-1, 600), offset=2000),  # no left side: from the cache's start
        dict(window=(3000, -1)),  # no right side
        dict(window=(2600, 0)),  # right side 0 without causal
        dict(causal=True, alibi_slopes=slopes),
        dict(window=(2000, 900), offset=1500, alibi_slopes=slopes),
    ):
        kw = dict(scale=0.25, **kw)
        plan = mn.PrefillPlan(q, k, v, device="cuda", return_lse=True, **kw)
        _splits(plan)
        out, lse = plan.run(q, k, v, alibi_slopes=kw.get("alibi_slopes"))
        _check(np.asarray(out, np.float32), np.asarray(lse), *reference_prefill(q, k, v, **kw))


@needs_gpu
def test_explicit_masks_that_vary_row_by_row_under_a_split(rng):
    rows, kv = 48, 3000
    q, k, v = _qkv(rng, rows, kv, 8, 2, 256, 256)
    mask = np.where(rng.random((rows, kv)) < 0.2, -np.inf, 0).astype(np.float16)
    mask[:, 1000:1900] = rng.uniform(-3, 1, (rows, 900)).astype(np.float16)
    mask[[5, 31]] = -np.inf  # fully masked rows
    mask[7, : kv - 1] = -np.inf  # a row decided by its last column alone
    mask[9, :] = np.float16(-0.0)
    out, lse, plan = _run(q, k, v, mask, scale=0.5)
    _splits(plan)
    ref, ref_lse = reference_prefill(q, k, v, mask, scale=0.5)
    _check(out, lse, ref, ref_lse)
    assert (out[[5, 31]].view(np.uint32) == 0).all(), "rows that see nothing are +0 bit for bit"
    assert np.isneginf(lse[:, [5, 31]]).all()
    # With sinks such a row's lse is its head's sink, and its output still +0.
    sinks = rng.uniform(-2, 2, 8).astype(np.float32)
    out, lse, _ = _run(q, k, v, mask, scale=0.5, sinks=sinks, softcap=2.0)
    _check(out, lse, *reference_prefill(q, k, v, mask, scale=0.5, sinks=sinks, softcap=2.0))
    assert (out[[5, 31]].view(np.uint32) == 0).all()
    assert (lse[:, [5, 31]] == sinks[:, None]).all()


@needs_gpu
def test_a_computed_table_and_an_all_ones_table_give_the_same_bits_under_a_split(rng):
    rows, kv = 40, 2600
    q, k, v = _qkv(rng, rows, kv, 4, 2, 256, 256)
    mask = np.zeros((rows, kv), np.float16)
    mask[:, :640] = -np.inf  # whole tiles skipped
    mask[:, 1280:1300] = -1.5  # partly masked tiles
    mask[11] = -np.inf
    plan = mn.PrefillPlan(q, k, v, mask, device="cuda", scale=0.7)
    _splits(plan)
    b = plan._buffers
    with plan.device.encoder() as enc:
        plan._record(enc, b, True)
    computed = b["out"].numpy().copy()
    assert (b["blk"].numpy() != 1).any(), "the table skips some tiles"
    b["blk"].write(np.ones(b["blk"].numpy().shape, np.uint8))
    with plan.device.encoder() as enc:
        plan._record(enc, b, False)
    assert np.array_equal(computed.view(np.uint32), b["out"].numpy().view(np.uint32))
    ref, _ = reference_prefill(q, k, v, mask, scale=0.7)
    assert nmse(computed.reshape(ref.shape), ref) < 1e-5


@needs_gpu
def test_batches_variable_length_and_output_dtypes_under_a_split(rng):
    q, k, v = _qkv(rng, 24, 2200, 4, 1, 128, 128, batch=3)
    for out_dtype in (np.float16, BF16, np.float32):
        plan = mn.PrefillPlan(q, k, v, device="cuda", causal=True, out_dtype=out_dtype, return_lse=True)
        _splits(plan)
        out, lse = plan.run(q, k, v)
        assert out.dtype == np.dtype(out_dtype)
        ref, ref_lse = reference_prefill(q, k, v, causal=True, scale=1 / np.sqrt(128))
        assert nmse(np.asarray(out, np.float32), ref) < (1e-5 if out_dtype == np.float32 else 2e-5)
        assert np.abs(lse - ref_lse).max() < 2e-3
    # Variable length: sequences of 10, 0 and 30 rows against caches of 3000, 40 and 4000.
    cu_q, cu_k = np.array([0, 10, 10, 40], np.int32), np.array([0, 3000, 3040, 7040], np.int32)
    q, k, v = _qkv(rng, 40, 7040, 8, 2, 256, 256)
    sinks = rng.uniform(-1, 1, 8).astype(np.float32)
    kw = dict(causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, sinks=sinks, scale=0.3)
    out, lse, plan = _run(q, k, v, **kw)
    _splits(plan)
    _check(out, lse, *reference_prefill(q, k, v, **kw))


@needs_gpu
def test_torch_tensors_split_in_place_on_the_callers_stream(rng):
    torch = import_test_extra("torch")
    q, k, v = _qkv(rng, 64, 4096, 8, 8, 256, 256)
    tq, tk, tv = (torch.from_numpy(x).cuda() for x in (q, k, v))
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        out, lse = mn.flash_attn_prefill(tq, tk, tv, causal=True, return_lse=True)
        plan = mn.PrefillPlan(tq, tk, tv, causal=True)
        out2 = plan.run(tq, tk, tv)
    s.synchronize()
    _splits(plan)
    ref, ref_lse = reference_prefill(q, k, v, causal=True, scale=1 / 16)
    _check(out.cpu().numpy(), lse.cpu().numpy(), ref, ref_lse)
    assert torch.equal(out, out2)


@needs_gpu
def test_a_split_run_is_captured_in_a_cuda_graph(rng):
    torch = import_test_extra("torch")
    q, k, v = _qkv(rng, 32, 3000, 4, 4, 128, 128)
    tq, tk, tv = (torch.from_numpy(x).cuda() for x in (q, k, v))
    plan = mn.PrefillPlan(tq, tk, tv, causal=True)
    _splits(plan)
    out = torch.empty(plan.shape, dtype=torch.float32, device="cuda")
    plan.run(tq, tk, tv, out=out)  # warm up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        plan.run(tq, tk, tv, out=out)
    q2 = rng.uniform(-1, 1, q.shape).astype(np.float32)
    tq.copy_(torch.from_numpy(q2))
    g.replay()
    torch.cuda.synchronize()
    ref, _ = reference_prefill(q2, k, v, causal=True, scale=1 / np.sqrt(128))
    assert nmse(out.cpu().numpy(), ref) < 1e-5


@needs_gpu
@pytest.mark.skipif(FORCED is not None, reason="the forced runs are this test's own children")
@pytest.mark.parametrize("parts", ["2", "4", "16"])
def test_every_case_with_the_split_forced(parts):
    env = dict(os.environ, MLX_NATIVE_CUDA_KV_SPLITS=parts, PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "not forced", __file__]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    summary = r.stdout.strip().split("\n")[-1]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, summary
