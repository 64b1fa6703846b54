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
use crate::params::FlashAttnPrefillTensorParamsGpu as Params;

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
    let p: Params = d.constant(0)?;
    let bq = bq_of(D);
    // The origin's contract (kv_pad a multiple of 64, no empty dimension), checked as the
    // origin checked it; the general kernel then checks every buffer against its strides.
    p.extents(D as u64, bq as u64)
        .ok_or_else(|| MlxError::Internal("flash_attn_prefill_tensor (cpu): shape breaks the op's contract".into()))?;
    run::<D, D>(d, &p.as_prefill(D as i32, bq as i32))
}
