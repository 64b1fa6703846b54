//! Classify an additive F16 mask into tiles for [`super::flash_attn_prefill_tensor`]
//! (SPEC section 1): one U8 per `(bq, bk)` tile, row-major `[ceil(rows/bq), kv_pad/bk]`.
//!
//! | byte | tile | the attention kernel |
//! | --- | --- | --- |
//! | 0 | every value -inf or <= -65504 | skips it |
//! | 2 | every value +0 or -0 | computes it without reading the mask |
//! | 1 | anything else | computes it and adds the mask |
//!
//! Only mask rows `< rows` are read: the last query tile is clamped.

use crate::buffer::MlxBuffer;
use crate::device::MlxDevice;
use crate::dtypes::DType;
use crate::encoder::{as_bytes, CommandEncoder, GridSize, KernelArg};
use crate::error::{MlxError, Result};
use crate::kernel_registry::{KernelRegistry, KernelSource, SourceFile};
use crate::recorded::classifier_slot;

pub use crate::params::FlashAttnPrefillBlkParamsGpu;

/// Kernel entry point.
pub const K_BLK_F16: &str = "flash_attn_prefill_blk";

/// The classifiers' CUDA source (the origin's and the front door's table share one file).
pub const FLASH_ATTN_PREFILL_BLK_CUDA: SourceFile =
    SourceFile::single("flash_attn_prefill_blk.cu", include_str!("../../../shaders/flash_attn_prefill_blk.cu"));

/// The classifiers' MSL source.
pub const FLASH_ATTN_PREFILL_BLK_METAL: SourceFile =
    SourceFile::single("flash_attn_prefill_blk.metal", include_str!("../../../shaders/flash_attn_prefill_blk.metal"));

/// The device sources (MSL, CUDA).
pub static FLASH_ATTN_PREFILL_BLK_SHADER_SOURCE: KernelSource =
    KernelSource { metal: Some(FLASH_ATTN_PREFILL_BLK_METAL), cuda: Some(FLASH_ATTN_PREFILL_BLK_CUDA) };

/// Threads of one threadgroup (one tile each).
const THREADS: u64 = 32;

/// Register the entry point against the kernel source.
pub fn register(registry: &mut KernelRegistry) {
    registry.register_source(K_BLK_F16, FLASH_ATTN_PREFILL_BLK_SHADER_SOURCE);
}

/// Shape of one classification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlashAttnPrefillBlkParams {
    /// Mask rows (query rows).
    pub rows: u32,
    /// Mask columns and row stride; a multiple of `bk`.
    pub kv_pad: u32,
    /// Query rows per tile.
    pub bq: u32,
    /// Cache rows per tile.
    pub bk: u32,
}

/// Bytes of the table for `p`: `ceil(rows / bq) * (kv_pad / bk)`.
pub fn blk_bytes(p: &FlashAttnPrefillBlkParams) -> Result<u64> {
    if p.bq == 0 || p.bk == 0 {
        return Err(invalid(format!("tile shape must be positive, got {p:?}")));
    }
    Ok((p.rows as u64).div_ceil(p.bq as u64) * (p.kv_pad as u64 / p.bk as u64))
}

fn invalid(msg: String) -> MlxError {
    MlxError::InvalidArgument(format!("flash_attn_prefill_blk: {msg}"))
}

/// Encode one classification of `mask` (F16 `[rows, kv_pad]`) into `blk` (U8).
pub fn dispatch_flash_attn_prefill_blk(
    encoder: &mut CommandEncoder,
    registry: &mut KernelRegistry,
    device: &MlxDevice,
    mask: &MlxBuffer,
    blk: &MlxBuffer,
    p: &FlashAttnPrefillBlkParams,
) -> Result<()> {
    if p.rows == 0 || p.kv_pad == 0 || p.bq == 0 || p.bk == 0 {
        return Err(invalid(format!("empty shape {p:?}")));
    }
    if !p.kv_pad.is_multiple_of(p.bk) {
        return Err(invalid(format!("kv_pad {} is not a multiple of bk {}", p.kv_pad, p.bk)));
    }
    if [p.rows, p.kv_pad, p.bq, p.bk].iter().any(|&x| x > i32::MAX as u32) {
        return Err(invalid(format!("a dimension exceeds i32: {p:?}")));
    }
    let mask_bytes = p.rows as u64 * p.kv_pad as u64 * 2;
    if mask.dtype() != DType::F16 {
        return Err(invalid(format!("mask must be {}, got {}", DType::F16, mask.dtype())));
    }
    if (mask.data_byte_len() as u64) < mask_bytes {
        return Err(invalid(format!(
            "mask holds {} bytes, [{}, {}] needs {mask_bytes}",
            mask.data_byte_len(),
            p.rows,
            p.kv_pad
        )));
    }
    let need = blk_bytes(p)?;
    if blk.dtype() != DType::U8 || (blk.data_byte_len() as u64) < need {
        return Err(invalid(format!(
            "blk must be U8 with at least {need} bytes (bq {}, bk {}), got {} {} bytes",
            p.bq,
            p.bk,
            blk.dtype(),
            blk.data_byte_len()
        )));
    }
    if blk.overlaps(mask) {
        return Err(invalid("blk overlaps the mask".into()));
    }
    let gpu =
        FlashAttnPrefillBlkParamsGpu { rows: p.rows as i32, kv_pad: p.kv_pad as i32, bq: p.bq as i32, bk: p.bk as i32 };
    let pipeline = registry.get_pipeline(K_BLK_F16, device)?;
    encoder.encode_threadgroups_with_args_and_shared(
        pipeline,
        &[
            (classifier_slot::PARAMS, KernelArg::Bytes(as_bytes(&gpu))),
            (classifier_slot::MASK, KernelArg::Buffer(mask)),
            (classifier_slot::BLK, KernelArg::Buffer(blk)),
        ],
        &[],
        GridSize::new((p.kv_pad / p.bk) as u64, (p.rows as u64).div_ceil(p.bq as u64), 1),
        GridSize::new(THREADS, 1, 1),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_mirror_is_four_words() {
        assert_eq!(std::mem::size_of::<FlashAttnPrefillBlkParamsGpu>(), 16);
    }

    #[test]
    fn table_size_clamps_the_last_query_tile() {
        let p = FlashAttnPrefillBlkParams { rows: 33, kv_pad: 128, bq: 32, bk: 64 };
        assert_eq!(blk_bytes(&p).unwrap(), 4);
        assert!(blk_bytes(&FlashAttnPrefillBlkParams { bq: 0, ..p }).is_err());
    }
}
