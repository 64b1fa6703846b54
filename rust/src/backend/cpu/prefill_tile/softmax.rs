//! The online softmax of one step on the transposed scores (lanes = query rows).

use crate::backend::cpu::simd::{Simd, W};

/// Online softmax of one step, lanes = rows: new max with the lazy (> +8) rescale,
/// `p = half(exp(s - M))` in place of the scores, `S = S * ms + sum p`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn softmax_step<S: Simd>(
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
    for i0 in (ib..ie).step_by(W) {
        let (m_new, scale) = step_max::<S>(st, 1.0, m, ms, r, i0, lo, hi);
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

/// The step's max of the W rows at `i0` over cache rows `lo..hi`, times `k` (the scores'
/// pending scale: `k * max(s)` is `max(k * s)` to the bit for k > 0, rounding being
/// monotonic), and SPEC 2's lazy update: only where it exceeds the running max by more than
/// 8 does the max move (to it) and the rescale factor `ms = exp(M_old - M_new)` differ from
/// 1. Stores M and ms; returns them.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn step_max<S: Simd>(
    st: *const f32,
    k: f32,
    m: *mut f32,
    ms: *mut f32,
    r: usize,
    i0: usize,
    lo: usize,
    hi: usize,
) -> (S::V, S::V) {
    // As if the max had started at column 0: the -inf columns before `lo` leave -inf.
    let first = S::load(st.add(lo * r + i0));
    let mut mx = if lo == 0 { first } else { S::max(first, S::splat(f32::NEG_INFINITY)) };
    for j in lo + 1..hi {
        mx = S::max(S::load(st.add(j * r + i0)), mx);
    }
    let mx = S::mul(mx, S::splat(k));
    let m_old = S::load(m.add(i0));
    let thresh = S::add(m_old, S::splat(8.0));
    let scale = S::select_gt(mx, thresh, S::exp(S::sub(m_old, mx)), S::splat(1.0));
    let m_new = S::select_gt(mx, thresh, mx, m_old);
    S::store(m.add(i0), m_new);
    S::store(ms.add(i0), scale);
    (m_new, scale)
}
