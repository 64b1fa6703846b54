//! Where a step's K and V rows are read from (SPEC 11, paged K/V): every loader of the work
//! items (the FMA item's f32 tiles, the AMX item's packing and in-place reads, the shared
//! packing) takes a step's rows as a base pointer and a row stride, and gets them here.
//!
//! Contiguous K/V: the step's rows in place. Paged K/V: sequence row `j` is row `j % bs` of
//! block `table[j / bs]`; a step whose rows lie in one block is read in place as well (every
//! step, for block sizes that are multiples of the step's 64 rows), and a step that spans
//! blocks is gathered into the thread's staging rows first, bit for bit. The loaders see the
//! same values in the same order either way, so the result is the contiguous layout's to
//! the bit.
//!
//! Quantised K/V (SPEC 11: FP8 E4M3 / E5M2 with descale factors, Q8_0): the loaders read
//! the bytes as they read halves (`fma::load_kv`: FP8 widened through F16, exactly, times the
//! KV head's factor, one f32 rounding, `descale * float(x)`; Q8_0 as `float(d) * q`, exact),
//! so a step is read in place as F16 K/V are; a step that spans blocks, or rows whose byte
//! stride is odd (the loaders address rows in u16 units), is copied bit for bit into the
//! staging rows first.

use super::{Kv, Problem, Seq, C};
use crate::backend::cpu::simd::e4m3_half;

/// A quantised K/V format (its `DType` code 7, 8 or 9).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(in crate::backend::cpu) enum QuantFormat {
    E4M3,
    E5M2,
    Q8_0,
}

/// Quantised K/V of a prefill: `Problem::k` / `v` point to bytes, strides in bytes.
#[derive(Clone, Copy)]
pub(in crate::backend::cpu) struct Quant {
    pub format: QuantFormat,
    /// FP8's factors, `[2][n_kv_heads]` (K's, then V's), or null: every factor 1.
    pub descale: *const f32,
    pub n_kv_heads: usize,
}

// SAFETY: the factors are read-only while the kernel runs.
unsafe impl Send for Quant {}
unsafe impl Sync for Quant {}

impl Problem {
    /// The K/V element type of KV head `g`'s K or V: [`Problem::kv`] with FP8's descale
    /// factor of the head (the loaders multiply each widened value by it: one f32 rounding,
    /// `descale * float(x)`).
    #[inline(always)]
    pub(super) unsafe fn kv_of(&self, which: Which, g: usize) -> Kv {
        let Some(qz) = self.quant else { return self.kv };
        if qz.descale.is_null() {
            return self.kv;
        }
        let f = *qz.descale.add(if which == Which::K { 0 } else { qz.n_kv_heads } + g);
        match self.kv {
            Kv::E4M3(_) => Kv::E4M3(f),
            Kv::E5M2(_) => Kv::E5M2(f),
            kv => kv,
        }
    }
}

/// Element `d` of the K/V row at `row` as f32, one at a time (as the vector loaders widen
/// it: `fma::load_kv`).
#[inline(always)]
pub(super) unsafe fn kv_value(row: *const u16, d: usize, kv: Kv) -> f32 {
    let bytes = row as *const u8;
    match kv {
        Kv::F16 => half::f16::from_bits(*row.add(d)).to_f32(),
        Kv::BF16 => half::bf16::from_bits(*row.add(d)).to_f32(),
        Kv::F32 => *(row as *const f32).add(d),
        // The vector loaders' decoding (simd.rs), one byte at a time: E4M3 through the half
        // whose value is the byte's times 2^-8, E5M2 as the top byte of a half.
        Kv::E4M3(f) => f * (half::f16::from_bits(e4m3_half(*bytes.add(d))).to_f32() * 256.0),
        Kv::E5M2(f) => f * half::f16::from_bits((*bytes.add(d) as u16) << 8).to_f32(),
        Kv::Q8_0 => {
            let b = bytes.add(d / 32 * 34);
            q8_0_scale(b) * (*b.add(2 + d % 32) as i8) as f32
        }
    }
}

/// The scale of the Q8_0 block at `b` (its first two bytes, a little-endian F16) as f32.
#[inline(always)]
pub(super) unsafe fn q8_0_scale(b: *const u8) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([*b, *b.add(1)])).to_f32()
}

/// Bytes of a quantised row of `d` values.
fn quant_row_bytes(format: QuantFormat, d: usize) -> usize {
    if format == QuantFormat::Q8_0 {
        d / 32 * 34
    } else {
        d
    }
}

/// The paged caches of a prefill (strides in the kernel's u16 units, as `Problem`'s).
#[derive(Clone, Copy)]
pub(in crate::backend::cpu) struct Pages {
    /// The block table, `[batch][max_blocks]` (the sequence's row at `Seq::table`); every
    /// entry a sequence reads was checked to be a block of the caches.
    pub table: *const i32,
    pub block_size: usize,
    /// Elements from one block of K (V) to the next.
    pub k_bs: usize,
    pub v_bs: usize,
}

// SAFETY: the table is read-only while the kernel runs.
unsafe impl Send for Pages {}
unsafe impl Sync for Pages {}

/// K or V.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Which {
    K,
    V,
}

/// The element offset of row `j` of sequence `seq`, KV head `g`, in K or V (before the
/// cache's base pointer).
#[inline(always)]
pub(super) unsafe fn row_offset(pb: &Problem, seq: &Seq, which: Which, g: usize, j: usize) -> usize {
    let (base, bs_stride, rs, hs) = match which {
        Which::K => (seq.k, pb.pages.map_or(0, |p| p.k_bs), pb.k_rs, pb.k_hs),
        Which::V => (seq.v, pb.pages.map_or(0, |p| p.v_bs), pb.v_rs, pb.v_hs),
    };
    match pb.pages {
        None => base + g * hs + j * rs,
        Some(p) => {
            let block = *p.table.add(seq.table + j / p.block_size) as usize;
            block * bs_stride + g * hs + (j % p.block_size) * rs
        }
    }
}

/// Row `j`'s first element of K or V (its first byte, quantised K/V).
#[inline(always)]
pub(super) unsafe fn row(pb: &Problem, seq: &Seq, which: Which, g: usize, j: usize) -> *const u16 {
    let src = if which == Which::K { pb.k } else { pb.v };
    let off = row_offset(pb, seq, which, g, j);
    if pb.quant.is_some() {
        (src as *const u8).add(off) as *const u16
    } else {
        src.add(off)
    }
}

/// The step at cache row `c0` (`n` of its rows exist) of K or V of KV head `g`, of which
/// the loaders read rows `[lo, hi)` (clamped to `n`): its row 0 and its row stride. Paged
/// rows that span blocks are copied into `stage` (rows `[lo, hi)` at their places; `width`
/// u16 per row, a row of `d` elements) and read from there.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn step_rows(
    pb: &Problem,
    seq: &Seq,
    which: Which,
    g: usize,
    c0: usize,
    n: usize,
    lo: usize,
    hi: usize,
    d: usize,
    stage: &mut Vec<u16>,
) -> (*const u16, usize) {
    if let Some(qz) = pb.quant {
        // Quantised: bytes, strides in bytes. Read in place where the step lies in one
        // block and the row stride is even (a whole number of the loaders' u16 units; rows
        // are read with unaligned loads), else rows [lo, hi) copied, bit for bit, into
        // `stage` at an even width.
        let rs = if which == Which::K { pb.k_rs } else { pb.v_rs };
        let hi = hi.min(n);
        let one_block = pb.pages.is_none_or(|p| n == 0 || c0 / p.block_size == (c0 + n - 1) / p.block_size);
        if lo >= hi || (one_block && rs.is_multiple_of(2)) {
            return (row(pb, seq, which, g, c0), rs / 2);
        }
        let bytes = quant_row_bytes(qz.format, d);
        let width = bytes.div_ceil(2);
        if stage.len() < C * width {
            stage.resize(C * width, 0);
        }
        let dst = stage.as_mut_ptr() as *mut u8;
        for j in lo..hi {
            let src = row(pb, seq, which, g, c0 + j) as *const u8;
            std::ptr::copy_nonoverlapping(src, dst.add(j * 2 * width), bytes);
        }
        return (stage.as_ptr(), width);
    }
    let rs = if which == Which::K { pb.k_rs } else { pb.v_rs };
    let Some(p) = pb.pages else { return (row(pb, seq, which, g, c0), rs) };
    let hi = hi.min(n);
    if n == 0 || c0 / p.block_size == (c0 + n - 1) / p.block_size || lo >= hi {
        // One block holds the step (or nothing of it is read): in place.
        return (row(pb, seq, which, g, c0), rs);
    }
    let width = if pb.kv == Kv::F32 { 2 * d } else { d };
    if stage.len() < C * width {
        stage.resize(C * width, 0);
    }
    for j in lo..hi {
        let src = row(pb, seq, which, g, c0 + j);
        std::ptr::copy_nonoverlapping(src, stage.as_mut_ptr().add(j * width), width);
    }
    (stage.as_ptr(), width)
}

#[cfg(test)]
mod tests {
    use super::*;

    // The formats' values from their definitions (sign, exponent, mantissa), the reference the
    // loaders' bit tricks are checked against.
    /// The f32 value of each FP8 byte, E4M3 (`float8_e4m3fn`: exponent bias 7, no infinity,
    /// 0x7f / 0xff NaN) or E5M2 (bias 15, IEEE's infinities and NaNs): exact, every FP8 value
    /// is an f32.
    const fn fp8_table(e4m3: bool) -> [f32; 256] {
        let (mbits, bias) = if e4m3 { (3u32, 7i32) } else { (2u32, 15i32) };
        let emax = if e4m3 { 15 } else { 31 };
        let mut t = [0.0f32; 256];
        let mut b = 0usize;
        while b < 256 {
            let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0f32 };
            let e = ((b as u32 & 0x7f) >> mbits) as i32;
            let m = (b as u32) & ((1 << mbits) - 1);
            let frac = m as f32 / (1u32 << mbits) as f32;
            t[b] = if e4m3 && e == emax && m == (1 << mbits) - 1 {
                f32::NAN
            } else if !e4m3 && e == emax {
                if m == 0 {
                    sign * f32::INFINITY
                } else {
                    f32::NAN
                }
            } else if e == 0 {
                sign * frac * pow2(1 - bias)
            } else {
                sign * (1.0 + frac) * pow2(e - bias)
            };
            b += 1;
        }
        t
    }

    const fn pow2(e: i32) -> f32 {
        let mut x = 1.0f32;
        let mut i = 0;
        while i < e.abs() {
            x = if e > 0 { x * 2.0 } else { x * 0.5 };
            i += 1;
        }
        x
    }

    static E4M3: [f32; 256] = fp8_table(true);
    static E5M2: [f32; 256] = fp8_table(false);

    #[test]
    fn fp8_bytes_decode_to_the_formats_values() {
        // E4M3: 0x38 = 1.0, 0x7e = 448 (the largest), 0x01 = 2^-9 (the smallest subnormal).
        assert_eq!((E4M3[0x38], E4M3[0x7e], E4M3[0x01], E4M3[0xb8]), (1.0, 448.0, 2f32.powi(-9), -1.0));
        assert!(E4M3[0x7f].is_nan() && E4M3[0xff].is_nan());
        let same = |a: f32, b: f32| a == b || (a.is_nan() && b.is_nan());
        for b in 0..=255u8 {
            // Every byte, as the scalar loader reads it (descale 1, then 0.5 exactly).
            for (kv, table) in [(Kv::E4M3(1.0), &E4M3), (Kv::E5M2(1.0), &E5M2)] {
                let got = unsafe { kv_value([b as u16].as_ptr(), 0, kv) };
                assert!(same(got, table[b as usize]), "{kv:?} {b:#x}: {got} against {}", table[b as usize]);
            }
            let half_e4m3 = unsafe { kv_value([b as u16].as_ptr(), 0, Kv::E4M3(0.5)) };
            assert!(same(half_e4m3, 0.5 * E4M3[b as usize]), "{b:#x}");
        }
    }

    #[test]
    fn q8_0_rows_are_scale_times_the_bytes() {
        let mut row = [0u8; 68];
        row[..2].copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
        row[34..36].copy_from_slice(&half::f16::from_f32(-2.0).to_bits().to_le_bytes());
        for i in 0..32 {
            row[2 + i] = (i as i8 - 16) as u8;
            row[36 + i] = (127 - i as i32) as u8;
        }
        for i in 0..32 {
            unsafe {
                assert_eq!(kv_value(row.as_ptr() as *const u16, i, Kv::Q8_0), 0.5 * (i as f32 - 16.0));
                assert_eq!(kv_value(row.as_ptr() as *const u16, 32 + i, Kv::Q8_0), -2.0 * (127 - i as i32) as f32);
            }
        }
    }
}
