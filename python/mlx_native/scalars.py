"""Integer arguments, checked the same way in every layer: an ``int`` (Python's or numpy's,
never a bool, a float or a string) within the range of the C type it becomes. ``int(8.7)``
is 8 and ``int(True)`` is 1: taking either silently would plan or allocate something else
than was asked for. Imports nothing of the package but its errors."""

from __future__ import annotations

import numbers
from typing import Any, Sequence, Tuple

from .errors import ArgumentTypeError, InvalidArgumentError

#: The C types' ranges the C ABI takes.
U32_MAX = 2**32 - 1
I64_MAX = 2**63 - 1


def is_integer(x: Any) -> bool:
    """An integer that is not a bool (numpy's integers count; numpy's bool does not)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and type(x).__name__ != "bool_"


def check_int(x: Any, name: str, lo: int = 0, hi: int = I64_MAX, outside: str = "") -> int:
    """``x`` as an int in ``[lo, hi]``: an ``ArgumentTypeError`` for anything that is not an
    integer, an ``InvalidArgumentError`` naming the range (or saying ``outside``) for one
    outside it."""
    if not is_integer(x):
        raise ArgumentTypeError(f"{name} must be an integer, got {x!r} ({type(x).__name__})")
    v = int(x)
    if not lo <= v <= hi:
        raise InvalidArgumentError(f"{name} {v} {outside}" if outside else f"{name} must be an integer from {lo} to {hi}, got {v}")
    return v


def check_shape(shape: Any, name: str = "shape") -> Tuple[int, ...]:
    """A shape: a sequence of integers >= 0 (or one integer), each within int64."""
    if is_integer(shape):
        shape = (shape,)
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
        raise ArgumentTypeError(f"{name} must be a tuple of integers, got {shape!r} ({type(shape).__name__})")
    dims = tuple(check_int(d, f"{name}[{i}]", -I64_MAX, I64_MAX) for i, d in enumerate(shape))
    if any(d < 0 for d in dims):
        raise InvalidArgumentError(f"negative dimension in {name} {dims}")
    # (A product past any memory is the allocator's BufferAllocationError, with the bytes.)
    return dims


def check_strides(strides: Any, ndim: int, name: str = "strides") -> Tuple[int, ...]:
    """Strides in elements: one integer per axis, within int64 either way."""
    if isinstance(strides, (str, bytes)) or not isinstance(strides, Sequence):
        raise ArgumentTypeError(f"{name} must be a tuple of integers, got {strides!r} ({type(strides).__name__})")
    out = tuple(check_int(s, f"{name}[{i}]", -I64_MAX, I64_MAX) for i, s in enumerate(strides))
    if len(out) != ndim:
        raise InvalidArgumentError(f"{len(out)} {name} for a shape of {ndim} axes")
    return out
