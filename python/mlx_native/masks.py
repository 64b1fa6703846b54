"""Masks: explicit masks brought to the kernel's form (float16, one mask for every head,
shared by the batch or one per sequence) with the array's own library on its own device,
the useful pairs of a prefill (SPEC 5), and the helpers :func:`causal_mask` and
:func:`flash_attn_prefill_blk` (the origin op's tile table)."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from .scalars import U32_MAX, check_int
from .arrays import Operand, _contiguous_strides
from .checks import check_window
from .device import Device, default_device
from .dtypes import bfloat16_dtype
from .errors import ArgumentTypeError, InvalidArgumentError, UnsupportedDtypeError
from .ops import CACHE_ROWS_PER_STEP, dispatch_flash_attn_prefill_blk

#: The most negative half: a mask value at or below it hides its pair (SPEC 1).
NEG_HALF_MAX = -65504.0

#: Rows of a mask built or counted at a time (bounds the temporary memory of huge masks).
CHUNK_ROWS = 1024

_MASK_DTYPES = ("bool", "float16", "float32", "float64", "bfloat16")


def _count(x: Any, name: str) -> int:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise ArgumentTypeError(f"{name} must be a non-negative integer, got {x!r} ({type(x).__name__})")
    if x < 0:
        raise InvalidArgumentError(f"{name} must be a non-negative integer, got {x}")
    return int(x)


def causal_mask(rows: int, kv_len: int, window: Optional[int] = None, dtype: Any = np.float16) -> np.ndarray:
    """Additive mask ``[rows, kv_len]`` (numpy): 0 where query row ``r`` may see cache row
    ``j``, ``-inf`` elsewhere. Causal: ``j <= r + (kv_len - rows)`` (the prompt is the last
    ``rows`` rows of the cache); with a window ``w`` (an integer >= 1) also
    ``j > r + (kv_len - rows) - w``. ``flash_attn_prefill(..., causal=True, window=w)``
    computes the same without any such array."""
    rows, kv_len = _count(rows, "rows"), _count(kv_len, "kv_len")
    window = check_window(window)
    out = np.empty((rows, kv_len), dtype=dtype)
    for r0 in range(0, rows, CHUNK_ROWS):
        r1 = min(rows, r0 + CHUNK_ROWS)
        out[r0:r1] = np.where(_visible(np, r0, r1, rows, kv_len, True, window), 0, -np.inf).astype(dtype)
    return out


def _visible(xp, r0: int, r1: int, rows: int, kv_len: int, causal: bool, window: Optional[int], device=None, offset=None):
    """bool ``[r1 - r0, kv_len]``: the pairs of query rows ``r0..r1`` the description
    leaves visible (SPEC 6), built with ``xp`` (numpy, CuPy or torch); ``offset`` None: the
    prompt is the end of its cache."""
    kw = {} if device is None else {"device": device}
    last = xp.arange(r0, r1, **kw)[:, None] + (kv_len - rows if offset is None else offset)
    j = xp.arange(kv_len, **kw)[None, :]
    if isinstance(window, tuple):  # a two-sided window without causal: p - left <= j <= p + right
        ok = last * 0 <= j
        if window[0] >= 0:
            ok &= j >= last - window[0]
        if window[1] >= 0:
            ok &= j <= last + window[1]
        return ok
    if not causal:
        return last * 0 <= j  # every pair, shaped [r1 - r0, kv_len]
    ok = j <= last
    if window is not None:
        ok &= j > last - window
    return ok


def described_pairs(lq: int, lk: int, causal: bool, window: Optional[int], offset: Optional[int] = None) -> int:
    """The visible (query row, cache row) pairs of one sequence of ``lq`` query rows and
    ``lk`` cache rows under a described mask (SPEC 5-6), in closed form; ``offset`` places
    row r at cache position ``r + offset`` (None: ``lk - lq``, the prompt ends the cache)."""
    if lq <= 0 or lk <= 0:
        return 0
    if isinstance(window, tuple):  # two-sided, not causal: count row by row
        p = np.arange(lq, dtype=np.int64) + (lk - lq if offset is None else offset)
        lo = np.maximum(p - window[0], 0) if window[0] >= 0 else np.zeros_like(p)
        hi = np.minimum(p + window[1], lk - 1) if window[1] >= 0 else np.full_like(p, lk - 1)
        return int(np.maximum(hi - lo + 1, 0).sum())
    if not causal:
        return lq * lk
    if offset is not None and offset != lk - lq:
        # Row r sees cache rows [r + off - w + 1, r + off] clipped to [0, lk): count
        # the pairs of the unclipped cache [0, r + off] and take away those past lk - 1.
        below = _pairs_ending_at(offset, lq, window)
        past = _pairs_ending_at(offset - lk, lq, window)
        return below - past
    # Row r sees min(r + off + 1, w) rows: t = r + off + 1 runs from a to b.
    off = lk - lq
    a, b = max(off + 1, 1), off + lq
    if b < 1:
        return 0
    n = b - a + 1
    if window is None or b <= window:
        return (a + b) * n // 2
    if a >= window:
        return window * n
    return (a + window - 1) * (window - a) // 2 + window * (b - window + 1)


def _pairs_ending_at(off: int, lq: int, window: Optional[int]) -> int:
    """``sum over r < lq`` of the cache rows ``j >= 0`` with ``r + off - w < j <= r + off``
    (no lower bound but 0 without a window): row r counts ``clip(r + off + 1, 0, w)``."""

    def ramp(t0: int, t1: int) -> int:  # sum of t for t in [t0, t1], 0 if empty
        return (t0 + t1) * (t1 - t0 + 1) // 2 if t1 >= t0 else 0

    # t = r + off + 1 runs over [off + 1, off + lq]; t <= 0 counts 0, 0 < t < w counts t,
    # t >= w counts w.
    lo, hi = off + 1, off + lq
    if window is None:
        return ramp(max(lo, 1), hi)
    return ramp(max(lo, 1), min(hi, window - 1)) + window * max(0, hi - max(lo, window) + 1)


def mask_to_half(op: Operand) -> Operand:
    """A contiguous float16 copy of a mask with the array's own library on its device:
    bool True -> 0 and False -> -inf; float values at or below -65504 (transformers'
    ``finfo(dtype).min`` included) -> -inf, without an overflow warning."""
    if op.library == "torch":
        import torch

        t = op.obj
        if t.dtype == torch.bool:
            h = torch.full(tuple(t.shape), float("-inf"), dtype=torch.float16, device=t.device)
            return Operand.of(h.masked_fill_(t, 0.0))
        h = t.to(torch.float16).contiguous()
        if t.dtype != torch.float16:
            h.masked_fill_(h <= NEG_HALF_MAX, float("-inf"))
        return Operand.of(h)
    if op.library == "cupy":
        import cupy as xp

        a = op.obj
    else:
        xp, a = np, op.host_array()
    if a.dtype == np.bool_:
        h = xp.where(a, xp.float16(0), xp.float16(-np.inf))
    elif a.dtype == np.float16:
        h = a
    else:
        h = xp.where(a <= NEG_HALF_MAX, -np.inf, a).astype(np.float16)
    return Operand.of(xp.ascontiguousarray(h))


def prepare_mask(mask: Any, *, batch: int, rows: int, kv_len: int, like: Operand) -> Tuple[Operand, int, int]:
    """The kernel's form of an explicit mask and its (batch, row) strides in elements (0:
    shared by every sequence / by every row).

    Shapes: ``[rows, kv]``, ``[B or 1, rows, kv]``, ``[B or 1, 1, rows, kv]``; an axis of
    size 1 or stride 0 is shared, so a ``[B, H, rows, kv]`` made by ``expand`` is taken (one
    mask for every head), and so is a row broadcast (``[B, 1, 1, kv]`` expanded). Float16
    with a contiguous last axis is used in place; other dtypes (bool, float32, float64, bfloat16) are
    converted with the array's own library on its device (:func:`mask_to_half`). A host
    mask for CUDA ``q`` (``like``) is copied to q's device; a CUDA mask is never copied to
    the host."""
    m = mask if isinstance(mask, Operand) else Operand.of(mask, "mask")
    if m.dtype.name not in _MASK_DTYPES and m.dtype != bfloat16_dtype():
        raise UnsupportedDtypeError(
            f"mask must be floating point (additive) or bool (True = may attend), got {m.dtype.name}"
        )
    if m.ndim not in (2, 3, 4):
        raise InvalidArgumentError(_shape_message(m.shape, batch, rows, kv_len))
    # As [B, H, rows, kv]: a 3-D mask is [B, rows, kv], a 2-D one [rows, kv].
    shape4, strides4 = m.shape, m.strides
    if m.ndim == 3:
        shape4, strides4 = (m.shape[0], 1) + m.shape[1:], (m.strides[0], 0) + m.strides[1:]
    elif m.ndim == 2:
        shape4, strides4 = (1, 1) + m.shape, (0, 0) + m.strides
    (bm, hm, rm, km), (sb, sh, sr, _) = shape4, strides4
    shared_b, shared_r = bm == 1 or sb == 0, rm == 1 or sr == 0
    if km != kv_len or rm not in (rows, 1) or bm not in (batch, 1):
        raise InvalidArgumentError(_shape_message(m.shape, batch, rows, kv_len))
    if hm != 1 and sh != 0:
        raise InvalidArgumentError(
            f"mask has {hm} heads ({m.shape}): every head shares one mask here; pass it as [B or 1, 1, rows, kv]"
        )
    if m.library == "spec":
        shape = (1 if shared_b else bm, 1 if shared_r else rm, km)
        half_in_place = m.dtype == np.float16 and m.in_place
        strides = (sb, sr, m.strides[-1]) if half_in_place else _contiguous_strides(shape)
        core = Operand(None, "spec", m.device, shape, strides, np.dtype(np.float16), 0, True)
    elif m.device != like.device:
        if m.on_cuda:
            raise InvalidArgumentError(f"the mask is on {m.device} and q on {like.device}: put them on one device")
        m = like.from_host(m.to_host())
    if m.library != "spec":
        obj = {2: lambda x: x[None, None], 3: lambda x: x[:, None], 4: lambda x: x}[m.ndim](m.obj)
        core = Operand.of(obj[slice(0, 1) if shared_b else slice(None), 0, slice(0, 1) if shared_r else slice(None)], "mask")
        if core.dtype != np.float16 or not core.in_place:
            core = mask_to_half(core)
    bs = 0 if core.shape[0] <= 1 else core.strides[0]
    rs = 0 if core.shape[1] <= 1 else core.strides[1]
    return core, bs, rs


def _shape_message(shape, batch: int, rows: int, kv_len: int) -> str:
    return (
        f"mask must have shape [rows, kv] = [{rows}, {kv_len}], [B or 1, rows, kv] or [B or 1, 1, rows, kv] "
        f"(B = {batch}; an axis of 1 is shared), got {tuple(shape)}"
    )


def masked_pairs(
    core: Operand, batch: int, rows: int, kv_len: int, causal: bool, window: Optional[int], offset: Optional[int] = None
) -> int:
    """The visible pairs of a fixed-length batch with an explicit mask (its kernel form,
    ``[B or 1, rows or 1, kv]`` float16): pairs the description leaves visible whose mask
    value is above -65504, summed over the batch. Computed on the mask's device, in chunks
    of rows."""
    if rows == 0 or kv_len == 0 or batch == 0:
        return 0
    bc, rc = core.shape[0], core.shape[1]
    total = 0
    if core.library == "torch":
        import torch

        t, dev = core.obj, core.obj.device
        for b in range(bc):
            for r0 in range(0, rows, CHUNK_ROWS):
                r1 = min(rows, r0 + CHUNK_ROWS)
                vis = _visible(torch, r0, r1, rows, kv_len, causal, window, device=dev, offset=offset)
                m = t[b, r0:r1] if rc > 1 else t[b, 0:1]
                total += int(torch.count_nonzero(vis & (m > NEG_HALF_MAX)))
    else:
        if core.library == "cupy":
            import cupy as xp

            a = core.obj
        else:
            xp, a = np, core.host_array()
        for b in range(bc):
            for r0 in range(0, rows, CHUNK_ROWS):
                r1 = min(rows, r0 + CHUNK_ROWS)
                vis = _visible(xp, r0, r1, rows, kv_len, causal, window, offset=offset)
                m = a[b, r0:r1] if rc > 1 else a[b, 0:1]
                total += int(xp.count_nonzero(vis & (m > NEG_HALF_MAX)))
    return total * (batch if bc == 1 else 1)


def flash_attn_prefill_blk(mask: Any, bq: int, bk: int = CACHE_ROWS_PER_STEP, *, device: Optional[Device] = None) -> np.ndarray:
    """The origin op's tile-skip table of an F16 mask ``[rows, kv_pad]`` (``kv_pad`` a
    multiple of ``bk``): uint8 ``[ceil(rows/bq), kv_pad/bk]``, 0 = every value -inf (or <=
    -65504), 2 = every value zero, 1 = anything else. Computed by the library's kernel."""
    dev = device or default_device()
    m = Operand.of(mask, "mask").to_host()
    if m.ndim != 2:
        raise InvalidArgumentError(f"mask must be 2-D [rows, kv_pad], got shape {m.shape}")
    if m.dtype != np.float16:
        raise UnsupportedDtypeError(f"mask must be float16, got {m.dtype.name}")
    rows, kvp = m.shape
    bq, bk = check_int(bq, "bq", 1, U32_MAX), check_int(bk, "bk", 1, U32_MAX)
    blk = np.empty((-(-rows // bq), kvp // bk), dtype=np.uint8)
    mbuf = dev.buffer(np.ascontiguousarray(m))
    bbuf = dev.buffer(blk) if dev.backend == "cpu" else dev.empty(blk.shape, np.uint8)
    with dev.encoder() as enc:
        dispatch_flash_attn_prefill_blk(enc, mbuf, bbuf, rows=rows, kv_pad=kvp, bq=bq, bk=bk)
    return blk if dev.backend == "cpu" else bbuf.numpy()
