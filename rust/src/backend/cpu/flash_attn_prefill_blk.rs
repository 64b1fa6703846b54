//! CPU form of `flash_attn_prefill_blk`: classify each (bq x bk) tile of the F16 mask.

use super::{host_ptr, CpuKernelFn, SendPtr};
use crate::error::{MlxError, Result};
use crate::interface::Dispatch;
use crate::recorded::{Broken, RecordedBlk};

/// This op's kernel, by name.
pub const KERNELS: &[(&str, CpuKernelFn)] = &[("flash_attn_prefill_blk", run)];

/// Every value of the tile is -inf or at most -65504 (the most negative half).
pub(super) const SKIP: u8 = 0;
/// Some values are neither all-masked nor all-zero.
pub(super) const MIXED: u8 = 1;
/// Every value is +0 or -0.
pub(super) const ZERO: u8 = 2;

/// Bits of `h` that say "not masked" (0 when `h` is -inf or a negative half of magnitude
/// at least 65504; NaN magnitudes exceed 0x7c00) and "not zero" (0 for +0 and -0), as two
/// integers to OR over a row: branch-free, so the compiler vectorises the loop.
#[inline(always)]
fn row_flags(row: &[u16]) -> (u16, u16) {
    let (mut not_masked, mut not_zero) = (0u16, 0u16);
    for &h in row {
        let mag = h & 0x7fff;
        not_masked |= u16::from(h & 0x8000 == 0) | u16::from(mag.wrapping_sub(0x7bff) > 1);
        not_zero |= mag;
    }
    (not_masked, not_zero)
}

/// The class of a tile given as rows of halves (bit patterns); stops at the first row that
/// makes it mixed.
#[inline]
pub fn classify_rows<'a>(rows: impl Iterator<Item = &'a [u16]>) -> u8 {
    let (mut all_masked, mut all_zero) = (true, true);
    for row in rows {
        let (nm, nz) = row_flags(row);
        all_masked &= nm == 0;
        all_zero &= nz == 0;
        if !all_masked && !all_zero {
            return MIXED;
        }
    }
    if all_masked {
        SKIP
    } else if all_zero {
        ZERO
    } else {
        MIXED
    }
}

/// The class of one tile, from its half bit patterns.
#[inline]
pub fn classify(bits: impl Iterator<Item = u16>) -> u8 {
    let (mut all_masked, mut all_zero) = (true, true);
    for h in bits {
        let mag = h & 0x7fff;
        // Negative, at least 65504 in magnitude, and not NaN (NaN magnitudes exceed 0x7c00).
        all_masked &= h & 0x8000 != 0 && (0x7bff..=0x7c00).contains(&mag);
        all_zero &= mag == 0;
        if !all_masked && !all_zero {
            return MIXED;
        }
    }
    if all_masked {
        SKIP
    } else if all_zero {
        ZERO
    } else {
        MIXED
    }
}

/// The origin's classifier: the mask `[rows, kv_pad]` and its table (`RecordedBlk`).
pub fn run(d: &Dispatch) -> Result<()> {
    let bad = |what: &str| MlxError::Internal(format!("flash_attn_prefill_blk (cpu): {what}"));
    let r = RecordedBlk::decode(d)?.map_err(|Broken(what)| bad(what))?;
    let p = &r.params;
    let mask_need = r.mask_bytes;
    let (rows, kv_pad, bq, bk) = (p.rows as usize, p.kv_pad as usize, p.bq as usize, p.bk as usize);
    let (mask, blk) = (host_ptr(r.mask)?, host_ptr(r.blk)?);
    let q_tiles = rows.div_ceil(bq);
    let k_tiles = kv_pad / bk;
    let mask = SendPtr(mask as *mut u16);
    let blk = SendPtr(blk);
    // Work: a pass over the mask's bytes.
    super::pool::for_each(q_tiles, mask_need, |qt| {
        let (m, b) = (mask, blk);
        let r0 = qt * bq;
        let r1 = (r0 + bq).min(rows);
        for kt in 0..k_tiles {
            let tile_rows = (r0..r1).map(|r| {
                // SAFETY: r < rows and the tile's columns are < kv_pad: inside the mask.
                unsafe { std::slice::from_raw_parts(m.0.add(r * kv_pad + kt * bk), bk) }
            });
            // SAFETY: qt * k_tiles + kt < q_tiles * k_tiles <= blk_len; one task per row of tiles.
            unsafe { *b.0.add(qt * k_tiles + kt) = classify_rows(tile_rows) };
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: f32) -> u16 {
        half::f16::from_f32(x).to_bits()
    }

    #[test]
    fn classes_of_crafted_tiles() {
        assert_eq!(classify([h(f32::NEG_INFINITY); 4].into_iter()), SKIP);
        assert_eq!(classify([h(-65504.0), h(f32::NEG_INFINITY)].into_iter()), SKIP);
        assert_eq!(classify([h(0.0), h(-0.0)].into_iter()), ZERO);
        assert_eq!(classify([h(0.0), h(f32::NEG_INFINITY)].into_iter()), MIXED);
        assert_eq!(classify([h(-65472.0)].into_iter()), MIXED, "the next half above -65504 is not masked");
        assert_eq!(classify([h(1e-7)].into_iter()), MIXED, "a subnormal is not zero");
        assert_eq!(classify([0xfe00u16].into_iter()), MIXED, "NaN is neither masked nor zero");
        assert_eq!(classify([h(f32::INFINITY)].into_iter()), MIXED);
    }

    #[test]
    fn row_classification_agrees_with_the_element_one() {
        let specials = [
            h(f32::NEG_INFINITY),
            h(-65504.0),
            h(-65472.0),
            h(0.0),
            h(-0.0),
            h(1e-7),
            0xfe00,
            0x7e00,
            h(f32::INFINITY),
            h(-1.5),
            0xfc01,
        ];
        let mut state = 12345u64;
        let mut next = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 33) as usize
        };
        for case in 0..3000 {
            // Mostly one special value with a few others, so all three classes occur.
            let base = specials[case % 3];
            let n = 1 + next() % 70;
            let mut v = vec![base; n];
            for _ in 0..next() % 3 {
                let i = next() % n;
                v[i] = specials[next() % specials.len()];
            }
            let rows: Vec<&[u16]> = v.chunks(1 + next() % 9).collect();
            assert_eq!(classify_rows(rows.into_iter()), classify(v.iter().copied()), "{v:x?}");
        }
    }
}
