//! The tile unit in software: TDPBF16PS as the Intel SDM's pseudo-code states it, so that
//! the AMX kernels run, and are tested, on CPUs without AMX.
//!
//! The SDM (TDPBF16PS, "Operation"): for each row m of C, a temporary row of 32 f32 starts
//! at zero; for each pair k of A's row and each column n, the even products accumulate into
//! `temp[2n]` and the odd ones into `temp[2n + 1]`, each step an f32 fused multiply-add
//! rounded to nearest even; then `C[m][n] += temp[2n] + temp[2n + 1]` (two f32 additions).
//! Input denormals are read as zero and output denormals flushed to zero (DAZ, FTZ) in
//! every step; MXCSR plays no part.

use super::tiles::{TileUnit, TILE_ROWS, TILE_ROW_BYTES};

/// 32-bit words of one tile.
const WORDS: usize = TILE_ROWS * TILE_ROW_BYTES / 4;

/// Eight tiles of 16 x 64 bytes in memory.
pub struct EmulatedTiles {
    t: [[u32; WORDS]; 8],
    configured: bool,
}

impl Default for EmulatedTiles {
    fn default() -> Self {
        EmulatedTiles { t: [[0; WORDS]; 8], configured: false }
    }
}

/// A signed zero for a zero or denormal f32 (DAZ on an input, FTZ on a result).
#[inline(always)]
pub fn flush(x: f32) -> f32 {
    let b = x.to_bits();
    if b & 0x7f80_0000 == 0 {
        f32::from_bits(b & 0x8000_0000)
    } else {
        x
    }
}

/// A bfloat16 read as f32 (it is the f32's top half), denormals as zero.
#[inline(always)]
pub fn bf16_in(h: u16) -> f32 {
    flush(f32::from_bits((h as u32) << 16))
}

/// `c + a * b` rounded once to f32, nearest even, then flushed: the product of two bfloat16
/// is exact in f64, and so is its sum with an f32 unless one is below 2^-29 of the other,
/// when both the exact sum and the f64 one round to the larger (so one f64 sum rounded to
/// f32 is the fused result).
#[inline(always)]
pub fn fma_bf16(a: f32, b: f32, c: f32) -> f32 {
    flush((a as f64 * b as f64 + c as f64) as f32)
}

/// TDPBF16PS on words: `c` 16 x 16 f32, `a` and `b` 16 x 16 pairs of bfloat16 (low half of
/// a word even, high half odd).
pub fn dot_bf16_words(c: &mut [u32; WORDS], a: &[u32; WORDS], b: &[u32; WORDS]) {
    let half = |w: u32, odd: bool| bf16_in(if odd { (w >> 16) as u16 } else { w as u16 });
    for m in 0..TILE_ROWS {
        let mut temp = [0f32; 32];
        for k in 0..16 {
            let aw = a[m * 16 + k];
            let (a0, a1) = (half(aw, false), half(aw, true));
            for n in 0..16 {
                let bw = b[k * 16 + n];
                temp[2 * n] = fma_bf16(a0, half(bw, false), temp[2 * n]);
                temp[2 * n + 1] = fma_bf16(a1, half(bw, true), temp[2 * n + 1]);
            }
        }
        for n in 0..16 {
            let sum = flush(temp[2 * n] + temp[2 * n + 1]);
            let acc = flush(f32::from_bits(c[m * 16 + n]));
            c[m * 16 + n] = flush(acc + sum).to_bits();
        }
    }
}

impl TileUnit for EmulatedTiles {
    unsafe fn configure(&mut self) {
        self.t = [[0; WORDS]; 8];
        self.configured = true;
    }
    unsafe fn release(&mut self) {
        self.configured = false;
    }
    unsafe fn zero<const T: u8>(&mut self) {
        assert!(self.configured, "tile zero before the tiles were configured");
        self.t[T as usize] = [0; WORDS];
    }
    unsafe fn load<const T: u8>(&mut self, src: *const u8, stride: usize) {
        assert!(self.configured, "tile load before the tiles were configured");
        let tile = &mut self.t[T as usize];
        for row in 0..TILE_ROWS {
            let p = src.add(row * stride) as *const [u32; 16];
            tile[row * 16..row * 16 + 16].copy_from_slice(&std::ptr::read_unaligned(p));
        }
    }
    unsafe fn store<const T: u8>(&self, dst: *mut u8, stride: usize) {
        assert!(self.configured, "tile store before the tiles were configured");
        let tile = &self.t[T as usize];
        for row in 0..TILE_ROWS {
            let words: [u32; 16] = tile[row * 16..row * 16 + 16].try_into().unwrap_or([0; 16]);
            std::ptr::write_unaligned(dst.add(row * stride) as *mut [u32; 16], words);
        }
    }
    unsafe fn dot_bf16<const C: u8, const A: u8, const B: u8>(&mut self) {
        assert!(self.configured, "tile product before the tiles were configured");
        assert!(C != A && C != B && A != B, "TDPBF16PS needs three different tiles");
        let (a, b) = (self.t[A as usize], self.t[B as usize]);
        dot_bf16_words(&mut self.t[C as usize], &a, &b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf16(x: f32) -> u16 {
        half::bf16::from_f32(x).to_bits()
    }

    fn word(even: f32, odd: f32) -> u32 {
        bf16(even) as u32 | (bf16(odd) as u32) << 16
    }

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> f32 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
    }

    /// Integers small enough that every product and sum is exact: the tile product is the
    /// matrix product to the bit, through load, product and store at strides.
    #[test]
    fn the_product_of_exact_data_is_the_matrix_product() {
        let mut a = vec![0u16; 16 * 40]; // 16 rows of 32 bf16, row stride 40 elements
        let mut b = vec![0u16; 16 * 48]; // 16 rows of 16 pairs, row stride 48 elements
        for m in 0..16 {
            for kk in 0..32 {
                a[m * 40 + kk] = bf16(((m * 7 + kk * 3) % 9) as f32 - 4.0);
            }
        }
        for k in 0..16 {
            for nn in 0..32 {
                b[k * 48 + nn] = bf16(((k * 5 + nn * 11) % 7) as f32 - 3.0);
            }
        }
        let mut c = vec![0f32; 16 * 20];
        for (i, x) in c.iter_mut().enumerate() {
            *x = (i % 13) as f32; // C accumulates onto what it holds
        }
        let c0 = c.clone();
        let mut t = EmulatedTiles::default();
        unsafe {
            t.configure();
            t.load::<0>(c.as_ptr() as *const u8, 20 * 4);
            t.load::<1>(a.as_ptr() as *const u8, 40 * 2);
            t.load::<2>(b.as_ptr() as *const u8, 48 * 2);
            t.dot_bf16::<0, 1, 2>();
            t.store::<0>(c.as_mut_ptr() as *mut u8, 20 * 4);
            t.release();
        }
        for m in 0..16 {
            for n in 0..16 {
                let mut want = c0[m * 20 + n] as f64;
                for k in 0..16 {
                    for e in 0..2 {
                        let x = half::bf16::from_bits(a[m * 40 + 2 * k + e]).to_f64();
                        let y = half::bf16::from_bits(b[k * 48 + 2 * n + e]).to_f64();
                        want += x * y;
                    }
                }
                assert_eq!(c[m * 20 + n] as f64, want, "C[{m}][{n}]");
            }
        }
        // Columns past the tile's 16 were not written.
        for m in 0..16 {
            assert_eq!(c[m * 20 + 16..m * 20 + 20], c0[m * 20 + 16..m * 20 + 20]);
        }
    }

    /// Random data against a scalar reference written from the SDM's pseudo-code (even and
    /// odd products in two f32 accumulators from zero, fused steps, then their sum added to
    /// C), bit for bit; and against the float64 dot product, close.
    #[test]
    fn random_data_follows_the_sdm_order_of_rounding() {
        let mut rng = Rng(7);
        let a: [u32; WORDS] = std::array::from_fn(|_| word(rng.next() * 3.0, rng.next()));
        let b: [u32; WORDS] = std::array::from_fn(|_| word(rng.next(), rng.next() * 1e-3));
        let c_in: [u32; WORDS] = std::array::from_fn(|_| (rng.next() * 100.0).to_bits());
        let mut c = c_in;
        dot_bf16_words(&mut c, &a, &b);
        let bf = |w: u32, odd: bool| half::bf16::from_bits(if odd { (w >> 16) as u16 } else { w as u16 }).to_f32();
        for m in 0..16 {
            for n in 0..16 {
                let (mut even, mut odd) = (0f32, 0f32);
                let mut exact = f32::from_bits(c_in[m * 16 + n]) as f64;
                for k in 0..16 {
                    let (aw, bw) = (a[m * 16 + k], b[k * 16 + n]);
                    even = bf(aw, false).mul_add(bf(bw, false), even);
                    odd = bf(aw, true).mul_add(bf(bw, true), odd);
                    exact += bf(aw, false) as f64 * bf(bw, false) as f64 + bf(aw, true) as f64 * bf(bw, true) as f64;
                }
                let want = f32::from_bits(c_in[m * 16 + n]) + (even + odd);
                let got = f32::from_bits(c[m * 16 + n]);
                assert_eq!(got.to_bits(), want.to_bits(), "C[{m}][{n}]");
                assert!((got as f64 - exact).abs() <= 1e-5 * exact.abs().max(1.0), "C[{m}][{n}] {got} vs {exact}");
            }
        }
    }

    /// Denormal inputs read as zero (bf16 and the accumulator), denormal results become
    /// zero, and a product below the normal range flushes even where IEEE keeps it.
    #[test]
    fn denormals_are_zero_in_and_out() {
        let tiny = f32::from_bits(0x0001_0000); // a bfloat16 denormal
        assert_eq!(bf16_in((tiny.to_bits() >> 16) as u16).to_bits(), 0);
        assert_eq!(bf16_in(0x8001).to_bits(), 0x8000_0000, "a negative denormal reads as -0");
        let mut a = [0u32; WORDS];
        let mut b = [0u32; WORDS];
        a[0] = word(1.0, 0.0) | (0x0001 << 16); // odd half: a denormal bf16
        b[0] = word(2.0, 0.0) | (0x3f80 << 16); // times 1.0
        a[1] = word(1e-20, 0.0);
        b[16] = word(1e-20, 0.0); // 1e-40: below the normal range
        let mut c = [0u32; WORDS];
        c[1] = 0x0000_0005; // a denormal accumulator reads as zero
        dot_bf16_words(&mut c, &a, &b);
        assert_eq!(f32::from_bits(c[0]), 2.0, "the denormal odd product counts as zero; 1e-40 flushed");
        assert_eq!(c[1], 0, "0 + a denormal accumulator is +0");
        assert_eq!(fma_bf16(1e-20, 1e-20, 0.0).to_bits(), 0);
        assert_eq!(fma_bf16(-1e-20, 1e-20, 0.0).to_bits(), 0x8000_0000);
    }

    /// One rounding per step: `c + a * b` where the separate product would round first.
    #[test]
    fn the_steps_are_fused_and_round_to_nearest_even() {
        // 1 + 2^-24 is a tie between 1 and 1 + 2^-23: to even (1).
        assert_eq!(fma_bf16(1.0, f32::from_bits(0x3380_0000), 1.0), 1.0);
        // Just above the tie rounds up.
        let above = f32::from_bits(0x3380_0000) * (1.0 + 1.0 / 128.0);
        assert_eq!(fma_bf16(1.0, above, 1.0), f32::from_bits(0x3f80_0001));
        // Overflow gives inf; NaN propagates.
        assert_eq!(fma_bf16(f32::MAX, 2.0, 0.0), f32::INFINITY);
        assert!(fma_bf16(f32::NAN, 1.0, 0.0).is_nan());
    }

    #[test]
    #[should_panic(expected = "before the tiles were configured")]
    fn a_product_before_configure_is_refused() {
        let mut t = EmulatedTiles::default();
        unsafe { t.dot_bf16::<0, 1, 2>() };
    }
}
