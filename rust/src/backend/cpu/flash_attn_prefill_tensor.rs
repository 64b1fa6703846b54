//! CPU form of `flash_attn_prefill_tensor_f16_d256` / `_d512` (SPEC section 2): the general
//! prefill kernel (`flash_attn_prefill`) with the origin's fixed layout. The origin's params
//! block becomes a prefill block (`FlashAttnPrefillTensorParamsGpu::as_prefill`) of one
//! sequence of `rows` query rows over a cache of `kv_pad` rows, the origin's strides, O
//! contiguous `[rows, n_heads, head_dim]`, Q and O F32, and the explicit mask with its table
//! (tiles of `bq` rows); nothing described. The arithmetic is the general kernel's, in the
//! same order: the output is the one the origin's own kernel gave, bit for bit.

use super::flash_attn_prefill::{bq_of, run};
use super::CpuKernelFn;
use crate::error::{MlxError, Result};
use crate::interface::Dispatch;
use crate::recorded::{Broken, RecordedTensor};

pub use super::flash_attn_prefill::{column_skipping, set_column_skipping};

/// This op's kernels, by name.
pub const KERNELS: &[(&str, CpuKernelFn)] =
    &[("flash_attn_prefill_tensor_f16_d256", run_d256), ("flash_attn_prefill_tensor_f16_d512", run_d512)];

/// Entry point of `flash_attn_prefill_tensor_f16_d256`.
pub fn run_d256(d: &Dispatch) -> Result<()> {
    run_head_dim::<256>(d)
}

/// Entry point of `flash_attn_prefill_tensor_f16_d512`.
pub fn run_d512(d: &Dispatch) -> Result<()> {
    run_head_dim::<512>(d)
}

fn run_head_dim<const D: usize>(d: &Dispatch) -> Result<()> {
    // The origin's contract (kv_pad a multiple of 64, no empty dimension, buffers that hold
    // the block), then the general kernel's as a prefill.
    let bad = |Broken(what)| MlxError::Internal(format!("flash_attn_prefill_tensor (cpu): {what}"));
    let r = RecordedTensor::decode(d, D as u32)?.map_err(bad)?;
    debug_assert_eq!(r.bq as usize, bq_of(D));
    run::<D, D>(&r.as_prefill().map_err(bad)?, super::isa_of(&d.options))
}
