//! The work item on AMX tiles: the same item as the FMA one (one sequence, one KV head, up
//! to four query tiles with every query head of the group; the same step plan, masks,
//! score transforms, lazy online softmax and output), with both products on the tile unit
//! in bfloat16 with f32 accumulation:
//!
//! - scores transposed, `S^T = K . Q^T` (16 cache rows x 16 query rows per tile), stored
//!   per query tile (`[tile][C][ld]`, see `amx_layout`), where the masks, transforms and
//!   softmax run across lanes = query rows as in the FMA item's `[C][r]`;
//! - the softmax writes P^T directly as the VNNI pairs the tiles read (two cache rows
//!   interleaved), with p = 0 outside the rows the tile computes;
//! - `O^T += V^T . P^T` on f32 tiles loaded from and stored to `O^T` (per query tile
//!   `[DV][ld]`) each step,
//!   rescaled lazily in AVX-512 where a row's max moved; transposed to O at the end.
//!
//! K and V of a step are converted once (bfloat16 parts, V transposed) for every query head
//! and query tile of the item, as the FMA item widens them once; BF16 K/V are packed once
//! for every item of the call before any runs ([`pack_step`], `Problem::packed`), which
//! the items that see a step share (at 2048 causal rows up to 16 of them packed it each).
//! Each product is a sum of bf16 products of the operands' parts (`cpu::amx::Products`): by
//! default the exact products, four each with F16 K/V and two with BF16; docs/spec.md ("The
//! CPU on AMX tiles") has the measured errors of every choice.

use super::amx_layout::{aligned, pack_k, pack_q, pack_vt, tile_ld};
use super::io::{load_q, load_q_pairs, store_out_t};
use super::pages::{kv_value, row, step_rows, Which};
use super::softmax::step_max;
use super::transforms::transform_scores;
use super::{grow, item_subs, plan_step, start_rows, tile_view, Elem, Kv, Problem, Scratch, Seq, Sub, C, MAX_NT};
use crate::backend::cpu::amx::gemm::{self, Operand, Output, Product};
use crate::backend::cpu::amx::TileUnit;
use crate::backend::cpu::simd::{Simd, W};

/// The AMX item's operands (the bfloat16 ones a high part, then a low part where used),
/// each from a 64-byte boundary; per query tile (`[tile][..][ld]`) where indexed by query row.
#[derive(Default)]
pub(super) struct Buffers {
    /// Q^T pairs, `[tile][dkp/2][ld][2]` per part.
    q: Vec<u16>,
    /// K rows of a step, `[C][dkp]` per part.
    k: Vec<u16>,
    /// V^T of a step, `[DV][C]` per part.
    vt: Vec<u16>,
    /// P^T pairs of a step, `[tile][C/2][ld][2]` per part.
    p: Vec<u16>,
    /// O^T, `[tile][DV][ld]` f32.
    ot: Vec<f32>,
}

/// The parts of one operand: `hi`, and `lo` or null when no product reads it.
#[derive(Clone, Copy)]
struct Parts {
    hi: *mut u16,
    lo: *mut u16,
}

impl Parts {
    /// Two parts of `len` elements each (a multiple of 32: both on 64-byte boundaries) from
    /// the first 64-byte boundary of `v` (the second only if `lo`).
    fn of(v: &mut Vec<u16>, len: usize, lo: bool) -> Parts {
        let hi = aligned(v, if lo { 2 * len } else { len });
        // SAFETY: the vector holds 2 * len elements past hi when lo is asked for.
        Parts { hi, lo: if lo { unsafe { hi.add(len) } } else { std::ptr::null_mut() } }
    }

    /// Query tile `k`'s view of both parts of a per-tile buffer of pairs ([`tile_view`]).
    unsafe fn tile(&self, k: usize, per: usize, ld: usize, rows: usize) -> Parts {
        let lo = if self.lo.is_null() { self.lo } else { tile_view(self.lo, k, per, ld, rows, 2) };
        Parts { hi: tile_view(self.hi, k, per, ld, rows, 2), lo }
    }

    fn part(&self, lo: bool) -> *const u8 {
        (if lo { self.lo } else { self.hi }) as *const u8
    }
}

/// The split products in their order (`cpu::amx::Products`): (A part, B part), true = lo.
const TERMS: [(bool, bool); 4] = [(false, false), (false, true), (true, false), (true, true)];

/// The elements of one KV head's packed K and V^T ([`pack_step`]) for a cache of `lk` rows.
pub(super) fn packed_len<const DK: usize, const DV: usize>(lk: usize) -> usize {
    lk.div_ceil(C) * C * (DK.next_multiple_of(32) + DV)
}

/// Step `step` of sequence `seq`'s KV head `g`, BF16 K/V, packed into its part of
/// `pb.packed` as the item would pack it (every row of the step; rows past the cache zero):
/// K `[steps * C][dkp]`, then V^T `[steps][DV][C]`.
#[inline(always)]
pub(super) unsafe fn pack_step<S: Simd, const DK: usize, const DV: usize>(
    pb: &Problem,
    seq: &Seq,
    g: usize,
    step: usize,
) {
    let dkp = DK.next_multiple_of(32);
    let steps = seq.lk.div_ceil(C);
    let c0 = step * C;
    let n = C.min(seq.lk - c0);
    let part = (pb.packed as *mut u16).add(seq.packed + g * packed_len::<DK, DV>(seq.lk));
    PACK_STAGE.with(|stage| {
        let (ks, vs) = &mut *stage.borrow_mut();
        let (k_src, k_rs) = step_rows(pb, seq, Which::K, g, c0, n, 0, C, DK, ks);
        let (v_src, v_rs) = step_rows(pb, seq, Which::V, g, c0, n, 0, C, DV, vs);
        let null = std::ptr::null_mut();
        pack_k::<S, DK>(k_src, k_rs, pb.kv_of(Which::K, g), 0, C, n, dkp, part.add(c0 * dkp), null);
        pack_vt::<S, DV>(v_src, v_rs, pb.kv_of(Which::V, g), 0, C, n, part.add(steps * C * dkp + step * DV * C), null);
    })
}

thread_local! {
    /// The shared packing's staging rows of paged K and V (`pages::step_rows`).
    static PACK_STAGE: std::cell::RefCell<(Vec<u16>, Vec<u16>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// One work item on the tile unit `t` (see the module's comment): as `fma::work_item`, with
/// `pb.amx` products per product.
#[inline(always)]
pub(super) unsafe fn work_item<S: Simd, T: TileUnit, const DK: usize, const DV: usize>(
    pb: &Problem,
    seq: &Seq,
    grp: usize,
    g: usize,
    sc: &mut Scratch,
    t: &mut T,
) {
    let dkp = DK.next_multiple_of(32);
    let (bq, nt) = (pb.bq, pb.nt);
    let per = bq * pb.group; // rows of one tile, a multiple of 16
    let r = per * nt;
    let ld = tile_ld(per);
    let steps = seq.lk.div_ceil(C);
    let (qk, pv) = (pb.amx.qk as usize, pb.amx.pv as usize);
    // BFloat16 Q is read as it is, exact in one bfloat16 part, and the scale multiplies the
    // scores (f32) instead of Q: no product of a low part of Q, and scores nearer the exact
    // ones than SPEC's `half(scale * q)` (whose rounding a bfloat16 part could not hold).
    // (Only where the scale is positive, which the max commutes with, and where every
    // `half(scale * q)` is finite: SPEC 9 makes the others inf.)
    let mut subs = item_subs(pb, seq, grp);
    let subs = &mut subs[..nt];
    grow(&mut sc.qt, DK * r);
    let mut q_exact = pb.q_dtype == Elem::BF16 && pb.scale > 0.0;
    // Exact Q in one product of Q and K (no low part of either): Q's pairs straight from
    // its rows ([`load_q_pairs`]), no f32 Q^T (which only split products read).
    let mut q_packed = false;
    if q_exact && qk <= 2 && DK.is_multiple_of(32) {
        let hi = Parts::of(&mut sc.amx.q, nt * dkp * ld, false).hi;
        q_packed = load_q_pairs::<S, DK>(pb, seq, g, subs, hi, dkp, ld);
        q_exact = q_packed;
    }
    if !q_packed && !load_q::<S, DK>(pb, seq, g, subs, sc.qt.as_mut_ptr(), r, q_exact) && q_exact {
        q_exact = false;
        load_q::<S, DK>(pb, seq, g, subs, sc.qt.as_mut_ptr(), r, false);
    }
    let mut qk_terms = [TERMS[0]; 4];
    let mut n_qk = 0;
    for &t in TERMS[..qk].iter().filter(|t| !(q_exact && t.1)) {
        qk_terms[n_qk] = t;
        n_qk += 1;
    }
    let qk_terms = &qk_terms[..n_qk];
    let score_scale = if q_exact { pb.scale } else { 1.0 };
    let k_lo = qk_terms.iter().any(|t| t.0);
    grow(&mut sc.mrow, bq * C);
    grow(&mut sc.mt, nt * C * bq);
    grow(&mut sc.m, r);
    grow(&mut sc.l, r);
    grow(&mut sc.ms, r);
    grow(&mut sc.ls, r);
    let qt_b = sc.qt.as_mut_ptr();
    // S^T per query tile, `[tile][C][ld]`, in the FMA item's scores buffer.
    let st_b = aligned(&mut sc.st, nt * C * ld);
    let (mrow, mt) = (sc.mrow.as_mut_ptr(), sc.mt.as_mut_ptr());
    let (m_b, l_b, ms_b) = (sc.m.as_mut_ptr(), sc.l.as_mut_ptr(), sc.ms.as_mut_ptr());
    // lse's sum apart from O's where P is rounded to bfloat16 (one product of P).
    let ls_b = if pv == 1 { sc.ls.as_mut_ptr() } else { l_b };
    let b = &mut sc.amx;
    // Which low parts a product reads: Q's from the second product on (none of exact Q),
    // K's from the third; likewise P's and V's.
    let qv = Parts::of(&mut b.q, nt * dkp * ld, qk_terms.iter().any(|t| t.1));
    let kb = Parts::of(&mut b.k, C * dkp, k_lo);
    let vt = Parts::of(&mut b.vt, DV * C, pv >= 3);
    let pp = Parts::of(&mut b.p, nt * C * ld, pv >= 2);
    let ot = aligned(&mut b.ot, nt * DV * ld);
    // BF16 K whose low part no product reads (it is zero), in whole chunks of 32 columns:
    // the packed copy of a row inside the cache would hold the row's own bits (rounding a
    // bfloat16 to bfloat16 keeps it), so the score product reads those blocks in place
    // where the cache's rows are contiguous (one KV head, or heads outermost), as the copy
    // would be. Rows further apart stay packed: at 8 KV heads of 128 they are 2 KB apart,
    // and a step's K would fall into 8 of L1's 64 sets (32 lines a set, the A tiles reloaded
    // from L2 for every pair of query blocks), which the copy, contiguous, avoids.
    // (Per step, with the step's row stride: paged rows gathered from several blocks are
    // contiguous, `pages::step_rows`.)
    let k_in_place = pb.kv == Kv::BF16 && !k_lo && DK.is_multiple_of(32);
    // Only split products can meet inf . 0 (below).
    let split_scores = n_qk > 1;
    // A bfloat16 model's call (exact Q, BF16 K/V) with P in two parts: P to about 16 bits,
    // not SPEC's half ([`p_pairs_16`]).
    let p16 = q_exact && pb.kv == Kv::BF16 && pv >= 2;

    // The factor each tile's scores still need (the scale of exact Q, or 1).
    let mut scaled = [1.0f32; MAX_NT];
    if !q_packed {
        pack_q::<S>(qt_b, DK, dkp, r, per, ld, qv.hi, qv.lo);
    }
    let q_inf = split_scores && holds_inf(qv.hi, nt * dkp * ld);
    start_rows(m_b, l_b, r);
    start_rows(m_b, ls_b, r);
    std::ptr::write_bytes(ot, 0, nt * DV * ld);

    // K and V^T packed once for every item ([`pack_step`]; BF16 K/V, whose parts no
    // product splits), or null: this item packs each step it computes.
    let pre = if pb.packed.is_null() {
        std::ptr::null()
    } else {
        debug_assert!(!k_lo && vt.lo.is_null(), "packed K/V have one part");
        pb.packed.add(seq.packed + g * packed_len::<DK, DV>(seq.lk))
    };
    t.configure();
    let row_bytes = |d: usize| match pb.kv {
        Kv::F32 => 4 * d,
        Kv::F16 | Kv::BF16 => 2 * d,
        Kv::E4M3(_) | Kv::E5M2(_) => d,
        Kv::Q8_0 => d / 32 * 34,
    };
    let (k_kv, v_kv) = (pb.kv_of(Which::K, g), pb.kv_of(Which::V, g));
    for step in 0..steps {
        let c0 = step * C;
        let n = C.min(seq.lk - c0);
        let (lo_all, hi_all) = plan_step::<S>(pb, seq, subs, mrow, mt, step, c0, n);
        if lo_all >= hi_all {
            continue;
        }
        // K in blocks of 16 rows (a score tile), V in chunks of 32 (a product's reduction):
        // K's blocks `[ka, kin)` read in place where they can be (wholly before the cache's
        // end: rows past it may hold anything, or be past the caller's memory), the others
        // `[kin, kb_end)` packed.
        // The rows any loader below reads: V's chunks of 32 around K's blocks of 16.
        let (sa, sb) = (lo_all & !31, round_up(hi_all, 32));
        let (k_src, k_rs) = step_rows(pb, seq, Which::K, g, c0, n, sa, sb, DK, &mut sc.kpage);
        let (ka, kb_end) = (lo_all & !15, round_up(hi_all, 16));
        let kin = if k_in_place && k_rs == DK && pre.is_null() { (n & !15).clamp(ka, kb_end) } else { ka };
        // This step's packed K: the shared one (rows from the step's first), or this item's.
        let kb = if pre.is_null() {
            pack_k::<S, DK>(k_src, k_rs, k_kv, kin, kb_end, n, dkp, kb.hi, kb.lo);
            kb
        } else {
            Parts { hi: pre.add(c0 * dkp) as *mut u16, lo: std::ptr::null_mut() }
        };
        // Only the split products need it (below).
        let inf = split_scores
            && (q_inf
                || (ka..kin).any(|j| holds_inf(k_src.add(j * k_rs), DK))
                || holds_inf(kb.hi.add(kin * dkp), (kb_end - kin) * dkp));
        let k_cache = Parts { hi: k_src as *mut u16, lo: std::ptr::null_mut() };
        for (k, sub) in subs.iter().enumerate() {
            if sub.lo >= sub.hi {
                continue;
            }
            let st = tile_view(st_b, k, per, ld, C, 1);
            let q = qv.tile(k, per, ld, dkp / 2);
            let (a, b) = (sub.lo & !15, round_up(sub.hi, 16));
            if a < kin {
                scores(t, sub, qk_terms, k_cache, k_rs, q, st, ld, dkp, a, b.min(kin));
            }
            if b > kin.max(a) {
                scores(t, sub, qk_terms, kb, dkp, q, st, ld, dkp, a.max(kin), b);
            }
            if inf {
                redo_nan_scores::<DK>(st, ld, sub, k_src, k_rs, k_kv, qt_b, r);
            }
            // The scale of exact Q: on the scores here where a transform follows (SPEC 10's
            // are of the scaled scores), else in the softmax, which reads them anyway.
            scaled[k] = score_scale;
            if score_scale != 1.0 && (pb.softcap > 0.0 || sub.add || sub.distance) {
                scale_scores::<S>(st, ld, sub, score_scale);
                scaled[k] = 1.0;
            }
            transform_scores::<S>(pb, seq, g, sub, mt.add(k * C * bq), st, ld, c0);
        }
        let vt = if pre.is_null() {
            let (v_src, v_rs) = step_rows(pb, seq, Which::V, g, c0, n, sa, sb, DV, &mut sc.vpage);
            pack_vt::<S, DV>(v_src, v_rs, v_kv, lo_all & !31, round_up(hi_all, 32), n, vt.hi, vt.lo);
            vt
        } else {
            Parts { hi: pre.add(steps * C * dkp + step * DV * C) as *mut u16, lo: std::ptr::null_mut() }
        };
        for (k, sub) in subs.iter().enumerate() {
            // The next step's K and V rows, towards L2 while this step computes, a share
            // after each tile's products (not all at once: the requests in flight are few):
            // rows of different heads are kilobytes apart, each in a page of its own, where
            // the hardware's prefetchers do not follow. (The shared packing is contiguous,
            // where they do.)
            let next = if pre.is_null() { c0 + C + k * C / nt..(c0 + C + (k + 1) * C / nt).min(seq.lk) } else { 0..0 };
            for j in next {
                S::prefetch_span(row(pb, seq, Which::K, g, j) as *const u8, row_bytes(DK));
                S::prefetch_span(row(pb, seq, Which::V, g, j) as *const u8, row_bytes(DV));
            }
            if sub.lo >= sub.hi {
                continue;
            }
            let (st, ot) = (tile_view(st_b, k, per, ld, C, 1), tile_view(ot, k, per, ld, DV, 1));
            let p = pp.tile(k, per, ld, C / 2);
            softmax_pairs::<S>(st, scaled[k], m_b, l_b, ls_b, ms_b, ld, sub, p, p16);
            rescale::<S>(ot, ms_b, ld, DV, sub);
            output(t, sub, &TERMS[..pv], vt, p, ot, ld, DV);
        }
    }
    t.release();

    store_out_t::<S, DV>(pb, seq, g, subs, ot, ld, m_b, l_b, ls_b);
}

/// Whether `n` bfloat16 values at `p` hold an infinity. Without an early exit, so that the
/// scan vectorises (it reads a step's K rows).
#[inline(always)]
unsafe fn holds_inf(p: *const u16, n: usize) -> bool {
    std::slice::from_raw_parts(p, n).iter().fold(false, |seen, &x| seen | (x & 0x7fff == 0x7f80))
}

/// `S^T *= k` on tile `sub`'s computed cache rows (`[lo, hi)`, its query rows): the scale of
/// exact Q, before a transform that needs scaled scores.
#[inline(always)]
unsafe fn scale_scores<S: Simd>(st: *mut f32, ld: usize, sub: &Sub, k: f32) {
    let kv = S::splat(k);
    for j in sub.lo..sub.hi {
        for i0 in (sub.ib..sub.ie).step_by(W) {
            let at = st.add(j * ld + i0);
            S::store(at, S::mul(S::load(at), kv));
        }
    }
}

/// Where Q or K holds an infinity, a product of a high part and a low part can be inf . 0
/// (the low part of most values is 0), a NaN where SPEC's f32 product has +-inf (a score of
/// -inf masks its cache row). Such scores are computed again as one f32 dot product of the
/// operands; a non-finite sum does not depend on the order of its terms, and a finite one
/// never came out NaN. Rare (infinite inputs only), so plain scalar code. `st`: tile `sub`'s
/// view of S^T (row stride `ld`); `qt`: Q^T `[DK][r]`.
#[allow(clippy::too_many_arguments)]
unsafe fn redo_nan_scores<const DK: usize>(
    st: *mut f32,
    ld: usize,
    sub: &Sub,
    k: *const u16,
    k_rs: usize,
    kv: Kv,
    qt: *const f32,
    r: usize,
) {
    for j in sub.lo..sub.hi {
        for i in sub.ib..sub.ie {
            let s = st.add(j * ld + i);
            if !(*s).is_nan() {
                continue;
            }
            let mut acc = 0.0f32;
            for d in 0..DK {
                let row = k.add(j * k_rs);
                let kd = kv_value(row, d, kv);
                acc += kd * *qt.add(d * r + i);
            }
            *s = acc;
        }
    }
}

fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

/// `S^T` of tile `sub`: cache rows `[a, b)` (blocks of 16), its query rows, as the sum of
/// `terms` of K's and Q's parts (`k`: K's row 0, rows `k_rs` elements apart; `q`: the tile's
/// view of Q^T pairs), into `st` (the tile's view of S^T); `ld`: the views' row length.
/// Each block of S^T is computed alone (`gemm::run`), so splitting a tile's rows in two
/// products changes nothing in it.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn scores<T: TileUnit>(
    t: &mut T,
    sub: &Sub,
    terms: &[(bool, bool)],
    k: Parts,
    k_rs: usize,
    q: Parts,
    st: *mut f32,
    ld: usize,
    dkp: usize,
    a: usize,
    b: usize,
) {
    let operands = terms.map_pairs(|(kl, ql)| {
        debug_assert!(!kl || !k.lo.is_null(), "a low part of K that is not there");
        (
            Operand {
                base: k.part(kl).add(a * k_rs * 2),
                row_stride: k_rs * 2,
                chunk_step: 64,
                block_step: 16 * k_rs * 2,
            },
            Operand { base: q.part(ql).add(sub.ib * 4), row_stride: ld * 4, chunk_step: 16 * ld * 4, block_step: 64 },
        )
    });
    let p = Product {
        terms: &operands[..terms.len()],
        chunks: dkp / 32,
        m_blocks: (b - a) / 16,
        n_blocks: (sub.ie - sub.ib) / 16,
        c: Output { base: st.add(a * ld + sub.ib) as *mut u8, row_stride: ld * 4, m_step: 16 * ld * 4, n_step: 64 },
        accumulate: false,
    };
    gemm::run(t, &p);
}

/// `O^T += V^T . P^T` for tile `sub`: its query rows, cache rows `[lo, hi)` rounded out to
/// chunks of 32 (P is zero on the rows added), the sum of `terms` of V's and P's parts (`p`
/// and `ot`: the tile's views, row length `ld`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn output<T: TileUnit>(
    t: &mut T,
    sub: &Sub,
    terms: &[(bool, bool)],
    vt: Parts,
    p: Parts,
    ot: *mut f32,
    ld: usize,
    dv: usize,
) {
    let (a, b) = (sub.lo & !31, round_up(sub.hi, 32));
    let operands = terms.map_pairs(|(vl, pl)| {
        (
            Operand { base: vt.part(vl).add(a * 2), row_stride: C * 2, chunk_step: 64, block_step: 16 * C * 2 },
            Operand {
                base: p.part(pl).add(((a / 2) * ld + sub.ib) * 4),
                row_stride: ld * 4,
                chunk_step: 16 * ld * 4,
                block_step: 64,
            },
        )
    });
    let prod = Product {
        terms: &operands[..terms.len()],
        chunks: (b - a) / 32,
        m_blocks: dv / 16,
        n_blocks: (sub.ie - sub.ib) / 16,
        c: Output { base: ot.add(sub.ib) as *mut u8, row_stride: ld * 4, m_step: 16 * ld * 4, n_step: 64 },
        accumulate: true,
    };
    gemm::run(t, &prod);
}

/// Up to four terms mapped to their operands, in a fixed array (no allocation per step).
trait MapPairs {
    fn map_pairs(&self, f: impl Fn((bool, bool)) -> (Operand, Operand)) -> [(Operand, Operand); 4];
}

impl MapPairs for [(bool, bool)] {
    fn map_pairs(&self, f: impl Fn((bool, bool)) -> (Operand, Operand)) -> [(Operand, Operand); 4] {
        let first = f(self[0]);
        std::array::from_fn(|i| if i < self.len() { f(self[i]) } else { first })
    }
}

/// The step's softmax of tile `sub` (SPEC 2 as `softmax_step`: the lazy max, `S = S * ms +
/// sum p`), writing P^T as VNNI pairs for cache rows `[lo, hi)` rounded out to chunks of 32,
/// p = 0 on the rows added. With a low part (`p.lo`), P is SPEC's half, stored as its two
/// bfloat16 parts (or, `p16`, P to 16 bits: [`p_pairs_16`]); without, P is rounded to bfloat16, the sum `l` is of those values (what O
/// divides by) and `ls` of the values before their rounding (lse's). `k` multiplies the
/// scores first (the scale of exact Q, or 1). `st` and `p` are the tile's views, row length
/// `ld`.
///
/// The max is guessed: most steps leave every row's max where it was (the lazy rescale moves
/// it only past +8), so P is computed against the running max while the step's max is
/// taken along, and only a group of rows where that max passes the threshold is computed
/// again after [`step_max`] (the first step of every row, and rarely any later one). Either
/// way the bits are those of `step_max` then P: where no row's max passes, `step_max` keeps
/// M and sets `ms = 1`, and the maxima agree but for NaN, which passes nothing in either.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn softmax_pairs<S: Simd>(
    st: *const f32,
    k: f32,
    m: *mut f32,
    l: *mut f32,
    ls: *mut f32,
    ms: *mut f32,
    ld: usize,
    sub: &Sub,
    p: Parts,
    p16: bool,
) {
    let one = S::splat(1.0);
    for i0 in (sub.ib..sub.ie).step_by(W) {
        let m_old = S::load(m.add(i0));
        // (Not a closure: one would not inherit the caller's instruction set.)
        let (sum, sum_exact, mx) = if p16 {
            p_pairs_16::<S>(st, k, m_old, ld, sub, i0, p)
        } else {
            p_pairs::<S>(st, k, m_old, ld, sub, i0, p)
        };
        let (sum, sum_exact, scale) = if S::any_gt(mx, S::add(m_old, S::splat(8.0))) {
            let (m_new, scale) = step_max::<S>(st, k, m, ms, ld, i0, sub.lo, sub.hi);
            let (sum, sum_exact, _) = if p16 {
                p_pairs_16::<S>(st, k, m_new, ld, sub, i0, p)
            } else {
                p_pairs::<S>(st, k, m_new, ld, sub, i0, p)
            };
            (sum, sum_exact, scale)
        } else {
            S::store(ms.add(i0), one);
            (sum, sum_exact, one)
        };
        S::store(l.add(i0), S::fma(S::load(l.add(i0)), scale, sum));
        if p.lo.is_null() {
            S::store(ls.add(i0), S::fma(S::load(ls.add(i0)), scale, sum_exact));
        }
    }
}

/// P^T's pairs of the W rows at `i0` of tile `sub` against the max `m_new` (see
/// [`softmax_pairs`]); returns the sum of the stored values, the sum before their rounding
/// to bfloat16 (one product of P; else 0), and the max of the scaled scores over `[lo, hi)`
/// (NaN left out).
#[inline(always)]
unsafe fn p_pairs<S: Simd>(
    st: *const f32,
    k: f32,
    m_new: S::V,
    ld: usize,
    sub: &Sub,
    i0: usize,
    p: Parts,
) -> (S::V, S::V, S::V) {
    let (a, b) = (sub.lo & !31, round_up(sub.hi, 32));
    let (zero, kv) = (S::splat(0.0), S::splat(k));
    let split_p = !p.lo.is_null();
    // Without a low part: p = 2^((s - M) log2 e), the exponent's product with log2 e
    // fused ([`exp2_for_bf16`]).
    let (log2e, m_log2e) = (S::splat(std::f32::consts::LOG2_E), S::mul(m_new, S::splat(-std::f32::consts::LOG2_E)));
    let (mut sum, mut sum_exact, mut mx) = (zero, zero, S::splat(f32::NEG_INFINITY));
    for kp in a / 2..b / 2 {
        let j = 2 * kp;
        // lo and hi are multiples of 4: both rows of a pair are in, or both out.
        let (p0, p1) = if j >= sub.lo && j < sub.hi {
            // As a pass `s *= k` then the softmax (`x * 1` is x to the bit): the described
            // mask and its explicit form give the same bits.
            let (s0, s1) = (S::mul(S::load(st.add(j * ld + i0)), kv), S::mul(S::load(st.add((j + 1) * ld + i0)), kv));
            // A NaN score never wins (the first operand), as in `step_max`.
            mx = S::max(s1, S::max(s0, mx));
            if split_p {
                let e0 = S::exp_for_half(S::sub(s0, m_new));
                let e1 = S::exp_for_half(S::sub(s1, m_new));
                (S::round_half(e0), S::round_half(e1))
            } else {
                let e0 = exp2_for_bf16::<S>(S::fma(s0, log2e, m_log2e));
                let e1 = exp2_for_bf16::<S>(S::fma(s1, log2e, m_log2e));
                sum_exact = S::add(S::add(sum_exact, e0), e1);
                (S::round_bf16(e0), S::round_bf16(e1))
            }
        } else {
            (zero, zero)
        };
        sum = S::add(S::add(sum, p0), p1);
        let at = (kp * ld + i0) * 2;
        if split_p {
            // The pairs keep each lane's top half: the high parts of the split. (p is
            // finite, at most e^8, or NaN: `split`'s care for infinities is not needed.)
            let (l0, l1) = (S::sub(p0, S::trunc_bf16(p0)), S::sub(p1, S::trunc_bf16(p1)));
            S::store_bf16_pairs(p.hi.add(at), p0, p1);
            S::store_bf16_pairs(p.lo.add(at), l0, l1);
        } else {
            S::store_bf16_pairs(p.hi.add(at), p0, p1);
        }
    }
    (sum, sum_exact, mx)
}

/// P^T's pairs as [`p_pairs`] makes them, for a bfloat16 model's call (exact Q, BF16 K/V;
/// two products of P): p = `2^t` to about 3e-6 of its value ([`exp2_for_bf16`]), t =
/// `s k log2 e - M log2 e` in one fused operation, split into its top 16 bits (`hi`) and
/// the top 16 bits of the rest (`lo`): P to about 2^-16 of each value, where SPEC's half
/// keeps 2^-11, for fewer operations (no half rounding, one operation for the exponent
/// where three stood). The sum is of the f32 values, which the parts hold to 2^-16 (their
/// truncation leaves out under 2^-16 of each p). Returns as [`p_pairs`] (no sum before a
/// rounding: 0).
#[inline(always)]
unsafe fn p_pairs_16<S: Simd>(
    st: *const f32,
    k: f32,
    m_new: S::V,
    ld: usize,
    sub: &Sub,
    i0: usize,
    p: Parts,
) -> (S::V, S::V, S::V) {
    let (a, b) = (sub.lo & !31, round_up(sub.hi, 32));
    let zero = S::splat(0.0);
    let kl = S::splat(k * std::f32::consts::LOG2_E);
    let ml = S::mul(m_new, S::splat(-std::f32::consts::LOG2_E));
    let (mut sum, mut mx) = (zero, S::splat(f32::NEG_INFINITY));
    for kp in a / 2..b / 2 {
        let j = 2 * kp;
        // lo and hi are multiples of 4: both rows of a pair are in, or both out.
        let (p0, p1) = if j >= sub.lo && j < sub.hi {
            let (s0, s1) = (S::load(st.add(j * ld + i0)), S::load(st.add((j + 1) * ld + i0)));
            // The max of the unscaled scores, scaled once below (`step_max`'s way: the same
            // bits, rounding being monotonic). A NaN score never wins.
            mx = S::max(s1, S::max(s0, mx));
            (exp2_for_bf16::<S>(S::fma(s0, kl, ml)), exp2_for_bf16::<S>(S::fma(s1, kl, ml)))
        } else {
            (zero, zero)
        };
        sum = S::add(S::add(sum, p0), p1);
        let at = (kp * ld + i0) * 2;
        let (l0, l1) = (S::sub(p0, S::trunc_bf16(p0)), S::sub(p1, S::trunc_bf16(p1)));
        S::store_bf16_pairs(p.hi.add(at), p0, p1);
        S::store_bf16_pairs(p.lo.add(at), l0, l1);
    }
    (sum, zero, S::mul(mx, S::splat(k)))
}

/// `2^t` for the softmax's P where it is rounded to bfloat16 (one product of P): to about
/// 3e-6 of its value (a minimax polynomial of degree 4 on the fraction), where bfloat16 keeps
/// 2^-9, in nine or ten vector operations (`exp`, to 2 ulp for SPEC's half P, takes seventeen).
/// t is at most about 12 (a score at most 8 above the lazy max) or NaN (kept); below -126
/// (-inf: a masked score) 2^t is 0.
#[inline(always)]
unsafe fn exp2_for_bf16<S: Simd>(t: S::V) -> S::V {
    // NaN is the second operand of the clamp and the select: it survives.
    let low = S::splat(-126.0);
    let tc = S::max(low, t);
    let n = S::round(tc);
    let f = S::sub(tc, n);
    let mut p = S::splat(9.582_85e-3);
    p = S::fma(p, f, S::splat(5.590_643e-2));
    p = S::fma(p, f, S::splat(2.402_41e-1));
    p = S::fma(p, f, S::splat(6.931_242e-1));
    p = S::fma(p, f, S::splat(1.0));
    S::ldexp_unless_below(p, n, t, low)
}

/// `O^T[d][i] *= ms[i]` on tile `sub`'s rows where some row's max moved this step (with
/// the lazy rescale most steps leave every factor at 1, and O is left as it is); `ot` the
/// tile's view, row length `ld`.
#[inline(always)]
unsafe fn rescale<S: Simd>(ot: *mut f32, ms: *const f32, ld: usize, dv: usize, sub: &Sub) {
    if (sub.ib..sub.ie).all(|i| *ms.add(i) == 1.0) {
        return;
    }
    for i0 in (sub.ib..sub.ie).step_by(W) {
        let s = S::load(ms.add(i0));
        for d in 0..dv {
            let at = ot.add(d * ld + i0);
            S::store(at, S::mul(S::load(at), s));
        }
    }
}
