"""flash_attn_prefill's Metal kernels (SPEC 6-9: batches of fixed and variable length,
described causal and window masks with the prompt at the cache's end or an explicit query
offset, an explicit mask and its tile tables, lse, Q and O dtypes) run by the CPU emulator (tests/metal_emu, docs/metal.md), dispatched exactly as
rust/src/ops/flash_attn_prefill.rs encodes them (bindings, params block packed like the Rust
struct, threadgroup memory, grid), against the float64 reference and the CPU backend.

Every input lives in a larger buffer whose bytes outside the view are NaN, and the K/V
buffers end at the last cache row they hold: a kernel that read a row past a sequence's cache
(or any element outside a view) would fault or turn the output non-finite. Every output
lives in a larger buffer of sentinel values: only the view may change, and all of it must.

The CPU backend's form of this op is not in this tree yet; until it is, the CPU check runs the
origin op (flash_attn_prefill_tensor_f16) on each sequence with the explicit mask that
expresses it (the description as 0 / -inf, plus the explicit mask, padded to a multiple of 64
with zero K/V rows and -inf columns)."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pytest

import metal_emu
import mlx_native as mx
from mlx_native.dtypes import bfloat16_dtype
from mlx_native.reference import merge_reference, nmse, peer_mask, reference_prefill, visible_mask

from helpers import LowLevelCase, _span, cpu_fma_kernels, run_low_level

BF16 = bfloat16_dtype()
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
DTYPE_CODE = {F32: 0, F16: 1, BF16: 2}

# PREFILL_* (rust/src/params.rs)
CAUSAL, MASK, VARLEN, LSE, OFFSET, SINKS, WINDOW_RIGHT, ALIBI_SLOPES, PAGED = 1, 2, 4, 8, 16, 32, 64, 128, 256
DESCALE = 512
# Quantised K/V's kv_dtype codes (rust/src/dtypes.rs), by format name (SPEC 11).
KV_CODE = {"float8_e4m3fn": 7, "float8_e5m2": 8, "q8_0": 9}

THREADS = (32, 8, 1)
STEP = 64
# Query rows per threadgroup by Q/K head dim (the op's mask_tile_rows).
BQ = {d: 32 for d in (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256)} | {512: 16, 576: 16}
MASK_BLK = "flash_attn_prefill_mask_blk"
# FlashAttnPrefillParamsGpu: 17 i64, 14 i32, scale, offset, head_dim_v, kv_dtype, softcap, max_bias
PREFILL_FORMAT = "<17q14ifi2i2f2i"


def threadgroup_memory(hd: int) -> int:
    """The op's threadgroup_memory_bytes at Q/K head dim ``hd``: queries, scores,
    probabilities, row scales and the rescale flag of a tile of BQ[hd] rows, padded to 16."""
    bq = BQ[hd]
    return cdiv(bq * hd * 2 + bq * STEP * (4 + 2) + bq * 4 + 4, 16) * 16


def quant_threadgroup_memory(hd: int) -> int:
    """The op's quant_threadgroup_memory_bytes: a K sub-tile of 16 rows (8 where 16 do not fit
    the scores' and probabilities' memory) widened to half, from the scores' offset on."""
    bq = BQ[hd]
    k_rows = 16 if 16 * hd * 2 <= bq * STEP * 6 else 8
    return cdiv(bq * hd * 2 + max(bq * STEP * (4 + 2) + bq * 4 + 4, k_rows * hd * 2), 16) * 16


def kernel_name(hd: int, hdv: int, kv_dtype, paged: bool = False, kv_format: Optional[str] = None) -> str:
    """The op's kernel of a (Q/K, V) head dim pair and K/V dtype (HEAD_DIMS); ``paged``: its
    Metal entry point for paged K/V (PAGED_KERNELS); ``kv_format``: quantised K/V's
    (QUANT_KV_KERNELS, whatever the format)."""
    name = f"flash_attn_prefill_{'paged_' if paged else ''}d{hd}" + (f"_{hdv}" if hdv != hd else "")
    if kv_format is not None:
        return name + "_kvq"
    return name + ("_bf16" if np.dtype(kv_dtype) == BF16 else "")
MASK_BLK_FORMAT = "<2q6i"  # FlashAttnPrefillMaskBlkParamsGpu

# Against the float64 reference (SPEC bar 5e-4), by output dtype; the F16 and BF16 bars are
# those of rounding the F32 result once.
EXPECTED = {F32: 1e-5, F16: 1e-5, BF16: 5e-5}
LSE_TOLERANCE = 2e-3  # SPEC 8, absolute
CPU_AGREEMENT = 1e-10  # against the CPU backend, which computes the same rounded steps
# With softcap or ALiBi the two compute tanh and the slopes each their own way: an ulp apart
# in a score moves P's rounding to half by a half ulp on the odd element.
CPU_AGREEMENT_TRANSFORMS = 1e-8
SENTINEL = -1024.0  # exact in F32, F16 and BF16; no output comes near it


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# -- cases -------------------------------------------------------------------------------------


@dataclass
class Prefill:
    """One prefill: views of Q, K, V (and the explicit mask) into larger NaN-filled buffers.
    Fixed length: q [B, rows, H, D], k/v [B, kv, Hkv, D], mask [1 or B, rows, kv]. Variable
    length: q [total_q, H, D], k/v [total_k, Hkv, D], cu_q / cu_k int32 [B + 1]."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    mask: Optional[np.ndarray] = None
    cu_q: Optional[np.ndarray] = None
    cu_k: Optional[np.ndarray] = None
    causal: bool = False
    window: int = 0
    # Query row r of each sequence at r + offset of its cache (PREFILL_OFFSET); None: the
    # prompt is the cache's end (offset Lk - Lq).
    offset: Optional[int] = None
    scale: float = 1.0
    lse: bool = True
    o_dtype: np.dtype = F32
    # The K and V buffers as bound (default: the views' spans, ending at the last cache row).
    k_buf: Optional[np.ndarray] = None
    v_buf: Optional[np.ndarray] = None
    # SPEC 10: softcap, ALiBi's max_bias, float32 sinks [H].
    softcap: float = 0.0
    max_bias: float = 0.0
    sinks: Optional[np.ndarray] = None
    # Issue 28: a two-sided window's right side (None: none but causal's), ALiBi slopes as
    # data (float32 [H] or [B, H]).
    window_right: Optional[int] = None
    alibi: Optional[np.ndarray] = None
    # SPEC 11: quantised K/V (k and v uint8 views of the bytes, strides in bytes): the format
    # (KV_CODE's names), and FP8's descale factors float32 [2, Hkv] (K's, then V's).
    kv_format: Optional[str] = None
    descale: Optional[np.ndarray] = None

    @property
    def window_arg(self):
        """The front door's / reference's ``window``: the int of a causal window, or the
        ``(left, right)`` pair of a two-sided one."""
        if self.window_right is None and (self.causal or not self.window):
            return self.window or None
        return (self.window - 1 if self.window else -1, -1 if self.window_right is None else self.window_right)

    @property
    def varlen(self) -> bool:
        return self.cu_q is not None

    @property
    def head_dim(self) -> int:
        return self.q.shape[-1]

    @property
    def head_dim_v(self) -> int:
        return self.v.shape[-1] // 34 * 32 if self.kv_format == "q8_0" else self.v.shape[-1]

    @property
    def n_heads(self) -> int:
        return self.q.shape[-2]

    @property
    def batch(self) -> int:
        return len(self.cu_q) - 1 if self.varlen else self.q.shape[0]

    @property
    def rows(self) -> int:
        """Query rows of each sequence (fixed), or of all (variable length)."""
        return self.q.shape[0] if self.varlen else self.q.shape[1]

    @property
    def kv_len(self) -> int:
        return self.k.shape[0] if self.varlen else self.k.shape[1]

    def sequences(self):
        """(q rows, k rows) slices of each sequence, and its (q, k, v, mask) views."""
        for b in range(self.batch):
            if self.varlen:
                qs, ks = slice(self.cu_q[b], self.cu_q[b + 1]), slice(self.cu_k[b], self.cu_k[b + 1])
                yield (qs, ks), (self.q[qs], self.k[ks], self.v[ks], None)
            else:
                m = None if self.mask is None else self.mask[b if self.mask.shape[0] > 1 else 0]
                yield (b, b), (self.q[b], self.k[b], self.v[b], m)

    def with_(self, **kw) -> "Prefill":
        return Prefill(**{**self.__dict__, **kw})


def _values(rng, shape, dtype) -> np.ndarray:
    return rng.uniform(-1, 1, size=shape).astype(np.float32).astype(dtype)


def _nan_base(shape, dtype) -> np.ndarray:
    """NaN of ``dtype``; bytes (quantised K/V) 0x7f, NaN in both FP8 formats (and 0x7f7f, a
    Q8_0 block's scale, a NaN half)."""
    if np.dtype(dtype) == np.uint8:
        return np.full(shape, 0x7F, np.uint8)
    return np.full(shape, np.nan, np.float32).astype(dtype)


def _qkv(rng, lead, rows, kv, nh, nkv, hd, q_dtype, hdv=None, kv_dtype=F16, v_in_k=False):
    """Q, K, V views with padded row, head and element axes around them (NaN outside); V
    of ``hdv`` columns (default ``hd``), or the view of K's first ``hdv`` columns."""
    hdv = hd if hdv is None else hdv
    qb = _nan_base((*lead, rows + 1, nh + 1, hd + 8), q_dtype)
    q = qb[..., 1:, :nh, 4 : 4 + hd]
    q[...] = _values(rng, q.shape, q_dtype)
    kb = _nan_base((*lead, kv + 3, nkv, hd + 2), kv_dtype) if lead else _nan_base((kv, nkv, hd + 2), kv_dtype)
    k = kb[..., :kv, :, 1 : 1 + hd]
    k[...] = _values(rng, k.shape, kv_dtype)
    if v_in_k:
        return q, k, k[..., :hdv]
    vb = _nan_base((*lead, kv + 3, nkv + 1, hdv), kv_dtype) if lead else _nan_base((kv, nkv + 1, hdv), kv_dtype)
    v = vb[..., :kv, 1:, :]
    v[...] = _values(rng, v.shape, kv_dtype)
    return q, k, v


def fixed_case(rng, *, batch, rows, kv, nh, nkv, hd, q_dtype=F32, mask=None, hdv=None, kv_dtype=F16, v_in_k=False,
               **kw) -> Prefill:  # fmt: skip
    """``mask``: None, "shared" (one mask for every sequence) or "per-batch"; peer masks
    (all three tile classes)."""
    q, k, v = _qkv(rng, (batch,), rows, kv, nh, nkv, hd, q_dtype, hdv, kv_dtype, v_in_k)
    m = None
    if mask is not None:
        n = 1 if mask == "shared" else batch
        mb = _nan_base((n, rows + 1, kv + 5), F16)
        m = mb[:, :rows, 2 : 2 + kv]
        for i in range(n):
            m[i] = peer_mask(rows, kv, rng)
            if rows >= BQ[hd] and kv >= 2 * STEP:
                m[i, :, :STEP] = -np.inf  # a skipped tile and a mask-free one, whatever the draw
                m[i, : BQ[hd], STEP : 2 * STEP] = 0
    return Prefill(q, k, v, m, **kw)


def varlen_case(rng, *, lq, lk, nh, nkv, hd, q_dtype=F32, hdv=None, kv_dtype=F16, **kw) -> Prefill:
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q, k, v = _qkv(rng, (), int(cu_q[-1]), int(cu_k[-1]), nh, nkv, hd, q_dtype, hdv, kv_dtype)
    return Prefill(q, k, v, cu_q=cu_q, cu_k=cu_k, **kw)


# -- dispatching like the op -------------------------------------------------------------------


def _el(x: np.ndarray, axis: int) -> int:
    return x.strides[axis] // x.itemsize


def _start(view: np.ndarray, base: np.ndarray) -> int:
    """The element of ``base`` (flat) where the view starts."""
    return (view.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // base.itemsize


def _from(view: np.ndarray, base: np.ndarray) -> np.ndarray:
    """The flat memory of ``base`` from the view's first element to the base's end."""
    return base.reshape(-1)[_start(view, base) :]


def emu_mask_blk(emu, mask: np.ndarray, bq: int, **kw) -> np.ndarray:
    """flash_attn_prefill_mask_blk as the op dispatches it over masks [n, rows, kv] (a view);
    returns the tables [n, ceil(rows / bq), ceil(kv / 64)]."""
    n, rows, kv = mask.shape
    steps = cdiv(kv, STEP)
    table = np.full((n, cdiv(rows, bq), steps), 0xEE, np.uint8)  # every byte must be written
    params = struct.pack(MASK_BLK_FORMAT, _el(mask, 0) if n > 1 else 0, _el(mask, 1), n, rows, kv, bq, STEP, steps)
    res = emu.dispatch(MASK_BLK, (steps, cdiv(rows, bq), n), (32, 1, 1), buffers={1: _span(mask), 2: table},
                       constants={0: params}, **kw)  # fmt: skip
    return res[2]


def emu_prefill(emu, c: Prefill, *, blk=None, tg_memory=None, pages=None, **kw):
    """flash_attn_prefill as the op encodes it (threadgroup memory: the op's unless given);
    the explicit mask's tables from the emulated classifier unless given. Checks that only
    the output views changed, and all of them. Returns (out, lse or None, blk or None).

    ``pages``: paged K/V (SPEC 11; test_metal_emulator_paged.py's ``Pages``) holding the
    rows of ``c``'s K and V: the paged entry point with the caches at 2 and 3, their block
    (``pages.block``) at 13, the table at 14 and the lengths at 15, and K/V strides 0 in the
    params block, as the op binds them."""
    hd, hdv, nh, bq = c.head_dim, c.head_dim_v, c.n_heads, BQ[c.head_dim]
    nkv = c.k.shape[-2]
    batch, rows, kv = c.batch, c.rows, c.kv_len
    if c.varlen:
        ob = np.full((rows + 2, nh, hdv + 4), SENTINEL, np.float32).astype(c.o_dtype)
        o_sl = (slice(0, rows), slice(None), slice(2, 2 + hdv))
        lb = np.full((nh + 1, rows + 3), SENTINEL, np.float32)
        l_sl = (slice(0, nh), slice(1, rows + 1))
        max_rows = int(np.diff(c.cu_q).max(initial=0))
    else:
        ob = np.full((batch, rows + 2, nh, hdv + 4), SENTINEL, np.float32).astype(c.o_dtype)
        o_sl = (slice(None), slice(0, rows), slice(None), slice(2, 2 + hdv))
        lb = np.full((batch, nh + 1, rows + 3), SENTINEL, np.float32)
        l_sl = (slice(None), slice(0, nh), slice(1, rows + 1))
        max_rows = rows
    o, lse = ob[o_sl], lb[l_sl]

    def strides3(x):  # batch, row, head strides in elements (batch 0 with variable length)
        return (0, _el(x, 0), _el(x, 1)) if c.varlen else (_el(x, 0), _el(x, 1), _el(x, 2))

    flags = (CAUSAL if c.causal else 0) | (MASK if c.mask is not None else 0)
    flags |= (VARLEN if c.varlen else 0) | (LSE if c.lse else 0) | (OFFSET if c.offset is not None else 0)
    flags |= SINKS if c.sinks is not None else 0
    right = c.window_right is not None and not c.causal
    flags |= (WINDOW_RIGHT if right else 0) | (ALIBI_SLOPES if c.alibi is not None else 0)
    flags |= PAGED if pages is not None else 0
    flags |= DESCALE if c.descale is not None else 0
    kv_strides = (lambda x: (0, 0, 0)) if pages is not None else strides3
    alibi_stride = nh if c.alibi is not None and np.asarray(c.alibi).ndim == 2 else 0
    blk_rows, blk_steps = cdiv(rows, bq), cdiv(kv, STEP)
    mask_strides = (0, 0)
    if c.mask is not None:
        mask_strides = (_el(c.mask, 0) if c.mask.shape[0] > 1 else 0, _el(c.mask, 1))
        if blk is None:
            blk = emu_mask_blk(emu, c.mask, bq)
    lse_strides = ((0, _el(lse, 0)) if c.varlen else (_el(lse, 0), _el(lse, 1))) if c.lse else (0, 0)
    params = struct.pack(
        PREFILL_FORMAT,
        *strides3(c.q), *kv_strides(c.k), *kv_strides(c.v), *strides3(o),
        *mask_strides, *lse_strides,
        blk_rows * blk_steps if c.mask is not None and mask_strides[0] != 0 else 0,
        batch, rows, kv, nh, nkv, hd, max_rows, c.window, flags,
        DTYPE_CODE[c.q.dtype], DTYPE_CODE[c.o_dtype], blk_rows, blk_steps, bq, c.scale, c.offset or 0,
        hdv, KV_CODE[c.kv_format] if c.kv_format else DTYPE_CODE[c.k.dtype], c.softcap, c.max_bias, c.window_right if right else 0, alibi_stride,
    )  # fmt: skip
    assert len(params) == 224
    qbuf = _span(c.q)
    buffers = {
        1: qbuf,
        2: _span(c.k) if c.k_buf is None else c.k_buf,
        3: _span(c.v) if c.v_buf is None else c.v_buf,
        4: _span(c.mask) if c.mask is not None else qbuf,
        5: blk if c.mask is not None else qbuf,
        6: _from(o, ob),
        7: _from(lse, lb) if c.lse else qbuf,
        8: c.cu_q if c.varlen else qbuf,
        9: c.cu_k if c.varlen else qbuf,
        10: np.asarray(c.sinks, np.float32) if c.sinks is not None else qbuf,
        12: np.ascontiguousarray(c.alibi, np.float32).reshape(-1) if c.alibi is not None else qbuf,
    }  # fmt: skip
    constants = {0: params}
    if c.kv_format is not None:  # the descale factors, or Q bound unread (as the op binds them)
        buffers[16] = np.ascontiguousarray(c.descale, np.float32).reshape(-1) if c.descale is not None else qbuf
    if pages is not None:
        buffers.update({2: pages.k_buf, 3: pages.v_buf, 14: pages.table, 15: pages.used})
        constants[13] = pages.block
    if batch > 0 and max_rows > 0:
        res = emu.dispatch(
            kernel_name(hd, hdv, c.k.dtype, pages is not None, c.kv_format), (cdiv(max_rows, bq), nh, batch), THREADS,
            buffers=buffers, constants=constants,
            threadgroup_memory={0: tg_memory or (quant_threadgroup_memory if c.kv_format else threadgroup_memory)(hd)},
            **kw,
        )  # fmt: skip
        ob = _put_back(ob, o, res[6])
        lb = _put_back(lb, lse, res[7]) if c.lse else lb
    sentinel = np.array(SENTINEL, np.float32).astype(c.o_dtype).view(np.uint16 if c.o_dtype.itemsize == 2 else np.uint32)
    _only_the_view_changed(ob, o_sl, sentinel, "out")
    if c.lse:
        _only_the_view_changed(lb, l_sl, np.array(SENTINEL, np.float32).view(np.uint32), "lse")
    return ob[o_sl], (lb[l_sl] if c.lse else None), blk


def _put_back(base, view, flat):
    """The base array with its memory from the view's first element replaced by ``flat``."""
    out = base.copy()
    out.reshape(-1)[_start(view, base) :] = flat
    return out


def _only_the_view_changed(base, sl, sentinel_bits, what):
    bits = base.view(sentinel_bits.dtype)
    inside = np.zeros(base.shape, bool)
    inside[sl] = True
    assert (bits[~inside] == sentinel_bits).all(), f"{what}: an element outside the view was written"
    assert not (bits[inside] == sentinel_bits).any(), f"{what}: an element of the view was not written"


def placed(lq: int, lk: int, causal: bool, window: int, offset: Optional[int]) -> np.ndarray:
    """SPEC 6 with the query rows at ``r + offset`` of the cache (None: ``lk - lq``): bool
    ``[lq, lk]``, True where row r sees cache row j."""
    r = np.arange(lq)[:, None] + (lk - lq if offset is None else offset)
    j = np.arange(lk)[None, :]
    ok = np.ones((lq, lk), dtype=bool)
    if causal:
        ok &= j <= r
    if window:
        ok &= j > r - window
    return ok


def reference(c: Prefill):
    return reference_prefill(
        c.q, c.k, c.v, c.mask, causal=c.causal, window=c.window_arg, scale=c.scale,
        cu_seqlens_q=c.cu_q, cu_seqlens_k=c.cu_k, offset=c.offset,
        softcap=c.softcap, max_bias=c.max_bias, sinks=c.sinks, alibi_slopes=c.alibi,
    )  # fmt: skip


def cpu_origin(c: Prefill) -> np.ndarray:
    """The CPU backend's origin op on each sequence, with the explicit mask that expresses it;
    float32, shaped like q."""
    out = np.zeros(c.q.shape, np.float32)
    dev = mx.Device("cpu")
    for (qs, _), (q, k, v, m) in c.sequences():
        lq, lk = q.shape[0], k.shape[0]
        if lq == 0 or lk == 0:
            continue
        kvp = mx.kv_pad(lk)
        kp = np.zeros((kvp, *k.shape[1:]), np.float16)
        vp = np.zeros((kvp, *v.shape[1:]), np.float16)
        kp[:lk], vp[:lk] = k, v
        seen = placed(lq, lk, c.causal, c.window, c.offset)
        full = np.full((lq, kvp), -np.inf, np.float16)
        full[:, :lk] = np.where(seen, 0 if m is None else m, -np.inf)
        qf = np.ascontiguousarray(q, dtype=np.float32)
        case = LowLevelCase(qf, kp, vp, full, lk, c.scale, qf, kp, vp)
        out[qs] = run_low_level(dev, case)[0]
    return out


def cpu_front_door(c: Prefill) -> np.ndarray:
    """The CPU backend's flash_attn_prefill on the same views; float32, shaped like out."""
    out = mx.flash_attn_prefill(
        c.q, c.k, c.v, c.mask, causal=c.causal, window=c.window_arg, scale=c.scale, cu_seqlens_q=c.cu_q,
        cu_seqlens_k=c.cu_k, out_dtype=np.float32, device="cpu", softcap=c.softcap, max_bias=c.max_bias,
        sinks=c.sinks, alibi_slopes=c.alibi, offset=c.offset,
    )  # fmt: skip
    return np.asarray(out)


def _origin_expresses(c: Prefill) -> bool:
    """Whether the origin op (F16 K/V, head dim 256 or 512, no SPEC 10) computes the case."""
    plain = c.softcap == 0 and c.max_bias == 0 and c.sinks is None and c.alibi is None and c.window_right is None
    plain = plain and (c.causal or not c.window)
    return plain and c.head_dim in (256, 512) and c.head_dim_v == c.head_dim and c.k.dtype == F16


def check(c: Prefill, out, lse, *, cpu=True):
    """out against the reference (and the CPU backend), lse within SPEC 8's tolerance, rows
    that see nothing +0 with lse -inf."""
    ref, ref_lse = reference(c)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    err = nmse(out, ref)
    assert err < EXPECTED[c.o_dtype], f"nmse {err:.3e} against the reference"
    unseen = ~np.isfinite(ref_lse)  # [.., H, rows]
    if c.sinks is not None:  # a row that sees nothing has lse = its sink
        unseen = _sees_nothing(c)
    unseen_out = np.moveaxis(unseen, -1, -2)  # [.., rows, H]
    assert (np.asarray(out, np.float32)[unseen_out].view(np.uint32) == 0).all(), "a row that sees nothing is not +0"
    if lse is not None:
        if c.sinks is None:
            assert (lse[unseen] == -np.inf).all(), "the lse of a row that sees nothing is not -inf"
        else:
            sig = np.broadcast_to(np.asarray(c.sinks, np.float32)[:, None], lse.shape)
            assert (lse[unseen] == sig[unseen]).all(), "the lse of a row that sees nothing is not its sink"
        assert np.isfinite(lse[~unseen]).all()
        off = np.abs(lse[~unseen] - ref_lse[~unseen]).max(initial=0)
        assert off < LSE_TOLERANCE, f"lse off by {off:.3e}"
    if cpu and c.o_dtype == F32:
        with cpu_fma_kernels():
            err = nmse(out, cpu_origin(c) if _origin_expresses(c) else cpu_front_door(c))
        bar = CPU_AGREEMENT if c.softcap == 0 and c.max_bias == 0 else CPU_AGREEMENT_TRANSFORMS
        assert err < bar, f"nmse {err:.3e} against the CPU backend"


def _sees_nothing(c: Prefill) -> np.ndarray:
    """Where a (head, row) sees no cache row, ``[.., H, rows]`` like lse: the reference's lse
    without the sinks is -inf there."""
    _, plain = reference(c.with_(sinks=None))
    return ~np.isfinite(plain)


def same_bits(a, b) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


# -- batches, variable length, the described mask ----------------------------------------------


@pytest.mark.parametrize(
    "hd,batch,rows,kv,nh,nkv,scale",
    [(256, 2, 37, 100, 4, 2, 0.6), (512, 3, 20, 77, 2, 1, 1.0)],
)
def test_fixed_batches_with_strides(emu, rng, hd, batch, rows, kv, nh, nkv, scale):
    # Causal with an offset (kv > rows), partial query tiles and a partial last step; each
    # sequence's cache is followed by NaN rows and the last one by the buffer's end.
    c = fixed_case(rng, batch=batch, rows=rows, kv=kv, nh=nh, nkv=nkv, hd=hd, causal=True, scale=scale)
    out, lse, _ = emu_prefill(emu, c)
    check(c, out, lse)


@pytest.mark.parametrize(
    "hd,lq,lk,causal,window",
    [
        (256, [17, 0, 33, 5], [40, 7, 33, 70], True, 20),  # an empty prompt, offsets 23, 0, 65
        (512, [9, 20, 0, 4], [0, 70, 5, 64], False, 0),  # a sequence with no cache: zeros, lse -inf
    ],
)
def test_variable_length(emu, rng, hd, lq, lk, causal, window):
    c = varlen_case(rng, lq=lq, lk=lk, nh=2, nkv=1 if causal else 2, hd=hd, causal=causal, window=window)
    out, lse, _ = emu_prefill(emu, c)
    check(c, out, lse)
    for b, (l, n) in enumerate(zip(lq, lk)):
        if n == 0:
            rows = slice(c.cu_q[b], c.cu_q[b + 1])
            assert (out[rows].view(np.uint32) == 0).all() and (lse[:, rows] == -np.inf).all()


@pytest.mark.parametrize("hd,rows,kv,window", [(256, 40, 150, 30), (512, 33, 100, 50), (256, 70, 70, 1)])
def test_causal_window_with_an_offset(emu, rng, hd, rows, kv, window):
    # Windows shorter than a step, spanning steps, and of one row (each row sees itself only).
    c = fixed_case(rng, batch=1, rows=rows, kv=kv, nh=2, nkv=1, hd=hd, causal=True, window=window)
    out, lse, _ = emu_prefill(emu, c)
    check(c, out, lse)


@pytest.mark.parametrize(
    "hd,rows,kv,window",
    [
        (256, 64, 97, 0),  # offset 33: row 31, the last of tile 0, alone sees cache row 64 (step 1's first)
        (256, 64, 128, 34),  # offset 64: row 32, the first of tile 1, alone sees cache row 63 (step 0's last)
        (512, 32, 81, 0),  # offset 49: row 15 alone sees cache row 64
        (512, 32, 96, 18),  # offset 64: row 16 alone sees cache row 63
    ],
)
def test_a_step_one_edge_row_alone_sees_is_computed(emu, rng, hd, rows, kv, window):
    # The described class of a step for a tile: some pair is visible iff the step meets
    # [lo(first row), hi(last row)]. Here that span touches the step in one cache row only.
    # A small scale keeps every p of a row well above half's smallest value, so the one pair
    # counts whatever the draw.
    c = fixed_case(rng, batch=1, rows=rows, kv=kv, nh=2, nkv=1, hd=hd, causal=True, window=window, scale=0.05)
    out, lse, _ = emu_prefill(emu, c)
    check(c, out, lse)


def _explicit(c: Prefill) -> Prefill:
    """The same prefill with its description given as an explicit 0 / -inf mask (per
    sequence, in a NaN-padded buffer) and nothing described."""
    mb = _nan_base((c.batch, c.rows + 1, c.kv_len + 3), F16)
    m = mb[:, :c.rows, 1 : 1 + c.kv_len]
    for (qs, _), (q, k, _, own) in c.sequences():
        seen = placed(q.shape[0], k.shape[0], c.causal, c.window, c.offset)
        m[qs] = np.where(seen, 0.0 if own is None else own.astype(np.float32), -np.inf)
    return c.with_(mask=m, causal=False, window=0, offset=None)


@pytest.mark.parametrize(
    "hd,batch,rows,kv,window,offset",
    [
        (256, 2, 40, 150, 0, -20),  # rows below 20 see nothing
        (512, 2, 20, 150, 0, 37),  # a chunk of queries inside the cache
        (256, 1, 40, 100, 0, 200),  # past the cache: every row sees all of it
        (256, 2, 70, 150, 30, 60),  # a window, a partial last step
        (512, 1, 33, 100, 16, -5),
    ],
)
def test_an_explicit_offset_places_the_queries_in_the_cache(emu, rng, hd, batch, rows, kv, window, offset):
    # PREFILL_OFFSET (context parallelism, SPEC 6): row r at r + offset of the cache, not
    # the prompt at the cache's end. Against the reference, and bit for bit against the same
    # placement given as an explicit mask; rows that see nothing are +0 with lse -inf.
    c = fixed_case(rng, batch=batch, rows=rows, kv=kv, nh=2, nkv=1, hd=hd, causal=True, window=window, offset=offset)
    assert offset != kv - rows
    out, lse, _ = emu_prefill(emu, c)
    check(c, out, lse)
    e = _explicit(c)
    out_e, lse_e, _ = emu_prefill(emu, e)
    assert same_bits(out, out_e) and same_bits(lse, lse_e)
    # Without the flag the same block means the prompt at the cache's end: another result.
    end, _, _ = emu_prefill(emu, c.with_(offset=None))
    assert nmse(end, out) > 1e-3


def test_an_explicit_offset_with_variable_length(emu, rng):
    # Caches longer, shorter than and as long as their prompts, and an empty prompt: every
    # sequence is placed by the same offset.
    c = varlen_case(rng, lq=[30, 0, 50, 20], lk=[80, 10, 20, 20], nh=2, nkv=1, hd=256, causal=True, offset=10)
    out, lse, _ = emu_prefill(emu, c)
    check(c, out, lse)
    w = c.with_(window=7, offset=-3)
    out, lse, _ = emu_prefill(emu, w)
    check(w, out, lse)


@pytest.mark.parametrize(
    "hd,batch,mask,causal,window",
    [(256, 2, "shared", False, 0), (512, 2, "per-batch", True, 0), (256, 3, "per-batch", True, 40)],
)
def test_explicit_mask_alone_and_with_the_description(emu, rng, hd, batch, mask, causal, window):
    rows, kv = (45, 130) if hd == 256 else (20, 150)
    c = fixed_case(rng, batch=batch, rows=rows, kv=kv, nh=2, nkv=1, hd=hd, mask=mask, causal=causal, window=window)
    out, lse, blk = emu_prefill(emu, c)
    assert {0, 1, 2} <= set(np.unique(blk).tolist())
    check(c, out, lse)


def test_fully_masked_rows_are_plus_zero_with_lse_minus_inf(emu, rng):
    c = fixed_case(rng, batch=2, rows=20, kv=90, nh=2, nkv=1, hd=512, mask="per-batch", causal=True)
    c.mask[0, [0, 7, 19]] = -np.inf
    c.mask[1, 5] = -np.inf
    out, lse, _ = emu_prefill(emu, c)
    check(c, out, lse)
    for b, r in [(0, 0), (0, 7), (0, 19), (1, 5)]:
        assert (out[b, r].view(np.uint32) == 0).all()
        assert (lse[b, :, r] == -np.inf).all()


# -- dtypes --------------------------------------------------------------------------------------


def test_every_q_dtype_and_o_dtype(emu, rng):
    # Q values that F16 and BF16 both hold exactly: the kernel reads Q as float, so the three
    # Q dtypes give the same bits; O in F16 / BF16 is the F32 result rounded to nearest even.
    c = fixed_case(rng, batch=2, rows=20, kv=70, nh=2, nkv=1, hd=256, causal=True, scale=0.8)
    qv = c.q.astype(np.float32).astype(BF16).astype(np.float32)
    qv[qv.astype(np.float16).astype(np.float32) != qv] = 0
    c.q[...] = qv
    base, base_lse, _ = emu_prefill(emu, c)
    check(c, base, base_lse)
    for dt in (F16, BF16):
        q, _, _ = _qkv(rng, (2,), 20, 70, 2, 1, 256, dt)
        q[...] = qv.astype(dt)
        out, lse, _ = emu_prefill(emu, c.with_(q=q))
        assert same_bits(out, base), dt
        assert same_bits(lse, base_lse), dt
    for dt in (F16, BF16):
        out, _, _ = emu_prefill(emu, c.with_(o_dtype=dt))
        assert out.dtype == dt
        assert same_bits(out, base.astype(dt)), dt
        check(c.with_(o_dtype=dt), out, None)


def test_f16_and_bf16_outputs_round_ties_to_even(emu, rng):
    # Q = 0: every visible score is 0, so p = 1 and each output is the mean of the V rows its
    # row sees, exact in F32. With a window of 1 that is a V value (an F16: one in eight is a
    # tie for BF16), with a window of 2 the mean of two (often a tie for F16). The kernel
    # rounds each to nearest even: half away from zero and truncation differ on the ties.
    for window, dt in ((1, BF16), (2, F16), (2, BF16)):
        c = fixed_case(rng, batch=1, rows=40, kv=100, nh=2, nkv=1, hd=256, causal=True, window=window)
        c.q[...] = 0
        base, _, _ = emu_prefill(emu, c)
        check(c, base, None, cpu=False)
        out, _, _ = emu_prefill(emu, c.with_(o_dtype=dt))
        want = base.astype(dt)
        assert same_bits(out, want), (window, dt)
        # The case has ties: rounding half away from zero gives other bits.
        if dt == BF16:
            away = ((base.view(np.uint32).astype(np.uint64) + 0x8000) >> 16).astype(np.uint16)
        else:
            f, t = base.astype(np.float64), base.astype(np.float16)
            other = np.nextafter(t, np.where(f > t, np.float16(np.inf), np.float16(-np.inf)))
            tie = (f != t) & (np.abs(other.astype(np.float64) - f) == np.abs(t.astype(np.float64) - f))
            away = np.where(tie & (np.abs(other) > np.abs(t)), other, t).view(np.uint16)
        assert (away != want.view(np.uint16)).sum() > 100, (window, dt)


# -- lse -----------------------------------------------------------------------------------------


def test_lse_merges_two_halves_of_the_cache(emu, rng):
    # SPEC 8: the cache split in two (at a row that is not a step boundary), each half run on
    # its own with its part of the mask, merged by lse: the whole attention.
    rows, kv, split = 40, 150, 75
    c = fixed_case(rng, batch=1, rows=rows, kv=kv, nh=4, nkv=2, hd=256, mask="per-batch")
    c.mask[0] = np.where(visible_mask(rows, kv, True, None), c.mask[0], -np.inf)
    c.mask[0, 3, split:] = -np.inf  # row 3 sees nothing in the second half
    c.mask[0, 4] = -np.inf  # row 4 sees nothing at all
    whole, whole_lse, _ = emu_prefill(emu, c)
    check(c, whole, whole_lse)
    halves = []
    for cols in (slice(0, split), slice(split, kv)):
        h = c.with_(k=c.k[:, cols], v=c.v[:, cols], mask=c.mask[:, :, cols])
        out, lse, _ = emu_prefill(emu, h)
        check(h, out, lse)
        halves += [out.astype(np.float64), lse.astype(np.float64)]
    assert (halves[3][0, :, 3] == -np.inf).all()
    merged, merged_lse = merge_reference(*halves)
    ref, ref_lse = reference(c)
    assert nmse(merged, ref) < EXPECTED[F32]
    seen = np.isfinite(ref_lse)
    assert np.abs(merged_lse[seen] - ref_lse[seen]).max() < LSE_TOLERANCE
    assert (merged_lse[~seen] == -np.inf).all() and (merged[0, 4] == 0).all()


# -- SPEC 3: what must not change a bit -----------------------------------------------------------


@pytest.mark.parametrize("hd", [256, 512])
def test_computed_tables_and_described_masks_change_no_bit(emu, rng, hd):
    rows, kv, w = (45, 200, 140) if hd == 256 else (20, 250, 140)  # every class occurs
    # The computed tables against all-ones tables (an explicit mask whose masked entries are
    # -inf, with the description).
    c = fixed_case(rng, batch=2, rows=rows, kv=kv, nh=2, nkv=1, hd=hd, mask="per-batch", causal=True, window=w)
    out, lse, blk = emu_prefill(emu, c)
    assert 0 in blk and 2 in blk
    ones, ones_lse, _ = emu_prefill(emu, c, blk=np.ones_like(blk))
    assert same_bits(out, ones) and same_bits(lse, ones_lse)
    # The description against the same visibility as an explicit 0 / -inf mask.
    d = c.with_(mask=None)
    described, described_lse, _ = emu_prefill(emu, d)
    explicit = np.where(visible_mask(rows, kv, True, w), 0, -np.inf).astype(np.float16)
    mb = _nan_base((1, rows, kv + 3), F16)
    mb[:, :, :kv] = explicit
    e = d.with_(mask=mb[:, :, :kv], causal=False, window=0)
    out_e, lse_e, blk_e = emu_prefill(emu, e)
    assert {0, 1, 2} <= set(np.unique(blk_e).tolist())
    assert same_bits(described, out_e) and same_bits(described_lse, lse_e)
    # The description with an all-zero explicit mask against the description alone.
    mb[:, :, :kv] = 0
    z, z_lse, _ = emu_prefill(emu, d.with_(mask=mb[:, :, :kv]))
    assert same_bits(described, z) and same_bits(described_lse, z_lse)
    check(d, described, described_lse)


def test_schedules_and_cooperative_layouts_change_no_bit(emu, rng):
    """Any order of the threads between synchronisation points, and any layout of the
    cooperative tensors, gives the same bits (out and lse)."""
    cases = [
        fixed_case(rng, batch=2, rows=20, kv=100, nh=2, nkv=1, hd=256, mask="per-batch", causal=True, scale=2.0),
        varlen_case(rng, lq=[5, 18], lk=[70, 18], nh=2, nkv=1, hd=512, causal=True, window=9),
    ]
    for c in cases:
        base, base_lse, blk = emu_prefill(emu, c)
        for kw in (dict(schedule="reverse"), dict(schedule="random:1", layout_seed=7), dict(layout_seed=2)):
            out, lse, _ = emu_prefill(emu, c, blk=blk, **kw)
            assert same_bits(out, base) and same_bits(lse, base_lse), kw


def test_threadgroup_memory_is_exactly_what_the_op_binds(emu, rng):
    # The origin op's formula, which the prefill op shares (SPEC 2), at its two head dims.
    assert [threadgroup_memory(d) for d in (256, 512)] == [mx.threadgroup_memory_bytes(d) for d in (256, 512)]
    c = fixed_case(rng, batch=1, rows=8, kv=64, nh=1, nkv=1, hd=256)
    out, lse, _ = emu_prefill(emu, c)
    check(c, out, lse, cpu=False)
    with pytest.raises(metal_emu.EmulatorError):
        emu_prefill(emu, c, tg_memory=mx.threadgroup_memory_bytes(256) - 16)


# -- the explicit mask's classifier -----------------------------------------------------------------


def spec_tables(mask: np.ndarray, bq: int) -> np.ndarray:
    """SPEC 1 per mask of [n, rows, kv], columns past kv counted as masked."""
    n, rows, kv = mask.shape
    steps = cdiv(kv, STEP)
    bits = mask.view(np.uint16)
    out = np.zeros((n, cdiv(rows, bq), steps), np.uint8)
    for b in range(n):
        for qt in range(cdiv(rows, bq)):
            for kt in range(steps):
                t = bits[b, qt * bq : (qt + 1) * bq, kt * STEP : (kt + 1) * STEP]
                mag = t & 0x7FFF
                masked = ((t & 0x8000) != 0) & (mag >= 0x7BFF) & (mag <= 0x7C00)
                partial = (kt + 1) * STEP > kv
                out[b, qt, kt] = 0 if masked.all() else (2 if (mag == 0).all() and not partial else 1)
    return out


@pytest.mark.parametrize("n,rows,kv,bq", [(3, 45, 130, 32), (1, 33, 200, 16), (2, 16, 64, 16)])
def test_mask_blk_follows_spec_1(emu, rng, n, rows, kv, bq):
    mb = _nan_base((n, rows + 1, kv + 7), F16)  # NaN columns past kv: never read
    m = mb[:, :rows, 3 : 3 + kv]
    for i in range(n):
        m[i] = peer_mask(rows, kv, rng)
    m[:, :bq, :STEP] = -65504.0  # the most negative half counts as masked
    if kv > STEP:
        zeros = m[:, :bq, STEP : 2 * STEP]
        zeros[...] = np.where(rng.random(zeros.shape) < 0.5, 0.0, -0.0)  # either zero is zero
    got = emu_mask_blk(emu, m, bq)
    assert np.array_equal(got, spec_tables(m, bq))
    assert {0, 1, 2} <= set(np.unique(got).tolist()) or kv == STEP
    if kv % STEP:
        # A tile of zeros that runs past kv is 1 (its columns past kv count as masked); one of
        # -inf is 0.
        tail = slice((kv // STEP) * STEP, kv)
        m[0, :bq, tail] = 0
        m[-1, (cdiv(rows, bq) - 1) * bq :, tail] = -np.inf
        got = emu_mask_blk(emu, m, bq)
        assert got[0, 0, -1] == 1 and got[-1, -1, -1] == 0
        assert np.array_equal(got, spec_tables(m, bq))


def test_mask_blk_matches_the_origin_classifier_on_padded_masks(emu, rng):
    # The origin classifier is an entry point over the same body: on a mask padded to a
    # multiple of 64 with -inf columns, each table is the origin's.
    n, rows, kv, bq = 2, 40, 100, 32
    m = np.stack([peer_mask(rows, kv, rng) for _ in range(n)])
    got = emu_mask_blk(emu, m, bq)
    for b in range(n):
        padded = np.full((rows, mx.kv_pad(kv)), -np.inf, np.float16)
        padded[:, :kv] = m[b]
        table = np.full((cdiv(rows, bq), mx.kv_pad(kv) // STEP), 0xEE, np.uint8)
        res = emu.dispatch(
            "flash_attn_prefill_blk", (mx.kv_pad(kv) // STEP, cdiv(rows, bq), 1), (32, 1, 1),
            buffers={1: padded, 2: table}, constants={0: struct.pack("<4i", rows, mx.kv_pad(kv), bq, STEP)},
        )  # fmt: skip
        want = res[2]
        # Past kv the padded mask is -inf, and a partial last step is never 2 either way.
        assert np.array_equal(got[b], want), b
        assert np.array_equal(want, mx.flash_attn_prefill_blk(padded, bq, STEP, device=mx.Device("cpu")))


# -- deliberately wrong kernels must fail these checks ----------------------------------------------


def mutated(build_dir, original: str, replacement: str, count: int = 1) -> metal_emu.Emulator:
    """The emulator built with one deliberate change to the attention kernels' source."""
    src = metal_emu.SHADER_FILES["flash_attn_prefill_tensor.metal"].read_text()
    assert src.count(original) == count, f"the mutation no longer applies: {original!r}"
    sources = {name: path.read_text() for name, path in metal_emu.SHADER_FILES.items()}
    sources["flash_attn_prefill_tensor.metal"] = src.replace(original, replacement)
    return metal_emu.Emulator(metal_emu.build(build_dir, sources))


def test_a_dropped_causal_offset_is_caught(build_dir, rng):
    # Each prompt is the end of its cache (offset = Lk - Lq): without the offset, every row
    # sees too little of a cache longer than its prompt.
    bad = mutated(build_dir, "(p.flags & PREFILL_OFFSET) != 0 ? p.offset : lk - lq;", "(p.flags & PREFILL_OFFSET) != 0 ? p.offset : 0;")
    c = fixed_case(rng, batch=2, rows=37, kv=100, nh=2, nkv=1, hd=256, causal=True)
    out, _, _ = emu_prefill(bad, c)
    assert nmse(out, reference(c)[0]) > 1e-3


def test_lse_without_the_running_max_is_caught(build_dir, rng):
    bad = mutated(build_dir, "m_run[i] + log(s_run[i])", "log(s_run[i])")
    c = fixed_case(rng, batch=1, rows=20, kv=100, nh=2, nkv=1, hd=256, causal=True, scale=3.0)
    out, lse, _ = emu_prefill(bad, c)
    with pytest.raises(AssertionError, match="lse off by"):
        check(c, out, lse, cpu=False)
    check(c.with_(lse=False), out, None, cpu=False)  # the output itself is right


def test_a_partial_step_read_past_the_cache_is_caught(emu, build_dir, rng):
    # A V tensor of a whole step at the cache's end (125 rows: the last step has 61)
    # read the 3 rows after it: past the last sequence's buffer, a fault; where the buffers go
    # on (the NaN rows after each cache), NaN in the output.
    bad = mutated(build_dir, "dextents<int32_t, 2>(DV, kn)", "dextents<int32_t, 2>(DV, C)")
    c = fixed_case(rng, batch=2, rows=20, kv=125, nh=2, nkv=1, hd=256, causal=True)
    with pytest.raises(metal_emu.EmulatorError):
        emu_prefill(bad, c)
    wide = c.with_(k_buf=_from(c.k, c.k.base), v_buf=_from(c.v, c.v.base))
    out, _, _ = emu_prefill(bad, wide)
    assert not np.isfinite(out).all()
    good, lse, _ = emu_prefill(emu, wide)
    check(wide, good, lse)
