"""FlashAttention's forward semantics written out in PyTorch, for the interface tests: the
visibility of ``causal`` and ``window_size`` (bottom-right aligned when seqlen_q !=
seqlen_k), softcap, ALiBi slopes, GQA/MQA, and the error rule of FlashAttention's tests (our
output's distance from a float64 reference at most twice the distance of PyTorch computing
the same in the inputs' low precision, plus a small epsilon)."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

#: The epsilon beside twice PyTorch's error (the output's own rounding on tiny outputs).
EPS = 1e-5


def visible(seqlen_q: int, seqlen_k: int, causal: bool, window_size: Tuple[int, int], device="cpu") -> torch.Tensor:
    """bool ``[seqlen_q, seqlen_k]``: query ``i`` (at cache position ``p = i + seqlen_k -
    seqlen_q``) sees key ``j`` iff ``p - left <= j <= p + right`` (-1: unbounded; causal
    makes ``right`` 0)."""
    left, right = window_size
    if causal:
        right = 0
    p = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    j = torch.arange(seqlen_k, device=device)[None, :]
    ok = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        ok &= j <= p + right
    if left >= 0:
        ok &= j >= p - left
    return ok


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    upcast: bool = True,
):
    """``(out, lse)`` for q ``[B, Sq, H, D]``, k/v ``[B, Sk, Hk, D]``: in float64 when
    ``upcast`` (the reference), else in the inputs' dtype with the softmax in float32 and P
    rounded to it (what PyTorch computes in low precision). A row that sees nothing is
    zeros with lse +inf (FlashAttention's value)."""
    dtype = q.dtype
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    s = torch.einsum("bthd,bshd->bhts", q * scale, k)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    sq, sk = q.shape[1], k.shape[1]
    ok = visible(sq, sk, causal, window_size, q.device)
    if alibi_slopes is not None:
        slopes = alibi_slopes.double() if upcast else alibi_slopes.float()
        slopes = slopes.reshape(-1, q.shape[2]) if slopes.dim() == 1 else slopes  # [1 or B, H]
        p = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
        dist = (p - torch.arange(sk, device=q.device)[None, :]).abs().to(s.dtype if upcast else torch.float32)
        s = s.to(dist.dtype) - slopes[:, :, None, None] * dist
    s = s.masked_fill(~ok, float("-inf"))
    sf = s if upcast else s.float()
    lse = torch.logsumexp(sf, dim=-1)
    p_ = torch.softmax(sf, dim=-1).masked_fill(~ok.any(-1)[:, None], 0.0)
    p_ = torch.nan_to_num(p_, nan=0.0)
    if not upcast:
        p_ = p_.to(dtype)
    out = torch.einsum("bhts,bshd->bthd", p_, v)
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    return out, lse


def within_rule(out: torch.Tensor, ref: torch.Tensor, pt: torch.Tensor) -> Tuple[bool, float, float]:
    """FlashAttention's test rule: ``max|out - ref| <= 2 * max|pt - ref| + EPS``; returns
    (holds, ours, PyTorch's)."""
    ours = (out.double() - ref).abs().max().item() if out.numel() else 0.0
    theirs = (pt.double() - ref).abs().max().item() if pt.numel() else 0.0
    return ours <= 2 * theirs + EPS, ours, theirs
