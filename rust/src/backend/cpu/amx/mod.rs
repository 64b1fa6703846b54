//! Intel AMX for the CPU kernels: whether the tiles may be used ([`available`]), the tile
//! unit they are written against ([`TileUnit`], in hardware and emulated), a blocked
//! product over tiles ([`gemm`]), and how many bf16 products stand for each product of the
//! attention ([`products`]).
//!
//! AMX-BF16 multiplies bfloat16 only. F16 data (and Q, P, which SPEC rounds to half) are
//! split exactly into two bfloat16, `x = hi + lo` with `hi = bf16(x)` and `lo = x - hi` (a
//! half has 11 significant bits, `hi` takes 8, the 3 left fit `lo`; every half, subnormals
//! included, is a normal bfloat16 so the tiles' DAZ never meets them), and a product of two
//! split operands is the sum of the partial products of their parts.

mod detect;
mod emulated;
pub mod gemm;
mod tiles;

use std::sync::atomic::{AtomicU8, Ordering};

pub use detect::available;
pub use emulated::{bf16_in, dot_bf16_words, fma_bf16, EmulatedTiles};
#[cfg(target_arch = "x86_64")]
pub use tiles::HwTiles;
pub use tiles::{tile_config, TileUnit, TILE_ROWS, TILE_ROW_BYTES};

use crate::error::{MlxError, Result};

/// The bf16 products that stand for one product of the attention, in this order (the first
/// `n` are summed): `A_hi.B_hi`, `A_hi.B_lo`, `A_lo.B_hi`, `A_lo.B_lo`, where A is K (for
/// the scores, B = Q) or V (for the output, B = P). One product rounds both operands to
/// bfloat16; two keep B exact (Q, or P as SPEC's half) with A rounded (exact for BF16 K/V,
/// whose low parts are zero); three drop only `lo.lo` (under 2^-14 of the product); four
/// are exact. With one product for P.V the softmax rounds P to bfloat16 (not half), so that
/// the sum it divides by is that of the values multiplied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Products {
    /// Products for Q.K^T (1 to 4; at most 2 with BF16 K).
    pub qk: u8,
    /// Products for P.V (1 to 4; at most 2 with BF16 V).
    pub pv: u8,
}

/// The default per K/V dtype: every product exact (four with F16, two with BF16, whose low
/// parts are zero), as SPEC's f32 products are; only the order of the f32 additions differs
/// from the FMA kernels. docs/spec.md ("The CPU on AMX tiles") has the measured errors: with
/// fewer products the NMSE against float64 can stay at the FMA kernels' (three with F16), but
/// each score moves by up to 2^-14 of its size (the dropped `lo.lo`), far past the FMA
/// kernels' f32 rounding, so P's half rounding differs from SPEC's on many elements (the
/// planted cases' bar against SPEC's own rounding, 2e-11, sees 1.3e-9); and rounding Q or P
/// to bfloat16 (one product, as PyTorch does) is no more accurate than PyTorch and puts lse
/// past SPEC 8's 2e-3 (a score moves by up to 2^-9 of its size, a row's sum by up to 2^-9).
///
/// BF16 Q (a bfloat16 model's call) is read exactly by the AMX item, which scales the scores
/// instead, so its low part is zero and one product of Q is already exact; one product of P
/// (P rounded to bfloat16, as PyTorch rounds it) was measured a little less accurate than
/// PyTorch's bf16 SDPA in the bench (3.5e-6 against 3.1e-6; two: 2.7e-6), so P stays exact.
pub const DEFAULT_F16: Products = Products { qk: 4, pv: 4 };
pub const DEFAULT_BF16: Products = Products { qk: 2, pv: 2 };

/// 0: the default; else `qk * 16 + pv`.
static F16_SETTING: AtomicU8 = AtomicU8::new(0);
static BF16_SETTING: AtomicU8 = AtomicU8::new(0);

fn setting(kv_bf16: bool) -> &'static AtomicU8 {
    if kv_bf16 {
        &BF16_SETTING
    } else {
        &F16_SETTING
    }
}

/// The products the AMX kernels use for F16 (`kv_bf16` false) or BF16 K/V.
pub fn products(kv_bf16: bool) -> Products {
    match setting(kv_bf16).load(Ordering::Relaxed) {
        0 if kv_bf16 => DEFAULT_BF16,
        0 => DEFAULT_F16,
        x => Products { qk: x >> 4, pv: x & 15 },
    }
}

/// Make the AMX kernels use `p` for F16 or BF16 K/V (`None`: the default). Process-wide,
/// for measurements and tests that compare the splits. Each count is 1 to 4 with F16, 1 or
/// 2 with BF16 (a BF16 value has no low part).
pub fn set_products(kv_bf16: bool, p: Option<Products>) -> Result<()> {
    let code = match p {
        None => 0,
        Some(p) => {
            let most = if kv_bf16 { 2 } else { 4 };
            if !(1..=most).contains(&p.qk) || !(1..=most).contains(&p.pv) {
                return Err(MlxError::InvalidArgument(format!(
                    "AMX products must be 1 to {most} each with {} K/V, got qk {} pv {}",
                    if kv_bf16 { "bfloat16" } else { "float16" },
                    p.qk,
                    p.pv
                )));
            }
            p.qk << 4 | p.pv
        }
    };
    setting(kv_bf16).store(code, Ordering::Relaxed);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Settings are per K/V dtype, checked, and `None` restores the default. (The only test
    /// that changes them, so the kernels' tests meet the defaults.)
    #[test]
    fn products_are_set_per_dtype_within_their_ranges() {
        assert_eq!(products(false), DEFAULT_F16);
        assert_eq!(products(true), DEFAULT_BF16);
        set_products(false, Some(Products { qk: 3, pv: 2 })).unwrap();
        assert_eq!(products(false), Products { qk: 3, pv: 2 });
        assert_eq!(products(true), DEFAULT_BF16, "the other dtype's setting is its own");
        assert!(set_products(true, Some(Products { qk: 3, pv: 1 })).is_err(), "bf16 has no low part");
        assert!(set_products(false, Some(Products { qk: 0, pv: 1 })).is_err());
        assert!(set_products(false, Some(Products { qk: 1, pv: 5 })).is_err());
        assert_eq!(products(false), Products { qk: 3, pv: 2 }, "a refused setting changes nothing");
        set_products(false, None).unwrap();
        assert_eq!(products(false), DEFAULT_F16);
    }
}
