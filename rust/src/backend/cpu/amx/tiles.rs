//! The tile unit the AMX kernels are written against: eight tile registers of 16 rows of 64
//! bytes, loaded and stored with a row stride, and TDPBF16PS. Two implementations:
//! [`HwTiles`], the instructions themselves (inline assembly: the AMX intrinsics are not
//! stable in Rust), and [`super::EmulatedTiles`], the same semantics in software, so that
//! the whole AMX algorithm runs and is tested on any CPU.
//!
//! Every tile is configured 16 x 64 bytes once (palette 1): the kernels pad their operands
//! to whole tiles instead of reconfiguring, which is slow next to a tile product.

// The trait's `# Safety` covers every method.
#![allow(clippy::missing_safety_doc)]

/// Rows of every tile.
pub const TILE_ROWS: usize = 16;
/// Bytes of every tile row: 16 f32, or 32 bf16 (16 VNNI pairs).
pub const TILE_ROW_BYTES: usize = 64;

/// Eight tile registers and the operations the kernels use. Tile numbers are const
/// parameters because the instructions name their registers.
///
/// # Safety
/// Every method is `unsafe`: `configure` must come before the others, pointers must be
/// valid for 16 rows of 64 bytes at the given stride, and the hardware form needs a CPU
/// with AMX-TILE and AMX-BF16 whose OS granted this process the tile data
/// ([`super::available`]).
pub trait TileUnit {
    /// Configure the eight tiles as 16 rows x 64 bytes (palette 1) and zero them.
    unsafe fn configure(&mut self);
    /// Give the tile state back (the tiles become unconfigured).
    unsafe fn release(&mut self);
    /// Tile `T` = 0.
    unsafe fn zero<const T: u8>(&mut self);
    /// Tile `T` = 16 rows of 64 bytes from `src`, `stride` bytes apart.
    unsafe fn load<const T: u8>(&mut self, src: *const u8, stride: usize);
    /// Tile `T`'s 16 rows of 64 bytes to `dst`, `stride` bytes apart.
    unsafe fn store<const T: u8>(&self, dst: *mut u8, stride: usize);
    /// TDPBF16PS: `C[m][n] += sum_k A[m][2k] * B[k][2n] + A[m][2k + 1] * B[k][2n + 1]` for
    /// the f32 tile C (16 x 16), A (16 rows of 16 bf16 pairs) and B (16 rows of 16 pairs).
    unsafe fn dot_bf16<const C: u8, const A: u8, const B: u8>(&mut self);
}

/// The palette-1 configuration of [`TileUnit::configure`]: 64 bytes, palette id, then the
/// bytes per row of each tile (u16 at 16 + 2t) and its rows (u8 at 48 + t).
pub fn tile_config() -> [u8; 64] {
    let mut cfg = [0u8; 64];
    cfg[0] = 1;
    for t in 0..8 {
        cfg[16 + 2 * t..18 + 2 * t].copy_from_slice(&(TILE_ROW_BYTES as u16).to_le_bytes());
        cfg[48 + t] = TILE_ROWS as u8;
    }
    cfg
}

/// The AMX instructions (x86-64 only). A zero-sized value: the state is the CPU's.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Default)]
pub struct HwTiles;

// The asm blocks keep the default memory effects (no `nomem`/`readonly`): the tile
// registers are state the compiler cannot see, so these blocks must stay in program order
// with each other and with the stores that fill the buffers the tiles read.
#[cfg(target_arch = "x86_64")]
impl TileUnit for HwTiles {
    #[inline(always)]
    unsafe fn configure(&mut self) {
        let cfg = tile_config();
        std::arch::asm!("ldtilecfg [{cfg}]", cfg = in(reg) cfg.as_ptr(), options(nostack));
    }
    #[inline(always)]
    unsafe fn release(&mut self) {
        std::arch::asm!("tilerelease", options(nostack));
    }
    #[inline(always)]
    unsafe fn zero<const T: u8>(&mut self) {
        std::arch::asm!("tilezero tmm{t}", t = const T, options(nostack));
    }
    #[inline(always)]
    unsafe fn load<const T: u8>(&mut self, src: *const u8, stride: usize) {
        std::arch::asm!(
            "tileloadd tmm{t}, [{src} + {stride}*1]",
            t = const T,
            src = in(reg) src,
            stride = in(reg) stride,
            options(nostack)
        );
    }
    #[inline(always)]
    unsafe fn store<const T: u8>(&self, dst: *mut u8, stride: usize) {
        std::arch::asm!(
            "tilestored [{dst} + {stride}*1], tmm{t}",
            t = const T,
            dst = in(reg) dst,
            stride = in(reg) stride,
            options(nostack)
        );
    }
    #[inline(always)]
    unsafe fn dot_bf16<const C: u8, const A: u8, const B: u8>(&mut self) {
        // Intel syntax: the destination, then A (ModRM.r/m), then B (VEX.vvvv).
        std::arch::asm!("tdpbf16ps tmm{c}, tmm{a}, tmm{b}", c = const C, a = const A, b = const B, options(nostack));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The configuration block is palette 1 with every tile 16 rows of 64 bytes, the rest
    /// zero (reserved bytes must be zero or LDTILECFG faults).
    #[test]
    fn the_configuration_is_palette_one_with_full_tiles() {
        let cfg = tile_config();
        assert_eq!(cfg[0], 1);
        assert!(cfg[1..16].iter().all(|&b| b == 0), "start row and reserved bytes");
        for t in 0..8 {
            assert_eq!(u16::from_le_bytes([cfg[16 + 2 * t], cfg[17 + 2 * t]]), 64, "tile {t} bytes per row");
            assert_eq!(cfg[48 + t], 16, "tile {t} rows");
        }
        assert!(cfg[32..48].iter().all(|&b| b == 0), "tiles 8-15 bytes per row");
        assert!(cfg[56..].iter().all(|&b| b == 0), "tiles 8-15 rows");
    }
}
