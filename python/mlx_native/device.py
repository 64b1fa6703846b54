"""Devices, buffers and command encoders."""

from __future__ import annotations

import threading
import weakref
from typing import Any, Optional, Sequence

import numpy as np

from ._lib import check, ffi, get_string, lib
from .arrays import Operand
from .dtypes import dtype_code as _dtype_code
from .dtypes import numpy_dtype as _numpy_dtype
from .errors import ArgumentTypeError, InvalidArgumentError, UnsupportedDtypeError, not_picklable
from .scalars import check_int, check_shape

BACKEND_NAMES = {0: "cpu", 1: "cuda", 2: "metal"}


def version() -> str:
    """The native library's version."""
    return ffi.string(lib.mlxn_version()).decode()


def backends() -> list:
    """Backends that can open a device on this machine, best first (``cpu`` always)."""
    return get_string(lib.mlxn_backends).split(",")


def cpu_info() -> dict:
    """The CPU backend's instruction set in use, the ones detected, and its threads."""
    fields = dict(kv.split("=", 1) for kv in get_string(lib.mlxn_cpu_info).split(";"))
    return {
        "isa": fields["isa"],
        "detected": fields["detected"].split(","),
        "threads": int(fields["threads"]),
        # The most one buffer may take (RAM plus swap within the cgroup limit); 0 unknown.
        "memory": int(fields.get("memory", 0)),
        # What runs the kernels' parallel jobs: "rayon" (the library's pool) or "openmp (path)".
        "runtime": fields.get("runtime", "rayon"),
    }


def cpu_fma_peak(threads: int = 0) -> float:
    """Measured FMA peak of the CPU in GFLOP/s (float32, an FMA is 2 FLOP per lane) on
    ``threads`` threads (0: all the threads the kernels use), with the instruction set the
    kernels use now. Takes about a quarter of a second."""
    if int(threads) != threads or threads < 0:
        raise InvalidArgumentError(f"threads must be a non-negative integer, got {threads!r}")
    out = ffi.new("double *")
    check(lib.mlxn_cpu_fma_peak(int(threads), out))
    return float(out[0])


def cpu_amx_peak(threads: int = 0) -> float:
    """Measured AMX-BF16 peak of the CPU in GFLOP/s (TDPBF16PS on tile registers, a
    multiply-add counting 2 FLOP) on ``threads`` threads (0: all the threads the kernels
    use), measured as :func:`cpu_fma_peak` is. Raises ``BackendUnavailableError`` where the
    CPU or its OS offers no AMX tiles (``"amx"`` not in ``cpu_info()["detected"]``)."""
    if int(threads) != threads or threads < 0:
        raise InvalidArgumentError(f"threads must be a non-negative integer, got {threads!r}")
    out = ffi.new("double *")
    check(lib.mlxn_cpu_amx_peak(int(threads), out))
    return float(out[0])


_AMX_KV = {"float16": 1, "bfloat16": 2}


def _amx_kv_code(kv_dtype: str) -> int:
    if kv_dtype not in _AMX_KV:
        raise InvalidArgumentError(f"kv_dtype must be 'float16' or 'bfloat16', got {kv_dtype!r}")
    return _AMX_KV[kv_dtype]


def cpu_amx_products(kv_dtype: str) -> tuple:
    """``(qk, pv)``: how many bfloat16 products the CPU's AMX kernels sum for Q.K^T and for
    P.V with K/V of ``kv_dtype`` (``"float16"`` or ``"bfloat16"``); see
    :func:`set_cpu_amx_products`."""
    qk, pv = ffi.new("uint32_t *"), ffi.new("uint32_t *")
    check(lib.mlxn_cpu_amx_products(_amx_kv_code(kv_dtype), qk, pv))
    return int(qk[0]), int(pv[0])


def set_cpu_amx_products(kv_dtype: str, qk: Optional[int] = None, pv: Optional[int] = None) -> None:
    """Choose how the AMX kernels split each product with K/V of ``kv_dtype`` into bfloat16
    products (AMX multiplies bfloat16 only): in the order ``A_hi.B_hi``, ``A_hi.B_lo``,
    ``A_lo.B_hi``, ``A_lo.B_lo`` the first ``qk`` (for Q.K^T, A = K) and ``pv`` (for P.V,
    A = V) are summed, 1 to 4 each (1 or 2 with bfloat16 K/V, which has no low part); one
    rounds Q or P to bfloat16 (bfloat16 Q is exact in one part: the kernels read it as it is
    and scale the scores instead). ``None`` for both restores the default (float16: 4 and 4,
    bfloat16: 2 and 2, the exact products). Process-wide; for measurements."""
    if (qk is None) != (pv is None):
        raise InvalidArgumentError("give both qk and pv, or neither (the default)")
    code = _amx_kv_code(kv_dtype)
    check(lib.mlxn_cpu_set_amx_products(code, 0 if qk is None else int(qk), 0 if pv is None else int(pv)))


def cuda_compile_check(arch: str = "sm_90a") -> str:
    """Compile every CUDA kernel of the library with NVRTC for ``arch`` (``sm_90a``,
    ``sm_80``, ...) without a GPU. Returns ptxas's report (registers and spills per entry
    point); raises ``BackendUnavailableError`` when NVRTC is not found and
    ``ShaderCompilationError`` (with the compiler's log) when a kernel does not compile."""
    if not isinstance(arch, str):
        raise InvalidArgumentError(f"arch must be a string such as 'sm_90a', got {type(arch).__name__}")
    return get_string(lib.mlxn_cuda_compile_check, arch.encode())


def live_handles() -> int:
    """Devices, buffers and encoders open now in this process (for leak checks)."""
    out = ffi.new("uint64_t *")
    check(lib.mlxn_handle_count(out))
    return int(out[0])


def force_cpu_isa(name: Optional[str]) -> None:
    """Make the CPU kernels use one instruction set (``amx``, ``avx512``, ``avx2+fma+f16c``,
    ``portable``: those of ``cpu_info()["detected"]``; or ``amx-emulated``, the AMX kernels on
    software tiles, which runs on any CPU and is never detected), or the best available with
    ``None``. Process-wide; for tests and benchmarks that compare code paths."""
    if name is not None and not isinstance(name, str):
        raise ArgumentTypeError(
            f"name must be an instruction set's name (one of cpu_info()['detected']) or None, got {type(name).__name__}"
        )
    check(lib.mlxn_cpu_force_isa(ffi.NULL if name is None else name.encode()))


def force_cuda_pair(mode: Optional[str]) -> None:
    """Make every CUDA launch use one CTA-pair choice: ``"0"`` the one-CTA forms,
    ``"queries"`` query pairs only, ``"1"`` head pairs where the group of query heads splits
    in two (the default's rule); ``None``: back to ``MLX_NATIVE_CUDA_PAIR``'s. Process-wide;
    for tests and benchmarks that compare the forms (the output is the same to the bit)."""
    if mode is not None and not isinstance(mode, str):
        raise ArgumentTypeError(f"mode must be '0', 'queries', '1' or None, got {type(mode).__name__}")
    check(lib.mlxn_cuda_force_pair(ffi.NULL if mode is None else mode.encode()))


#: Whether the caller chose the CPU kernels' threads (set_num_threads); until then the
#: torch operators follow torch.get_num_threads().
_threads_chosen = False
_threads_applied = 0


def set_num_threads(n: Optional[int]) -> None:
    """Run the CPU kernels on ``n`` threads from the next call on (``None`` or 0: back to
    the default, ``RAYON_NUM_THREADS`` or else every core this process may use).
    Process-wide. Until it is called, calls on torch CPU tensors use
    ``torch.get_num_threads()`` threads, as PyTorch's own operators do."""
    global _threads_chosen, _threads_applied
    if n is None:
        n = 0
    if not isinstance(n, (int, np.integer)) or isinstance(n, (bool, np.bool_)):
        raise ArgumentTypeError(f"n must be an integer >= 0 or None, got {n!r} ({type(n).__name__})")
    if not 0 <= n <= 1024:
        raise InvalidArgumentError(f"n must be between 1 and 1024 threads (0 or None: the default), got {n}")
    check(lib.mlxn_cpu_set_threads(int(n)))
    _threads_chosen, _threads_applied = n != 0, int(n)


def get_num_threads() -> int:
    """The threads the CPU kernels run on."""
    return cpu_info()["threads"]


#: Whether the torch operators have asked for PyTorch's OpenMP threads (once per process).
_openmp_asked = False


def follow_torch_threads(n: int) -> None:
    """Run the CPU kernels as PyTorch's own operators run: on ``n``
    (``torch.get_num_threads()``) threads unless the caller chose a number with
    :func:`set_num_threads`, and on PyTorch's OpenMP threads (which spin after each of its
    operators, and would fight a pool of ours for the cores). The torch operators call this
    before each CPU run: one comparison when nothing changed."""
    global _threads_applied, _openmp_asked
    if not _openmp_asked:
        check(lib.mlxn_cpu_use_openmp(1, ffi.NULL))
        _openmp_asked = True
    if not _threads_chosen and n != _threads_applied:
        check(lib.mlxn_cpu_set_threads(max(0, min(int(n), 1024))))
        _threads_applied = n


_shared_lock = threading.Lock()
_shared: dict = {}


def shared_device(name: str) -> "Device":
    """``Device(name)``, opened once per process and name (``"cpu"``, ``"cuda:1"``,
    ``"auto"``): the device the high-level calls use when they pick one."""
    with _shared_lock:
        dev = _shared.get(name)
        if dev is None or dev.closed:
            dev = _shared[name] = Device(name)
        return dev


def default_device() -> "Device":
    """``Device("auto")``, opened once per process: the device of the origin op's helpers
    when none is given. (The high-level attention lets the arrays decide instead.)"""
    return shared_device("auto")


def _free(fn, handle: int) -> None:
    # Called by weakref.finalize, possibly at interpreter exit: never raise.
    try:
        fn(handle)
    except Exception:  # pragma: no cover
        pass


class Device:
    """A compute device: ``Device()`` or ``Device("auto")`` picks Metal if present, else
    CUDA if a GPU is present, else the CPU; ``Device("cpu")``, ``Device("cuda")``,
    ``Device("cuda:1")`` or ``Device("metal")`` ask for one."""

    def __init__(self, backend: str = "auto"):
        if not isinstance(backend, str):
            raise InvalidArgumentError(f"backend must be a string, got {type(backend).__name__}")
        out = ffi.new("uint64_t *")
        check(lib.mlxn_device_open(backend.encode(), out))
        self._handle = out[0]
        self._finalizer = weakref.finalize(self, _free, lib.mlxn_device_close, self._handle)
        code = ffi.new("uint32_t *")
        self.description = get_string(lib.mlxn_device_info, self._handle, code)
        self.backend = BACKEND_NAMES.get(code[0], "unknown")
        #: The CUDA device's ordinal (``cuda:N``; 0 for ``cuda`` and ``auto``), 0 elsewhere.
        self.index = int(backend.split(":", 1)[1]) if backend.startswith("cuda:") else 0

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return not self._finalizer.alive

    @property
    def handle(self) -> int:
        return self._handle

    def close(self) -> None:
        """Release the device handle (buffers made from it stay valid until freed).
        Closing twice raises ``InvalidHandleError``."""
        if not self._finalizer.alive:
            check(lib.mlxn_device_close(self._handle))  # raises: already closed
        self._finalizer.detach()
        check(lib.mlxn_device_close(self._handle))

    def __repr__(self) -> str:
        return f"Device({self.backend!r}: {self.description})"

    def __reduce__(self):
        raise not_picklable(self, "a handle of this process's native library", "Open Device(name) in the other process")

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc) -> None:
        if self._finalizer.alive:
            self.close()

    # -- buffers -------------------------------------------------------------------------

    def empty(self, shape: Sequence[int] | int, dtype: Any = np.float32) -> "Buffer":
        """A zero-filled buffer of ``shape`` elements of ``dtype`` on this device."""
        shape = check_shape(shape)
        code = _dtype_code(dtype)
        dims = ffi.new("uint64_t[]", [int(d) for d in shape] or [0])
        out = ffi.new("uint64_t *")
        check(lib.mlxn_buffer_new(self._handle, code, dims, len(shape), out))
        return Buffer(self, out[0], _numpy_dtype(code), shape, owner=None, writable=True)

    def buffer(self, array: Any, *, copy: bool = False) -> "Buffer":
        """A buffer holding ``array`` (numpy float32/float16/uint8/..., bfloat16 through
        ml_dtypes, or anything numpy can view: the buffer protocol, CPU DLPack tensors).

        On the CPU the buffer uses the array's memory in place when it is contiguous and
        aligned (``copy=False``); the buffer keeps the array alive. Otherwise, or with
        ``copy=True``, it holds a copy. A read-only array gives a read-only buffer, which
        cannot be an output.

        On a CUDA device a CUDA array (PyTorch tensor, CuPy array: anything with the CUDA
        Array Interface) is used in place when it is contiguous (``copy=False``), after
        waiting for its producer stream; the buffer keeps it alive."""
        op = Operand.of(array)
        if op.on_cuda:
            if self.backend != "cuda":
                raise InvalidArgumentError(f"a CUDA array needs a CUDA device, not {self!r}")
            if not op.contiguous:
                raise InvalidArgumentError(
                    f"a non-contiguous CUDA array (strides {op.strides}) cannot be used in place; pass a contiguous one"
                )
            return self.wrap(op.copied() if copy else op)
        arr = op.host_array()
        code = _dtype_code(arr.dtype)
        shape = arr.shape
        dims = ffi.new("uint64_t[]", [int(d) for d in shape] or [0])
        out = ffi.new("uint64_t *")
        in_place = (
            self.backend == "cpu"
            and not copy
            and arr.flags.c_contiguous
            and arr.flags.aligned
        )
        if in_place:
            writable = bool(arr.flags.writeable)
            ptr = ffi.cast("void *", arr.ctypes.data) if arr.nbytes else ffi.NULL
            check(lib.mlxn_buffer_wrap_host(self._handle, ptr, arr.nbytes, code, dims, len(shape), out))
            return Buffer(self, out[0], arr.dtype, shape, owner=arr, writable=writable)
        if self.backend == "cpu":
            owned = np.array(arr, copy=True, order="C")
            ptr = ffi.cast("void *", owned.ctypes.data) if owned.nbytes else ffi.NULL
            check(lib.mlxn_buffer_wrap_host(self._handle, ptr, owned.nbytes, code, dims, len(shape), out))
            return Buffer(self, out[0], owned.dtype, shape, owner=owned, writable=True)
        buf = self.empty(shape, arr.dtype)
        buf.write(arr)
        return buf

    def wrap(self, op: Operand, *, span: bool = False) -> "Buffer":
        """A buffer over an operand's memory on this device, used in place and kept alive
        by the buffer: the operand's own shape when it is contiguous, or (``span=True``) a
        flat buffer over the elements from its first to its last. A CUDA operand is waited
        for first (its producer stream)."""
        if span:
            shape = (op.span_elements(),)
        elif op.contiguous:
            shape = op.shape
        else:
            raise InvalidArgumentError(f"an array with strides {op.strides} is not contiguous; wrap its span instead")
        nbytes = int(np.prod(shape, dtype=np.int64)) * op.dtype.itemsize
        code = _dtype_code(op.dtype)
        dims = ffi.new("uint64_t[]", [int(d) for d in shape] or [0])
        out = ffi.new("uint64_t *")
        if op.on_cuda:
            stream = op.producer_stream()
            if stream is not None:
                self.wait_stream(stream)
            check(lib.mlxn_buffer_wrap_device(self._handle, op.ptr, nbytes, code, dims, len(shape), out))
        else:
            ptr = ffi.cast("void *", op.ptr) if nbytes else ffi.NULL
            check(lib.mlxn_buffer_wrap_host(self._handle, ptr, nbytes, code, dims, len(shape), out))
        return Buffer(self, out[0], op.dtype, shape, owner=op.obj, writable=not op.readonly)

    def wait_stream(self, stream: int) -> None:
        """Wait until the work queued on another library's CUDA stream (a
        ``cudaStream_t`` as an int; 1 and 2 name the default streams) is done. CUDA
        devices only."""
        check(lib.mlxn_device_wait_stream(self._handle, int(stream)))

    def encoder(self) -> "Encoder":
        """A command encoder; as a context manager it commits and waits on exit."""
        return Encoder(self)


def _as_numpy(array: Any) -> np.ndarray:
    """``array`` as a host numpy array (a view where it can be)."""
    return Operand.of(array).to_host()


class Buffer:
    """A typed, shaped buffer on a device. ``numpy()`` copies it to a new array."""

    def __init__(self, device: Device, handle: int, dtype: np.dtype, shape, owner, writable: bool):
        self.device = device
        self._handle = handle
        self.dtype = np.dtype(dtype)
        self.shape = tuple(int(d) for d in shape)
        self.writable = writable
        # The array whose memory the buffer uses in place: kept alive with the buffer.
        self._owner = owner
        self._finalizer = weakref.finalize(self, _free, lib.mlxn_buffer_free, handle)

    @property
    def handle(self) -> int:
        return self._handle

    @property
    def nbytes(self) -> int:
        info = ffi.new("MlxnBufferInfo *")
        check(lib.mlxn_buffer_info(self._handle, info))
        return int(info.byte_len)

    def numpy(self) -> np.ndarray:
        """A new array with the buffer's contents."""
        out = np.empty(self.shape, dtype=self.dtype)
        if out.nbytes:
            check(lib.mlxn_buffer_read(self._handle, 0, ffi.cast("void *", out.ctypes.data), out.nbytes))
        return out

    def write(self, array: Any) -> None:
        """Copy ``array`` (same dtype and number of elements) into the buffer."""
        arr = np.ascontiguousarray(_as_numpy(array))
        if arr.dtype != self.dtype:
            raise UnsupportedDtypeError(f"buffer holds {self.dtype.name}, got {arr.dtype.name}")
        if not self.writable:
            raise InvalidArgumentError("the buffer wraps a read-only array")
        want = int(np.prod(self.shape, dtype=object))
        if arr.size != want:
            raise InvalidArgumentError(
                f"the buffer holds {want} elements {self.shape} and the array {arr.size} {arr.shape}: write an array "
                f"of the buffer's size (a part of the buffer: write into buffer.view(byte_offset, shape))"
            )
        if arr.nbytes:
            check(lib.mlxn_buffer_write(self._handle, 0, ffi.cast("void *", arr.ctypes.data), arr.nbytes))

    def view(self, byte_offset: int, shape: Sequence[int] | int, dtype: Any = None) -> "Buffer":
        """A buffer over the bytes of ``shape`` elements of ``dtype`` (default: this
        buffer's; a numpy dtype, or a C ABI dtype's name such as ``"q8_0"``) starting
        ``byte_offset`` bytes in: the same memory, no copy. It keeps this buffer's memory
        (and the array it wraps) alive."""
        shape = check_shape(shape)
        byte_offset = check_int(byte_offset, "byte_offset")
        code = _dtype_code(self.dtype if dtype is None else dtype)
        dt = _numpy_dtype(code)
        nbytes = int(np.prod(shape, dtype=object)) * dt.itemsize
        if nbytes >= 2**63 or int(byte_offset) >= 2**63:
            raise InvalidArgumentError(f"a view of {nbytes} bytes at {byte_offset} exceeds any buffer")
        dims = ffi.new("uint64_t[]", [int(d) for d in shape] or [0])
        out = ffi.new("uint64_t *")
        check(lib.mlxn_buffer_view(self._handle, int(byte_offset), nbytes, code, dims, len(shape), out))
        return Buffer(self.device, out[0], _numpy_dtype(code), shape, owner=self, writable=self.writable)

    def free(self) -> None:
        """Release the buffer now. Freeing twice raises ``InvalidHandleError``."""
        if not self._finalizer.alive:
            check(lib.mlxn_buffer_free(self._handle))  # raises: already freed
        self._finalizer.detach()
        # The wrapped array (if any) stays referenced: a pending dispatch may still use it.
        check(lib.mlxn_buffer_free(self._handle))

    def __repr__(self) -> str:
        return f"Buffer({self.dtype.name}, shape={self.shape}, device={self.device.backend})"

    def __reduce__(self):
        raise not_picklable(self, "a handle of this process's native library", "Pickle buffer.numpy() instead")


class Encoder:
    """Records dispatches; ``commit()`` runs them and waits. As a context manager it
    commits on a clean exit and discards what it recorded if the block raised."""

    def __init__(self, device: Device):
        self.device = device
        out = ffi.new("uint64_t *")
        check(lib.mlxn_encoder_new(device.handle, out))
        self._handle = out[0]
        self._finalizer = weakref.finalize(self, _free, lib.mlxn_encoder_free, self._handle)
        # Buffers used by recorded dispatches stay alive (with their arrays) until commit.
        self._keep: list = []
        self._lock = threading.Lock()

    @property
    def handle(self) -> int:
        return self._handle

    def __reduce__(self):
        raise not_picklable(self, "a handle of this process's native library", "Make an encoder in the other process")

    def _hold(self, *buffers: "Buffer") -> None:
        with self._lock:
            self._keep.extend(buffers)

    @property
    def pending(self) -> int:
        """Dispatches recorded and not yet committed."""
        out = ffi.new("uint64_t *")
        check(lib.mlxn_encoder_pending(self._handle, out))
        return int(out[0])

    def commit(self) -> None:
        """Run every recorded dispatch and wait for it to finish."""
        try:
            check(lib.mlxn_encoder_commit_and_wait(self._handle))
        finally:
            with self._lock:
                self._keep.clear()

    def close(self) -> None:
        """Free the encoder; dispatches never committed are dropped unrun."""
        if not self._finalizer.alive:
            check(lib.mlxn_encoder_free(self._handle))  # raises: already closed
        self._finalizer.detach()
        check(lib.mlxn_encoder_free(self._handle))
        with self._lock:
            self._keep.clear()

    def __enter__(self) -> "Encoder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self.commit()
        finally:
            if self._finalizer.alive:
                self.close()
