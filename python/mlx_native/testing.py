"""Builders for strided low-level cases, shared by the test suite and the GPU scripts.

A case is Q, K and V as views into larger buffers (padded rows and heads, so that every
stride differs from the dense one), a mask with -inf past the cache, and the params of the
low-level attention dispatch; :func:`run_low_level` dispatches the mask classification and
the attention over buffers of the views' memory spans, as llama.cpp does::

    from mlx_native.testing import make_case, run_low_level
    case = make_case(np.random.default_rng(0), 40, 4, 2, 256, 150, mask="peer")
    out, blk = run_low_level(mn.Device("cpu"), case)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import mlx_native as mn
from mlx_native.reference import peer_mask

__all__ = ["LowLevelCase", "make_case", "run_low_level"]


@dataclass
class LowLevelCase:
    """Strided views (``q``, ``k``, ``v``), the mask over the padded cache, and the bases
    the views point into."""

    q: np.ndarray  # [rows, nh, hd] view of a larger float32 base
    k: np.ndarray  # [kv_pad, nkv, hd] view of a larger float16 base
    v: np.ndarray
    mask: np.ndarray  # [rows, kv_pad] float16, -inf past kv_len
    kv_len: int
    scale: float
    q_base: np.ndarray
    k_base: np.ndarray
    v_base: np.ndarray

    @property
    def rows(self):
        return self.q.shape[0]

    def params(self) -> mn.FlashAttnPrefillTensorParams:
        rows, nh, hd = self.q.shape
        kvp, nkv, _ = self.k.shape
        e4, e2 = 4, 2
        return mn.FlashAttnPrefillTensorParams(
            rows=rows,
            n_heads=nh,
            n_kv_heads=nkv,
            head_dim=hd,
            kv_pad=kvp,
            q_row_stride=self.q.strides[0] // e4,
            q_head_stride=self.q.strides[1] // e4,
            k_row_stride=self.k.strides[0] // e2,
            k_head_stride=self.k.strides[1] // e2,
            v_row_stride=self.v.strides[0] // e2,
            v_head_stride=self.v.strides[1] // e2,
            scale=self.scale,
        )


def make_case(rng, rows, nh, nkv, hd, kv_len, *, scale=1.0, mask="peer", pad=(4, 1, 2), window=None):
    """Q, K, V as views into larger buffers (row pad, head pad); K/V rows past kv_len are
    zero (the host contract); mask built per ``mask`` with -inf padding columns."""
    kvp = mn.kv_pad(kv_len)
    qp, kp, vp = pad
    q_base = rng.uniform(-1, 1, size=(rows, nh + 1, hd + 4 * qp)).astype(np.float32)
    q0 = 4 if qp else 0
    q = q_base[:, :nh, q0 : q0 + hd]
    k_base = rng.uniform(-1, 1, size=(kvp, nkv, hd + kp)).astype(np.float16)
    v_base = rng.uniform(-1, 1, size=(kvp, nkv + 1, hd + vp)).astype(np.float16)
    k_base[kv_len:] = 0
    v_base[kv_len:] = 0
    k = k_base[:, :, kp : kp + hd] if kp else k_base[:, :, :hd]
    v = v_base[:, 1:, :hd]
    m = np.full((rows, kvp), -np.inf, dtype=np.float16)
    if mask == "peer":
        m[:, :kv_len] = peer_mask(rows, kv_len, rng)
        # Make sure every tile class occurs: one skipped and one mask-free block.
        if kv_len >= 128:
            m[:128, :64] = -np.inf
            m[:128, 64:128] = 0
    elif mask == "zero":
        m[:, :kv_len] = 0
    elif mask == "causal":
        m[:, :kv_len] = mn.causal_mask(rows, kv_len, window)
    else:
        raise ValueError(mask)
    return LowLevelCase(q, k, v, m, kv_len, scale, q_base, k_base, v_base)


def run_low_level(dev, case: LowLevelCase, *, blk_override=None, extra_out_rows=0, sentinel=None):
    """Dispatch blk (unless overridden) and attention on ``dev`` over buffers of the bases;
    returns (out [rows + extra, nh, hd], blk)."""
    rows, nh, hd = case.q.shape
    bq = mn.queries_per_threadgroup(hd)
    kvp = case.k.shape[0]
    qb = dev.buffer(_span(case.q))
    kb = dev.buffer(_span(case.k))
    vb = dev.buffer(_span(case.v))
    mb = dev.buffer(case.mask)
    blk_shape = (-(-rows // bq), kvp // 64)
    blkb = dev.buffer(blk_override) if blk_override is not None else dev.empty(blk_shape, np.uint8)
    out_init = np.full((rows + extra_out_rows, nh, hd), np.nan if sentinel is None else sentinel, np.float32)
    ob = dev.buffer(out_init, copy=True)
    with dev.encoder() as enc:
        if blk_override is None:
            mn.dispatch_flash_attn_prefill_blk(enc, mb, blkb, rows=rows, kv_pad=kvp, bq=bq, bk=64)
        mn.dispatch_flash_attn_prefill_tensor_f16(enc, qb, kb, vb, mb, blkb, ob, case.params())
    return ob.numpy(), blkb.numpy()


def _span(x: np.ndarray) -> np.ndarray:
    """The flat memory span of a view with non-negative strides (a view, not a copy)."""
    item = x.itemsize
    n = sum((s - 1) * (st // item) for s, st in zip(x.shape[:-1], x.strides[:-1])) + x.shape[-1]
    return np.lib.stride_tricks.as_strided(x, shape=(n,), strides=(item,), writeable=False)
