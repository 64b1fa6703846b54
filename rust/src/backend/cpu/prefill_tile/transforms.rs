//! The masks and SPEC 10's score transforms on a step's transposed scores (`[C][r]`): the
//! explicit mask (loaded and transposed per tile, times each head's ALiBi slope), ALiBi on
//! the described mask's distance, the description's hidden pairs, and softcap.

use super::{Problem, Seq, Sub, C, NO_RIGHT};
use crate::backend::cpu::simd::{Simd, W};

/// Everything between the scores and the softmax of tile `sub` in the step at `c0`, in
/// SPEC 10's order: softcap, the explicit mask (`mt`, loaded by the step's plan) times the
/// heads' slopes, ALiBi's distance, then the description's hidden pairs.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn transform_scores<S: Simd>(
    pb: &Problem,
    seq: &Seq,
    g: usize,
    sub: &Sub,
    mt: *const f32,
    st: *mut f32,
    r: usize,
    c0: usize,
) {
    if pb.softcap > 0.0 {
        softcap::<S>(pb.softcap, st, r, sub.ib, sub.ie, sub.lo, sub.hi);
    }
    if sub.add {
        add_mask::<S>(pb, g, mt, st, r, sub.ib, sub.lo, sub.hi);
    }
    if sub.distance {
        add_distance::<S>(pb, seq, g, st, r, sub, c0);
    }
    if sub.hide {
        hide::<S>(pb, seq, st, r, sub, c0);
    }
}

/// SPEC 10: `s = cap * tanh(s / cap)` on the scores of cache rows `lo..hi`, rows `ib..ie`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn softcap<S: Simd>(cap: f32, st: *mut f32, r: usize, ib: usize, ie: usize, lo: usize, hi: usize) {
    let (c, inv) = (S::splat(cap), S::splat(1.0 / cap));
    for j in lo..hi {
        for i0 in (ib..ie).step_by(W) {
            let p = st.add(j * r + i0);
            S::store(p, S::mul(c, S::tanh(S::mul(S::load(p), inv))));
        }
    }
}

/// Load the explicit mask (at `mask`, its sequence's start) of cache rows `c0..c0+C` for the
/// tile's rows into `mt` (`[C][bq]`, f32), and return the range `[lo, hi)` (multiples of 4)
/// outside which every value is -inf. Columns at or past `n` (the cache's end) are not read
/// and count as -inf; mask rows past the prompt are not read and count as zero.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn load_mask<S: Simd>(
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
pub(super) unsafe fn add_mask<S: Simd>(
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

/// ALiBi on the positions: each score of cache rows `lo..hi` (step at `c0`) gains
/// `-slope_h * |p - j|`, `p = r + offset` the query's position: flash-attn's `alibi_slopes`,
/// and `max_bias` without an explicit mask (the mask llama.cpp writes for ALiBi models holds
/// `-(p - j)` on a visible pair, and a causal description's visible pairs have `j <= p`).
/// Pairs the description hides are set to -inf afterwards, whatever this adds to them. The
/// distance is an integer, exact in f32 below 2^24.
#[inline(always)]
pub(super) unsafe fn add_distance<S: Simd>(
    pb: &Problem,
    seq: &Seq,
    g: usize,
    st: *mut f32,
    r: usize,
    sub: &Sub,
    c0: usize,
) {
    let mut lane = [0f32; W];
    for (x, l) in lane.iter_mut().enumerate() {
        *l = x as f32;
    }
    let lane = S::load(lane.as_ptr());
    let zero = S::splat(0.0);
    for hh in 0..pb.group {
        let slope = S::splat(*pb.dist_slopes.add(seq.alibi + g * pb.group + hh));
        for j in sub.lo..sub.hi {
            // Row r0 + rv + x of the tile: j - p = (c0 + j - off - r0 - rv) - x.
            let base = (c0 + j) as i64 - seq.off - sub.r0 as i64;
            for rv in (0..pb.bq).step_by(W) {
                let d = S::sub(S::splat((base - rv as i64) as f32), lane);
                // -|j - p|: the same value as j - p wherever j <= p.
                let dist = S::min(d, S::sub(zero, d));
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
pub(super) unsafe fn hide<S: Simd>(pb: &Problem, seq: &Seq, st: *mut f32, r: usize, sub: &Sub, c0: usize) {
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
        // Row r0 + rr sees ja iff rr >= ja - off - r0 - right (causal: right 0) and
        // rr < ja - off - r0 + w (window).
        let rel = ja - off - sub.r0 as i64;
        let (a, b) = if ja >= seq.lk as i64 {
            (0, 0)
        } else {
            let a = if pb.right != NO_RIGHT { (rel - pb.right).clamp(0, bq) } else { 0 };
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
