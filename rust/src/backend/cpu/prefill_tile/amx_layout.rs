//! The AMX item's operands in the tiles' layouts, each as a bfloat16 high part and, where
//! the products use it, a low part (`x = hi + lo` exactly, see `cpu::amx`):
//!
//! - scores, transposed (`S^T = K . Q^T`): A = K's rows `[C][dkp]` (as stored: no
//!   transpose), B = Q^T as VNNI pairs (pairs of head-dim columns), built once per item;
//! - output, transposed (`O^T += V^T . P^T`): A = V^T `[DV][C]` (pairs of cache rows made
//!   with `bf16_pairs`, then transposed as 32-bit words, per step), B = P^T as VNNI pairs
//!   (pairs of cache rows: two rows of the transposed scores, interleaved, made by the
//!   softmax that computes them).
//!
//! What is indexed by query row (Q^T pairs, S^T, P^T pairs, O^T) is kept per query tile:
//! `[tile][rows][ld]` ([`tile_ld`]: the tile's `per` query rows and a cache line of
//! padding), so that a tile product reads one query tile's block as one contiguous span
//! with a row stride of its own width, never a stride of all the item's rows (at `r = 512`
//! rows a tile's 16 rows were 2 KB apart: the same few sets of L1, which evicted one
//! another). [`tile_view`] addresses a tile's block with the item's row index, so the step
//! plan, masks, transforms and softmax run on it with row stride `ld` as they ran on
//! `[rows][r]`. The buffers start on 64-byte boundaries ([`aligned`]) and `ld` is a multiple
//! of 16: every tile row is one cache line.
//!
//! `dkp` is DK rounded up to a tile's 32 columns (80 and 112 pad with zeros); rows past the
//! cache's end are zeros (never the caller's memory, never NaN).

use super::fma::load_kv;
use super::{tile_view, Kv, C};
use crate::backend::cpu::simd::{Simd, W};

/// The row length (elements per row, per unit of `width`) of a query tile's block in the
/// per-tile layouts: its `per` query rows and 16 more, so that at the usual widths (per a
/// multiple of 32) consecutive rows of a block start an odd number of cache lines apart and
/// a tile's 16 rows, and a block's column over all its rows, spread over every set of L1.
/// The padding is never read by a product nor by the softmax.
pub(super) fn tile_ld(per: usize) -> usize {
    per + 16
}

/// The first 64-byte boundary in `v`, grown so that `n` elements follow it: tile rows then
/// lie in one cache line each (the allocator aligns to 16 bytes only).
pub(in crate::backend::cpu) fn aligned<E: Copy + Default>(v: &mut Vec<E>, n: usize) -> *mut E {
    let extra = 64 / std::mem::size_of::<E>();
    if v.len() < n + extra {
        v.resize(n + extra, E::default());
    }
    let p = v.as_mut_ptr();
    let skip = (64 - p as usize % 64) % 64 / std::mem::size_of::<E>();
    // SAFETY: skip < extra, so the vector holds skip + n elements.
    unsafe { p.add(skip) }
}

/// `x = hi + lo` exactly (both bfloat16) for half values: `hi` is x cut to bfloat16 (one
/// AND; any exact split serves when both parts are multiplied), `lo` the remainder, of at
/// most 3 significant bits and the same sign. An infinity splits as (itself, 0): its
/// remainder `inf - inf` would be NaN and turn a score of -inf (a cache row the products
/// mask, SPEC 3's non-finite inputs) into NaN. A NaN stays NaN in both parts.
#[inline(always)]
pub(super) unsafe fn split<S: Simd>(x: S::V) -> (S::V, S::V) {
    let hi = S::trunc_bf16(x);
    let (zero, big) = (S::splat(0.0), S::splat(f32::MAX));
    let lo = S::select_gt(x, big, zero, S::sub(x, hi));
    (hi, S::select_gt(S::splat(-f32::MAX), x, zero, lo))
}

/// The parts of `x` an operand's products use: both ([`split`]) where its low part is
/// multiplied (`both`), else the nearest bfloat16 alone (the low part is dropped, so the
/// high one must be as close as can be).
#[inline(always)]
pub(super) unsafe fn parts<S: Simd>(x: S::V, both: bool) -> (S::V, S::V) {
    if both {
        split::<S>(x)
    } else {
        (S::round_bf16(x), S::splat(0.0))
    }
}

/// Q^T (`qt`, f32 `[dk][r]`, half values; `r` = the item's rows, tiles of `per`) as B
/// pairs in the per-tile layout (`[tile][dkp/2][ld]` pairs, [`tile_view`]): `hi[k][i] =
/// (q[2k][i], q[2k+1][i])` (and `lo` likewise, when given: then `hi + lo` is Q exactly, else
/// `hi` is Q rounded); pairs past `dk` zero, and the padding zero.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn pack_q<S: Simd>(
    qt: *const f32,
    dk: usize,
    dkp: usize,
    r: usize,
    per: usize,
    ld: usize,
    hi: *mut u16,
    lo: *mut u16,
) {
    let both = !lo.is_null();
    for t in 0..r / per {
        let vh = tile_view(hi, t, per, ld, dkp / 2, 2);
        let vl = if both { tile_view(lo, t, per, ld, dkp / 2, 2) } else { lo };
        for k in 0..dkp / 2 {
            for i0 in (t * per..(t + 1) * per).step_by(W) {
                let (x, y) = if 2 * k < dk {
                    (S::load(qt.add(2 * k * r + i0)), S::load(qt.add((2 * k + 1) * r + i0)))
                } else {
                    (S::splat(0.0), S::splat(0.0))
                };
                let ((xh, xl), (yh, yl)) = (parts::<S>(x, both), parts::<S>(y, both));
                S::store_bf16_pairs(vh.add((k * ld + i0) * 2), xh, yh);
                if both {
                    S::store_bf16_pairs(vl.add((k * ld + i0) * 2), xl, yl);
                }
            }
            let pad = (k * ld + (t + 1) * per) * 2..(k * ld + t * per + ld) * 2;
            for at in pad {
                *vh.add(at) = 0;
                if both {
                    *vl.add(at) = 0;
                }
            }
        }
    }
}

/// Rows `a..b` of a step's K (`src`, F16 or BF16, row stride `rs`; `n` rows exist) as A
/// rows `[C][dkp]`: `hi` (and `lo` when given, as [`parts`]); columns past DK and rows past
/// `n` zero.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn pack_k<S: Simd, const DK: usize>(
    src: *const u16,
    rs: usize,
    kv: Kv,
    a: usize,
    b: usize,
    n: usize,
    dkp: usize,
    hi: *mut u16,
    lo: *mut u16,
) {
    if kv == Kv::BF16 && lo.is_null() {
        // The rows as they are: what rounding each value to bfloat16 would store.
        for j in a..b {
            let dst = hi.add(j * dkp);
            if j < n {
                std::ptr::copy_nonoverlapping(src.add(j * rs), dst, DK);
            } else {
                std::ptr::write_bytes(dst, 0, DK);
            }
            std::ptr::write_bytes(dst.add(DK), 0, dkp - DK);
        }
        return;
    }
    let zero = S::splat(0.0);
    for j in a..b {
        for d0 in (0..dkp).step_by(W) {
            let x = if j < n && d0 < DK { load_kv::<S>(src.add(j * rs), d0, kv) } else { zero };
            let (xh, xl) = parts::<S>(x, !lo.is_null());
            S::store_bf16(hi.add(j * dkp + d0), xh);
            if !lo.is_null() {
                S::store_bf16(lo.add(j * dkp + d0), xl);
            }
        }
    }
}

/// Rows `a..b` (multiples of 32) of a step's V (`src`, row stride `rs`; `n` rows exist) as
/// A rows of V^T `[DV][C]`: `hi[d][j] = v[j][d]` (and `lo`, as [`parts`]). Per 32 rows and 16 columns:
/// sixteen vectors of row pairs (lane d: rows 2k and 2k + 1 of column d), transposed as
/// 32-bit words so that each becomes one tile row (column d, rows 2k0 .. 2k0 + 32).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn pack_vt<S: Simd, const DV: usize>(
    src: *const u16,
    rs: usize,
    kv: Kv,
    a: usize,
    b: usize,
    n: usize,
    hi: *mut u16,
    lo: *mut u16,
) {
    if kv == Kv::BF16 && lo.is_null() {
        // The pairs from the rows' bits (what rounding each value to bfloat16 would keep).
        let zeros = [0u16; W];
        let at = |j: usize, d0: usize| if j < n { src.add(j * rs + d0) } else { zeros.as_ptr() };
        for k0 in (a / 2..b / 2).step_by(W) {
            for d0 in (0..DV).step_by(W) {
                // A loop, not `array::from_fn`: its closure is compiled apart, without the
                // instruction set, and calls every intrinsic.
                let mut ph = [S::splat(0.0); W];
                for (x, v) in ph.iter_mut().enumerate() {
                    let j = 2 * (k0 + x);
                    *v = S::load_bf16_pairs(at(j, d0), at(j + 1, d0));
                }
                S::transpose16(&mut ph);
                for (y, v) in ph.iter().enumerate() {
                    S::store(hi.add((d0 + y) * C + 2 * k0) as *mut f32, *v);
                }
            }
        }
        return;
    }
    let zero = S::splat(0.0);
    let row = |j: usize, d0: usize| if j < n { load_kv::<S>(src.add(j * rs), d0, kv) } else { zero };
    let both = !lo.is_null();
    for k0 in (a / 2..b / 2).step_by(W) {
        for d0 in (0..DV).step_by(W) {
            let mut ph = [zero; W];
            let mut pl = [zero; W];
            for x in 0..W {
                let j = 2 * (k0 + x);
                let ((eh, el), (oh, ol)) = (parts::<S>(row(j, d0), both), parts::<S>(row(j + 1, d0), both));
                ph[x] = S::bf16_pairs(eh, oh);
                pl[x] = S::bf16_pairs(el, ol);
            }
            S::transpose16(&mut ph);
            for (y, v) in ph.iter().enumerate() {
                S::store(hi.add((d0 + y) * C + 2 * k0) as *mut f32, *v);
            }
            if !lo.is_null() {
                S::transpose16(&mut pl);
                for (y, v) in pl.iter().enumerate() {
                    S::store(lo.add((d0 + y) * C + 2 * k0) as *mut f32, *v);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::simd::Portable;

    fn bf(bits: u16) -> f64 {
        half::bf16::from_bits(bits).to_f64()
    }

    /// A pseudo-random half value (normal, subnormal, zero or large) for position `i`.
    fn half_value(i: usize) -> f32 {
        let bits = ((i as u32).wrapping_mul(2654435761) >> 7) as u16 & 0x7bff; // finite
        let x = half::f16::from_bits(bits).to_f32();
        if i.is_multiple_of(3) {
            -x
        } else {
            x
        }
    }

    /// Every half value, subnormals and the largest included, is exactly the sum of its two
    /// bfloat16 parts (both normal: the tiles read denormals as zero); alone, the high part
    /// is the nearest bfloat16.
    #[test]
    fn a_half_is_the_exact_sum_of_its_two_bfloat16_parts() {
        for bits in 0..=0xffffu16 {
            let x = half::f16::from_bits(bits).to_f32();
            if !x.is_finite() {
                continue;
            }
            let v = unsafe { Portable::splat(x) };
            let (hi, lo) = unsafe { parts::<Portable>(v, true) };
            let (hb, lb) = ((hi[0].to_bits() >> 16) as u16, (lo[0].to_bits() >> 16) as u16);
            assert_eq!(hi[0].to_bits() & 0xffff, 0, "hi of {x} is not a bfloat16");
            assert_eq!(lo[0].to_bits() & 0xffff, 0, "lo of {x} is not a bfloat16");
            assert_eq!(bf(hb) + bf(lb), x as f64, "{x} = hi + lo");
            assert!(x == 0.0 || lo[0] == 0.0 || lo[0].abs() >= f32::MIN_POSITIVE, "lo of {x} is a normal bfloat16");
            let (near, none) = unsafe { parts::<Portable>(v, false) };
            assert_eq!(near[0].to_bits(), half::bf16::from_f32(x).to_f32().to_bits(), "{x} alone: the nearest");
            assert_eq!(none[0], 0.0);
        }
    }

    /// Q^T pairs, per query tile: `hi[k][i] + lo[k][i]` is the pair `(q[2k][i], q[2k+1][i])`
    /// exactly at `tile_view`'s place for row i's tile; padded head-dim pairs and the padding
    /// past each tile's rows are zero.
    #[test]
    fn q_pairs_hold_q_exactly_in_two_parts() {
        // 80: its last chunk of 32 columns half zeros; 16: less than one chunk.
        for (dk, dkp) in [(80, 96), (16, 32)] {
            let (per, nt) = (32, 3);
            let (r, ld) = (per * nt, tile_ld(per));
            let len = nt * dkp * ld;
            let qt: Vec<f32> = (0..dk * r).map(half_value).collect();
            let mut hi = vec![0xffffu16; len];
            let mut lo = vec![0xffffu16; len];
            let (h, l) = (hi.as_mut_ptr(), lo.as_mut_ptr());
            unsafe { pack_q::<Portable>(qt.as_ptr(), dk, dkp, r, per, ld, h, l) };
            let at = |t: usize, k: usize, i: usize, e: usize| {
                // The entry's offset in the buffer, through the tile's view.
                let view = unsafe { tile_view(h, t, per, ld, dkp / 2, 2) };
                unsafe { view.add((k * ld + i) * 2 + e).offset_from(h) as usize }
            };
            let mut seen = vec![false; len];
            for t in 0..nt {
                for k in 0..dkp / 2 {
                    for i in t * per..t * per + ld {
                        for e in 0..2 {
                            let x = at(t, k, i, e);
                            assert!(x < len && !seen[x], "tile {t} pair {k} row {i} half {e}: offset {x} reused");
                            seen[x] = true;
                            let want =
                                if i < (t + 1) * per && 2 * k + e < dk { qt[(2 * k + e) * r + i] as f64 } else { 0.0 };
                            assert_eq!(bf(hi[x]) + bf(lo[x]), want, "tile {t} pair {k} row {i} half {e}");
                        }
                    }
                }
            }
            assert!(seen.iter().all(|&s| s), "every entry of the buffer is written");
            // Without a low part, Q rounded to the nearest bfloat16.
            let mut near = vec![0u16; len];
            unsafe { pack_q::<Portable>(qt.as_ptr(), dk, dkp, r, per, ld, near.as_mut_ptr(), std::ptr::null_mut()) };
            for k in 0..dk / 2 {
                for i in 0..r {
                    let want = half::bf16::from_f32(qt[2 * k * r + i]).to_bits();
                    assert_eq!(near[at(i / per, k, i, 0)], want, "pair {k} row {i} rounded");
                }
            }
        }
    }

    /// K rows from F16 (hi + lo exact) and BF16 (hi exact, lo zero), columns past DK and
    /// rows past the cache's end zero, rows outside `a..b` untouched.
    #[test]
    fn k_rows_hold_k_exactly_and_pad_with_zeros() {
        const DK: usize = 112;
        let (dkp, rs, n) = (128, 130, 37);
        for bf16 in [false, true] {
            let src: Vec<u16> = (0..C * rs)
                .map(|i| {
                    let x = half_value(i);
                    if bf16 {
                        half::bf16::from_f32(x).to_bits()
                    } else {
                        half::f16::from_f32(x).to_bits()
                    }
                })
                .collect();
            let mut hi = vec![0x7777u16; C * dkp];
            let mut lo = vec![0x7777u16; C * dkp];
            unsafe {
                pack_k::<Portable, DK>(
                    src.as_ptr(),
                    rs,
                    if bf16 { Kv::BF16 } else { Kv::F16 },
                    16,
                    48,
                    n,
                    dkp,
                    hi.as_mut_ptr(),
                    lo.as_mut_ptr(),
                )
            };
            for j in 0..C {
                for d in 0..dkp {
                    let at = j * dkp + d;
                    if !(16..48).contains(&j) {
                        assert_eq!((hi[at], lo[at]), (0x7777, 0x7777), "row {j} outside a..b was written");
                        continue;
                    }
                    let want = if j < n && d < DK {
                        let s = src[j * rs + d];
                        if bf16 {
                            bf(s)
                        } else {
                            half::f16::from_bits(s).to_f64()
                        }
                    } else {
                        0.0
                    };
                    assert_eq!(bf(hi[at]) + bf(lo[at]), want, "bf16 {bf16} row {j} column {d}");
                    if bf16 {
                        assert_eq!(bf(lo[at]), 0.0, "a bfloat16 has no low part");
                    }
                }
            }
        }
    }

    /// V^T: `hi[d][j] + lo[d][j] = v[j][d]` for the rows packed, zero past the cache's end.
    #[test]
    fn v_transposed_holds_v_exactly() {
        const DV: usize = 80;
        let (rs, n) = (90, 45);
        let src: Vec<u16> = (0..C * rs).map(|i| half::f16::from_f32(half_value(i)).to_bits()).collect();
        let mut hi = vec![0x7777u16; DV * C];
        let mut lo = vec![0x7777u16; DV * C];
        unsafe { pack_vt::<Portable, DV>(src.as_ptr(), rs, Kv::F16, 32, 64, n, hi.as_mut_ptr(), lo.as_mut_ptr()) };
        for d in 0..DV {
            for j in 0..C {
                let at = d * C + j;
                if j < 32 {
                    assert_eq!((hi[at], lo[at]), (0x7777, 0x7777), "row {j} outside a..b was written");
                    continue;
                }
                let want = if j < n { half::f16::from_bits(src[j * rs + d]).to_f64() } else { 0.0 };
                assert_eq!(bf(hi[at]) + bf(lo[at]), want, "V^T[{d}][{j}]");
            }
        }
    }
}
