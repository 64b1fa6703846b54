"""The operands' layouts: :class:`ArraySpec` (a layout without data), how the kernels read an
array (its own strides when its last axis is contiguous, else those of a copy), the checks
of q, k and v against each other, and where a prefill runs."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from ._lib import check, ffi, lib
from .arrays import Operand, _contiguous_strides
from .device import Device, shared_device
from .dtypes import DTYPE_CODES, dtype_code, dtype_name, numpy_dtype_of_name
from .errors import InvalidArgumentError, UnsupportedDtypeError
from .scalars import check_shape, check_strides

__all__ = [
    "ArraySpec", "HND_HINT", "check_head_dims", "check_qkv", "layout", "norm_strides", "nhd_view", "operand", "pick_device",
    "span",
]  # fmt: skip

#: What a mistake that often comes from an SDPA-layout array read as ``"NHD"`` says to do.
HND_HINT = (
    'if the arrays are [batch, heads, seq, head_dim] (PyTorch SDPA\'s layout), pass layout="HND" (read in place; '
    "or x.transpose(1, 2), also without a copy)"
)

_Q_DTYPES = ("float32", "float16", "bfloat16")
_SPEC_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")
_KV_DTYPES = ("float16", "bfloat16", "float32")


class ArraySpec:
    """An array's layout without its data, to plan on: ``shape``, ``dtype`` (a name, a
    numpy or torch dtype), ``strides`` in elements (None: C-contiguous) and ``device``
    (``"cpu"``, ``"cuda"``, ``"cuda:N"``). ``ArraySpec.like(x)`` takes an array's."""

    def __init__(self, shape: Sequence[int], dtype: Any, strides: Optional[Sequence[int]] = None, device: str = "cpu"):
        self.shape = check_shape(shape, "ArraySpec shape")
        self.dtype = numpy_dtype_of_name(dtype_name(dtype))
        if strides is None:
            self.strides = _contiguous_strides(self.shape)
        else:
            self.strides = check_strides(strides, len(self.shape), "ArraySpec strides")
        if not isinstance(device, str) or not _SPEC_DEVICE.match(device):
            raise InvalidArgumentError(f"ArraySpec: device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
        self.device = "cuda:0" if device == "cuda" else device

    @classmethod
    def like(cls, x: Any) -> "ArraySpec":
        op = Operand.of(x)
        return cls(op.shape, op.dtype, op.strides, op.device)

    def operand(self) -> Operand:
        return Operand(None, "spec", self.device, self.shape, self.strides, self.dtype, 0, True)

    def __repr__(self) -> str:
        return f"ArraySpec({self.shape}, {self.dtype.name}, strides={self.strides}, device={self.device!r})"


def operand(x: Any, name: str) -> Operand:
    if isinstance(x, ArraySpec):
        return x.operand()
    if isinstance(x, Operand):
        return x
    return Operand.of(x, name)


def norm_strides(shape: tuple, strides: tuple) -> tuple:
    """Strides with those of axes of one element (or none) set to 0: they are never used,
    and libraries disagree on them."""
    return tuple(0 if d <= 1 else int(s) for d, s in zip(shape, strides))


def nhd_view(op: Operand) -> Operand:
    """An ``"HND"`` operand (``[..., heads, seq, head_dim]``) as the ``"NHD"`` one the plan
    reads: axes -3 and -2 swapped in its shape and strides, the same elements at the same
    address (no copy). An operand of fewer than 3 axes is returned as it is, for
    :func:`check_qkv` to refuse. Its ``obj`` stays the caller's array: a copy of one whose
    last axis is not contiguous is made from ``obj`` and then viewed again."""
    if op.ndim < 3:
        return op
    return dataclasses.replace(op, shape=_swapped(op.shape), strides=_swapped(op.strides))


def _swapped(t: tuple) -> tuple:
    return t[:-3] + (t[-2], t[-3], t[-1])


def layout(op: Operand, hnd: bool = False) -> tuple:
    """(shape, strides, dtype) as the kernels read the operand: its own strides when its
    last axis is contiguous (used in place), else those of its contiguous copy. ``hnd``:
    ``op`` is an :func:`nhd_view`, whose copy is made in the caller's layout and then
    viewed."""
    if op.in_place:
        strides = op.strides
    elif hnd and op.ndim >= 3:
        strides = _swapped(_contiguous_strides(_swapped(op.shape)))
    else:
        strides = _contiguous_strides(op.shape)
    return op.shape, norm_strides(op.shape, strides), op.dtype


def span(op: Operand) -> np.ndarray:
    """A host operand's elements from its first to its last, as a flat numpy view."""
    a = op.host_array()
    n = op.span_elements()
    # Through unsigned integers of the same width: as_strided rebuilds the array from its
    # array interface, whose type string numpy cannot read back for every dtype
    # (ml_dtypes' float8_e5m2 is '<f1').
    bits = a.view(np.dtype(f"u{a.itemsize}")) if a.itemsize in (1, 2, 4, 8) else a
    return np.lib.stride_tricks.as_strided(bits, shape=(n,), strides=(a.itemsize,), writeable=False).view(a.dtype)


def check_qkv(qo: Operand, ko: Operand, vo: Operand, tensor_layout: str = "NHD") -> None:
    """Dtypes, ranks and shapes of q, k, v against each other, and that this build has a
    kernel for the head dims (q and k's, v's) and the K/V dtype. The operands are read as
    ``"NHD"`` (:func:`nhd_view` of ``"HND"`` ones); ``tensor_layout`` says which the
    caller passed, for the messages."""
    hnd = tensor_layout == "HND"
    seq_heads = "[heads, rows, head_dim]" if hnd else "[rows, heads, head_dim]"
    fix = (
        'with layout="HND" q is [batch, heads, rows, head_dim] and k/v [batch, kv_heads, kv_len, head_dim]'
        if hnd else f"the layout is q [rows, heads, head_dim], k/v [kv_len, kv_heads, head_dim]; {HND_HINT}"
    )  # fmt: skip
    for name, op in (("k", ko), ("v", vo)):
        if op.device != qo.device:
            raise InvalidArgumentError(f"{name} is on {op.device} and q on {qo.device}: put q, k and v on one device")
    if qo.dtype.name not in _Q_DTYPES:
        raise UnsupportedDtypeError(f"q must be float32, float16 or bfloat16, got {qo.dtype.name}")
    for name, op in (("k", ko), ("v", vo)):
        if op.dtype.name not in _KV_DTYPES:
            raise UnsupportedDtypeError(f"{name} must be float16, bfloat16 or float32, got {op.dtype.name}")
    if vo.dtype != ko.dtype:
        raise UnsupportedDtypeError(
            f"k is {ko.dtype.name} and v is {vo.dtype.name}: they must have one dtype (float16, bfloat16 or float32)"
        )
    if qo.ndim not in (3, 4):
        raise InvalidArgumentError(
            f"q must be 3-D {seq_heads} or 4-D [batch, {seq_heads[1:]}, got shape {qo.shape}"
            + ("" if hnd else f" ({HND_HINT})")
        )
    for name, op in (("k", ko), ("v", vo)):
        if op.ndim != qo.ndim:
            kind = "[kv_len, kv_heads, head_dim]" if qo.ndim == 3 else "[batch, kv_len, kv_heads, head_dim]"
            raise InvalidArgumentError(f"q is {qo.ndim}-D, so {name} must be {kind}; got shape {op.shape}")
    if vo.shape[:-1] != ko.shape[:-1]:
        raise InvalidArgumentError(
            f"v has shape {vo.shape}, k has {ko.shape}: they must match but for the head dim (the last axis, which "
            f"differs only as k 576 and v 512)"
        )
    if ko.shape[-1] != qo.shape[-1]:
        raise InvalidArgumentError(
            f"q has head_dim {qo.shape[-1]} and k {ko.shape[-1]} (the last axis): they must be equal. The layout is "
            f"q [rows, heads, head_dim], k/v [kv_len, kv_heads, head_dim] (4-D: a batch axis first)"
        )
    if qo.ndim == 4 and ko.shape[0] != qo.shape[0]:
        raise InvalidArgumentError(f"q has a batch of {qo.shape[0]} and k/v of {ko.shape[0]}: they must be equal")
    n_heads, n_kv = qo.shape[-2], ko.shape[-2]
    if n_kv == 0 or n_heads % n_kv:
        axis = "axis -3" if hnd else "axis -2"
        raise InvalidArgumentError(f"n_heads {n_heads} is not a multiple of n_kv_heads {n_kv} ({axis} of q and of k/v): {fix}")
    # The head dims this build has kernels for, as the op itself says.
    dk, dv = (min(int(x), 2**32 - 1) for x in (qo.shape[-1], vo.shape[-1]))
    check(lib.mlxn_flash_attn_prefill_supports(dk, dv, DTYPE_CODES[ko.dtype.name]))


def check_head_dims(head_dim: int, head_dim_v: int = 0, kv_dtype: Any = "float16") -> None:
    """Raise the op's own error (naming the head dims this build has kernels for) unless
    it has a prefill kernel for Q/K head dim ``head_dim``, V head dim ``head_dim_v`` (0:
    the same) and K/V of ``kv_dtype``."""
    cap = 2**32 - 1
    check(lib.mlxn_flash_attn_prefill_supports(min(head_dim, cap), min(head_dim_v, cap), dtype_code(kv_dtype)))


def pick_device(dev_arg, qo: Operand) -> Tuple[Device, bool]:
    """The plan's device and whether the arrays are uploaded to it: by default the data
    decides (host arrays on the CPU, CUDA arrays on their device)."""
    if dev_arg is None:
        dev = shared_device(qo.device if qo.on_cuda else "cpu")
    elif isinstance(dev_arg, str):
        dev = shared_device(dev_arg)
    else:
        dev = dev_arg
    if qo.on_cuda:
        if dev.backend != "cuda" or dev.index != qo.device_index:
            raise InvalidArgumentError(
                f"the arrays are on {qo.device} and the device is {dev.backend}"
                f"{':' + str(dev.index) if dev.backend == 'cuda' else ''}: pass device=None (the arrays' own device), "
                f"or move the arrays"
            )
        return dev, False
    return dev, dev.backend == "cuda"
