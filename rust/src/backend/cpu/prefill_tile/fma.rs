//! The work item on f32 FMAs (AVX-512, AVX2+FMA, portable): each K/V tile of a step is widened
//! to f32 once for every query head of the KV head and every query tile of the item, then
//! Q.K^T and P.V run as blocked FMA loops over the transposed scores.

use super::io::{load_q, store_out};
use super::pages::{q8_0_scale, step_rows, Which};
use super::softmax::softmax_step;
use super::transforms::transform_scores;
use super::{grow, item_subs, plan_step, start_rows, Kv, Problem, Scratch, Seq, Sub, C, MAX_NT};
use crate::backend::cpu::simd::{Simd, W};

/// One work item: query tiles `grp * nt ..` (up to `nt` of them) of sequence `seq`, KV head
/// `g`, all `group` query heads of that KV head. Row `i` of the item is tile
/// `i / (group * bq)`, head `i / bq % group`, query row `i % bq` of the tile.
#[inline(always)]
pub(super) unsafe fn work_item<S: Simd, const DK: usize, const DV: usize>(
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

    let mut subs = item_subs(pb, seq, grp);
    let subs = &mut subs[..nt];

    load_q::<S, DK>(pb, seq, g, subs, qt_b, r, false);
    let (k_kv, v_kv) = (pb.kv_of(Which::K, g), pb.kv_of(Which::V, g));
    start_rows(m_b, l_b, r);
    std::ptr::write_bytes(o_b, 0, r * DV);

    for step in 0..steps {
        let c0 = step * C;
        // Cache rows of this step that exist: the last step of a cache that is not a
        // multiple of C is partial, and K/V rows at or past Lk are never read.
        let n = C.min(seq.lk - c0);
        let (lo_all, hi_all) = plan_step::<S>(pb, seq, subs, mrow, mt, step, c0, n);
        if lo_all >= hi_all {
            continue;
        }
        let (k_step, k_rs) = step_rows(pb, seq, Which::K, g, c0, n, lo_all, hi_all, DK, &mut sc.kpage);
        load_tile::<S, DK>(kf, k_step, k_rs, lo_all, hi_all, n, k_kv);
        for (k, sub) in subs.iter().enumerate() {
            if sub.lo >= sub.hi {
                continue;
            }
            scores::<S, DK>(kf, qt_b, st_b, r, sub.ib, sub.ie, sub.lo, sub.hi);
            transform_scores::<S>(pb, seq, g, sub, mt.add(k * C * bq), st_b, r, c0);
            softmax_step::<S>(st_b, m_b, l_b, ms_b, r, sub.ib, sub.ie, sub.lo, sub.hi);
        }
        let (v_step, v_rs) = step_rows(pb, seq, Which::V, g, c0, n, lo_all, hi_all, DV, &mut sc.vpage);
        accumulate::<S, DV>(st_b, v_step, v_rs, v_kv, vf, o_b, ms_b, r, subs, lo_all, hi_all, n);
    }

    store_out::<S, DV>(pb, seq, g, subs, o_b, m_b, l_b, l_b);
}

/// W elements of K or V from column `col` of the row at `row`, widened to f32 from F16 or
/// BF16 (F32 read as it is; its rows are addressed in u16 units, twice its elements), or
/// from quantised bytes (FP8 times the head's descale factor, one rounding; Q8_0 times its
/// block's scale, exact).
#[inline(always)]
pub(super) unsafe fn load_kv<S: Simd>(row: *const u16, col: usize, kv: Kv) -> S::V {
    match kv {
        Kv::F16 => S::load_f16(row.add(col)),
        Kv::BF16 => S::load_bf16(row.add(col)),
        Kv::F32 => S::load((row as *const f32).add(col)),
        Kv::E4M3(f) => S::mul(S::load_e4m3((row as *const u8).add(col)), S::splat(f)),
        Kv::E5M2(f) => S::mul(S::load_e5m2((row as *const u8).add(col)), S::splat(f)),
        // A vector's 16 columns lie in one block of 32 (`col` is a multiple of W).
        Kv::Q8_0 => {
            let b = (row as *const u8).add(col / 32 * 34);
            S::mul(S::load_i8(b.add(2 + col % 32)), S::splat(q8_0_scale(b)))
        }
    }
}

/// Rows `lo..hi` of `C` rows of `D` halves or bfloat16 values (row stride `rs` elements)
/// widened to f32 `[C][D]`; rows at or past `n` (past the cache's end) are zeros, never read.
#[inline(always)]
pub(super) unsafe fn load_tile<S: Simd, const D: usize>(
    dst: *mut f32,
    src: *const u16,
    rs: usize,
    lo: usize,
    hi: usize,
    n: usize,
    kv: Kv,
) {
    for j in lo..hi {
        let s = src.add(j * rs);
        for dv in (0..D).step_by(W) {
            let x = if j < n { load_kv::<S>(s, dv, kv) } else { S::splat(0.0) };
            S::store(dst.add(j * D + dv), x);
        }
    }
}

/// `st[j][i] = sum_d kf[j][d] * qt[d][i]` for `lo <= j < hi`, `ib <= i < ie` (row stride
/// of `qt` and `st`: `r`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn scores<S: Simd, const D: usize>(
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
pub(super) unsafe fn scores_block<S: Simd, const D: usize, const JB: usize, const IV: usize>(
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

/// Columns of V that one P.V pass covers: a slice of V widened to f32 (`C * V_SPAN * 4` =
/// 8 KiB) stays in L1 while every row block of the item uses it. A head dim that is an odd
/// multiple of W (80, 112) ends with a slice of one vector.
pub(super) const V_SPAN: usize = 2 * W;

/// `o[i] = o[i] * ms[i] + sum_j p[j][i] * v[j]` for the rows of every tile in `subs` that
/// computes this step, over its cache rows, with V at `v` (F16 or BF16, row stride `rs`),
/// slice by slice of `V_SPAN` columns (rows `lo..hi` of each slice widened once for all
/// tiles; rows at or past `n` are zeros, never read).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn accumulate<S: Simd, const D: usize>(
    p: *const f32,
    v: *const u16,
    rs: usize,
    kv: Kv,
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
                let val = if j < n { load_kv::<S>(v.add(j * rs), d0 + x * W, kv) } else { S::splat(0.0) };
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
pub(super) unsafe fn accumulate_block<S: Simd, const D: usize, const IB: usize, const NV: usize>(
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
    use super::super::pages::kv_value;
    use super::*;
    use crate::backend::cpu::simd::Portable;

    /// The vector loader of each instruction set against the scalar one (`kv_value`, itself
    /// checked against each format's values in pages.rs): FP8 E4M3 and E5M2 with a descale
    /// factor, every byte in every lane, and Q8_0 rows of two blocks at each vector's column,
    /// bit for bit (NaN as NaN).
    fn check_load_kv<S: Simd>() {
        let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
        let mut got = [0f32; W];
        for shift in 0..W {
            let bytes: Vec<u8> = (0..256 + W).map(|i| (i + shift) as u8).collect();
            for kv in [Kv::E4M3(0.75), Kv::E5M2(0.75), Kv::E4M3(1.0), Kv::E5M2(1.0)] {
                for col in (0..256).step_by(W) {
                    unsafe { S::store(got.as_mut_ptr(), load_kv::<S>(bytes.as_ptr() as *const u16, col, kv)) };
                    for (e, &g) in got.iter().enumerate() {
                        let want = unsafe { kv_value(bytes.as_ptr() as *const u16, col + e, kv) };
                        assert!(same(g, want), "{} {kv:?} byte {:#x}: {g} against {want}", S::NAME, bytes[col + e]);
                    }
                }
            }
        }
        // Q8_0: two blocks (scales 0.5 and -3), every int8 value at every place of a block.
        let mut row = [0u8; 68];
        for (b, d) in [(0usize, 0.5f32), (1, -3.0)] {
            row[b * 34..b * 34 + 2].copy_from_slice(&half::f16::from_f32(d).to_bits().to_le_bytes());
        }
        for shift in 0..8 {
            for i in 0..32 {
                row[2 + i] = (i * 8 + shift) as u8;
                row[36 + i] = (255 - i * 8 - shift) as u8;
            }
            for col in (0..64).step_by(W) {
                unsafe { S::store(got.as_mut_ptr(), load_kv::<S>(row.as_ptr() as *const u16, col, Kv::Q8_0)) };
                for (e, &g) in got.iter().enumerate() {
                    let want = unsafe { kv_value(row.as_ptr() as *const u16, col + e, Kv::Q8_0) };
                    assert_eq!(g.to_bits(), want.to_bits(), "{} q8_0 column {}", S::NAME, col + e);
                }
            }
        }
    }

    #[test]
    fn the_vector_kv_loaders_are_the_scalar_one() {
        check_load_kv::<Portable>();
        #[cfg(target_arch = "x86_64")]
        {
            use crate::backend::cpu::simd::{has_avx2, has_avx512, Avx2, Avx512};
            if has_avx2() {
                check_load_kv::<Avx2>();
            }
            if has_avx512() {
                check_load_kv::<Avx512>();
            }
        }
    }
}
