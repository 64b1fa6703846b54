"""The float64 reference of SPEC section 3, the error metric, and test inputs."""

from __future__ import annotations

from typing import Iterable, Optional

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
        seen = np.isfinite(mx[:, 0])
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
