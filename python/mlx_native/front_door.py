"""``mlx_native.flash_attn_prefill``, the public call: torch tensors go through the
``torch.ops.mlx_native`` operators (``torch_ops.py``), so that ``torch.compile`` traces a
function that calls it without a graph break; every other array (and torch tensors with a
``mlx_native.Device`` object, which no operator schema can carry) goes straight to the
array call of ``attention.py``, which the operators run too."""

from __future__ import annotations

from typing import Any, Optional, Union

from . import attention
from .device import Device
from .head_dims import cut_head_dim, pad_head_dims

__all__ = ["flash_attn_prefill"]


def flash_attn_prefill(
    q: Any,
    k: Any,
    v: Any,
    mask: Any = None,
    *,
    causal: bool = False,
    window: Any = None,
    scale: Optional[float] = None,
    cu_seqlens_q: Any = None,
    cu_seqlens_k: Any = None,
    return_lse: bool = False,
    out_dtype: Any = None,
    device: Union[None, str, Device] = None,
    check_finite: bool = False,
    softcap: float = 0.0,
    max_bias: float = 0.0,
    sinks: Any = None,
    offset: Optional[int] = None,
    layout: str = "NHD",
    alibi_slopes: Any = None,
) -> Any:
    # A head dim without a kernel runs on the next kernel size, zero-padded (head_dims.py):
    # here, so that every entry (torch operators and arrays alike) gets it.
    q, k, v, scale, cut = pad_head_dims(q, k, v, scale)
    out = _dispatch(
        q, k, v, mask, causal=causal, window=window, scale=scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        return_lse=return_lse, out_dtype=out_dtype, device=device, check_finite=check_finite, softcap=softcap,
        max_bias=max_bias, sinks=sinks, offset=offset, layout=layout, alibi_slopes=alibi_slopes,
    )  # fmt: skip
    if cut is None:
        return out
    if isinstance(out, tuple):
        return cut_head_dim(out[0], cut), out[1]
    return cut_head_dim(out, cut)


def _dispatch(q, k, v, mask, *, causal, window, scale, cu_seqlens_q, cu_seqlens_k, return_lse, out_dtype, device,
              check_finite, softcap, max_bias, sinks, offset, layout, alibi_slopes):  # fmt: skip
    if _through_torch_op(q, k, v, mask, cu_seqlens_q, cu_seqlens_k, sinks, alibi_slopes) and not isinstance(
        device, Device
    ):
        ops = _torch_ops or _import_torch_ops()
        return ops.flash_attn_prefill(
            q, k, v, mask, causal=causal, window=window, scale=scale, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k, return_lse=return_lse, out_dtype=out_dtype, device=device,
            check_finite=check_finite, softcap=softcap, max_bias=max_bias, sinks=sinks, offset=offset, layout=layout,
            alibi_slopes=alibi_slopes,
        )  # fmt: skip
    return attention.flash_attn_prefill(
        q, k, v, mask, causal=causal, window=window, scale=scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        return_lse=return_lse, out_dtype=out_dtype, device=device, check_finite=check_finite, offset=offset,
        softcap=_off_if_none(softcap), max_bias=_off_if_none(max_bias), sinks=sinks, layout=layout,
        alibi_slopes=alibi_slopes,
    )  # fmt: skip


def _off_if_none(x: Any) -> Any:
    """``softcap`` or ``max_bias`` None (as transformers passes "no softcap") is 0.0: off;
    anything else goes to the array call's own check."""
    return 0.0 if x is None else x


#: ``torch_ops`` once imported (an import statement per call would cost more than the
#: operator's dispatch).
_torch_ops = None


def _import_torch_ops():
    global _torch_ops
    from . import torch_ops  # registers the operators; torch is imported by now (q is a tensor)

    _torch_ops = torch_ops
    return torch_ops


def _is_torch(x) -> bool:
    mod = type(x).__module__
    return mod == "torch" or mod.startswith("torch.")


def _through_torch_op(q, k, v, *optional) -> bool:
    """Whether every array argument is a torch tensor (the optional ones may be None): an
    operator's schema takes nothing else, and the array call gives the typed error for
    anything else."""
    if not (_is_torch(q) and _is_torch(k) and _is_torch(v)):
        return False
    return all(x is None or _is_torch(x) for x in optional)


flash_attn_prefill.__doc__ = (attention.flash_attn_prefill.__doc__ or "") + """

    Torch tensors (q, k, v and any mask, ``cu_seqlens``, ``sinks``) go through the operator
    ``torch.ops.mlx_native.flash_attn_prefill`` (``flash_attn_prefill_lse`` with
    ``return_lse``), so ``torch.compile(fn, fullgraph=True)`` traces a function that calls
    this without a graph break; ``device`` as a ``mlx_native.Device`` object runs outside it.
    ``softcap``, ``max_bias``, ``sinks`` (SPEC 10) and ``offset`` are passed on when not
    their defaults.

    Head dims without a kernel of their own (any up to the largest kernel's, e.g.
    FlashAttention's 32, 40, 59, 160, 224) run on the next kernel size: q, k and v are
    copied with zero columns up to it (which change no score), the output's extra columns
    are cut off, and ``scale=None`` stays ``1/sqrt`` of the caller's head dim. Numpy arrays
    and torch tensors only; the plan (``PrefillPlan``) takes kernel head dims alone."""
