"""Paged K/V (SPEC 11) on CUDA: k/v caches ``[num_blocks, block_size, kv_heads, head_dim]``
read through a block table and ``seqused_k`` by the one-CTA forms (the Hopper form's
cp.async loaders on sm_90a, and the portable mma.sync form, ``cuda_form="portable"``) and,
on sm_90a at head dims 64, 128 and 256 with fixed-length queries, by the paged module's
CTA-pair forms (TMA boxes of a block's rows found through the table).

- Bit-identity with the contiguous layout on the same device and form (SPEC 11): block sizes
  16, 32, 48 (no step aligns with it), 64 and 256, shuffled tables with garbage past each
  sequence's last block, GQA, causal, windows, lse, sinks, variable-length and fixed-length
  queries, float16 and bfloat16 K/V, the head dims of both forms, split walks.
- The float64 reference (``reference_paged``).
- What is never read: unused blocks and the rows past each cache's end hold NaN (the pair
  forms' TMA copies a last block's rows past the end: their consumers zero V's there).

Shapes are small. Without a CUDA device every test is skipped (the CPU suite,
``test_paged.py``, holds the same cases on the CPU backend)."""

from __future__ import annotations

import numpy as np
import pytest

import mlx_native as mn
from mlx_native.dtypes import bfloat16_dtype
from mlx_native.reference import gather_pages, nmse, reference_paged

from helpers import KERNEL_DIMS, traced_pair_run
from test_paged import contiguous, make_pages

HAS_CUDA = "cuda" in mn.backends()
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
BF16 = bfloat16_dtype()
LSE_TOL = 2e-3  # SPEC 8
#: Each form a paged plan runs: the library's choice (the Hopper form on sm_90a) and the
#: portable one on any GPU.
FORMS = ["auto", "portable"]
#: The bar against the float64 reference: bfloat16 K/V round P to bfloat16.
BARS = {np.dtype(np.float16): 1e-5, np.dtype(BF16): 1e-4}


def _bits(a, b):
    for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), f"max diff {np.abs(x.astype(float) - y).max()}"


def _cuda(q, k, v, mask=None, form="auto", splits=0, pairs="off", **kw):
    """One call on CUDA through a plan of host arrays (uploaded, run, downloaded), in the
    given form, the walk split as asked (0: never) and CTA pairs as asked (by default none,
    so that a paged plan and a contiguous one launch the same kernel; ``auto``: head pairs
    where the group splits, else query pairs; ``queries``); returns the run's result and the
    plan."""
    plan = mn.PrefillPlan(q, k, v, mask, device="cuda", cuda_form=form, kv_splits=splits, cta_pairs=pairs, **kw)
    return plan.run(), plan


# (block_size, query lengths, cache lengths, heads, kv heads, causal, window)
VARLEN = [
    (16, [37, 1, 0, 64], [100, 1, 30, 64], 4, 2, True, None),
    (32, [20, 70], [150, 70], 2, 2, True, 40),
    (64, [33, 5], [129, 64], 4, 1, False, None),
    (256, [40, 17], [300, 17], 4, 2, True, None),
    (48, [9, 65], [200, 65], 2, 1, True, (70, 3)),  # a block size no step aligns with; a two-sided window
]


@needs_gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kv_dtype", [np.float16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("d", [64, 80, 128, 256])
@pytest.mark.parametrize("case", VARLEN, ids=lambda c: f"bs{c[0]}")
def test_paged_varlen_on_cuda_is_the_contiguous_layout_to_the_bit(rng, form, kv_dtype, d, case):
    bs, lq, lk, nh, nkv, causal, window = case
    k, v, table, used = make_pages(rng, lk, bs, nkv, d, dtype=kv_dtype)
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    q = rng.uniform(-1, 1, (int(cq[-1]), nh, d)).astype(np.float32)
    sinks = rng.uniform(-1, 1, nh).astype(np.float32)
    kw = dict(causal=causal, window=window, cu_seqlens_q=cq, return_lse=True, sinks=sinks, form=form)
    paged, plan = _cuda(q, k, v, block_table=table, seqused_k=used, **kw)
    assert plan.choices["pairs"] == "off", plan.choices
    kc, ck = contiguous(k, table, used)
    vc, _ = contiguous(v, table, used)
    _bits(paged, _cuda(q, kc, vc, cu_seqlens_k=ck, **kw)[0])
    ref, ref_lse = reference_paged(q, k, v, block_table=table, seqused_k=used, cu_seqlens_q=cq, causal=causal,
                                   window=window, sinks=sinks, scale=1 / np.sqrt(d))  # fmt: skip
    assert np.isfinite(paged[0]).all()
    assert nmse(paged[0], ref) < BARS[np.dtype(kv_dtype)]
    seen = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(paged[1]), seen)
    assert np.abs(paged[1][seen] - ref_lse[seen]).max() < LSE_TOL


@needs_gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kv_dtype", [np.float16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("d", [64, 128, 256, 512])
@pytest.mark.parametrize("bs", [16, 64, 80])
def test_paged_fixed_length_on_cuda_is_each_sequences_contiguous_result(rng, form, kv_dtype, d, bs):
    """4-D q (every sequence ``Lq`` rows) against caches of different lengths (one as long
    as the prompt, partial last blocks), GQA, causal, with an explicit mask over the longest
    cache (each sequence reads its first ``Lk_b`` columns): each sequence's output and lse
    are those of its own contiguous call, bit for bit, and the batch matches the reference.
    Block size 80 is a multiple of 16 that is not a power of two (rows found by division)."""
    lq, lk, nh, nkv = 24, [90, 24, 160], 4, 2
    k, v, table, used = make_pages(rng, lk, bs, nkv, d, dtype=kv_dtype)
    q = rng.uniform(-1, 1, (len(lk), lq, nh, d)).astype(np.float32)
    mask = rng.uniform(-1, 1, (len(lk), lq, max(lk))).astype(np.float16)
    mask[:, :, 64:128] = -np.inf  # a skipped step
    (out, lse), _ = _cuda(q, k, v, mask, causal=True, block_table=table, seqused_k=used, return_lse=True, form=form)
    for b, n in enumerate(lk):
        kb, vb = gather_pages(k, table, used, b), gather_pages(v, table, used, b)
        one, _ = _cuda(q[b], kb, vb, np.ascontiguousarray(mask[b, :, :n]), causal=True, return_lse=True, form=form)
        _bits((out[b], lse[b]), one)
    ref, _ = reference_paged(q, k, v, mask, block_table=table, seqused_k=used, causal=True, scale=1 / np.sqrt(d))
    assert nmse(out, ref) < BARS[np.dtype(kv_dtype)]


@needs_gpu
@pytest.mark.parametrize("form", FORMS)
def test_paged_without_a_mask_and_seqused_k_shorter_than_the_table(rng, form):
    """Fixed-length queries without an explicit mask, a window and no causal bound: every
    sequence uses fewer rows than its table row holds (the rest of the table garbage, the
    rest of its last block NaN), one sequence has an empty cache."""
    bs, lk, lq, nh, nkv, d = 32, [75, 0, 33, 128], 16, 8, 2, 128
    k, v, table, used = make_pages(rng, lk, bs, nkv, d)
    wide = np.concatenate([table, rng.integers(-5, 5, (len(lk), 3)).astype(np.int32)], axis=1)
    q = rng.uniform(-1, 1, (len(lk), lq, nh, d)).astype(np.float32)
    kw = dict(window=(40, 40), return_lse=True, form=form)
    (out, lse), _ = _cuda(q, k, v, block_table=wide, seqused_k=used, **kw)
    assert np.isfinite(out).all()
    for b, n in enumerate(lk):
        if n == 0:
            assert not np.isfinite(lse[b]).any() and not out[b].any()
            continue
        kb, vb = gather_pages(k, table, used, b), gather_pages(v, table, used, b)
        _bits((out[b], lse[b]), _cuda(q[b], kb, vb, **kw)[0])
    ref, _ = reference_paged(q, k, v, block_table=wide, seqused_k=used, window=(40, 40), scale=1 / np.sqrt(d))
    assert nmse(out, ref) < 1e-5


@needs_gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("splits", [2, 4, 16])
def test_paged_split_walks_on_cuda(rng, form, splits):
    """A chunk against long paged caches with the walk split (the merge kernel after):
    the contiguous layout's bits under the same split, and the reference."""
    bs, lq, lk, nh, nkv, d = 16, [40, 8], [2000, 1500], 8, 2, 128
    k, v, table, used = make_pages(rng, lk, bs, nkv, d)
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    q = rng.uniform(-1, 1, (int(cq[-1]), nh, d)).astype(np.float32)
    sinks = rng.uniform(-1, 1, nh).astype(np.float32)
    kw = dict(causal=True, cu_seqlens_q=cq, return_lse=True, sinks=sinks, form=form, splits=splits)
    paged, plan = _cuda(q, k, v, block_table=table, seqused_k=used, **kw)
    assert plan.workspace_bytes > 0 and plan.choices["splits"] == splits, plan.choices
    kc, ck = contiguous(k, table, used)
    vc, _ = contiguous(v, table, used)
    _bits(paged, _cuda(q, kc, vc, cu_seqlens_k=ck, **kw)[0])
    ref, ref_lse = reference_paged(q, k, v, block_table=table, seqused_k=used, cu_seqlens_q=cq, causal=True,
                                   sinks=sinks, scale=1 / np.sqrt(d))  # fmt: skip
    assert nmse(paged[0], ref) < 1e-5
    assert np.abs(paged[1] - ref_lse).max() < LSE_TOL


@needs_gpu
@pytest.mark.parametrize("form", FORMS)
def test_paged_transforms_and_float32_caches_on_cuda(rng, form):
    """Softcap and ALiBi slopes per sequence (the portable form's ``_xf`` entry) on paged
    caches against the reference; float32 caches run as their float16 copies (as contiguous
    float32 K/V do on CUDA): the float16 caches' bits."""
    lk, bs, nh, nkv, d = [70, 130], 32, 4, 2, 64
    k, v, table, used = make_pages(rng, lk, bs, nkv, d, dtype=np.float32)
    q = rng.uniform(-1, 1, (2, 24, nh, d)).astype(np.float32)
    slopes = rng.uniform(0, 0.2, (2, nh)).astype(np.float32)
    kw = dict(window=(30, 5), softcap=5.0, alibi_slopes=slopes, block_table=table, seqused_k=used, form=form)
    out, _ = _cuda(q, k, v, **kw)
    ref, _ = reference_paged(q, k, v, block_table=table, seqused_k=used, window=(30, 5), softcap=5.0,
                             alibi_slopes=slopes, scale=1 / 8)  # fmt: skip
    assert nmse(out, ref) < 1e-5
    _bits(out, _cuda(q, k.astype(np.float16), v.astype(np.float16), **kw)[0])


@needs_gpu
def test_paged_torch_cuda_tensors(rng):
    """CUDA tensors (q, the caches, the table and the lengths on the GPU) through the
    operator: the result is a CUDA tensor, the contiguous call's bits."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA build of torch")
    lq, lk, bs = [12, 30], [40, 30], 16
    k, v, table, used = make_pages(rng, lk, bs, 2, 64)
    cq = np.array([0, 12, 42], np.int32)
    q = rng.uniform(-1, 1, (42, 4, 64)).astype(np.float32)
    t = lambda x: torch.from_numpy(x).cuda()  # noqa: E731
    out = mn.flash_attn_prefill(t(q).to(torch.bfloat16), t(k), t(v), causal=True, cu_seqlens_q=t(cq),
                                block_table=t(table), seqused_k=t(used), cta_pairs="off")  # fmt: skip
    assert isinstance(out, torch.Tensor) and out.is_cuda and out.dtype == torch.bfloat16
    kc, ck = contiguous(k, table, used)
    vc, _ = contiguous(v, table, used)
    want = mn.flash_attn_prefill(t(q).to(torch.bfloat16), t(kc), t(vc), causal=True, cu_seqlens_q=t(cq),
                                 cu_seqlens_k=t(ck), cta_pairs="off")  # fmt: skip
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    ref, _ = reference_paged(q.astype(BF16), k, v, block_table=table, seqused_k=used, cu_seqlens_q=cq, causal=True,
                             scale=1 / 8)  # fmt: skip
    assert nmse(out.float().cpu().numpy(), ref) < 1e-4


@needs_gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kv_dtype", [np.float16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("softcap", [0.0, 8.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("dk,dv", KERNEL_DIMS, ids=[f"d{a}_{b}" for a, b in KERNEL_DIMS])
def test_every_paged_entry_point(rng, form, kv_dtype, softcap, dk, dv):
    """Every head dim's paged entry points (``_paged``, and the portable form's
    ``_xf_paged`` with softcap): a small causal GQA batch with a partial last block, the
    contiguous layout's bits and the reference."""
    bs, lq, lk, nh, nkv = 32, [20, 7], [75, 40], 4, 2
    k, v, table, used = make_pages(rng, lk, bs, nkv, dk, dv, dtype=kv_dtype)
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    q = rng.uniform(-1, 1, (int(cq[-1]), nh, dk)).astype(np.float32)
    kw = dict(causal=True, cu_seqlens_q=cq, return_lse=True, softcap=softcap, form=form)
    paged, _ = _cuda(q, k, v, block_table=table, seqused_k=used, **kw)
    kc, ck = contiguous(k, table, used)
    vc, _ = contiguous(v, table, used)
    _bits(paged, _cuda(q, kc, vc, cu_seqlens_k=ck, **kw)[0])
    ref, _ = reference_paged(q, k, v, block_table=table, seqused_k=used, cu_seqlens_q=cq, causal=True,
                             softcap=softcap, scale=1 / np.sqrt(dk))  # fmt: skip
    assert nmse(paged[0], ref) < BARS[np.dtype(kv_dtype)]


# ------------------------------------------------- the CTA-pair forms on paged K/V (Hopper)

#: Block sizes of the pair forms' cases: boxes of 16 rows (16, 48: no 32- or 64-row box
#: divides them), of 64 (64, 256; 256: a tile inside one block).
PAIR_BLOCKS = [16, 48, 64, 256]


@needs_gpu
@pytest.mark.parametrize("pairs", ["auto", "queries"])
@pytest.mark.parametrize("kv_dtype", [np.float16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("bs", PAIR_BLOCKS)
def test_paged_pair_forms_are_each_sequences_contiguous_result(rng, pairs, kv_dtype, d, bs):
    """Fixed-length queries against paged caches of different lengths (partial last blocks
    whose rows past the end are NaN, one cache as long as the prompt, one past several
    tiles), GQA, causal, an explicit mask with a skipped step, CTA pairs asked for: each
    sequence's output and lse are those of its own contiguous call in the form the paged
    plan reports (``choices["pairs"]``: on sm_90a the paged module's pair forms, their boxes
    found through the table and V's rows past the end zeroed, where the host launches them;
    else ``off``, the one-CTA forms), bit for bit, and the batch matches the reference."""
    lq, lk, nh, nkv = 100, [300, 100, 129], 8, 2
    k, v, table, used = make_pages(rng, lk, bs, nkv, d, dtype=kv_dtype)
    q = rng.uniform(-1, 1, (len(lk), lq, nh, d)).astype(np.float32)
    mask = rng.uniform(-1, 1, (len(lk), lq, max(lk))).astype(np.float16)
    mask[:, :, 64:128] = -np.inf  # a skipped step
    (out, lse), plan = _cuda(q, k, v, mask, pairs=pairs, causal=True, block_table=table, seqused_k=used,
                             return_lse=True)
    form = plan.choices["pairs"]
    assert form in (pairs, "off"), plan.choices
    assert np.isfinite(out).all()
    for b, n in enumerate(lk):
        kb, vb = gather_pages(k, table, used, b), gather_pages(v, table, used, b)
        one, _ = _cuda(q[b], kb, vb, np.ascontiguousarray(mask[b, :, :n]), pairs=form, causal=True, return_lse=True)
        _bits((out[b], lse[b]), one)
    ref, _ = reference_paged(q, k, v, mask, block_table=table, seqused_k=used, causal=True, scale=1 / np.sqrt(d))
    assert nmse(out, ref) < BARS[np.dtype(kv_dtype)]


@needs_gpu
@pytest.mark.parametrize("d", [64, 128, 256])
def test_paged_pair_forms_without_a_mask(rng, d):
    """The described masks alone (a two-sided window, sinks) on paged caches with CTA pairs
    asked for: each sequence's contiguous result in the paged plan's form, bit for bit (a
    cache of one row, one of a block and a row, one of many tiles)."""
    lq, lk, nh, nkv, bs = 70, [1, 17, 200], 4, 1, 16
    k, v, table, used = make_pages(rng, lk, bs, nkv, d)
    q = rng.uniform(-1, 1, (len(lk), lq, nh, d)).astype(np.float32)
    sinks = rng.uniform(-1, 1, nh).astype(np.float32)
    kw = dict(window=(50, 50), sinks=sinks, return_lse=True)
    (out, lse), plan = _cuda(q, k, v, pairs="auto", block_table=table, seqused_k=used, **kw)
    assert np.isfinite(out).all()
    for b, n in enumerate(lk):
        kb, vb = gather_pages(k, table, used, b), gather_pages(v, table, used, b)
        _bits((out[b], lse[b]), _cuda(q[b], kb, vb, pairs=plan.choices["pairs"], **kw)[0])


_PAGED_PLAN = """
from test_paged import make_pages
k, v, table, used = make_pages(np.random.default_rng(0), [100], 16, 2, 128)
q = np.zeros((1, 64, 8, 128), np.float32)
plan = mn.PrefillPlan(q, k, v, device="cuda", causal=True, block_table=table, seqused_k=used, cta_pairs="auto")
"""


@needs_gpu
def test_traced_paged_pairs_launch_what_the_plans_report():
    """The two tests above again in a process of their own with the launch trace on: where
    a paged plan reports CTA pairs (sm_90a, the host launching the paged pair forms), every
    paged pair entry point (``<entry>_pair_heads_paged``, ``_pair_queries_paged``, head dims
    64, 128 and 256, float16 and bfloat16) is launched; where it reports ``off``, none is."""
    reported, entries = traced_pair_run(__file__, _PAGED_PLAN, "test_paged_pair_forms")
    launched = {e for e in entries if "_pair_" in e and "_paged" in e}
    want = {
        f"{e}_pair_{m}_paged"
        for e in ("flash_attn_prefill_d64", "flash_attn_prefill_d64_bf16", "flash_attn_prefill_d128",
                  "flash_attn_prefill_d128_bf16", "flash_attn_prefill_tensor_f16_d256", "flash_attn_prefill_d256_bf16")
        for m in ("heads", "queries")
    }  # fmt: skip
    assert launched == (want if reported != "off" else set()), (reported, sorted(launched ^ want))
