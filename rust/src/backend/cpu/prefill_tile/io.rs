//! A work item's input and output: Q read into Q^T (scaled, rounded to half), and O, lse
//! (with the sinks) written from the accumulators in the output's dtype.

use super::{Elem, Problem, Seq, Sub};
use crate::backend::cpu::simd::{Simd, W};

/// Q of the item's rows: `qh = half(scale * q)`, transposed into Q^T (`[D][r]`); rows past
/// the prompt are zero. By blocks of W rows, so that every line of Q^T is written whole, once.
#[inline(always)]
pub(super) unsafe fn load_q<S: Simd, const D: usize>(
    pb: &Problem,
    seq: &Seq,
    g: usize,
    subs: &[Sub],
    qt_b: *mut f32,
    r: usize,
) {
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
pub(super) fn with_sink(m: f32, l: f32, sigma: f32) -> (f32, f64, f64) {
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
pub(super) unsafe fn store_out<S: Simd, const D: usize>(
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
