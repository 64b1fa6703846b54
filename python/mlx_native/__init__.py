"""mlx-native: flash attention for LLM prefill in llama.cpp / hf2q layouts (F32 Q, F16 K/V
with explicit strides, grouped-query heads, an additive F16 mask shared by all heads, a
tile-skip table), on the CPU, CUDA and Metal, from a Rust core through a C ABI.

Quick start::

    import numpy as np, mlx_native as mx
    out = mx.flash_attn_prefill(q, k, v, causal=True)          # q f32, k/v f16

Lower level, mirroring the Rust op names::

    dev = mx.Device()                                          # auto: Metal, CUDA, CPU
    with dev.encoder() as enc:
        mx.dispatch_flash_attn_prefill_blk(enc, mask, blk, rows=..., kv_pad=..., bq=...)
        mx.dispatch_flash_attn_prefill_tensor_f16(enc, q, k, v, mask, blk, out, params)
"""

from .attention import PrefillPlan, causal_mask, default_device, flash_attn_prefill, flash_attn_prefill_blk
from .attention import check_q_fits_half
from .device import Buffer, Device, Encoder, backends, cpu_fma_peak, cpu_info, cuda_compile_check, force_cpu_isa, version
from .errors import (
    BackendUnavailableError,
    BufferAllocationError,
    CommandBufferError,
    DeviceNotFoundError,
    InternalError,
    InvalidArgumentError,
    InvalidHandleError,
    KernelNotFoundError,
    MlxError,
    ShaderCompilationError,
    UnsupportedDtypeError,
)
from .ops import (
    CACHE_ROWS_PER_STEP,
    K_TENSOR_F16_D256,
    K_TENSOR_F16_D512,
    FlashAttnPrefillTensorParams,
    dispatch_flash_attn_prefill_blk,
    dispatch_flash_attn_prefill_tensor_f16,
    flash_attn_prefill_tensor_available,
    kv_pad,
    queries_per_threadgroup,
    threadgroup_memory_bytes,
)

__version__ = version()

__all__ = [
    "BackendUnavailableError",
    "Buffer",
    "BufferAllocationError",
    "CACHE_ROWS_PER_STEP",
    "CommandBufferError",
    "Device",
    "DeviceNotFoundError",
    "Encoder",
    "FlashAttnPrefillTensorParams",
    "InternalError",
    "InvalidArgumentError",
    "InvalidHandleError",
    "K_TENSOR_F16_D256",
    "K_TENSOR_F16_D512",
    "KernelNotFoundError",
    "MlxError",
    "PrefillPlan",
    "ShaderCompilationError",
    "UnsupportedDtypeError",
    "backends",
    "causal_mask",
    "check_q_fits_half",
    "cpu_fma_peak",
    "cpu_info",
    "cuda_compile_check",
    "default_device",
    "dispatch_flash_attn_prefill_blk",
    "dispatch_flash_attn_prefill_tensor_f16",
    "flash_attn_prefill",
    "flash_attn_prefill_blk",
    "flash_attn_prefill_tensor_available",
    "force_cpu_isa",
    "kv_pad",
    "queries_per_threadgroup",
    "threadgroup_memory_bytes",
    "version",
]
