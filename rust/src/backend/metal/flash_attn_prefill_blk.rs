//! Metal host side of `flash_attn_prefill_blk` (`shaders/flash_attn_prefill_blk.metal`):
//! one threadgroup of 32 threads per tile, launched as the op encodes it.

use super::MetalKernel;

/// This op's kernel, by name.
pub const KERNELS: &[MetalKernel] =
    &[MetalKernel { name: "flash_attn_prefill_blk", function: "flash_attn_prefill_blk" }];
