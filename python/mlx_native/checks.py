"""Argument checks of the high-level API: each returns the argument in its normal form or
raises a typed error (an :class:`~mlx_native.MlxError` that is also a ``ValueError`` or a
``TypeError``) that says what to pass instead. Nothing here touches an array's data but
:func:`check_q_fits_half` and :func:`check_inputs_finite`, which are asked for."""

from __future__ import annotations

import math
import numbers
import re
from typing import Any, Optional, Tuple, Union

import numpy as np

from .arrays import Operand
from .device import Device
from .dtypes import dtype_name
from .errors import ArgumentTypeError, InvalidArgumentError, InvalidHandleError, UnsupportedDtypeError
from .scalars import is_integer

#: Output dtypes the kernels write.
OUT_DTYPES = ("float32", "float16", "bfloat16")

_DEVICE_NAME = re.compile(r"^(auto|cpu|metal|cuda(:\d+)?)$")

#: Rows of a host array checked at a time (bounds the temporary memory of huge inputs).
_CHUNK_ROWS = 1024


def check_bool(x: Any, name: str) -> bool:
    """``x`` as a bool: True or False (numpy's too), nothing else."""
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    raise ArgumentTypeError(f"{name} must be True or False, got {x!r} ({type(x).__name__})")


def check_run_options(kv_splits: Any, cta_pairs: Any, cuda_form: Any, cpu_isa: Any) -> tuple:
    """The run options (``kv_splits``, ``cta_pairs``, ``cuda_form``, ``cpu_isa``) of their
    types: ``None`` each (the library's choice), an integer of ``kv_splits``, names of the
    others. Their values are checked where a plan is made (the library knows its forms and
    this CPU's instruction sets), each refusal an ``InvalidArgumentError`` naming the option
    and what it takes."""
    if kv_splits is not None:
        if not is_integer(kv_splits):
            raise ArgumentTypeError(
                f"kv_splits must be an integer (0 or 1: never split; 2, 4, 8 or 16 parts) or None, got {kv_splits!r} "
                f"({type(kv_splits).__name__})"
            )
        kv_splits = int(kv_splits)
    for name, x in (("cta_pairs", cta_pairs), ("cuda_form", cuda_form), ("cpu_isa", cpu_isa)):
        if x is not None and not isinstance(x, str):
            raise ArgumentTypeError(f"{name} must be a name (a str) or None, got {x!r} ({type(x).__name__})")
    return kv_splits, cta_pairs, cuda_form, cpu_isa


def check_window(window: Any, name: str = "window") -> Optional[int]:
    """``None`` or an integer >= 1 (a window of ``w`` cache rows, SPEC 6). A bool, a float
    (even 2.0) or a string is an ``ArgumentTypeError``; 0 or a negative integer an
    ``InvalidArgumentError``."""
    if window is None:
        return None
    if not is_integer(window):
        raise ArgumentTypeError(
            f"{name} must be an integer >= 1 (the number of cache rows each query row sees) or None, "
            f"got {window!r} ({type(window).__name__})"
        )
    w = int(window)
    if w < 1:
        raise InvalidArgumentError(
            f"{name} must be at least 1, got {w}: a window of w lets query row r see cache rows r-w+1..r; "
            f"pass window=None for a plain causal mask"
        )
    if w > 2**31 - 1:
        raise InvalidArgumentError(f"{name} {w} exceeds 2^31 - 1; pass window=None for a plain causal mask")
    return w


#: The tensor layouts of q, k, v and the output (``layout=``): ``"NHD"`` is ``[..., seq,
#: heads, head_dim]`` (FlashAttention's, the default), ``"HND"`` ``[..., heads, seq,
#: head_dim]`` (PyTorch SDPA's and transformers'). Written here once; the front door, the
#: plan and the torch operators take it.
TENSOR_LAYOUTS = ("NHD", "HND")


def check_tensor_layout(layout: Any) -> str:
    """``"NHD"`` or ``"HND"`` (:data:`TENSOR_LAYOUTS`)."""
    if isinstance(layout, str) and layout in TENSOR_LAYOUTS:
        return layout
    what = (
        'pass "NHD" for [batch, seq, heads, head_dim] (FlashAttention\'s layout, the default) or "HND" for '
        "[batch, heads, seq, head_dim] (PyTorch SDPA's)"
    )
    if not isinstance(layout, str):
        raise ArgumentTypeError(f"layout must be a string, got {layout!r} ({type(layout).__name__}): {what}")
    raise InvalidArgumentError(f"layout {layout!r} is not a tensor layout: {what}")


def check_window_sides(window: Any, causal: bool) -> Tuple[bool, Union[None, int, Tuple[int, int]]]:
    """``(causal, window)`` in their normal form from ``window``: None, an integer ``w >= 1``
    (a causal window: ``(w - 1, 0)`` in FlashAttention's terms; it implies causal) or a pair
    ``(left, right)`` of integers >= -1 (FlashAttention's ``window_size``: query row r at
    cache position p sees ``p - left <= j <= p + right``, -1 unbounded on that side; with
    ``causal`` the right side is capped at 0). A pair that a causal description or none
    already says becomes that: ``(-1, -1)`` is no window, ``(left, r)`` under causal is the
    integer ``left + 1`` (``(-1, r)``: plain causal). What stays a pair is a window without
    causal with at least one side bounded."""
    if not isinstance(window, (tuple, list)):
        w = check_window(window)
        return (causal or w is not None), w
    if len(window) != 2:
        raise InvalidArgumentError(
            f"window as a pair is (left, right), FlashAttention's window_size (-1: unbounded on that side), got "
            f"{len(window)} values {tuple(window)!r}"
        )
    sides = []
    for side, x in zip(("left", "right"), window):
        if not is_integer(x):
            raise ArgumentTypeError(
                f"window's {side} side must be an integer >= -1 (-1: unbounded), got {x!r} ({type(x).__name__})"
            )
        x = int(x)
        if x < -1:
            raise InvalidArgumentError(
                f"window's {side} side must be >= -1 (-1: unbounded; 0: only the query's own position on that side), "
                f"got {x}"
            )
        if x > 2**31 - 2:
            raise InvalidArgumentError(f"window's {side} side {x} exceeds 2^31 - 2; pass -1 for unbounded")
        sides.append(x)
    left, right = sides
    if causal:
        return True, (None if left < 0 else left + 1)
    if left < 0 and right < 0:
        return False, None
    return False, (left, right)


def check_offset(offset: Any, causal: bool) -> Optional[int]:
    """``None`` (the prompt is the end of its cache: ``offset = kv_len - rows``, SPEC 6) or
    an integer in int32 placing query row ``r`` at position ``r + offset`` of the cache, any
    sign (negative: the queries start before the cache; past ``kv_len``: after it). It places
    the queries for a described mask only, so it needs ``causal`` (or ``window``)."""
    if offset is None:
        return None
    if not is_integer(offset):
        raise ArgumentTypeError(
            f"offset must be an integer (query row r sits at cache position r + offset) or None, "
            f"got {offset!r} ({type(offset).__name__})"
        )
    off = int(offset)
    if not -(2**31) <= off <= 2**31 - 1:
        raise InvalidArgumentError(f"offset {off} does not fit in int32")
    if not causal:
        raise InvalidArgumentError(
            f"offset {off} places the queries for a described mask: pass causal=True or a window with it "
            f"(without a mask every query row sees the whole cache, wherever it sits)"
        )
    return off


#: The smallest positive normal float32: a parameter the kernels compare with 0 must not be
#: a subnormal, which a GPU flushes to 0 ("off").
_F32_MIN_NORMAL = float(np.finfo(np.float32).tiny)


def check_real_f32(x: Any, name: str, what: str, kind: str = "a finite number", type_kind: str = "a real number") -> float:
    """``x`` as a float that is finite in float32, the kernels' precision (an integer too
    large for a float, a value that overflows float32, NaN and inf are refused); a non-zero
    value that float32 would flush to zero or to a subnormal is refused too, since it would
    silently mean 0 to the kernel. ``kind`` and ``type_kind`` say in the messages what is
    taken."""
    if type(x) is float and x == 0.0:
        return x  # 0.0, "off" for softcap and max_bias (their default): no float32 round trip to make
    if not isinstance(x, numbers.Real) or isinstance(x, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name} must be {type_kind} ({what}), got {x!r} ({type(x).__name__})")
    try:
        v = float(x)
    except OverflowError:
        raise InvalidArgumentError(f"{name} must be {kind} (in float32), got {x!r}, beyond any float ({what})") from None
    with np.errstate(over="ignore"):
        in_f32 = float(np.float32(v)) if math.isfinite(v) else v
    if not math.isfinite(in_f32):
        raise InvalidArgumentError(f"{name} must be {kind} (in float32), got {x!r} ({what})")
    if v != 0 and abs(in_f32) < _F32_MIN_NORMAL:
        raise InvalidArgumentError(
            f"{name} {x!r} is too small for float32, the kernels' precision: it would become 0 (or a subnormal the "
            f"GPU flushes to 0); pass 0 for none or a magnitude of at least {_F32_MIN_NORMAL:.4g} ({what})"
        )
    return v


def check_scale(scale: Any) -> Optional[float]:
    """``None`` (1/sqrt(head_dim), decided where the head dim is known) or a real number that
    is finite in float32 (and not a non-zero value float32 flushes to 0)."""
    if scale is None:
        return None
    return check_real_f32(scale, "scale", "folded into Q; None for 1/sqrt(head_dim)", type_kind="a real number or None")


def check_softcap(softcap: Any) -> float:
    """SPEC 10's softcap: a finite real number >= 0 (0: none; Gemma 2 uses 50 and 30)."""
    return _non_negative(softcap, "softcap", "s = softcap * tanh(s / softcap) on every score; 0 for none")


#: The largest ``max_bias``: the smallest ALiBi slope, ``2^-max_bias``, stays a normal
#: float32 (at 0, a masked entry's ``0 * -inf`` would be NaN). The op checks the same.
MAX_BIAS_LIMIT = 126.0


def check_max_bias(max_bias: Any) -> float:
    """SPEC 10's ALiBi ``max_bias``: a finite real number from 0 to 126 (0: no ALiBi; 8 for
    the models trained with it)."""
    v = _non_negative(max_bias, "max_bias", "ALiBi's slopes are 2^(-max_bias * ...) per head; 0 for none")
    if v > MAX_BIAS_LIMIT:
        raise InvalidArgumentError(
            f"max_bias {max_bias!r} is above {MAX_BIAS_LIMIT:g}: the smallest ALiBi slope, 2^-max_bias, would "
            f"underflow float32 (models use 8)"
        )
    return v


def _non_negative(x: Any, name: str, what: str) -> float:
    v = check_real_f32(x, name, what, kind="a finite number >= 0", type_kind="a real number >= 0")
    if v < 0:
        raise InvalidArgumentError(f"{name} must be a finite number >= 0 (in float32), got {x!r} ({what})")
    return v


def check_sinks(op: Operand, n_heads: int) -> Operand:
    """SPEC 10's attention sinks: one float32 logit per query head, ``[n_heads]``."""
    if op.dtype != np.float32:
        raise UnsupportedDtypeError(
            f"sinks must be float32 (one logit per query head), got {op.dtype.name}: convert with .astype(float32) "
            f"or .float()"
        )
    if op.shape != (n_heads,):
        raise InvalidArgumentError(
            f"sinks must have shape ({n_heads},), one logit per query head, got {op.shape}"
        )
    return op


def check_alibi_slopes(op: Operand, n_heads: int, batch: int, max_bias: float, values: bool = True) -> Operand:
    """flash-attn's ALiBi slopes: float32 ``[n_heads]`` or ``[batch, n_heads]`` (``batch``
    the sequences: B fixed length, the ``cu_seqlens``' B variable length), finite (checked
    on the host for host arrays and, where ``values``, on the device for device arrays, a
    synchronisation), and not beside ``max_bias``."""
    if max_bias > 0:
        raise InvalidArgumentError(
            "alibi_slopes and max_bias are two ways to give ALiBi's slopes: pass one (max_bias=0 with alibi_slopes, "
            "or alibi_slopes=None with max_bias)"
        )
    if op.dtype != np.float32:
        raise UnsupportedDtypeError(
            f"alibi_slopes must be float32 (one slope per query head), got {op.dtype.name}: convert with "
            f".astype(float32) or .float()"
        )
    if op.shape not in ((n_heads,), (batch, n_heads)):
        raise InvalidArgumentError(
            f"alibi_slopes must have shape ({n_heads},) or ({batch}, {n_heads}) (one slope per query head, or per "
            f"sequence and head), got {op.shape}"
        )
    if values and op.size:
        if op.library == "torch":
            import torch

            bad = not bool(torch.isfinite(op.obj).all())
        else:
            bad = not bool(np.isfinite(np.asarray(op.to_host())).all())
        if bad:
            raise InvalidArgumentError(
                "alibi_slopes holds a NaN or an infinity: each slope must be a finite float32 (the score gains "
                "-slope * |p - j|)"
            )
    return op


def check_out_dtype(out_dtype: Any, q_dtype: Any) -> str:
    """The output dtype's name: ``q``'s dtype for ``None``; float32, float16 or bfloat16."""
    name = dtype_name(q_dtype if out_dtype is None else out_dtype)
    if name not in OUT_DTYPES:
        raise UnsupportedDtypeError(f"out_dtype must be one of {', '.join(OUT_DTYPES)} (or None: q's dtype), got {name}")
    return name


def check_device(device: Any) -> Union[None, str, Any]:
    """``None``, a device name (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"metal"``,
    ``"auto"``) or a :class:`~mlx_native.Device` (which must be open)."""
    if device is None:
        return None
    if isinstance(device, Device):
        if device.closed:
            raise InvalidHandleError(f"device handle {device.handle} is closed")
        return device
    if isinstance(device, str):
        if not _DEVICE_NAME.match(device):
            raise InvalidArgumentError(
                f"device {device!r} is not a device name: pass 'cpu', 'cuda', 'cuda:N', 'metal', 'auto', "
                f"a mlx_native.Device, or None (the arrays' own device)"
            )
        return device
    raise ArgumentTypeError(
        f"device must be a name such as 'cpu' or 'cuda:0', a mlx_native.Device or None, got {type(device).__name__}"
    )


def check_cu_seqlens(cu_q: Any, cu_k: Any, total_q: int, total_k: int, causal: bool) -> Tuple[np.ndarray, np.ndarray]:
    """SPEC 7's ``cu_seqlens_q`` and ``cu_seqlens_k`` as host int32 arrays: 1-D integer
    arrays (int32 or int64; numpy, torch CPU/CUDA, CuPy) of ``B + 1`` entries each,
    starting at 0, non-decreasing, ending at the totals; with ``causal`` (pass False when an
    explicit offset places the queries) no sequence's cache shorter than its prompt. A CUDA
    array is copied to the host (a synchronisation)."""
    if (cu_q is None) != (cu_k is None):
        raise InvalidArgumentError("cu_seqlens_q and cu_seqlens_k go together: pass both (variable length) or neither")
    vals = []
    for name, cu, total in (("cu_seqlens_q", cu_q, total_q), ("cu_seqlens_k", cu_k, total_k)):
        op = Operand.of(cu, name)
        if op.dtype.kind not in "iu":
            raise UnsupportedDtypeError(f"{name} must hold integers (int32 or int64), got {op.dtype.name}")
        if op.ndim != 1 or op.shape[0] < 1:
            raise InvalidArgumentError(f"{name} must be 1-D with B + 1 entries (B sequences), got shape {op.shape}")
        a = np.asarray(op.to_host()).astype(np.int64)
        if a[0] != 0:
            raise InvalidArgumentError(f"{name}[0] is {a[0]}, it must be 0 (FlashAttention's convention: offsets of each sequence)")
        down = np.flatnonzero(np.diff(a) < 0)
        if down.size:
            i = int(down[0]) + 1
            raise InvalidArgumentError(f"{name} decreases at entry {i}: {a[i - 1]} then {a[i]}; offsets must be non-decreasing")
        if a[-1] != total:
            raise InvalidArgumentError(f"{name} ends at {a[-1]}, not at the {total} rows its tensor has")
        if total > 2**31 - 1:
            raise InvalidArgumentError(f"{name}: {total} rows exceed int32")
        vals.append(a)
    cq, ck = vals
    if len(cq) != len(ck):
        raise InvalidArgumentError(
            f"cu_seqlens_q has {len(cq)} entries and cu_seqlens_k {len(ck)}: both must have B + 1 (one per sequence, plus one)"
        )
    if causal:
        lq, lk = np.diff(cq), np.diff(ck)
        short = np.flatnonzero(lk < lq)
        if short.size:
            b = int(short[0])
            raise InvalidArgumentError(
                f"sequence {b} has {lq[b]} query rows but {lk[b]} cache rows: with causal (or window) each prompt is "
                f"the end of its cache, which cannot be shorter"
            )
    return cq.astype(np.int32), ck.astype(np.int32)


def default_scale(head_dim: int) -> float:
    """SPEC 9: ``1 / sqrt(head_dim)``, as in every peer."""
    return 1.0 / math.sqrt(head_dim) if head_dim else 1.0


def check_q_fits_half(q: Any, scale: Optional[float] = None) -> None:
    """Raise ``InvalidArgumentError`` if ``half(scale * q)`` is not finite somewhere
    (``scale`` None: 1/sqrt(head_dim)).

    The kernel folds ``scale`` into Q and rounds Q to float16 (SPEC section 2, step 1): a
    value with ``|scale * q| >= 65520`` becomes +-inf in half, and a NaN stays NaN; either
    makes that (row, head) of the output NaN or inf. This finds the first such element. A
    torch tensor is checked on its own device."""
    op = Operand.of(q, "q")
    s = check_scale(scale)
    if s is None:
        s = default_scale(op.shape[-1] if op.ndim else 1)
    if op.library == "torch":
        import torch

        t = op.obj
        bad = ~torch.isfinite((t.float() * np.float32(s)).half())
        if bool(bad.any()):
            i = np.unravel_index(int(torch.argmax(bad.flatten().to(torch.uint8))), tuple(t.shape))
            _q_error(i, float(t[i]), scale if scale is not None else s)
        return
    a = op.to_host()
    f = np.float32(s)
    rows = a.shape[0] if a.ndim else 1
    flat = a.reshape(rows, -1) if a.ndim else a.reshape(1, 1)
    for r0 in range(0, rows, _CHUNK_ROWS):
        chunk = flat[r0 : r0 + _CHUNK_ROWS]
        with np.errstate(over="ignore", invalid="ignore"):
            bad = ~np.isfinite((f * chunk.astype(np.float32)).astype(np.float16))
        if bad.any():
            i = np.unravel_index(int(np.argmax(bad.ravel())) + r0 * flat.shape[1], a.shape)
            _q_error(i, float(a[i]), scale if scale is not None else s)


def _q_error(i, value, scale) -> None:
    raise InvalidArgumentError(
        f"q[{', '.join(str(int(x)) for x in i)}] = {value!r} times scale {scale!r} is not finite in half "
        f"(|scale * q| must stay below 65520 and q must be finite)"
    )


def check_finite(name: str, x: Any, allow_neg_inf: bool = False) -> None:
    """Raise ``InvalidArgumentError`` naming the first NaN or infinite element of ``x``
    (``-inf`` allowed where ``allow_neg_inf``: a mask's masked entries), on ``x``'s own
    device for a torch tensor."""
    op = Operand.of(x, name)
    if op.size == 0:
        return
    if op.library == "torch":
        import torch

        t = op.obj
        if t.dtype == torch.bool:
            return
        bad = torch.isnan(t) | torch.isposinf(t) if allow_neg_inf else ~torch.isfinite(t)
        if bool(bad.any()):
            i = np.unravel_index(int(torch.argmax(bad.flatten().to(torch.uint8))), tuple(t.shape))
            raise InvalidArgumentError(f"{name}[{', '.join(str(int(j)) for j in i)}] = {float(t[i])!r} is not finite")
        return
    a = op.to_host()
    if a.dtype == np.bool_:
        return
    bad = np.isnan(a) | np.isposinf(a) | (np.isneginf(a) & (not allow_neg_inf))
    if bad.any():
        i = np.unravel_index(int(np.argmax(bad.ravel())), a.shape)
        raise InvalidArgumentError(f"{name}[{', '.join(str(int(j)) for j in i)}] = {float(a[i])!r} is not finite")


def check_inputs_finite(q: Any, k: Any, v: Any, mask: Any, sinks: Any, scale: Optional[float]) -> None:
    """``check_finite``: raise unless ``half(scale * q)``, ``k`` and ``v`` (the arrays the
    kernels read) are finite and the mask (as the caller gave it: its -inf means "masked")
    and the sinks hold no NaN or +inf; ``mask`` and ``sinks`` may be None."""
    check_q_fits_half(q, scale)
    if k is not None:
        check_finite("k", k)
    if v is not None:
        check_finite("v", v)
    if mask is not None:
        check_finite("mask", mask, allow_neg_inf=True)
    if sinks is not None:
        check_finite("sinks", sinks, allow_neg_inf=True)
