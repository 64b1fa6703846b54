"""One operand adapter for every kind of array the library takes: numpy arrays, PyTorch
tensors (CPU and CUDA), CuPy arrays, and anything numpy can view (the buffer protocol,
CPU DLPack). An :class:`Operand` says where the elements are (address, shape, strides in
elements, dtype, device) and makes new arrays of the same library on the same device, so
the layers above never branch on where an array came from.

Nothing here imports the rest of the package but the errors and dtypes: the device layer
and the attention API stand on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from ._lib import get_string, lib
from .dtypes import bfloat16_dtype, numpy_dtype_of_name
from .errors import ArgumentTypeError, BufferAllocationError, InvalidArgumentError, UnsupportedDtypeError


def _library(x: Any) -> str:
    mod = type(x).__module__.split(".")[0]
    if mod in ("torch", "cupy", "numpy"):
        return mod
    return "other"


#: numpy dtypes of torch dtypes, and device names of torch devices, as met.
_TORCH_DTYPES: dict = {}
_TORCH_DEVICES: dict = {}


def _torch_dtype_name(t: Any) -> str:
    name = str(t.dtype).rsplit(".", 1)[-1]
    return {"float": "float32", "half": "float16", "double": "float64"}.get(name, name)


@dataclass
class Operand:
    """Where one array's elements are. ``strides`` are in elements; ``device`` is ``"cpu"``
    or ``"cuda:N"``; ``ptr`` is the address of element ``[0, ..., 0]``."""

    obj: Any
    library: str
    device: str
    shape: tuple
    strides: tuple
    dtype: np.dtype
    ptr: int
    readonly: bool
    #: Why the elements are a copy of the caller's array, not the array itself (a numpy
    #: array in the other byte order, or not aligned to its elements: the kernels read
    #: native, aligned elements); None where they are the array's own. Such an operand is
    #: read-only: writing it would not reach the caller.
    converted: Optional[str] = None

    # ------------------------------------------------------------------ making one

    @classmethod
    def of(cls, x: Any, name: str = "array") -> "Operand":
        """The operand of ``x``; a typed error for anything that is not an array, and for a
        tensor that requires grad (the library computes no gradient, so it refuses rather
        than silently dropping one)."""
        lib = _library(x)
        if lib == "torch":
            return cls._of_torch(x, name)
        cai = _cuda_array_interface(x, name)
        if cai is not None:
            return cls._of_cai(x, cai, name)
        if isinstance(x, (list, tuple, int, float, complex, bool, str, bytes)) or x is None:
            raise ArgumentTypeError(
                f"{name} must be an array (a numpy array, a torch tensor or a CuPy array), got {type(x).__name__}: "
                f"make one first, e.g. numpy.asarray({name}, dtype=...)"
            )
        return cls._of_numpy(_as_numpy(x, name), name, obj=x)

    @classmethod
    def _of_numpy(cls, a: np.ndarray, name: str, obj: Any = None) -> "Operand":
        converted = None
        if not a.dtype.isnative:
            converted = "its byte order is not this machine's"
        elif a.size and not a.flags.aligned:
            converted = f"its data is not aligned to its {a.dtype.itemsize}-byte elements"
        if converted is not None:
            # The kernels read native, aligned elements: a copy holds them (as a copy holds a
            # view whose last axis is not contiguous).
            a = np.array(a, dtype=a.dtype.newbyteorder("="), order="C", copy=True)
            obj = None
        item = a.itemsize
        if any(s % item for s in a.strides):
            raise InvalidArgumentError(f"{name} has strides {a.strides} that are not whole elements")
        return cls(
            obj=a if obj is None or _library(obj) == "numpy" else obj,
            library="numpy",
            device="cpu",
            shape=tuple(int(d) for d in a.shape),
            strides=tuple(s // item for s in a.strides),
            dtype=a.dtype,
            ptr=int(a.ctypes.data) if a.size else 0,
            readonly=converted is not None or not a.flags.writeable,
            converted=converted,
        )

    @classmethod
    def _of_torch(cls, t: Any, name: str) -> "Operand":
        if getattr(t, "requires_grad", False):
            raise InvalidArgumentError(
                f"{name} requires grad, and mlx_native computes no backward pass: pass {name}.detach() "
                "(or call it under torch.no_grad())"
            )
        dtype = _TORCH_DTYPES.get(t.dtype)
        if dtype is None:
            try:
                dtype = _TORCH_DTYPES[t.dtype] = numpy_dtype_of_name(_torch_dtype_name(t))
            except UnsupportedDtypeError:
                raise UnsupportedDtypeError(f"{name} has dtype {t.dtype}, which mlx_native does not take") from None
        dev = t.device
        device = _TORCH_DEVICES.get(dev)
        if device is None:
            if dev.type not in ("cpu", "cuda"):
                raise InvalidArgumentError(f"{name} is on device {dev}; mlx_native takes CPU and CUDA tensors")
            device = _TORCH_DEVICES[dev] = "cpu" if dev.type == "cpu" else f"cuda:{dev.index or 0}"
        return cls(t, "torch", device, tuple(t.shape), t.stride(), dtype, t.data_ptr(), False)

    @classmethod
    def _of_cai(cls, x: Any, cai: dict, name: str) -> "Operand":
        try:
            dtype = np.dtype(cai["typestr"])
        except TypeError as e:
            raise UnsupportedDtypeError(f"{name}: CUDA array of type {cai.get('typestr')!r}: {e}") from e
        if dtype.kind == "V" and dtype.itemsize == 2:  # bfloat16 arrays describe themselves as <V2
            dtype = bfloat16_dtype()
        shape = tuple(int(d) for d in cai["shape"])
        item = dtype.itemsize
        if cai.get("strides") is None:
            strides = _contiguous_strides(shape)
        else:
            bs = tuple(int(b) for b in cai["strides"])
            if any(b % item for b in bs):
                raise InvalidArgumentError(f"{name}: CUDA array strides {bs} are not whole elements")
            strides = tuple(b // item for b in bs)
        ptr, readonly = cai["data"]
        dev = getattr(x, "device", None)
        index = next((v for v in (getattr(dev, "id", None), getattr(dev, "index", None)) if isinstance(v, int)), 0)
        return cls(x, _library(x), f"cuda:{index}", shape, strides, dtype, int(ptr or 0), bool(readonly))

    # ------------------------------------------------------------------ facts

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def device_index(self) -> int:
        return int(self.device.split(":")[1]) if self.on_cuda else 0

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def in_place(self) -> bool:
        """Whether the kernels can read it where it is: a contiguous last axis and no
        negative stride."""
        shape, strides = self.shape, self.strides
        if not shape or 0 in shape:
            return True
        return (shape[-1] <= 1 or strides[-1] == 1) and min(strides) >= 0

    @property
    def contiguous(self) -> bool:
        return self.size == 0 or tuple(self.strides) == _contiguous_strides(self.shape)

    def span_elements(self) -> int:
        """Elements from the first to one past the last (non-negative strides)."""
        if self.size == 0:
            return 0
        if any(s < 0 for s in self.strides):
            raise InvalidArgumentError(f"an array with negative strides {self.strides} cannot be used in place")
        return sum((d - 1) * s for d, s in zip(self.shape, self.strides)) + 1

    def producer_stream(self) -> Optional[int]:
        """The CUDA stream whose work must finish before this array is read or written:
        PyTorch's current stream for a tensor, the interface's ``stream`` for others (None:
        ready now, or a host array)."""
        if not self.on_cuda:
            return None
        if self.library == "torch":
            import torch

            return int(torch.cuda.current_stream(self.obj.device).cuda_stream)
        s = (_cuda_array_interface(self.obj, "array") or {}).get("stream")
        return None if s is None else int(s)

    def run_stream(self) -> int:
        """The CUDA stream to run on for this array (``cudaStream_t`` as an int): PyTorch's
        current stream for a tensor, CuPy's current stream for a CuPy array, the interface's
        ``stream`` for others; 1 (the legacy default stream) for the default stream, since 0
        means "the library's own stream" to the C ABI."""
        s = None
        if self.library == "torch":
            import torch

            s = torch.cuda.current_stream(self.obj.device).cuda_stream
        elif self.library == "cupy":
            import cupy

            s = cupy.cuda.get_current_stream().ptr
        else:
            s = (_cuda_array_interface(self.obj, "array") or {}).get("stream")
        return int(s) if s else 1

    # ------------------------------------------------------------------ host views

    def host_array(self) -> np.ndarray:
        """A numpy view of a host operand's elements (no copy)."""
        if self.on_cuda:
            raise InvalidArgumentError("a CUDA array has no host view; use to_host()")
        if self.library == "numpy":
            return self.obj if isinstance(self.obj, np.ndarray) else np.asarray(self.obj)
        if self.library == "torch":
            t = self.obj
            if self.dtype == bfloat16_dtype():
                import torch

                return t.view(torch.int16).numpy().view(self.dtype)
            return t.numpy()
        return np.asarray(self.obj)

    def to_host(self) -> np.ndarray:
        """The elements as a numpy array: a view for host operands, a copy for CUDA ones."""
        if not self.on_cuda:
            return self.host_array()
        if self.library == "torch":
            import torch

            t = self.obj.detach()
            if t.dtype == torch.bfloat16:
                return t.view(torch.int16).cpu().numpy().view(self.dtype)
            return t.cpu().numpy()
        if self.library == "cupy":
            return self.obj.get()
        raise InvalidArgumentError(f"cannot copy a {type(self.obj).__name__} to the host")

    # ------------------------------------------------------------------ new arrays

    def new_empty(self, shape: Sequence[int], dtype: Any) -> "Operand":
        """A new C-contiguous array of this operand's library on its device (numpy for
        arrays of other libraries); a ``BufferAllocationError`` when it does not fit."""
        if not self.on_cuda:
            check_host_fits(shape, dtype, self.device)
        try:
            return self._new_empty(shape, dtype)
        except ALLOCATION_FAILURES as e:
            raise allocation_error(shape, dtype, self.device, e) from e

    def _new_empty(self, shape: Sequence[int], dtype: Any) -> "Operand":
        dt = np.dtype(dtype)
        shape = tuple(int(d) for d in shape)
        if self.library == "torch":
            import torch

            t = torch.empty(shape, dtype=_torch_dtype(dt), device=self.obj.device)
            return Operand.of(t)
        if self.library == "cupy":
            import cupy

            with cupy.cuda.Device(self.device_index):
                return Operand.of(cupy.empty(shape, dtype=dt))
        return Operand.of(np.empty(shape, dtype=dt))

    def from_host(self, a: np.ndarray) -> "Operand":
        """A new array of this operand's library on its device holding the host array ``a``
        (numpy itself for numpy and other libraries)."""
        if self.library == "torch":
            import torch

            src = np.ascontiguousarray(a)
            if src.dtype == bfloat16_dtype():
                t = torch.from_numpy(src.view(np.int16)).view(torch.bfloat16)
            else:
                t = torch.from_numpy(src)
            return Operand.of(t.to(self.obj.device) if self.on_cuda else t)
        if self.library == "cupy":
            import cupy

            with cupy.cuda.Device(self.device_index):
                return Operand.of(cupy.asarray(a))
        return Operand.of(a)

    def new_zeros(self, shape: Sequence[int], dtype: Any) -> "Operand":
        out = self.new_empty(shape, dtype)
        if out.library == "torch":
            out.obj.zero_()
        elif out.library == "cupy":
            out.obj.fill(0)
        else:
            out.obj.fill(0)
        return out

    def made_contiguous(self) -> "Operand":
        """A C-contiguous copy (this operand itself when it is one)."""
        if self.contiguous:
            return self
        if self.library == "torch":
            return Operand.of(self.obj.contiguous())
        if self.library == "cupy":
            import cupy

            return Operand.of(cupy.ascontiguousarray(self.obj))
        return Operand.of(np.ascontiguousarray(self.host_array()))

    def copied(self) -> "Operand":
        """A new C-contiguous copy."""
        if self.library == "torch":
            import torch

            return Operand.of(self.obj.clone(memory_format=torch.contiguous_format))
        if self.library == "cupy":
            import cupy

            with cupy.cuda.Device(self.device_index):
                return Operand.of(cupy.array(self.obj, copy=True, order="C"))
        return Operand.of(np.array(self.host_array(), copy=True, order="C"))

    def half_copy(self) -> "Operand":
        """A contiguous float16 copy of a float32 operand, made by its own library on its
        device (round to nearest even; values beyond half's range become +-inf)."""
        if self.library == "torch":
            import torch

            return Operand.of(self.obj.to(torch.float16, memory_format=torch.contiguous_format))
        if self.library == "cupy":
            import cupy

            with cupy.cuda.Device(self.device_index):
                return Operand.of(cupy.ascontiguousarray(self.obj.astype(cupy.float16)))
        return Operand.of(np.ascontiguousarray(self.host_array().astype(np.float16)))


#: What the libraries raise when an array does not fit: numpy's MemoryError (and ValueError
#: for a size past its index type), torch's RuntimeError (its OutOfMemoryError is one).
ALLOCATION_FAILURES = (MemoryError, ValueError, RuntimeError)


def allocation_error(shape: Sequence[int], dtype: Any, device: str, cause: BaseException) -> BufferAllocationError:
    """The library's error for an output that could not be allocated, with its size."""
    n = math.prod(int(d) for d in shape) * np.dtype(dtype).itemsize
    return BufferAllocationError(
        f"cannot allocate an output of shape {tuple(shape)} ({n / 2**30:.3g} GiB of {np.dtype(dtype).name}) on "
        f"{device}: {type(cause).__name__}: {cause}. Free memory, pass a smaller batch, or give out= arrays"
    )


_host_memory: Optional[int] = None


def host_memory() -> int:
    """The most one host buffer may take (RAM plus swap within the cgroup limit, as the CPU
    backend reports it; 0 unknown), read once."""
    global _host_memory
    if _host_memory is None:
        fields = dict(kv.split("=", 1) for kv in get_string(lib.mlxn_cpu_info).split(";"))
        _host_memory = int(fields.get("memory", 0))
    return _host_memory


def host_fits(shape: Sequence[int], dtype: Any) -> bool:
    """Whether a host array of this shape and dtype is within :func:`host_memory` (or that is
    unknown)."""
    limit = host_memory()
    return not limit or math.prod(int(d) for d in shape) * np.dtype(dtype).itemsize <= limit


def check_host_fits(shape: Sequence[int], dtype: Any, device: str) -> None:
    """A ``BufferAllocationError`` for a host output larger than :func:`host_memory`: on a
    machine that overcommits memory its allocation succeeds, and the process is killed when
    the kernel writes it, instead of an error the caller can handle."""
    if not host_fits(shape, dtype):
        limit = host_memory()
        cause = MemoryError(f"more than the {limit / 2**30:.3g} GiB one buffer may take here (RAM plus swap within the cgroup limit)")
        raise allocation_error(shape, dtype, device, cause)


def layout_key(x: Any) -> Optional[tuple]:
    """A hashable summary of an array's layout (type, shape, strides, dtype, device, and
    for a tensor whether it requires grad) read without building an :class:`Operand`, for
    caches keyed by layout; None for an object of another kind (not cached)."""
    t = type(x)
    if t is np.ndarray:
        # Alignment too: a plan made on aligned arrays passes addresses as they are.
        return (t, x.shape, x.strides, x.dtype, x.flags.aligned)
    mod = t.__module__
    if mod == "torch":
        return (t, x.shape, x.stride(), x.dtype, x.device, x.requires_grad)
    if mod.startswith("cupy"):
        return (t, x.shape, x.strides, x.dtype, x.device.id)
    return None


def _contiguous_strides(shape) -> tuple:
    strides, s = [], 1
    for d in reversed(shape):
        strides.append(s)
        s *= int(d)
    return tuple(reversed(strides))


def _cuda_array_interface(x: Any, name: str) -> Optional[dict]:
    try:
        cai = getattr(x, "__cuda_array_interface__", None)
    except (AttributeError, TypeError):
        return None
    except RuntimeError as e:  # a tensor that requires grad, for instance
        raise InvalidArgumentError(f"cannot use {name} in place: {e}") from e
    return cai if isinstance(cai, dict) else None


def _as_numpy(x: Any, name: str) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__dlpack__") and not hasattr(x, "__array_interface__"):
        try:
            return np.from_dlpack(x)
        except (TypeError, RuntimeError, BufferError) as e:
            raise InvalidArgumentError(f"cannot view {name} ({type(x).__name__}) on the host through DLPack: {e}") from e
    try:
        a = np.asarray(x)
    except Exception as e:
        raise UnsupportedDtypeError(f"cannot make an array of {name} ({type(x).__name__}): {e}") from e
    if a.dtype == object:
        raise UnsupportedDtypeError(f"{name} ({type(x).__name__}) is not an array of numbers")
    return a


_TORCH_OF_NAME: dict = {}


def _torch_dtype(dt: np.dtype):
    if not _TORCH_OF_NAME:
        import torch

        _TORCH_OF_NAME.update(float32=torch.float32, float16=torch.float16, bfloat16=torch.bfloat16, uint8=torch.uint8,
                              int32=torch.int32, int64=torch.int64, bool=torch.bool, int16=torch.int16)  # fmt: skip
    name = np.dtype(dt).name
    if name not in _TORCH_OF_NAME:
        raise UnsupportedDtypeError(f"no torch dtype for {name}")
    return _TORCH_OF_NAME[name]


def as_host_array(x: Any, name: str = "array") -> np.ndarray:
    """``x`` as a numpy array: the array itself, a view of a CPU tensor, or a copy of a
    CUDA one."""
    return Operand.of(x, name).to_host()


# ---------------------------------------------------------------------- a run's outputs


def output(given: Any, like: Operand, name: str, shape: tuple, dtype, fill: Optional[np.ndarray] = None) -> Operand:
    """The output operand: ``given`` (checked: contiguous, of ``shape`` and ``dtype``, on
    ``like``'s device), or a new array of ``like``'s library; with ``fill`` (a host array)
    holding it."""
    if given is None:
        if fill is not None:
            return like.from_host(fill)
        return like.new_empty(shape, dtype)
    op = Operand.of(given, name)
    if op.converted is not None:
        raise InvalidArgumentError(
            f"{name} cannot be written in place: {op.converted}. Pass a new array "
            f"(numpy.empty({tuple(shape)}, dtype={np.dtype(dtype).name})), or none to get one"
        )
    if op.shape != tuple(shape) or op.dtype != np.dtype(dtype) or not op.contiguous or op.readonly or op.device != like.device:
        raise InvalidArgumentError(
            f"{name} must be a writable contiguous {np.dtype(dtype).name} array of shape {tuple(shape)} on {like.device}, "
            f"got {op.dtype.name} {op.shape} with strides {op.strides} on {op.device}"
        )
    if fill is not None:
        if op.library == "torch":
            op.obj.copy_(Operand.of(op.obj).from_host(fill).obj)
        else:
            op.obj[...] = fill
    return op


def direct_outputs(qo: Operand, shape: tuple, lse_shape: tuple, out_dtype):
    """For a plan's one-call path (numpy arrays and torch tensors used in place): makers of
    the outputs from q (its library, its device) and the address function of its library."""
    # The plan's output shape is fixed: whether it fits the host is decided once here, and a
    # call raises check_host_fits's error only where it does not (an overcommitting host
    # "allocates" anything, then kills the writer).
    fits = qo.on_cuda or host_fits(shape, out_dtype)
    if qo.library == "torch":
        import torch

        tdt = _torch_dtype(out_dtype)

        def new_out(q):
            if not fits:
                check_host_fits(shape, out_dtype, qo.device)
            return torch.empty(shape, dtype=tdt, device=q.device)

        def new_lse(q):
            return torch.empty(lse_shape, dtype=torch.float32, device=q.device)

        ptr = _torch_ptr
    else:

        def new_out(q):
            if not fits:
                check_host_fits(shape, out_dtype, qo.device)
            return np.empty(shape, dtype=out_dtype)

        def new_lse(q):
            return np.empty(lse_shape, dtype=np.float32)

        ptr = _numpy_ptr
    return new_out, new_lse, ptr


def _numpy_ptr(a: np.ndarray) -> int:
    return a.ctypes.data if a.size else 0


def _torch_ptr(t) -> int:
    return t.data_ptr()
