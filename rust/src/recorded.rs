//! The dispatches the ops record, read back: the slots each op binds its arguments at, and
//! one decoder per op that every backend's host file calls. A decoder reads the params
//! block, checks it against the op's contract (what the op's validation guarantees and a
//! kernel that writes memory relies on), and checks each buffer the block says is present
//! against the bytes its strides reach. A backend then holds typed params and buffers by
//! role; it never reads a slot by number, and the checks are written once, here.
//!
//! A decoder refuses with [`Broken`], the contract's clause that failed; the backend adds
//! its name (`flash_attn_prefill (cpu): ...`). Like [`crate::params`], this imports nothing
//! of the ops or the backends: the ops bind at these slots and the backends read them.

use crate::error::{MlxError, Result};
use crate::interface::{BoundArg, BufferBinding, Dispatch};
use crate::params::{kv_row_width, PagedKvParamsGpu, PREFILL_DESCALE, PREFILL_PAGED};
use crate::params::{
    FlashAttnPrefillBlkParamsGpu, FlashAttnPrefillMaskBlkParamsGpu, FlashAttnPrefillParamsGpu,
    FlashAttnPrefillTensorParamsGpu, PREFILL_ALIBI_SLOPES, PREFILL_CAUSAL, PREFILL_LSE, PREFILL_MASK, PREFILL_SINKS,
    PREFILL_VARLEN, PREFILL_WINDOW_RIGHT,
};

/// The slots of the attention dispatches (`flash_attn_prefill_d*` binds them all, the
/// origin's `flash_attn_prefill_tensor_*` the first seven).
pub mod attention_slot {
    pub const PARAMS: u64 = 0;
    pub const Q: u64 = 1;
    pub const K: u64 = 2;
    pub const V: u64 = 3;
    pub const MASK: u64 = 4;
    pub const BLK: u64 = 5;
    pub const OUT: u64 = 6;
    pub const LSE: u64 = 7;
    pub const CU_SEQLENS_Q: u64 = 8;
    pub const CU_SEQLENS_K: u64 = 9;
    pub const SINKS: u64 = 10;
    /// The split walk's scratch, bound only when one is given (the backend that asked for
    /// it, `Backend::workspace_bytes`, reads it here).
    pub const WORKSPACE: u64 = 11;
    /// F32 ALiBi slopes (`PREFILL_ALIBI_SLOPES`).
    pub const ALIBI_SLOPES: u64 = 12;
    /// Paged K/V (`PREFILL_PAGED`): the `PagedKvParamsGpu` block, the I32 block table
    /// `[batch, max_blocks]` and the I32 cache lengths `seqused_k` `[batch]`.
    pub const PAGED: u64 = 13;
    pub const BLOCK_TABLE: u64 = 14;
    pub const SEQUSED_K: u64 = 15;
    /// FP8 K/V's descale factors (`PREFILL_DESCALE`): F32 `[2][n_kv_heads]`, K's then V's.
    pub const DESCALE: u64 = 16;
}

/// The slots of both mask classifiers (`flash_attn_prefill_blk`, `flash_attn_prefill_mask_blk`).
pub mod classifier_slot {
    pub const PARAMS: u64 = 0;
    pub const MASK: u64 = 1;
    pub const BLK: u64 = 2;
}

/// The clause of an op's contract a recorded dispatch breaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Broken(pub &'static str);

/// A decoder's answer: the typed dispatch, or the clause it breaks (a missing slot is an
/// internal error of its own, [`MlxError`]).
pub type Decoded<T> = Result<std::result::Result<T, Broken>>;

/// `b`, checked to hold `need` bytes: the one size check of the attention decoders.
fn fits(b: &BufferBinding, need: u64) -> std::result::Result<&BufferBinding, Broken> {
    if (b.byte_len as u64) < need {
        Err(Broken(SHORT))
    } else {
        Ok(b)
    }
}

/// What a buffer shorter than its strides reach breaks.
const SHORT: &str = "a buffer is smaller than its strides need";

macro_rules! take {
    ($e:expr) => {
        match $e? {
            Ok(x) => x,
            Err(broken) => return Ok(Err(broken)),
        }
    };
}

/// A recorded `flash_attn_prefill_d*` dispatch (SPEC 6-10): its params block and each
/// buffer its flags say is present, every one checked to hold what the block's strides
/// reach. The origin's dispatch becomes one too ([`RecordedTensor::as_prefill`]).
#[derive(Debug, Clone)]
pub struct RecordedPrefill<'d> {
    pub params: FlashAttnPrefillParamsGpu,
    pub q: &'d BufferBinding,
    pub k: &'d BufferBinding,
    pub v: &'d BufferBinding,
    pub out: &'d BufferBinding,
    /// The explicit mask and its tile table.
    pub mask: Option<(&'d BufferBinding, &'d BufferBinding)>,
    pub lse: Option<&'d BufferBinding>,
    /// `cu_seqlens_q` and `cu_seqlens_k` (variable length), `batch + 1` int32 each.
    pub cu_seqlens: Option<(&'d BufferBinding, &'d BufferBinding)>,
    pub sinks: Option<&'d BufferBinding>,
    pub alibi_slopes: Option<&'d BufferBinding>,
    /// The split walk's scratch, where the op bound one.
    pub workspace: Option<&'d BufferBinding>,
    /// Paged K/V (`PREFILL_PAGED`): `k` and `v` are then the caches of blocks.
    pub paged: Option<RecordedPaged<'d>>,
    /// FP8 K/V's descale factors (`PREFILL_DESCALE`), checked to hold `2 * n_kv_heads` F32.
    pub descale: Option<&'d BufferBinding>,
}

/// The paged K/V of a recorded prefill: its block, checked against the caches' and the
/// tables' sizes (the table's values are the backend's to check as it reads them).
#[derive(Debug, Clone)]
pub struct RecordedPaged<'d> {
    pub params: PagedKvParamsGpu,
    pub block_table: &'d BufferBinding,
    pub seqused_k: &'d BufferBinding,
}

/// The bytes of one element of a `DType` code of the params block (F32 4, F16 and BF16 2,
/// the quantised K/V's F8E4M3, F8E5M2 and Q8_0 bytes 1).
fn element_bytes(code: i32) -> u64 {
    match code {
        0 => 4,
        7..=9 => 1,
        _ => 2,
    }
}

impl<'d> RecordedPrefill<'d> {
    /// Read a prefill dispatch back, paged K/V included (every backend's kernels read the
    /// pages: the CPU's and CUDA's decode their dispatches here).
    pub fn decode(d: &'d Dispatch) -> Decoded<Self> {
        use attention_slot as s;
        let p: FlashAttnPrefillParamsGpu = d.constant(s::PARAMS)?;
        let has = |f: i32| p.flags & f != 0;
        let opt = |slot: u64, present: bool| if present { d.buffer(slot).map(Some) } else { Ok(None) };
        let workspace = match d.args.iter().find(|(i, _)| *i == s::WORKSPACE) {
            Some((_, BoundArg::Buffer(b))) => Some(b),
            Some(_) => {
                return Err(MlxError::Internal(format!("{}: a constant where a buffer belongs", d.pipeline.name())))
            }
            None => None,
        };
        let (mask, blk) = (opt(s::MASK, has(PREFILL_MASK))?, opt(s::BLK, has(PREFILL_MASK))?);
        let (cu_q, cu_k) = (opt(s::CU_SEQLENS_Q, has(PREFILL_VARLEN))?, opt(s::CU_SEQLENS_K, has(PREFILL_VARLEN))?);
        let paged = if has(PREFILL_PAGED) {
            let pk: PagedKvParamsGpu = d.constant(s::PAGED)?;
            Some((pk, d.buffer(s::BLOCK_TABLE)?, d.buffer(s::SEQUSED_K)?))
        } else {
            None
        };
        let prefill = Self::from_parts(
            p,
            [d.buffer(s::Q)?, d.buffer(s::K)?, d.buffer(s::V)?, d.buffer(s::OUT)?],
            mask.zip(blk),
            opt(s::LSE, has(PREFILL_LSE))?,
            cu_q.zip(cu_k),
            opt(s::SINKS, has(PREFILL_SINKS))?,
            opt(s::ALIBI_SLOPES, has(PREFILL_ALIBI_SLOPES))?,
            workspace,
        );
        let prefill = match (prefill, paged) {
            (Ok(r), Some((pk, table, used))) => r.with_pages(pk, table, used),
            (r, _) => r,
        };
        let descale = opt(s::DESCALE, has(PREFILL_DESCALE))?;
        Ok(prefill.and_then(|r| r.with_descale(descale)))
    }

    /// This prefill with FP8 K/V's descale factors where its block says so (`2 * n_kv_heads`
    /// F32: K's, then V's).
    pub fn with_descale(mut self, descale: Option<&'d BufferBinding>) -> std::result::Result<Self, Broken> {
        let p = &self.params;
        let fp8 = p.kv_dtype == 7 || p.kv_dtype == 8;
        match (descale, p.flags & PREFILL_DESCALE != 0) {
            (None, false) => Ok(self),
            (Some(b), true) if fp8 => {
                fits(b, (p.n_kv_heads.max(0) as u64) * 2 * 4)?;
                self.descale = Some(b);
                Ok(self)
            }
            _ => Err(Broken("descale factors bound or missing against the flags, or without FP8 K/V")),
        }
    }

    /// This prefill with paged K/V: `k` and `v` are caches of `pk.num_blocks` blocks, each
    /// checked to hold what the block's strides reach, as are the table and the lengths.
    pub fn with_pages(
        mut self,
        pk: PagedKvParamsGpu,
        block_table: &'d BufferBinding,
        seqused_k: &'d BufferBinding,
    ) -> std::result::Result<Self, Broken> {
        let p = &self.params;
        if p.flags & PREFILL_PAGED == 0 || pk.batch != p.batch || pk.max_blocks < 0 {
            return Err(Broken("a paged block that is not the prefill's"));
        }
        if !(16..=256).contains(&pk.block_size) || pk.block_size % 16 != 0 {
            return Err(Broken("a block size that is not a multiple of 16 from 16 to 256"));
        }
        let (ke, ve) = pk
            .extents(p.n_kv_heads, kv_row_width(p.kv_dtype, p.head_dim), kv_row_width(p.kv_dtype, p.head_dim_v))
            .ok_or(Broken("a negative paged field"))?;
        let kv = element_bytes(p.kv_dtype);
        let fits = |b: &BufferBinding, need: u64| if (b.byte_len as u64) < need { Err(Broken(SHORT)) } else { Ok(()) };
        fits(self.k, ke.saturating_mul(kv))?;
        fits(self.v, ve.saturating_mul(kv))?;
        let batch = p.batch.max(0) as u64;
        fits(block_table, batch.saturating_mul(pk.max_blocks as u64).saturating_mul(4))?;
        fits(seqused_k, batch.saturating_mul(4))?;
        self.paged = Some(RecordedPaged { params: pk, block_table, seqused_k });
        Ok(self)
    }

    /// A prefill of these parts, checked as [`decode`](Self::decode) checks a recorded one.
    #[allow(clippy::too_many_arguments)]
    pub fn from_parts(
        p: FlashAttnPrefillParamsGpu,
        [q, k, v, out]: [&'d BufferBinding; 4],
        mask: Option<(&'d BufferBinding, &'d BufferBinding)>,
        lse: Option<&'d BufferBinding>,
        cu_seqlens: Option<(&'d BufferBinding, &'d BufferBinding)>,
        sinks: Option<&'d BufferBinding>,
        alibi_slopes: Option<&'d BufferBinding>,
        workspace: Option<&'d BufferBinding>,
    ) -> std::result::Result<Self, Broken> {
        let e = p.extents().ok_or(Broken("params break the op's contract"))?;
        let has = |f: i32| p.flags & f != 0;
        if !(0..=2).contains(&p.q_dtype) || !(0..=2).contains(&p.o_dtype) || !matches!(p.kv_dtype, 0..=2 | 7..=9) {
            return Err(Broken("a Q or O dtype code that is not F32, F16 or BF16, or a K/V code of no K/V format"));
        }
        if p.kv_dtype == 9 && (p.head_dim % 32 != 0 || p.head_dim_v % 32 != 0) {
            return Err(Broken("Q8_0 K/V with a head dim that is not a multiple of 32"));
        }
        if p.n_heads <= 0 || p.n_kv_heads <= 0 || p.n_heads % p.n_kv_heads != 0 || p.window < 0 {
            return Err(Broken("the heads do not group, or a negative window"));
        }
        if has(PREFILL_WINDOW_RIGHT) && !has(PREFILL_CAUSAL) && p.window_right < 0 {
            return Err(Broken("a negative right bound"));
        }
        if !(p.softcap >= 0.0 && p.softcap.is_finite() && p.max_bias >= 0.0 && p.max_bias.is_finite()) {
            return Err(Broken("softcap or max_bias is negative or not finite"));
        }
        if p.max_bias > 0.0 && !has(PREFILL_MASK) && !has(PREFILL_CAUSAL) {
            return Err(Broken("ALiBi without an explicit mask or a causal description"));
        }
        if has(PREFILL_ALIBI_SLOPES) && (p.max_bias > 0.0 || p.alibi_batch_stride < 0) {
            return Err(Broken("ALiBi slopes with max_bias, or a negative slopes stride"));
        }
        // The table bytes a kernel reads: table b at b * blk_batch_stride, row r / blk_bq,
        // a column per step of the cache; at least the tables' whole rows.
        let steps = (p.kv_len.max(0) as u64).div_ceil(64);
        let mut blk_need = e.blk;
        if has(PREFILL_MASK) {
            if has(PREFILL_VARLEN) || p.blk_bq <= 0 || (p.blk_steps as u64) < steps {
                return Err(Broken("an explicit mask with variable length, or a table narrower than the cache"));
            }
            if p.batch > 0 && p.rows > 0 && steps > 0 {
                let reach = ((p.batch - 1) as u64)
                    .saturating_mul(p.blk_batch_stride as u64)
                    .saturating_add(((p.rows - 1) / p.blk_bq) as u64 * p.blk_steps as u64)
                    .saturating_add(steps);
                blk_need = blk_need.max(reach);
            }
        }
        let kv = element_bytes(p.kv_dtype);
        fits(q, e.q.saturating_mul(element_bytes(p.q_dtype)))?;
        fits(k, e.k.saturating_mul(kv))?;
        fits(v, e.v.saturating_mul(kv))?;
        fits(out, e.out.saturating_mul(element_bytes(p.o_dtype)))?;
        let present = |b: Option<&BufferBinding>, flag: i32, need: u64| match (b, has(flag)) {
            (Some(b), true) => fits(b, need).map(|_| ()),
            (None, false) => Ok(()),
            _ => Err(Broken("a buffer bound or missing against the flags")),
        };
        present(mask.map(|m| m.0), PREFILL_MASK, e.mask.saturating_mul(2))?;
        present(mask.map(|m| m.1), PREFILL_MASK, blk_need)?;
        present(lse, PREFILL_LSE, e.lse.saturating_mul(4))?;
        let cu = (p.batch.max(0) as u64 + 1) * 4;
        present(cu_seqlens.map(|c| c.0), PREFILL_VARLEN, cu)?;
        present(cu_seqlens.map(|c| c.1), PREFILL_VARLEN, cu)?;
        present(sinks, PREFILL_SINKS, e.sinks.saturating_mul(4))?;
        present(alibi_slopes, PREFILL_ALIBI_SLOPES, e.alibi_slopes.saturating_mul(4))?;
        Ok(RecordedPrefill {
            params: p,
            q,
            k,
            v,
            out,
            mask,
            lse,
            cu_seqlens,
            sinks,
            alibi_slopes,
            workspace,
            paged: None,
            descale: None,
        })
    }
}

/// A recorded `flash_attn_prefill_tensor_f16_d*` dispatch (the origin's, SPEC 2): its params
/// block and its six buffers, checked against the block at its head dim.
#[derive(Debug, Clone)]
pub struct RecordedTensor<'d> {
    pub params: FlashAttnPrefillTensorParamsGpu,
    pub head_dim: u32,
    /// Query rows of one tile of its table (the op's `mask_tile_rows`).
    pub bq: u32,
    pub q: &'d BufferBinding,
    pub k: &'d BufferBinding,
    pub v: &'d BufferBinding,
    pub mask: &'d BufferBinding,
    pub blk: &'d BufferBinding,
    pub out: &'d BufferBinding,
}

impl<'d> RecordedTensor<'d> {
    /// Read the origin's dispatch back, for its kernel's head dim (its table's tiles: 32
    /// query rows at 256, 16 at 512).
    pub fn decode(d: &'d Dispatch, head_dim: u32) -> Decoded<Self> {
        use attention_slot as s;
        let p: FlashAttnPrefillTensorParamsGpu = d.constant(s::PARAMS)?;
        let bq = if head_dim <= 256 { 32 } else { 16 };
        let Some(e) = p.extents(head_dim as u64, bq as u64) else {
            return Ok(Err(Broken("shape breaks the op's contract")));
        };
        Ok(Ok(RecordedTensor {
            params: p,
            head_dim,
            bq,
            q: take!(d.buffer(s::Q).map(|b| fits(b, e.q))),
            k: take!(d.buffer(s::K).map(|b| fits(b, e.k))),
            v: take!(d.buffer(s::V).map(|b| fits(b, e.v))),
            mask: take!(d.buffer(s::MASK).map(|b| fits(b, e.mask))),
            blk: take!(d.buffer(s::BLK).map(|b| fits(b, e.blk))),
            out: take!(d.buffer(s::OUT).map(|b| fits(b, e.out))),
        }))
    }

    /// The general prefill this is (`FlashAttnPrefillTensorParamsGpu::as_prefill`: one
    /// sequence, Q and O F32, the explicit mask and its table), checked as a prefill.
    pub fn as_prefill(&self) -> std::result::Result<RecordedPrefill<'d>, Broken> {
        let p = self.params.as_prefill(self.head_dim as i32, self.bq as i32);
        RecordedPrefill::from_parts(
            p,
            [self.q, self.k, self.v, self.out],
            Some((self.mask, self.blk)),
            None,
            None,
            None,
            None,
            None,
        )
    }
}

/// A recorded `flash_attn_prefill_blk` dispatch (the origin's classifier): the mask
/// `[rows, kv_pad]` and its table, checked against the block.
#[derive(Debug, Clone)]
pub struct RecordedBlk<'d> {
    pub params: FlashAttnPrefillBlkParamsGpu,
    pub mask: &'d BufferBinding,
    pub blk: &'d BufferBinding,
    /// Bytes of the mask the block reaches, and of its table.
    pub mask_bytes: u64,
    pub table_bytes: u64,
}

/// What a classifier's buffer shorter than its block says breaks.
const SHORT_CLASSIFIER: &str = "buffers smaller than validated";

impl<'d> RecordedBlk<'d> {
    pub fn decode(d: &'d Dispatch) -> Decoded<Self> {
        use classifier_slot as s;
        let p: FlashAttnPrefillBlkParamsGpu = d.constant(s::PARAMS)?;
        let Some((mask_bytes, table_bytes)) = p.extents() else {
            return Ok(Err(Broken("shape breaks the op's contract")));
        };
        let (mask, blk) = (d.buffer(s::MASK)?, d.buffer(s::BLK)?);
        if (mask.byte_len as u64) < mask_bytes || (blk.byte_len as u64) < table_bytes {
            return Ok(Err(Broken(SHORT_CLASSIFIER)));
        }
        Ok(Ok(RecordedBlk { params: p, mask, blk, mask_bytes, table_bytes }))
    }
}

/// A recorded `flash_attn_prefill_mask_blk` dispatch (the prefill's classifier): the F16
/// mask `[batch, rows, kv_len]` (its strides) and the tables, checked against the block.
#[derive(Debug, Clone)]
pub struct RecordedMaskBlk<'d> {
    pub params: FlashAttnPrefillMaskBlkParamsGpu,
    pub mask: &'d BufferBinding,
    pub blk: &'d BufferBinding,
    /// Bytes of the mask the block reaches.
    pub mask_bytes: u64,
}

impl<'d> RecordedMaskBlk<'d> {
    pub fn decode(d: &'d Dispatch) -> Decoded<Self> {
        use classifier_slot as s;
        let p: FlashAttnPrefillMaskBlkParamsGpu = d.constant(s::PARAMS)?;
        let dims = [p.batch, p.rows, p.kv_len, p.steps];
        if dims.iter().any(|&x| x < 0) || p.bq <= 0 || p.bk <= 0 || p.mask_batch_stride < 0 || p.mask_row_stride < 0 {
            return Ok(Err(Broken("params break the op's contract")));
        }
        let mask_bytes = if p.batch == 0 || p.rows == 0 || p.kv_len == 0 {
            0
        } else {
            ((p.batch as u64 - 1).saturating_mul(p.mask_batch_stride as u64))
                .saturating_add((p.rows as u64 - 1).saturating_mul(p.mask_row_stride as u64))
                .saturating_add(p.kv_len as u64)
                .saturating_mul(2)
        };
        let (mask, blk) = (d.buffer(s::MASK)?, d.buffer(s::BLK)?);
        if (mask.byte_len as u64) < mask_bytes || (blk.byte_len as u64) < p.table_bytes() {
            return Ok(Err(Broken(SHORT_CLASSIFIER)));
        }
        Ok(Ok(RecordedMaskBlk { params: p, mask, blk, mask_bytes }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interface::{GridSize, Pipeline};

    /// A dispatch of the attention with only its params block bound.
    fn dispatch(flags: i32) -> Dispatch {
        let p = FlashAttnPrefillParamsGpu { flags, ..bytemuck::Zeroable::zeroed() };
        Dispatch {
            pipeline: Pipeline::new("flash_attn_prefill_d64", 256, std::sync::Arc::new(())),
            args: vec![(attention_slot::PARAMS, BoundArg::Bytes(bytemuck::bytes_of(&p).to_vec()))],
            shared: vec![],
            grid: GridSize::new(1, 1, 1),
            threadgroup: GridSize::new(32, 8, 1),
            options: Default::default(),
        }
    }

    /// The decoder takes a paged dispatch (every backend reads paged K/V): it goes on to read
    /// the paged slots (here missing: an internal error, not a refusal).
    #[test]
    fn the_decoder_takes_paged_kv() {
        let d = dispatch(PREFILL_PAGED);
        assert!(matches!(RecordedPrefill::decode(&d), Err(MlxError::Internal(_))));
    }
}
