"""The ops, mirroring the Rust names: constants, params, validation-free wrappers (the
library validates and raises), and availability."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ._lib import check, ffi, lib
from .device import Buffer, Device, Encoder
from .checks import check_real_f32
from .errors import InvalidArgumentError
from .scalars import U32_MAX, check_int

#: Cache rows per step (the kernel's ``C``, the blk ``bk``).
CACHE_ROWS_PER_STEP: int = int(lib.mlxn_cache_rows_per_step())

#: Kernel entry points.
K_TENSOR_F16_D256 = "flash_attn_prefill_tensor_f16_d256"
K_TENSOR_F16_D512 = "flash_attn_prefill_tensor_f16_d512"


@dataclass
class FlashAttnPrefillTensorParams:
    """Shapes and strides of one dispatch. Strides are in elements."""

    rows: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    #: Cache rows the kernel walks; a multiple of ``CACHE_ROWS_PER_STEP``.
    kv_pad: int
    q_row_stride: int
    q_head_stride: int
    k_row_stride: int
    k_head_stride: int
    v_row_stride: int
    v_head_stride: int
    #: Pre-softmax scale folded into Q (1.0 for Gemma 4).
    scale: float = 1.0

    def _to_c(self):
        c = ffi.new("MlxnFlashAttnPrefillTensorParams *")
        for name, value in asdict(self).items():
            if name == "scale":
                c.scale = check_real_f32(value, "scale", "the pre-softmax scale folded into Q")
                continue
            setattr(c, name, check_int(value, f"flash_attn_prefill_tensor: {name}", 0, U32_MAX, "does not fit in 32 unsigned bits"))
        return c


def queries_per_threadgroup(head_dim: int) -> int:
    """Queries per threadgroup (the kernel's ``Q``, the blk ``bq``): 32 at 256, 16 at 512."""
    out = ffi.new("uint32_t *")
    check(lib.mlxn_queries_per_threadgroup(_u32(head_dim, "head_dim"), out))
    return int(out[0])


def kv_pad(kv_len: int) -> int:
    """``kv_len`` rounded up to a multiple of ``CACHE_ROWS_PER_STEP``."""
    out = ffi.new("uint32_t *")
    check(lib.mlxn_kv_pad(_u32(kv_len, "kv_len"), out))
    return int(out[0])


def threadgroup_memory_bytes(head_dim: int) -> int:
    """Threadgroup memory of one dispatch of the Metal kernel (28816 at 256, 22608 at 512)."""
    out = ffi.new("uint64_t *")
    check(lib.mlxn_threadgroup_memory_bytes(_u32(head_dim, "head_dim"), out))
    return int(out[0])


def flash_attn_prefill_tensor_available(device: Device, head_dim: int) -> bool:
    """Whether the attention pipeline for ``head_dim`` builds on ``device``."""
    out = ffi.new("int32_t *")
    check(lib.mlxn_flash_attn_prefill_tensor_available(device.handle, _u32(head_dim, "head_dim"), out))
    return bool(out[0])


def dispatch_flash_attn_prefill_tensor_f16(
    encoder: Encoder,
    q: Buffer,
    k: Buffer,
    v: Buffer,
    mask: Buffer,
    blk: Buffer,
    out: Buffer,
    params: FlashAttnPrefillTensorParams,
) -> None:
    """Record one flash-attention dispatch (SPEC section 2). Raises before recording
    anything if the inputs break the contract; ``out`` is written on commit."""
    _check_buffers(q=q, k=k, v=v, mask=mask, blk=blk, out=out)
    if not out.writable:
        raise InvalidArgumentError("flash_attn_prefill_tensor: out wraps a read-only array")
    if not isinstance(params, FlashAttnPrefillTensorParams):
        raise InvalidArgumentError(
            f"params must be FlashAttnPrefillTensorParams, got {type(params).__name__}"
        )
    c = params._to_c()
    check(
        lib.mlxn_dispatch_flash_attn_prefill_tensor_f16(
            encoder.handle, q.handle, k.handle, v.handle, mask.handle, blk.handle, out.handle, c
        )
    )
    encoder._hold(q, k, v, mask, blk, out)


def dispatch_flash_attn_prefill_blk(
    encoder: Encoder, mask: Buffer, blk: Buffer, *, rows: int, kv_pad: int, bq: int, bk: int = 64
) -> None:
    """Record one classification of ``mask`` (F16 ``[rows, kv_pad]``) into ``blk`` (U8
    ``[ceil(rows/bq), kv_pad/bk]``): 0 skip, 1 add the mask, 2 all zero."""
    _check_buffers(mask=mask, blk=blk)
    if not blk.writable:
        raise InvalidArgumentError("flash_attn_prefill_blk: blk wraps a read-only array")
    check(
        lib.mlxn_dispatch_flash_attn_prefill_blk(
            encoder.handle,
            mask.handle,
            blk.handle,
            _u32(rows, "rows"),
            _u32(kv_pad, "kv_pad"),
            _u32(bq, "bq"),
            _u32(bk, "bk"),
        )
    )
    encoder._hold(mask, blk)


def _check_buffers(**buffers) -> None:
    for name, b in buffers.items():
        if not isinstance(b, Buffer):
            raise InvalidArgumentError(f"{name} must be a Buffer, got {type(b).__name__}")


def _u32(value, name: str) -> int:
    return check_int(value, name, 0, U32_MAX, "is not an integer in [0, 2^32)")
