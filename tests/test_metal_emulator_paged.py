"""Paged K/V (SPEC 11) in the Metal kernels, run by the CPU emulator (tests/metal_emu) and
dispatched as rust/src/ops/flash_attn_prefill.rs encodes a paged plan on Metal: the
``flash_attn_prefill_paged_*`` entry points with the caches at 2 and 3, the paged block
(PagedKvParamsGpu) at 13, the block table at 14 and ``seqused_k`` at 15, and K/V strides 0
in the params block (test_metal_emulator_prefill.emu_prefill with ``pages``).

Each case is a contiguous prefill of test_metal_emulator_prefill.py whose K and V rows are
scattered into caches of blocks by a shuffled table (shared blocks too), and the paged result
must be the contiguous one's to the bit (SPEC 11), out and lse, besides meeting the float64
reference. Every byte of the caches that no sequence owns is NaN (rows past a sequence's end
in its last block, blocks no table names, the padding between rows, heads and blocks) and
table entries past a sequence's last block are out of range, so a kernel that read one would
turn the output non-finite or fault; the caches end at their last element."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import pytest

from mlx_native.reference import nmse, reference_paged

from test_metal_emulator_prefill import (
    BF16,
    EXPECTED,
    F16,
    LSE_TOLERANCE,
    _el,
    _nan_base,
    _span,
    cdiv,
    check,
    emu_prefill,
    fixed_case,
    same_bits,
    varlen_case,
)

PAGED_FORMAT = "<6q4i"  # PagedKvParamsGpu: three K strides, three V strides, four words


@dataclass
class Pages:
    """Paged caches ``[num_blocks, block_size, kv_heads, D]`` (views into NaN buffers), the
    table ``[batch, max_blocks]`` and the lengths ``[batch]``, as the op binds them."""

    k_cache: np.ndarray
    v_cache: np.ndarray
    table: np.ndarray
    used: np.ndarray

    @property
    def k_buf(self) -> np.ndarray:
        return _span(self.k_cache)

    @property
    def v_buf(self) -> np.ndarray:
        return _span(self.v_cache)

    @property
    def block(self) -> bytes:
        k, v = self.k_cache, self.v_cache
        return struct.pack(PAGED_FORMAT, *(_el(k, a) for a in range(3)), *(_el(v, a) for a in range(3)), k.shape[0],
                           k.shape[1], self.table.shape[1], self.table.shape[0])  # fmt: skip


def _rows(c, b: int, which: str) -> np.ndarray:
    x = getattr(c, which)
    return x[c.cu_k[b] : c.cu_k[b + 1]] if c.varlen else x[b]


def paginate(rng, c, bs: int, *, used: Optional[Sequence[int]] = None, shared: int = 0, spare: int = 3) -> Pages:
    """``c``'s K and V rows in blocks of ``bs`` rows, in shuffled order among ``spare`` blocks
    no table names; ``used``: each sequence's cache length (default: all its rows).
    ``shared``: sequence 1's first ``shared`` blocks are sequence 0's (their rows are made
    equal in ``c`` first, so the contiguous case is the same prefill)."""
    batch = c.batch
    lens = [int(c.cu_k[b + 1] - c.cu_k[b]) for b in range(batch)] if c.varlen else [c.kv_len] * batch
    used = np.array(lens if used is None else used, np.int32)
    if shared:
        n = shared * bs
        assert min(used[0], used[1]) >= n
        for which in ("k", "v"):
            _rows(c, 1, which)[:n] = _rows(c, 0, which)[:n]
    blocks = [cdiv(int(u), bs) for u in used]
    own = sum(blocks) - (shared if shared else 0)
    num_blocks = own + spare
    ids = iter(rng.permutation(num_blocks)[:own].tolist())
    max_blocks = max(blocks, default=0) + 2
    table = np.array(rng.choice([-7, num_blocks, 10**6], size=(batch, max_blocks)), np.int32)  # never read
    for b in range(batch):
        for i in range(blocks[b]):
            table[b, i] = table[0, i] if b == 1 and i < shared else next(ids)
    nkv, hd, hdv = c.k.shape[-2], c.k.shape[-1], c.v.shape[-1]
    kb = _nan_base((num_blocks, bs + 1, nkv + 1, hd + 3), c.k.dtype)
    vb = _nan_base((num_blocks, bs + 2, nkv, hdv + 1), c.v.dtype)
    k_cache, v_cache = kb[:, 1:, 1:, 2 : 2 + hd], vb[:, :bs, :, :hdv]
    for b in range(batch):
        j = np.arange(int(used[b]))
        k_cache[table[b, j // bs], j % bs] = _rows(c, b, "k")[j]
        v_cache[table[b, j // bs], j % bs] = _rows(c, b, "v")[j]
    return Pages(k_cache, v_cache, table, used)


def same_as_contiguous(emu, c, pages: Pages, **kw):
    """The paged run of ``c`` and its contiguous run, bit for bit (out and lse); returns the
    paged (out, lse, blk)."""
    out, lse, blk = emu_prefill(emu, c, **kw)
    p_out, p_lse, _ = emu_prefill(emu, c, pages=pages, blk=blk, **kw)
    assert same_bits(p_out, out), "paged out is not the contiguous layout's"
    if c.lse:
        assert same_bits(p_lse, lse), "paged lse is not the contiguous layout's"
    return p_out, p_lse, blk


# -- block sizes 16 to 256, variable length, GQA ---------------------------------------------------


@pytest.mark.parametrize(
    "bs,hd,kv_dtype",
    [(16, 64, F16), (48, 256, BF16), (256, 512, F16), (80, 576, BF16)],
    ids=["bs16-d64", "bs48-d256-bf16", "bs256-d512", "bs80-d576-bf16"],
)
def test_variable_length_is_the_contiguous_layout_to_the_bit(emu, rng, bs, hd, kv_dtype):
    # Steps spanning four blocks (16), two (48, 80: a block edge inside a step), or lying in
    # one (256); partial last blocks and steps, an empty prompt, a cache of 5 rows; K and V of
    # 512 columns staged in 16 slices (d512, d576/512), GQA 2.
    hdv = 512 if hd == 576 else hd
    c = varlen_case(rng, lq=[9, 0, 20], lk=[40, 5, 150], nh=4, nkv=2, hd=hd, hdv=hdv, kv_dtype=kv_dtype, causal=True,
                    scale=0.5)  # fmt: skip
    pages = paginate(rng, c, bs)
    out, lse, _ = same_as_contiguous(emu, c, pages)
    check(c, out, lse)


def test_fixed_length_with_a_mask_a_window_and_shared_blocks(emu, rng):
    # Two sequences of one cache length whose first two blocks are the same blocks (a shared
    # prefix), an explicit mask per sequence with all three tile classes, causal with a
    # window; bits as contiguous, then the reference.
    c = fixed_case(rng, batch=2, rows=37, kv=150, nh=2, nkv=1, hd=128, mask="per-batch", causal=True, window=70,
                   scale=0.5)  # fmt: skip
    pages = paginate(rng, c, 32, shared=2)
    assert (pages.table[0, :2] == pages.table[1, :2]).all()
    out, lse, blk = same_as_contiguous(emu, c, pages)
    assert {0, 1, 2} <= set(np.unique(blk).tolist())
    check(c, out, lse)


def test_offset_sinks_transforms_and_fully_masked_rows(emu, rng):
    # An explicit query offset, softcap, ALiBi from max_bias, sinks, and rows whose mask is
    # all -inf (zeros with lse their sink) and rows before the offset sees anything.
    c = fixed_case(rng, batch=2, rows=20, kv=100, nh=3, nkv=1, hd=64, mask="per-batch", causal=True, offset=-5,
                   softcap=4.0, max_bias=2.0, sinks=rng.uniform(-2, 2, 3).astype(np.float32), scale=0.5)  # fmt: skip
    c.mask[0, [2, 11]] = -np.inf
    pages = paginate(rng, c, 16)
    out, lse, _ = same_as_contiguous(emu, c, pages)
    check(c, out, lse)
    assert (out[0, [2, 11]].view(np.uint32) == 0).all()
    assert (lse[0][:, [2, 11]] == c.sinks[:, None]).all()


def test_sequences_of_their_own_lengths_against_the_reference(emu, rng):
    # Fixed-length queries with each sequence's own cache length (seqused_k; the buffers hold
    # the longest): 130, 0 (zeros, lse -inf), 64 (one whole step), 77; causal placed by an
    # offset so that a cache shorter than the prompt is allowed.
    used = [130, 0, 64, 77]
    c = fixed_case(rng, batch=4, rows=33, kv=130, nh=4, nkv=2, hd=96, causal=True, offset=20, scale=0.5)
    pages = paginate(rng, c, 64, used=used)
    out, lse, _ = emu_prefill(emu, c, pages=pages)
    ref, ref_lse = reference_paged(c.q, pages.k_cache, pages.v_cache, block_table=pages.table, seqused_k=pages.used,
                                   causal=True, offset=20, scale=0.5)  # fmt: skip
    assert np.isfinite(out).all()
    assert nmse(out, ref) < EXPECTED[np.dtype(np.float32)]
    seen = np.isfinite(ref_lse)
    assert (out[1].view(np.uint32) == 0).all() and (lse[1] == -np.inf).all()
    assert np.array_equal(seen, np.isfinite(lse))
    assert np.abs(lse[seen] - ref_lse[seen]).max() < LSE_TOLERANCE


def test_schedules_and_layouts_change_no_bit(emu, rng):
    c = varlen_case(rng, lq=[5, 18], lk=[70, 18], nh=2, nkv=1, hd=32, causal=True, window=9)
    pages = paginate(rng, c, 16)
    base, base_lse, _ = emu_prefill(emu, c, pages=pages)
    for kw in (dict(schedule="reverse"), dict(schedule="random:3", layout_seed=5)):
        out, lse, _ = emu_prefill(emu, c, pages=pages, **kw)
        assert same_bits(out, base) and same_bits(lse, base_lse), kw


@pytest.mark.parametrize("seed", range(3))
def test_fuzzed_tables(emu, rng, seed):
    # Random block sizes, lengths, shared prefixes and tables: paged equals contiguous.
    r = np.random.default_rng(1000 + seed)
    bs = int(r.choice([16, 32, 48, 64, 112, 128, 256]))
    lk = [int(x) for x in r.integers(1, 200, size=3)]
    lk[1] = max(lk[1], lk[0]) if seed == 0 else lk[1]
    lq = [int(min(x, r.integers(1, 40))) for x in lk]
    c = varlen_case(rng, lq=lq, lk=lk, nh=2, nkv=2, hd=48, causal=bool(seed % 2), scale=0.5)
    shared = min(lk[0], lk[1]) // bs if seed == 0 else 0
    pages = paginate(rng, c, bs, shared=shared)
    out, lse, _ = same_as_contiguous(emu, c, pages)
    check(c, out, lse, cpu=False)
