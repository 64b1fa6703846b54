//! CUDA host side of `flash_attn_prefill_blk` (`shaders/flash_attn_prefill_blk.cu`): one
//! warp per tile, eight tiles per CTA of the row-major table, 16-byte loads where the mask
//! allows them.

use super::launch::{contract, device_addr, CudaKernel, Launch, PrepareContext};
use crate::error::{MlxError, Result};
use crate::interface::Dispatch;
use crate::recorded::{Broken, RecordedBlk};

/// This op's kernel, by name.
pub const KERNELS: &[CudaKernel] = &[CudaKernel {
    name: "flash_attn_prefill_blk",
    entry: "flash_attn_prefill_blk",
    hopper_variants: &[],
    hopper_form: false,
    portable_variants: &[],
    paged: false,
    paged_pairs: false,
    quant_pairs: false,
    quant: false,
    shared_bytes: |_| None,
    prepare: |pc, d, _| prepare(pc, d),
    merge_entry: None,
    split: super::launch::no_split,
}];

fn prepare(pc: &PrepareContext<'_>, d: &Dispatch) -> Result<Launch> {
    let name = d.pipeline.name();
    let r = RecordedBlk::decode(d)?.map_err(|Broken(what)| contract(name, what))?;
    let (p, blk_need) = (r.params, r.table_bytes);
    let (mask, blk) = (device_addr(pc.ctx, r.mask, name)?, device_addr(pc.ctx, r.blk, name)?);
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
