//! The params blocks the ops bind at index 0 of their dispatches: the one Rust definition
//! of each, `#[repr(C)]`. The op writes it; every Rust backend reads it back from the
//! dispatch through its op's decoder ([`crate::recorded`]); the device sources declare the same
//! struct (`shaders/*.cu`, `shaders/*.metal`), held to this one by the tests below (size,
//! field names, order and offsets).
//!
//! This file imports nothing of the crate: the ops write these blocks and the backends read
//! them without either reaching into the other.

/// `flash_attn_prefill_tensor_f16_*` (the origin op's `FlashAttnPrefillTensorParamsGpu`):
/// twelve 32-bit words, strides in elements.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct FlashAttnPrefillTensorParamsGpu {
    pub rows: i32,
    pub n_heads: i32,
    pub n_kv_heads: i32,
    pub kv_pad: i32,
    pub q_row_stride: i32,
    pub q_head_stride: i32,
    pub k_row_stride: i32,
    pub k_head_stride: i32,
    pub v_row_stride: i32,
    pub v_head_stride: i32,
    pub mask_row_stride: i32,
    pub scale: f32,
}

/// Bytes each buffer of one attention dispatch must hold, from its params and head dim
/// (SPEC section 2: last row * row stride + last head * head stride + head_dim elements);
/// `None` for a shape that breaks the op's contract (a negative or empty dimension).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionExtents {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub mask: u64,
    pub blk: u64,
    pub out: u64,
}

impl FlashAttnPrefillTensorParamsGpu {
    /// What the op validated and what a backend that writes memory relies on: the bytes of
    /// every buffer, for query tiles of `bq` rows.
    pub fn extents(&self, head_dim: u64, bq: u64) -> Option<AttentionExtents> {
        let dims = [
            self.rows,
            self.n_heads,
            self.n_kv_heads,
            self.kv_pad,
            self.q_row_stride,
            self.q_head_stride,
            self.k_row_stride,
            self.k_head_stride,
            self.v_row_stride,
            self.v_head_stride,
            self.mask_row_stride,
        ];
        if dims.iter().any(|&x| x < 0) || self.rows == 0 || self.n_heads == 0 || self.n_kv_heads == 0 {
            return None;
        }
        if self.kv_pad == 0 || self.kv_pad % 64 != 0 || self.n_heads % self.n_kv_heads != 0 || bq == 0 {
            return None;
        }
        let u = |x: i32| x as u64;
        let (rows, nh, nkv, kvp) = (u(self.rows), u(self.n_heads), u(self.n_kv_heads), u(self.kv_pad));
        let span = |last_row: u64, rs: i32, last_head: u64, hs: i32, width: u64, esz: u64| {
            last_row
                .saturating_mul(u(rs))
                .saturating_add(last_head.saturating_mul(u(hs)))
                .saturating_add(width)
                .saturating_mul(esz)
        };
        Some(AttentionExtents {
            q: span(rows - 1, self.q_row_stride, nh - 1, self.q_head_stride, head_dim, 4),
            k: span(kvp - 1, self.k_row_stride, nkv - 1, self.k_head_stride, head_dim, 2),
            v: span(kvp - 1, self.v_row_stride, nkv - 1, self.v_head_stride, head_dim, 2),
            mask: span(rows - 1, self.mask_row_stride, 0, 0, kvp, 2),
            blk: rows.div_ceil(bq).saturating_mul(kvp / 64),
            out: rows.saturating_mul(nh).saturating_mul(head_dim).saturating_mul(4),
        })
    }
}

/// `flash_attn_prefill_blk` (the op's `FlashAttnPrefillBlkParamsGpu`): four 32-bit words.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct FlashAttnPrefillBlkParamsGpu {
    pub rows: i32,
    pub kv_pad: i32,
    pub bq: i32,
    pub bk: i32,
}

impl FlashAttnPrefillBlkParamsGpu {
    /// Bytes of the mask and of the table, `None` for a shape that breaks the op's contract.
    pub fn extents(&self) -> Option<(u64, u64)> {
        if self.rows <= 0 || self.kv_pad <= 0 || self.bq <= 0 || self.bk <= 0 || self.kv_pad % self.bk != 0 {
            return None;
        }
        let (rows, kvp) = (self.rows as u64, self.kv_pad as u64);
        Some((rows * kvp * 2, rows.div_ceil(self.bq as u64) * (kvp / self.bk as u64)))
    }
}

/// `flash_attn_prefill_d*` (SPEC sections 6-9): one prefill over a batch of sequences, fixed
/// length or variable length, with a described mask (causal, window), an optional explicit
/// mask and its tile table, optional lse, and the dtypes of Q and O. Strides in elements
/// (the table's batch stride in bytes). The 64-bit fields come first, so that the C, CUDA
/// and Metal structs need no padding.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct FlashAttnPrefillParamsGpu {
    pub q_batch_stride: i64,
    pub q_row_stride: i64,
    pub q_head_stride: i64,
    pub k_batch_stride: i64,
    pub k_row_stride: i64,
    pub k_head_stride: i64,
    pub v_batch_stride: i64,
    pub v_row_stride: i64,
    pub v_head_stride: i64,
    pub o_batch_stride: i64,
    pub o_row_stride: i64,
    pub o_head_stride: i64,
    /// 0: one mask for every sequence.
    pub mask_batch_stride: i64,
    pub mask_row_stride: i64,
    pub lse_batch_stride: i64,
    pub lse_head_stride: i64,
    /// Bytes from one sequence's tile table to the next (0: one table for all).
    pub blk_batch_stride: i64,
    /// Sequences.
    pub batch: i32,
    /// Query rows of each sequence (fixed length), or of all of them (variable length).
    pub rows: i32,
    /// Cache rows of each sequence (fixed length), or of all of them (variable length).
    pub kv_len: i32,
    pub n_heads: i32,
    pub n_kv_heads: i32,
    pub head_dim: i32,
    /// The most query rows of one sequence (what the grid covers).
    pub max_rows: i32,
    /// `w` of a window-`w` causal mask; 0 for none.
    pub window: i32,
    /// `PREFILL_*` bits.
    pub flags: i32,
    /// `DType` codes of Q and O.
    pub q_dtype: i32,
    pub o_dtype: i32,
    /// Rows of a sequence's tile table (`ceil(rows / bq)`, fixed length) and its columns
    /// (`ceil(kv_len / 64)`): the table of the explicit mask, `[blk_rows][blk_steps]`.
    pub blk_rows: i32,
    pub blk_steps: i32,
    /// Query rows of one table row (`bq`).
    pub blk_bq: i32,
    pub scale: f32,
    /// With `PREFILL_OFFSET`: query row r of each sequence is at position `r + offset` of its
    /// cache (without it the prompt is the cache's end: `offset = Lk - Lq`).
    pub offset: i32,
    /// Columns of V and O (`head_dim` is Q's and K's; they differ only at (576, 512)).
    pub head_dim_v: i32,
    /// `DType` code of K and V (F16, BF16, F32; the CPU's quantised F8E4M3, F8E5M2, Q8_0).
    pub kv_dtype: i32,
    /// SPEC 10: `s = softcap * tanh(s / softcap)` when above 0.
    pub softcap: f32,
    /// SPEC 10: ALiBi slopes on the explicit mask when above 0.
    pub max_bias: f32,
    /// With `PREFILL_WINDOW_RIGHT`: query row r (at cache position p) sees cache row j only
    /// if `j <= p + window_right` (the right side of a two-sided window, SPEC 6; causal is
    /// right 0 and needs no field). Without the flag there is no right bound but causal's.
    pub window_right: i32,
    /// With `PREFILL_ALIBI_SLOPES`: elements from one sequence's slopes to the next (0: one
    /// `[n_heads]` array for every sequence; `n_heads` for `[batch, n_heads]`).
    pub alibi_batch_stride: i32,
}

/// Elements (bytes for `blk`) each buffer of a prefill must hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefillExtents {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub out: u64,
    pub mask: u64,
    pub blk: u64,
    pub lse: u64,
    /// F32 sink logits, one per query head.
    pub sinks: u64,
    /// F32 ALiBi slopes, `[n_heads]` or `[batch, n_heads]`.
    pub alibi_slopes: u64,
}

impl FlashAttnPrefillParamsGpu {
    /// What each buffer of a dispatch with this block must hold (0 for an absent one): the
    /// op checks its buffers against it, and a backend that writes memory relies on it.
    /// `None` for a block no op makes (a negative field).
    pub fn extents(&self) -> Option<PrefillExtents> {
        let fields = [self.batch, self.rows, self.kv_len, self.n_heads, self.n_kv_heads, self.head_dim];
        let strides = [
            self.q_batch_stride,
            self.q_row_stride,
            self.q_head_stride,
            self.k_batch_stride,
            self.k_row_stride,
            self.k_head_stride,
            self.v_batch_stride,
            self.v_row_stride,
            self.v_head_stride,
            self.o_batch_stride,
            self.o_row_stride,
            self.o_head_stride,
            self.mask_batch_stride,
            self.mask_row_stride,
            self.lse_batch_stride,
            self.lse_head_stride,
            self.blk_batch_stride,
        ];
        if fields.iter().any(|&x| x < 0) || strides.iter().any(|&x| x < 0) || self.blk_rows < 0 || self.blk_steps < 0 {
            return None;
        }
        let u = |x: i32| x as u64;
        let w = |x: i64| x as u64;
        // Variable length: one batch of all the rows (the batch strides are 0).
        let seqs = if self.flags & PREFILL_VARLEN != 0 { u(self.batch).min(1) } else { u(self.batch) };
        let (rows, kvl, nh, nkv, hd) =
            (u(self.rows), u(self.kv_len), u(self.n_heads), u(self.n_kv_heads), u(self.head_dim));
        if self.head_dim_v < 0 {
            return None;
        }
        let hdv = u(self.head_dim_v);
        // K's and V's rows in their own elements (Q8_0: bytes of blocks).
        let (kw, vw) = (u(kv_row_width(self.kv_dtype, self.head_dim)), u(kv_row_width(self.kv_dtype, self.head_dim_v)));
        let span = |n: [u64; 3], s: [u64; 3], width: u64| -> u64 {
            if n.contains(&0) || width == 0 {
                return 0;
            }
            (n[0] - 1)
                .saturating_mul(s[0])
                .saturating_add((n[1] - 1).saturating_mul(s[1]))
                .saturating_add((n[2] - 1).saturating_mul(s[2]))
                .saturating_add(width)
        };
        let mask = self.flags & PREFILL_MASK != 0;
        let lse = self.flags & PREFILL_LSE != 0;
        let masks = if self.mask_batch_stride == 0 { u(self.batch).min(1) } else { u(self.batch) };
        let tables = if self.blk_batch_stride == 0 { u(self.batch).min(1) } else { u(self.batch) };
        Some(PrefillExtents {
            q: span([seqs, rows, nh], [w(self.q_batch_stride), w(self.q_row_stride), w(self.q_head_stride)], hd),
            k: span([seqs, kvl, nkv], [w(self.k_batch_stride), w(self.k_row_stride), w(self.k_head_stride)], kw),
            v: span([seqs, kvl, nkv], [w(self.v_batch_stride), w(self.v_row_stride), w(self.v_head_stride)], vw),
            out: span([seqs, rows, nh], [w(self.o_batch_stride), w(self.o_row_stride), w(self.o_head_stride)], hdv),
            mask: if mask {
                span([masks, rows, 1], [w(self.mask_batch_stride), w(self.mask_row_stride), 0], kvl)
            } else {
                0
            },
            blk: if mask { tables.saturating_mul(u(self.blk_rows)).saturating_mul(u(self.blk_steps)) } else { 0 },
            lse: if lse {
                span([seqs, nh, 1], [w(self.lse_batch_stride), w(self.lse_head_stride), 0], rows)
            } else {
                0
            },
            sinks: if self.flags & PREFILL_SINKS != 0 { nh } else { 0 },
            alibi_slopes: if self.flags & PREFILL_ALIBI_SLOPES != 0 {
                if self.alibi_batch_stride < 0 {
                    return None;
                }
                (u(self.batch).max(1) - 1).saturating_mul(u(self.alibi_batch_stride)).saturating_add(nh)
            } else {
                0
            },
        })
    }
}

impl FlashAttnPrefillParamsGpu {
    /// SPEC 10: the ALiBi slope of query head `h` (1 without ALiBi, `max_bias <= 0`):
    /// `n2 = 2^floor(log2(n_heads))`, `m0 = 2^(-max_bias / n2)`, `m1 = 2^(-max_bias / 2 / n2)`,
    /// `m0^(h + 1)` for `h < n2`, else `m1^(2 (h - n2) + 1)`. Computed in f64 as one power of
    /// two and rounded once, so that every backend that calls it scales by the same f32.
    pub fn alibi_slope(&self, h: i32) -> f32 {
        alibi_slope(self.max_bias, self.n_heads, h)
    }
}

/// [`FlashAttnPrefillParamsGpu::alibi_slope`] from its three numbers.
pub fn alibi_slope(max_bias: f32, n_heads: i32, h: i32) -> f32 {
    if max_bias <= 0.0 || n_heads <= 0 {
        return 1.0;
    }
    let n2 = 1i64 << (31 - (n_heads as u32).leading_zeros());
    let (mb, n2f, h) = (max_bias as f64, n2 as f64, h as i64);
    let exponent = if h < n2 { -mb / n2f * (h + 1) as f64 } else { -mb / 2.0 / n2f * (2 * (h - n2) + 1) as f64 };
    exponent.exp2() as f32
}

impl FlashAttnPrefillTensorParamsGpu {
    /// The origin op's dispatch as the front door's params block: one sequence of `rows`
    /// query rows and `kv_pad` cache rows, the explicit mask (row stride `mask_row_stride`)
    /// with its table of `bq`-row tiles, F32 Q and O, O contiguous `[rows, n_heads,
    /// head_dim]`, no lse. The kernels of both ops are one.
    pub fn as_prefill(&self, head_dim: i32, bq: i32) -> FlashAttnPrefillParamsGpu {
        let i = |x: i32| x as i64;
        FlashAttnPrefillParamsGpu {
            q_batch_stride: 0,
            q_row_stride: i(self.q_row_stride),
            q_head_stride: i(self.q_head_stride),
            k_batch_stride: 0,
            k_row_stride: i(self.k_row_stride),
            k_head_stride: i(self.k_head_stride),
            v_batch_stride: 0,
            v_row_stride: i(self.v_row_stride),
            v_head_stride: i(self.v_head_stride),
            o_batch_stride: 0,
            o_row_stride: i(self.n_heads) * i(head_dim),
            o_head_stride: i(head_dim),
            mask_batch_stride: 0,
            mask_row_stride: i(self.mask_row_stride),
            lse_batch_stride: 0,
            lse_head_stride: 0,
            blk_batch_stride: 0,
            batch: 1,
            rows: self.rows,
            kv_len: self.kv_pad,
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim,
            max_rows: self.rows,
            window: 0,
            flags: PREFILL_MASK,
            q_dtype: 0,
            o_dtype: 0,
            blk_rows: (self.rows + bq - 1) / bq.max(1),
            blk_steps: self.kv_pad / 64,
            blk_bq: bq,
            scale: self.scale,
            offset: 0,
            head_dim_v: head_dim,
            kv_dtype: 1,
            softcap: 0.0,
            max_bias: 0.0,
            window_right: 0,
            alibi_batch_stride: 0,
        }
    }
}

/// Causal visibility (SPEC 6): query row r sees cache row j iff `j <= r + Lk - Lq`.
pub const PREFILL_CAUSAL: i32 = 1;
/// An explicit additive F16 mask (and its tile table) is bound.
pub const PREFILL_MASK: i32 = 2;
/// Variable length: `cu_seqlens_q` / `cu_seqlens_k` are bound (SPEC 7).
pub const PREFILL_VARLEN: i32 = 4;
/// lse is written (SPEC 8).
pub const PREFILL_LSE: i32 = 8;
/// The block's `offset` places the query rows in the cache (context parallelism: a chunk of
/// the queries against a chunk of the cache that does not end where the queries do).
pub const PREFILL_OFFSET: i32 = 16;
/// Attention sinks (SPEC 10): one logit per query head, bound at index 10.
pub const PREFILL_SINKS: i32 = 32;
/// A right bound of the described mask (SPEC 6, two-sided windows): `j <= p + window_right`.
pub const PREFILL_WINDOW_RIGHT: i32 = 64;
/// ALiBi slopes given as data (flash-attn's `alibi_slopes`, `recorded::attention_slot::ALIBI_SLOPES`): the score of
/// each computed pair gains `-slope * |p - j|` (`p` the query's cache position).
pub const PREFILL_ALIBI_SLOPES: i32 = 128;

/// Paged K/V (SPEC 11): K and V are caches of fixed-size blocks read through a block table
/// and each sequence's cache length (bound at `recorded::attention_slot::{PAGED, BLOCK_TABLE,
/// SEQUSED_K}`, described by [`PagedKvParamsGpu`]); the block's K/V strides and `kv_len` then
/// describe no tensor (the strides are 0, `kv_len` the longest sequence's cache, or the sum of
/// them with `PREFILL_VARLEN`). Every backend takes it: the CPU in its kernels behind the flag,
/// CUDA in its one-CTA forms' `_paged` entry points (whose launch carries the caches' strides as
/// K/V's and the table's address), Metal in entry points of its own
/// (`ops::flash_attn_prefill::PAGED_KERNELS`).
pub const PREFILL_PAGED: i32 = 256;
/// Quantised FP8 K/V with descale factors (SPEC 11): an F32 buffer at the descale slot,
/// `[2][n_kv_heads]` (K's factors, then V's); without the flag every factor is 1.
pub const PREFILL_DESCALE: i32 = 512;

/// `DType` code of Q8_0 K/V (ggml's blocks of 32 values in 34 bytes).
pub const KV_Q8_0: i32 = 9;

/// Elements (bytes) of one K or V row of `d` values for the K/V `DType` code `kv_dtype`:
/// `d` but for Q8_0, whose 32 values take 34 bytes (`d` a multiple of 32, checked by the op).
pub fn kv_row_width(kv_dtype: i32, d: i32) -> i32 {
    if kv_dtype == KV_Q8_0 {
        d / 32 * 34
    } else {
        d
    }
}

/// The paged K/V of a `PREFILL_PAGED` prefill: `k_cache`, `v_cache` `[num_blocks, block_size,
/// n_kv_heads, head_dim]` (strides in elements), `block_table` I32 `[batch, max_blocks]`,
/// `seqused_k` I32 `[batch]`. Sequence b's cache row j is row `j % block_size` of block
/// `block_table[b * max_blocks + j / block_size]`. A block of its own (not fields of
/// [`FlashAttnPrefillParamsGpu`], which the device sources declare too): the CPU and Metal's
/// paged kernels read it, and the CUDA host turns it into its launch
/// (`backend::cuda::flash_attn_prefill::paged_params`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct PagedKvParamsGpu {
    pub k_block_stride: i64,
    pub k_row_stride: i64,
    pub k_head_stride: i64,
    pub v_block_stride: i64,
    pub v_row_stride: i64,
    pub v_head_stride: i64,
    pub num_blocks: i32,
    pub block_size: i32,
    pub max_blocks: i32,
    pub batch: i32,
}

impl PagedKvParamsGpu {
    /// Elements of K and V the caches span (`[num_blocks, block_size, n_kv_heads, width]`),
    /// `None` for a negative field.
    pub fn extents(&self, n_kv_heads: i32, head_dim: i32, head_dim_v: i32) -> Option<(u64, u64)> {
        let s = [
            self.k_block_stride,
            self.k_row_stride,
            self.k_head_stride,
            self.v_block_stride,
            self.v_row_stride,
            self.v_head_stride,
        ];
        let n = [self.num_blocks, self.block_size, n_kv_heads, head_dim, head_dim_v];
        if s.iter().any(|&x| x < 0) || n.iter().any(|&x| x < 0) {
            return None;
        }
        let u = |x: i32| x as u64;
        let span = |st: [i64; 3], width: u64| -> u64 {
            let counts = [u(self.num_blocks), u(self.block_size), u(n_kv_heads)];
            if counts.contains(&0) || width == 0 {
                return 0;
            }
            (0..3).fold(width, |acc, i| acc.saturating_add((counts[i] - 1).saturating_mul(st[i] as u64)))
        };
        Some((
            span([self.k_block_stride, self.k_row_stride, self.k_head_stride], u(head_dim)),
            span([self.v_block_stride, self.v_row_stride, self.v_head_stride], u(head_dim_v)),
        ))
    }
}

/// `flash_attn_prefill_mask_blk`: the tile table of an explicit mask over a batch
/// (`[batch][ceil(rows / bq)][ceil(kv_len / bk)]` bytes; columns at or past `kv_len` count as
/// masked, rows at or past `rows` are not read).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct FlashAttnPrefillMaskBlkParamsGpu {
    pub mask_batch_stride: i64,
    pub mask_row_stride: i64,
    pub batch: i32,
    pub rows: i32,
    pub kv_len: i32,
    pub bq: i32,
    pub bk: i32,
    pub steps: i32,
}

impl FlashAttnPrefillMaskBlkParamsGpu {
    /// Rows of one table.
    pub fn table_rows(&self) -> i64 {
        (self.rows as i64 + self.bq as i64 - 1) / self.bq.max(1) as i64
    }
    /// Bytes of the tables of every sequence.
    pub fn table_bytes(&self) -> u64 {
        (self.batch.max(0) as u64) * (self.table_rows().max(0) as u64) * (self.steps.max(0) as u64)
    }
}

/// One field of a params block as the device sources must declare it: name and offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field {
    pub name: &'static str,
    pub offset: usize,
}

macro_rules! fields {
    ($t:ty: $($f:ident),*) => {
        &[$(Field { name: stringify!($f), offset: std::mem::offset_of!($t, $f) }),*]
    };
}

/// The fields of [`FlashAttnPrefillTensorParamsGpu`], in order.
pub const ATTENTION_FIELDS: &[Field] = fields!(FlashAttnPrefillTensorParamsGpu: rows, n_heads, n_kv_heads,
    kv_pad, q_row_stride, q_head_stride, k_row_stride, k_head_stride, v_row_stride, v_head_stride,
    mask_row_stride, scale);

/// The fields of [`FlashAttnPrefillBlkParamsGpu`], in order.
pub const BLK_FIELDS: &[Field] = fields!(FlashAttnPrefillBlkParamsGpu: rows, kv_pad, bq, bk);

/// The fields of [`FlashAttnPrefillParamsGpu`], in order.
pub const PREFILL_FIELDS: &[Field] = fields!(FlashAttnPrefillParamsGpu: q_batch_stride, q_row_stride,
    q_head_stride, k_batch_stride, k_row_stride, k_head_stride, v_batch_stride, v_row_stride, v_head_stride,
    o_batch_stride, o_row_stride, o_head_stride, mask_batch_stride, mask_row_stride, lse_batch_stride,
    lse_head_stride, blk_batch_stride, batch, rows, kv_len, n_heads, n_kv_heads, head_dim, max_rows, window,
    flags, q_dtype, o_dtype, blk_rows, blk_steps, blk_bq, scale, offset, head_dim_v, kv_dtype, softcap, max_bias,
    window_right, alibi_batch_stride);

/// The fields of [`FlashAttnPrefillMaskBlkParamsGpu`], in order.
pub const MASK_BLK_FIELDS: &[Field] =
    fields!(FlashAttnPrefillMaskBlkParamsGpu: mask_batch_stride, mask_row_stride, batch, rows, kv_len, bq, bk, steps);

#[cfg(test)]
mod tests {
    use super::*;

    /// The fields of `struct <name> { ... }` in a C-like source, with the offsets a C
    /// compiler gives them: 4-byte `int` / `float` and 8-byte `long long` / `long` (Metal's
    /// 64-bit integer) fields, each at its natural alignment (anything else fails the
    /// parse, and the test with it), and their sizes ([`device_fields`]: names and offsets).
    fn device_layout(source: &str, name: &str) -> Vec<(String, usize, usize)> {
        let start = source.find(&format!("struct {name} {{")).unwrap_or_else(|| panic!("no struct {name}"));
        let body = &source[start..];
        let body = &body[body.find('{').unwrap() + 1..body.find("};").unwrap()];
        let mut out = Vec::new();
        let mut offset = 0usize;
        for decl in body.split(';') {
            let decl: String = decl.lines().map(|l| l.split("//").next().unwrap()).collect::<Vec<_>>().join(" ");
            let decl = decl.trim();
            if decl.is_empty() {
                continue;
            }
            let (size, names) = if let Some(rest) = decl.strip_prefix("long long ") {
                (8, rest)
            } else if let Some(rest) = decl.strip_prefix("long ") {
                (8, rest)
            } else if let Some(rest) = decl.strip_prefix("int ") {
                (4, rest)
            } else if let Some(rest) = decl.strip_prefix("float ") {
                (4, rest)
            } else {
                panic!("{name}: field {decl:?} is not an int, float, long or long long");
            };
            for n in names.split(',') {
                offset = offset.div_ceil(size) * size;
                out.push((n.trim().to_string(), offset, size));
                offset += size;
            }
        }
        out
    }

    fn device_fields(source: &str, name: &str) -> Vec<(String, usize)> {
        device_layout(source, name).into_iter().map(|(n, offset, _)| (n, offset)).collect()
    }

    /// The sizes of [`device_layout`]'s fields.
    fn device_sizes(source: &str, name: &str) -> Vec<usize> {
        device_layout(source, name).into_iter().map(|(_, _, size)| size).collect()
    }

    /// Each field's size in a block without padding (`total` its size): the gap to the next.
    fn rust_sizes(fields: &[Field], total: usize) -> Vec<usize> {
        let ends = fields.iter().skip(1).map(|f| f.offset).chain([total]);
        fields.iter().zip(ends).map(|(f, end)| end - f.offset).collect()
    }

    fn rust_fields(fields: &[Field]) -> Vec<(String, usize)> {
        fields.iter().map(|f| (f.name.to_string(), f.offset)).collect()
    }

    #[test]
    fn the_blocks_have_the_ops_sizes() {
        assert_eq!(std::mem::size_of::<FlashAttnPrefillTensorParamsGpu>(), 48);
        assert_eq!(std::mem::size_of::<FlashAttnPrefillBlkParamsGpu>(), 16);
        assert_eq!(ATTENTION_FIELDS.len() * 4, 48);
        assert_eq!(BLK_FIELDS.len() * 4, 16);
    }

    #[test]
    fn device_sources_declare_the_same_attention_blocks() {
        let cu = include_str!("../../shaders/flash_attn_prefill/params.cuh");
        let metal = include_str!("../../shaders/flash_attn_prefill_tensor.metal");
        // The CUDA kernels take the front door's block (the origin's is turned into it on
        // the host); the origin's Metal kernels bind the origin's block, as its op encodes.
        assert_eq!(
            device_fields(cu, "Params"),
            rust_fields(PREFILL_FIELDS),
            "shaders/flash_attn_prefill/params.cuh drifted"
        );
        assert_eq!(
            device_fields(metal, "FlashAttnPrefillTensorParams"),
            rust_fields(ATTENTION_FIELDS),
            "the .metal struct drifted"
        );
        assert_eq!(
            *PREFILL_FIELDS.last().map(|f| &f.offset).unwrap() + 4,
            std::mem::size_of::<FlashAttnPrefillParamsGpu>()
        );
    }

    #[test]
    fn device_sources_declare_the_same_blk_blocks() {
        let cu = include_str!("../../shaders/flash_attn_prefill_blk.cu");
        let metal = include_str!("../../shaders/flash_attn_prefill_blk.metal");
        assert_eq!(
            device_fields(cu, "BlkParams"),
            rust_fields(BLK_FIELDS),
            "shaders/flash_attn_prefill_blk.cu drifted"
        );
        assert_eq!(
            device_fields(metal, "FlashAttnPrefillBlkParams"),
            rust_fields(BLK_FIELDS),
            "the .metal struct drifted"
        );
        assert_eq!(
            device_fields(cu, "MaskBlkParams"),
            rust_fields(MASK_BLK_FIELDS),
            "the .cu mask table struct drifted"
        );
    }

    #[test]
    fn metal_declares_the_same_prefill_block() {
        let metal = include_str!("../../shaders/flash_attn_prefill_tensor.metal");
        let name = "FlashAttnPrefillParams";
        assert_eq!(device_fields(metal, name), rust_fields(PREFILL_FIELDS), "the .metal struct drifted");
        let size = std::mem::size_of::<FlashAttnPrefillParamsGpu>();
        assert_eq!(device_sizes(metal, name), rust_sizes(PREFILL_FIELDS, size), "a .metal field has another size");
    }

    #[test]
    fn metal_declares_the_same_mask_blk_block() {
        let metal = include_str!("../../shaders/flash_attn_prefill_blk.metal");
        let name = "FlashAttnPrefillMaskBlkParams";
        assert_eq!(device_fields(metal, name), rust_fields(MASK_BLK_FIELDS), "the .metal struct drifted");
        let size = std::mem::size_of::<FlashAttnPrefillMaskBlkParamsGpu>();
        assert_eq!(device_sizes(metal, name), rust_sizes(MASK_BLK_FIELDS, size), "a .metal field has another size");
    }

    #[test]
    fn an_int_where_the_block_has_a_long_is_seen_by_its_size() {
        // The offsets may still agree (the next long is aligned to 8); the sizes do not.
        let narrowed = "struct Q {\n long q_batch_stride;\n int q_row_stride;\n long q_head_stride;\n};";
        assert_eq!(device_fields(narrowed, "Q"), rust_fields(&PREFILL_FIELDS[..3]));
        assert_eq!(device_sizes(narrowed, "Q"), vec![8, 4, 8]);
        assert_ne!(device_sizes(narrowed, "Q"), rust_sizes(&PREFILL_FIELDS[..3], 24));
    }

    #[test]
    fn sixty_four_bit_fields_are_aligned() {
        let f = device_fields("struct P {\n int a;\n long long b;\n float c;\n};", "P");
        assert_eq!(f, vec![("a".to_string(), 0), ("b".to_string(), 8), ("c".to_string(), 16)]);
    }

    #[test]
    fn a_drifted_struct_is_seen() {
        let swapped = "struct Params {\n int n_heads, rows;\n};";
        let f = device_fields(swapped, "Params");
        assert_ne!(f, rust_fields(&ATTENTION_FIELDS[..2]));
        assert_eq!(f, vec![("n_heads".to_string(), 0), ("rows".to_string(), 4)]);
    }

    #[test]
    fn alibi_slopes_follow_spec_10() {
        // 8 heads, max_bias 8: n2 = 8, m0 = 1/2, slopes 1/2 .. 1/256.
        for h in 0..8 {
            assert_eq!(alibi_slope(8.0, 8, h), 0.5f32.powi(h + 1), "head {h}");
        }
        // 12 heads: n2 = 8; heads 8..12 take m1 = 2^(-1/2) to the odd powers 1, 3, 5, 7.
        for h in 8..12 {
            let want = 2f64.powf(-0.5 * (2 * (h - 8) + 1) as f64) as f32;
            assert_eq!(alibi_slope(8.0, 12, h), want, "head {h}");
        }
        assert_eq!(alibi_slope(0.0, 12, 3), 1.0);
        assert_eq!(alibi_slope(5.0, 1, 0), 2f64.powf(-5.0) as f32);
    }

    #[test]
    fn extents_follow_the_strides() {
        let p = FlashAttnPrefillTensorParamsGpu {
            rows: 33,
            n_heads: 4,
            n_kv_heads: 2,
            kv_pad: 128,
            q_row_stride: 1024,
            q_head_stride: 256,
            k_row_stride: 512,
            k_head_stride: 256,
            v_row_stride: 512,
            v_head_stride: 256,
            mask_row_stride: 128,
            scale: 1.0,
        };
        let e = p.extents(256, 32).unwrap();
        assert_eq!(e.q, (32 * 1024 + 3 * 256 + 256) * 4);
        assert_eq!(e.k, (127 * 512 + 256 + 256) * 2);
        assert_eq!(e.mask, (32 * 128 + 128) * 2);
        assert_eq!(e.blk, 2 * 2);
        assert_eq!(e.out, 33 * 4 * 256 * 4);
        assert!(FlashAttnPrefillTensorParamsGpu { kv_pad: 100, ..p }.extents(256, 32).is_none());
        assert!(FlashAttnPrefillTensorParamsGpu { rows: -1, ..p }.extents(256, 32).is_none());
    }
}
