"""The front door as PyTorch operators: ``torch.ops.mlx_native.flash_attn_prefill`` and
``torch.ops.mlx_native.flash_attn_prefill_lse`` (a ``torch.library`` schema, a CPU and a
CUDA kernel and a fake implementation), so that ``torch.compile``, ``torch.export`` and
``FakeTensorMode`` see one opaque operator whose output they know instead of tracing into
the library.

Importing this module needs torch and registers both operators; ``mlx_native`` imports it
when a torch tensor first reaches :func:`mlx_native.flash_attn_prefill`, so torch stays
optional. The real implementation is the array call (``attention.flash_attn_prefill``):
CPU tensors on the CPU backend, CUDA tensors on their device and on the caller's current
stream. There is no backward pass: a tensor that requires grad is refused."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor

from . import attention
from .arrays import _torch_dtype
from .checks import OUT_DTYPES, check_bool, check_device, check_max_bias, check_offset, check_scale, check_softcap, check_window_sides
from .device import follow_torch_threads
from .dtypes import dtype_name, numpy_dtype_of_name
from .errors import InvalidArgumentError, UnsupportedDtypeError

__all__ = ["flash_attn_prefill"]


#: The operators' namespace; the Library object keeps their definitions for the process.
_LIB = torch.library.Library("mlx_native", "DEF")

_ARGS = (
    "Tensor q, Tensor k, Tensor v, Tensor? mask=None, bool causal=False, SymInt? window=None, float? scale=None, "
    "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, ScalarType? out_dtype=None, str? device=None, "
    "bool check_finite=False, float softcap=0.0, float max_bias=0.0, Tensor? sinks=None, SymInt? offset=None, "
    "int[]? window_size=None, Tensor? alibi_slopes=None"
)
# Defined with a schema and plain kernels rather than torch.library.custom_op: the same
# operator to the tracers, at a fraction of custom_op's dispatch cost per eager call (about
# 5 us against 20-30 us on this CPU), which a call of a short prefill would feel.
_LIB.define(f"flash_attn_prefill({_ARGS}) -> Tensor")
_LIB.define(f"flash_attn_prefill_lse({_ARGS}) -> (Tensor, Tensor)")


def _kernel(return_lse: bool, cpu: bool):
    def kernel(q, k, v, mask=None, causal=False, window=None, scale=None, cu_seqlens_q=None, cu_seqlens_k=None,
               out_dtype=None, device=None, check_finite=False, softcap=0.0, max_bias=0.0, sinks=None,
               offset=None, window_size=None, alibi_slopes=None):  # fmt: skip
        if window_size is not None:  # a two-sided window (left, right), FlashAttention's
            window = (int(window_size[0]), int(window_size[1]))
        if cpu:  # as many threads as PyTorch's own CPU operators, unless the caller chose
            follow_torch_threads(torch.get_num_threads())
        # The array call itself, never the public front door (which would come back here).
        return attention.flash_attn_prefill(
            q, k, v, mask, causal=causal, window=window, scale=scale, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k, return_lse=return_lse, out_dtype=out_dtype, device=device,
            check_finite=check_finite, offset=offset, softcap=softcap, max_bias=max_bias, sinks=sinks,
            alibi_slopes=alibi_slopes,
        )  # fmt: skip

    return kernel


def _fake_out(q: Tensor, v: Tensor, out_dtype: Optional[torch.dtype]) -> Tensor:
    if q.dim() not in (3, 4):
        raise InvalidArgumentError(
            f"q must be 3-D [rows, heads, head_dim] or 4-D [batch, rows, heads, head_dim], got {q.dim()} axes "
            f"(a [batch, heads, rows, head_dim] tensor passes as q.transpose(1, 2), without a copy)"
        )
    # Shaped like q with v's head dim (576/512: MLA), contiguous, as the real call returns it.
    return q.new_empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype if out_dtype is None else out_dtype)


def _is_fake(t: Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _check_fake_operands(named: dict) -> None:
    """The fake implementation runs for FakeTensors (tracing) and for meta tensors. A meta
    tensor among tensors with data would make torch run it on those too, and return an
    uninitialised output for them: that mix is refused, naming the operands."""
    real = [n for n, t in named.items() if t is not None and not _is_fake(t) and t.device.type != "meta"]
    meta = [n for n, t in named.items() if t is not None and not _is_fake(t) and t.device.type == "meta"]
    if real and meta:
        raise InvalidArgumentError(
            f"{', '.join(meta)} {'is' if len(meta) == 1 else 'are'} on the meta device (no data) and "
            f"{', '.join(real)} {'holds' if len(real) == 1 else 'hold'} data on "
            f"{named[real[0]].device}: pass every operand with its data on one device"
        )
    # The arrays the kernel reads sit on q's device (the sequence offsets are read on the
    # host, and a host mask is copied to q's device, as the real call does).
    for name in ("k", "v", "mask", "sinks", "alibi_slopes"):
        t = named[name]
        if t is not None and t.device != named["q"].device and not (name == "mask" and t.device.type == "cpu"):
            raise InvalidArgumentError(f"{name} is on {t.device} and q on {named['q'].device}: they must be on one device")


def _concrete(t: Optional[Tensor]) -> bool:
    """Whether a tensor's shape and strides are plain ints (not symbols of a dynamic trace)."""
    return t is None or all(type(d) is int for d in tuple(t.shape) + tuple(t.stride()))


def _check_like_the_real_call(q, k, v, mask, sinks, cu_seqlens_q, cu_seqlens_k, kw, alibi_slopes=None) -> None:
    """Every check the real call makes that needs no data: a plan made on the operands'
    layouts (ArraySpecs on the CPU backend, which checks what every backend does); the
    sequence offsets' values are data, so with them only their presence is planned."""
    from .plan import ArraySpec, PrefillPlan

    def spec(t):
        return None if t is None else ArraySpec(tuple(t.shape), t.dtype, tuple(t.stride()))

    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise InvalidArgumentError("cu_seqlens_q and cu_seqlens_k go together: pass both (variable length) or neither")
    if cu_seqlens_q is not None:
        if mask is not None:
            raise InvalidArgumentError(
                "an explicit mask cannot go with cu_seqlens: describe the mask (causal, window) or pad the batch "
                "to a fixed length ([B, rows, heads, head_dim]) and pass a [B, 1, rows, kv] mask"
            )
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1:
                raise InvalidArgumentError(f"{name} must be a 1-D int32 or int64 tensor of B + 1 offsets")
        # A causal prompt shorter than its cache is checked per sequence, on the values.
        kw = dict(kw, offset=kw["offset"] if kw["offset"] is not None else (0 if kw["causal"] or kw["window"] else None))
    if alibi_slopes is not None:  # the slopes' values are data: their shape and dtype are planned
        from .checks import check_alibi_slopes

        batch = (q.shape[0] if q.dim() == 4 else 1) if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
        check_alibi_slopes(_SlopesSpec(alibi_slopes), q.shape[-2], batch, kw["max_bias"], values=False)
    PrefillPlan(spec(q), spec(k), spec(v), spec(mask), sinks=spec(sinks), device="cpu", **kw)


class _SlopesSpec:
    """The shape and dtype of a (fake) slopes tensor, as ``check_alibi_slopes`` reads them."""

    def __init__(self, t: Tensor):
        self.shape = tuple(t.shape)
        self.ndim = len(self.shape)
        self.size = 0
        try:
            self.dtype = np.dtype(str(t.dtype).replace("torch.", ""))
        except TypeError:  # bfloat16: any dtype but float32 is refused, named as numpy names it
            self.dtype = np.dtype(np.float16)


def _fake(return_lse: bool):
    def fake(q, k, v, mask=None, causal=False, window=None, scale=None, cu_seqlens_q=None, cu_seqlens_k=None,
             out_dtype=None, device=None, check_finite=False, softcap=0.0, max_bias=0.0, sinks=None,
             offset=None, window_size=None, alibi_slopes=None):  # fmt: skip
        named = dict(q=q, k=k, v=v, mask=mask, sinks=sinks, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                     alibi_slopes=alibi_slopes)  # fmt: skip
        _check_fake_operands(named)
        if window_size is not None:
            window = (int(window_size[0]), int(window_size[1]))
        if all(_concrete(t) for t in (q, k, v, mask, sinks, alibi_slopes)):
            kw = dict(causal=causal, window=window, scale=scale, out_dtype=out_dtype, softcap=softcap,
                      max_bias=max_bias, offset=offset)  # fmt: skip
            _check_like_the_real_call(q, k, v, mask, sinks, cu_seqlens_q, cu_seqlens_k, kw, alibi_slopes)
        out = _fake_out(q, v, out_dtype)
        if not return_lse:
            return out
        shape = (q.shape[0], q.shape[2], q.shape[1]) if q.dim() == 4 else (q.shape[1], q.shape[0])
        return out, q.new_empty(shape, dtype=torch.float32)

    return fake


for _name, _lse in (("flash_attn_prefill", False), ("flash_attn_prefill_lse", True)):
    for _key in ("CPU", "CUDA"):
        _LIB.impl(_name, _kernel(_lse, _key == "CPU"), _key)
    torch.library.register_fake(f"mlx_native::{_name}", _fake(_lse), lib=_LIB)


def _refuse_grad(**tensors) -> None:
    for name, t in tensors.items():
        if t is not None and t.requires_grad:
            raise InvalidArgumentError(
                f"{name} requires grad, and mlx_native computes no backward pass: pass {name}.detach() "
                "(or call it under torch.no_grad())"
            )


def _torch_out_dtype(out_dtype: Any) -> Optional[torch.dtype]:
    if out_dtype is None:
        return None
    name = dtype_name(out_dtype)
    if name not in OUT_DTYPES:
        raise UnsupportedDtypeError(
            f"out_dtype must be one of {', '.join(OUT_DTYPES)} (or None: q's dtype), got {name}"
        )
    return out_dtype if isinstance(out_dtype, torch.dtype) else _torch_dtype(numpy_dtype_of_name(name))


def flash_attn_prefill(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None, *, causal: Any = False,
                       window: Any = None, scale: Any = None, cu_seqlens_q: Optional[Tensor] = None,
                       cu_seqlens_k: Optional[Tensor] = None, return_lse: Any = False, out_dtype: Any = None,
                       device: Optional[str] = None, check_finite: Any = False, softcap: Any = 0.0, max_bias: Any = 0.0,
                       sinks: Optional[Tensor] = None, offset: Any = None,
                       alibi_slopes: Optional[Tensor] = None):  # fmt: skip
    """``mlx_native.flash_attn_prefill`` on torch tensors, through the operators: the
    arguments are checked here (the library's typed errors, not the schema's), then one
    operator runs."""
    if not torch.compiler.is_compiling():
        # The library's typed errors rather than the schema's; values already of the
        # schema's types skip their checks here (the array call checks them all again).
        # Traced code holds these as constants, checked when it first ran eagerly or
        # refused by the schema: checking them in a trace would only break the graph.
        if type(causal) is not bool:
            causal = check_bool(causal, "causal")
        if type(return_lse) is not bool:
            return_lse = check_bool(return_lse, "return_lse")
        if type(check_finite) is not bool:
            check_finite = check_bool(check_finite, "check_finite")
        if window is not None:
            causal, window = check_window_sides(window, causal)
        if scale is not None and type(scale) is not float:
            scale = check_scale(scale)
        if device is not None:
            device = check_device(device)
        if type(softcap) is not float:
            softcap = check_softcap(0.0 if softcap is None else softcap)
        if type(max_bias) is not float:
            max_bias = check_max_bias(0.0 if max_bias is None else max_bias)
        if offset is not None:
            offset = check_offset(offset, causal or window is not None)
    _refuse_grad(q=q, k=k, v=v, mask=mask, sinks=sinks, alibi_slopes=alibi_slopes)
    # A two-sided window travels as window_size=[left, right] (the schema's window is an int).
    window_size = None
    if isinstance(window, (tuple, list)):
        window_size, window = [int(window[0]), int(window[1])], None
    # The overloads, called by position: no name look-up, no keyword parsing.
    op = _LSE_OP if return_lse else _OP
    return op(q, k, v, mask, causal, window, scale, cu_seqlens_q, cu_seqlens_k, _torch_out_dtype(out_dtype), device,
              check_finite, softcap, max_bias, sinks, offset, window_size, alibi_slopes)  # fmt: skip


_OP = torch.ops.mlx_native.flash_attn_prefill.default
_LSE_OP = torch.ops.mlx_native.flash_attn_prefill_lse.default
