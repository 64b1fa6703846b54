//! Metal host side of `flash_attn_prefill_d*` (every head dim of the op's table, F16 and BF16 K/V)
//! (`shaders/flash_attn_prefill_tensor.metal`) and of the explicit mask's classifier
//! `flash_attn_prefill_mask_blk` (`shaders/flash_attn_prefill_blk.metal`): the MSL functions,
//! launched as the op encodes them (`ceil(max_rows / bq) x n_heads x batch` threadgroups of
//! 32 x 8 threads with `threadgroup_memory_bytes(head_dim)` of threadgroup memory at index 0;
//! the classifier `steps x table_rows x batch` threadgroups of 32 threads). A paged prefill
//! (SPEC 11) runs `flash_attn_prefill_paged_*`, the op's `PAGED_KERNELS`.

use super::MetalKernel;

/// This op's kernels, by name.
pub const KERNELS: &[MetalKernel] = &[
    MetalKernel { name: "flash_attn_prefill_d16", function: "flash_attn_prefill_d16" },
    MetalKernel { name: "flash_attn_prefill_d16_bf16", function: "flash_attn_prefill_d16_bf16" },
    MetalKernel { name: "flash_attn_prefill_d32", function: "flash_attn_prefill_d32" },
    MetalKernel { name: "flash_attn_prefill_d32_bf16", function: "flash_attn_prefill_d32_bf16" },
    MetalKernel { name: "flash_attn_prefill_d48", function: "flash_attn_prefill_d48" },
    MetalKernel { name: "flash_attn_prefill_d48_bf16", function: "flash_attn_prefill_d48_bf16" },
    MetalKernel { name: "flash_attn_prefill_d64", function: "flash_attn_prefill_d64" },
    MetalKernel { name: "flash_attn_prefill_d64_bf16", function: "flash_attn_prefill_d64_bf16" },
    MetalKernel { name: "flash_attn_prefill_d80", function: "flash_attn_prefill_d80" },
    MetalKernel { name: "flash_attn_prefill_d80_bf16", function: "flash_attn_prefill_d80_bf16" },
    MetalKernel { name: "flash_attn_prefill_d96", function: "flash_attn_prefill_d96" },
    MetalKernel { name: "flash_attn_prefill_d96_bf16", function: "flash_attn_prefill_d96_bf16" },
    MetalKernel { name: "flash_attn_prefill_d112", function: "flash_attn_prefill_d112" },
    MetalKernel { name: "flash_attn_prefill_d112_bf16", function: "flash_attn_prefill_d112_bf16" },
    MetalKernel { name: "flash_attn_prefill_d128", function: "flash_attn_prefill_d128" },
    MetalKernel { name: "flash_attn_prefill_d128_bf16", function: "flash_attn_prefill_d128_bf16" },
    MetalKernel { name: "flash_attn_prefill_d160", function: "flash_attn_prefill_d160" },
    MetalKernel { name: "flash_attn_prefill_d160_bf16", function: "flash_attn_prefill_d160_bf16" },
    MetalKernel { name: "flash_attn_prefill_d192", function: "flash_attn_prefill_d192" },
    MetalKernel { name: "flash_attn_prefill_d192_bf16", function: "flash_attn_prefill_d192_bf16" },
    MetalKernel { name: "flash_attn_prefill_d224", function: "flash_attn_prefill_d224" },
    MetalKernel { name: "flash_attn_prefill_d224_bf16", function: "flash_attn_prefill_d224_bf16" },
    MetalKernel { name: "flash_attn_prefill_d256", function: "flash_attn_prefill_d256" },
    MetalKernel { name: "flash_attn_prefill_d256_bf16", function: "flash_attn_prefill_d256_bf16" },
    MetalKernel { name: "flash_attn_prefill_d512", function: "flash_attn_prefill_d512" },
    MetalKernel { name: "flash_attn_prefill_d512_bf16", function: "flash_attn_prefill_d512_bf16" },
    MetalKernel { name: "flash_attn_prefill_d576_512", function: "flash_attn_prefill_d576_512" },
    MetalKernel { name: "flash_attn_prefill_d576_512_bf16", function: "flash_attn_prefill_d576_512_bf16" },
    MetalKernel { name: "flash_attn_prefill_mask_blk", function: "flash_attn_prefill_mask_blk" },
    // Paged K/V (SPEC 11): the same body reading K and V through a block table, with the paged
    // block, the table and the lengths at 13, 14 and 15 (the op's PAGED_KERNELS).
    MetalKernel { name: "flash_attn_prefill_paged_d16", function: "flash_attn_prefill_paged_d16" },
    MetalKernel { name: "flash_attn_prefill_paged_d16_bf16", function: "flash_attn_prefill_paged_d16_bf16" },
    MetalKernel { name: "flash_attn_prefill_paged_d32", function: "flash_attn_prefill_paged_d32" },
    MetalKernel { name: "flash_attn_prefill_paged_d32_bf16", function: "flash_attn_prefill_paged_d32_bf16" },
    MetalKernel { name: "flash_attn_prefill_paged_d48", function: "flash_attn_prefill_paged_d48" },
    MetalKernel { name: "flash_attn_prefill_paged_d48_bf16", function: "flash_attn_prefill_paged_d48_bf16" },
    MetalKernel { name: "flash_attn_prefill_paged_d64", function: "flash_attn_prefill_paged_d64" },
    MetalKernel { name: "flash_attn_prefill_paged_d64_bf16", function: "flash_attn_prefill_paged_d64_bf16" },
    MetalKernel { name: "flash_attn_prefill_paged_d80", function: "flash_attn_prefill_paged_d80" },
    MetalKernel { name: "flash_attn_prefill_paged_d80_bf16", function: "flash_attn_prefill_paged_d80_bf16" },
    MetalKernel { name: "flash_attn_prefill_paged_d96", function: "flash_attn_prefill_paged_d96" },
    MetalKernel { name: "flash_attn_prefill_paged_d96_bf16", function: "flash_attn_prefill_paged_d96_bf16" },
    MetalKernel { name: "flash_attn_prefill_paged_d112", function: "flash_attn_prefill_paged_d112" },
    MetalKernel { name: "flash_attn_prefill_paged_d112_bf16", function: "flash_attn_prefill_paged_d112_bf16" },
    MetalKernel { name: "flash_attn_prefill_paged_d128", function: "flash_attn_prefill_paged_d128" },
    MetalKernel { name: "flash_attn_prefill_paged_d128_bf16", function: "flash_attn_prefill_paged_d128_bf16" },
    MetalKernel { name: "flash_attn_prefill_paged_d160", function: "flash_attn_prefill_paged_d160" },
    MetalKernel { name: "flash_attn_prefill_paged_d160_bf16", function: "flash_attn_prefill_paged_d160_bf16" },
    MetalKernel { name: "flash_attn_prefill_paged_d192", function: "flash_attn_prefill_paged_d192" },
    MetalKernel { name: "flash_attn_prefill_paged_d192_bf16", function: "flash_attn_prefill_paged_d192_bf16" },
    MetalKernel { name: "flash_attn_prefill_paged_d224", function: "flash_attn_prefill_paged_d224" },
    MetalKernel { name: "flash_attn_prefill_paged_d224_bf16", function: "flash_attn_prefill_paged_d224_bf16" },
    MetalKernel { name: "flash_attn_prefill_paged_d256", function: "flash_attn_prefill_paged_d256" },
    MetalKernel { name: "flash_attn_prefill_paged_d256_bf16", function: "flash_attn_prefill_paged_d256_bf16" },
    MetalKernel { name: "flash_attn_prefill_paged_d512", function: "flash_attn_prefill_paged_d512" },
    MetalKernel { name: "flash_attn_prefill_paged_d512_bf16", function: "flash_attn_prefill_paged_d512_bf16" },
    MetalKernel { name: "flash_attn_prefill_paged_d576_512", function: "flash_attn_prefill_paged_d576_512" },
    MetalKernel { name: "flash_attn_prefill_paged_d576_512_bf16", function: "flash_attn_prefill_paged_d576_512_bf16" },
];
