"""Element types: the C ABI's dtype codes and their numpy dtypes (bfloat16 through
ml_dtypes)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import UnsupportedDtypeError

#: DType codes of the C ABI, by numpy dtype name.
DTYPE_CODES = {
    "float32": 0,
    "float16": 1,
    "bfloat16": 2,
    "uint8": 3,
    "uint16": 4,
    "uint32": 5,
    "int32": 6,
}
DTYPE_NAMES = {v: k for k, v in DTYPE_CODES.items()}

#: Other dtypes an operand may have (a mask can be bool or float64, indices int64).
_OTHER = ("bool", "float64", "int64", "int16", "int8")


def bfloat16_dtype() -> np.dtype:
    """numpy's bfloat16 (from ml_dtypes)."""
    try:
        import ml_dtypes
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise UnsupportedDtypeError("bfloat16 arrays need the ml_dtypes package (pip install ml_dtypes)") from e
    return np.dtype(ml_dtypes.bfloat16)


def numpy_dtype_of_name(name: str) -> np.dtype:
    """The numpy dtype of a dtype name (``bfloat16`` through ml_dtypes)."""
    if name == "bfloat16":
        return bfloat16_dtype()
    if name in DTYPE_CODES or name in _OTHER:
        return np.dtype(name)
    raise UnsupportedDtypeError(f"dtype {name} is not supported")


def dtype_code(dtype: Any) -> int:
    """The C ABI code of a buffer dtype."""
    name = np.dtype(dtype).name
    if name not in DTYPE_CODES:
        raise UnsupportedDtypeError(f"dtype {name} is not supported (supported: {', '.join(DTYPE_CODES)})")
    return DTYPE_CODES[name]


def numpy_dtype(code: int) -> np.dtype:
    """The numpy dtype of a C ABI dtype code."""
    return numpy_dtype_of_name(DTYPE_NAMES[code])


def dtype_name(dtype: Any) -> str:
    """The name of a dtype given as a string (``"float16"``), a numpy dtype or type, an
    ml_dtypes type or a torch dtype (``torch.float16``): ``float32``, ``float16``,
    ``bfloat16``, ...; an ``UnsupportedDtypeError`` for anything else."""
    if isinstance(dtype, str):
        name = dtype
    elif type(dtype).__module__ == "torch":  # torch.dtype: str() is "torch.float16"
        name = str(dtype).rsplit(".", 1)[-1]
        name = {"float": "float32", "half": "float16", "double": "float64"}.get(name, name)
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            raise UnsupportedDtypeError(f"{dtype!r} is not a dtype") from None
    return name
