//! The work item of the CPU prefill kernels (`flash_attn_prefill_d*`, and through them the
//! origin's `flash_attn_prefill_tensor_f16_d*`): SPEC sections 2 and 6-10 for one sequence,
//! one KV head and up to four consecutive query tiles, at Q/K head dim `DK` and V/O head dim
//! `DV` (they differ only at (576, 512)).
//!
//! The K/V tile of a step is converted to f32 once and used by every query head of the KV
//! head and every query tile of the item, while each query tile follows its own class: the
//! description's (causal, window, the cache's end) combined with the explicit mask's table.
//! Scores are kept transposed (`[cache row][query row]`) so the per-row max, exp, half
//! rounding and sums run across SIMD lanes without horizontal reductions; in a partly
//! visible step a tile computes only the cache rows some of its rows can see (from the
//! description arithmetically, from the explicit mask by its -inf columns). Scratch is per
//! thread and reused, so the hot loop allocates nothing.
//!
//! SPEC 10's score transforms sit between the scores and the softmax: softcap on every
//! computed score, ALiBi as each head's slope on the explicit mask (or, without one, on the
//! described mask's distance `j - (r + offset)`), and the sinks once per row at the end (the
//! running max and sum of the cache's scores are combined with the sink's logit then, which
//! is exact and keeps P relative to the scores' own max, where half rounds it finest).
//! K and V are F16 or BF16 (`Problem::kv_bf16`), widened to f32 where each tile is loaded.

use std::cell::RefCell;

use super::simd::{Portable, Simd};
use super::SendPtr;

mod amx;
mod amx_layout;
mod fma;
mod io;
mod pages;
mod softmax;
mod transforms;

pub(in crate::backend::cpu) use amx_layout::aligned;
use fma::work_item;
pub(in crate::backend::cpu) use pages::{Pages, Quant, QuantFormat};
use transforms::load_mask;

/// Cache rows per step (the tables' `bk`).
pub(super) const C: usize = 64;

/// Most query tiles one work item takes.
pub(super) const MAX_NT: usize = 4;

/// Query tiles per work item for `rows_per_tile` rows (bq times the heads sharing a KV
/// head) at head dim `d`: enough for about 64K elements of Q (256 rows at 256, 128 at 512),
/// so that the conversion of each K/V tile to f32 is shared by that many rows while Q^T
/// and O stay within L2 (64-row items spent about 4% more than 256-row ones).
pub(super) fn tiles_per_item(rows_per_tile: usize, d: usize) -> usize {
    (65536 / d / rows_per_tile).clamp(1, MAX_NT)
}

/// No right bound ([`Problem::right`]).
pub(super) const NO_RIGHT: i64 = i64::MAX / 4;

/// Element types of K and V. F32 K/V are addressed in u16 units (strides and offsets doubled
/// by the kernel's entry), so only a row's column index needs the element's width
/// ([`fma::load_kv`]). Quantised K/V (SPEC 11) are bytes, which the loaders widen to f32 as
/// they widen halves: FP8 with the KV head's descale factor (`Problem::kv` holds 1;
/// [`Problem::kv_of`] the head's), Q8_0 with each block's scale. Their rows are addressed
/// in u16 units too, from row pointers and strides that [`pages::step_rows`] makes even.
#[derive(Clone, Copy, PartialEq, Debug)]
pub(super) enum Kv {
    F16,
    BF16,
    F32,
    E4M3(f32),
    E5M2(f32),
    Q8_0,
}

/// Element types of Q and O, by their `DType` codes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Elem {
    F32,
    F16,
    BF16,
}

impl Elem {
    pub(super) fn from_code(code: i32) -> Option<Elem> {
        match code {
            0 => Some(Elem::F32),
            1 => Some(Elem::F16),
            2 => Some(Elem::BF16),
            _ => None,
        }
    }
}

/// Everything a work item reads that is the same for every sequence, as plain numbers and
/// pointers (strides in elements).
#[derive(Clone, Copy)]
pub(super) struct Problem {
    pub group: usize,
    /// Query rows of one tile.
    pub bq: usize,
    /// Query tiles per work item (they share each K/V tile's conversion).
    pub nt: usize,
    pub q_rs: usize,
    pub q_hs: usize,
    pub k_rs: usize,
    pub k_hs: usize,
    pub v_rs: usize,
    pub v_hs: usize,
    pub o_rs: usize,
    pub o_hs: usize,
    pub mask_rs: usize,
    pub lse_hs: usize,
    pub scale: f32,
    pub column_skip: bool,
    /// The right bound of the description: row r (at cache position p) sees only `j <= p +
    /// right` (0 for causal, a two-sided window's right side), or [`NO_RIGHT`] for none.
    pub right: i64,
    /// `w` of a window-`w` mask (its left side `w - 1`), 0 for none.
    pub window: usize,
    /// An explicit mask and its table are bound.
    pub has_mask: bool,
    pub has_lse: bool,
    /// K and V's element type.
    pub kv: Kv,
    /// SPEC 10: `s = softcap * tanh(s / softcap)` when above 0.
    pub softcap: f32,
    /// ALiBi on the positions: each computed score gains `-slope_h * |p - j|` (`max_bias`
    /// without an explicit mask, where visible pairs have `j <= p`, or slopes given as data).
    pub alibi_distance: bool,
    /// `[n_heads]`: each head's ALiBi slope (1 without ALiBi), scaling the explicit mask.
    pub slopes: *const f32,
    /// The slopes of [`Problem::alibi_distance`]: `[n_heads]` from sequence `Seq::alibi`.
    pub dist_slopes: *const f32,
    /// `[n_heads]` F32 sink logits, or null for none.
    pub sinks: *const f32,
    pub q_dtype: Elem,
    pub o_dtype: Elem,
    /// The table's columns per row and query rows per row.
    pub blk_steps: usize,
    pub blk_bq: usize,
    pub q: *const u8,
    pub k: *const u16,
    pub v: *const u16,
    pub mask: *const u16,
    pub blk: *const u8,
    pub out: SendPtr<u8>,
    pub lse: SendPtr<f32>,
    /// The bf16 products of the AMX item for this K/V dtype (`cpu::amx::products`).
    pub amx: super::amx::Products,
    /// K and V^T in the AMX item's layouts, packed once for every item ([`pick_pack`]), or
    /// null where each item packs its own steps.
    pub packed: *const u16,
    /// Paged K/V (SPEC 11): `k` and `v` are caches of blocks read through a block table
    /// ([`pages`]); `None`: each sequence's rows are contiguous from `Seq::k` / `Seq::v`.
    pub pages: Option<Pages>,
    /// Quantised K/V (SPEC 11): `k` and `v` hold bytes of this format (strides in bytes),
    /// which the loaders widen as they read them (`kv` is `Kv::E4M3`, `E5M2` or `Q8_0`;
    /// FP8's factors through [`Problem::kv_of`]).
    pub quant: Option<Quant>,
}

// SAFETY: read-only inputs, and outputs every item writes a disjoint part of.
unsafe impl Send for Problem {}
unsafe impl Sync for Problem {}

/// One sequence: its lengths, where its query rows sit in its cache, and where its data
/// starts (element offsets; bytes for the table).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Seq {
    pub lq: usize,
    pub lk: usize,
    /// Query row r is at position `r + off` of the cache (SPEC 6: `Lk - Lq`, the prompt at the
    /// cache's end, unless the block gives an offset).
    pub off: i64,
    pub q: usize,
    pub k: usize,
    pub v: usize,
    pub o: usize,
    pub lse: usize,
    pub mask: usize,
    pub blk: usize,
    /// The sequence's first element of `Problem::dist_slopes`.
    pub alibi: usize,
    /// The sequence's first element of `Problem::packed` (KV head g's part `g *
    /// packed_len(lk)` further).
    pub packed: usize,
    /// Paged K/V: the sequence's first entry of the block table (`Problem::pages`).
    pub table: usize,
}

/// Packs one step of one sequence's KV head into its part of `Problem::packed`.
pub(super) type PackFn = unsafe fn(&Problem, &Seq, usize, usize);

/// The elements of one KV head's part of `Problem::packed` for a cache of `lk` rows
/// ([`amx::pack_step`]'s layout).
pub(super) fn packed_len<const DK: usize, const DV: usize>(lk: usize) -> usize {
    amx::packed_len::<DK, DV>(lk)
}

/// The packing of K/V steps shared by every work item, where the AMX item runs (hardware or
/// emulated tiles) and K/V are BF16 (their pairs are the rows' own bits, one part each): an
/// item then reads each step's K and V^T where they were packed once, instead of packing
/// them itself as every item that sees the step did (up to 16 items at 2048 rows).
pub(super) fn pick_pack<const DK: usize, const DV: usize>(kv: Kv, isa: &'static str) -> Option<PackFn> {
    if kv != Kv::BF16 {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        if isa == super::simd::AMX || (isa == super::simd::AMX_EMULATED && super::simd::has_avx512()) {
            return Some(pack_avx512::<DK, DV>);
        }
        if isa == super::simd::AMX_EMULATED && super::simd::has_avx2() {
            return Some(pack_avx2::<DK, DV>);
        }
    }
    (isa == super::simd::AMX_EMULATED).then_some(pack_portable::<DK, DV> as PackFn)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn pack_avx512<const DK: usize, const DV: usize>(pb: &Problem, seq: &Seq, g: usize, step: usize) {
    amx::pack_step::<super::simd::Avx512, DK, DV>(pb, seq, g, step)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pack_avx2<const DK: usize, const DV: usize>(pb: &Problem, seq: &Seq, g: usize, step: usize) {
    amx::pack_step::<super::simd::Avx2, DK, DV>(pb, seq, g, step)
}

unsafe fn pack_portable<const DK: usize, const DV: usize>(pb: &Problem, seq: &Seq, g: usize, step: usize) {
    amx::pack_step::<Portable, DK, DV>(pb, seq, g, step)
}

/// The work-item function for the instruction set in use.
pub(super) type ItemFn = unsafe fn(&Problem, &Seq, usize, usize, &mut Scratch);

/// The work item at head dims (`DK`, `DV`) for the instruction set `isa`.
pub(super) fn pick<const DK: usize, const DV: usize>(isa: &'static str) -> ItemFn {
    if isa == super::simd::AMX_EMULATED {
        return pick_emulated::<DK, DV>();
    }
    #[cfg(target_arch = "x86_64")]
    {
        match isa {
            super::simd::AMX => return item_amx::<DK, DV>,
            "avx512" => return item_avx512::<DK, DV>,
            "avx2+fma+f16c" => return item_avx2::<DK, DV>,
            _ => {}
        }
    }
    item_portable::<DK, DV>
}

/// The AMX item on the emulated tile unit, its vector work on the best instruction set
/// here (so that on an AMX machine it runs the hardware item's code but for the tiles).
fn pick_emulated<const DK: usize, const DV: usize>() -> ItemFn {
    #[cfg(target_arch = "x86_64")]
    {
        if super::simd::has_avx512() {
            return item_amx_emulated_avx512::<DK, DV>;
        }
        if super::simd::has_avx2() {
            return item_amx_emulated_avx2::<DK, DV>;
        }
    }
    item_amx_emulated_portable::<DK, DV>
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn item_amx<const DK: usize, const DV: usize>(pb: &Problem, seq: &Seq, grp: usize, g: usize, s: &mut Scratch) {
    let mut tiles = super::amx::HwTiles;
    amx::work_item::<super::simd::Avx512, _, DK, DV>(pb, seq, grp, g, s, &mut tiles)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn item_amx_emulated_avx512<const DK: usize, const DV: usize>(
    pb: &Problem,
    seq: &Seq,
    grp: usize,
    g: usize,
    s: &mut Scratch,
) {
    let mut tiles = super::amx::EmulatedTiles::default();
    amx::work_item::<super::simd::Avx512, _, DK, DV>(pb, seq, grp, g, s, &mut tiles)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn item_amx_emulated_avx2<const DK: usize, const DV: usize>(
    pb: &Problem,
    seq: &Seq,
    grp: usize,
    g: usize,
    s: &mut Scratch,
) {
    let mut tiles = super::amx::EmulatedTiles::default();
    amx::work_item::<super::simd::Avx2, _, DK, DV>(pb, seq, grp, g, s, &mut tiles)
}

unsafe fn item_amx_emulated_portable<const DK: usize, const DV: usize>(
    pb: &Problem,
    seq: &Seq,
    grp: usize,
    g: usize,
    s: &mut Scratch,
) {
    let mut tiles = super::amx::EmulatedTiles::default();
    amx::work_item::<Portable, _, DK, DV>(pb, seq, grp, g, s, &mut tiles)
}

unsafe fn item_portable<const DK: usize, const DV: usize>(
    pb: &Problem,
    seq: &Seq,
    grp: usize,
    g: usize,
    s: &mut Scratch,
) {
    work_item::<Portable, DK, DV>(pb, seq, grp, g, s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn item_avx512<const DK: usize, const DV: usize>(
    pb: &Problem,
    seq: &Seq,
    grp: usize,
    g: usize,
    s: &mut Scratch,
) {
    work_item::<super::simd::Avx512, DK, DV>(pb, seq, grp, g, s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn item_avx2<const DK: usize, const DV: usize>(pb: &Problem, seq: &Seq, grp: usize, g: usize, s: &mut Scratch) {
    work_item::<super::simd::Avx2, DK, DV>(pb, seq, grp, g, s)
}

/// Per-thread working memory of a work item, grown on demand and reused.
#[derive(Default)]
pub(super) struct Scratch {
    /// Q^T, `[DK][R]`: the item's query rows, scaled and rounded to half.
    qt: Vec<f32>,
    /// O, `[R][DV]`: unnormalised output accumulators.
    o: Vec<f32>,
    /// Scores then probabilities, transposed: `[C][R]`.
    st: Vec<f32>,
    /// K of one step in f32, `[C][DK]`.
    kf: Vec<f32>,
    /// One slice of V's columns of one step in f32, `[C][V_SPAN]`.
    vf: Vec<f32>,
    /// One step of mask rows, `[bq][C]`, then transposed to `[C][bq]` per tile.
    mrow: Vec<f32>,
    mt: Vec<f32>,
    /// Running max, running sum, and this step's rescale factor, `[R]` each.
    m: Vec<f32>,
    l: Vec<f32>,
    ms: Vec<f32>,
    /// The AMX item's running sum of P before its rounding to bfloat16, `[R]` (lse's).
    ls: Vec<f32>,
    /// The AMX item's operands in the tiles' layouts.
    amx: amx::Buffers,
    /// Paged K/V: a step's K and V rows gathered from the blocks it spans (`pages::step_rows`).
    kpage: Vec<u16>,
    vpage: Vec<u16>,
}

thread_local! {
    pub(super) static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

fn grow(v: &mut Vec<f32>, n: usize) {
    if v.len() < n {
        v.resize(n, 0.0);
    }
}

/// Tile classes (SPEC 1 and 6): nothing visible, some visible or masked, all visible.
const SKIP: u8 = 0;
const PARTIAL: u8 = 1;
const FULL: u8 = 2;

/// One query tile of a work item, and what it does in the current step.
#[derive(Clone, Copy, Default)]
struct Sub {
    /// First query row (of the sequence), and rows below the prompt's end (0 for a tile past it).
    r0: usize,
    nr: usize,
    /// The item's rows of this tile: `[ib, ie)`.
    ib: usize,
    ie: usize,
    /// This step: add the explicit mask; add the ALiBi distance; hide the pairs the
    /// description does not see; the cache rows `[lo, hi)` it computes (empty: none).
    add: bool,
    distance: bool,
    hide: bool,
    lo: usize,
    hi: usize,
}

/// The description's class of the step at `c0` (`n` cache rows of it exist) for query rows
/// `r0 .. r0 + nr` of a sequence, and the range of the step's columns some of them see
/// (relative to `c0`, unrounded).
#[inline(always)]
fn describe(pb: &Problem, seq: &Seq, r0: usize, nr: usize, c0: usize, n: usize) -> (u8, usize, usize) {
    let off = seq.off;
    let (first, last, w) = (r0 as i64 + off, (r0 + nr - 1) as i64 + off, pb.window as i64);
    let (c0i, end) = (c0 as i64, (c0 + n) as i64);
    // Row r sees [r + off - w + 1, r + off + right] (window, right bound) within [0, Lk): the union over
    // consecutive rows is one range.
    let right = pb.right;
    let lo = if w > 0 { first - w + 1 } else { 0 }.max(c0i);
    let hi = if right != NO_RIGHT { last + right + 1 } else { end }.min(end);
    if lo >= hi {
        return (SKIP, C, 0);
    }
    let all = n == C && (right == NO_RIGHT || c0i + C as i64 - 1 <= first + right) && (w == 0 || c0i > last - w);
    (if all { FULL } else { PARTIAL }, (lo - c0i) as usize, (hi - c0i) as usize)
}

/// The explicit mask's class of the step for query rows `r0 .. r0 + nr`: the bytes of every
/// table row they cover (one where the table's tiles are as tall as ours).
#[inline(always)]
unsafe fn table_class(pb: &Problem, seq: &Seq, r0: usize, nr: usize, step: usize) -> u8 {
    let (mut all_skip, mut all_full) = (true, true);
    for t in r0 / pb.blk_bq..=(r0 + nr - 1) / pb.blk_bq {
        let b = *pb.blk.add(seq.blk + t * pb.blk_steps + step);
        all_skip &= b == SKIP;
        all_full &= b == FULL;
    }
    if all_skip {
        SKIP
    } else if all_full {
        FULL
    } else {
        PARTIAL
    }
}

/// The item's query tiles: tile `k` is query tile `grp * nt + k` of the sequence, rows
/// `[k * per, (k + 1) * per)` of the item (`per = bq * group`); a tile past the prompt has no rows.
#[inline(always)]
fn item_subs(pb: &Problem, seq: &Seq, grp: usize) -> [Sub; MAX_NT] {
    let (bq, nt) = (pb.bq, pb.nt);
    let per = bq * pb.group;
    let q_tiles = seq.lq.div_ceil(bq);
    let mut subs = [Sub::default(); MAX_NT];
    for (k, sub) in subs.iter_mut().enumerate().take(nt) {
        let qt = grp * nt + k;
        let r0 = qt * bq;
        let nr = if qt < q_tiles { bq.min(seq.lq - r0) } else { 0 };
        *sub = Sub { r0, nr, ib: k * per, ie: (k + 1) * per, ..Sub::default() };
    }
    subs
}

/// The online softmax's starting state of `r` rows: max `-FLT_MAX / 2`, sum 0 (SPEC 2).
#[inline(always)]
unsafe fn start_rows(m: *mut f32, l: *mut f32, r: usize) {
    for i in 0..r {
        *m.add(i) = -f32::MAX / 2.0;
        *l.add(i) = 0.0;
    }
}

/// What each query tile of the item does in the step at `c0` (`n` of its cache rows exist):
/// its class from the description and the explicit mask's table (the mask loaded into `mt`
/// where partial), and the cache rows `[lo, hi)` it computes; returns the union of those
/// ranges (empty: nothing to do).
///
/// Per tile, cache rows `[lo, hi)` (multiples of 4) hold every one the tile's rows may see;
/// the others are -inf for all of them, so their p is exactly 0 and leaving them out changes
/// no bit (K and V are finite). On the diagonal of a causal mask and at the edge of a window
/// this skips up to three quarters of a step.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn plan_step<S: Simd>(
    pb: &Problem,
    seq: &Seq,
    subs: &mut [Sub],
    mrow: *mut f32,
    mt: *mut f32,
    step: usize,
    c0: usize,
    n: usize,
) -> (usize, usize) {
    let bq = pb.bq;
    let (mut lo_all, mut hi_all) = (C, 0);
    for (k, sub) in subs.iter_mut().enumerate() {
        (sub.add, sub.distance, sub.hide, sub.lo, sub.hi) = (false, false, false, C, 0);
        if sub.nr == 0 {
            continue;
        }
        let (dc, dlo, dhi) = describe(pb, seq, sub.r0, sub.nr, c0, n);
        if dc == SKIP {
            continue;
        }
        let tc = if pb.has_mask { table_class(pb, seq, sub.r0, sub.nr, step) } else { FULL };
        if tc == SKIP {
            continue;
        }
        let (mut lo, mut hi) = if dc == FULL { (0, C) } else { (dlo & !3, ((dhi + 3) & !3).min(C)) };
        if tc == PARTIAL {
            let mask = pb.mask.add(seq.mask);
            let (mlo, mhi) = load_mask::<S>(pb, mask, mrow, mt.add(k * C * bq), sub.r0, sub.nr, c0, n);
            (lo, hi) = (lo.max(mlo), hi.min(mhi));
        }
        if !pb.column_skip {
            (lo, hi) = (0, C);
        }
        (sub.add, sub.hide, sub.lo, sub.hi) = (tc == PARTIAL, dc == PARTIAL, lo, hi);
        // ALiBi on the description: every computed pair has its own distance.
        sub.distance = pb.alibi_distance;
        if lo < hi {
            lo_all = lo_all.min(lo);
            hi_all = hi_all.max(hi);
        }
    }
    (lo_all, hi_all)
}

/// Query tile `k`'s block of a per-tile buffer of the AMX item (its layouts, `amx_layout`; its
/// Q^T and O^T, `io`) (`[tile][rows][ld]`, `width` elements per
/// entry: 1 for f32, 2 for a bfloat16 pair), as the pointer the item's query row index
/// addresses: entry (j, i) of the tile's rows `k * per <= i < (k + 1) * per` lies at
/// `view + (j * ld + i) * width`. The view is the block's start less `k * per` entries:
/// inside the buffer (at or after its start) since `rows * ld >= per`.
#[inline(always)]
unsafe fn tile_view<E>(buf: *mut E, k: usize, per: usize, ld: usize, rows: usize, width: usize) -> *mut E {
    buf.add(k * (rows * ld - per) * width)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problem(causal: bool, window: usize) -> Problem {
        Problem {
            group: 1,
            bq: 32,
            nt: 1,
            q_rs: 0,
            q_hs: 0,
            k_rs: 0,
            k_hs: 0,
            v_rs: 0,
            v_hs: 0,
            o_rs: 0,
            o_hs: 0,
            mask_rs: 0,
            lse_hs: 0,
            scale: 1.0,
            column_skip: true,
            right: if causal { 0 } else { NO_RIGHT },
            window,
            has_mask: false,
            has_lse: false,
            kv: Kv::F16,
            softcap: 0.0,
            alibi_distance: false,
            slopes: std::ptr::null(),
            dist_slopes: std::ptr::null(),
            sinks: std::ptr::null(),
            q_dtype: Elem::F32,
            o_dtype: Elem::F32,
            blk_steps: 0,
            blk_bq: 32,
            q: std::ptr::null(),
            k: std::ptr::null(),
            v: std::ptr::null(),
            mask: std::ptr::null(),
            blk: std::ptr::null(),
            out: SendPtr(std::ptr::null_mut()),
            lse: SendPtr(std::ptr::null_mut()),
            amx: crate::backend::cpu::amx::DEFAULT_F16,
            packed: std::ptr::null(),
            pages: None,
            quant: None,
        }
    }

    /// The description's class and range against visibility pair by pair, for every
    /// offset of the prompt in its cache up to 70 (so the diagonal and the window's edge
    /// meet every alignment with the tiles), offsets a block gives (negative, past the
    /// cache, with a cache shorter than the prompt) and windows on either side of tile sizes.
    #[test]
    fn the_description_classifies_as_its_pairs_say() {
        let mut shapes = vec![(40usize, 20usize), (70, 3), (33, 64)]; // lk < lq: not causal only
        for lq in [1, 5, 33, 70] {
            shapes.extend((0..=70).map(|off| (lq, lq + off)));
        }
        let descriptions = [
            (false, 0),
            (true, 0),
            (true, 1),
            (true, 2),
            (true, 15),
            (true, 31),
            (true, 32),
            (true, 47),
            (true, 63),
            (true, 64),
            (true, 79),
            (true, 95),
            (true, 100),
        ];
        for bq in [32, 16] {
            for (causal, window) in descriptions {
                let pb = Problem { bq, ..problem(causal, window) };
                // The prompt at the cache's end, and offsets a block gives (context
                // parallelism: a chunk of queries before, inside or past a chunk of the cache).
                let placed = shapes
                    .iter()
                    .filter(|&&(lq, lk)| !causal || lk >= lq)
                    .map(|&(lq, lk)| (lq, lk, lk as i64 - lq as i64));
                let given = [(33usize, 100usize, -40i64), (33, 100, -1), (70, 20, 5), (5, 64, 200), (40, 130, 17)];
                for (lq, lk, off) in placed.chain(given.into_iter().filter(|_| causal)) {
                    let seq = Seq { lq, lk, off, ..Seq::default() };
                    let visible = |r: usize, j: usize| {
                        let (r, j) = (r as i64, j as i64);
                        j < lk as i64 && (!causal || j <= r + off) && (window == 0 || j > r + off - window as i64)
                    };
                    for r0 in (0..lq).step_by(bq) {
                        let nr = bq.min(lq - r0);
                        for c0 in (0..lk).step_by(C) {
                            let n = C.min(lk - c0);
                            let (class, lo, hi) = describe(&pb, &seq, r0, nr, c0, n);
                            let (mut seen, mut lo_want, mut hi_want) = (0, C, 0);
                            for r in r0..r0 + nr {
                                for j in c0..c0 + C {
                                    if visible(r, j) {
                                        seen += 1;
                                        lo_want = lo_want.min(j - c0);
                                        hi_want = hi_want.max(j - c0 + 1);
                                    }
                                }
                            }
                            let want = if seen == 0 {
                                SKIP
                            } else if seen == nr * C {
                                FULL
                            } else {
                                PARTIAL
                            };
                            let at = format!(
                                "bq {bq} causal {causal} window {window} lq {lq} lk {lk} off {off} r0 {r0} c0 {c0}"
                            );
                            assert_eq!(class, want, "{at}");
                            if class != SKIP {
                                assert_eq!((lo, hi), (lo_want, hi_want), "{at}");
                            }
                        }
                    }
                }
            }
        }
    }
}
