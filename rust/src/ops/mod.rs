//! One file per op: constants, validation, the params mirror, and the dispatch. An op
//! validates, looks up its pipeline by name and encodes; it never asks which backend runs.

pub mod dense_mm_capability;
pub mod flash_attn_prefill_blk;
pub mod flash_attn_prefill_tensor;

use crate::kernel_registry::KernelRegistry;

/// Register every op's kernels.
pub fn register_all(registry: &mut KernelRegistry) {
    flash_attn_prefill_tensor::register(registry);
    flash_attn_prefill_blk::register(registry);
}
