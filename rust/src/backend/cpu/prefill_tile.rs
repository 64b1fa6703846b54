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

use super::simd::{Portable, Simd, W};
use super::SendPtr;

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
    pub causal: bool,
    /// `w` of a window-`w` mask, 0 for none.
    pub window: usize,
    /// An explicit mask and its table are bound.
    pub has_mask: bool,
    pub has_lse: bool,
    /// K and V are BF16 (else F16).
    pub kv_bf16: bool,
    /// SPEC 10: `s = softcap * tanh(s / softcap)` when above 0.
    pub softcap: f32,
    /// SPEC 10: the described mask's ALiBi distance is added (ALiBi without an explicit mask).
    pub alibi_distance: bool,
    /// `[n_heads]`: each head's ALiBi slope (1 without ALiBi), scaling the explicit mask.
    pub slopes: *const f32,
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
}

/// The work-item function for the instruction set in use.
pub(super) type ItemFn = unsafe fn(&Problem, &Seq, usize, usize, &mut Scratch);

/// The work item at head dims (`DK`, `DV`) for the instruction set in use.
pub(super) fn pick<const DK: usize, const DV: usize>() -> ItemFn {
    #[cfg(target_arch = "x86_64")]
    {
        match super::simd::selected_isa() {
            "avx512" => return item_avx512::<DK, DV>,
            "avx2+fma+f16c" => return item_avx2::<DK, DV>,
            _ => {}
        }
    }
    item_portable::<DK, DV>
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
    // Row r sees [r + off - w + 1, r + off] (causal, window) within [0, Lk): the union over
    // consecutive rows is one range.
    let lo = if w > 0 { first - w + 1 } else { 0 }.max(c0i);
    let hi = if pb.causal { last + 1 } else { end }.min(end);
    if lo >= hi {
        return (SKIP, C, 0);
    }
    let all = n == C && (!pb.causal || c0i + C as i64 - 1 <= first) && (w == 0 || c0i > last - w);
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

/// One work item: query tiles `grp * nt ..` (up to `nt` of them) of sequence `seq`, KV head
/// `g`, all `group` query heads of that KV head. Row `i` of the item is tile
/// `i / (group * bq)`, head `i / bq % group`, query row `i % bq` of the tile.
#[inline(always)]
unsafe fn work_item<S: Simd, const DK: usize, const DV: usize>(
    pb: &Problem,
    seq: &Seq,
    grp: usize,
    g: usize,
    sc: &mut Scratch,
) {
    let (bq, nt) = (pb.bq, pb.nt);
    let per = bq * pb.group; // rows of one tile, a multiple of W
    let r = per * nt; // rows of the item
    let steps = seq.lk.div_ceil(C);
    let q_tiles = seq.lq.div_ceil(bq);
    grow(&mut sc.qt, DK * r);
    grow(&mut sc.o, r * DV);
    grow(&mut sc.st, C * r);
    grow(&mut sc.kf, C * DK);
    grow(&mut sc.vf, C * V_SPAN);
    grow(&mut sc.mrow, bq * C);
    grow(&mut sc.mt, nt * C * bq);
    grow(&mut sc.m, r);
    grow(&mut sc.l, r);
    grow(&mut sc.ms, r);
    let (qt_b, o_b, st_b) = (sc.qt.as_mut_ptr(), sc.o.as_mut_ptr(), sc.st.as_mut_ptr());
    let (kf, vf) = (sc.kf.as_mut_ptr(), sc.vf.as_mut_ptr());
    let (mrow, mt) = (sc.mrow.as_mut_ptr(), sc.mt.as_mut_ptr());
    let (m_b, l_b, ms_b) = (sc.m.as_mut_ptr(), sc.l.as_mut_ptr(), sc.ms.as_mut_ptr());

    let mut subs = [Sub::default(); MAX_NT];
    for (k, sub) in subs.iter_mut().enumerate().take(nt) {
        let qt = grp * nt + k;
        let r0 = qt * bq;
        let nr = if qt < q_tiles { bq.min(seq.lq - r0) } else { 0 };
        *sub = Sub { r0, nr, ib: k * per, ie: (k + 1) * per, ..Sub::default() };
    }
    let subs = &mut subs[..nt];

    load_q::<S, DK>(pb, seq, g, subs, qt_b, r);
    for i in 0..r {
        *m_b.add(i) = -f32::MAX / 2.0;
        *l_b.add(i) = 0.0;
    }
    std::ptr::write_bytes(o_b, 0, r * DV);

    let (k_base, v_base) = (pb.k.add(seq.k + g * pb.k_hs), pb.v.add(seq.v + g * pb.v_hs));
    for step in 0..steps {
        let c0 = step * C;
        // Cache rows of this step that exist: the last step of a cache that is not a
        // multiple of C is partial, and K/V rows at or past Lk are never read.
        let n = C.min(seq.lk - c0);
        // Per tile: cache rows [lo, hi) of the step (multiples of 4) hold every one the
        // tile's rows may see; the others are -inf for all of them, so their p is exactly 0
        // and leaving them out changes no bit (K and V are finite). On the diagonal of a
        // causal mask and at the edge of a window this skips up to three quarters of a step.
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
        if lo_all >= hi_all {
            continue;
        }
        load_tile::<S, DK>(kf, k_base.add(c0 * pb.k_rs), pb.k_rs, lo_all, hi_all, n, pb.kv_bf16);
        for (k, sub) in subs.iter().enumerate() {
            if sub.lo >= sub.hi {
                continue;
            }
            scores::<S, DK>(kf, qt_b, st_b, r, sub.ib, sub.ie, sub.lo, sub.hi);
            if pb.softcap > 0.0 {
                softcap::<S>(pb.softcap, st_b, r, sub.ib, sub.ie, sub.lo, sub.hi);
            }
            if sub.add {
                add_mask::<S>(pb, g, mt.add(k * C * bq), st_b, r, sub.ib, sub.lo, sub.hi);
            }
            if sub.distance {
                add_distance::<S>(pb, seq, g, st_b, r, sub, c0);
            }
            if sub.hide {
                hide::<S>(pb, seq, st_b, r, sub, c0);
            }
            softmax_step::<S>(st_b, m_b, l_b, ms_b, r, sub.ib, sub.ie, sub.lo, sub.hi);
        }
        let v_step = v_base.add(c0 * pb.v_rs);
        accumulate::<S, DV>(st_b, v_step, pb.v_rs, pb.kv_bf16, vf, o_b, ms_b, r, subs, lo_all, hi_all, n);
    }

    store_out::<S, DV>(pb, seq, g, subs, o_b, m_b, l_b);
}

/// Q of the item's rows: `qh = half(scale * q)`, transposed into Q^T (`[D][r]`); rows past
/// the prompt are zero. By blocks of W rows, so that every line of Q^T is written whole, once.
#[inline(always)]
unsafe fn load_q<S: Simd, const D: usize>(pb: &Problem, seq: &Seq, g: usize, subs: &[Sub], qt_b: *mut f32, r: usize) {
    let scale = S::splat(pb.scale);
    let mut tmp = [[0f32; D]; W];
    for sub in subs.iter() {
        for hh in 0..pb.group {
            let h = g * pb.group + hh;
            for rb in (0..pb.bq).step_by(W) {
                for (x, row) in tmp.iter_mut().enumerate() {
                    let rr = rb + x;
                    if rr < sub.nr {
                        let at = seq.q + (sub.r0 + rr) * pb.q_rs + h * pb.q_hs;
                        for dv in (0..D).step_by(W) {
                            let q = match pb.q_dtype {
                                Elem::F32 => S::load((pb.q as *const f32).add(at + dv)),
                                Elem::F16 => S::load_f16((pb.q as *const u16).add(at + dv)),
                                Elem::BF16 => S::load_bf16((pb.q as *const u16).add(at + dv)),
                            };
                            S::store(row.as_mut_ptr().add(dv), S::round_half(S::mul(q, scale)));
                        }
                    } else {
                        row.fill(0.0);
                    }
                }
                let i0 = sub.ib + hh * pb.bq + rb;
                // A transpose: `dd` indexes the inner arrays of `tmp`, column by column.
                #[allow(clippy::needless_range_loop)]
                for dd in 0..D {
                    let col: [f32; W] = std::array::from_fn(|x| tmp[x][dd]);
                    S::store(qt_b.add(dd * r + i0), S::load(col.as_ptr()));
                }
            }
        }
    }
}

/// The sink logit `sigma` joins a row's running max `m` and sum `l` (SPEC 10): the max
/// becomes `mf = max(m, sigma)`, the sum `l * e^(m - mf) + e^(sigma - mf)`. Returns what O
/// is divided by (the new sum over `e^(m - mf)`, which rescales O to the new max; infinite
/// when that factor underflows, giving zeros) and the new max and sum, in f64 (one row's
/// scalars).
#[inline(always)]
fn with_sink(m: f32, l: f32, sigma: f32) -> (f32, f64, f64) {
    let (m, l, sigma) = (m as f64, l as f64, sigma as f64);
    let mf = if sigma > m { sigma } else { m };
    let f = (m - mf).exp();
    let sum = l * f + (sigma - mf).exp();
    ((sum / f) as f32, mf, sum)
}

/// O / S, or zeros where S == 0 (a row that saw no visible cache row), in O's dtype (rounded
/// to nearest even from f32); lse = M + ln(S), or -inf where S == 0. With sinks, M and S
/// take the head's sink logit first ([`with_sink`]): a row that saw nothing is then zeros
/// with lse = sigma.
#[inline(always)]
unsafe fn store_out<S: Simd, const D: usize>(
    pb: &Problem,
    seq: &Seq,
    g: usize,
    subs: &[Sub],
    o_b: *const f32,
    m_b: *const f32,
    l_b: *const f32,
) {
    for sub in subs.iter() {
        for hh in 0..pb.group {
            let h = g * pb.group + hh;
            for rr in 0..sub.nr {
                let i = sub.ib + hh * pb.bq + rr;
                let at = seq.o + (sub.r0 + rr) * pb.o_rs + h * pb.o_hs;
                let (m, mut l) = (*m_b.add(i), *l_b.add(i));
                let mut lse = if l == 0.0 { f32::NEG_INFINITY } else { m + l.ln() };
                if !pb.sinks.is_null() {
                    let (div, mf, sum) = with_sink(m, l, *pb.sinks.add(h));
                    l = div;
                    lse = if sum == 0.0 { f32::NEG_INFINITY } else { (mf + sum.ln()) as f32 };
                }
                let lv = S::splat(l);
                for dv in (0..D).step_by(W) {
                    let o = if l == 0.0 { S::splat(0.0) } else { S::div(S::load(o_b.add(i * D + dv)), lv) };
                    match pb.o_dtype {
                        Elem::F32 => S::store((pb.out.0 as *mut f32).add(at + dv), o),
                        Elem::F16 | Elem::BF16 => {
                            let mut x = [0f32; W];
                            S::store(x.as_mut_ptr(), o);
                            let dst = (pb.out.0 as *mut u16).add(at + dv);
                            for (e, &v) in x.iter().enumerate() {
                                let bits = if pb.o_dtype == Elem::F16 {
                                    half::f16::from_f32(v).to_bits()
                                } else {
                                    half::bf16::from_f32(v).to_bits()
                                };
                                *dst.add(e) = bits;
                            }
                        }
                    }
                }
                if pb.has_lse {
                    *pb.lse.0.add(seq.lse + h * pb.lse_hs + sub.r0 + rr) = lse;
                }
            }
        }
    }
}

/// 16 elements of K or V, widened to f32 from BF16 or F16.
#[inline(always)]
unsafe fn load_kv<S: Simd>(p: *const u16, bf16: bool) -> S::V {
    if bf16 {
        S::load_bf16(p)
    } else {
        S::load_f16(p)
    }
}

/// Rows `lo..hi` of `C` rows of `D` halves or bfloat16 values (row stride `rs` elements)
/// widened to f32 `[C][D]`; rows at or past `n` (past the cache's end) are zeros, never read.
#[inline(always)]
unsafe fn load_tile<S: Simd, const D: usize>(
    dst: *mut f32,
    src: *const u16,
    rs: usize,
    lo: usize,
    hi: usize,
    n: usize,
    bf16: bool,
) {
    for j in lo..hi {
        let s = src.add(j * rs);
        for dv in (0..D).step_by(W) {
            let x = if j < n { load_kv::<S>(s.add(dv), bf16) } else { S::splat(0.0) };
            S::store(dst.add(j * D + dv), x);
        }
    }
}

/// SPEC 10: `s = cap * tanh(s / cap)` on the scores of cache rows `lo..hi`, rows `ib..ie`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn softcap<S: Simd>(cap: f32, st: *mut f32, r: usize, ib: usize, ie: usize, lo: usize, hi: usize) {
    let (c, inv) = (S::splat(cap), S::splat(1.0 / cap));
    for j in lo..hi {
        for i0 in (ib..ie).step_by(W) {
            let p = st.add(j * r + i0);
            S::store(p, S::mul(c, S::tanh(S::mul(S::load(p), inv))));
        }
    }
}

/// `st[j][i] = sum_d kf[j][d] * qt[d][i]` for `lo <= j < hi`, `ib <= i < ie` (row stride
/// of `qt` and `st`: `r`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn scores<S: Simd, const D: usize>(
    kf: *const f32,
    qt: *const f32,
    st: *mut f32,
    r: usize,
    ib: usize,
    ie: usize,
    lo: usize,
    hi: usize,
) {
    // AVX-512: 4 cache rows x 4 vectors (16 zmm accumulators). AVX2 (and the remainder):
    // 6 cache rows x 1 vector, 12 ymm accumulators; 4 x 2 would need 16 and spill.
    let mut i0 = ib;
    while S::WIDE_BLOCKS && i0 + 4 * W <= ie {
        for j0 in (lo..hi).step_by(4) {
            scores_block::<S, D, 4, 4>(kf, qt, st, r, j0, i0);
        }
        i0 += 4 * W;
    }
    while i0 < ie {
        let mut j0 = lo;
        while j0 + 6 <= hi {
            scores_block::<S, D, 6, 1>(kf, qt, st, r, j0, i0);
            j0 += 6;
        }
        while j0 < hi {
            scores_block::<S, D, 2, 1>(kf, qt, st, r, j0, i0);
            j0 += 2;
        }
        i0 += W;
    }
}

#[inline(always)]
unsafe fn scores_block<S: Simd, const D: usize, const JB: usize, const IV: usize>(
    kf: *const f32,
    qt: *const f32,
    st: *mut f32,
    r: usize,
    j0: usize,
    i0: usize,
) {
    let mut acc = [[S::splat(0.0); IV]; JB];
    for d in 0..D {
        let mut qv = [S::splat(0.0); IV];
        for (iv, q) in qv.iter_mut().enumerate() {
            *q = S::load(qt.add(d * r + i0 + iv * W));
        }
        for (jj, row) in acc.iter_mut().enumerate() {
            let kb = S::splat(*kf.add((j0 + jj) * D + d));
            for (iv, a) in row.iter_mut().enumerate() {
                *a = S::fma(kb, qv[iv], *a);
            }
        }
    }
    for (jj, row) in acc.iter().enumerate() {
        for (iv, a) in row.iter().enumerate() {
            S::store(st.add((j0 + jj) * r + i0 + iv * W), *a);
        }
    }
}

/// Load the explicit mask (at `mask`, its sequence's start) of cache rows `c0..c0+C` for the
/// tile's rows into `mt` (`[C][bq]`, f32), and return the range `[lo, hi)` (multiples of 4)
/// outside which every value is -inf. Columns at or past `n` (the cache's end) are not read
/// and count as -inf; mask rows past the prompt are not read and count as zero.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn load_mask<S: Simd>(
    pb: &Problem,
    mask: *const u16,
    mrow: *mut f32,
    mt: *mut f32,
    r0: usize,
    nr: usize,
    c0: usize,
    n: usize,
) -> (usize, usize) {
    let bq = pb.bq;
    for rr in 0..bq {
        let dst = mrow.add(rr * C);
        if rr >= nr {
            // Mask rows past the prompt are never read; those query rows are never written.
            for jv in (0..C).step_by(W) {
                S::store(dst.add(jv), S::splat(0.0));
            }
            continue;
        }
        let src = mask.add((r0 + rr) * pb.mask_rs + c0);
        if n == C {
            for jv in (0..C).step_by(W) {
                S::store(dst.add(jv), S::load_f16(src.add(jv)));
            }
        } else {
            for j in 0..C {
                *dst.add(j) = if j < n { half::f16::from_bits(*src.add(j)).to_f32() } else { f32::NEG_INFINITY };
            }
        }
    }
    let (mut lo, mut hi) = (C, 0);
    for j in 0..C {
        let mut live = false;
        for rr in 0..bq {
            let x = *mrow.add(rr * C + j);
            *mt.add(j * bq + rr) = x;
            // A NaN counts as seen, as does anything but -inf.
            live |= rr < nr && x != f32::NEG_INFINITY;
        }
        if live {
            lo = lo.min(j);
            hi = j + 1;
        }
    }
    (lo & !3, (hi + 3) & !3)
}

/// Add the mask (`mt`, `[C][bq]`) of cache rows `lo..hi`, times each head's ALiBi slope, to
/// the scores of every head (of KV head `g`) of the tile whose rows start at `ib`. Without
/// ALiBi the slope is 1, and `fma(1, m, s)` is `s + m` to the bit.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn add_mask<S: Simd>(
    pb: &Problem,
    g: usize,
    mt: *const f32,
    st: *mut f32,
    r: usize,
    ib: usize,
    lo: usize,
    hi: usize,
) {
    let bq = pb.bq;
    for hh in 0..pb.group {
        let slope = S::splat(*pb.slopes.add(g * pb.group + hh));
        for j in lo..hi {
            for rv in (0..bq).step_by(W) {
                let p = st.add(j * r + ib + hh * bq + rv);
                S::store(p, S::fma(slope, S::load(mt.add(j * bq + rv)), S::load(p)));
            }
        }
    }
}

/// ALiBi on the described mask (no explicit mask): the mask llama.cpp writes for ALiBi
/// models holds `-(p - j)` on a visible pair, `p = r + offset` the query's position, so each
/// score of cache rows `lo..hi` (step at `c0`) gains `slope_h * (j - p)`. Pairs the
/// description hides are set to -inf afterwards, whatever this adds to them. The distance is
/// an integer, exact in f32 below 2^24.
#[inline(always)]
unsafe fn add_distance<S: Simd>(pb: &Problem, seq: &Seq, g: usize, st: *mut f32, r: usize, sub: &Sub, c0: usize) {
    let mut lane = [0f32; W];
    for (x, l) in lane.iter_mut().enumerate() {
        *l = x as f32;
    }
    let lane = S::load(lane.as_ptr());
    for hh in 0..pb.group {
        let slope = S::splat(*pb.slopes.add(g * pb.group + hh));
        for j in sub.lo..sub.hi {
            // Row r0 + rv + x of the tile: j - p = (c0 + j - off - r0 - rv) - x.
            let base = (c0 + j) as i64 - seq.off - sub.r0 as i64;
            for rv in (0..pb.bq).step_by(W) {
                let dist = S::sub(S::splat((base - rv as i64) as f32), lane);
                let p = st.add(j * r + sub.ib + hh * pb.bq + rv);
                S::store(p, S::fma(slope, dist, S::load(p)));
            }
        }
    }
}

/// The description, element by element: the score of every pair of the tile's cache rows
/// `lo..hi` that its rows cannot see becomes -inf (whatever it was: NaN and inf included).
/// For cache row j the visible rows of the tile are one range `[a, b)`, from the indices.
#[inline(always)]
unsafe fn hide<S: Simd>(pb: &Problem, seq: &Seq, st: *mut f32, r: usize, sub: &Sub, c0: usize) {
    let bq = pb.bq as i64;
    let off = seq.off;
    let ninf = S::splat(f32::NEG_INFINITY);
    let mut lane = [0f32; W];
    for (x, l) in lane.iter_mut().enumerate() {
        *l = x as f32;
    }
    let lane = S::load(lane.as_ptr());
    for j in sub.lo..sub.hi {
        let ja = (c0 + j) as i64;
        // Row r0 + rr sees ja iff rr >= ja - off - r0 (causal) and rr < ja - off - r0 + w (window).
        let rel = ja - off - sub.r0 as i64;
        let (a, b) = if ja >= seq.lk as i64 {
            (0, 0)
        } else {
            let a = if pb.causal { rel.clamp(0, bq) } else { 0 };
            let b = if pb.window > 0 { (rel + pb.window as i64).clamp(0, bq) } else { bq };
            (a, b.max(a))
        };
        if a == 0 && b == bq {
            continue;
        }
        for rv in (0..pb.bq).step_by(W) {
            let (v0, v1) = (rv as i64, (rv + W) as i64);
            if v0 >= a && v1 <= b {
                continue; // every lane visible
            }
            // Lane x is row rv + x: visible iff a <= rv + x < b, i.e. x > a - rv - 1/2 and b - rv > x.
            let above = S::splat((a - v0) as f32 - 0.5);
            let below = S::splat((b - v0) as f32);
            for hh in 0..pb.group {
                let p = st.add(j * r + sub.ib + hh * pb.bq + rv);
                let s = S::select_gt(lane, above, S::load(p), ninf);
                S::store(p, S::select_gt(below, lane, s, ninf));
            }
        }
    }
}

/// Online softmax of one step, lanes = rows: new max with the lazy (> +8) rescale,
/// `p = half(exp(s - M))` in place of the scores, `S = S * ms + sum p`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn softmax_step<S: Simd>(
    st: *mut f32,
    m: *mut f32,
    l: *mut f32,
    ms: *mut f32,
    r: usize,
    ib: usize,
    ie: usize,
    lo: usize,
    hi: usize,
) {
    let one = S::splat(1.0);
    for i0 in (ib..ie).step_by(W) {
        // As if the max had started at column 0: the -inf columns before `lo` leave -inf.
        let first = S::load(st.add(lo * r + i0));
        let mut mx = if lo == 0 { first } else { S::max(first, S::splat(f32::NEG_INFINITY)) };
        for j in lo + 1..hi {
            mx = S::max(S::load(st.add(j * r + i0)), mx);
        }
        let m_old = S::load(m.add(i0));
        let thresh = S::add(m_old, S::splat(8.0));
        let scale = S::select_gt(mx, thresh, S::exp(S::sub(m_old, mx)), one);
        let m_new = S::select_gt(mx, thresh, mx, m_old);
        S::store(m.add(i0), m_new);
        S::store(ms.add(i0), scale);
        let mut sum = S::splat(0.0);
        for j in lo..hi {
            let ptr = st.add(j * r + i0);
            let p = S::round_half(S::exp(S::sub(S::load(ptr), m_new)));
            S::store(ptr, p);
            sum = S::add(sum, p);
        }
        S::store(l.add(i0), S::fma(S::load(l.add(i0)), scale, sum));
    }
}

/// Columns of V that one P.V pass covers: a slice of V widened to f32 (`C * V_SPAN * 4` =
/// 8 KiB) stays in L1 while every row block of the item uses it. A head dim that is an odd
/// multiple of W (80, 112) ends with a slice of one vector.
const V_SPAN: usize = 2 * W;

/// `o[i] = o[i] * ms[i] + sum_j p[j][i] * v[j]` for the rows of every tile in `subs` that
/// computes this step, over its cache rows, with V at `v` (F16 or BF16, row stride `rs`),
/// slice by slice of `V_SPAN` columns (rows `lo..hi` of each slice widened once for all
/// tiles; rows at or past `n` are zeros, never read).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn accumulate<S: Simd, const D: usize>(
    p: *const f32,
    v: *const u16,
    rs: usize,
    bf16: bool,
    vc: *mut f32,
    o: *mut f32,
    ms: *const f32,
    r: usize,
    subs: &[Sub],
    lo: usize,
    hi: usize,
    n: usize,
) {
    // With the lazy rescale most steps keep every max: then O is only read (x * 1 == x).
    let mut rescale = [false; MAX_NT];
    for (k, sub) in subs.iter().enumerate() {
        rescale[k] = (sub.ib..sub.ie).any(|i| *ms.add(i) != 1.0);
    }
    for d0 in (0..D).step_by(V_SPAN) {
        // The slice's vectors: 2, or 1 for the last slice of an odd multiple of W.
        let nv = (D - d0).min(V_SPAN) / W;
        for j in lo..hi {
            for x in 0..nv {
                let val = if j < n { load_kv::<S>(v.add(j * rs + d0 + x * W), bf16) } else { S::splat(0.0) };
                S::store(vc.add(j * nv * W + x * W), val);
            }
        }
        // Row blocks: 8 rows x 2 vectors (16 accumulators) where 32 registers allow it,
        // 2 x 2 on AVX2's 16 ymm (a vector is two of them there; 4 x 1 and 6 x 1 measured
        // slower); a one-vector slice takes twice the rows.
        for (k, sub) in subs.iter().enumerate() {
            if sub.lo >= sub.hi {
                continue;
            }
            let (resc, lo, hi) = (rescale[k], sub.lo, sub.hi);
            match (S::WIDE_BLOCKS, nv) {
                (true, 2) => {
                    for i0 in (sub.ib..sub.ie).step_by(8) {
                        accumulate_block::<S, D, 8, 2>(p, vc, o, ms, resc, r, i0, d0, lo, hi);
                    }
                }
                (true, _) => {
                    for i0 in (sub.ib..sub.ie).step_by(16) {
                        accumulate_block::<S, D, 16, 1>(p, vc, o, ms, resc, r, i0, d0, lo, hi);
                    }
                }
                (false, 2) => {
                    for i0 in (sub.ib..sub.ie).step_by(2) {
                        accumulate_block::<S, D, 2, 2>(p, vc, o, ms, resc, r, i0, d0, lo, hi);
                    }
                }
                (false, _) => {
                    for i0 in (sub.ib..sub.ie).step_by(4) {
                        accumulate_block::<S, D, 4, 1>(p, vc, o, ms, resc, r, i0, d0, lo, hi);
                    }
                }
            }
        }
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn accumulate_block<S: Simd, const D: usize, const IB: usize, const NV: usize>(
    p: *const f32,
    vc: *const f32,
    o: *mut f32,
    ms: *const f32,
    rescale: bool,
    r: usize,
    i0: usize,
    d0: usize,
    lo: usize,
    hi: usize,
) {
    let mut acc = [[S::splat(0.0); NV]; IB];
    for (ii, row) in acc.iter_mut().enumerate() {
        let s = S::splat(*ms.add(i0 + ii));
        for (dv, a) in row.iter_mut().enumerate() {
            let x = S::load(o.add((i0 + ii) * D + d0 + dv * W));
            *a = if rescale { S::mul(x, s) } else { x };
        }
    }
    for j in lo..hi {
        let mut vv = [S::splat(0.0); NV];
        for (dv, x) in vv.iter_mut().enumerate() {
            *x = S::load(vc.add(j * NV * W + dv * W));
        }
        for (ii, row) in acc.iter_mut().enumerate() {
            let pb = S::splat(*p.add(j * r + i0 + ii));
            for (dv, a) in row.iter_mut().enumerate() {
                *a = S::fma(pb, vv[dv], *a);
            }
        }
    }
    for (ii, row) in acc.iter().enumerate() {
        for (dv, a) in row.iter().enumerate() {
            S::store(o.add((i0 + ii) * D + d0 + dv * W), *a);
        }
    }
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
            causal,
            window,
            has_mask: false,
            has_lse: false,
            kv_bf16: false,
            softcap: 0.0,
            alibi_distance: false,
            slopes: std::ptr::null(),
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
