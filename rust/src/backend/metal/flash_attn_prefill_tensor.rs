//! Metal host side of `flash_attn_prefill_tensor_f16_d256` / `_d512`
//! (`shaders/flash_attn_prefill_tensor.metal`): the MSL functions, launched as the op
//! encodes them (`ceil(rows / bq) x n_heads` threadgroups of 32 x 8 threads, with
//! `threadgroup_memory_bytes(head_dim)` of threadgroup memory at index 0).

use super::MetalKernel;

/// This op's kernels, by name.
pub const KERNELS: &[MetalKernel] = &[
    MetalKernel { name: "flash_attn_prefill_tensor_f16_d256", function: "flash_attn_prefill_tensor_f16_d256" },
    MetalKernel { name: "flash_attn_prefill_tensor_f16_d512", function: "flash_attn_prefill_tensor_f16_d512" },
];
