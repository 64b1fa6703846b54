"""High-level prefill attention on numpy arrays: pads the cache, builds the mask and the
tile-skip table, dispatches, returns the output."""

from __future__ import annotations

import threading
from typing import Any, Optional

import numpy as np

from .arrays import Operand
from .device import Device, _as_numpy
from .errors import InvalidArgumentError, UnsupportedDtypeError
from .ops import (
    CACHE_ROWS_PER_STEP,
    FlashAttnPrefillTensorParams,
    dispatch_flash_attn_prefill_blk,
    dispatch_flash_attn_prefill_tensor_f16,
    kv_pad,
    queries_per_threadgroup,
)

_default_lock = threading.Lock()
_default: Optional[Device] = None

#: Rows of the mask built at a time (bounds the temporary memory of huge masks).
_MASK_CHUNK_ROWS = 1024


def default_device() -> Device:
    """The device ``flash_attn_prefill`` uses when none is given: ``Device("auto")``,
    opened once per process."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Device("auto")
        return _default


def causal_mask(rows: int, kv_len: int, window: Optional[int] = None, dtype: Any = np.float16) -> np.ndarray:
    """Additive mask ``[rows, kv_len]``: 0 where query row ``r`` may see cache row ``j``,
    ``-inf`` elsewhere. Causal: ``j <= r + (kv_len - rows)`` (the prompt is the last
    ``rows`` rows of the cache); with a window ``w`` also ``j > r + (kv_len - rows) - w``."""
    rows, kv_len = _nonneg(rows, "rows"), _nonneg(kv_len, "kv_len")
    if window is not None and _nonneg(window, "window") < 1:
        raise InvalidArgumentError(f"window must be at least 1, got {window}")
    out = np.empty((rows, kv_len), dtype=dtype)
    for r0 in range(0, rows, _MASK_CHUNK_ROWS):
        r1 = min(rows, r0 + _MASK_CHUNK_ROWS)
        out[r0:r1] = np.where(_visible(r0, r1, rows, kv_len, window), 0, -np.inf).astype(dtype)
    return out


def _visible(r0: int, r1: int, rows: int, kv_len: int, window: Optional[int]) -> np.ndarray:
    last = np.arange(r0, r1)[:, None] + (kv_len - rows)
    j = np.arange(kv_len)[None, :]
    ok = j <= last
    if window is not None:
        ok &= j > last - window
    return ok


def check_q_fits_half(q: Any, scale: float = 1.0) -> None:
    """Raise ``InvalidArgumentError`` if ``half(scale * q)`` is not finite somewhere.

    The kernel folds ``scale`` into Q and rounds Q to float16 (SPEC section 2, step 1): a
    value with ``|scale * q| >= 65520`` becomes +-inf in half, and a NaN stays NaN; either
    makes that (row, head) of the output NaN or inf. This finds the first such element."""
    q = _as_numpy(q)
    s = np.float32(scale)
    if not np.isfinite(s):
        raise InvalidArgumentError(f"scale {scale!r} is not finite")
    rows = q.shape[0] if q.ndim else 1
    flat = q.reshape(rows, -1) if q.ndim else q.reshape(1, 1)
    for r0 in range(0, rows, _MASK_CHUNK_ROWS):
        chunk = flat[r0 : r0 + _MASK_CHUNK_ROWS]
        with np.errstate(over="ignore", invalid="ignore"):
            bad = ~np.isfinite((s * chunk.astype(np.float32)).astype(np.float16))
        if bad.any():
            i = np.unravel_index(int(np.argmax(bad.ravel())) + r0 * flat.shape[1], q.shape)
            raise InvalidArgumentError(
                f"q[{', '.join(str(int(x)) for x in i)}] = {float(q[i])!r} times scale {scale!r} is not finite in half "
                f"(|scale * q| must stay below 65520 and q must be finite)"
            )


def _check_finite(name: str, a: np.ndarray, allow_neg_inf: bool = False) -> None:
    """Raise ``InvalidArgumentError`` naming the first NaN or infinite element of ``a``
    (``-inf`` allowed where ``allow_neg_inf``)."""
    bad = np.isnan(a) | (np.isposinf(a)) | (np.isneginf(a) & (not allow_neg_inf))
    if bad.any():
        i = np.unravel_index(int(np.argmax(bad.ravel())), a.shape)
        raise InvalidArgumentError(f"{name}[{', '.join(str(int(x)) for x in i)}] = {float(a[i])!r} is not finite")


def flash_attn_prefill_blk(mask: Any, bq: int, bk: int = CACHE_ROWS_PER_STEP, *, device: Optional[Device] = None) -> np.ndarray:
    """The tile-skip table of an F16 mask ``[rows, kv_pad]`` (``kv_pad`` a multiple of
    ``bk``): uint8 ``[ceil(rows/bq), kv_pad/bk]``, 0 = every value -inf (or <= -65504),
    2 = every value zero, 1 = anything else. Computed by the library's kernel."""
    dev = device or default_device()
    m = _as_numpy(mask)
    if m.ndim != 2:
        raise InvalidArgumentError(f"mask must be 2-D [rows, kv_pad], got shape {m.shape}")
    if m.dtype != np.float16:
        raise UnsupportedDtypeError(f"mask must be float16, got {m.dtype.name}")
    rows, kvp = m.shape
    if bq <= 0 or bk <= 0:
        raise InvalidArgumentError(f"bq and bk must be positive, got {bq} and {bk}")
    blk = np.empty((-(-rows // bq), kvp // bk), dtype=np.uint8)
    mbuf = dev.buffer(np.ascontiguousarray(m))
    bbuf = dev.buffer(blk) if dev.backend == "cpu" else dev.empty(blk.shape, np.uint8)
    with dev.encoder() as enc:
        dispatch_flash_attn_prefill_blk(enc, mbuf, bbuf, rows=rows, kv_pad=kvp, bq=bq, bk=bk)
    return blk if dev.backend == "cpu" else bbuf.numpy()


def flash_attn_prefill(
    q: Any,
    k: Any,
    v: Any,
    mask: Any = None,
    *,
    causal: bool = False,
    window: Optional[int] = None,
    scale: float = 1.0,
    device: Optional[Device] = None,
    check_finite: bool = False,
) -> Any:
    """Prefill attention, SPEC section 2, on arrays.

    - ``q``: float32 ``[rows, n_heads, head_dim]``, ``head_dim`` 256 or 512;
    - ``k``, ``v``: float16 ``[kv_len, n_kv_heads, head_dim]``, ``n_heads`` a multiple of
      ``n_kv_heads`` (query head ``h`` reads KV head ``h // (n_heads // n_kv_heads)``);
    - ``mask``: ``None``, an additive float mask ``[rows, kv_len]`` (rounded to float16),
      or a boolean one (True = may attend);
    - ``causal``: also hide cache rows after each query row (the prompt is the last
      ``rows`` rows of the cache); ``window=w`` keeps only the last ``w`` of them and
      implies ``causal``;
    - ``scale``: folded into Q before Q is rounded to half;
    - ``check_finite``: first raise ``InvalidArgumentError`` if ``half(scale * q)``, ``k``
      or ``v`` holds a NaN or an infinity, or the mask a NaN or +inf (costs a pass over the
      inputs; without it such a value gives NaN/inf in the output rows it reaches, see
      ``docs/reliability.md``).

    Any strides are accepted: views whose last axis is contiguous are used in place, others
    are copied. Returns float32 ``[rows, n_heads, head_dim]``; a row that may attend to
    nothing is zeros.

    ``q``, ``k``, ``v`` may be CUDA arrays (PyTorch tensors, CuPy arrays): they are used in
    place on the CUDA device they live on (or ``device``), and the result is a new array
    of ``q``'s library on that device (torch in, torch out; numpy in, numpy out). The
    call waits for the arrays' producer stream (PyTorch's current stream) before it
    starts and for its own work before it returns."""
    plan = PrefillPlan(
        q, k, v, mask, causal=causal, window=window, scale=scale, device=device, check_finite=check_finite
    )
    return plan.run()


class PrefillPlan:
    """One prefill's buffers on a device, built once and runnable many times (what
    ``flash_attn_prefill`` does in one go; benchmarks time ``run`` alone).

    ``visible_pairs`` counts the (query row, cache row) pairs the mask leaves visible, the
    useful work of SPEC section 5."""

    def __init__(
        self,
        q: Any,
        k: Any,
        v: Any,
        mask: Any = None,
        *,
        causal: bool = False,
        window: Optional[int] = None,
        scale: float = 1.0,
        device: Optional[Device] = None,
        check_finite: bool = False,
    ):
        ops = [Operand.of(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"))]
        on_gpu = [o.on_cuda for o in ops]
        if any(on_gpu):
            first = ops[on_gpu.index(True)]
            dev = device or _cuda_device(first.device_index)
            if dev.backend != "cuda":
                raise InvalidArgumentError(f"CUDA arrays need a CUDA device, got {dev!r}")
        else:
            dev = device or default_device()
        self.device = dev
        qo, ko, vo = ops
        _expect(qo, "q", np.float32)
        _expect(ko, "k", np.float16)
        _expect(vo, "v", np.float16)
        rows, n_heads, head_dim = qo.shape
        kv_len, n_kv_heads, k_dim = ko.shape
        if vo.shape != ko.shape:
            raise InvalidArgumentError(f"v has shape {vo.shape}, k has {ko.shape}: they must match")
        if k_dim != head_dim:
            raise InvalidArgumentError(f"q has head_dim {head_dim}, k and v have {k_dim}")
        if n_kv_heads == 0 or n_heads % n_kv_heads:
            raise InvalidArgumentError(f"n_heads {n_heads} is not a multiple of n_kv_heads {n_kv_heads}")
        bq = queries_per_threadgroup(head_dim)  # raises for a head dim other than 256/512
        if window is not None:
            causal = True
        if check_finite:
            check_q_fits_half(qo.to_host(), scale)
            _check_finite("k", ko.to_host())
            _check_finite("v", vo.to_host())
        # One run at a time: runs share the table and (on the CPU) the output array.
        self._lock = threading.Lock()
        self.shape = (rows, n_heads, head_dim)
        self.visible_pairs = 0
        self._empty = rows == 0 or kv_len == 0 or n_heads == 0
        # Output in q's library when q is a CUDA array; the CUDA arrays used in place.
        self._like = qo if on_gpu[0] else None
        self._cuda_arrays = []
        if self._empty:
            return
        kvp = kv_pad(kv_len)
        full_mask = _build_mask(mask, rows, kv_len, kvp, causal, window)
        if check_finite:
            _check_finite("mask", full_mask, allow_neg_inf=True)
        self.visible_pairs = int(np.count_nonzero(full_mask > np.float16(-65504)))
        k_arr, v_arr = _pad_cache(ko, kvp), _pad_cache(vo, kvp)
        qb, q_rs, q_hs = self._operand(dev, qo, multiple=4)
        kb, k_rs, k_hs = self._operand(dev, k_arr)
        vb, v_rs, v_hs = self._operand(dev, v_arr)
        self._on_host = dev.backend == "cpu"
        blk_shape = (-(-rows // bq), kvp // CACHE_ROWS_PER_STEP)
        if self._like is not None:
            out = self._like.new_empty(self.shape, np.float32)
            self._out = out.obj
            ob = dev.wrap(out)
            self._cuda_arrays.append(out)
            blkb = dev.empty(blk_shape, np.uint8)
        elif self._on_host:
            self._out = np.empty(self.shape, dtype=np.float32)
            ob = dev.buffer(self._out)
            blkb = dev.buffer(np.empty(blk_shape, dtype=np.uint8))
        else:
            ob = dev.empty(self.shape, np.float32)
            blkb = dev.empty(blk_shape, np.uint8)
        self._buffers = dict(q=qb, k=kb, v=vb, mask=dev.buffer(full_mask), blk=blkb, out=ob)
        self._blk_args = dict(rows=rows, kv_pad=kvp, bq=bq, bk=CACHE_ROWS_PER_STEP)
        self.params = FlashAttnPrefillTensorParams(
            rows=rows,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            kv_pad=kvp,
            q_row_stride=q_rs,
            q_head_stride=q_hs,
            k_row_stride=k_rs,
            k_head_stride=k_hs,
            v_row_stride=v_rs,
            v_head_stride=v_hs,
            scale=float(scale),
        )

    def encode(self, encoder, *, classify: bool = True) -> None:
        """Record this prefill's dispatches on ``encoder`` (an encoder of the plan's
        device) without running them: the mask classification (unless ``classify`` is
        False and an earlier run left the table in place) and the attention. Benchmarks
        record many and commit once."""
        if self._empty:
            return
        b = self._buffers
        if classify:
            dispatch_flash_attn_prefill_blk(encoder, b["mask"], b["blk"], **self._blk_args)
        dispatch_flash_attn_prefill_tensor_f16(
            encoder, b["q"], b["k"], b["v"], b["mask"], b["blk"], b["out"], self.params
        )

    def _operand(self, dev: Device, op: Operand, multiple: int = 1):
        if not op.on_cuda:
            return _strided_buffer(dev, op.host_array(), multiple)
        s0, s1, s2 = op.strides
        if s2 != 1 or s0 % multiple or s1 % multiple:
            op = op.made_contiguous()
            s0, s1, s2 = op.strides
        self._cuda_arrays.append(op)
        return dev.wrap(op, span=True), s0, s1

    def run(self):
        """Classify the mask, run the attention, and return the output (a new array on
        every call for device backends; the same host array, overwritten, on the CPU; the
        same CUDA array, overwritten, when q is one)."""
        if self._empty:
            if self._like is not None:
                return self._like.new_zeros(self.shape, np.float32).obj
            return np.zeros(self.shape, dtype=np.float32)
        b = self._buffers
        with self._lock:
            for s in dict.fromkeys(x.producer_stream() for x in self._cuda_arrays):
                if s is not None:
                    self.device.wait_stream(s)
            with self.device.encoder() as enc:
                self.encode(enc)
            if self._like is not None or self._on_host:
                return self._out
            return b["out"].numpy()


def _expect(op: Operand, name: str, dtype) -> None:
    if op.dtype != dtype:
        raise UnsupportedDtypeError(f"{name} must be {np.dtype(dtype).name}, got {op.dtype.name}")
    if op.ndim != 3:
        raise InvalidArgumentError(f"{name} must be 3-D [rows, heads, head_dim], got shape {op.shape}")


_cuda_devices: dict = {}


def _cuda_device(index: int) -> Device:
    """``Device("cuda:index")``, opened once per process."""
    with _default_lock:
        if index not in _cuda_devices:
            _cuda_devices[index] = Device(f"cuda:{index}")
        return _cuda_devices[index]


def _nonneg(x, name: str) -> int:
    if int(x) != x or x < 0:
        raise InvalidArgumentError(f"{name} must be a non-negative integer, got {x!r}")
    return int(x)


def _build_mask(mask, rows: int, kv_len: int, kvp: int, causal: bool, window) -> np.ndarray:
    """F16 ``[rows, kv_pad]``: the user's mask (or zeros), -inf where causality or the
    window hides a cache row, -inf in the padding columns."""
    full = np.full((rows, kvp), -np.inf, dtype=np.float16)
    if mask is None:
        full[:, :kv_len] = 0
    else:
        m = Operand.of(mask, "mask").to_host()
        if m.shape != (rows, kv_len):
            raise InvalidArgumentError(f"mask must have shape {(rows, kv_len)}, got {m.shape}")
        if m.dtype == np.bool_:
            full[:, :kv_len] = np.where(m, 0, -np.inf).astype(np.float16)
        elif np.issubdtype(m.dtype, np.floating) or m.dtype.name == "bfloat16":
            full[:, :kv_len] = m.astype(np.float16)
        else:
            raise UnsupportedDtypeError(f"mask must be floating point or bool, got {m.dtype.name}")
    if causal:
        for r0 in range(0, rows, _MASK_CHUNK_ROWS):
            r1 = min(rows, r0 + _MASK_CHUNK_ROWS)
            hidden = ~_visible(r0, r1, rows, kv_len, window)
            full[r0:r1, :kv_len][hidden] = -np.inf
    return full


def _pad_cache(op: Operand, kvp: int) -> Operand:
    """The cache with ``kvp`` rows: the operand itself when it has them, else a zero-padded
    copy (padding rows must be finite; their mask columns are -inf)."""
    if op.shape[0] == kvp:
        return op
    padded = op.new_zeros((kvp,) + op.shape[1:], op.dtype)
    padded.obj[: op.shape[0]] = op.obj if op.library != "numpy" else op.host_array()
    return padded


def _strided_buffer(dev: Device, x: np.ndarray, multiple: int = 1):
    """A buffer over the memory span of the 3-D view ``x`` and its (row, head) strides in
    elements; a contiguous copy when the view cannot be used in place."""
    item = x.itemsize
    s0, s1, s2 = x.strides
    usable = (
        dev.backend == "cpu"
        and s2 == item
        and s0 >= 0
        and s1 >= 0
        and s0 % (item * multiple) == 0
        and s1 % (item * multiple) == 0
        and x.flags.aligned
    )
    if usable:
        n = (x.shape[0] - 1) * (s0 // item) + (x.shape[1] - 1) * (s1 // item) + x.shape[2]
        flat = np.lib.stride_tricks.as_strided(x, shape=(n,), strides=(item,), writeable=False)
        return dev.buffer(flat), s0 // item, s1 // item
    c = np.ascontiguousarray(x)
    return dev.buffer(c), c.shape[1] * c.shape[2], c.shape[2]
