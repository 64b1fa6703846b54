"""mlx-native: flash attention for LLM prefill on the CPU, CUDA and Metal, from a Rust core
through a C ABI; numpy arrays and torch tensors (CPU and CUDA) in, the same out.

Quick start::

    import numpy as np
    import mlx_native as mn

    q = np.random.uniform(-1, 1, (2048, 16, 256)).astype(np.float32)  # [rows, heads, head_dim]
    k = np.random.uniform(-1, 1, (2048, 8, 256)).astype(np.float16)   # [kv_len, kv_heads, head_dim]
    v = np.random.uniform(-1, 1, (2048, 8, 256)).astype(np.float16)
    out = mn.flash_attn_prefill(q, k, v, causal=True, window=1024)    # float32 [2048, 16, 256]

    # Plan once on the layouts, run many times (on the caller's CUDA stream for tensors):
    plan = mn.PrefillPlan(q, k, v, causal=True, return_lse=True)
    out, lse = plan.run(q, k, v)

The high level: :func:`flash_attn_prefill`, :class:`PrefillPlan` (and :class:`ArraySpec`
to plan on layouts alone), :func:`merge_attention_states`, :func:`causal_mask`. The low
level mirrors the Rust op names (:mod:`mlx_native.ops`)::

    dev = mn.Device()                                          # auto: Metal, CUDA, CPU
    with dev.encoder() as enc:
        mn.dispatch_flash_attn_prefill_blk(enc, mask, blk, rows=..., kv_pad=..., bq=...)
        mn.dispatch_flash_attn_prefill_tensor_f16(enc, q, k, v, mask, blk, out, params)
"""

from .attention import clear_plan_cache
from .front_door import flash_attn_prefill
from .plan import ArraySpec, PrefillPlan
from .merge import merge_attention_states
from .masks import causal_mask, flash_attn_prefill_blk
from .checks import check_q_fits_half
from .device import (
    Buffer,
    Device,
    Encoder,
    backends,
    cpu_amx_peak,
    cpu_amx_products,
    cpu_fma_peak,
    cpu_info,
    cuda_compile_check,
    default_device,
    force_cpu_isa,
    force_cuda_pair,
    get_num_threads,
    set_cpu_amx_products,
    set_num_threads,
    version,
)
from .errors import (
    ArgumentTypeError,
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
    UnsupportedFeatureError,
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
    # The high level.
    "flash_attn_prefill",
    "PrefillPlan",
    "ArraySpec",
    "merge_attention_states",
    "causal_mask",
    "check_q_fits_half",
    "clear_plan_cache",
    # Devices.
    "Device",
    "Buffer",
    "Encoder",
    "backends",
    "default_device",
    "cpu_info",
    "cpu_fma_peak",
    "cpu_amx_peak",
    "cpu_amx_products",
    "set_cpu_amx_products",
    "cuda_compile_check",
    "force_cpu_isa",
    "force_cuda_pair",
    "set_num_threads",
    "get_num_threads",
    "version",
    # Errors.
    "MlxError",
    "ArgumentTypeError",
    "BackendUnavailableError",
    "BufferAllocationError",
    "CommandBufferError",
    "DeviceNotFoundError",
    "InternalError",
    "InvalidArgumentError",
    "InvalidHandleError",
    "KernelNotFoundError",
    "ShaderCompilationError",
    "UnsupportedDtypeError",
    "UnsupportedFeatureError",
    # The origin op, mirroring the Rust names (mlx_native.ops).
    "CACHE_ROWS_PER_STEP",
    "K_TENSOR_F16_D256",
    "K_TENSOR_F16_D512",
    "FlashAttnPrefillTensorParams",
    "dispatch_flash_attn_prefill_blk",
    "dispatch_flash_attn_prefill_tensor_f16",
    "flash_attn_prefill_blk",
    "flash_attn_prefill_tensor_available",
    "kv_pad",
    "queries_per_threadgroup",
    "threadgroup_memory_bytes",
]


def __getattr__(name: str):
    # PEP 562: ``mn.integrations`` (the backends of other libraries, which import those
    # libraries) loads on first use; nothing here imports it otherwise.
    if name == "integrations":
        import importlib

        return importlib.import_module(".integrations", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
