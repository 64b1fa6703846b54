//! CPU form of `flash_attn_prefill_tensor_f16_d256` / `_d512` (SPEC section 2).
//!
//! One work item is one KV head times up to four consecutive query tiles of the blk table
//! (`bq` rows each, 128 to 256 rows in all), with every query head that shares that KV head:
//! the K/V tile of a step is converted to f32 once and used by all those rows, while each
//! query tile follows its own blk bytes and mask. Scores are kept transposed (`[cache
//! row][query row]`) so the per-row max, exp, half rounding and sums run across SIMD lanes
//! without horizontal reductions; in a partly masked step a tile computes only the cache rows
//! some of its rows can see. Items run in parallel on all cores (rayon, work stealing), a
//! thread taking consecutive items of one KV head; scratch is per thread and reused, so the
//! hot loop allocates nothing.

use std::cell::RefCell;

use rayon::prelude::*;

use super::simd::{Portable, Simd, W};
use super::{host_slice, CpuKernelFn, SendPtr};
use crate::error::{MlxError, Result};
use crate::interface::Dispatch;
use crate::params::FlashAttnPrefillTensorParamsGpu as Params;

/// This op's kernels, by name.
pub const KERNELS: &[(&str, CpuKernelFn)] =
    &[("flash_attn_prefill_tensor_f16_d256", run_d256), ("flash_attn_prefill_tensor_f16_d512", run_d512)];

/// Cache rows per step (the blk `bk`).
const C: usize = 64;

static COLUMN_SKIP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Whether a step of a partly masked tile leaves out the cache rows that are -inf for all
/// of the tile's rows (on by default). Off computes them; the output is the same to the
/// bit, which the tests check with this switch.
pub fn set_column_skipping(on: bool) {
    COLUMN_SKIP.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Queries per blk tile at head dim `D` (the kernel's `Q`).
const fn bq_of(d: usize) -> usize {
    if d == 256 {
        32
    } else {
        16
    }
}

/// Most query tiles one work item takes.
const MAX_NT: usize = 4;

/// Query tiles per work item for `rows_per_tile` rows (bq times the heads sharing a KV
/// head) at head dim `d`: enough for about 64K elements of Q (256 rows at 256, 128 at 512),
/// so that the conversion of each K/V tile to f32 is shared by that many rows while Q^T
/// and O stay within L2 (64-row items spent about 4% more than 256-row ones).
fn tiles_per_item(rows_per_tile: usize, d: usize) -> usize {
    (65536 / d / rows_per_tile).clamp(1, MAX_NT)
}

/// Entry point of `flash_attn_prefill_tensor_f16_d256`.
pub fn run_d256(d: &Dispatch) -> Result<()> {
    run_head_dim::<256>(d)
}

/// Entry point of `flash_attn_prefill_tensor_f16_d512`.
pub fn run_d512(d: &Dispatch) -> Result<()> {
    run_head_dim::<512>(d)
}

/// Everything a work item reads, as plain numbers and pointers.
#[derive(Clone, Copy)]
struct Problem {
    rows: usize,
    n_heads: usize,
    kv_pad: usize,
    group: usize,
    bq: usize,
    /// Query tiles per work item (they share each K/V tile's conversion).
    nt: usize,
    q_rs: usize,
    q_hs: usize,
    k_rs: usize,
    k_hs: usize,
    v_rs: usize,
    v_hs: usize,
    mask_rs: usize,
    scale: f32,
    column_skip: bool,
    q: *const f32,
    k: *const u16,
    v: *const u16,
    mask: *const u16,
    blk: *const u8,
    out: SendPtr<f32>,
}

// SAFETY: read-only inputs, and an output every item writes a disjoint part of.
unsafe impl Send for Problem {}
unsafe impl Sync for Problem {}

fn run_head_dim<const D: usize>(d: &Dispatch) -> Result<()> {
    let p: Params = d.constant(0)?;
    let bq = bq_of(D);
    // The op validated the dispatch; a kernel that writes memory checks what it relies on,
    // from the same extents.
    let bad = |what: &str| MlxError::Internal(format!("flash_attn_prefill_tensor (cpu): {what}"));
    let e = p.extents(D as u64, bq as u64).ok_or_else(|| bad("shape breaks the op's contract"))?;
    let (q, q_len) = host_slice(d, 1)?;
    let (k, k_len) = host_slice(d, 2)?;
    let (v, v_len) = host_slice(d, 3)?;
    let (mask, mask_len) = host_slice(d, 4)?;
    let (blk, blk_len) = host_slice(d, 5)?;
    let (out, out_len) = host_slice(d, 6)?;
    let fits = [(q_len, e.q), (k_len, e.k), (v_len, e.v), (mask_len, e.mask), (blk_len, e.blk), (out_len, e.out)];
    if fits.iter().any(|&(have, need)| (have as u64) < need) {
        return Err(bad("a buffer is smaller than its strides need"));
    }
    let u = |x: i32| x as usize;
    let (rows, nh, nkv, kv_pad) = (u(p.rows), u(p.n_heads), u(p.n_kv_heads), u(p.kv_pad));
    let pb = Problem {
        rows,
        n_heads: nh,
        kv_pad,
        group: nh / nkv,
        bq,
        nt: tiles_per_item(bq * (nh / nkv), D),
        q_rs: u(p.q_row_stride),
        q_hs: u(p.q_head_stride),
        k_rs: u(p.k_row_stride),
        k_hs: u(p.k_head_stride),
        v_rs: u(p.v_row_stride),
        v_hs: u(p.v_head_stride),
        mask_rs: u(p.mask_row_stride),
        scale: p.scale,
        column_skip: COLUMN_SKIP.load(std::sync::atomic::Ordering::Relaxed),
        q: q as *const f32,
        k: k as *const u16,
        v: v as *const u16,
        mask: mask as *const u16,
        blk,
        out: SendPtr(out as *mut f32),
    };
    let item: unsafe fn(&Problem, usize, usize, &mut Scratch) = pick::<D>();
    let groups = rows.div_ceil(bq).div_ceil(pb.nt);
    // Items in KV-head-major order: rayon hands each thread contiguous runs of items, so a
    // thread walks consecutive query tiles of one KV head, whose K/V rows (the same cache
    // rows, or a window sliding by one tile) are still in its L2 from the item before.
    (0..groups * nkv).into_par_iter().for_each(|w| {
        SCRATCH.with(|s| {
            let mut s = s.borrow_mut();
            // SAFETY: `pick` chose an instruction set this CPU has; sizes checked above.
            unsafe { item(&pb, w % groups, w / groups, &mut s) };
        })
    });
    Ok(())
}

/// The work-item function for the instruction set in use.
fn pick<const D: usize>() -> unsafe fn(&Problem, usize, usize, &mut Scratch) {
    #[cfg(target_arch = "x86_64")]
    {
        match super::simd::selected_isa() {
            "avx512" => return item_avx512::<D>,
            "avx2+fma+f16c" => return item_avx2::<D>,
            _ => {}
        }
    }
    item_portable::<D>
}

unsafe fn item_portable<const D: usize>(pb: &Problem, qt: usize, g: usize, s: &mut Scratch) {
    work_item::<Portable, D>(pb, qt, g, s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn item_avx512<const D: usize>(pb: &Problem, qt: usize, g: usize, s: &mut Scratch) {
    work_item::<super::simd::Avx512, D>(pb, qt, g, s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn item_avx2<const D: usize>(pb: &Problem, qt: usize, g: usize, s: &mut Scratch) {
    work_item::<super::simd::Avx2, D>(pb, qt, g, s)
}

/// Per-thread working memory of a work item, grown on demand and reused.
#[derive(Default)]
struct Scratch {
    /// Q^T, `[D][R]`: the item's query rows, scaled and rounded to half.
    qt: Vec<f32>,
    /// O, `[R][D]`: unnormalised output accumulators.
    o: Vec<f32>,
    /// Scores then probabilities, transposed: `[C][R]`.
    st: Vec<f32>,
    /// K of one step in f32, `[C][D]`.
    kf: Vec<f32>,
    /// One slice of V's columns of one step in f32, `[C][V_SPAN]`.
    vf: Vec<f32>,
    /// One step of mask rows, `[bq][C]`, then transposed to `[C][bq]`.
    mrow: Vec<f32>,
    mt: Vec<f32>,
    /// Running max, running sum, and this step's rescale factor, `[R]` each.
    m: Vec<f32>,
    l: Vec<f32>,
    ms: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

fn grow(v: &mut Vec<f32>, n: usize) {
    if v.len() < n {
        v.resize(n, 0.0);
    }
}

/// One query tile of a work item, and what it does in the current step.
#[derive(Clone, Copy, Default)]
struct Sub {
    /// First query row, and rows below the prompt's end (0 for a tile past it).
    r0: usize,
    nr: usize,
    /// The item's rows of this tile: `[ib, ie)`.
    ib: usize,
    ie: usize,
    /// This step: the blk byte, and the cache rows `[lo, hi)` it computes (empty: none).
    t: u8,
    lo: usize,
    hi: usize,
}

/// One work item: query tiles `grp * nt ..` (up to `nt` of them), KV head `g`, all `group`
/// query heads of that KV head. Row `i` of the item is tile `i / (group * bq)`, head
/// `i / bq % group`, query row `i % bq` of the tile. Each tile follows its own blk bytes and
/// mask; the tiles share the conversion of every K/V tile.
#[inline(always)]
unsafe fn work_item<S: Simd, const D: usize>(pb: &Problem, grp: usize, g: usize, sc: &mut Scratch) {
    let (bq, nt) = (pb.bq, pb.nt);
    let per = bq * pb.group; // rows of one tile, a multiple of W
    let r = per * nt; // rows of the item
    let steps = pb.kv_pad / C;
    let q_tiles = pb.rows.div_ceil(bq);
    grow(&mut sc.qt, D * r);
    grow(&mut sc.o, r * D);
    grow(&mut sc.st, C * r);
    grow(&mut sc.kf, C * D);
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
        let nr = if qt < q_tiles { bq.min(pb.rows - r0) } else { 0 };
        *sub = Sub { r0, nr, ib: k * per, ie: (k + 1) * per, ..Sub::default() };
    }
    let subs = &mut subs[..nt];

    // Q: qh = half(scale * q), transposed into Q^T; rows past the prompt are zero.
    // By blocks of W rows, so that every line of Q^T is written whole, once.
    let scale = S::splat(pb.scale);
    let mut tmp = [[0f32; D]; W];
    for sub in subs.iter() {
        for hh in 0..pb.group {
            let h = g * pb.group + hh;
            for rb in (0..bq).step_by(W) {
                for (x, row) in tmp.iter_mut().enumerate() {
                    let rr = rb + x;
                    if rr < sub.nr {
                        let src = pb.q.add((sub.r0 + rr) * pb.q_rs + h * pb.q_hs);
                        for dv in (0..D).step_by(W) {
                            S::store(row.as_mut_ptr().add(dv), S::round_half(S::mul(S::load(src.add(dv)), scale)));
                        }
                    } else {
                        row.fill(0.0);
                    }
                }
                let i0 = sub.ib + hh * bq + rb;
                for dd in 0..D {
                    let mut col = [0f32; W];
                    for (x, c) in col.iter_mut().enumerate() {
                        *c = tmp[x][dd];
                    }
                    S::store(qt_b.add(dd * r + i0), S::load(col.as_ptr()));
                }
            }
        }
    }
    for i in 0..r {
        *m_b.add(i) = -f32::MAX / 2.0;
        *l_b.add(i) = 0.0;
    }
    std::ptr::write_bytes(o_b, 0, r * D);

    for step in 0..steps {
        let c0 = step * C;
        // Per tile: cache rows [lo, hi) of the step (multiples of 4) hold every one the
        // tile's rows may see; the others are -inf for all of them, so their p is exactly 0
        // and leaving them out changes no bit (K and V are finite). On the diagonal of a
        // causal mask and at the edge of a window this skips up to three quarters of a step.
        let (mut lo_all, mut hi_all) = (C, 0);
        for (k, sub) in subs.iter_mut().enumerate() {
            sub.t = if sub.nr == 0 { 0 } else { *pb.blk.add((grp * nt + k) * steps + step) };
            let (lo, hi) = match sub.t {
                0 => (C, 0),
                2 => (0, C),
                _ => {
                    let range = load_mask::<S>(pb, mrow, mt.add(k * C * bq), sub.r0, sub.nr, c0);
                    if pb.column_skip { range } else { (0, C) }
                }
            };
            (sub.lo, sub.hi) = (lo, hi);
            if lo < hi {
                lo_all = lo_all.min(lo);
                hi_all = hi_all.max(hi);
            }
        }
        if lo_all >= hi_all {
            continue;
        }
        load_tile::<S, D>(kf, pb.k.add(c0 * pb.k_rs + g * pb.k_hs), pb.k_rs, lo_all, hi_all);
        for (k, sub) in subs.iter().enumerate() {
            if sub.lo >= sub.hi {
                continue;
            }
            scores::<S, D>(kf, qt_b, st_b, r, sub.ib, sub.ie, sub.lo, sub.hi);
            if sub.t != 2 {
                add_mask::<S>(pb, mt.add(k * C * bq), st_b, r, sub.ib, sub.lo, sub.hi);
            }
            softmax_step::<S>(st_b, m_b, l_b, ms_b, r, sub.ib, sub.ie, sub.lo, sub.hi);
        }
        accumulate::<S, D>(st_b, pb.v.add(c0 * pb.v_rs + g * pb.v_hs), pb.v_rs, vf, o_b, ms_b, r, subs, lo_all, hi_all);
    }

    // O / S, or zeros where S == 0 (a row that saw no unmasked cache row).
    for sub in subs.iter() {
        for hh in 0..pb.group {
            let h = g * pb.group + hh;
            for rr in 0..sub.nr {
                let i = sub.ib + hh * bq + rr;
                let dst = pb.out.0.add(((sub.r0 + rr) * pb.n_heads + h) * D);
                let l = *l_b.add(i);
                let lv = S::splat(l);
                for dv in (0..D).step_by(W) {
                    let o = if l == 0.0 { S::splat(0.0) } else { S::div(S::load(o_b.add(i * D + dv)), lv) };
                    S::store(dst.add(dv), o);
                }
            }
        }
    }
}

/// Rows `lo..hi` of `C` rows of `D` halves (row stride `rs` elements) widened to f32 `[C][D]`.
#[inline(always)]
unsafe fn load_tile<S: Simd, const D: usize>(dst: *mut f32, src: *const u16, rs: usize, lo: usize, hi: usize) {
    for j in lo..hi {
        let s = src.add(j * rs);
        for dv in (0..D).step_by(W) {
            S::store(dst.add(j * D + dv), S::load_f16(s.add(dv)));
        }
    }
}

/// `st[j][i] = sum_d kf[j][d] * qt[d][i]` for `lo <= j < hi`, `ib <= i < ie` (row stride
/// of `qt` and `st`: `r`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn scores<S: Simd, const D: usize>(kf: *const f32, qt: *const f32, st: *mut f32, r: usize, ib: usize, ie: usize, lo: usize, hi: usize) {
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

/// Load the mask of cache rows `c0..c0+C` for the tile's rows into `mt` (`[C][bq]`, f32),
/// and return the range `[lo, hi)` (multiples of 4) outside which every value is -inf.
#[inline(always)]
unsafe fn load_mask<S: Simd>(pb: &Problem, mrow: *mut f32, mt: *mut f32, r0: usize, nr: usize, c0: usize) -> (usize, usize) {
    let bq = pb.bq;
    for rr in 0..bq {
        for jv in (0..C).step_by(W) {
            // Mask rows past the prompt are never read; those query rows are never written.
            let x = if rr < nr {
                S::load_f16(pb.mask.add((r0 + rr) * pb.mask_rs + c0 + jv))
            } else {
                S::splat(0.0)
            };
            S::store(mrow.add(rr * C + jv), x);
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

/// Add the mask (`mt`, `[C][bq]`) of cache rows `lo..hi` to the scores of every head of
/// the tile whose rows start at `ib`.
#[inline(always)]
unsafe fn add_mask<S: Simd>(pb: &Problem, mt: *const f32, st: *mut f32, r: usize, ib: usize, lo: usize, hi: usize) {
    let bq = pb.bq;
    for j in lo..hi {
        for hh in 0..pb.group {
            for rv in (0..bq).step_by(W) {
                let p = st.add(j * r + ib + hh * bq + rv);
                S::store(p, S::add(S::load(p), S::load(mt.add(j * bq + rv))));
            }
        }
    }
}

/// Online softmax of one step, lanes = rows: new max with the lazy (> +8) rescale,
/// `p = half(exp(s - M))` in place of the scores, `S = S * ms + sum p`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn softmax_step<S: Simd>(st: *mut f32, m: *mut f32, l: *mut f32, ms: *mut f32, r: usize, ib: usize, ie: usize, lo: usize, hi: usize) {
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
/// 8 KiB) stays in L1 while every row block of the item uses it.
const V_SPAN: usize = 2 * W;

/// `o[i] = o[i] * ms[i] + sum_j p[j][i] * v[j]` for the rows of every tile in `subs` that
/// computes this step, over its cache rows, with V at `v` (halves, row stride `rs`), slice
/// by slice of `V_SPAN` columns (rows `lo..hi` of each slice widened once for all tiles).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn accumulate<S: Simd, const D: usize>(
    p: *const f32,
    v: *const u16,
    rs: usize,
    vc: *mut f32,
    o: *mut f32,
    ms: *const f32,
    r: usize,
    subs: &[Sub],
    lo: usize,
    hi: usize,
) {
    // With the lazy rescale most steps keep every max: then O is only read (x * 1 == x).
    let mut rescale = [false; MAX_NT];
    for (k, sub) in subs.iter().enumerate() {
        rescale[k] = (sub.ib..sub.ie).any(|i| *ms.add(i) != 1.0);
    }
    for d0 in (0..D).step_by(V_SPAN) {
        for j in lo..hi {
            for x in (0..V_SPAN).step_by(W) {
                S::store(vc.add(j * V_SPAN + x), S::load_f16(v.add(j * rs + d0 + x)));
            }
        }
        // Row blocks: 8 rows x 2 vectors (16 accumulators) where 32 registers allow it,
        // 2 x 2 on AVX2's 16 ymm (a vector is two of them there; 4 x 1 and 6 x 1 measured
        // slower).
        for (k, sub) in subs.iter().enumerate() {
            if sub.lo >= sub.hi {
                continue;
            }
            if S::WIDE_BLOCKS {
                for i0 in (sub.ib..sub.ie).step_by(8) {
                    accumulate_block::<S, D, 8, 2>(p, vc, o, ms, rescale[k], r, i0, d0, sub.lo, sub.hi);
                }
            } else {
                for i0 in (sub.ib..sub.ie).step_by(2) {
                    accumulate_block::<S, D, 2, 2>(p, vc, o, ms, rescale[k], r, i0, d0, sub.lo, sub.hi);
                }
            }
        }
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn accumulate_block<S: Simd, const D: usize, const IB: usize, const DV: usize>(
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
    let mut acc = [[S::splat(0.0); DV]; IB];
    for (ii, row) in acc.iter_mut().enumerate() {
        let s = S::splat(*ms.add(i0 + ii));
        for (dv, a) in row.iter_mut().enumerate() {
            let x = S::load(o.add((i0 + ii) * D + d0 + dv * W));
            *a = if rescale { S::mul(x, s) } else { x };
        }
    }
    for j in lo..hi {
        let mut vv = [S::splat(0.0); DV];
        for (dv, x) in vv.iter_mut().enumerate() {
            *x = S::load(vc.add(j * DV * W + dv * W));
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
