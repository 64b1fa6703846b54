//! A blocked product on the tile unit: `C (+)= sum over terms of A_t . B_t`, C made of
//! 16 x 16 f32 blocks, A of 16-row blocks and B of 16-column blocks, both walked along the
//! reduction in chunks of 32 (a tile's 16 bf16 pairs). Blocks of C are held in tiles two by
//! two (tiles 0-3), with two A tiles (4, 5) and two B tiles (6, 7) per chunk: four products
//! for four loads, as far as the tile file allows.
//!
//! The terms are the split products of the AMX kernels (for example `K_hi . Q_hi +
//! K_hi . Q_lo + K_lo . Q_hi`): each term is its own pair of operands over the same blocks.

use super::tiles::TileUnit;

/// Where an operand's blocks lie: block b of reduction chunk kc starts at
/// `base + kc * chunk_step + b * block_step` (bytes), its 16 rows `row_stride` bytes apart.
#[derive(Clone, Copy, Debug)]
pub struct Operand {
    pub base: *const u8,
    pub row_stride: usize,
    pub chunk_step: usize,
    pub block_step: usize,
}

impl Operand {
    #[inline(always)]
    unsafe fn at(&self, kc: usize, b: usize) -> *const u8 {
        self.base.add(kc * self.chunk_step + b * self.block_step)
    }
}

/// C's blocks: block (i, j) at `base + i * m_step + j * n_step` (bytes), rows `row_stride`
/// bytes apart.
#[derive(Clone, Copy, Debug)]
pub struct Output {
    pub base: *mut u8,
    pub row_stride: usize,
    pub m_step: usize,
    pub n_step: usize,
}

/// One blocked product: `m_blocks x n_blocks` blocks of C, `chunks` reduction chunks, the
/// sum of `terms` (A, B); C is loaded and added to when `accumulate`, else it starts at 0.
pub struct Product<'a> {
    pub terms: &'a [(Operand, Operand)],
    pub chunks: usize,
    pub m_blocks: usize,
    pub n_blocks: usize,
    pub c: Output,
    pub accumulate: bool,
}

/// Run `p` on the tile unit `t` (configured).
///
/// # Safety
/// Every block the product names must lie in valid memory (C writable), and `t` must be
/// configured ([`TileUnit::configure`]).
#[inline(always)]
pub unsafe fn run<T: TileUnit>(t: &mut T, p: &Product) {
    for i in (0..p.m_blocks).step_by(2) {
        for j in (0..p.n_blocks).step_by(2) {
            match (p.m_blocks - i >= 2, p.n_blocks - j >= 2) {
                (true, true) => block::<T, 2, 2>(t, p, i, j),
                (true, false) => block::<T, 2, 1>(t, p, i, j),
                (false, true) => block::<T, 1, 2>(t, p, i, j),
                (false, false) => block::<T, 1, 1>(t, p, i, j),
            }
        }
    }
}

/// `MB x NB` blocks of C from block (i, j): C tile `2 mi + nj`, A tiles 4 + mi, B 6 + nj.
#[inline(always)]
unsafe fn block<T: TileUnit, const MB: usize, const NB: usize>(t: &mut T, p: &Product, i: usize, j: usize) {
    let c = |mi: usize, nj: usize| p.c.base.add((i + mi) * p.c.m_step + (j + nj) * p.c.n_step);
    let rs = p.c.row_stride;
    if p.accumulate {
        t.load::<0>(c(0, 0), rs);
        if NB == 2 {
            t.load::<1>(c(0, 1), rs);
        }
        if MB == 2 {
            t.load::<2>(c(1, 0), rs);
            if NB == 2 {
                t.load::<3>(c(1, 1), rs);
            }
        }
    } else {
        t.zero::<0>();
        if NB == 2 {
            t.zero::<1>();
        }
        if MB == 2 {
            t.zero::<2>();
            if NB == 2 {
                t.zero::<3>();
            }
        }
    }
    for (a, b) in p.terms {
        for kc in 0..p.chunks {
            t.load::<4>(a.at(kc, i), a.row_stride);
            if MB == 2 {
                t.load::<5>(a.at(kc, i + 1), a.row_stride);
            }
            t.load::<6>(b.at(kc, j), b.row_stride);
            if NB == 2 {
                t.load::<7>(b.at(kc, j + 1), b.row_stride);
            }
            t.dot_bf16::<0, 4, 6>();
            if NB == 2 {
                t.dot_bf16::<1, 4, 7>();
            }
            if MB == 2 {
                t.dot_bf16::<2, 5, 6>();
                if NB == 2 {
                    t.dot_bf16::<3, 5, 7>();
                }
            }
        }
    }
    t.store::<0>(c(0, 0), rs);
    if NB == 2 {
        t.store::<1>(c(0, 1), rs);
    }
    if MB == 2 {
        t.store::<2>(c(1, 0), rs);
        if NB == 2 {
            t.store::<3>(c(1, 1), rs);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::EmulatedTiles;
    use super::*;

    /// Small integers: every sum exact, so the blocked product of two terms over odd block
    /// counts (every remainder case) equals the matrix product to the bit, added to C where
    /// it accumulates, and nothing outside C's blocks is written.
    #[test]
    fn the_blocked_product_of_two_terms_is_the_matrix_product() {
        let (mb, nb, chunks) = (3usize, 5usize, 3usize);
        let (m, n, kd) = (16 * mb, 16 * nb, 32 * chunks);
        let val = |s: usize, x: usize, y: usize| (((x * 7 + y * 3 + s * 5) % 9) as f32 - 4.0) * 0.5;
        // A row-major [m][kd] bf16 (row stride kd + 8); B VNNI [kd/2][n][2] (row stride 2n + 4).
        let a_rs = kd + 8;
        let b_rs = 2 * n + 4;
        let mut terms_data = Vec::new();
        for s in 0..2 {
            let mut a = vec![0u16; m * a_rs];
            for x in 0..m {
                for y in 0..kd {
                    a[x * a_rs + y] = half::bf16::from_f32(val(s, x, y)).to_bits();
                }
            }
            let mut b = vec![0u16; kd / 2 * b_rs];
            for y in 0..kd {
                for z in 0..n {
                    b[(y / 2) * b_rs + 2 * z + y % 2] = half::bf16::from_f32(val(s + 2, y, z)).to_bits();
                }
            }
            terms_data.push((a, b));
        }
        let terms: Vec<(Operand, Operand)> = terms_data
            .iter()
            .map(|(a, b)| {
                (
                    Operand {
                        base: a.as_ptr() as *const u8,
                        row_stride: a_rs * 2,
                        chunk_step: 64,
                        block_step: 16 * a_rs * 2,
                    },
                    Operand {
                        base: b.as_ptr() as *const u8,
                        row_stride: b_rs * 2,
                        chunk_step: 16 * b_rs * 2,
                        block_step: 64,
                    },
                )
            })
            .collect();
        for accumulate in [false, true] {
            let c_rs = n + 3;
            let mut c: Vec<f32> = (0..(m + 1) * c_rs).map(|i| (i % 5) as f32).collect();
            let c0 = c.clone();
            let p = Product {
                terms: &terms,
                chunks,
                m_blocks: mb,
                n_blocks: nb,
                c: Output { base: c.as_mut_ptr() as *mut u8, row_stride: c_rs * 4, m_step: 16 * c_rs * 4, n_step: 64 },
                accumulate,
            };
            let mut t = EmulatedTiles::default();
            unsafe {
                t.configure();
                run(&mut t, &p);
                t.release();
            }
            for x in 0..m + 1 {
                for z in 0..c_rs {
                    let got = c[x * c_rs + z];
                    if x >= m || z >= n {
                        assert_eq!(got, c0[x * c_rs + z], "written outside C at ({x}, {z})");
                        continue;
                    }
                    let mut want = if accumulate { c0[x * c_rs + z] as f64 } else { 0.0 };
                    for s in 0..2 {
                        for y in 0..kd {
                            want += val(s, x, y) as f64 * val(s + 2, y, z) as f64;
                        }
                    }
                    assert_eq!(got as f64, want, "C[{x}][{z}] accumulate {accumulate}");
                }
            }
        }
    }
}
