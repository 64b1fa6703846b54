"""The front door as PyTorch operators: ``torch.ops.mlx_native.flash_attn_prefill`` and
``torch.ops.mlx_native.flash_attn_prefill_lse`` (a ``torch.library`` schema, a CPU and a
CUDA kernel and a fake implementation), so that ``torch.compile``, ``torch.export`` and
``FakeTensorMode`` see one opaque operator whose output they know instead of tracing into
the library.

Importing this module needs torch and registers both operators; ``mlx_native`` imports it
when a torch tensor first reaches :func:`mlx_native.flash_attn_prefill`, so torch stays
optional. The real implementation is the array call (``attention.flash_attn_prefill``):
CPU tensors on the CPU backend, CUDA tensors on their device and on the caller's current
stream. There is no backward pass: the forward runs under grad mode (a model in eval mode
called without ``torch.no_grad()``), and a backward through it raises
:class:`~mlx_native.UnsupportedFeatureError` when it is called (``_no_backward``)."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor

from . import attention
from .arrays import _torch_dtype
from .checks import OUT_DTYPES
from .device import follow_torch_threads
from .dtypes import dtype_name, numpy_dtype_of_name
from .errors import InvalidArgumentError, UnsupportedDtypeError, UnsupportedFeatureError
from .options import PrefillArgs, checked
from .paged import refuse_unpaged_arguments
from .quant import kv_format_name

__all__ = ["flash_attn_prefill"]


#: The operators' namespace; the Library object keeps their definitions for the process.
_LIB = torch.library.Library("mlx_native", "DEF")

_ARGS = (
    "Tensor q, Tensor k, Tensor v, Tensor? mask=None, bool causal=False, SymInt? window=None, float? scale=None, "
    "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, ScalarType? out_dtype=None, str? device=None, "
    "bool check_finite=False, float softcap=0.0, float max_bias=0.0, Tensor? sinks=None, SymInt? offset=None, "
    'str layout="NHD", int[]? window_size=None, Tensor? alibi_slopes=None, SymInt? kv_splits=None, '
    "str? cta_pairs=None, str? cuda_form=None, str? cpu_isa=None, Tensor? block_table=None, Tensor? seqused_k=None, "
    "str? kv_dtype=None, Tensor? k_descale=None, Tensor? v_descale=None"
)
# Defined with a schema and plain kernels rather than torch.library.custom_op: the same
# operator to the tracers, at a fraction of custom_op's dispatch cost per eager call (about
# 5 us against 20-30 us on this CPU), which a call of a short prefill would feel.
_LIB.define(f"flash_attn_prefill({_ARGS}) -> Tensor")
_LIB.define(f"flash_attn_prefill_lse({_ARGS}) -> (Tensor, Tensor)")
# The same operators with an autograd formula (whose backward raises), for inputs that
# require grad: a Python autograd kernel costs every call about 30 us, which the plain
# ones, called whenever no input requires grad, do not pay.
_LIB.define(f"flash_attn_prefill_autograd({_ARGS}) -> Tensor")
_LIB.define(f"flash_attn_prefill_lse_autograd({_ARGS}) -> (Tensor, Tensor)")


#: The schema's arguments after q, k, v, as PrefillArgs holds them but for the window's two
#: forms: ``window`` (an int) and ``window_size`` (a two-sided window, FlashAttention's),
#: which stands before ``alibi_slopes``; ``return_lse`` picks the operator. ``_TAIL``: the
#: fields after ``alibi_slopes`` (the run options, paged K/V's ``block_table`` and
#: ``seqused_k``, quantised K/V's ``kv_dtype`` (a format name), ``k_descale`` and
#: ``v_descale`` (float32 tensors: a number is made one, ``_quantised_schema_form``)), read from
#: PrefillArgs, where the keywords are written once.
_TAIL = PrefillArgs._fields[15:-1]
_SCHEMA_NAMES = PrefillArgs._fields[:14] + ("window_size", "alibi_slopes") + _TAIL
assert tuple(arg.split("=")[0].split()[-1] for arg in _ARGS.split(", ")[3:]) == _SCHEMA_NAMES
assert PrefillArgs._fields[14] == "alibi_slopes" and PrefillArgs._fields[-1] == "return_lse"
_SCHEMA_DEFAULTS = PrefillArgs()[:14] + (None, None) + PrefillArgs()[15 : 15 + len(_TAIL)]


def _args_of(given: tuple, return_lse: bool) -> PrefillArgs:
    """The :class:`PrefillArgs` of an operator's call: the dispatcher passes the schema's
    arguments by position and leaves out trailing ones equal to their defaults."""
    full = given + _SCHEMA_DEFAULTS[len(given):]
    window_size = full[14]
    args = PrefillArgs(*full[:14], full[15], *full[16:], return_lse=return_lse)
    if window_size is not None:  # a two-sided window (left, right), FlashAttention's
        args = args._replace(window=(int(window_size[0]), int(window_size[1])))
    return args


def _kernel(return_lse: bool, cpu: bool, autograd: bool = False):
    def kernel(q, k, v, *given):
        args = _args_of(given, return_lse)
        if cpu:  # as many threads as PyTorch's own CPU operators, unless the caller chose
            follow_torch_threads(torch.get_num_threads())
        # Below the autograd key the tensors still say requires_grad; the kernels read data.
        # The plain operators have no formula: under grad mode such a tensor is refused
        # there, by name (a direct call); under no_grad nothing records a graph.
        if autograd or not torch.is_grad_enabled():
            q, k, v = _detached(q), _detached(k), _detached(v)
            if _any_requires_grad(args.mask, args.sinks, args.alibi_slopes):
                args = args._replace(
                    mask=_detached(args.mask), sinks=_detached(args.sinks), alibi_slopes=_detached(args.alibi_slopes)
                )
        # The array call itself, never the public front door (which would come back here).
        return attention.prefill(q, k, v, args)

    return kernel


def _detached(t: Optional[Tensor]) -> Optional[Tensor]:
    return t.detach() if t is not None and t.requires_grad else t


def _fake_out(q: Tensor, v: Tensor, out_dtype: Optional[torch.dtype], kv_dtype: Optional[str] = None) -> Tensor:
    if q.dim() not in (3, 4):
        raise InvalidArgumentError(
            f"q must be 3-D [rows, heads, head_dim] or 4-D [batch, rows, heads, head_dim] (layout=\"NHD\"), or "
            f"[heads, rows, head_dim] / [batch, heads, rows, head_dim] (layout=\"HND\"), got {q.dim()} axes"
        )
    # Shaped like q (in its layout) with v's head dim (576/512: MLA; a Q8_0 row of n blocks
    # of 34 bytes holds 32 n values), contiguous, as the real call returns it.
    dv = v.shape[-1] // 34 * 32 if kv_dtype == "q8_0" else v.shape[-1]
    return q.new_empty(q.shape[:-1] + (dv,), dtype=q.dtype if out_dtype is None else out_dtype)


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
    # host, and a host mask is copied to q's device, as the real call does; the descale
    # factors, the plan's, are read on the host from a tensor on any device: not listed).
    for name in ("k", "v", "mask", "sinks", "alibi_slopes"):
        t = named[name]
        if t is not None and t.device != named["q"].device and not (name == "mask" and t.device.type == "cpu"):
            raise InvalidArgumentError(f"{name} is on {t.device} and q on {named['q'].device}: they must be on one device")


def _concrete(t: Optional[Tensor]) -> bool:
    """Whether a tensor's shape and strides are plain ints (not symbols of a dynamic trace)."""
    return t is None or all(type(d) is int for d in tuple(t.shape) + tuple(t.stride()))


def _check_like_the_real_call(q, k, v, args: PrefillArgs) -> None:
    """Every check the real call makes that needs no data: a plan made on the operands'
    layouts (ArraySpecs on the CPU backend, which checks what every backend does); the
    sequence offsets' values are data, so with them only their presence is planned."""
    from .plan import ArraySpec, PrefillPlan

    def spec(t):
        return None if t is None else ArraySpec(tuple(t.shape), t.dtype, tuple(t.stride()))

    mask, cu_seqlens_q, cu_seqlens_k, alibi_slopes = args.mask, args.cu_seqlens_q, args.cu_seqlens_k, args.alibi_slopes
    paged = args.block_table is not None or args.seqused_k is not None
    if paged:  # what the real call refuses first: no table, cu_seqlens_k
        refuse_unpaged_arguments(args.block_table, cu_seqlens_k)
    elif (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise InvalidArgumentError("cu_seqlens_q and cu_seqlens_k go together: pass both (variable length) or neither")
    # What is planned: the options but those no plan on layouts reads.
    planned = args._replace(
        mask=spec(mask), sinks=spec(args.sinks), cu_seqlens_q=None, cu_seqlens_k=None, alibi_slopes=None, device="cpu",
        return_lse=False, check_finite=False, block_table=None, seqused_k=None,
        k_descale=_descale_stand_in(args.k_descale), v_descale=_descale_stand_in(args.v_descale),
    )  # fmt: skip
    if cu_seqlens_q is not None:
        if mask is not None:
            raise InvalidArgumentError(
                "an explicit mask cannot go with cu_seqlens: describe the mask (causal, window) or pad the batch "
                "to a fixed length ([B, rows, heads, head_dim]) and pass a [B, 1, rows, kv] mask"
            )
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if cu is not None and (cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1):
                raise InvalidArgumentError(f"{name} must be a 1-D int32 or int64 tensor of B + 1 offsets")
        # A causal prompt shorter than its cache is checked per sequence, on the values.
        if args.offset is None and (args.causal or args.window):
            planned = planned._replace(offset=0)
    planned = checked(planned)
    batch = (q.shape[0] if q.dim() == 4 else 1) if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
    if alibi_slopes is not None:  # the slopes' values are data: their shape and dtype are planned
        from .checks import check_alibi_slopes

        check_alibi_slopes(_SlopesSpec(alibi_slopes), q.shape[-2], batch, planned.max_bias, values=False)
    if paged:
        planned = _paged_stand_in(q, k, args, planned, batch)
    PrefillPlan.from_args(spec(q), spec(k), spec(v), planned)


def _descale_stand_in(t: Optional[Tensor]) -> Optional[np.ndarray]:
    """A host stand-in of a descale tensor: its shape and dtype, every factor 1 (the values
    are data: the real call checks them)."""
    return None if t is None else np.ones(tuple(t.shape), _numpy_dtype(t.dtype))


def _paged_stand_in(q, k, args: PrefillArgs, planned: PrefillArgs, batch: int) -> PrefillArgs:
    """``planned`` with host stand-ins for the paged K/V's data, of the real ones' shapes and
    dtypes: every sequence one block long (block 0 of each table row; none without blocks)
    and the queries' offsets each sequence's share, so that the plan checks, by name, what
    needs no data (the table's and the lengths' ranks, dtypes and rows against the batch, the
    caches against each other, the block size). The values themselves (entries, lengths, a
    causal cache shorter than its prompt, the explicit mask's columns, the longest cache's)
    are the real call's to check: planned with an offset and without the mask."""
    table, used = args.block_table, args.seqused_k  # (either may be None: the plan names the missing one)
    cq = args.cu_seqlens_q
    rows = q.shape[-3 if planned.layout == "NHD" else -2]
    block_size = k.shape[1 if planned.layout == "NHD" else 2] if k.dim() == 4 else 0
    blocks = table.shape[-1] if table is not None and table.dim() == 2 else 0
    length = block_size if k.shape[0] > 0 and blocks > 0 else 0
    stand_in = dict(
        block_table=None if table is None else np.zeros(tuple(table.shape), _numpy_dtype(table.dtype)),
        seqused_k=None if used is None else np.full(tuple(used.shape), length, _numpy_dtype(used.dtype)),
        mask=None,
    )
    if cq is not None:  # the rows cut into the batch's sequences (offsets checked as the real call's)
        stand_in["cu_seqlens_q"] = np.minimum(np.arange(batch + 1), 1).astype(np.int32) * rows
    if planned.offset is None and (planned.causal or planned.window is not None):
        stand_in["offset"] = 0
    return planned._replace(**stand_in)


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """numpy's dtype of a torch dtype, for a stand-in that is refused as the tensor would be
    (bfloat16 and others numpy lacks: float16, refused as any non-int32 dtype is)."""
    try:
        return np.dtype(str(dtype).replace("torch.", ""))
    except TypeError:
        return np.dtype(np.float16)


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
    def fake(q, k, v, *given):
        args = _args_of(given, return_lse)
        named = dict(q=q, k=k, v=v, mask=args.mask, sinks=args.sinks, cu_seqlens_q=args.cu_seqlens_q,
                     cu_seqlens_k=args.cu_seqlens_k, alibi_slopes=args.alibi_slopes, block_table=args.block_table,
                     seqused_k=args.seqused_k, k_descale=args.k_descale, v_descale=args.v_descale)  # fmt: skip
        _check_fake_operands(named)
        shaped = (q, k, v, args.mask, args.sinks, args.alibi_slopes, args.k_descale, args.v_descale)
        if args.block_table is not None or args.seqused_k is not None:  # stand-ins of their shapes are planned
            shaped += (args.block_table, args.seqused_k, args.cu_seqlens_q)
        if all(_concrete(t) for t in shaped):
            _check_like_the_real_call(q, k, v, args)
        out = _fake_out(q, v, args.out_dtype, kv_format_name(args.kv_dtype))
        if not return_lse:
            return out
        # lse is [batch, heads, rows] ([heads, rows] 3-D) in either layout.
        if args.layout == "HND":
            shape = tuple(q.shape[:-1])
        else:
            shape = (q.shape[0], q.shape[2], q.shape[1]) if q.dim() == 4 else (q.shape[1], q.shape[0])
        return out, q.new_empty(shape, dtype=torch.float32)

    return fake


for _name, _lse in (("flash_attn_prefill", False), ("flash_attn_prefill_lse", True)):
    for _grad in (False, True):
        _op_name = _name + ("_autograd" if _grad else "")
        for _key in ("CPU", "CUDA"):
            _LIB.impl(_op_name, _kernel(_lse, _key == "CPU", _grad), _key)
        torch.library.register_fake(f"mlx_native::{_op_name}", _fake(_lse), lib=_LIB)


# ---------------------------------------------------------------------- no backward
#
# The forward must run under grad mode (transformers' models are called so), so the
# operators have an autograd formula; it is an operator too, whose real kernel raises the
# typed error and whose fake one returns gradients of the right shapes: tracers
# (AOTAutograd's joint graph under torch.compile) can trace it, and only running it fails.

NO_BACKWARD = (
    "a backward pass through mlx_native's attention: it computes the forward only (inference). Run under "
    "torch.no_grad() / torch.inference_mode(), detach its inputs, or train with another attention implementation"
)

_LIB.define("_no_backward(Tensor grad, SymInt[] q_shape, SymInt[] k_shape, SymInt[] v_shape) -> (Tensor, Tensor, Tensor)")


def _no_backward_kernel(grad, q_shape, k_shape, v_shape):
    raise UnsupportedFeatureError(NO_BACKWARD)


def _no_backward_fake(grad, q_shape, k_shape, v_shape):
    return grad.new_empty(q_shape), grad.new_empty(k_shape), grad.new_empty(v_shape)


for _key in ("CPU", "CUDA"):
    _LIB.impl("_no_backward", _no_backward_kernel, _key)
torch.library.register_fake("mlx_native::_no_backward", _no_backward_fake, lib=_LIB)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v = inputs[:3]
    ctx.shapes = (q.shape, k.shape, v.shape)  # shapes only: no tensor is kept for a backward that never runs
    ctx.others = len(inputs) - 3


def _backward(ctx, grad, *more):
    dq, dk, dv = torch.ops.mlx_native._no_backward(grad, *ctx.shapes)
    return (dq, dk, dv) + (None,) * ctx.others


for _name in ("flash_attn_prefill_autograd", "flash_attn_prefill_lse_autograd"):
    torch.library.register_autograd(f"mlx_native::{_name}", _backward, setup_context=_setup_context, lib=_LIB)


def _torch_out_dtype(out_dtype: Any) -> Optional[torch.dtype]:
    if out_dtype is None:
        return None
    name = dtype_name(out_dtype)
    if name not in OUT_DTYPES:
        raise UnsupportedDtypeError(
            f"out_dtype must be one of {', '.join(OUT_DTYPES)} (or None: q's dtype), got {name}"
        )
    return out_dtype if isinstance(out_dtype, torch.dtype) else _torch_dtype(numpy_dtype_of_name(name))


def flash_attn_prefill(q: Tensor, k: Tensor, v: Tensor, args: PrefillArgs):
    """``mlx_native.flash_attn_prefill`` on torch tensors, through the operators: one
    operator runs, whose kernel checks ``args`` (the array call's :func:`checked`)."""
    if not torch.compiler.is_compiling() and not _schema_takes(args):
        # Values the schema cannot hold as they are (numpy's bool, an int scale, a window
        # pair): checked here, for the library's typed errors rather than the schema's, and
        # put in their normal form. Traced code holds these as constants, checked when it
        # first ran eagerly or refused by the schema: checking them in a trace would only
        # break the graph.
        args = checked(args)
    if args.kv_dtype is not None or args.k_descale is not None or args.v_descale is not None:
        args = _quantised_schema_form(args)
    # A two-sided window travels as window_size=[left, right] (the schema's window is an int).
    window, window_size = args.window, None
    if isinstance(window, (tuple, list)):
        window_size, window = [int(window[0]), int(window[1])], None
    # The overloads, called by position (the schema's order, PrefillArgs'): no name look-up,
    # no keyword parsing.
    if torch.is_grad_enabled() and _any_requires_grad(q, k, v, args.mask, args.sinks, args.alibi_slopes):
        op = _LSE_GRAD_OP if args.return_lse else _GRAD_OP
    else:
        op = _LSE_OP if args.return_lse else _OP
    return op(q, k, v, args.mask, args.causal, window, *args[3:6], _torch_out_dtype(args.out_dtype), *args[7:14],
              window_size, *args[14 : 15 + len(_TAIL)])  # fmt: skip


def _quantised_schema_form(a: PrefillArgs) -> PrefillArgs:
    """Quantised K/V's options as the schema holds them: ``kv_dtype`` as its format name (a
    torch or numpy dtype named, an unknown name refused by name here), and a descale factor
    given as a number as a float32 tensor of one value, on the host (the factors belong to
    the plan, which reads them there). Tensors stay as they are (the real call checks them);
    ``front_door`` sends anything else to the array call, for its typed errors."""
    def tensor(x: Any) -> Any:
        return torch.tensor([float(x)], dtype=torch.float32) if isinstance(x, (int, float)) else x

    return a._replace(kv_dtype=kv_format_name(a.kv_dtype), k_descale=tensor(a.k_descale), v_descale=tensor(a.v_descale))


def _schema_takes(a: PrefillArgs) -> bool:
    """Whether the options are already of the schema's types (bool, int, float, str)."""
    return (
        type(a.causal) is bool and type(a.return_lse) is bool and type(a.check_finite) is bool
        and (a.window is None or type(a.window) is int) and (a.scale is None or type(a.scale) is float)
        and type(a.softcap) is float and type(a.max_bias) is float and (a.offset is None or type(a.offset) is int)
        and (a.device is None or type(a.device) is str) and type(a.layout) is str
        and (a.kv_splits is None or type(a.kv_splits) is int)
        and all(x is None or type(x) is str for x in (a.cta_pairs, a.cuda_form, a.cpu_isa))
    )  # fmt: skip


def _any_requires_grad(*tensors) -> bool:
    return any(t is not None and t.requires_grad for t in tensors)


_OP = torch.ops.mlx_native.flash_attn_prefill.default
_LSE_OP = torch.ops.mlx_native.flash_attn_prefill_lse.default
_GRAD_OP = torch.ops.mlx_native.flash_attn_prefill_autograd.default
_LSE_GRAD_OP = torch.ops.mlx_native.flash_attn_prefill_lse_autograd.default
