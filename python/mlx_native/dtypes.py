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
    # Quantised K/V (SPEC 11, the CPU and CUDA backends): FP8 (ml_dtypes' and torch's names) and
    # ggml's Q8_0 blocks (uint8 arrays with kv_dtype="q8_0").
    "float8_e4m3fn": 7,
    "float8_e5m2": 8,
    "q8_0": 9,
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


def float8_dtype(name: str) -> np.dtype:
    """numpy's ``float8_e4m3fn`` or ``float8_e5m2`` (from ml_dtypes)."""
    try:
        import ml_dtypes
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise UnsupportedDtypeError(
            f"{name} arrays need the ml_dtypes package (pip install ml_dtypes); without it pass the bytes as uint8 "
            f"with kv_dtype={name!r}"
        ) from e
    return np.dtype(getattr(ml_dtypes, name))


def numpy_dtype_of_name(name: str) -> np.dtype:
    """The numpy dtype of a dtype name (``bfloat16`` and the float8 types through ml_dtypes;
    Q8_0's blocks are uint8)."""
    if name == "bfloat16":
        return bfloat16_dtype()
    if name in ("float8_e4m3fn", "float8_e5m2"):
        return float8_dtype(name)
    if name == "q8_0":
        return np.dtype(np.uint8)
    if name in DTYPE_CODES or name in _OTHER:
        return np.dtype(name)
    raise UnsupportedDtypeError(f"dtype {name} is not supported")


def dtype_code(dtype: Any) -> int:
    """The C ABI code of a buffer dtype: a numpy dtype, or a C ABI dtype's name (``"q8_0"``,
    which no numpy dtype names)."""
    name = dtype if isinstance(dtype, str) and dtype in DTYPE_CODES else np.dtype(dtype).name
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
