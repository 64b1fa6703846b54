//! One file per op: constants, validation and the dispatch; [`crate::params`] holds the
//! params blocks they bind (where the backends read them too). An op validates, names its
//! kernels and their sources, looks up its pipeline by name and encodes; it never asks
//! which backend runs, and imports none.

pub mod dense_mm_capability;
pub mod flash_attn_prefill;
pub mod flash_attn_prefill_blk;
pub mod flash_attn_prefill_paged;
pub mod flash_attn_prefill_plan;
pub mod flash_attn_prefill_tensor;

use crate::kernel_registry::KernelRegistry;

/// Register every op's kernels.
pub fn register_all(registry: &mut KernelRegistry) {
    flash_attn_prefill_tensor::register(registry);
    flash_attn_prefill_blk::register(registry);
    flash_attn_prefill::register(registry);
}
