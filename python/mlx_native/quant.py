"""Quantised K/V (SPEC 11) for :class:`~mlx_native.PrefillPlan`, on every backend (the CPU,
CUDA and Metal):

- FP8: ``k`` and ``v`` of dtype ``float8_e4m3fn`` or ``float8_e5m2`` (torch's, or numpy
  arrays of ml_dtypes' types), or raw ``uint8`` bytes with ``kv_dtype="float8_e4m3fn"`` /
  ``"float8_e5m2"``; ``k_descale`` / ``v_descale``: None (1), a number, or float32 arrays
  of 1 or ``kv_heads`` values (FlashAttention-3's): the value used is ``descale * float(x)``.
- Q8_0 (ggml's blocks): ``uint8`` bytes with ``kv_dtype="q8_0"``, ``[..., kv_heads,
  head_dim // 32 * 34]``: per 32 values along the head dim one float16 scale ``d`` then 32
  int8 ``q`` (the value ``float(d) * q``); head dims multiples of 32.

Here: the format of a call (from ``kv_dtype`` and k's dtype), the views q/k/v are checked
against each other with (the head dim a Q8_0 row holds), and the descale factors as host values, which belong to the plan (as a block table's do). The op
checks them again (``rust/src/ops/flash_attn_prefill_plan.rs``)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np

from .arrays import Operand
from .dtypes import dtype_name
from .errors import ArgumentTypeError, InvalidArgumentError, UnsupportedDtypeError

__all__ = ["KV_FORMATS", "kv_format", "logical_views", "descale_values", "descale_key", "kv_format_name"]

#: The quantised K/V formats, by name, and their C ABI dtype codes.
KV_FORMATS = {"float8_e4m3fn": 7, "float8_e5m2": 8, "q8_0": 9}
_FP8 = ("float8_e4m3fn", "float8_e5m2")
_Q8_0_BLOCK = 34  # bytes of 32 values: a float16 scale and 32 int8


def kv_format_name(kv_dtype: Any) -> Optional[str]:
    """``kv_dtype`` as a format name (``"float8_e4m3fn"``, ``"float8_e5m2"``, ``"q8_0"``),
    from a string, a torch dtype or a numpy / ml_dtypes dtype; None for None."""
    if kv_dtype is None:
        return None
    if isinstance(kv_dtype, str) and kv_dtype.lower() in ("q8_0", "q8"):
        return "q8_0"
    try:
        name = dtype_name(kv_dtype)
    except UnsupportedDtypeError:
        name = None
    if name not in KV_FORMATS:
        raise UnsupportedDtypeError(
            f"kv_dtype {kv_dtype!r} is no quantised K/V format: pass 'float8_e4m3fn', 'float8_e5m2' or 'q8_0' "
            f"(or leave it None for k and v of a float dtype)"
        )
    return name


def kv_format(kv_dtype: Any, ko: Operand, vo: Operand) -> Optional[str]:
    """The quantised K/V format of a call, or None for float16, bfloat16 or float32 K/V.
    ``kv_dtype`` None: k's own dtype says (torch's or ml_dtypes' float8 types); given, k
    and v are of that dtype or raw uint8 bytes of it (Q8_0: uint8 always)."""
    kn, vn = ko.dtype.name, vo.dtype.name
    fmt = kv_format_name(kv_dtype)
    if kn != vn and (fmt is not None or kn in _FP8 or vn in _FP8):
        raise UnsupportedDtypeError(f"k is {kn} and v is {vn}: they must have one dtype")
    if fmt is None:  # (other mismatches: check_qkv's, in its order)
        return kn if kn in _FP8 else None
    if kn != "uint8" and kn != fmt:
        raise UnsupportedDtypeError(
            f"kv_dtype={fmt!r} with k and v of dtype {kn}: pass them as {fmt} arrays"
            f"{'' if fmt == 'q8_0' else ' or'} as uint8 bytes"
            + (" (ggml's blocks: [..., kv_heads, head_dim // 32 * 34])" if fmt == "q8_0" else "")
        )
    return fmt


def logical_views(fmt: str, ko: Operand, vo: Operand) -> tuple:
    """``k`` and ``v`` as the checks of q, k and v against each other read them: float16
    stand-ins of the values' shapes (a Q8_0 row of ``n`` blocks holds ``32 n`` values).
    Only their shapes, devices and dtypes are read."""

    def view(op: Operand, name: str) -> Operand:
        shape = op.shape
        if fmt == "q8_0":
            width = shape[-1] if shape else 0
            if width % _Q8_0_BLOCK:
                raise InvalidArgumentError(
                    f"{name} is Q8_0 bytes with a last axis of {width}: a row of head_dim values takes "
                    f"head_dim // 32 * 34 bytes (a float16 scale and 32 int8 per block)"
                )
            shape = shape[:-1] + (width // _Q8_0_BLOCK * 32,)
        return dataclasses.replace(op, shape=shape, dtype=np.dtype(np.float16))

    return view(ko, "k"), view(vo, "v")


def descale_values(x: Any, name: str, fmt: Optional[str], n_kv_heads: int) -> Optional[np.ndarray]:
    """A descale factor as float32 host values (1 or ``n_kv_heads`` of them), or None.
    Only FP8 K/V take them."""
    if x is None:
        return None
    if fmt not in _FP8:
        what = "Q8_0 blocks carry their own scales" if fmt == "q8_0" else "k and v are not quantised"
        raise InvalidArgumentError(f"{name} goes with FP8 k and v (float8_e4m3fn, float8_e5m2); {what}: leave it out")
    if isinstance(x, bool) or isinstance(x, (str, bytes)):
        raise ArgumentTypeError(f"{name} must be a number or a float32 array of 1 or kv_heads values, got {x!r}")
    if isinstance(x, (int, float)):
        values = np.array([x], dtype=np.float32)
    else:
        op = Operand.of(x, name)
        if op.dtype != np.float32:
            raise UnsupportedDtypeError(f"{name} must be float32, got {op.dtype.name}")
        values = np.ascontiguousarray(np.asarray(op.to_host()), dtype=np.float32).reshape(-1)
        if op.ndim > 1 and not (op.ndim == 2 and op.shape[0] == 1):
            raise InvalidArgumentError(f"{name} must be a scalar, [1] or [kv_heads] ({n_kv_heads}), got shape {op.shape}")
    if values.size not in (1, n_kv_heads):
        raise InvalidArgumentError(
            f"{name} has {values.size} values; give one (for every KV head) or kv_heads = {n_kv_heads} (one per KV head)"
        )
    if not np.isfinite(values).all():
        raise InvalidArgumentError(f"{name} holds a NaN or an infinity; descale factors must be finite")
    return values


def descale_key(x: Any) -> Any:
    """The values of a descale factor for the plan cache's key (they belong to the plan);
    ``False`` where they cannot be read without a copy that could fail (no caching)."""
    if x is None or isinstance(x, (int, float)):
        return x
    try:
        op = Operand.of(x, "descale")
        return (op.shape, op.dtype.name, np.asarray(op.to_host()).tobytes())
    except Exception:
        return False
