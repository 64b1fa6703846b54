"""Head dims without a kernel of their own, run on the next kernel size with zero padding.

The kernels exist for a fixed set of head dims (``mlxn_flash_attn_prefill_supports``);
FlashAttention takes any multiple of 8 up to 256 (its tests also use 59 and 111). Padding
Q and K with zero columns changes no score (``q . k`` gains only ``0 * 0`` terms); V's zero
columns give output columns that are sliced off. Only the scale must stay the caller's
(``1/sqrt(D)`` of the unpadded D by default, never of the padded one), and SPEC 2's
``half(scale * q)`` rounds the same values. So the padded run equals an unpadded kernel of
that head dim would, at the cost of the padding's work and one copy of q, k and v.

The set of kernel head dims is read from the library once, at import, into plain Python
sets: the front door decides on padding from shapes and dtypes alone, which
``torch.compile`` traces without a graph break (a cffi call would break it)."""

from __future__ import annotations

import math
from typing import Any, Dict, FrozenSet, Optional, Tuple

import numpy as np

from ._lib import lib
from .dtypes import DTYPE_CODES

__all__ = ["KERNEL_HEAD_DIMS", "cut_head_dim", "kernel_head_dim", "pad_head_dims", "supported_pair"]

#: The K/V dtypes probed; a dtype this build has no kernel for has no entry.
_PROBED_KV_DTYPES = ("float16", "bfloat16", "float32")
#: Head dims probed (every kernel size is a multiple of 8; MLA's 576 is below this).
_PROBE_LIMIT = 1024


def _probe() -> Tuple[Dict[str, FrozenSet[int]], Dict[str, FrozenSet[Tuple[int, int]]]]:
    squares: Dict[str, FrozenSet[int]] = {}
    pairs: Dict[str, FrozenSet[Tuple[int, int]]] = {}
    for name in _PROBED_KV_DTYPES:
        code = DTYPE_CODES.get(name)
        if code is None:
            continue
        sq = [d for d in range(8, _PROBE_LIMIT + 1, 8) if lib.mlxn_flash_attn_prefill_supports(d, d, code) == 0]
        if not sq:
            continue
        squares[name] = frozenset(sq)
        # Q/K and V head dims that differ (MLA's 576/512): V's is one of the square sizes.
        pairs[name] = frozenset(
            (dk, dv)
            for dk in range(8, _PROBE_LIMIT + 1, 8)
            for dv in sq
            if dk != dv and lib.mlxn_flash_attn_prefill_supports(dk, dv, code) == 0
        )
    return squares, pairs


#: For each K/V dtype name, the head dims with a kernel (Q/K and V alike).
KERNEL_HEAD_DIMS, _KERNEL_PAIRS = _probe()


def supported_pair(head_dim: int, head_dim_v: int, kv_dtype: str) -> bool:
    """Whether a kernel exists for these head dims and K/V dtype (pure Python)."""
    if head_dim == head_dim_v:
        return head_dim in KERNEL_HEAD_DIMS.get(kv_dtype, ())
    return (head_dim, head_dim_v) in _KERNEL_PAIRS.get(kv_dtype, ())


def kernel_head_dim(head_dim: int, head_dim_v: int, kv_dtype: str) -> Optional[int]:
    """The head dim a call with these head dims runs at: None when a kernel takes them as
    they are (or when none is larger: the op then refuses them by name), else the smallest
    kernel size at least as large as both (Q, K and V padded to it)."""
    if supported_pair(head_dim, head_dim_v, kv_dtype):
        return None
    need = max(head_dim, head_dim_v)
    larger = [d for d in KERNEL_HEAD_DIMS.get(kv_dtype, ()) if d >= need]
    return min(larger) if larger and need > 0 else None


#: torch's names of the K/V dtypes, by ``str(dtype)`` (torch is optional: no import here).
_TORCH_KV_NAMES = {"torch.float16": "float16", "torch.bfloat16": "bfloat16", "torch.float32": "float32"}


def _kv_dtype_name(k: Any) -> str:
    dt = k.dtype
    if isinstance(dt, np.dtype):
        return dt.name
    return _TORCH_KV_NAMES.get(str(dt), "")


def _pad(x: Any, width: int) -> Any:
    """``x`` with zero columns appended to its last axis up to ``width`` (a new array of its
    library: torch's ``pad`` on its device, numpy's zeros and a copy)."""
    n = x.shape[-1]
    if type(x).__module__.startswith("torch"):
        import torch

        return torch.nn.functional.pad(x, (0, width - n))
    out = np.zeros(tuple(x.shape[:-1]) + (width,), dtype=x.dtype)
    out[..., :n] = x
    return out


def _is_padded_kind(x: Any) -> bool:
    mod = type(x).__module__
    return type(x) is np.ndarray or mod == "torch" or mod.startswith("torch.")


def pad_head_dims(q: Any, k: Any, v: Any, scale: Optional[float]):
    """``(q, k, v, scale, head_dim_v)`` to run: the arrays themselves (and ``head_dim_v``
    None) when a kernel takes their head dims, else copies padded with zero columns to the
    next kernel size, with ``scale`` made explicit (the unpadded ``1/sqrt(D)`` when None)
    and V's head dim to cut the output back to. Arrays other than numpy's and torch's, and
    head dims larger than every kernel's, pass as they are (the op refuses them by name)."""
    if not (_is_padded_kind(q) and _is_padded_kind(k) and _is_padded_kind(v)):
        return q, k, v, scale, None
    dk, dv = int(q.shape[-1]), int(v.shape[-1])
    if int(k.shape[-1]) != dk or q.ndim < 3:
        return q, k, v, scale, None  # the op's own shape errors
    width = kernel_head_dim(dk, dv, _kv_dtype_name(k))
    if width is None:
        return q, k, v, scale, None
    if scale is None:
        scale = 1.0 / math.sqrt(dk)
    return _pad(q, width), _pad(k, width), _pad(v, width), scale, dv


def cut_head_dim(out: Any, head_dim_v: int) -> Any:
    """The output of a padded run with V's padding cut off, contiguous (as every output)."""
    cut = out[..., :head_dim_v]
    if type(cut) is np.ndarray:
        return np.ascontiguousarray(cut)
    return cut.contiguous()
