"""CUDA arrays of other libraries (PyTorch tensors, CuPy arrays, anything with the CUDA
Array Interface) used in place by the CUDA backend, and the NVRTC compile check.

Synchronisation: the library runs its kernels on a stream of its own and waits for them
before returning. Before it reads or writes a CUDA array it waits for the array's
producer stream: PyTorch's current stream for a tensor, the interface's ``stream`` for
others (an array without one is ready, per the interface's rules). So results are ready
for any stream once a call returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ._lib import check, ffi, get_string, lib
from .errors import InvalidArgumentError, UnsupportedDtypeError


def compile_check(arch: str = "sm_90a") -> str:
    """Compile every CUDA kernel of the library with NVRTC for ``arch`` (``sm_90a``,
    ``sm_80``, ...) without a GPU. Returns ptxas's report (registers and spills per entry
    point); raises ``BackendUnavailableError`` when NVRTC is not found and
    ``ShaderCompilationError`` (with the compiler's log) when a kernel does not compile."""
    return get_string(lib.mlxn_cuda_compile_check, arch.encode())


def interface(x: Any) -> Optional[dict]:
    """``x.__cuda_array_interface__``, or None when ``x`` is not a CUDA array."""
    try:
        cai = getattr(x, "__cuda_array_interface__", None)
    except (AttributeError, TypeError):
        return None
    except RuntimeError as e:  # PyTorch: a tensor that requires grad
        raise InvalidArgumentError(f"cannot use this CUDA tensor in place: {e}") from e
    return cai if isinstance(cai, dict) else None


def is_cuda_array(x: Any) -> bool:
    return interface(x) is not None


def library(x: Any) -> Optional[str]:
    """``"torch"`` or ``"cupy"`` for arrays of those libraries, else None."""
    mod = type(x).__module__.split(".")[0]
    return mod if mod in ("torch", "cupy") else None


def device_index(x: Any) -> int:
    """The CUDA device ordinal of a CUDA array (0 when the library does not say)."""
    dev = getattr(x, "device", None)
    for attr in ("index", "id"):
        v = getattr(dev, attr, None)
        if isinstance(v, int):
            return v
    return 0


@dataclass
class View:
    """Where a CUDA array's elements are: address, shape, strides in elements."""

    ptr: int
    shape: tuple
    strides: tuple
    dtype: np.dtype
    readonly: bool
    stream: Optional[int]

    @property
    def contiguous(self) -> bool:
        expect, s = [], 1
        for d in reversed(self.shape):
            expect.append(s)
            s *= d
        return tuple(reversed(expect)) == tuple(self.strides) or 0 in self.shape

    def span_elements(self) -> int:
        """Elements from the first to one past the last (non-negative strides)."""
        if 0 in self.shape:
            return 0
        return sum((d - 1) * s for d, s in zip(self.shape, self.strides)) + 1


def view(x: Any) -> View:
    """The :class:`View` of a CUDA array (raises for anything else)."""
    cai = interface(x)
    if cai is None:
        raise InvalidArgumentError(f"{type(x).__name__} is not a CUDA array")
    try:
        dtype = np.dtype(cai["typestr"])
    except TypeError as e:
        raise UnsupportedDtypeError(f"CUDA array of type {cai.get('typestr')!r}: {e}") from e
    shape = tuple(int(d) for d in cai["shape"])
    item = dtype.itemsize
    if cai.get("strides") is None:
        strides, s = [], 1
        for d in reversed(shape):
            strides.append(s)
            s *= d
        strides = tuple(reversed(strides))
    else:
        bs = tuple(int(b) for b in cai["strides"])
        if any(b % item for b in bs):
            raise InvalidArgumentError(f"CUDA array strides {bs} are not whole elements")
        strides = tuple(b // item for b in bs)
    if any(s < 0 for s in strides):
        raise InvalidArgumentError(f"CUDA array with negative strides {strides}")
    ptr, readonly = cai["data"]
    return View(int(ptr or 0), shape, strides, dtype, bool(readonly), producer_stream(x, cai))


def producer_stream(x: Any, cai: Optional[dict] = None) -> Optional[int]:
    """The stream whose work must finish before ``x`` is read or written: PyTorch's
    current stream for a tensor, else the interface's ``stream`` (None: ready now)."""
    if library(x) == "torch":
        import torch

        return int(torch.cuda.current_stream(x.device).cuda_stream)
    cai = interface(x) if cai is None else cai
    s = (cai or {}).get("stream")
    return None if s is None else int(s)


def empty(like: Any, shape, dtype) -> Any:
    """A new array of ``like``'s library and device (PyTorch or CuPy)."""
    lib_name = library(like)
    if lib_name == "torch":
        import torch

        tdt = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16}[np.dtype(dtype)]
        return torch.empty(tuple(shape), dtype=tdt, device=like.device)
    if lib_name == "cupy":
        import cupy

        with cupy.cuda.Device(device_index(like)):
            return cupy.empty(tuple(shape), dtype=np.dtype(dtype))
    raise InvalidArgumentError(
        f"cannot make a new array like a {type(like).__name__} (PyTorch and CuPy arrays are supported)"
    )


def zeros(like: Any, shape, dtype) -> Any:
    """A new zero-filled array of ``like``'s library and device."""
    out = empty(like, shape, dtype)
    if library(like) == "torch":
        out.zero_()
    else:
        out.fill(0)
    return out


def padded_rows(x: Any, rows: int) -> Any:
    """``x`` (``[n, ...]``) with zero rows appended up to ``rows``, as a new array of
    ``x``'s library."""
    lib_name = library(x)
    if lib_name == "torch":
        out = x.new_zeros((rows,) + tuple(x.shape[1:]))
    elif lib_name == "cupy":
        import cupy

        with cupy.cuda.Device(device_index(x)):
            out = cupy.zeros((rows,) + tuple(x.shape[1:]), dtype=x.dtype)
    else:
        raise InvalidArgumentError(
            f"cannot pad a {type(x).__name__} (PyTorch and CuPy arrays are supported)"
        )
    out[: x.shape[0]] = x
    return out


def contiguous(x: Any) -> Any:
    """A C-contiguous copy of a PyTorch or CuPy array (the array itself if it is one)."""
    lib_name = library(x)
    if lib_name == "torch":
        return x.contiguous()
    if lib_name == "cupy":
        import cupy

        return cupy.ascontiguousarray(x)
    raise InvalidArgumentError(f"cannot copy a {type(x).__name__} (PyTorch and CuPy arrays are supported)")


def to_host(x: Any) -> np.ndarray:
    """A numpy copy of a PyTorch or CuPy array (bfloat16 widened to float32)."""
    lib_name = library(x)
    if lib_name == "torch":
        import torch

        t = x.detach()
        if t.dtype == torch.bfloat16:
            t = t.float()
        return t.cpu().numpy()
    if lib_name == "cupy":
        return x.get()
    raise InvalidArgumentError(f"cannot copy a {type(x).__name__} to the host (PyTorch and CuPy arrays are supported)")


def copy(x: Any) -> Any:
    """A new C-contiguous copy of a PyTorch or CuPy array."""
    lib_name = library(x)
    if lib_name == "torch":
        import torch

        return x.clone(memory_format=torch.contiguous_format)
    if lib_name == "cupy":
        import cupy

        with cupy.cuda.Device(device_index(x)):
            return cupy.array(x, copy=True, order="C")
    raise InvalidArgumentError(f"cannot copy a {type(x).__name__} (PyTorch and CuPy arrays are supported)")


def wait(device, streams) -> None:
    """Make ``device`` wait for each stream in ``streams`` (Nones ignored)."""
    for s in dict.fromkeys(s for s in streams if s is not None):
        check(lib.mlxn_device_wait_stream(device.handle, s))


def wrap(device, x: Any, *, span: bool = False):
    """A buffer over ``x``'s memory on the CUDA ``device``, kept alive by the buffer: the
    array's own shape when it is contiguous, or (``span=True``) a flat buffer over the
    elements from its first to its last. Waits for ``x``'s producer stream first."""
    from .device import Buffer, _dtype_code

    v = view(x)
    code = _dtype_code(v.dtype)
    if span:
        shape = (v.span_elements(),)
    elif v.contiguous:
        shape = v.shape
    else:
        raise InvalidArgumentError(
            f"a non-contiguous CUDA array (strides {v.strides}) cannot be used in place; "
            "pass a contiguous one"
        )
    nbytes = shape[0] * v.dtype.itemsize if span else int(np.prod(shape, dtype=np.int64)) * v.dtype.itemsize
    wait(device, [v.stream])
    dims = ffi.new("uint64_t[]", [int(d) for d in shape] or [0])
    out = ffi.new("uint64_t *")
    check(lib.mlxn_buffer_wrap_device(device.handle, v.ptr, nbytes, code, dims, len(shape), out))
    return Buffer(device, out[0], v.dtype, shape, owner=x, writable=not v.readonly)
