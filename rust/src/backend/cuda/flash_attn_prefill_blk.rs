//! CUDA host side of `flash_attn_prefill_blk` (`shaders/flash_attn_prefill_blk.cu`): one
//! warp per tile, eight tiles per CTA of the row-major table, 16-byte loads where the mask
//! allows them.

use super::launch::{contract, device_buffer, CudaKernel, Launch, PrepareContext};
use crate::error::{MlxError, Result};
use crate::interface::Dispatch;
use crate::params::FlashAttnPrefillBlkParamsGpu as BlkParams;

/// This op's kernel, by name.
pub const KERNELS: &[CudaKernel] = &[CudaKernel {
    name: "flash_attn_prefill_blk",
    entry: "flash_attn_prefill_blk",
    hopper_variants: &[],
    hopper_form: false,
    portable_variants: &[],
    shared_bytes: |_| None,
    prepare: |pc, d, _| prepare(pc, d),
    merge_entry: None,
    workspace_bytes: super::launch::no_workspace,
}];

fn prepare(pc: &PrepareContext<'_>, d: &Dispatch) -> Result<Launch> {
    let name = d.pipeline.name();
    let p: BlkParams = d.constant(0)?;
    let (mask_need, blk_need) = p.extents().ok_or_else(|| contract(name, "shape breaks the op's contract"))?;
    let (mask, mask_len) = device_buffer(pc.ctx, d, 1)?;
    let (blk, blk_len) = device_buffer(pc.ctx, d, 2)?;
    if (mask_len as u64) < mask_need || (blk_len as u64) < blk_need {
        return Err(contract(name, "buffers smaller than validated"));
    }
    let ctas = blk_need.div_ceil(8);
    if ctas > i32::MAX as u64 {
        return Err(MlxError::InvalidArgument(format!("{name}: {blk_need} tiles is more than one launch takes")));
    }
    let aligned = (mask % 16 == 0 && p.bk % 8 == 0) as i32;
    let mut l = Launch::new([ctas as u32, 1, 1], [256, 1, 1], 0);
    l.push_bytes(bytemuck::bytes_of(&p));
    l.push_ptr(mask);
    l.push_ptr(blk);
    l.push_bytes(&aligned.to_ne_bytes());
    Ok(l)
}
