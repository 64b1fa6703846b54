//! A work item's input and output: Q read into Q^T (scaled, rounded to half), and O, lse
//! (with the sinks) written from the accumulators in the output's dtype.

use super::{tile_view, Elem, Problem, Seq, Sub};
use crate::backend::cpu::simd::{Simd, W};

/// Q of the item's rows: `qh = half(scale * q)` (or, where `exact`, q itself: bfloat16 Q
/// for the AMX item, which scales the scores instead), transposed into Q^T (`[D][r]`); rows
/// past the prompt are zero. By blocks of W rows and W columns (a register transpose), so
/// that every line of Q^T is written whole, once. Returns whether every `half(scale * q)` is
/// finite (where one is not, SPEC 9 makes it inf, which exact Q would not).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn load_q<S: Simd, const D: usize>(
    pb: &Problem,
    seq: &Seq,
    g: usize,
    subs: &[Sub],
    qt_b: *mut f32,
    r: usize,
    exact: bool,
) -> bool {
    let scale = S::splat(pb.scale);
    let zero = S::splat(0.0);
    // The largest |half(scale * q)| per lane (a NaN never kept).
    let mut big = zero;
    let mut tmp = [[0f32; D]; W];
    // Each tile's rows (every head of the group) asked for ahead, the next tile's while
    // this one converts: rows are a row of all heads apart, each line of them a miss the
    // hardware's prefetchers do not see coming.
    let esize = if pb.q_dtype == Elem::F32 { 4 } else { 2 };
    let fetch = |sub: &Sub| {
        for rr in 0..sub.nr {
            for hh in 0..pb.group {
                let at = seq.q + (sub.r0 + rr) * pb.q_rs + (g * pb.group + hh) * pb.q_hs;
                let row = pb.q.add(at * esize);
                for b in (0..D * esize).step_by(64) {
                    S::prefetch(row.add(b));
                }
            }
        }
    };
    if let Some(first) = subs.first() {
        fetch(first);
    }
    for (k, sub) in subs.iter().enumerate() {
        if let Some(next) = subs.get(k + 1) {
            fetch(next);
        }
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
                            let h = S::round_half(S::mul(q, scale));
                            big = S::max(S::max(h, S::sub(zero, h)), big);
                            S::store(row.as_mut_ptr().add(dv), if exact { q } else { h });
                        }
                    } else {
                        row.fill(0.0);
                    }
                }
                let i0 = sub.ib + hh * pb.bq + rb;
                // D is a multiple of W at every head dim.
                for d0 in (0..D).step_by(W) {
                    // A loop, not `array::from_fn`: its closure is compiled apart, without
                    // the instruction set, and calls every intrinsic.
                    let mut v = [S::splat(0.0); W];
                    for (x, col) in v.iter_mut().enumerate() {
                        *col = S::load(tmp[x].as_ptr().add(d0));
                    }
                    S::transpose16(&mut v);
                    for (y, col) in v.iter().enumerate() {
                        S::store(qt_b.add((d0 + y) * r + i0), *col);
                    }
                }
            }
        }
    }
    let mut lanes = [0f32; W];
    S::store(lanes.as_mut_ptr(), big);
    lanes.iter().all(|x| x.is_finite())
}

/// bfloat16 Q of the item's rows, exact, straight into the AMX item's Q^T pairs (`hi`, per
/// tile `[dkp/2][ld]` pairs, [`tile_view`]) with no f32 Q^T between: a pair `(q[2k][i],
/// q[2k+1][i])` is the 32-bit word k of row i as stored, so Q^T's pairs are Q's rows
/// transposed as 32-bit words (16 rows by 16 words, a register transpose; bits moved, never
/// converted). Pairs past `dk`, rows past the prompt and each row's padding are zero: the
/// layout and bits `load_q` (exact) then `pack_q` (one part) give. Returns what `load_q`
/// returns, whether every `half(scale * q)` is finite, from the largest |q| (rounding and a
/// positive scale are monotonic; a NaN is never kept).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn load_q_pairs<S: Simd, const D: usize>(
    pb: &Problem,
    seq: &Seq,
    g: usize,
    subs: &[Sub],
    hi: *mut u16,
    dkp: usize,
    ld: usize,
) -> bool {
    debug_assert!(pb.q_dtype == Elem::BF16 && D.is_multiple_of(2 * W));
    let per = pb.bq * pb.group;
    let zero = S::splat(0.0);
    let mut big = zero;
    for (t, sub) in subs.iter().enumerate() {
        debug_assert_eq!(sub.ib, t * per);
        let view = tile_view(hi, t, per, ld, dkp / 2, 2) as *mut f32;
        for hh in 0..pb.group {
            let h = g * pb.group + hh;
            for rb in (0..pb.bq).step_by(W) {
                let i0 = sub.ib + hh * pb.bq + rb;
                let row = |x: usize| {
                    let rr = rb + x;
                    (rr < sub.nr).then(|| (pb.q as *const u16).add(seq.q + (sub.r0 + rr) * pb.q_rs + h * pb.q_hs))
                };
                // W pairs (2W columns) of every row a block: 16 words of 16 rows.
                for k0 in (0..D / 2).step_by(W) {
                    let mut v = [zero; W];
                    for (x, w) in v.iter_mut().enumerate() {
                        if let Some(p) = row(x) {
                            let (a, b) = (S::load_bf16(p.add(2 * k0)), S::load_bf16(p.add(2 * k0 + W)));
                            big = S::max(S::max(a, S::sub(zero, a)), big);
                            big = S::max(S::max(b, S::sub(zero, b)), big);
                            *w = S::load(p.add(2 * k0) as *const f32);
                        }
                    }
                    S::transpose16(&mut v);
                    for (y, w) in v.iter().enumerate() {
                        S::store(view.add((k0 + y) * ld + i0), *w);
                    }
                }
            }
        }
        for k in 0..dkp / 2 {
            let line = view.add(k * ld);
            let (from, to) = if k < D / 2 { ((t + 1) * per, t * per + ld) } else { (t * per, t * per + ld) };
            for i in from..to {
                *line.add(i) = 0.0;
            }
        }
    }
    let mut lanes = [0f32; W];
    S::store(lanes.as_mut_ptr(), S::round_half(S::mul(big, S::splat(pb.scale))));
    lanes.iter().all(|x| x.is_finite())
}

/// The sink logit `sigma` joins a row's running max `m` and sum `l` (SPEC 10): the max
/// becomes `mf = max(m, sigma)`, the sum `l * e^(m - mf) + e^(sigma - mf)`. Returns what O
/// is divided by (the new sum over `e^(m - mf)`, which rescales O to the new max; infinite
/// when that factor underflows, giving zeros) and the new max and sum, in f64 (one row's
/// scalars).
#[inline(always)]
pub(super) fn with_sink(m: f32, l: f32, sigma: f32) -> (f32, f64, f64) {
    let (m, l, sigma) = (m as f64, l as f64, sigma as f64);
    let mf = if sigma > m { sigma } else { m };
    let f = (m - mf).exp();
    let sum = l * f + (sigma - mf).exp();
    ((sum / f) as f32, mf, sum)
}

/// What row `i` of head `h` divides O by, and its lse: S, or with sinks the sum after the
/// sink's rescale ([`with_sink`]); lse = M + ln(S') (S' = `ls`, see [`store_out`]), -inf
/// where the sum is 0.
#[inline(always)]
fn row_divisor(pb: &Problem, h: usize, m: f32, l: f32, ls: f32) -> (f32, f32) {
    if pb.sinks.is_null() {
        return (l, if l == 0.0 { f32::NEG_INFINITY } else { m + ls.ln() });
    }
    // SAFETY: the op's sinks hold one logit per query head.
    let sigma = unsafe { *pb.sinks.add(h) };
    let (div, _, _) = with_sink(m, l, sigma);
    let (_, mf, sum) = with_sink(m, ls, sigma);
    (div, if sum == 0.0 { f32::NEG_INFINITY } else { (mf + sum.ln()) as f32 })
}

/// Row `o` (W values, f32) of the output divided by `l` (zeros where `l == 0`), stored in
/// O's dtype (rounded to nearest even from f32) at element `at` of the output.
#[inline(always)]
unsafe fn store_row<S: Simd>(pb: &Problem, at: usize, o: S::V, l: f32) {
    let o = if l == 0.0 { S::splat(0.0) } else { S::div(o, S::splat(l)) };
    match pb.o_dtype {
        Elem::F32 => S::store((pb.out.0 as *mut f32).add(at), o),
        Elem::F16 => S::store_f16_nearest((pb.out.0 as *mut u16).add(at), o),
        Elem::BF16 => S::store_bf16_nearest((pb.out.0 as *mut u16).add(at), o),
    }
}

/// O / S, or zeros where S == 0 (a row that saw no visible cache row), in O's dtype (rounded
/// to nearest even from f32); lse = M + ln(S), or -inf where S == 0. With sinks, M and S
/// take the head's sink logit first ([`with_sink`]): a row that saw nothing is then zeros
/// with lse = sigma. S' (`ls_b`) is S but where P was rounded coarser than SPEC's half (to
/// bfloat16, by the AMX item's one product): there O divides by the sum of the values it
/// multiplied (S) and lse takes the sum before their rounding (S'), as near as the exp.
/// `o_b`: O, `[r][D]` f32.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn store_out<S: Simd, const D: usize>(
    pb: &Problem,
    seq: &Seq,
    g: usize,
    subs: &[Sub],
    o_b: *const f32,
    m_b: *const f32,
    l_b: *const f32,
    ls_b: *const f32,
) {
    for sub in subs.iter() {
        for hh in 0..pb.group {
            let h = g * pb.group + hh;
            for rr in 0..sub.nr {
                let i = sub.ib + hh * pb.bq + rr;
                let at = seq.o + (sub.r0 + rr) * pb.o_rs + h * pb.o_hs;
                let (l, lse) = row_divisor(pb, h, *m_b.add(i), *l_b.add(i), *ls_b.add(i));
                for dv in (0..D).step_by(W) {
                    store_row::<S>(pb, at + dv, S::load(o_b.add(i * D + dv)), l);
                }
                if pb.has_lse {
                    *pb.lse.0.add(seq.lse + h * pb.lse_hs + sub.r0 + rr) = lse;
                }
            }
        }
    }
}

/// [`store_out`] from the AMX item's O^T (`ot`, f32, per tile `[D][ld]`, [`tile_view`]),
/// transposed on the way by 16 x 16 blocks (a register transpose: the same values, so the
/// same bits as O^T transposed into O then `store_out`), with no O between.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn store_out_t<S: Simd, const D: usize>(
    pb: &Problem,
    seq: &Seq,
    g: usize,
    subs: &[Sub],
    ot: *mut f32,
    ld: usize,
    m_b: *const f32,
    l_b: *const f32,
    ls_b: *const f32,
) {
    let per = pb.bq * pb.group;
    for (t, sub) in subs.iter().enumerate() {
        let view = tile_view(ot, t, per, ld, D, 1);
        for hh in 0..pb.group {
            let h = g * pb.group + hh;
            // bq is a multiple of W: no block of W rows spans two heads.
            for rb in (0..sub.nr).step_by(W) {
                let i0 = sub.ib + hh * pb.bq + rb;
                let rows = W.min(sub.nr - rb);
                let mut div = [0f32; W];
                for (x, d) in div.iter_mut().enumerate().take(rows) {
                    let (i, rr) = (i0 + x, rb + x);
                    let (l, lse) = row_divisor(pb, h, *m_b.add(i), *l_b.add(i), *ls_b.add(i));
                    *d = l;
                    if pb.has_lse {
                        *pb.lse.0.add(seq.lse + h * pb.lse_hs + sub.r0 + rr) = lse;
                    }
                }
                let at = seq.o + (sub.r0 + rb) * pb.o_rs + h * pb.o_hs;
                for d0 in (0..D).step_by(W) {
                    // (A loop, not `array::from_fn`, as in `load_q`.)
                    let mut v = [S::splat(0.0); W];
                    for (y, x) in v.iter_mut().enumerate() {
                        *x = S::load(view.add((d0 + y) * ld + i0));
                    }
                    S::transpose16(&mut v);
                    for (x, row) in v.iter().enumerate().take(rows) {
                        store_row::<S>(pb, at + x * pb.o_rs + d0, *row, div[x]);
                    }
                }
            }
        }
    }
}
