"""Paged K/V (SPEC 11) on the CPU backend: k/v caches ``[num_blocks, block_size, kv_heads,
head_dim]`` read through a block table and ``seqused_k``.

- Bit-identity with the contiguous layout on the same backend (SPEC 11), on every
  instruction set of this CPU and the emulated AMX tiles: block sizes 16, 32, 64 and 256
  (steps within a block, and steps spanning blocks, which the kernels gather), shuffled
  tables, GQA, causal, window and explicit masks, lse, sinks, variable-length and
  fixed-length queries, float16, bfloat16 and float32 K/V.
- The float64 reference (``reference_paged``: each sequence's blocks gathered).
- What is never read: table entries past a sequence's last block hold garbage, unused blocks
  and the rows past each cache's end hold NaN.
- Every hostile input of SPEC 11 refused by name before anything runs; paged K/V runs on
  every backend (Metal's kernels: test_metal_emulator_paged.py; CUDA: ``test_cuda_paged.py``).

Shapes are small: the whole file runs in seconds."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import mlx_native as mn
from mlx_native.reference import gather_pages, nmse, reference_paged
from helpers import ops_seen

BF16 = ml_dtypes.bfloat16
BAR = 1e-5
LSE_TOL = 2e-3  # SPEC 8
ISAS = list(dict.fromkeys(mn.cpu_info()["detected"] + ["amx-emulated"]))
GARBAGE = (-7, 10**9, -(2**31), 2**31 - 1)


@pytest.fixture(params=ISAS)
def isa(request):
    """Each CPU path (portable, AVX2, AVX-512, AMX where present, the emulated tiles), forced
    for the test."""
    mn.force_cpu_isa(request.param)
    try:
        yield request.param
    finally:
        mn.force_cpu_isa(None)


def make_pages(rng, lens, block_size, nkv, dk, dv=None, dtype=np.float16, spare=3):
    """Caches holding sequences of ``lens`` rows in shuffled blocks (``spare`` more blocks
    unused), the table (garbage past each sequence's last block: one more column than the
    longest needs) and the lengths. Unused blocks and the rows past each cache's end are NaN,
    so a kernel that read them would say so."""
    dv = dk if dv is None else dv
    need = [-(-lk // block_size) for lk in lens]
    num_blocks = sum(need) + spare
    order = rng.permutation(num_blocks)
    k = np.full((num_blocks, block_size, nkv, dk), np.nan, np.float32)
    v = np.full((num_blocks, block_size, nkv, dv), np.nan, np.float32)
    table = np.empty((len(lens), max(need, default=0) + 1), np.int32)
    at = 0
    for b, (lk, n) in enumerate(zip(lens, need)):
        table[b, :n] = order[at : at + n]
        table[b, n:] = rng.choice(GARBAGE, table.shape[1] - n)
        at += n
        for j in range(lk):
            blk, r = table[b, j // block_size], j % block_size
            k[blk, r] = rng.uniform(-1, 1, (nkv, dk))
            v[blk, r] = rng.uniform(-1, 1, (nkv, dv))
    return k.astype(dtype), v.astype(dtype), table, np.asarray(lens, np.int32)


def contiguous(cache, table, used):
    """The caches' sequences one after the other (varlen k/v) and their ``cu_seqlens_k``."""
    parts = [gather_pages(cache, table, used, b) for b in range(len(used))]
    cu = np.concatenate([[0], np.cumsum(used)]).astype(np.int32)
    return np.concatenate(parts), cu


def _equal(a, b):
    for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), f"max diff {np.abs(x.astype(float) - y).max()}"


# (block_size, query lengths, cache lengths, heads, kv heads, causal, window)
VARLEN = [
    (16, [37, 1, 0, 64], [100, 1, 30, 64], 4, 2, True, None),
    (32, [20, 70], [150, 70], 2, 2, True, 40),
    (64, [33, 5], [129, 64], 4, 1, False, None),
    (256, [40, 17], [300, 17], 4, 2, True, None),
    (48, [9, 65], [200, 65], 2, 1, True, 70),  # a block size that no step aligns with
]


@pytest.mark.parametrize("case", VARLEN, ids=lambda c: f"bs{c[0]}")
def test_paged_varlen_is_the_contiguous_layout_to_the_bit(rng, isa, case):
    bs, lq, lk, nh, nkv, causal, window = case
    d = 64
    k, v, table, used = make_pages(rng, lk, bs, nkv, d)
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    q = rng.uniform(-1, 1, (int(cq[-1]), nh, d)).astype(np.float32)
    sinks = rng.uniform(-1, 1, nh).astype(np.float32)
    kw = dict(causal=causal, window=window, cu_seqlens_q=cq, return_lse=True, sinks=sinks)
    paged = mn.flash_attn_prefill(q, k, v, block_table=table, seqused_k=used, **kw)
    kc, ck = contiguous(k, table, used)
    vc, _ = contiguous(v, table, used)
    _equal(paged, mn.flash_attn_prefill(q, kc, vc, cu_seqlens_k=ck, **kw))
    ref, ref_lse = reference_paged(q, k, v, block_table=table, seqused_k=used, cu_seqlens_q=cq, causal=causal,
                                   window=window, sinks=sinks, scale=1 / 8)  # fmt: skip
    assert nmse(paged[0], ref) < BAR
    seen = np.isfinite(ref_lse)
    assert np.allclose(paged[1][seen], ref_lse[seen], atol=LSE_TOL)


@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("kv_dtype", [np.float16, BF16, np.float32], ids=["f16", "bf16", "f32"])
def test_paged_fixed_length_with_a_mask_is_each_sequences_contiguous_result(rng, isa, bs, kv_dtype):
    """4-D q (every sequence ``Lq`` rows) against caches of different lengths, with an
    explicit mask over the longest cache (each sequence reads its first ``Lk_b`` columns):
    each sequence's output is that of its own contiguous call, bit for bit."""
    lq, lk, nh, nkv, d = 24, [90, 24, 160], 4, 2, 128
    k, v, table, used = make_pages(rng, lk, bs, nkv, d, dtype=kv_dtype)
    q = rng.uniform(-1, 1, (len(lk), lq, nh, d)).astype(np.float32)
    mask = rng.uniform(-1, 1, (len(lk), lq, max(lk))).astype(np.float16)
    mask[:, :, 40:104] = -np.inf  # a skipped step
    out, lse = mn.flash_attn_prefill(q, k, v, mask, causal=True, block_table=table, seqused_k=used, return_lse=True)
    for b, n in enumerate(lk):
        kb, vb = gather_pages(k, table, used, b), gather_pages(v, table, used, b)
        one = mn.flash_attn_prefill(q[b], kb, vb, np.ascontiguousarray(mask[b, :, :n]), causal=True, return_lse=True)
        _equal((out[b], lse[b]), one)
    ref, _ = reference_paged(q, k, v, mask, block_table=table, seqused_k=used, causal=True, scale=1 / np.sqrt(d))
    assert nmse(out, ref) < BAR


def test_paged_strided_caches_and_a_plan(rng):
    """Caches that are views (a head-sliced, padded allocation: any strides with a contiguous
    last axis) are read in place, and a plan made once runs on new cache contents."""
    bs, lk, nh, d = 32, [70, 33], 4, 64
    k, v, table, used = make_pages(rng, lk, bs, 4, d)
    ks, vs = k[:, :, 1:3], v[:, :, ::2]  # 2 KV heads of 4: strides of the whole allocation
    q = rng.uniform(-1, 1, (2, 16, nh, d)).astype(np.float32)
    plan = mn.PrefillPlan(q, ks, vs, causal=True, block_table=table, seqused_k=used)
    first = plan.run(q, ks, vs)
    ref, _ = reference_paged(q, ks, vs, block_table=table, seqused_k=used, causal=True, scale=1 / 8)
    assert nmse(first, ref) < BAR
    k[:, :, 1:3] *= 2  # new contents, same layout: the plan reads them
    again = plan.run(q, ks, vs)
    ref2, _ = reference_paged(q, ks, vs, block_table=table, seqused_k=used, causal=True, scale=1 / 8)
    assert nmse(again, ref2) < BAR and not np.array_equal(first, again)


def test_paged_torch_tensors(rng):
    torch = pytest.importorskip("torch")
    lq, lk, bs = [12, 30], [40, 30], 16
    k, v, table, used = make_pages(rng, lk, bs, 2, 64)
    cq = np.array([0, 12, 42], np.int32)
    q = rng.uniform(-1, 1, (42, 4, 64)).astype(np.float32)
    t = lambda x: torch.from_numpy(x)  # noqa: E731
    out = mn.flash_attn_prefill(t(q).to(torch.bfloat16), t(k), t(v), causal=True, cu_seqlens_q=t(cq),
                                block_table=t(table), seqused_k=t(used))  # fmt: skip
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    ref, _ = reference_paged(q.astype(BF16), k, v, block_table=table, seqused_k=used, cu_seqlens_q=cq, causal=True,
                             scale=1 / 8)  # fmt: skip
    assert nmse(out.float().numpy(), ref) < 1e-4


# ---------------------------------------------------------------------- hostile inputs


def _good(rng, bs=16):
    k, v, table, used = make_pages(rng, [40, 20], bs, 2, 64)
    q = rng.uniform(-1, 1, (2, 8, 4, 64)).astype(np.float32)
    return q, k, v, table, used


def _refused(cls, words, *args, **kw):
    with pytest.raises(cls) as e:
        mn.flash_attn_prefill(*args, **kw)
    for w in words:
        assert w in str(e.value), f"{w!r} not in {str(e.value)!r}"


def test_paged_bad_tables_are_refused_by_name(rng):
    q, k, v, table, used = _good(rng)
    bad = table.copy()
    bad[1, 1] = k.shape[0]  # sequence 1 needs 2 blocks: its second is past the caches
    _refused(mn.InvalidArgumentError, ["block_table[1, 1]", str(k.shape[0])], q, k, v, block_table=bad, seqused_k=used)
    bad[1, 1] = -1
    _refused(mn.InvalidArgumentError, ["block_table[1, 1] is -1"], q, k, v, block_table=bad, seqused_k=used)
    # Longer than its table row; negative.
    _refused(mn.InvalidArgumentError, ["seqused_k[0] is 100", "widen"], q, k, v, block_table=table,
             seqused_k=np.array([100, 20], np.int32))  # fmt: skip
    _refused(mn.InvalidArgumentError, ["seqused_k[1] is -3"], q, k, v, block_table=table,
             seqused_k=np.array([40, -3], np.int32))  # fmt: skip
    # Causal with a cache shorter than the prompt, unless an offset places the queries.
    short = np.array([40, 5], np.int32)
    _refused(mn.InvalidArgumentError, ["seqused_k[1] = 5", "offset"], q, k, v, causal=True, block_table=table,
             seqused_k=short)  # fmt: skip
    out = mn.flash_attn_prefill(q, k, v, causal=True, offset=0, block_table=table, seqused_k=short)
    assert np.isfinite(out).all()


@pytest.mark.parametrize("bs", [8, 24, 272])
def test_paged_block_sizes_outside_16_to_256_are_refused(rng, bs):
    q, k, v, table, used = _good(rng, bs)
    _refused(mn.InvalidArgumentError, ["block_size", str(bs), "multiple of 16"], q, k, v, block_table=table,
             seqused_k=used)  # fmt: skip


def test_paged_wrong_kinds_are_refused_by_name(rng):
    q, k, v, table, used = _good(rng)
    _refused(mn.UnsupportedDtypeError, ["block_table", "int32"], q, k, v, block_table=table.astype(np.int64),
             seqused_k=used)  # fmt: skip
    _refused(mn.UnsupportedDtypeError, ["seqused_k", "int32"], q, k, v, block_table=table,
             seqused_k=used.astype(np.float32))  # fmt: skip
    _refused(mn.InvalidArgumentError, ["seqused_k", "block_table"], q, k, v, seqused_k=used)
    _refused(mn.InvalidArgumentError, ["block_table", "seqused_k"], q, k, v, block_table=table)
    _refused(mn.InvalidArgumentError, ["block_table", "[batch, max_blocks]"], q, k, v, block_table=table[0],
             seqused_k=used)  # fmt: skip
    _refused(mn.InvalidArgumentError, ["2 sequences"], q, k, v, block_table=table[:1], seqused_k=used[:1])
    _refused(mn.InvalidArgumentError, ["paged cache", "num_blocks"], q, k[0], v[0], block_table=table, seqused_k=used)
    cu = np.array([0, 8, 16], np.int32)
    _refused(mn.InvalidArgumentError, ["cu_seqlens_k", "seqused_k"], q.reshape(16, 4, 64), k, v, cu_seqlens_q=cu,
             cu_seqlens_k=cu, block_table=table, seqused_k=used)  # fmt: skip


def test_paged_kv_on_metal_is_not_refused(rng):
    # Metal runs paged K/V (its own entry points): a named Metal device gets past the paged
    # checks to the device itself, which off macOS does not exist.
    q, k, v, table, used = _good(rng)
    if "metal" in mn.backends():
        pytest.skip("a Metal device: test_paged's cases run there as on the CPU")
    with pytest.raises(mn.DeviceNotFoundError) as e:
        mn.flash_attn_prefill(q, k, v, block_table=table, seqused_k=used, device="metal")
    assert "block_table" not in str(e.value), str(e.value)


# ---------------------------------------------------------------------- FlashAttention's API


def test_flash_attn_varlen_func_and_with_kvcache_take_block_tables(rng):
    """FlashAttention 2's paged calls: ``flash_attn_varlen_func(..., block_table=)`` (its
    ``cu_seqlens_k`` the caches' lengths as offsets) and ``flash_attn_with_kvcache(q, k_cache,
    v_cache, cache_seqlens=, block_table=)`` equal, to the bit, the same calls on the pages
    gathered contiguous; a cache shorter than its queries (causal: its first rows see
    nothing) included."""
    torch = pytest.importorskip("torch")
    from mlx_native import flash_attn_interface as fai

    t = torch.from_numpy
    lq, lk, bs = [20, 30], [90, 12], 16
    k, v, table, used = make_pages(rng, lk, bs, 2, 64)
    kc, ck = contiguous(k, table, used)
    vc, _ = contiguous(v, table, used)
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    q = t(rng.uniform(-1, 1, (int(cq[-1]), 4, 64)).astype(np.float16))
    for causal in (False, True):
        paged = fai.flash_attn_varlen_func(q, t(k), t(v), t(cq), t(ck), 30, 90, causal=causal, block_table=t(table),
                                           return_attn_probs=True)  # fmt: skip
        flat = fai.flash_attn_varlen_func(q, t(kc), t(vc), t(cq), t(ck), 30, 90, causal=causal, return_attn_probs=True)
        assert torch.equal(paged[0], flat[0]) and torch.equal(paged[1], flat[1])
    # with_kvcache: [batch, seqlen_q] queries against each sequence's cache length.
    qb = t(rng.uniform(-1, 1, (2, 16, 4, 64)).astype(np.float16))
    padded_k = np.zeros((2, max(lk), 2, 64), np.float16)
    padded_v = np.zeros_like(padded_k)
    for b, n in enumerate(lk):
        padded_k[b, :n], padded_v[b, :n] = kc[ck[b] : ck[b + 1]], vc[ck[b] : ck[b + 1]]
    seqlens = t(used)
    paged, lse = fai.flash_attn_with_kvcache(qb, t(k), t(v), cache_seqlens=seqlens, block_table=t(table), causal=True,
                                             return_softmax_lse=True)  # fmt: skip
    flat, flat_lse = fai.flash_attn_with_kvcache(qb, t(padded_k), t(padded_v), cache_seqlens=seqlens, causal=True,
                                                 return_softmax_lse=True)  # fmt: skip
    assert torch.equal(paged, flat) and torch.equal(lse, flat_lse)
    assert torch.isinf(lse[1, :, :4]).all() and (paged[1, :4] == 0).all()  # 16 queries, a cache of 12
    # Contiguous caches of one length (an int): FlashAttention's own call on the cache's rows.
    whole = fai.flash_attn_with_kvcache(qb, t(padded_k), t(padded_v), cache_seqlens=50, causal=True)
    assert torch.equal(whole, fai.flash_attn_func(qb, t(padded_k[:, :50]), t(padded_v[:, :50]), causal=True))
    with pytest.raises(mn.UnsupportedFeatureError, match="rotary_cos"):
        fai.flash_attn_with_kvcache(qb, t(k), t(v), rotary_cos=qb, cache_seqlens=seqlens, block_table=t(table))


def test_paged_transforms_and_the_hnd_layout(rng):
    """Softcap, ALiBi slopes per sequence and a two-sided window on paged caches against the
    reference; and ``layout="HND"`` (q ``[batch, heads, rows, D]``, caches ``[num_blocks,
    kv_heads, block_size, D]``, read through their strides) equal to the ``"NHD"`` call."""
    lk, bs, nh, nkv, d = [70, 130], 32, 4, 2, 64
    k, v, table, used = make_pages(rng, lk, bs, nkv, d)
    q = rng.uniform(-1, 1, (2, 24, nh, d)).astype(np.float32)
    slopes = rng.uniform(0, 0.2, (2, nh)).astype(np.float32)
    kw = dict(window=(30, 5), softcap=5.0, alibi_slopes=slopes, block_table=table, seqused_k=used)
    out = mn.flash_attn_prefill(q, k, v, **kw)
    ref, _ = reference_paged(q, k, v, block_table=table, seqused_k=used, window=(30, 5), softcap=5.0,
                             alibi_slopes=slopes, scale=1 / 8)  # fmt: skip
    assert nmse(out, ref) < BAR
    qh, kh, vh = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    hnd = mn.flash_attn_prefill(np.ascontiguousarray(qh), np.ascontiguousarray(kh), np.ascontiguousarray(vh),
                                layout="HND", **kw)  # fmt: skip
    _equal(np.ascontiguousarray(hnd.transpose(0, 2, 1, 3)), out)


def test_paged_takes_the_run_options(rng):
    """A paged plan carries its run options like any other: ``cpu_isa`` picks the CPU path
    (the emulated tiles round P to bf16, so its bits differ from the FMA paths'), and the
    result is that of the same path forced process-wide."""
    k, v, table, used = make_pages(rng, [90, 40], 16, 2, 64)
    cq = np.asarray([0, 30, 50], np.int32)
    q = rng.uniform(-1, 1, (50, 4, 64)).astype(np.float32)
    kw = dict(causal=True, cu_seqlens_q=cq, block_table=table, seqused_k=used)
    by_option = mn.flash_attn_prefill(q, k, v, cpu_isa="amx-emulated", **kw)
    mn.force_cpu_isa("amx-emulated")
    try:
        forced = mn.flash_attn_prefill(q, k, v, **kw)
    finally:
        mn.force_cpu_isa(None)
    _equal(by_option, forced)
    plan = mn.PrefillPlan(q, k, v, cpu_isa="portable", **kw)
    assert plan.choices["isa"] == "portable", plan.choices
    _equal(plan.run(), mn.flash_attn_prefill(q, k, v, cpu_isa="portable", **kw))
    with pytest.raises(mn.InvalidArgumentError, match="cpu_isa"):
        mn.flash_attn_prefill(q, k, v, cpu_isa="sse9", **kw)


# ---------------------------------------------------------------------- the torch operators


def _torch():
    torch = pytest.importorskip("torch")
    import mlx_native.torch_ops  # noqa: F401  (registers the operators)

    return torch


# (block_size, query lengths or None for 4-D q of 16 rows, cache lengths, heads, kv heads, causal, spare table columns)
OPERATOR_CASES = [
    # variable length, GQA 4/2, partial last blocks (37 = 2 blocks + 5), a table wider than needed
    (16, [20, 9], [37, 16], 4, 2, True, 2),
    # fixed length (4-D q), GQA 8/2, caches shorter than their tables, not causal
    (32, None, [50, 33], 8, 2, False, 3),
    # fixed length, causal from the cache's first row (offset 0), a cache of 0 rows (its rows see nothing:
    # zeros, lse -inf) beside one of a block and a bit
    (64, None, [0, 70], 4, 1, True, 1),
]


@pytest.mark.parametrize("case", OPERATOR_CASES, ids=["varlen-gqa-partial", "fixed-gqa-short", "fixed-causal"])
def test_the_torch_operator_takes_paged_kv(rng, case):
    """Torch tensors with ``block_table=``/``seqused_k=`` go through
    ``torch.ops.mlx_native.flash_attn_prefill_lse`` (one operator reaches the dispatcher),
    and give the float64 reference's result (SPEC 11) and the array call's bits; called on
    the operator itself by keyword as well."""
    torch = _torch()
    bs, lq, lk, nh, nkv, causal, spare = case
    d = 64
    k, v, table, used = make_pages(rng, lk, bs, nkv, d)
    table = np.concatenate([table, np.full((len(lk), spare), -5, np.int32)], axis=1)  # never read
    kw = dict(causal=causal)
    if lq is not None:
        cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
        q = rng.uniform(-1, 1, (int(cq[-1]), nh, d)).astype(np.float32)
        kw["cu_seqlens_q"] = cq
    else:
        q = rng.uniform(-1, 1, (len(lk), 16, nh, d)).astype(np.float32)
    if causal and lq is None:
        kw["offset"] = 0  # a cache shorter than the queries: they start at its first row
    t = torch.from_numpy
    tkw = {n: t(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}
    seen = ops_seen()
    with seen:
        out, lse = mn.flash_attn_prefill(t(q), t(k), t(v), block_table=t(table), seqused_k=t(used), return_lse=True,
                                         **tkw)  # fmt: skip
    assert [s for s in seen.seen if "mlx_native" in s] == ["mlx_native.flash_attn_prefill_lse.default"], seen.seen
    assert isinstance(out, torch.Tensor) and out.shape == q.shape and lse.dtype == torch.float32
    ref, ref_lse = reference_paged(q, k, v, block_table=table, seqused_k=used, scale=1 / 8, **kw)
    assert nmse(out.numpy(), ref) < BAR
    assert lse.shape == ref_lse.shape
    seen_rows = np.isfinite(ref_lse)
    assert np.allclose(lse.numpy()[seen_rows], ref_lse[seen_rows], atol=LSE_TOL)
    assert np.isneginf(lse.numpy()[~seen_rows]).all()
    _equal((out.numpy(), lse.numpy()), mn.flash_attn_prefill(q, k, v, block_table=table, seqused_k=used,
                                                             return_lse=True, **kw))  # fmt: skip
    # The operator itself, by keyword (its schema names them).
    direct = torch.ops.mlx_native.flash_attn_prefill(t(q), t(k), t(v), block_table=t(table), seqused_k=t(used), **tkw)
    assert torch.equal(direct, out)


def _paged_block(q, k_cache, v_cache, table, used, cq):
    out, lse = mn.flash_attn_prefill(q * 0.5, k_cache, v_cache, causal=True, cu_seqlens_q=cq, block_table=table,
                                     seqused_k=used, return_lse=True)  # fmt: skip
    return out.float().sum(-1) + 1, lse


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_traces_a_paged_call(rng, backend):
    torch = _torch()
    k, v, table, used = make_pages(rng, [45, 20], 16, 2, 64)
    cq = np.array([0, 12, 30], np.int32)
    t = torch.from_numpy
    q = t(rng.uniform(-1, 1, (30, 4, 64)).astype(np.float32))
    operands = (q, t(k), t(v), t(table), t(used), t(cq))
    torch._dynamo.reset()
    got, got_lse = torch.compile(_paged_block, fullgraph=True, backend=backend)(*operands)
    want, want_lse = _paged_block(*operands)
    assert torch.allclose(got, want, rtol=0, atol=1e-4) and torch.equal(got_lse, want_lse)
    explain = torch._dynamo.explain(_paged_block)(*operands)
    assert explain.graph_break_count == 0 and explain.graph_count == 1


def test_the_fake_kernel_shapes_paged_calls_and_refuses_what_the_real_one_does():
    """Under FakeTensorMode (tracing) the paged operator's outputs have the real call's
    shapes (q's, with v's head dim; lse ``[heads, total_q]``, ``[batch, heads, rows]``), in
    either layout, and what needs no data is refused by name as the real call refuses it."""
    torch = _torch()
    from torch._subclasses.fake_tensor import FakeTensorMode

    i32 = torch.int32
    with FakeTensorMode():
        kc = torch.empty(10, 16, 2, 64, dtype=torch.float16)
        vc = torch.empty(10, 16, 2, 32, dtype=torch.float16)  # v's own head dim
        table, used = torch.empty(3, 4, dtype=i32), torch.empty(3, dtype=i32)
        cq = torch.empty(4, dtype=i32)
        out, lse = mn.flash_attn_prefill(torch.empty(50, 8, 64), kc, vc, causal=True, cu_seqlens_q=cq,
                                         block_table=table, seqused_k=used, return_lse=True)  # fmt: skip
        assert (out.shape, out.dtype, lse.shape, lse.dtype) == ((50, 8, 32), torch.float32, (8, 50), torch.float32)
        out, lse = mn.flash_attn_prefill(torch.empty(3, 40, 8, 64, dtype=torch.bfloat16), kc, vc, block_table=table,
                                         seqused_k=used, return_lse=True, out_dtype=torch.float16)  # fmt: skip
        assert (out.shape, out.dtype, lse.shape) == ((3, 40, 8, 32), torch.float16, (3, 8, 40))
        hnd = mn.flash_attn_prefill(torch.empty(3, 8, 40, 64), kc.transpose(1, 2), kc.transpose(1, 2), causal=True,
                                    layout="HND", block_table=table, seqused_k=used)  # fmt: skip
        assert hnd.shape == (3, 8, 40, 64)
        q4 = torch.empty(3, 40, 8, 64)
        refusals = [
            (mn.UnsupportedDtypeError, ["block_table", "int32"], dict(block_table=table.long(), seqused_k=used)),
            (mn.UnsupportedDtypeError, ["seqused_k", "int32"], dict(block_table=table, seqused_k=used.float())),
            (mn.InvalidArgumentError, ["seqused_k", "block_table"], dict(seqused_k=used)),
            (mn.InvalidArgumentError, ["block_table", "seqused_k"], dict(block_table=table)),
            (mn.InvalidArgumentError, ["3 sequences"], dict(block_table=table[:2], seqused_k=used[:2])),
            (mn.InvalidArgumentError, ["cu_seqlens_k", "seqused_k"],
             dict(block_table=table, seqused_k=used, cu_seqlens_q=cq, cu_seqlens_k=cq, q=torch.empty(50, 8, 64))),
        ]  # fmt: skip
        for cls, words, kw in refusals:
            q = kw.pop("q", q4)
            with pytest.raises(cls) as e:
                mn.flash_attn_prefill(q, kc, kc, **kw)
            assert all(w in str(e.value) for w in words), (words, str(e.value))
        odd = torch.empty(10, 24, 2, 64, dtype=torch.float16)  # a block of 24 rows
        with pytest.raises(mn.InvalidArgumentError, match="block_size"):
            mn.flash_attn_prefill(q4, odd, odd, block_table=table, seqused_k=used)


def test_opcheck_of_the_paged_operator(rng):
    torch = _torch()
    k, v, table, used = make_pages(rng, [40, 17], 16, 2, 64)
    k, v = np.nan_to_num(k), np.nan_to_num(v)  # opcheck compares outputs of repeated runs (NaN != NaN)
    table[table < 0] = 0  # ... and copies the table in ways that need no garbage
    t = torch.from_numpy
    q = t(rng.uniform(-1, 1, (2, 9, 4, 64)).astype(np.float32))
    cq = torch.tensor([0, 5, 9], dtype=torch.int32)
    ops = torch.ops.mlx_native
    for op, args, kw in [
        (ops.flash_attn_prefill.default, (q, t(k), t(v)), dict(causal=True, block_table=t(table), seqused_k=t(used))),
        (ops.flash_attn_prefill_lse.default, (q[0], t(k), t(v)),
         dict(causal=True, cu_seqlens_q=cq, block_table=t(table), seqused_k=t(used))),
    ]:  # fmt: skip
        result = torch.library.opcheck(op, args, kw)
        assert set(result.values()) == {"SUCCESS"}, result


def test_paged_torch_tensors_on_metal_and_cuda_are_not_refused(rng):
    """Paged K/V runs on every backend: through the operator, a Metal device named for CPU
    tensors gets past the paged checks to the device itself (which off macOS does not
    exist); CUDA tensors under FakeTensorMode (which needs no GPU: what torch.compile traces
    on a GPU machine) are shaped as the real call shapes them."""
    torch = _torch()
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v, table, used = _good(rng)
    t = torch.from_numpy
    if "metal" not in mn.backends():
        with pytest.raises(mn.DeviceNotFoundError) as e:
            mn.flash_attn_prefill(t(q), t(k), t(v), block_table=t(table), seqused_k=t(used), device="metal")
        assert "block_table" not in str(e.value), str(e.value)
    with FakeTensorMode():
        qc, kc = torch.empty(2, 8, 4, 64, device="cuda"), torch.empty(10, 16, 2, 64, device="cuda").half()
        tc, uc = torch.empty(2, 3, dtype=torch.int32), torch.empty(2, dtype=torch.int32)
        out = mn.flash_attn_prefill(qc, kc, kc, causal=True, block_table=tc, seqused_k=uc)
        assert tuple(out.shape) == (2, 8, 4, 64) and out.device.type == "cuda"


# ---------------------------------------------------------------------- encoders


def test_a_paged_plan_records_on_an_encoder(rng):
    """``PrefillPlan.encode`` of a paged plan records the plan's own run (its block table
    and lengths with it): several recordings on one encoder, with an explicit mask
    classified, give ``run()``'s bits and the reference's result; an encoder of another
    device is refused by name, and records nothing."""
    k, v, table, used = make_pages(rng, [70, 33], 16, 2, 64)
    q = rng.uniform(-1, 1, (2, 20, 4, 64)).astype(np.float32)
    mask = rng.uniform(-2, 0, (2, 20, 70)).astype(np.float16)
    for m in (None, mask):
        device = mn.Device("cpu")
        plan = mn.PrefillPlan(q, k, v, m, block_table=table, seqused_k=used, return_lse=True, offset=0, causal=True,
                              device=device)  # fmt: skip
        with mn.Device("cpu").encoder() as other:
            with pytest.raises(mn.InvalidArgumentError, match="device"):
                plan.encode(other)
            assert other.pending == 0
        with device.encoder() as enc:
            plan.encode(enc)
            plan.encode(enc, classify=False)
        _equal(plan.encoded_result(), plan.run())
        ref = reference_paged(q, k, v, m, block_table=table, seqused_k=used, offset=0, causal=True, scale=1 / 8)
        assert nmse(plan.encoded_result()[0], ref[0]) < BAR
