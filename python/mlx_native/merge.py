"""``merge_attention_states``: SPEC 8's exact merge of two partial attention results over
disjoint cache ranges, from their outputs and log-sum-exps, on the inputs' device."""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np

from .arrays import Operand
from .errors import InvalidArgumentError, UnsupportedDtypeError

__all__ = ["merge_attention_states"]


def merge_attention_states(o1: Any, lse1: Any, o2: Any, lse2: Any) -> Tuple[Any, Any]:
    """Merge two partial results of attention over disjoint parts of a cache (SPEC 8)::

        L   = ln(e^lse1 + e^lse2)
        out = e^(lse1 - L) * o1 + e^(lse2 - L) * o2

    ``o1``, ``o2``: ``[rows, heads, dim]`` or ``[batch, rows, heads, dim]`` (as
    :func:`flash_attn_prefill` returns them); ``lse1``, ``lse2``: float32 ``[heads, rows]``
    or ``[batch, heads, rows]`` (its ``return_lse=True``). numpy arrays or torch tensors
    (CPU or CUDA), computed in float32 (float64 for float64 inputs) with the inputs' library
    on their device. Returns ``(out, lse)``: out in o1's dtype, lse float32. Exact for rows
    that see nothing: where both lse are -inf the output is 0 and the lse -inf. A NaN in
    either lse makes that row's lse and output NaN (never "saw nothing")."""
    ops = [Operand.of(x, n) for x, n in ((o1, "o1"), (lse1, "lse1"), (o2, "o2"), (lse2, "lse2"))]
    a1, l1, a2, l2 = ops
    libs = {op.library for op in ops}
    if len(libs) != 1 or len({op.device for op in ops}) != 1:
        raise InvalidArgumentError(
            f"o1, lse1, o2, lse2 must be arrays of one library on one device, got "
            f"{', '.join(f'{op.library} on {op.device}' for op in ops)}"
        )
    if a1.shape != a2.shape:
        raise InvalidArgumentError(f"o1 has shape {a1.shape} and o2 {a2.shape}: they must match")
    if a1.ndim not in (3, 4):
        raise InvalidArgumentError(f"o1 must be [rows, heads, dim] or [batch, rows, heads, dim], got shape {a1.shape}")
    want = a1.shape[:-3] + (a1.shape[-2], a1.shape[-3])
    for name, op in (("lse1", l1), ("lse2", l2)):
        if op.shape != want:
            raise InvalidArgumentError(f"{name} must have shape {want} ([..., heads, rows] for o {a1.shape}), got {op.shape}")
    for op, name in ((a1, "o1"), (a2, "o2"), (l1, "lse1"), (l2, "lse2")):
        if op.dtype.kind != "f" and op.dtype.name != "bfloat16":
            raise UnsupportedDtypeError(f"{name} must be floating point, got {op.dtype.name}")
    if a1.library == "torch":
        return _merge_torch(o1, lse1, o2, lse2)
    if a1.library == "cupy":
        import cupy as xp

        arrays = (o1, lse1, o2, lse2)
    else:
        xp, arrays = np, tuple(op.host_array() for op in ops)
    return _merge_xp(xp, *arrays)


def _merge_xp(xp, o1, lse1, o2, lse2):
    wide = xp.float64 if xp.float64 in (o1.dtype, o2.dtype, lse1.dtype, lse2.dtype) else xp.float32
    l1, l2 = lse1.astype(wide), lse2.astype(wide)
    top = xp.maximum(l1, l2)  # NaN where either is NaN
    seen = top != -xp.inf  # NaN counts as seen: it must reach the output, not hide as -inf
    base = xp.where(seen, top, 0)
    w1, w2 = xp.exp(l1 - base), xp.exp(l2 - base)  # both 0 where nothing is seen
    total = w1 + w2
    denom = xp.where(seen, total, 1)
    lse = xp.where(seen, base + xp.log(denom), -xp.inf)
    lse = xp.where(top == xp.inf, xp.inf, lse).astype(xp.float32)  # ln(e^inf + e^x) (its output is NaN)
    c1 = xp.swapaxes(w1 / denom, -1, -2)[..., None]
    c2 = xp.swapaxes(w2 / denom, -1, -2)[..., None]
    out = (c1 * o1.astype(wide) + c2 * o2.astype(wide)).astype(o1.dtype)
    return out, lse


def _merge_torch(o1, lse1, o2, lse2):
    import torch

    wide = torch.float64 if torch.float64 in (o1.dtype, o2.dtype, lse1.dtype, lse2.dtype) else torch.float32
    l1, l2 = lse1.to(wide), lse2.to(wide)
    top = torch.maximum(l1, l2)  # NaN where either is NaN
    seen = top != float("-inf")  # NaN counts as seen: it must reach the output, not hide as -inf
    base = torch.where(seen, top, torch.zeros_like(top))
    w1, w2 = torch.exp(l1 - base), torch.exp(l2 - base)
    denom = torch.where(seen, w1 + w2, torch.ones_like(top))
    lse = torch.where(seen, base + torch.log(denom), torch.full_like(top, float("-inf")))
    lse = torch.where(top == float("inf"), top, lse).to(torch.float32)  # ln(e^inf + e^x) (its output is NaN)
    c1 = (w1 / denom).transpose(-1, -2).unsqueeze(-1)
    c2 = (w2 / denom).transpose(-1, -2).unsqueeze(-1)
    out = (c1 * o1.to(wide) + c2 * o2.to(wide)).to(o1.dtype)
    return out, lse
