"""The float64 reference of SPEC section 3, the error metric, and test inputs."""

from __future__ import annotations

from typing import Any, Iterable, Optional

import numpy as np


def reference_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: Optional[np.ndarray] = None,
    scale: float = 1.0,
    heads: Optional[Iterable[int]] = None,
) -> np.ndarray:
    """The exact softmax attention in float64 on the kernel's rounded inputs:
    ``half(scale * q)``, float16 K/V, the float16 mask ``[rows, kv_len]`` (or none).
    Rows that may attend to nothing are zeros. With ``heads``, only those query heads are
    computed (the others stay zero)."""
    rows, n_heads, head_dim = q.shape
    kv_len, n_kv_heads, _ = k.shape
    group = n_heads // n_kv_heads
    qh = (np.float32(scale) * q.astype(np.float32)).astype(np.float16).astype(np.float64)
    m = None if mask is None else np.asarray(mask).astype(np.float16).astype(np.float64)
    out = np.zeros((rows, n_heads, head_dim), dtype=np.float64)
    for h in range(n_heads) if heads is None else heads:
        g = h // group
        s = qh[:, h, :] @ k[:, g, :].astype(np.float64).T
        if m is not None:
            s = s + m
        mx = s.max(axis=1, keepdims=True)
        # -inf: the row sees nothing (zeros). NaN (a NaN or infinite input) stays NaN.
        seen = ~np.isneginf(mx[:, 0])
        p = np.zeros_like(s)
        p[seen] = np.exp(s[seen] - mx[seen])
        denom = p.sum(axis=1, keepdims=True)
        o = p @ v[:, g, :].astype(np.float64)
        out[seen, h, :] = o[seen] / denom[seen]
    return out


def nmse(out: np.ndarray, ref: np.ndarray) -> float:
    """``sum((out - ref)^2) / sum(ref^2)`` in float64 (the plain sum when ref is zero)."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    num = float(np.sum((out - ref) ** 2))
    den = float(np.sum(ref**2))
    return num / den if den else num


def peer_mask(rows: int, kv_len: int, rng: np.random.Generator, fraction: float = 0.2) -> np.ndarray:
    """The peer's random mask: uniform values in [-1, 1], then about ``fraction`` of the
    128x64 blocks set to -inf or to 0 (half each), so every tile class occurs. float16."""
    m = rng.uniform(-1, 1, size=(rows, kv_len)).astype(np.float16)
    for r0 in range(0, rows, 128):
        for c0 in range(0, kv_len, 64):
            u = rng.random()
            if u < fraction / 2:
                m[r0 : r0 + 128, c0 : c0 + 64] = -np.inf
            elif u < fraction:
                m[r0 : r0 + 128, c0 : c0 + 64] = 0
    return m


def random_qkv(rows: int, n_heads: int, n_kv_heads: int, head_dim: int, kv_len: int, rng: np.random.Generator):
    """Uniform [-1, 1) Q (float32) and K, V (float16) in the kernel's layouts."""
    q = rng.uniform(-1, 1, size=(rows, n_heads, head_dim)).astype(np.float32)
    k = rng.uniform(-1, 1, size=(kv_len, n_kv_heads, head_dim)).astype(np.float16)
    v = rng.uniform(-1, 1, size=(kv_len, n_kv_heads, head_dim)).astype(np.float16)
    return q, k, v


def useful_flops(head_dim: int, n_heads: int, visible_pairs: int) -> float:
    """SPEC section 5: ``4 * head_dim * n_heads * (unmasked (r, j) pairs)``."""
    return 4.0 * head_dim * n_heads * visible_pairs


def window_sides(causal: bool, window: Any) -> "tuple[int, int]":
    """The ``(left, right)`` of a description (FlashAttention's ``window_size``, -1 for
    unbounded): ``window=w`` (an int) is ``(w - 1, 0)``; a tuple is taken as it is, its
    right side capped at 0 by ``causal``; no window is ``(-1, 0)`` causal, ``(-1, -1)``
    otherwise."""
    if window is None:
        left, right = -1, -1
    elif isinstance(window, tuple):
        left, right = int(window[0]), int(window[1])
    else:
        left, right, causal = int(window) - 1, 0, True
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def visible_mask(
    lq: int, lk: int, causal: bool = False, window: Any = None, offset: Optional[int] = None
) -> np.ndarray:
    """SPEC 6: bool ``[lq, lk]``, True where query row r may see cache row j: row r sits at
    cache position ``p = r + offset`` (None: the prompt is the last ``lq`` rows of the cache,
    ``offset = lk - lq``) and sees ``p - left <= j <= p + right`` (:func:`window_sides`, -1
    unbounded)."""
    r = np.arange(lq)[:, None] + (lk - lq if offset is None else offset)
    j = np.arange(lk)[None, :]
    ok = np.ones((lq, lk), dtype=bool)
    left, right = window_sides(causal, window)
    if right >= 0:
        ok &= j <= r + right
    if left >= 0:
        ok &= j >= r - left
    return ok


def reference_prefill(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: Optional[np.ndarray] = None,
    *,
    causal: bool = False,
    window: Any = None,
    scale: float = 1.0,
    cu_seqlens_q: Optional[np.ndarray] = None,
    cu_seqlens_k: Optional[np.ndarray] = None,
    offset: Optional[int] = None,
    softcap: float = 0.0,
    max_bias: float = 0.0,
    sinks: Optional[np.ndarray] = None,
    alibi_slopes: Optional[np.ndarray] = None,
):
    """SPEC 6-10 in float64 on the kernels' rounded inputs: ``half(scale * q)`` (q read as
    float from any dtype), K/V as given (float16 or bfloat16, read exactly), an optional
    additive mask (rounded to float16) added on the visible pairs. Shapes as the high-level
    API takes them: q ``[rows, H, Dk]`` or ``[B, rows, H, Dk]``, k ``[kv, Hkv, Dk]`` or
    ``[B, kv, Hkv, Dk]``, v likewise with ``Dv`` columns, mask ``[rows, kv]`` or ``[B or 1,
    rows, kv]`` (a 4-D ``[B or 1, 1, rows, kv]`` is taken too); variable length with
    ``cu_seqlens_*`` on 3-D q/k/v (no mask). ``offset`` places query row r of every
    sequence at cache position ``r + offset`` (None: the prompt is the end of its cache).

    SPEC 10: ``softcap > 0`` caps each score ``s = softcap * tanh(s / softcap)``; ``max_bias
    > 0`` scales the mask by each head's ALiBi slope (:func:`alibi_slopes`), and without an
    explicit mask adds the slope times the described mask's ``-(p - j)`` (``p`` the query's
    position in the cache; needs ``causal`` or a window); ``sinks`` (``[H]``) adds each
    head's logit to the softmax as a score with no value. ``alibi_slopes`` (flash-attn's:
    ``[H]`` or ``[B, H]``, B the sequences) adds ``-slope * |p - j|`` to each score (after
    softcap, beside an unscaled mask). ``window``: an int ``w`` (causal, ``(w - 1, 0)``) or
    ``(left, right)`` (:func:`window_sides`). K/V may be float32 too (read exactly).

    Returns ``(out, lse)`` in float64: out shaped like q with ``Dv`` columns, lse ``[H,
    rows]``, ``[B, H, rows]`` or ``[H, total_q]`` (SPEC 8: ``ln(e^sigma + sum_j exp(s_j))``;
    zero output where a row sees nothing, and lse -inf there without a sink)."""
    q = np.asarray(q)
    batched = q.ndim == 4
    tr = _Transforms(softcap, max_bias, sinks, q.shape[-2])
    ab = None if alibi_slopes is None else np.asarray(alibi_slopes, np.float64)
    if ab is not None and ab.ndim == 1:
        ab = ab[None]
    qs = q if batched else q[None]
    ks = np.asarray(k) if batched else np.asarray(k)[None]
    vs = np.asarray(v) if batched else np.asarray(v)[None]
    if mask is not None:
        m = np.asarray(mask)
        if m.ndim == 4:
            m = m[:, 0]
        if m.ndim == 2:
            m = m[None]
        m = m.astype(np.float16).astype(np.float64)
    if cu_seqlens_q is not None:
        cq, ck = np.asarray(cu_seqlens_q, np.int64), np.asarray(cu_seqlens_k, np.int64)
        seqs = [(slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])) for b in range(len(cq) - 1)]
        out = np.zeros(q.shape[:-1] + (np.asarray(v).shape[-1],), np.float64)
        lse = np.full((q.shape[1], q.shape[0]), -np.inf)
        for b, (qsl, ksl) in enumerate(seqs):
            tr.given = None if ab is None else ab[b if ab.shape[0] > 1 else 0]
            o, l = _one_sequence(q[qsl], k[ksl], v[ksl], None, causal, window, scale, tr, offset)
            out[qsl] = o
            lse[:, qsl] = l
        return out, lse
    nb = qs.shape[0]
    out = np.zeros(qs.shape[:-1] + (vs.shape[-1],), np.float64)
    lse = np.full((nb, qs.shape[2], qs.shape[1]), -np.inf)
    for b in range(nb):
        mb = None if mask is None else m[b if m.shape[0] > 1 else 0]
        tr.given = None if ab is None else ab[b if ab.shape[0] > 1 else 0]
        out[b], lse[b] = _one_sequence(qs[b], ks[b], vs[b], mb, causal, window, scale, tr, offset)
    return (out, lse) if batched else (out[0], lse[0])


def alibi_slopes(n_heads: int, max_bias: float) -> np.ndarray:
    """SPEC 10's ALiBi slope of every head, float64 ``[n_heads]`` (ones without ALiBi):
    ``n2 = 2^floor(log2(n_heads))``, ``m0^(h + 1)`` for ``h < n2`` with ``m0 =
    2^(-max_bias / n2)``, else ``m1^(2 (h - n2) + 1)`` with ``m1 = 2^(-max_bias / 2 / n2)``."""
    if max_bias <= 0:
        return np.ones(n_heads)
    n2 = 1 << (int(n_heads).bit_length() - 1)
    h = np.arange(n_heads)
    m0, m1 = 2.0 ** (-max_bias / n2), 2.0 ** (-max_bias / 2 / n2)
    return np.where(h < n2, m0 ** (h + 1.0), m1 ** (2.0 * (h - n2) + 1.0))


class _Transforms:
    """SPEC 10's parameters of one reference call."""

    def __init__(self, softcap, max_bias, sinks, n_heads):
        self.softcap = float(softcap)
        self.max_bias = float(max_bias)
        self.slopes = alibi_slopes(n_heads, self.max_bias)
        self.sinks = None if sinks is None else np.asarray(sinks, np.float64).reshape(n_heads)
        #: The slopes given as data for the sequence at hand (``[H]``), or None.
        self.given = None


def _one_sequence(q, k, v, mask, causal, window, scale, tr, offset=None):
    lq, n_heads, head_dim = q.shape
    lk, n_kv_heads, _ = k.shape
    group = n_heads // n_kv_heads
    qh = (np.float32(scale) * q.astype(np.float32)).astype(np.float16).astype(np.float64)
    seen = visible_mask(lq, lk, causal, window, offset)
    # ALiBi without an explicit mask: the mask llama.cpp writes for it, -(p - j) with p the
    # query's position (r + offset, by default r + lk - lq).
    place = lk - lq if offset is None else offset
    distance = np.arange(lk)[None, :] - (np.arange(lq)[:, None] + place).astype(np.float64)
    out = np.zeros((lq, n_heads, v.shape[2]), np.float64)
    lse = np.full((n_heads, lq), -np.inf)
    if tr.sinks is not None:
        lse[:] = tr.sinks[:, None]
    if lq == 0 or lk == 0:
        return out, lse
    for h in range(n_heads):
        g = h // group
        s = qh[:, h, :] @ k[:, g, :].astype(np.float64).T
        if tr.softcap > 0:
            s = tr.softcap * np.tanh(s / tr.softcap)
        if mask is not None:
            s = s + tr.slopes[h] * mask
        elif tr.max_bias > 0:
            s = s + tr.slopes[h] * distance
        if tr.given is not None:
            s = s - tr.given[h] * np.abs(distance)
        s = np.where(seen, s, -np.inf)
        sigma = -np.inf if tr.sinks is None else tr.sinks[h]
        mx = np.maximum(s.max(axis=1, keepdims=True), sigma)
        # -inf: the row sees nothing (zeros). NaN (a NaN or infinite input) stays NaN.
        ok = ~np.isneginf(mx[:, 0])
        p = np.zeros_like(s)
        p[ok] = np.exp(s[ok] - mx[ok])
        denom = p.sum(axis=1) + (np.exp(sigma - mx[:, 0]) if tr.sinks is not None else 0.0)
        out[ok, h, :] = (p[ok] @ v[:, g, :].astype(np.float64)) / denom[ok, None]
        lse[h, ok] = mx[ok, 0] + np.log(denom[ok])
    return out, lse


def merge_reference(o1, lse1, o2, lse2):
    """SPEC 8's merge of two partial results over disjoint cache ranges, in float64 (lse
    ``[..., H, rows]`` against out ``[..., rows, H, D]``)."""
    l1 = np.moveaxis(np.asarray(lse1, np.float64), -1, -2)[..., None]
    l2 = np.moveaxis(np.asarray(lse2, np.float64), -1, -2)[..., None]
    top = np.maximum(l1, l2)
    safe = np.where(np.isfinite(top), top, 0.0)
    w1, w2 = np.exp(l1 - safe), np.exp(l2 - safe)
    total = w1 + w2
    out = np.where(total > 0, (w1 * o1 + w2 * o2) / np.where(total > 0, total, 1), 0.0)
    lse = np.where(total[..., 0] > 0, safe[..., 0] + np.log(np.where(total[..., 0] > 0, total[..., 0], 1)), -np.inf)
    return out, np.moveaxis(lse, -1, -2)


def gather_pages(cache: np.ndarray, block_table: np.ndarray, seqused_k: np.ndarray, b: int) -> np.ndarray:
    """SPEC 11: sequence ``b``'s cache rows ``[Lk_b, kv_heads, D]`` gathered from a paged cache
    ``[num_blocks, block_size, kv_heads, D]`` (row j is row ``j % block_size`` of block
    ``block_table[b, j // block_size]``): the contiguous layout a paged prefill equals."""
    bs = cache.shape[1]
    j = np.arange(int(seqused_k[b]))
    return np.asarray(cache)[np.asarray(block_table)[b, j // bs], j % bs]


def reference_paged(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    mask: Optional[np.ndarray] = None,
    *,
    block_table: np.ndarray,
    seqused_k: np.ndarray,
    cu_seqlens_q: Optional[np.ndarray] = None,
    alibi_slopes: Optional[np.ndarray] = None,
    **keywords: Any,
):
    """:func:`reference_prefill` of a paged prefill (SPEC 11): each sequence's cache gathered
    (:func:`gather_pages`) and computed on its own, with its explicit mask's first ``Lk_b``
    columns. q is ``[total_q, H, D]`` with ``cu_seqlens_q``, ``[B, Lq, H, D]``, or ``[Lq, H,
    D]`` (one sequence); ``keywords`` are :func:`reference_prefill`'s. Returns ``(out, lse)``
    shaped as the paged call's."""
    q = np.asarray(q)
    batch = len(seqused_k)
    if cu_seqlens_q is not None:
        cq = np.asarray(cu_seqlens_q, np.int64)
        qs = [q[cq[b] : cq[b + 1]] for b in range(batch)]
    else:
        qs = list(q) if q.ndim == 4 else [q]
    m = None if mask is None else np.asarray(mask)
    if m is not None and m.ndim == 4:
        m = m[:, 0]
    if m is not None and m.ndim == 2:
        m = m[None]
    ab = None if alibi_slopes is None else np.asarray(alibi_slopes)
    outs, lses = [], []
    for b in range(batch):
        kb, vb = gather_pages(k_cache, block_table, seqused_k, b), gather_pages(v_cache, block_table, seqused_k, b)
        mb = None if m is None else m[b if m.shape[0] > 1 else 0][:, : kb.shape[0]]
        slopes = None if ab is None else (ab[b] if ab.ndim == 2 else ab)
        o, l = reference_prefill(qs[b], kb, vb, mb, alibi_slopes=slopes, **keywords)
        outs.append(o)
        lses.append(l)
    if cu_seqlens_q is not None:
        return np.concatenate(outs, axis=0), np.concatenate(lses, axis=1)
    if q.ndim == 4:
        return np.stack(outs), np.stack(lses)
    return outs[0], lses[0]


def quantise_q8_0(x: np.ndarray) -> np.ndarray:
    """ggml's Q8_0 of float values ``[..., D]`` (D a multiple of 32): per 32 values along the
    last axis the float16 scale ``d = max|x| / 127`` then 32 int8 ``round(x / d)``, as
    ``uint8 [..., D // 32 * 34]`` (SPEC 11's layout, llama.cpp's ``quantize_row_q8_0``)."""
    x = np.asarray(x, np.float32)
    blocks = x.reshape(x.shape[:-1] + (x.shape[-1] // 32, 32))
    d = np.abs(blocks).max(axis=-1, keepdims=True) / 127.0
    inv = np.where(d > 0, 1.0 / np.where(d > 0, d, 1), 0.0)
    q = np.clip(np.rint(blocks * inv), -127, 127).astype(np.int8)
    out = np.empty(blocks.shape[:-1] + (34,), np.uint8)
    out[..., :2] = d.astype(np.float16).view(np.uint8)
    out[..., 2:] = q.view(np.uint8)
    return out.reshape(x.shape[:-1] + (x.shape[-1] // 32 * 34,))


def dequantise(x: Any, kv_dtype: Optional[str] = None, descale: Any = None) -> np.ndarray:
    """SPEC 11: quantised K/V ``[..., kv_heads, D]`` as their float64 values, exactly: FP8
    (ml_dtypes' float8 arrays, or uint8 bytes with ``kv_dtype`` ``"float8_e4m3fn"`` /
    ``"float8_e5m2"``) times ``descale`` (None, a number, or ``[kv_heads]``, broadcast over
    the heads axis), or Q8_0 bytes (``kv_dtype="q8_0"``: ``float(d) * q`` per block of 32)."""
    import ml_dtypes

    a = np.asarray(x)
    if kv_dtype == "q8_0":
        blocks = a.reshape(a.shape[:-1] + (a.shape[-1] // 34, 34))
        d = np.ascontiguousarray(blocks[..., :2]).view(np.float16).astype(np.float64)
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).astype(np.float64)
        return (d * q).reshape(a.shape[:-1] + (a.shape[-1] // 34 * 32,))
    if a.dtype == np.uint8:
        a = a.view(getattr(ml_dtypes, kv_dtype))
    out = a.astype(np.float64)
    if descale is not None:
        f = np.asarray(descale, np.float64).reshape(-1)
        out = out * (f[:, None] if f.size > 1 else f[0])
    return out
