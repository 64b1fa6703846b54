//! CUDA host side of `flash_attn_prefill_d256` / `_d512` (`shaders/flash_attn_prefill_tensor.cu`,
//! whose entry points the origin op's kernels share) and of `flash_attn_prefill_mask_blk`
//! (`shaders/flash_attn_prefill_blk.cu`): the CTA geometry, the kernel's `Launch` block, the
//! alignment flags, and on Hopper the CTA-pair forms with their TMA tensor maps.
//!
//! The op encodes the Metal geometry (`ceil(max_rows / bq) x n_heads x batch` threadgroups
//! of 32 x 8 threads). The CUDA kernels choose their own from the op's params block: CTAs
//! of 8 warps over `heads_per_cta` heads that share one KV head times `queries_per_cta`
//! queries of one sequence (grid z), reading the standard tile table (SPEC 1 allows taller
//! query tiles).

use std::ffi::c_void;

pub use super::attention_geometry::{
    attention_cta_rows, attention_geometry, attention_shared_bytes, has_wide_entries, paged_pair_form, pair_cta_rows,
    pair_geometry, pair_queries_geometry, pair_shared_bytes, pair_walk_fits, plain_shared_bytes, quant_pair_form,
    wide_form, ws_consumers, ws_form, ws_threads, AttentionGeometry, PAGED_PAIRS_LAUNCHED, QUANT_PAIRS_LAUNCHED,
    WIDE_LAUNCHED, WS_CONSUMERS_D64, WS_SHARED_BYTES,
};
use super::driver::{self, TensorMap};
use super::kv_split::{self, KvSplit};
use super::launch::{
    contract, device_addr, device_addr_or_null, no_split, CudaKernel, Launch, ModuleKind, PrepareContext, Variant,
};
use crate::error::{MlxError, Result};
use crate::interface::{BoundArg, Dispatch, RunOptions};
pub use crate::options::CtaPairs;
use crate::params::{
    FlashAttnPrefillParamsGpu, PagedKvParamsGpu, PREFILL_ALIBI_SLOPES, PREFILL_CAUSAL, PREFILL_MASK, PREFILL_OFFSET,
    PREFILL_PAGED, PREFILL_VARLEN, PREFILL_WINDOW_RIGHT,
};
use crate::recorded::{Broken, RecordedMaskBlk, RecordedPrefill};

/// One attention kernel: the op's name, its entry point, and its head dims; `pairs`: it
/// has the wgmma form on sm_90a and its CTA-pair variants (`<entry>_pair_heads`,
/// `_pair_queries`; head dims 64, 128, 256 and 512), with `wide` also those in the shape
/// without the explicit mask's tiles (`_wide`; head dim 128) where `WIDE_LAUNCHED`; else it runs the portable form
/// everywhere. Where it runs the portable form,
/// `<entry>_xf` is the one with SPEC 10's score transforms. Paged K/V (SPEC 11) runs
/// `<entry>_paged` (and `<entry>_xf_paged` in the portable form with the transforms): the
/// one-CTA forms instantiated with loaders that read each row through the block table, in
/// a module of their own that only a paged launch compiles ([`CudaKernel::paged_variants`]).
macro_rules! attention_kernel {
    ($name:literal, $entry:literal, $dk:literal, $dv:literal, pairs) => {
        attention_kernel!($name, $entry, $dk, $dv, [Variant::PairHeads, Variant::PairQueries])
    };
    ($name:literal, $entry:literal, $dk:literal, $dv:literal, pairs, wide) => {
        attention_kernel!(
            $name,
            $entry,
            $dk,
            $dv,
            if WIDE_LAUNCHED {
                &[Variant::PairHeads, Variant::PairQueries, Variant::PairHeadsWide, Variant::PairQueriesWide]
            } else {
                &[Variant::PairHeads, Variant::PairQueries]
            }
        )
    };
    ($name:literal, $entry:literal, $dk:literal, $dv:literal, [$($variant:expr),*]) => {
        attention_kernel!($name, $entry, $dk, $dv, &[$($variant),*])
    };
    ($name:literal, $entry:literal, $dk:literal, $dv:literal, $variants:expr) => {
        CudaKernel {
            name: $name,
            entry: $entry,
            hopper_variants: $variants,
            hopper_form: true,
            portable_variants: &[Variant::ScoreTransforms],
            paged: true,
            paged_pairs: paged_pair_form($dk),
            quant_pairs: false,
            quant: false,
            shared_bytes: |hopper| attention_shared_bytes($dk, $dv, hopper),
            prepare: |pc, d, variants| prepare(pc, ($dk, $dv), d, variants),
            merge_entry: Some(MERGE_ENTRY),
            split: |hopper, sms, params, forced| kv_split::split_of(($dk, $dv), hopper, sms, params, forced),
        }
    };
    ($name:literal, $dk:literal, $dv:literal) => {
        CudaKernel {
            name: $name,
            entry: $name,
            hopper_variants: &[],
            hopper_form: false,
            portable_variants: &[Variant::ScoreTransforms],
            paged: true,
            paged_pairs: false,
            quant_pairs: false,
            quant: false,
            shared_bytes: |_| attention_shared_bytes($dk, $dv, false),
            prepare: |pc, d, _| prepare(pc, ($dk, $dv), d, false),
            merge_entry: Some(MERGE_ENTRY),
            split: |_, sms, params, forced| kv_split::split_of(($dk, $dv), false, sms, params, forced),
        }
    };
}

/// A quantised K/V kernel (SPEC 11, the op's `QUANT_KV_KERNELS`: FP8 E4M3 / E5M2, Q8_0): the
/// F16 kernel of its head dims (`$entry`, whose source it shares) in the source's quant module
/// (`-DMLXN_QUANT_ENTRIES=1`, [`ModuleKind`]): `<entry>_kvq` (and `_xf_kvq` in the portable
/// form), on paged K/V `<entry>_paged_kvq` (`_xf_paged_kvq`) from the module with both
/// defines. The one-CTA forms (`hopper`: the Hopper form's on sm_90a), and in the Hopper
/// form at head dims 64, 128 and 256 the CTA-pair forms on FP8 K/V (`<entry>_pair_heads_kvq`,
/// `_pair_queries_kvq`: the TMA copies the bytes, the producer widens them;
/// [`quant_pair_form`]), with the F16 kernel's shared memory (the tiles are F16 in shared
/// memory).
macro_rules! quant_kernel {
    ($name:literal, $entry:literal, $dk:literal, $dv:literal, $hopper:literal) => {
        CudaKernel {
            name: $name,
            entry: $entry,
            hopper_variants: &[],
            hopper_form: $hopper,
            portable_variants: &[],
            paged: true,
            paged_pairs: false,
            quant_pairs: $hopper && quant_pair_form($dk),
            quant: true,
            shared_bytes: |hopper| attention_shared_bytes($dk, $dv, hopper && $hopper),
            prepare: |pc, d, variants| prepare(pc, ($dk, $dv), d, variants && $hopper && quant_pair_form($dk)),
            merge_entry: Some(MERGE_ENTRY),
            split: |hopper, sms, params, forced| kv_split::split_of(($dk, $dv), hopper && $hopper, sms, params, forced),
        }
    };
}

/// This op's kernels, by name (the op's `HEAD_DIMS`): at F16 K/V and head dims 256 and 512
/// the attention runs the entry points it shares with the origin op.
pub const KERNELS: &[CudaKernel] = &[
    attention_kernel!("flash_attn_prefill_d256", "flash_attn_prefill_tensor_f16_d256", 256, 256, pairs),
    attention_kernel!("flash_attn_prefill_d512", "flash_attn_prefill_tensor_f16_d512", 512, 512, pairs),
    attention_kernel!("flash_attn_prefill_d256_bf16", "flash_attn_prefill_d256_bf16", 256, 256, pairs),
    attention_kernel!("flash_attn_prefill_d512_bf16", "flash_attn_prefill_d512_bf16", 512, 512, pairs),
    attention_kernel!("flash_attn_prefill_d16", 16, 16),
    attention_kernel!("flash_attn_prefill_d16_bf16", 16, 16),
    attention_kernel!("flash_attn_prefill_d32", 32, 32),
    attention_kernel!("flash_attn_prefill_d32_bf16", 32, 32),
    attention_kernel!("flash_attn_prefill_d48", 48, 48),
    attention_kernel!("flash_attn_prefill_d48_bf16", 48, 48),
    attention_kernel!("flash_attn_prefill_d64", "flash_attn_prefill_d64", 64, 64, pairs),
    attention_kernel!("flash_attn_prefill_d64_bf16", "flash_attn_prefill_d64_bf16", 64, 64, pairs),
    attention_kernel!("flash_attn_prefill_d80", 80, 80),
    attention_kernel!("flash_attn_prefill_d80_bf16", 80, 80),
    attention_kernel!("flash_attn_prefill_d96", 96, 96),
    attention_kernel!("flash_attn_prefill_d96_bf16", 96, 96),
    attention_kernel!("flash_attn_prefill_d112", 112, 112),
    attention_kernel!("flash_attn_prefill_d112_bf16", 112, 112),
    attention_kernel!("flash_attn_prefill_d128", "flash_attn_prefill_d128", 128, 128, pairs, wide),
    attention_kernel!("flash_attn_prefill_d128_bf16", "flash_attn_prefill_d128_bf16", 128, 128, pairs, wide),
    attention_kernel!("flash_attn_prefill_d160", 160, 160),
    attention_kernel!("flash_attn_prefill_d160_bf16", 160, 160),
    attention_kernel!("flash_attn_prefill_d192", 192, 192),
    attention_kernel!("flash_attn_prefill_d192_bf16", 192, 192),
    attention_kernel!("flash_attn_prefill_d224", 224, 224),
    attention_kernel!("flash_attn_prefill_d224_bf16", 224, 224),
    attention_kernel!("flash_attn_prefill_d576_512", 576, 512),
    attention_kernel!("flash_attn_prefill_d576_512_bf16", 576, 512),
    quant_kernel!("flash_attn_prefill_d16_kvq", "flash_attn_prefill_d16", 16, 16, false),
    quant_kernel!("flash_attn_prefill_d32_kvq", "flash_attn_prefill_d32", 32, 32, false),
    quant_kernel!("flash_attn_prefill_d48_kvq", "flash_attn_prefill_d48", 48, 48, false),
    quant_kernel!("flash_attn_prefill_d64_kvq", "flash_attn_prefill_d64", 64, 64, true),
    quant_kernel!("flash_attn_prefill_d80_kvq", "flash_attn_prefill_d80", 80, 80, false),
    quant_kernel!("flash_attn_prefill_d96_kvq", "flash_attn_prefill_d96", 96, 96, false),
    quant_kernel!("flash_attn_prefill_d112_kvq", "flash_attn_prefill_d112", 112, 112, false),
    quant_kernel!("flash_attn_prefill_d128_kvq", "flash_attn_prefill_d128", 128, 128, true),
    quant_kernel!("flash_attn_prefill_d160_kvq", "flash_attn_prefill_d160", 160, 160, false),
    quant_kernel!("flash_attn_prefill_d192_kvq", "flash_attn_prefill_d192", 192, 192, false),
    quant_kernel!("flash_attn_prefill_d224_kvq", "flash_attn_prefill_d224", 224, 224, false),
    quant_kernel!("flash_attn_prefill_d256_kvq", "flash_attn_prefill_tensor_f16_d256", 256, 256, true),
    quant_kernel!("flash_attn_prefill_d512_kvq", "flash_attn_prefill_tensor_f16_d512", 512, 512, true),
    quant_kernel!("flash_attn_prefill_d576_512_kvq", "flash_attn_prefill_d576_512", 576, 512, false),
    CudaKernel {
        name: "flash_attn_prefill_mask_blk",
        entry: "flash_attn_prefill_mask_blk",
        hopper_variants: &[],
        hopper_form: false,
        portable_variants: &[],
        paged: false,
        paged_pairs: false,
        quant_pairs: false,
        quant: false,
        shared_bytes: |_| None,
        prepare: |pc, d, _| prepare_mask_blk(pc, d),
        merge_entry: None,
        split: no_split,
    },
];

/// The entry point of every attention source that merges a split launch's parts
/// (`shaders/flash_attn_prefill/split_merge.cuh`).
pub const MERGE_ENTRY: &str = "flash_attn_prefill_split_merge";
/// Threads of a merge CTA (the kernel's `MERGE_ROWS` warps, a row each).
const MERGE_ROWS: u32 = 8;

/// Threads of an attention CTA (8 warps).
pub const ATTENTION_THREADS: u32 = 256;
/// Threads of the warp-specialised CTA with two consumer warpgroups (the pair forms at head
/// dims 128 and 256, and 64 with `WS_CONSUMERS_D64` = 2: a producer warpgroup beside the
/// two consumers; the kernel's `WS_THREADS`). [`ws_threads`] gives each head dim's.
pub const WS_THREADS: u32 = 384;
/// The kernel's `Launch` block.
#[repr(C)]
#[derive(Debug, Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct AttentionLaunch {
    heads_per_cta: i32,
    queries_per_cta: i32,
    q_tiles: i32,
    flags: i32,
    /// Split-KV: log2 of the parts of each walk (0: none) and the workspace strides between
    /// parts.
    kv_split_log2: i32,
    o_split_stride: i32,
    lse_split_stride: i32,
    /// The described mask's sides ([`MaskSides`]).
    window_right: i32,
    window_left: i32,
    reserved: i32,
    /// Device address of the ALiBi slopes (`PREFILL_ALIBI_SLOPES`), else 0.
    alibi_slopes: u64,
}

/// The kernel's `Launch` block: [`AttentionLaunch`], followed in a paged module
/// (`MLXN_PAGED_ENTRIES`, whose entry points a paged launch runs: `pages`) by the
/// [`PagedPointers`] its `Launch` adds, and in a quant module (`MLXN_QUANT_ENTRIES`: `descale`
/// given, the factors' address or 0) by the descale factors' address.
fn launch_block(block: &AttentionLaunch, pages: Option<PagedPointers>, descale: Option<u64>) -> Vec<u8> {
    let mut bytes = bytemuck::bytes_of(block).to_vec();
    if let Some(g) = &pages {
        bytes.extend_from_slice(bytemuck::bytes_of(g));
    }
    if let Some(d) = descale {
        bytes.extend_from_slice(&d.to_ne_bytes());
    }
    bytes
}

/// Whether a params block's K/V dtype code is a quantised format's (SPEC 11: F8E4M3 7,
/// F8E5M2 8, Q8_0 9), which the quant modules read.
pub fn is_quantised_code(kv_dtype: i32) -> bool {
    matches!(kv_dtype, 7..=9)
}

/// The alignment of K or V (base `base`, strides `strides` in elements) that its loaders
/// take as `FLAG_K_ALIGNED` / `FLAG_V_ALIGNED`: 16-bit K/V, 16-byte loads (base and strides
/// multiples of 16 bytes, 8 elements); FP8 (bytes), 16-byte loads of 16 values (multiples of
/// 16 bytes); Q8_0 (bytes; blocks of 34), 2-byte loads (base and strides even).
fn kv_aligned(kv_dtype: i32, base: u64, strides: [i64; 3]) -> bool {
    let (bytes, elems) = match kv_dtype {
        7 | 8 => (16, 16),
        9 => (2, 2),
        _ => (16, 8),
    };
    base.is_multiple_of(bytes) && strides.iter().all(|&s| s % elems == 0)
}

const FLAG_Q_ALIGNED: i32 = 1;
const FLAG_K_ALIGNED: i32 = 2;
const FLAG_V_ALIGNED: i32 = 4;
const FLAG_MASK_ALIGNED: i32 = 8;
const FLAG_OUT_ALIGNED: i32 = 16;
/// The described mask has a right bound (causal, or a two-sided window's).
const FLAG_RIGHT_BOUND: i32 = 32;
/// The CTAs dealt head group first (`block_range.cuh` `cta_xy`; [`group_first`]).
const FLAG_GROUP_FIRST: i32 = 64;

/// Launches of at most this many CTAs an SM deal their CTAs head group first where the
/// walks differ in length ([`group_first`]).
const GROUP_FIRST_MAX_WAVES: u64 = 6;

/// Whether a launch deals its CTAs head group first: where its query tiles' walks differ in
/// length (a right bound without a window: the causal rows' triangle) and its grid is a few
/// waves of the GPU (`ctas` at most [`GROUP_FIRST_MAX_WAVES`] a multiprocessor). In the
/// grid's own order one head group's tiles run longest to shortest before the next group's,
/// so the last groups' longest tiles start late and run alone at the end. Measured on an H100
/// (docs/benchmarks.md, 2026-12-07 10:30 UTC): causal d256 8/8 at 8192 rows (3.9 waves) 1.19x;
/// at 16384 rows (7.8 waves) and at head dims 64 and 128 (10 waves and more) 0.99x-1.01x.
fn group_first(sides: &MaskSides, ctas: u64, multiprocessors: u32) -> bool {
    sides.bounded && sides.left == 0 && multiprocessors > 0 && ctas <= GROUP_FIRST_MAX_WAVES * multiprocessors as u64
}

/// The described mask (SPEC 6) as the kernels read it (`block_range.cuh`): query row r, at
/// `p = r + offset` of its cache, sees cache row j iff `j < lk`, `j <= p + right` where there
/// is a right bound, and `j > p + right - left` where there is a window. The kernels keep
/// `off = offset + right`, so each bound is that offset and one launch constant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaskSides {
    /// A right bound: causal's (`right` 0) or a two-sided window's.
    pub bounded: bool,
    /// The right bound's distance from a row's place (0 without one).
    pub right: i32,
    /// The window's span from the right edge, `window + right` (0: no left side).
    pub left: i32,
}

impl MaskSides {
    /// The sides of `p`'s description. A side that can bind no row of any sequence is left
    /// out (the same mask), so that the kernels' `r + off` sums stay in range: a right bound
    /// at or past every sequence's last cache row, a window reaching past its first.
    pub fn of(p: &FlashAttnPrefillParamsGpu) -> std::result::Result<MaskSides, &'static str> {
        if p.window < 0 || (p.flags & PREFILL_WINDOW_RIGHT != 0 && p.window_right < 0) {
            return Err("a negative window side");
        }
        let explicit = p.flags & PREFILL_OFFSET != 0;
        let (kv, rows, offset) = (p.kv_len as i64, p.max_rows as i64, p.offset as i64);
        let right = if p.flags & PREFILL_CAUSAL != 0 {
            Some(0)
        } else if p.flags & PREFILL_WINDOW_RIGHT != 0 {
            // Row r of a sequence with lq rows and lk cache rows is at r + lk - lq (or r +
            // offset): the bound leaves out none of its cache rows once right >= lq - 1 (or
            // lk - 1 - offset), the sequences' lq at most max_rows and lk at most kv_len.
            let r = p.window_right as i64;
            let binds = if explicit { r < kv - 1 - offset } else { r < rows - 1 };
            binds.then_some(r)
        } else {
            None
        };
        // The window leaves out none of a sequence's cache rows once window >= lk (or lq +
        // offset).
        let w = p.window as i64;
        let left_binds = w > 0 && if explicit { w < rows + offset } else { w < kv };
        let left = if left_binds { w + right.unwrap_or(0) } else { 0 };
        if left > i32::MAX as i64 {
            return Err("a window and right bound whose sum exceeds int32");
        }
        Ok(MaskSides { bounded: right.is_some(), right: right.unwrap_or(0) as i32, left: left as i32 })
    }
}

/// How the two CTAs of a cluster that share each K/V tile (Hopper) split the work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PairMode {
    /// The two halves of one KV head's query heads, same queries (clusters along y).
    Heads,
    /// Neighbouring query tiles, same heads (clusters along x).
    Queries,
}

impl PairMode {
    pub const ALL: [PairMode; 2] = [PairMode::Heads, PairMode::Queries];

    /// Its entry point among the kernel's [`CudaKernel::hopper_variants`]; `wide`: in the
    /// pipeline's shape without the explicit mask's tiles.
    fn variant(self, wide: bool) -> Variant {
        match (self, wide) {
            (PairMode::Heads, false) => Variant::PairHeads,
            (PairMode::Queries, false) => Variant::PairQueries,
            (PairMode::Heads, true) => Variant::PairHeadsWide,
            (PairMode::Queries, true) => Variant::PairQueriesWide,
        }
    }

    /// The entry point of this form for `head_dim`.
    pub fn entry(self, head_dim: u32) -> String {
        let mode = match self {
            PairMode::Heads => "heads",
            PairMode::Queries => "queries",
        };
        format!("flash_attn_prefill_tensor_f16_d{head_dim}_pair_{mode}")
    }
}

/// [`force_pair`]'s choice (0: none; 1 + the `CtaPairs` as below).
static FORCED_PAIR: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Make every launch use the CTA-pair choice `pair` (the one-CTA forms, query pairs only, or
/// head pairs where they fit), or go back to `MLX_NATIVE_CUDA_PAIR`'s with `None`.
/// Process-wide; for the tests and benchmarks that compare the forms.
pub fn force_pair(pair: Option<CtaPairs>) {
    let v = match pair {
        None => 0,
        Some(CtaPairs::Off) => 1,
        Some(CtaPairs::Queries) => 2,
        Some(CtaPairs::Auto) => 3,
    };
    FORCED_PAIR.store(v, std::sync::atomic::Ordering::Relaxed);
}

/// The CTA-pair choice of a dispatch with `options`: its plan's `cta_pairs`, else
/// [`force_pair`]'s, else `MLX_NATIVE_CUDA_PAIR`'s (read once, by `settings`).
pub fn pairs_of(options: &RunOptions) -> CtaPairs {
    options.cta_pairs.unwrap_or_else(|| match FORCED_PAIR.load(std::sync::atomic::Ordering::Relaxed) {
        1 => CtaPairs::Off,
        2 => CtaPairs::Queries,
        3 => CtaPairs::Auto,
        _ => crate::settings::get().cuda_pair,
    })
}

/// `None`: no pairs; `Some(heads)`: pairs, head pairs allowed or not ([`pairs_of`]).
fn pair_setting(options: &RunOptions) -> Option<bool> {
    match pairs_of(options) {
        CtaPairs::Off => None,
        CtaPairs::Queries => Some(false),
        CtaPairs::Auto => Some(true),
    }
}

/// The tensor map of K or V for the CTA-pair form: dims (a row's elements, KV heads, cache
/// rows, sequences), boxes of `shape`'s width x 1 x 64 x 1; rows past a sequence's cache land
/// as zeros. `strides` in K/V's elements of `elem_bytes` each (2: F16 / BF16; 1: FP8 bytes,
/// read as 16-bit pairs, [`KvMapShape::fp8`]). `None` where TMA cannot address the view.
fn kv_tensor_map(
    base: u64,
    shape: KvMapShape,
    elem_bytes: u64,
    n_kv: u32,
    kv_len: u32,
    batch: u32,
    strides: [i64; 3],
) -> Option<TensorMap> {
    let [batch_stride, row_stride, head_stride] = strides.map(|s| s as u64 * elem_bytes);
    // One sequence: the stride past its whole cache (the driver refuses a 4-d map whose
    // outer stride does not cover the dimension inside it).
    let seq = if batch == 1 { row_stride.saturating_mul(kv_len as u64) } else { batch_stride };
    encode_kv_map(base, shape, n_kv, [kv_len, batch], 64, [head_stride, row_stride, seq])
}

/// Rows of one box of a paged cache's map: the largest of 64, 32 and 16 that divides the
/// block size (a multiple of 16), so that a box never crosses a block (the kernel's
/// `paged_box_rows`, `shaders/flash_attn_prefill/paged_tma.cuh`).
pub fn paged_box_rows(block_size: u32) -> u32 {
    if block_size.is_multiple_of(64) {
        64
    } else if block_size.is_multiple_of(32) {
        32
    } else {
        16
    }
}

/// The tensor map of a paged K or V cache (SPEC 11) for the paged CTA-pair forms: dims
/// (head dim, KV heads, rows of a block, blocks) at the caches' (head, row, block) strides,
/// boxes of 64 x 1 x [`paged_box_rows`] x 1 halves, 128-byte swizzle. The kernel finds each
/// box's block through the table. `None` where TMA cannot address the caches.
fn kv_paged_tensor_map(
    base: u64,
    head_dim: u32,
    n_kv: u32,
    blocks: u32,
    block_size: u32,
    strides: [i64; 3],
) -> Option<TensorMap> {
    let [block_stride, row_stride, head_stride] = strides.map(|s| s as u64 * 2);
    // One block: the stride past its rows (as one sequence's above).
    let block = if blocks == 1 { row_stride.saturating_mul(block_size as u64) } else { block_stride };
    encode_kv_map(
        base,
        KvMapShape::halves(head_dim),
        n_kv,
        [block_size, blocks],
        paged_box_rows(block_size),
        [head_stride, row_stride, block],
    )
}

/// Whether a launch of the quant module with params `p` at `head_dim` runs its pair forms
/// (where TMA can address K and V): FP8 K/V (Q8_0's 34-byte blocks leave rows the TMA's
/// 16-byte strides cannot address in general) without an explicit mask (the forms keep no
/// room for mask tiles: a tile that needs one traps), at [`quant_pair_form`]'s head dims,
/// where [`QUANT_PAIRS_LAUNCHED`].
pub fn quant_pairs_apply(p: &FlashAttnPrefillParamsGpu, head_dim: u32) -> bool {
    QUANT_PAIRS_LAUNCHED
        && quant_pair_form(head_dim)
        && matches!(p.kv_dtype, 7 | 8)
        && p.flags & (PREFILL_MASK | PREFILL_PAGED) == 0
}

/// [`quant_pairs_apply`] of a params block (the plan's choices), at its head dim.
pub fn quant_pairs_apply_to(params: &[u8]) -> bool {
    params.len() == std::mem::size_of::<FlashAttnPrefillParamsGpu>() && {
        let p = bytemuck::pod_read_unaligned::<FlashAttnPrefillParamsGpu>(params);
        quant_pairs_apply(&p, p.head_dim as u32)
    }
}

/// A row of a K/V tensor map as the TMA reads it: `elems` 16-bit elements, boxes of
/// `box_elems` of them with the swizzle `swizzle` (a `driver::TENSOR_MAP_SWIZZLE_*`).
struct KvMapShape {
    elems: u32,
    box_elems: u32,
    swizzle: std::ffi::c_int,
}

impl KvMapShape {
    /// F16 / BF16 rows of `head_dim`: boxes of 64 elements (128 bytes), 128-byte swizzle.
    fn halves(head_dim: u32) -> KvMapShape {
        KvMapShape { elems: head_dim, box_elems: 64, swizzle: driver::TENSOR_MAP_SWIZZLE_128B }
    }

    /// FP8 rows of `head_dim` bytes (SPEC 11, the quant module's pair forms) read as
    /// `head_dim / 2` 16-bit elements (the TMA copies bits): boxes of `min(head_dim, 128)`
    /// bytes with the swizzle of that width (the kernel's raw slots, `quant_pipe.cuh`).
    fn fp8(head_dim: u32) -> KvMapShape {
        let box_bytes = head_dim.min(128);
        let swizzle = if box_bytes == 128 { driver::TENSOR_MAP_SWIZZLE_128B } else { driver::TENSOR_MAP_SWIZZLE_64B };
        KvMapShape { elems: head_dim / 2, box_elems: box_bytes / 2, swizzle }
    }
}

/// A 4-d map of 16-bit K or V (TMA reads bits: F16, BF16, or FP8 bytes in pairs): dims (a
/// row's elements, KV heads, rows, outer), strides in bytes of the last three, boxes of
/// `shape.box_elems` x 1 x `box_rows` x 1.
fn encode_kv_map(
    base: u64,
    shape: KvMapShape,
    n_kv: u32,
    [rows, outer]: [u32; 2],
    box_rows: u32,
    strides: [u64; 3],
) -> Option<TensorMap> {
    let encode = driver::driver().ok()?.cuTensorMapEncodeTiled?;
    let [head_stride, row_stride, outer_stride] = strides;
    // A dimension of extent 1 never steps: any valid stride does.
    let head = if n_kv == 1 { shape.elems as u64 * 2 } else { head_stride };
    let ok = |s: u64| s > 0 && s.is_multiple_of(16) && s < (1 << 40);
    if !base.is_multiple_of(16) || !ok(row_stride) || !ok(head) || !ok(outer_stride) || rows == 0 || outer == 0 {
        return None;
    }
    let dims = [shape.elems as u64, n_kv as u64, rows as u64, outer as u64];
    let strides = [head, row_stride, outer_stride];
    let boxes = [shape.box_elems, 1, box_rows, 1];
    let elem = [1u32, 1, 1, 1];
    let mut map = TensorMap([0; 16]);
    // SAFETY: every array has the documented length for rank 4; the map is written in place.
    let r = unsafe {
        encode(
            &mut map,
            driver::TENSOR_MAP_FLOAT16,
            4,
            base as usize as *mut c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem.as_ptr(),
            0,
            shape.swizzle,
            driver::TENSOR_MAP_L2_256B,
            0,
        )
    };
    if r != driver::CUDA_SUCCESS && super::launch::tracing() {
        eprintln!("mlx_native cuda: no tensor map for dims {dims:?} strides {strides:?} (driver status {r})");
    }
    (r == driver::CUDA_SUCCESS).then_some(map)
}

/// Device addresses of an attention launch's buffers (0 for one the flags say is absent).
#[derive(Debug, Clone, Copy)]
pub struct AttentionPointers {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub mask: u64,
    pub blk: u64,
    pub out: u64,
    pub lse: u64,
    pub cu_q: u64,
    pub cu_k: u64,
    pub sinks: u64,
    /// F32 ALiBi slopes (`PREFILL_ALIBI_SLOPES`).
    pub alibi_slopes: u64,
    /// Paged K/V (`PREFILL_PAGED`, SPEC 11), else `None`.
    pub pages: Option<PagedPointers>,
    /// Paged K/V: the caches' blocks (`num_blocks`: the extent of the pair forms' tensor
    /// maps); else 0.
    pub kv_blocks: u32,
    /// Quantised K/V (SPEC 11, a quant module's launch): the F32 descale factors' address
    /// (`PREFILL_DESCALE`) or 0; `None` for 16-bit K/V.
    pub descale: Option<u64>,
}

/// The paged K/V of a launch (SPEC 11): the device addresses of the I32 block table
/// `[batch, table_stride]` and of the I32 cache lengths `seqused_k` `[batch]`, and the block
/// size. The launch's params block then carries the caches' strides as K/V's (the block
/// stride as the batch stride): [`paged_params`].
/// In this order the tail of a paged module's launch block ([`launch_block`]; the device's
/// `Launch` with `MLXN_PAGED_ENTRIES`).
#[repr(C)]
#[derive(Debug, Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub struct PagedPointers {
    pub block_table: u64,
    pub seqused_k: u64,
    pub table_stride: i32,
    pub block_size: i32,
}

/// The params block a paged prefill launches with: the op's (whose K/V strides are 0,
/// describing no tensor) with the caches' (block, row, head) strides as K/V's (batch, row,
/// head) strides. The kernels read a row's block through the table and step by the block
/// stride; the alignment flags follow from the same strides.
pub fn paged_params(p: &FlashAttnPrefillParamsGpu, pk: &PagedKvParamsGpu) -> FlashAttnPrefillParamsGpu {
    FlashAttnPrefillParamsGpu {
        k_batch_stride: pk.k_block_stride,
        k_row_stride: pk.k_row_stride,
        k_head_stride: pk.k_head_stride,
        v_batch_stride: pk.v_block_stride,
        v_row_stride: pk.v_row_stride,
        v_head_stride: pk.v_head_stride,
        ..*p
    }
}

/// Whether a params block of one of this op's kernels is a paged prefill's (`PREFILL_PAGED`):
/// it runs the kernel's paged module ([`CudaKernel::paged_variants`]; CTA pairs only where
/// that module has them, [`paged_pair_form`]).
pub fn is_paged(kernel_name: &str, params: &[u8]) -> bool {
    KERNELS.iter().any(|k| k.name == kernel_name && k.paged)
        && params.len() == std::mem::size_of::<FlashAttnPrefillParamsGpu>()
        && bytemuck::pod_read_unaligned::<FlashAttnPrefillParamsGpu>(params).flags & PREFILL_PAGED != 0
}

/// [`is_paged`] of a dispatch (its params block at `attention_slot::PARAMS`).
pub fn dispatch_is_paged(d: &Dispatch) -> bool {
    let params = d.args.iter().find_map(|(i, a)| match a {
        BoundArg::Bytes(b) if *i == crate::recorded::attention_slot::PARAMS => Some(b.as_slice()),
        _ => None,
    });
    params.is_some_and(|b| is_paged(d.pipeline.name(), b))
}

/// Whether O's base and strides allow its two-element stores (`FLAG_OUT_ALIGNED`).
fn out_aligned(p: &FlashAttnPrefillParamsGpu, out: u64) -> bool {
    let pair_bytes = if p.o_dtype == 0 { 8 } else { 4 };
    out.is_multiple_of(pair_bytes) && [p.o_batch_stride, p.o_row_stride, p.o_head_stride].iter().all(|&s| s % 2 == 0)
}

/// The launch of one attention at head dims `dims` (Q/K, V/O) with the params block `p` (the
/// front door's, or the origin's turned into it); `variants`: the CTA-pair forms may be
/// chosen (Hopper). In the portable form, softcap or ALiBi (max_bias or given slopes)
/// launch the form with the score transforms (the kernel's first portable variant).
/// `workspace` (address, bytes): where the shape splits its walks ([`kv_split`]), the parts
/// go there and a merge follows.
pub fn attention_launch(
    pc: &PrepareContext<'_>,
    name: &str,
    dims: (u32, u32),
    p: &FlashAttnPrefillParamsGpu,
    b: &AttentionPointers,
    variants: bool,
    workspace: Option<(u64, usize)>,
) -> Result<Launch> {
    let split = match workspace {
        Some((addr, len)) => match kv_split::kv_split(
            p,
            dims,
            pc.ctx.multiprocessors.max(0) as u32,
            pc.hopper,
            kv_split::forced_parts(&pc.options),
        ) {
            Some(_) if !addr.is_multiple_of(16) => {
                return Err(MlxError::InvalidArgument(format!(
                    "{name}: the workspace's address {addr:#x} is not a multiple of 16 bytes: allocate it on its own \
                     (cudaMalloc, torch.empty) or pass 0 to run unsplit"
                )))
            }
            // The op checked the size against the same plan.
            Some(s) if s.bytes() > len as u64 => {
                return Err(contract(name, "the workspace is smaller than the split needs"))
            }
            Some(s) => Some((s, addr)),
            None => None,
        },
        None => None,
    };
    let Some((s, addr)) = split else {
        return part_launch(pc, name, dims, p, b, variants, None);
    };
    let pw = s.part_params(p);
    let bw = AttentionPointers { out: addr, lse: addr + s.lse_offset(), sinks: 0, ..*b };
    let mut l = part_launch(pc, name, dims, &pw, &bw, variants, Some(&s))?;
    l.merge = Some(Box::new(merge_launch(p, &pw, &s, b, &bw)));
    Ok(l)
}

/// The merge of a split launch's parts (`split_merge.cuh`): a warp per (row, head).
fn merge_launch(
    p: &FlashAttnPrefillParamsGpu,
    pw: &FlashAttnPrefillParamsGpu,
    s: &KvSplit,
    b: &AttentionPointers,
    bw: &AttentionPointers,
) -> Launch {
    let block = AttentionLaunch {
        heads_per_cta: 0,
        queries_per_cta: 0,
        q_tiles: 0,
        flags: if out_aligned(p, b.out) { FLAG_OUT_ALIGNED } else { 0 },
        kv_split_log2: s.log2() as i32,
        o_split_stride: s.o_elems as i32,
        lse_split_stride: s.lse_elems as i32,
        window_right: 0,
        window_left: 0,
        reserved: 0,
        alibi_slopes: 0,
    };
    let grid = [(p.max_rows.max(1) as u32).div_ceil(MERGE_ROWS), p.n_heads as u32, p.batch as u32];
    let mut l = Launch::new(grid, [MERGE_ROWS * 32, 1, 1], 0);
    l.push_bytes(bytemuck::bytes_of(p));
    l.push_bytes(bytemuck::bytes_of(pw));
    // (A paged launch's merge is the paged module's: its launch block has the pages too.)
    l.push_bytes(&launch_block(&block, b.pages, b.descale));
    for ptr in [bw.out, bw.lse, b.out, b.lse, b.cu_q, b.cu_k, b.sinks] {
        l.push_ptr(ptr);
    }
    l
}

/// The attention's own launch: of the whole walk (`split` None), or of a split launch's
/// parts (`p` and `b` then the parts' block and workspace).
fn part_launch(
    pc: &PrepareContext<'_>,
    name: &str,
    dims: (u32, u32),
    p: &FlashAttnPrefillParamsGpu,
    b: &AttentionPointers,
    variants: bool,
    split: Option<&KvSplit>,
) -> Result<Launch> {
    let hopper = pc.hopper;
    let head_dim = dims.0;
    let mut geo = attention_geometry(dims, p.max_rows.max(1) as u32, p.n_heads as u32, p.n_kv_heads as u32, hopper)?;
    let aligned = |base: u64, strides: &[i64], elems: i64, bytes: u64| {
        base.is_multiple_of(bytes) && strides.iter().all(|&s| s % elems == 0)
    };
    let q_elems = if p.q_dtype == 0 { 4 } else { 8 }; // 16 bytes of Q
    let mut flags = 0;
    if aligned(b.q, &[p.q_batch_stride, p.q_row_stride, p.q_head_stride], q_elems, 16) {
        flags |= FLAG_Q_ALIGNED;
    }
    if kv_aligned(p.kv_dtype, b.k, [p.k_batch_stride, p.k_row_stride, p.k_head_stride]) {
        flags |= FLAG_K_ALIGNED;
    }
    if kv_aligned(p.kv_dtype, b.v, [p.v_batch_stride, p.v_row_stride, p.v_head_stride]) {
        flags |= FLAG_V_ALIGNED;
    }
    if aligned(b.mask, &[p.mask_batch_stride, p.mask_row_stride], 8, 16) {
        flags |= FLAG_MASK_ALIGNED;
    }
    if out_aligned(p, b.out) {
        flags |= FLAG_OUT_ALIGNED;
    }
    let sides = MaskSides::of(p).map_err(|why| contract(name, why))?;
    if sides.bounded {
        flags |= FLAG_RIGHT_BOUND;
    }
    let slopes = p.flags & PREFILL_ALIBI_SLOPES != 0;
    if slopes && (p.max_bias > 0.0 || b.alibi_slopes == 0) {
        return Err(contract(name, "ALiBi slopes with max_bias, or without their buffer"));
    }
    // CTA pairs sharing each K/V tile (Hopper): where TMA can address K and V (fixed
    // length: a sequence's K/V is one box range of the map; paged, where PAGED_PAIRS_LAUNCHED:
    // a box is a block's rows, found through the table, at head dims 64, 128 and 256); head pairs where the group of
    // query heads splits in two, else pairs of query tiles; either only where its walk can
    // carry the explicit mask's table bytes of its rows (the 192-row CTAs at head dim 64
    // of a group of one head: none, the one-CTA forms run them).
    let mut maps = None;
    let mut mode = None;
    let fixed = p.flags & PREFILL_VARLEN == 0;
    // Quantised K/V: the one-CTA form (its loaders widen the bytes), or where
    // QUANT_PAIRS_LAUNCHED, FP8 K/V without an explicit mask in the quant module's pair forms
    // (the TMA copies the bytes, the producer widens them; no room for mask tiles).
    let module = ModuleKind { paged: b.pages.is_some(), quant: b.descale.is_some() };
    let pair_module = module == ModuleKind::CONTIGUOUS
        || (module == ModuleKind::PAGED && PAGED_PAIRS_LAUNCHED && paged_pair_form(head_dim))
        || (module == ModuleKind::QUANT && quant_pairs_apply(p, head_dim));
    if let Some(heads_allowed) =
        if variants && hopper && fixed && pair_module { pair_setting(&pc.options) } else { None }
    {
        let nkv = p.n_kv_heads as u32;
        let kstrides = [p.k_batch_stride, p.k_row_stride, p.k_head_stride];
        let vstrides = [p.v_batch_stride, p.v_row_stride, p.v_head_stride];
        let (km, vm) = match b.pages {
            // (The params block's K/V batch strides are the caches' block strides.)
            Some(pg) => {
                let (blocks, bs) = (b.kv_blocks, pg.block_size.max(0) as u32);
                (
                    kv_paged_tensor_map(b.k, head_dim, nkv, blocks, bs, kstrides),
                    kv_paged_tensor_map(b.v, head_dim, nkv, blocks, bs, vstrides),
                )
            }
            None => {
                let (kvl, nb) = (p.kv_len as u32, p.batch as u32);
                // FP8 (the quant module's): strides in bytes, a row read as 16-bit pairs.
                let (shape, bytes): (fn(u32) -> KvMapShape, u64) =
                    if module.quant { (KvMapShape::fp8, 1) } else { (KvMapShape::halves, 2) };
                (
                    kv_tensor_map(b.k, shape(head_dim), bytes, nkv, kvl, nb, kstrides),
                    kv_tensor_map(b.v, shape(head_dim), bytes, nkv, kvl, nb, vstrides),
                )
            }
        };
        if let (Some(km), Some(vm)) = (km, vm) {
            let (rows, nh, nkv) = (p.max_rows.max(1) as u32, p.n_heads as u32, p.n_kv_heads as u32);
            let masked = p.flags & PREFILL_MASK != 0;
            let heads = pair_geometry(head_dim, rows, nh, nkv).filter(|_| heads_allowed).map(|g| (g, PairMode::Heads));
            let choice = heads.filter(|(g, _)| pair_walk_fits(g.queries_per_cta, false, masked)).or_else(|| {
                pair_queries_geometry(head_dim, rows, nh, nkv)
                    .filter(|g| pair_walk_fits(g.queries_per_cta, true, masked))
                    .map(|g| (g, PairMode::Queries))
            });
            if let Some((g, m)) = choice {
                geo = g;
                mode = Some(m);
                maps = Some((km, vm));
            }
        }
    }
    let parts = split.map_or(1, |s| s.parts);
    // Query pairs: an even number of CTAs along x (an odd count's last one has no rows).
    let grid_x = if mode == Some(PairMode::Queries) { geo.q_tiles + geo.q_tiles % 2 } else { geo.q_tiles };
    let ctas = grid_x as u64 * geo.head_groups as u64 * p.batch.max(1) as u64 * parts as u64;
    if group_first(&sides, ctas, pc.ctx.multiprocessors.max(0) as u32) {
        flags |= FLAG_GROUP_FIRST;
    }
    let launch = AttentionLaunch {
        heads_per_cta: geo.heads_per_cta as i32,
        queries_per_cta: geo.queries_per_cta as i32,
        q_tiles: geo.q_tiles as i32,
        flags,
        kv_split_log2: split.map_or(0, |s| s.log2() as i32),
        o_split_stride: split.map_or(0, |s| s.o_elems as i32),
        lse_split_stride: split.map_or(0, |s| s.lse_elems as i32),
        window_right: sides.right,
        window_left: sides.left,
        reserved: 0,
        alibi_slopes: if slopes { b.alibi_slopes } else { 0 },
    };
    let shared = if maps.is_some() { pair_shared_bytes(head_dim) } else { plain_shared_bytes(dims.0, dims.1, hopper) }
        .ok_or_else(|| contract(name, "no shared memory size"))?;
    if p.batch as u64 * parts as u64 > 65_535 {
        return Err(MlxError::InvalidArgument(format!(
            "{name}: a batch of {} is more than one CUDA launch takes (65535)",
            p.batch
        )));
    }
    let threads = if maps.is_some() && ws_form(head_dim) { ws_threads(head_dim) } else { ATTENTION_THREADS };
    let mut l = Launch::new([grid_x, geo.head_groups, p.batch as u32 * parts], [threads, 1, 1], shared);
    l.push_bytes(bytemuck::bytes_of(p));
    l.push_bytes(&launch_block(&launch, b.pages, b.descale));
    for ptr in [b.q, b.k, b.v, b.mask, b.blk, b.out, b.lse, b.cu_q, b.cu_k, b.sinks] {
        l.push_ptr(ptr);
    }
    if let Some((km, vm)) = maps {
        l.push_bytes(bytemuck::cast_slice(&km.0));
        l.push_bytes(bytemuck::cast_slice(&vm.0));
        // Without an explicit mask no tile reads a mask tile: the wide shape runs, where the
        // head dim has one (the contiguous module's alone).
        let wide = wide_form(head_dim) && p.flags & PREFILL_MASK == 0 && module == ModuleKind::CONTIGUOUS;
        l.variant = mode.map(|m| m.variant(wide));
    }
    let transforms = !hopper && (p.softcap > 0.0 || p.max_bias > 0.0 || slopes);
    l.variant = entry_variant(module, transforms, l.variant);
    Ok(l)
}

/// The entry point a launch of the module `module` runs (as a variant of the kernel's plain
/// one; `None`: the plain one): the paged / quant module's, with or without the score
/// transforms (`transforms`: the portable form with softcap or ALiBi), else the contiguous
/// module's transforms form, else `pair` (the CTA-pair form chosen, or none).
pub fn entry_variant(module: ModuleKind, transforms: bool, pair: Option<Variant>) -> Option<Variant> {
    match pair {
        // A pair form chosen on paged K/V: its twin in the paged module.
        // (part_launch never chooses a form without a twin, the wide ones, on paged K/V.)
        Some(v) if module == ModuleKind::PAGED && !transforms && v.paged_pair().is_some() => v.paged_pair(),
        // And on quantised K/V its twin in the quant module.
        Some(v) if module == ModuleKind::QUANT && !transforms && v.quant_pair().is_some() => v.quant_pair(),
        _ if module != ModuleKind::CONTIGUOUS || transforms => Variant::of_module(module, transforms),
        _ => pair,
    }
}

/// The device addresses of a recorded prefill's buffers (0 for an absent one).
pub fn attention_pointers(pc: &PrepareContext<'_>, name: &str, r: &RecordedPrefill<'_>) -> Result<AttentionPointers> {
    let addr = |b| device_addr(pc.ctx, b, name);
    let opt = |b| device_addr_or_null(pc.ctx, b, name);
    Ok(AttentionPointers {
        q: addr(r.q)?,
        k: addr(r.k)?,
        v: addr(r.v)?,
        mask: opt(r.mask.map(|m| m.0))?,
        blk: opt(r.mask.map(|m| m.1))?,
        out: addr(r.out)?,
        lse: opt(r.lse)?,
        cu_q: opt(r.cu_seqlens.map(|c| c.0))?,
        cu_k: opt(r.cu_seqlens.map(|c| c.1))?,
        sinks: opt(r.sinks)?,
        alibi_slopes: opt(r.alibi_slopes)?,
        pages: match &r.paged {
            Some(pg) => Some(PagedPointers {
                block_table: addr(pg.block_table)?,
                seqused_k: addr(pg.seqused_k)?,
                table_stride: pg.params.max_blocks,
                block_size: pg.params.block_size,
            }),
            None => None,
        },
        kv_blocks: r.paged.as_ref().map_or(0, |pg| pg.params.num_blocks.max(0) as u32),
        descale: if is_quantised_code(r.params.kv_dtype) { Some(opt(r.descale)?) } else { None },
    })
}

fn prepare(pc: &PrepareContext<'_>, dims: (u32, u32), d: &Dispatch, variants: bool) -> Result<Launch> {
    let name = d.pipeline.name();
    // The op validated the dispatch; a kernel that writes device memory checks what it
    // relies on (`RecordedPrefill`: the block's contract, every buffer's extent).
    // Paged K/V included (SPEC 11: the decoder checked the caches, the table and the lengths
    // against the paged block; the op checked the table's entries before it uploaded them).
    let r = RecordedPrefill::decode(d)?.map_err(|Broken(what)| contract(name, what))?;
    if r.paged.is_some() != pc.module.paged {
        // Their launch blocks differ (`launch_block`): never one with the other's entry point.
        return Err(contract(name, "paged K/V runs the paged module's entry points, and only it does"));
    }
    if is_quantised_code(r.params.kv_dtype) != pc.module.quant {
        // Their loaders and launch blocks differ: never one with the other's entry point.
        return Err(contract(name, "quantised K/V runs the quant module's entry points, and only it does"));
    }
    let paged = r.paged.as_ref().map(|pg| paged_params(&r.params, &pg.params));
    let p = paged.as_ref().unwrap_or(&r.params);
    if (p.head_dim as u32, p.head_dim_v as u32) != dims {
        return Err(contract(name, "the params block's head dims are not the kernel's"));
    }
    // The kernels index the slopes with 32-bit arithmetic.
    let slopes = p.extents().map_or(0, |e| e.alibi_slopes);
    if slopes > i32::MAX as u64 {
        return Err(MlxError::InvalidArgument(format!("{name}: {slopes} ALiBi slopes is more than a launch takes")));
    }
    let b = attention_pointers(pc, name, &r)?;
    let workspace = r.workspace.map(|w| device_addr(pc.ctx, w, name).map(|a| (a, w.byte_len))).transpose()?;
    attention_launch(pc, name, dims, p, &b, variants, workspace)
}

fn prepare_mask_blk(pc: &PrepareContext<'_>, d: &Dispatch) -> Result<Launch> {
    let name = d.pipeline.name();
    let r = RecordedMaskBlk::decode(d)?.map_err(|Broken(what)| contract(name, what))?;
    let p = r.params;
    let (mask, blk) = (device_addr(pc.ctx, r.mask, name)?, device_addr(pc.ctx, r.blk, name)?);
    let tiles = p.table_bytes();
    let ctas = tiles.div_ceil(8);
    if ctas > i32::MAX as u64 {
        return Err(MlxError::InvalidArgument(format!("{name}: {tiles} tiles is more than one launch takes")));
    }
    let aligned =
        (mask % 16 == 0 && p.bk % 8 == 0 && p.mask_row_stride % 8 == 0 && p.mask_batch_stride % 8 == 0) as i32;
    let mut l = Launch::new([ctas.max(1) as u32, 1, 1], [256, 1, 1], 0);
    l.push_bytes(bytemuck::bytes_of(&p));
    l.push_ptr(mask);
    l.push_ptr(blk);
    l.push_bytes(&aligned.to_ne_bytes());
    Ok(l)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_blocks_have_their_sizes() {
        assert_eq!(std::mem::size_of::<FlashAttnPrefillParamsGpu>(), 224);
        assert_eq!(std::mem::size_of::<AttentionLaunch>(), 48);
        assert_eq!(std::mem::size_of::<PagedPointers>(), 24); // a paged module's Launch: 72 bytes
    }

    /// A params block of `rows` queries against `kv` cache rows with these flags and sides.
    fn described(rows: i32, kv: i32, flags: i32, window: i32, right: i32, offset: i32) -> FlashAttnPrefillParamsGpu {
        FlashAttnPrefillParamsGpu {
            batch: 1,
            rows,
            max_rows: rows,
            kv_len: kv,
            flags,
            window,
            window_right: right,
            offset,
            ..bytemuck::Zeroable::zeroed()
        }
    }

    /// Whether the kernels' reading of `p` (block_range.cuh's `visible`, with `off = offset +
    /// right`) lets row r see cache row j.
    fn kernel_sees(p: &FlashAttnPrefillParamsGpu, s: &MaskSides, r: i64, j: i64) -> bool {
        let offset = if p.flags & PREFILL_OFFSET != 0 { p.offset as i64 } else { (p.kv_len - p.rows) as i64 };
        let off = offset + s.right as i64;
        j < p.kv_len as i64 && (!s.bounded || j <= r + off) && (s.left == 0 || j > r + off - s.left as i64)
    }

    #[test]
    fn group_first_order_only_for_causal_triangles_of_few_waves() {
        let causal = MaskSides { bounded: true, right: 0, left: 0 };
        // Causal d256 8/8 heads at 8192 rows on 132 SMs: 512 CTAs (3.9 waves), dealt group
        // first; at 16384 rows (1024 CTAs, 7.8 waves) in the grid's order.
        assert!(group_first(&causal, 512, 132));
        assert!(group_first(&causal, 6 * 132, 132));
        assert!(!group_first(&causal, 6 * 132 + 1, 132));
        assert!(!group_first(&causal, 1024, 132));
        // Walks of equal length (no right bound, or a window's band): the grid's order.
        assert!(!group_first(&MaskSides { bounded: false, right: 0, left: 0 }, 512, 132));
        assert!(!group_first(&MaskSides { bounded: true, right: 0, left: 1024 }, 512, 132));
        assert!(!group_first(&causal, 512, 0));
    }

    #[test]
    fn the_described_sides_fold_the_right_bound_into_the_offset() {
        let wr = PREFILL_WINDOW_RIGHT;
        // Causal: right 0; a causal window w: the left span w.
        assert_eq!(
            MaskSides::of(&described(8, 8, PREFILL_CAUSAL, 0, 0, 0)),
            Ok(MaskSides { bounded: true, right: 0, left: 0 })
        );
        let s = MaskSides::of(&described(8, 90, PREFILL_CAUSAL, 5, 0, 0));
        assert_eq!(s, Ok(MaskSides { bounded: true, right: 0, left: 5 }));
        // A two-sided window (left 4, right 3: window 5): the span from the right edge is 8.
        let s = MaskSides::of(&described(40, 90, wr, 5, 3, 0));
        assert_eq!(s, Ok(MaskSides { bounded: true, right: 3, left: 8 }));
        // A window without a right side, and a right side without a window.
        assert_eq!(MaskSides::of(&described(40, 90, 0, 5, 0, 0)), Ok(MaskSides { bounded: false, right: 0, left: 5 }));
        assert_eq!(MaskSides::of(&described(40, 90, wr, 0, 2, 0)), Ok(MaskSides { bounded: true, right: 2, left: 0 }));
        // Sides that bind no row are left out: a right side of at least rows - 1 (the prompt
        // ends the cache), a window of at least the cache; with an offset, the cache's end.
        assert_eq!(
            MaskSides::of(&described(40, 90, wr, 0, 39, 0)),
            Ok(MaskSides { bounded: false, right: 0, left: 0 })
        );
        assert_eq!(
            MaskSides::of(&described(40, 90, wr, 0, 38, 0)),
            Ok(MaskSides { bounded: true, right: 38, left: 0 })
        );
        assert_eq!(
            MaskSides::of(&described(40, 90, wr, 90, i32::MAX, 0)),
            Ok(MaskSides { bounded: false, right: 0, left: 0 })
        );
        let off = PREFILL_OFFSET | wr;
        assert_eq!(
            MaskSides::of(&described(40, 90, off, 0, 79, 10)),
            Ok(MaskSides { bounded: false, right: 0, left: 0 })
        );
        assert_eq!(
            MaskSides::of(&described(40, 90, off, 0, 78, 10)),
            Ok(MaskSides { bounded: true, right: 78, left: 0 })
        );
        assert_eq!(
            MaskSides::of(&described(40, 90, off, 50, 5, 10)),
            Ok(MaskSides { bounded: true, right: 5, left: 0 })
        );
        assert_eq!(
            MaskSides::of(&described(40, 90, off, 49, 5, 10)),
            Ok(MaskSides { bounded: true, right: 5, left: 54 })
        );
        assert!(MaskSides::of(&described(40, 90, wr, 0, -1, 0)).is_err());
        assert!(MaskSides::of(&described(40, 90, 0, -1, 0, 0)).is_err());
        // Every pair, against SPEC 6's two-sided window (p - left <= j <= p + right,
        // p = r + offset): the same visibility, sides left out or not.
        for (rows, kv, offset) in [(40, 90, None), (70, 30, None), (20, 60, Some(-7)), (20, 60, Some(45))] {
            for (window, right) in
                [(0, None), (1, None), (5, None), (0, Some(0)), (1, Some(0)), (4, Some(3)), (200, Some(500))]
            {
                let mut flags = if right.is_some() { wr } else { 0 };
                if offset.is_some() {
                    flags |= PREFILL_OFFSET;
                }
                let p = described(rows, kv, flags, window, right.unwrap_or(0), offset.unwrap_or(0));
                let s = MaskSides::of(&p).unwrap();
                let o = offset.map_or((kv - rows) as i64, |o| o as i64);
                for r in 0..rows as i64 {
                    for j in 0..kv as i64 + 3 {
                        let pos = r + o;
                        let want = j < kv as i64
                            && right.is_none_or(|rr| j <= pos + rr as i64)
                            && (window == 0 || j > pos - window as i64);
                        assert_eq!(kernel_sees(&p, &s, r, j), want, "{p:?} {s:?} r {r} j {j}");
                    }
                }
            }
        }
    }

    #[test]
    fn each_kernel_states_its_shared_memory_and_pair_forms() {
        assert_eq!((KERNELS[0].shared_bytes)(false), Some(164_896));
        assert_eq!((KERNELS[0].shared_bytes)(true), Some(WS_SHARED_BYTES));
        assert_eq!(plain_shared_bytes(256, 256, true), Some(230_528));
        assert_eq!((KERNELS[1].shared_bytes)(true), Some(214_592));
        for (k, hd) in KERNELS.iter().zip([256, 512]) {
            let names: Vec<String> = PairMode::ALL.iter().map(|m| m.entry(hd)).collect();
            let entries: Vec<String> = k.hopper_variants.iter().map(|v| v.entry(k.entry)).collect();
            assert_eq!(entries, names);
            for m in PairMode::ALL {
                assert_eq!(m.variant(false).entry(k.entry), m.entry(hd));
            }
        }
        // Head dims 64 and 128: pair forms named after the kernel, launched with the
        // warp-specialised reserve; the plain forms keep two CTAs an SM.
        for name in [
            "flash_attn_prefill_d64",
            "flash_attn_prefill_d64_bf16",
            "flash_attn_prefill_d128",
            "flash_attn_prefill_d128_bf16",
        ] {
            let k = KERNELS.iter().find(|k| k.name == name).unwrap();
            assert!(k.hopper_form, "{name}");
            let mut want = vec![format!("{name}_pair_heads"), format!("{name}_pair_queries")];
            // Head dim 128 also has them in the shape without the explicit mask's tiles.
            if has_wide_entries(if name.contains("d128") { 128 } else { 64 }) {
                want.extend([format!("{name}_pair_heads_wide"), format!("{name}_pair_queries_wide")]);
                for m in PairMode::ALL {
                    assert_eq!(m.variant(true).entry(k.entry), format!("{}_wide", m.variant(false).entry(k.entry)));
                }
            }
            assert_eq!(
                name.contains("d128") && WIDE_LAUNCHED,
                want.len() == 4,
                "{name}: the wide forms are head dim 128's"
            );
            let entries: Vec<String> = k.hopper_variants.iter().map(|v| v.entry(k.entry)).collect();
            assert_eq!(entries, want);
            assert_eq!((k.shared_bytes)(true), Some(WS_SHARED_BYTES), "{name}: the limit covers the pair forms");
        }
        for hd in [64, 128] {
            assert_eq!(pair_shared_bytes(hd), Some(WS_SHARED_BYTES));
            let plain = plain_shared_bytes(hd, hd, true);
            assert_eq!(plain, Some(83_008));
            assert!(plain.is_some_and(|b| 2 * (b + 1024) <= 232_448), "two plain CTAs an SM at head dim {hd}");
        }
        assert_eq!(pair_shared_bytes(256), Some(WS_SHARED_BYTES));
        assert_eq!(pair_shared_bytes(512), Some(214_592));
    }

    /// Every attention kernel has a paged K/V module: the one-CTA Hopper form's `_paged`
    /// where it runs that form, else the portable form's `_paged` and `_xf_paged`; none of
    /// them is among the variants of the module every call loads (they are compiled only
    /// for a paged launch).
    #[test]
    fn each_attention_kernel_has_its_paged_entries_apart() {
        for k in KERNELS {
            assert_eq!(k.paged, k.merge_entry.is_some(), "{}", k.name);
            if k.quant {
                // Its paged entries are the paged quant module's (quant_variants).
                assert!(k.paged_variants(true).is_empty() && k.paged_variants(false).is_empty(), "{}", k.name);
                continue;
            }
            if !k.paged {
                assert!(k.paged_variants(true).is_empty() && k.paged_variants(false).is_empty());
                continue;
            }
            let names = |hopper| k.paged_variants(hopper).iter().map(|v| v.entry(k.entry)).collect::<Vec<_>>();
            if k.hopper_form && k.paged_pairs {
                // The pair forms' twins at head dims 64, 128 and 256 (paged_pair_form).
                let e = k.entry;
                assert_eq!(
                    names(true),
                    [format!("{e}_paged"), format!("{e}_pair_heads_paged"), format!("{e}_pair_queries_paged")]
                );
                assert!(k.hopper_variants.contains(&Variant::PairHeads), "{}", k.name);
            } else if k.hopper_form {
                assert_eq!(names(true), [format!("{}_paged", k.entry)]);
            }
            let d = k.name.trim_start_matches("flash_attn_prefill_d").split('_').next().unwrap();
            let pairs_here = k.hopper_variants.contains(&Variant::PairHeads) && paged_pair_form(d.parse().unwrap());
            assert_eq!(k.paged_pairs, pairs_here, "{}", k.name);
            assert_eq!(names(false), [format!("{}_paged", k.entry), format!("{}_xf_paged", k.entry)]);
            assert!(k.paged_variants(true).iter().chain(k.paged_variants(false)).all(|v| v.is_paged()));
            assert!(!k.hopper_variants.iter().chain(k.portable_variants).any(|v| v.is_paged()), "{}", k.name);
        }
        let others = super::super::flash_attn_prefill_tensor::KERNELS.iter();
        for k in others.chain(super::super::flash_attn_prefill_blk::KERNELS) {
            assert!(!k.paged, "{}: the origin op and the classifier read no paged K/V", k.name);
        }
    }

    /// The threads the host launches the warp-specialised pair forms with are the kernel's
    /// (`WS_THREADS`: the consumers' NTHREADS and a producer warpgroup), the head dims it
    /// launches them at are those whose row of the kernel's tile table names a pipeline
    /// (`PIPE` not 0), and the shared memory it reserves for them is the kernel's.
    #[test]
    fn the_warp_specialised_form_launches_the_kernels_threads() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders/flash_attn_prefill");
        let ws = std::fs::read_to_string(dir.join("mainloop_sm90_ws.cuh")).unwrap();
        assert!(ws.contains("#define WS_THREADS (NTHREADS + 128)"), "the kernel's thread count changed");
        let common = std::fs::read_to_string(dir.join("common.cuh")).unwrap();
        assert!(common.contains(&format!("#define NTHREADS {ATTENTION_THREADS}")));
        assert_eq!(WS_THREADS, ATTENTION_THREADS + 128);
        let entry = std::fs::read_to_string(dir.join("entry.cuh")).unwrap();
        assert!(entry.contains("#define MLXN_PAIR_WS(DIM) (hopper::Tiles<DIM>::PIPE != 0)"));
        assert!(entry.contains(
            "#define MLXN_PAIR_THREADS(DIM) (MLXN_PAIR_WS(DIM) ? 128 * (hopper::Tiles<DIM>::CONSUMERS + 1) : NTHREADS)"
        ));
        assert_eq!(ws_threads(128), WS_THREADS);
        assert_eq!(ws_threads(256), WS_THREADS);
        assert_eq!(ws_threads(64), 128 * (WS_CONSUMERS_D64 + 1));
        assert_eq!(pair_cta_rows(64), 64 * ws_consumers(64));
        let tiles = std::fs::read_to_string(dir.join("tiles_sm90.cuh")).unwrap();
        for hd in [64u32, 128, 256, 512] {
            let row = tiles.split(&format!("struct Tiles<{hd}> {{")).nth(1).expect("a row per head dim");
            let row = row.split("};").next().unwrap();
            let pipe = row.split("PIPE = ").nth(1).and_then(|r| r.split(',').next()).expect("PIPE in the row");
            assert_eq!(pipe.trim() != "0", ws_form(hd), "head dim {hd}: PIPE = {pipe}");
            if hd != 64 {
                assert!(row.contains("CONSUMERS = 2;"), "head dim {hd}: two consumer warpgroups");
            }
        }
        assert!(tiles.contains(&format!("#define MLXN_WS_CONSUMERS_D64 {WS_CONSUMERS_D64}\n")));
        let pipe = std::fs::read_to_string(dir.join("pipeline_sm90.cuh")).unwrap();
        assert!(pipe.contains(&format!("#define PIPE_SMEM_RESERVED {WS_SHARED_BYTES}\n")));
    }

    /// The shared memory the host reserves is what each instantiation file's compile-time
    /// check states for its `Cfg<DK, DV>` (the portable form).
    #[test]
    fn the_host_reserves_the_shared_memory_each_instantiation_checks() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders");
        let mut checked = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_none_or(|e| e != "cu") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            for line in text.lines().filter(|l| l.starts_with("static_assert(Cfg<")) {
                let inner = &line["static_assert(Cfg<".len()..];
                let (dims, rest) = inner.split_once(">::SMEM == ").unwrap();
                let (dk, dv) = dims.split_once(", ").unwrap();
                let bytes: u32 = rest.split(',').next().unwrap().trim().parse().unwrap();
                let (dk, dv) = (dk.parse().unwrap(), dv.parse().unwrap());
                assert_eq!(attention_shared_bytes(dk, dv, false), Some(bytes), "{}: {line}", path.display());
                checked += 1;
            }
        }
        let pairs = crate::ops::flash_attn_prefill::HEAD_DIMS.len();
        assert_eq!(checked, pairs, "one check per head-dim pair of the portable form");
        // Each kernel of a head-dim pair without the wgmma form reserves the portable bytes.
        for k in KERNELS.iter().filter(|k| k.name != "flash_attn_prefill_mask_blk") {
            let name = k.name.trim_end_matches("_kvq");
            let wgmma = ["_d64", "_d128", "_d256", "_d512"]
                .iter()
                .any(|d| name.ends_with(d) || name.contains(&format!("{d}_bf16")));
            assert_eq!((k.shared_bytes)(true) != (k.shared_bytes)(false), wgmma, "{}", k.name);
        }
    }

    /// Every quantised K/V kernel of the op (`QUANT_KV_KERNELS`) has its CUDA kernel: the F16
    /// kernel of its head dims run from the source's quant module, in the same form (Hopper
    /// where the F16 one has it) with the same shared memory and merge; its entry points are
    /// `<entry>_kvq` (and `_xf_kvq` in the portable form; in the Hopper form at head dims 64,
    /// 128 and 256 the pair forms `_pair_heads_kvq` and `_pair_queries_kvq`) and on paged K/V
    /// `<entry>_paged_kvq` (`_xf_paged_kvq`), none of them in any other module.
    #[test]
    fn each_quantised_kernel_runs_its_f16_kernel_from_the_quant_modules() {
        use crate::ops::flash_attn_prefill::{HEAD_DIMS, QUANT_KV_KERNELS};
        let quant: Vec<&CudaKernel> = KERNELS.iter().filter(|k| k.quant).collect();
        assert_eq!(quant.len(), QUANT_KV_KERNELS.len());
        for (dims, name) in QUANT_KV_KERNELS {
            let k = quant.iter().find(|k| k.name == name).unwrap_or_else(|| panic!("{name}: no CUDA kernel"));
            let f16_name = HEAD_DIMS.iter().find(|(d, _, _)| *d == dims).map(|(_, f16, _)| *f16).unwrap();
            let f16 = KERNELS.iter().find(|k| k.name == f16_name).unwrap();
            assert_eq!(k.entry, f16.entry, "{name}: the F16 kernel's entry point");
            assert_eq!(k.hopper_form, f16.hopper_form, "{name}");
            assert!(k.paged && !f16.quant);
            assert!(
                k.hopper_variants.is_empty() && k.portable_variants.is_empty(),
                "{name}: no contiguous-module entries"
            );
            assert_eq!(k.merge_entry, f16.merge_entry);
            for hopper in [false, true] {
                assert_eq!((k.shared_bytes)(hopper), (f16.shared_bytes)(hopper && f16.hopper_form), "{name}");
            }
            let names =
                |hopper, paged| k.quant_variants(hopper, paged).iter().map(|v| v.entry(k.entry)).collect::<Vec<_>>();
            let e = k.entry;
            // The Hopper form's pair forms on FP8 K/V at head dims 64, 128 and 256.
            let pairs_here = k.hopper_form && quant_pair_form(dims.0);
            assert_eq!(k.quant_pairs, pairs_here, "{name}");
            if pairs_here {
                let want = [format!("{e}_kvq"), format!("{e}_pair_heads_kvq"), format!("{e}_pair_queries_kvq")];
                assert_eq!(names(true, false), want);
            } else if k.hopper_form {
                assert_eq!(names(true, false), [format!("{e}_kvq")]);
            }
            if k.hopper_form {
                assert_eq!(names(true, true), [format!("{e}_paged_kvq")]);
            }
            assert_eq!(names(false, false), [format!("{e}_kvq"), format!("{e}_xf_kvq")]);
            assert_eq!(names(false, true), [format!("{e}_paged_kvq"), format!("{e}_xf_paged_kvq")]);
            for hopper in [false, true] {
                assert!(k.module_variants(ModuleKind::CONTIGUOUS, hopper).is_empty());
                assert!(k.module_variants(ModuleKind::PAGED, hopper).is_empty());
                for module in [ModuleKind::QUANT, ModuleKind::PAGED_QUANT] {
                    let vs = k.module_variants(module, hopper);
                    assert!(!vs.is_empty() && vs.iter().all(|v| v.module() == module), "{name} {module:?}");
                    // The module's plain entry point is the first of them.
                    assert_eq!(module.plain_variant(), Some(vs[0]));
                }
            }
        }
        // No other kernel has quant entry points, and none of its modules lists one.
        for k in KERNELS.iter().filter(|k| !k.quant) {
            for hopper in [false, true] {
                assert!(k.quant_variants(hopper, false).is_empty() && k.quant_variants(hopper, true).is_empty());
                for module in [ModuleKind::CONTIGUOUS, ModuleKind::PAGED] {
                    assert!(k.module_variants(module, hopper).iter().all(|v| !v.is_quant()), "{}", k.name);
                }
            }
        }
    }

    /// The entry point a launch runs: its module's (paged, quant, both; with or without the
    /// transforms), never a pair form outside the contiguous module.
    #[test]
    fn a_launch_runs_its_modules_entry_point() {
        let all = [ModuleKind::CONTIGUOUS, ModuleKind::PAGED, ModuleKind::QUANT, ModuleKind::PAGED_QUANT];
        for module in all {
            for transforms in [false, true] {
                for pair in [None, Some(Variant::PairHeads), Some(Variant::PairQueriesWide)] {
                    let v = entry_variant(module, transforms, pair);
                    let twin = pair.and_then(|p| p.paged_pair());
                    let quant_twin = pair.and_then(|p| p.quant_pair());
                    let want = match (module == ModuleKind::CONTIGUOUS, transforms) {
                        (true, false) => pair,
                        (false, false) if module == ModuleKind::PAGED && twin.is_some() => twin,
                        (false, false) if module == ModuleKind::QUANT && quant_twin.is_some() => quant_twin,
                        _ => Variant::of_module(module, transforms),
                    };
                    assert_eq!(v, want);
                    assert_eq!(v.map_or(ModuleKind::CONTIGUOUS, |v| v.module()), module, "{module:?} {transforms}");
                }
            }
        }
        assert_eq!(entry_variant(ModuleKind::QUANT, false, None), Some(Variant::Quant));
        assert_eq!(entry_variant(ModuleKind::QUANT, true, None), Some(Variant::QuantScoreTransforms));
        assert_eq!(entry_variant(ModuleKind::PAGED_QUANT, false, Some(Variant::PairHeads)), Some(Variant::PagedQuant));
        assert_eq!(entry_variant(ModuleKind::PAGED_QUANT, true, None), Some(Variant::PagedQuantScoreTransforms));
        assert_eq!(Variant::PagedQuantScoreTransforms.entry("e"), "e_xf_paged_kvq");
        // A pair form on paged K/V runs its twin in the paged module.
        assert_eq!(entry_variant(ModuleKind::PAGED, false, Some(Variant::PairHeads)), Some(Variant::PairHeadsPaged));
        assert_eq!(
            entry_variant(ModuleKind::PAGED, false, Some(Variant::PairQueries)),
            Some(Variant::PairQueriesPaged)
        );
        assert_eq!(Variant::PairQueriesPaged.entry("e"), "e_pair_queries_paged");
        // And on quantised K/V its twin in the quant module (the paged quant module has none).
        assert_eq!(entry_variant(ModuleKind::QUANT, false, Some(Variant::PairHeads)), Some(Variant::PairHeadsQuant));
        assert_eq!(
            entry_variant(ModuleKind::QUANT, false, Some(Variant::PairQueries)),
            Some(Variant::PairQueriesQuant)
        );
        assert_eq!(
            entry_variant(ModuleKind::QUANT, true, Some(Variant::PairHeads)),
            Some(Variant::QuantScoreTransforms)
        );
        assert_eq!(Variant::PairQueriesQuant.entry("e"), "e_pair_queries_kvq");
    }

    /// The launch block of each module is the device's `Launch` (params.cuh's check): 48
    /// bytes, the paged tail 24, the quant tail (the descale factors' address) 8 after it.
    #[test]
    fn each_modules_launch_block_is_the_devices() {
        let block: AttentionLaunch = bytemuck::Zeroable::zeroed();
        let pages = PagedPointers { block_table: 1, seqused_k: 2, table_stride: 3, block_size: 4 };
        assert_eq!(launch_block(&block, None, None).len(), 48);
        assert_eq!(launch_block(&block, Some(pages), None).len(), 72);
        assert_eq!(launch_block(&block, None, Some(0)).len(), 56);
        let both = launch_block(&block, Some(pages), Some(0x1234_5678_9abc));
        assert_eq!(both.len(), 80);
        assert_eq!(both[72..], 0x1234_5678_9abc_u64.to_ne_bytes(), "the descale pointer last");
        let params = include_str!("../../../../shaders/flash_attn_prefill/params.cuh");
        assert!(params.contains(
            "static_assert(sizeof(Launch) == 48 + (MLXN_PAGED_ENTRIES ? 24 : 0) + (MLXN_QUANT_ENTRIES ? 8 : 0),"
        ));
        let q = params.split("#if MLXN_QUANT_ENTRIES\n").nth(1).expect("the quant fields of Launch");
        let fields = q.split("#endif").next().unwrap();
        let code: Vec<&str> = fields.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with("//")).collect();
        assert_eq!(code, ["const float* descale;"], "one field: the descale pointer");
        assert!(fields.contains("const float* descale;"));
        assert!(params.contains("#define PREFILL_DESCALE 512"));
        assert_eq!(crate::params::PREFILL_DESCALE, 512);
        for (code, name) in [(7, "DT_F8E4M3"), (8, "DT_F8E5M2"), (9, "DT_Q8_0")] {
            assert!(params.contains(&format!("#define {name} {code}\n")), "{name}");
            assert!(is_quantised_code(code));
        }
        assert!(!(0..=2).any(is_quantised_code));
    }

    /// The alignment flags of K/V as each format's loader reads them: 16-bit K/V, 16 bytes
    /// (8 elements); FP8, 16 bytes (16 elements); Q8_0, even addresses and strides.
    #[test]
    fn quantised_kv_alignment_is_each_loaders() {
        for code in [0, 1, 2] {
            assert!(kv_aligned(code, 4096, [1024, 128, 8]));
            assert!(!kv_aligned(code, 4096, [1024, 128, 4]));
            assert!(!kv_aligned(code, 4104, [1024, 128, 8]));
        }
        for code in [7, 8] {
            assert!(kv_aligned(code, 4096, [2048, 256, 128]));
            assert!(kv_aligned(code, 4096, [0, 16, 16]));
            assert!(!kv_aligned(code, 4096, [2048, 256, 8]), "8 bytes: no 16-byte loads");
            assert!(!kv_aligned(code, 4104, [2048, 256, 128]));
        }
        // Q8_0: rows of 34-byte blocks (head dim 128: 136 bytes).
        assert!(kv_aligned(9, 4098, [136 * 64, 136 * 2, 136]));
        assert!(!kv_aligned(9, 4097, [136 * 64, 136 * 2, 136]));
        assert!(!kv_aligned(9, 4098, [136 * 64, 273, 136]));
    }
}
