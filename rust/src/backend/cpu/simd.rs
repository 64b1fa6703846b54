//! A 16-lane f32 vector abstraction with one implementation per instruction set, chosen at
//! run time. Kernels are written once, generic over [`Simd`], `#[inline(always)]`, and
//! instantiated inside `#[target_feature]` entry points so the intrinsics inline.
//!
//! Every operation that can meet a NaN keeps it (min/max/clamps are ordered so a NaN input
//! comes out NaN), so a NaN in Q, K or V reaches the output instead of vanishing.

#![allow(clippy::missing_safety_doc)]

/// Lanes per vector.
pub const W: usize = 16;

/// The half whose value is an FP8 E4M3 byte's times 2^-8 (NaN for 0x7f / 0xff):
/// [`Simd::load_e4m3`]'s lanes.
#[inline(always)]
pub fn e4m3_half(b: u8) -> u16 {
    let mag = (b & 0x7f) as u16;
    let h = ((b as u16 & 0x80) << 8) | (mag << 7);
    if mag == 0x7f {
        0xffff
    } else {
        h
    }
}

/// A 16-lane f32 vector type and its operations.
pub trait Simd: Copy + Send + Sync + 'static {
    type V: Copy;
    /// Human-readable name of the instruction set.
    const NAME: &'static str;
    /// Whether the register file holds a 4x4 block of vectors plus operands (32 zmm) or
    /// only a 2x2 one (16 ymm hold 8 two-register vectors).
    const WIDE_BLOCKS: bool;
    unsafe fn splat(x: f32) -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    /// Load 16 IEEE halves and widen them.
    unsafe fn load_f16(p: *const u16) -> Self::V;
    /// Load 16 bfloat16 values and widen them (exact: the top half of an f32).
    unsafe fn load_bf16(p: *const u16) -> Self::V;
    /// Load 16 FP8 E5M2 bytes and widen them (exact: each is the top byte of a half).
    #[inline(always)]
    unsafe fn load_e5m2(p: *const u8) -> Self::V {
        let b = std::ptr::read_unaligned(p as *const [u8; W]);
        Self::load_f16(b.map(|x| (x as u16) << 8).as_ptr())
    }
    /// Load 16 FP8 E4M3 (`float8_e4m3fn`) bytes and widen them, exactly: a byte's bits less
    /// its sign, shifted to a half's exponent and mantissa, are its value times 2^-8 (the
    /// biases 7 and 15 differ by 8; E4M3's subnormals land on halves, normal or not), the
    /// sign is the half's, 0x7f / 0xff become NaN (E4M3 has no infinity), and 2^8 is exact.
    #[inline(always)]
    unsafe fn load_e4m3(p: *const u8) -> Self::V {
        let b = std::ptr::read_unaligned(p as *const [u8; W]);
        Self::mul(Self::load_f16(b.map(e4m3_half).as_ptr()), Self::splat(256.0))
    }
    /// Load 16 int8 values and widen them (exact).
    #[inline(always)]
    unsafe fn load_i8(p: *const u8) -> Self::V {
        let b = std::ptr::read_unaligned(p as *const [i8; W]);
        Self::load(b.map(|x| x as f32).as_ptr())
    }
    /// Round every lane to the nearest half (ties to even) and widen back.
    unsafe fn round_half(v: Self::V) -> Self::V;
    /// `a * b + c`, fused where the hardware has it.
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn sub(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn div(a: Self::V, b: Self::V) -> Self::V;
    /// Lane-wise `if a > b { a } else { b }` (a NaN in `a` never wins, one in `b` does).
    unsafe fn max(a: Self::V, b: Self::V) -> Self::V;
    /// Lane-wise `if a < b { a } else { b }`.
    unsafe fn min(a: Self::V, b: Self::V) -> Self::V;
    /// Lane-wise `if a > b { t } else { f }`.
    unsafe fn select_gt(a: Self::V, b: Self::V, t: Self::V, f: Self::V) -> Self::V;
    /// Lane-wise round to the nearest integer (ties to even).
    unsafe fn round(v: Self::V) -> Self::V;
    /// `p * 2^n` for integral `n` in [-126, 127].
    unsafe fn ldexp(p: Self::V, n: Self::V) -> Self::V;
    /// Round every lane to the nearest bfloat16 (ties to even), kept as f32; NaN stays NaN.
    unsafe fn round_bf16(v: Self::V) -> Self::V;

    /// Lane-wise `if low > t { 0 } else { ldexp(p, n) }` (a NaN `t` keeps `ldexp(p, n)`): a
    /// `2^t` whose `t` below `low` is 0. One masked instruction where the set has one.
    #[inline(always)]
    unsafe fn ldexp_unless_below(p: Self::V, n: Self::V, t: Self::V, low: Self::V) -> Self::V {
        Self::select_gt(low, t, Self::splat(0.0), Self::ldexp(p, n))
    }
    /// Every lane's top 16 bits (a bfloat16 toward zero), kept as f32: one AND, for exact
    /// splits `x = trunc + (x - trunc)` where both parts are used.
    unsafe fn trunc_bf16(v: Self::V) -> Self::V;
    /// Store the 16 lanes as bfloat16 by keeping their top 16 bits: exact for values that
    /// are bfloat16 already (what [`Simd::round_bf16`] returns, or the parts of a split).
    unsafe fn store_bf16(p: *mut u16, v: Self::V);
    /// Pairs of bfloat16 in 32-bit lanes: lane x holds the top 16 bits of `even[x]` in its
    /// low half and those of `odd[x]` in its high half (as [`Simd::store_bf16`] keeps them),
    /// the pairs of the AMX tiles' VNNI layout; the lanes are bit patterns, not numbers.
    unsafe fn bf16_pairs(even: Self::V, odd: Self::V) -> Self::V;

    /// Store 32 bfloat16 interleaved, `p[2x] = even[x]`, `p[2x + 1] = odd[x]`
    /// ([`Simd::bf16_pairs`]).
    #[inline(always)]
    unsafe fn store_bf16_pairs(p: *mut u16, even: Self::V, odd: Self::V) {
        Self::store(p as *mut f32, Self::bf16_pairs(even, odd))
    }

    /// The pairs of [`Simd::bf16_pairs`] straight from 16 bfloat16 values at `even` and 16 at
    /// `odd` (the values' own bits, as rounding them to bfloat16 keeps them).
    #[inline(always)]
    unsafe fn load_bf16_pairs(even: *const u16, odd: *const u16) -> Self::V {
        Self::bf16_pairs(Self::load_bf16(even), Self::load_bf16(odd))
    }

    /// Store the 16 lanes as IEEE halves, each the nearest (ties to even; a NaN stays a
    /// NaN, quieted), as `half::f16::from_f32` does.
    #[inline(always)]
    unsafe fn store_f16_nearest(p: *mut u16, v: Self::V) {
        let mut x = [0f32; W];
        Self::store(x.as_mut_ptr(), v);
        for (e, &v) in x.iter().enumerate() {
            *p.add(e) = half::f16::from_f32(v).to_bits();
        }
    }

    /// Store the 16 lanes as bfloat16, each the nearest (ties to even; a NaN stays a NaN,
    /// quieted), as `half::bf16::from_f32` does.
    #[inline(always)]
    unsafe fn store_bf16_nearest(p: *mut u16, v: Self::V) {
        let mut x = [0f32; W];
        Self::store(x.as_mut_ptr(), v);
        for (e, &v) in x.iter().enumerate() {
            *p.add(e) = half::bf16::from_f32(v).to_bits();
        }
    }

    /// Ask for the cache line at `p` to be brought towards the core (L2), ahead of its use;
    /// nothing where the instruction set has no such hint.
    #[inline(always)]
    unsafe fn prefetch(_p: *const u8) {}

    /// [`Simd::prefetch`] every cache line of `bytes` bytes from `p`.
    #[inline(always)]
    unsafe fn prefetch_span(p: *const u8, bytes: usize) {
        for at in (0..bytes).step_by(64) {
            Self::prefetch(p.add(at));
        }
    }

    /// Transpose 16 vectors as a 16 x 16 matrix of 32-bit lanes (bit patterns kept): lane x
    /// of vector y becomes lane y of vector x. Through memory here; an instruction set whose
    /// speed matters for it has a register form.
    #[inline(always)]
    unsafe fn transpose16(rows: &mut [Self::V; W]) {
        let mut m = [[0u32; W]; W];
        for (y, row) in rows.iter().enumerate() {
            Self::store(m[y].as_mut_ptr() as *mut f32, *row);
        }
        for (x, row) in rows.iter_mut().enumerate() {
            let col: [u32; W] = std::array::from_fn(|y| m[y][x]);
            *row = Self::load(col.as_ptr() as *const f32);
        }
    }

    /// Whether `a > b` in some lane (a NaN in either never is). Through memory here; an
    /// instruction set whose speed matters for it compares in registers.
    #[inline(always)]
    unsafe fn any_gt(a: Self::V, b: Self::V) -> bool {
        let (mut x, mut y) = ([0f32; W], [0f32; W]);
        Self::store(x.as_mut_ptr(), a);
        Self::store(y.as_mut_ptr(), b);
        x.iter().zip(&y).any(|(a, b)| a > b)
    }

    /// e^x where it is rounded to half next (SPEC 2's p, `x <= 8` there): `2^t`, t = x log2
    /// e, by a degree-5 polynomial on t's fraction, in eleven operations where
    /// [`Simd::exp`] takes seventeen. Relative error about 1e-7, plus t's rounding (about
    /// 1e-6 at the smallest p half keeps); half's own rounding, 2^-12, is 200 times either.
    /// t is clamped to [-126, 127], where [`Simd::ldexp`] holds: below, the result is at most
    /// 2^-125.5, which half rounds to 0 as it does e^x; NaN stays NaN.
    #[inline(always)]
    unsafe fn exp_for_half(x: Self::V) -> Self::V {
        let t = Self::mul(x, Self::splat(std::f32::consts::LOG2_E));
        // NaN is the second operand of both, so it survives the clamps.
        let t = Self::max(Self::splat(-126.0), Self::min(Self::splat(127.0), t));
        let n = Self::round(t);
        let f = Self::sub(t, n);
        let mut p = Self::splat(1.327_647_1e-3);
        p = Self::fma(p, f, Self::splat(9.675_542e-3));
        p = Self::fma(p, f, Self::splat(5.550_713e-2));
        p = Self::fma(p, f, Self::splat(2.402_212e-1));
        p = Self::fma(p, f, Self::splat(6.931_469_4e-1));
        p = Self::fma(p, f, Self::splat(1.000_000_1));
        Self::ldexp(p, n)
    }

    /// e^x to about 2 ulp; 0 below -87.3, e^88.3 above 88.3, NaN stays NaN.
    #[inline(always)]
    unsafe fn exp(x: Self::V) -> Self::V {
        let lo = Self::splat(-87.33);
        let hi = Self::splat(88.3);
        // NaN is the second operand of both, so it survives the clamps.
        let xc = Self::max(lo, Self::min(hi, x));
        let n = Self::round(Self::mul(xc, Self::splat(std::f32::consts::LOG2_E)));
        // Cody-Waite reduction: ln 2 in two parts.
        let r = Self::fma(n, Self::splat(-0.693_359_4), xc);
        let r = Self::fma(n, Self::splat(2.121_944_4e-4), r);
        let mut p = Self::splat(1.987_569_1e-4);
        p = Self::fma(p, r, Self::splat(1.398_199_9e-3));
        p = Self::fma(p, r, Self::splat(8.333_452e-3));
        p = Self::fma(p, r, Self::splat(4.166_579_6e-2));
        p = Self::fma(p, r, Self::splat(1.666_666_5e-1));
        p = Self::fma(p, r, Self::splat(0.5));
        let r2 = Self::mul(r, r);
        let p = Self::add(Self::fma(p, r2, r), Self::splat(1.0));
        let e = Self::ldexp(p, n);
        // Below the clamp the true value rounds to 0 in half anyway; make it exactly 0.
        Self::select_gt(lo, x, Self::splat(0.0), e)
    }

    /// tanh(x) to a few ulp (SPEC 10's softcap); NaN stays NaN, +-1 beyond +-9.
    #[inline(always)]
    unsafe fn tanh(x: Self::V) -> Self::V {
        let zero = Self::splat(0.0);
        // |x|; NaN is the second operand, so it survives.
        let a = Self::max(x, Self::sub(zero, x));
        // Away from 0: (1 - e^(-2a)) / (1 + e^(-2a)), where 1 - e^(-2a) loses no digits.
        let t = Self::exp(Self::mul(a, Self::splat(-2.0)));
        let one = Self::splat(1.0);
        let big = Self::div(Self::sub(one, t), Self::add(one, t));
        let big = Self::select_gt(x, zero, big, Self::sub(zero, big));
        // Near 0 the series (its next term is below 1e-7 of tanh at the switch).
        let x2 = Self::mul(x, x);
        let mut p = Self::splat(62.0 / 2835.0);
        p = Self::fma(p, x2, Self::splat(-17.0 / 315.0));
        p = Self::fma(p, x2, Self::splat(2.0 / 15.0));
        p = Self::fma(p, x2, Self::splat(-1.0 / 3.0));
        let small = Self::fma(Self::mul(p, x2), x, x);
        Self::select_gt(Self::splat(0.3125), a, small, big)
    }
}

/// Plain Rust, 16 lanes as an array; correct everywhere, vectorised where LLVM can.
#[derive(Clone, Copy)]
pub struct Portable;

macro_rules! lanes {
    (|$i:ident| $e:expr) => {{
        let mut out = [0f32; W];
        for $i in 0..W {
            out[$i] = $e;
        }
        out
    }};
}

impl Simd for Portable {
    type V = [f32; W];
    const NAME: &'static str = "portable";
    const WIDE_BLOCKS: bool = true;
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self::V {
        [x; W]
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self::V {
        std::ptr::read_unaligned(p as *const [f32; W])
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: Self::V) {
        std::ptr::write_unaligned(p as *mut [f32; W], v)
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> Self::V {
        let h = std::ptr::read_unaligned(p as *const [u16; W]);
        lanes!(|i| half::f16::from_bits(h[i]).to_f32())
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const u16) -> Self::V {
        let h = std::ptr::read_unaligned(p as *const [u16; W]);
        lanes!(|i| f32::from_bits((h[i] as u32) << 16))
    }
    #[inline(always)]
    unsafe fn round_half(v: Self::V) -> Self::V {
        lanes!(|i| half::f16::from_f32(v[i]).to_f32())
    }
    #[inline(always)]
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V {
        // Unfused: a libm fma call per lane would be far slower than the rounding it saves.
        lanes!(|i| a[i] * b[i] + c[i])
    }
    #[inline(always)]
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V {
        lanes!(|i| a[i] + b[i])
    }
    #[inline(always)]
    unsafe fn sub(a: Self::V, b: Self::V) -> Self::V {
        lanes!(|i| a[i] - b[i])
    }
    #[inline(always)]
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V {
        lanes!(|i| a[i] * b[i])
    }
    #[inline(always)]
    unsafe fn div(a: Self::V, b: Self::V) -> Self::V {
        lanes!(|i| a[i] / b[i])
    }
    #[inline(always)]
    unsafe fn max(a: Self::V, b: Self::V) -> Self::V {
        lanes!(|i| if a[i] > b[i] { a[i] } else { b[i] })
    }
    #[inline(always)]
    unsafe fn min(a: Self::V, b: Self::V) -> Self::V {
        lanes!(|i| if a[i] < b[i] { a[i] } else { b[i] })
    }
    #[inline(always)]
    unsafe fn select_gt(a: Self::V, b: Self::V, t: Self::V, f: Self::V) -> Self::V {
        lanes!(|i| if a[i] > b[i] { t[i] } else { f[i] })
    }
    #[inline(always)]
    unsafe fn round(v: Self::V) -> Self::V {
        lanes!(|i| v[i].round_ties_even())
    }
    #[inline(always)]
    unsafe fn ldexp(p: Self::V, n: Self::V) -> Self::V {
        lanes!(|i| p[i] * f32::from_bits((((n[i] as i32) + 127) as u32) << 23))
    }
    #[inline(always)]
    unsafe fn round_bf16(v: Self::V) -> Self::V {
        lanes!(|i| half::bf16::from_f32(v[i]).to_f32())
    }
    #[inline(always)]
    unsafe fn trunc_bf16(v: Self::V) -> Self::V {
        lanes!(|i| f32::from_bits(v[i].to_bits() & 0xffff_0000))
    }
    #[inline(always)]
    unsafe fn store_bf16(p: *mut u16, v: Self::V) {
        for (i, x) in v.iter().enumerate() {
            *p.add(i) = (x.to_bits() >> 16) as u16;
        }
    }
    #[inline(always)]
    unsafe fn bf16_pairs(even: Self::V, odd: Self::V) -> Self::V {
        lanes!(|i| f32::from_bits((even[i].to_bits() >> 16) | (odd[i].to_bits() & 0xffff_0000)))
    }
}

#[cfg(target_arch = "x86_64")]
pub use x86::{Avx2, Avx512};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Simd, W};
    use std::arch::x86_64::*;

    const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

    /// 16 FP8 E5M2 bytes as halves (16-bit lanes): the byte is the half's top byte.
    #[inline(always)]
    unsafe fn e5m2_halves(p: *const u8) -> __m256i {
        _mm256_slli_epi16::<8>(_mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i)))
    }

    /// 16 FP8 E4M3 bytes as the halves of `super::e4m3_half` (16-bit lanes): the byte's
    /// value times 2^-8, NaN (all ones) for 0x7f / 0xff.
    #[inline(always)]
    unsafe fn e4m3_halves(p: *const u8) -> __m256i {
        let w = _mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i));
        let mag = _mm256_and_si256(w, _mm256_set1_epi16(0x7f));
        let sign = _mm256_slli_epi16::<8>(_mm256_and_si256(w, _mm256_set1_epi16(0x80)));
        let nan = _mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x7f));
        _mm256_or_si256(_mm256_or_si256(_mm256_slli_epi16::<7>(mag), sign), nan)
    }

    /// AVX-512F (with F16C conversions through `vcvtph2ps`/`vcvtps2ph` on zmm).
    #[derive(Clone, Copy)]
    pub struct Avx512;

    impl Simd for Avx512 {
        type V = __m512;
        const NAME: &'static str = "avx512";
        const WIDE_BLOCKS: bool = true;
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m512 {
            _mm512_set1_ps(x)
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m512) {
            _mm512_storeu_ps(p, v)
        }
        #[inline(always)]
        unsafe fn load_f16(p: *const u16) -> __m512 {
            _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
        }
        #[inline(always)]
        unsafe fn load_bf16(p: *const u16) -> __m512 {
            let wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(wide))
        }
        #[inline(always)]
        unsafe fn load_e5m2(p: *const u8) -> __m512 {
            _mm512_cvtph_ps(e5m2_halves(p))
        }
        #[inline(always)]
        unsafe fn load_e4m3(p: *const u8) -> __m512 {
            _mm512_mul_ps(_mm512_cvtph_ps(e4m3_halves(p)), _mm512_set1_ps(256.0))
        }
        #[inline(always)]
        unsafe fn load_i8(p: *const u8) -> __m512 {
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i)))
        }
        #[inline(always)]
        unsafe fn round_half(v: __m512) -> __m512 {
            _mm512_cvtph_ps(_mm512_cvtps_ph::<NEAREST>(v))
        }
        #[inline(always)]
        unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
            _mm512_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn add(a: __m512, b: __m512) -> __m512 {
            _mm512_add_ps(a, b)
        }
        #[inline(always)]
        unsafe fn sub(a: __m512, b: __m512) -> __m512 {
            _mm512_sub_ps(a, b)
        }
        #[inline(always)]
        unsafe fn mul(a: __m512, b: __m512) -> __m512 {
            _mm512_mul_ps(a, b)
        }
        #[inline(always)]
        unsafe fn div(a: __m512, b: __m512) -> __m512 {
            _mm512_div_ps(a, b)
        }
        #[inline(always)]
        unsafe fn max(a: __m512, b: __m512) -> __m512 {
            // vmaxps is exactly `a > b ? a : b` (the second operand on NaN or equal zeros).
            _mm512_max_ps(a, b)
        }
        #[inline(always)]
        unsafe fn min(a: __m512, b: __m512) -> __m512 {
            // vminps is exactly `a < b ? a : b`.
            _mm512_min_ps(a, b)
        }
        #[inline(always)]
        unsafe fn select_gt(a: __m512, b: __m512, t: __m512, f: __m512) -> __m512 {
            let m = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(a, b);
            _mm512_mask_blend_ps(m, f, t)
        }
        #[inline(always)]
        unsafe fn any_gt(a: __m512, b: __m512) -> bool {
            _mm512_cmp_ps_mask::<_CMP_GT_OQ>(a, b) != 0
        }
        #[inline(always)]
        unsafe fn round(v: __m512) -> __m512 {
            _mm512_roundscale_ps::<NEAREST>(v)
        }
        #[inline(always)]
        unsafe fn ldexp(p: __m512, n: __m512) -> __m512 {
            _mm512_scalef_ps(p, n)
        }
        #[inline(always)]
        unsafe fn ldexp_unless_below(p: __m512, n: __m512, t: __m512, low: __m512) -> __m512 {
            // Kept where `t < low` is false, unordered included: the default's select.
            let keep = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(t, low);
            _mm512_maskz_scalef_ps(keep, p, n)
        }
        #[inline(always)]
        unsafe fn round_bf16(v: __m512) -> __m512 {
            // Add 0x7fff plus the kept part's lowest bit, then clear the low half: ties go to
            // even and a carry moves into the exponent as it should (to inf past the top).
            let bits = _mm512_castps_si512(v);
            let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
            let up = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
            let r = _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(-65536)));
            // A NaN could carry into the sign bit: keep it as it came.
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
            _mm512_mask_blend_ps(nan, r, v)
        }
        #[inline(always)]
        unsafe fn trunc_bf16(v: __m512) -> __m512 {
            _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(-65536)))
        }
        #[inline(always)]
        unsafe fn store_bf16(p: *mut u16, v: __m512) {
            let top = _mm512_srli_epi32::<16>(_mm512_castps_si512(v));
            _mm256_storeu_si256(p as *mut __m256i, _mm512_cvtepi32_epi16(top));
        }
        #[inline(always)]
        unsafe fn bf16_pairs(even: __m512, odd: __m512) -> __m512 {
            let lo = _mm512_srli_epi32::<16>(_mm512_castps_si512(even));
            // `(odd & 0xffff0000) | lo` in one instruction: bit by bit, the mask's bit picks
            // odd's, else lo's (truth table 0xca of (mask, odd, lo): mask ? odd : lo).
            let top = _mm512_set1_epi32(-65536);
            _mm512_castsi512_ps(_mm512_ternarylogic_epi32::<0xca>(top, _mm512_castps_si512(odd), lo))
        }
        #[inline(always)]
        unsafe fn load_bf16_pairs(even: *const u16, odd: *const u16) -> __m512 {
            let e = _mm512_cvtepu16_epi32(_mm256_loadu_si256(even as *const __m256i));
            let o = _mm512_cvtepu16_epi32(_mm256_loadu_si256(odd as *const __m256i));
            _mm512_castsi512_ps(_mm512_or_si512(e, _mm512_slli_epi32::<16>(o)))
        }
        #[inline(always)]
        unsafe fn prefetch(p: *const u8) {
            _mm_prefetch::<_MM_HINT_T1>(p as *const i8)
        }
        #[inline(always)]
        unsafe fn store_f16_nearest(p: *mut u16, v: __m512) {
            // vcvtps2ph: ties to even, a NaN quieted with its top payload bits, as half's.
            _mm256_storeu_si256(p as *mut __m256i, _mm512_cvtps_ph::<NEAREST>(v))
        }
        #[inline(always)]
        unsafe fn store_bf16_nearest(p: *mut u16, v: __m512) {
            let top = _mm512_srli_epi32::<16>(_mm512_castps_si512(Self::round_bf16(v)));
            // A NaN: its top half with the quiet bit set, as half's conversion gives.
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
            let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(_mm512_castps_si512(v)), _mm512_set1_epi32(0x40));
            let top = _mm512_mask_blend_epi32(nan, top, quiet);
            _mm256_storeu_si256(p as *mut __m256i, _mm512_cvtepi32_epi16(top));
        }
        #[inline(always)]
        unsafe fn transpose16(r: &mut [__m512; W]) {
            // Pairs of rows interleaved by 32 bits, then by 64 bits: t[4g + c] holds, in each
            // 128-bit block q, column c + 4q of rows 4g .. 4g + 4.
            let mut t = [_mm512_setzero_ps(); W];
            for y in (0..W).step_by(2) {
                t[y] = _mm512_unpacklo_ps(r[y], r[y + 1]);
                t[y + 1] = _mm512_unpackhi_ps(r[y], r[y + 1]);
            }
            let mut u = [_mm512_setzero_ps(); W];
            let pd = _mm512_castps_pd;
            for g in (0..W).step_by(4) {
                u[g] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[g]), pd(t[g + 2])));
                u[g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[g]), pd(t[g + 2])));
                u[g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[g + 1]), pd(t[g + 3])));
                u[g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[g + 1]), pd(t[g + 3])));
            }
            // Then the 128-bit blocks: even blocks (0x88) and odd ones (0xdd) of two groups,
            // twice, gather column c's four blocks of rows in order.
            for c in 0..4 {
                let v0 = _mm512_shuffle_f32x4::<0x88>(u[c], u[4 + c]);
                let v1 = _mm512_shuffle_f32x4::<0xdd>(u[c], u[4 + c]);
                let w0 = _mm512_shuffle_f32x4::<0x88>(u[8 + c], u[12 + c]);
                let w1 = _mm512_shuffle_f32x4::<0xdd>(u[8 + c], u[12 + c]);
                r[c] = _mm512_shuffle_f32x4::<0x88>(v0, w0);
                r[c + 8] = _mm512_shuffle_f32x4::<0xdd>(v0, w0);
                r[c + 4] = _mm512_shuffle_f32x4::<0x88>(v1, w1);
                r[c + 12] = _mm512_shuffle_f32x4::<0xdd>(v1, w1);
            }
        }
    }

    /// AVX2 + FMA + F16C, 16 lanes as two ymm registers.
    #[derive(Clone, Copy)]
    pub struct Avx2;

    #[derive(Clone, Copy)]
    pub struct Pair(__m256, __m256);

    macro_rules! both {
        ($f:ident, $a:expr, $b:expr) => {
            Pair($f($a.0, $b.0), $f($a.1, $b.1))
        };
    }

    impl Simd for Avx2 {
        type V = Pair;
        const NAME: &'static str = "avx2+fma+f16c";
        const WIDE_BLOCKS: bool = false;
        #[inline(always)]
        unsafe fn prefetch(p: *const u8) {
            _mm_prefetch::<_MM_HINT_T1>(p as *const i8)
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Pair {
            let v = _mm256_set1_ps(x);
            Pair(v, v)
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Pair {
            Pair(_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(W / 2)))
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: Pair) {
            _mm256_storeu_ps(p, v.0);
            _mm256_storeu_ps(p.add(W / 2), v.1);
        }
        #[inline(always)]
        unsafe fn load_f16(p: *const u16) -> Pair {
            Pair(
                _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
                _mm256_cvtph_ps(_mm_loadu_si128(p.add(W / 2) as *const __m128i)),
            )
        }
        #[inline(always)]
        unsafe fn load_bf16(p: *const u16) -> Pair {
            let widen = |q: *const u16| {
                let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(q as *const __m128i));
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wide))
            };
            Pair(widen(p), widen(p.add(W / 2)))
        }
        #[inline(always)]
        unsafe fn load_e5m2(p: *const u8) -> Pair {
            let h = e5m2_halves(p);
            Pair(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(h)))
        }
        #[inline(always)]
        unsafe fn load_e4m3(p: *const u8) -> Pair {
            let h = e4m3_halves(p);
            let s = _mm256_set1_ps(256.0);
            Pair(
                _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), s),
                _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256::<1>(h)), s),
            )
        }
        #[inline(always)]
        unsafe fn load_i8(p: *const u8) -> Pair {
            let b = _mm_loadu_si128(p as *const __m128i);
            Pair(
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(b))),
            )
        }
        #[inline(always)]
        unsafe fn round_half(v: Pair) -> Pair {
            Pair(
                _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v.0)),
                _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v.1)),
            )
        }
        #[inline(always)]
        unsafe fn fma(a: Pair, b: Pair, c: Pair) -> Pair {
            Pair(_mm256_fmadd_ps(a.0, b.0, c.0), _mm256_fmadd_ps(a.1, b.1, c.1))
        }
        #[inline(always)]
        unsafe fn add(a: Pair, b: Pair) -> Pair {
            both!(_mm256_add_ps, a, b)
        }
        #[inline(always)]
        unsafe fn sub(a: Pair, b: Pair) -> Pair {
            both!(_mm256_sub_ps, a, b)
        }
        #[inline(always)]
        unsafe fn mul(a: Pair, b: Pair) -> Pair {
            both!(_mm256_mul_ps, a, b)
        }
        #[inline(always)]
        unsafe fn div(a: Pair, b: Pair) -> Pair {
            both!(_mm256_div_ps, a, b)
        }
        #[inline(always)]
        unsafe fn max(a: Pair, b: Pair) -> Pair {
            // vmaxps is exactly `a > b ? a : b` (the second operand on NaN or equal zeros).
            both!(_mm256_max_ps, a, b)
        }
        #[inline(always)]
        unsafe fn min(a: Pair, b: Pair) -> Pair {
            both!(_mm256_min_ps, a, b)
        }
        #[inline(always)]
        unsafe fn select_gt(a: Pair, b: Pair, t: Pair, f: Pair) -> Pair {
            let m0 = _mm256_cmp_ps::<_CMP_GT_OQ>(a.0, b.0);
            let m1 = _mm256_cmp_ps::<_CMP_GT_OQ>(a.1, b.1);
            Pair(_mm256_blendv_ps(f.0, t.0, m0), _mm256_blendv_ps(f.1, t.1, m1))
        }
        #[inline(always)]
        unsafe fn round(v: Pair) -> Pair {
            Pair(_mm256_round_ps::<NEAREST>(v.0), _mm256_round_ps::<NEAREST>(v.1))
        }
        #[inline(always)]
        unsafe fn ldexp(p: Pair, n: Pair) -> Pair {
            let bias = _mm256_set1_epi32(127);
            let e0 = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n.0), bias));
            let e1 = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n.1), bias));
            Pair(_mm256_mul_ps(p.0, _mm256_castsi256_ps(e0)), _mm256_mul_ps(p.1, _mm256_castsi256_ps(e1)))
        }
        #[inline(always)]
        unsafe fn round_bf16(v: Pair) -> Pair {
            // As the AVX-512 form: add 0x7fff plus the kept part's lowest bit, clear the low
            // half, keep NaNs as they came.
            let half = |x: __m256| {
                let bits = _mm256_castps_si256(x);
                let odd = _mm256_and_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(1));
                let up = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
                let r = _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(-65536)));
                _mm256_blendv_ps(r, x, _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x))
            };
            Pair(half(v.0), half(v.1))
        }
        #[inline(always)]
        unsafe fn trunc_bf16(v: Pair) -> Pair {
            let top = _mm256_castsi256_ps(_mm256_set1_epi32(-65536));
            Pair(_mm256_and_ps(v.0, top), _mm256_and_ps(v.1, top))
        }
        #[inline(always)]
        unsafe fn store_bf16(p: *mut u16, v: Pair) {
            let a = _mm256_srli_epi32::<16>(_mm256_castps_si256(v.0));
            let b = _mm256_srli_epi32::<16>(_mm256_castps_si256(v.1));
            // packus works within 128-bit lanes: [a0-3 b0-3 | a4-7 b4-7]; put them in order.
            let packed = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(a, b));
            _mm256_storeu_si256(p as *mut __m256i, packed);
        }
        #[inline(always)]
        unsafe fn bf16_pairs(even: Pair, odd: Pair) -> Pair {
            let top = _mm256_set1_epi32(-65536);
            let pair = |e: __m256, o: __m256| {
                let lo = _mm256_srli_epi32::<16>(_mm256_castps_si256(e));
                _mm256_castsi256_ps(_mm256_or_si256(lo, _mm256_and_si256(_mm256_castps_si256(o), top)))
            };
            Pair(pair(even.0, odd.0), pair(even.1, odd.1))
        }
    }
}

/// The AMX kernels: tiles for both products, AVX-512 between them (where `amx::available`).
pub const AMX: &str = "amx";
/// The AMX kernels on the software tile unit (`amx::EmulatedTiles`): runs anywhere, for
/// tests; never detected (so never picked by itself), only forced.
pub const AMX_EMULATED: &str = "amx-emulated";

/// The instruction sets this CPU offers that the kernels can use, best first.
pub fn detected_isas() -> Vec<&'static str> {
    let mut v = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        if super::amx::available() {
            v.push(AMX);
        }
        if has_avx512() {
            v.push(<Avx512 as Simd>::NAME);
        }
        if has_avx2() {
            v.push(<Avx2 as Simd>::NAME);
        }
    }
    v.push(<Portable as Simd>::NAME);
    v
}

#[cfg(target_arch = "x86_64")]
pub fn has_avx512() -> bool {
    std::is_x86_feature_detected!("avx512f")
        && std::is_x86_feature_detected!("avx2")
        && std::is_x86_feature_detected!("fma")
        && std::is_x86_feature_detected!("f16c")
}

#[cfg(target_arch = "x86_64")]
pub fn has_avx2() -> bool {
    std::is_x86_feature_detected!("avx2")
        && std::is_x86_feature_detected!("fma")
        && std::is_x86_feature_detected!("f16c")
}

static FORCED: std::sync::Mutex<Option<&'static str>> = std::sync::Mutex::new(None);

/// What [`force_isa`] takes: the detected instruction sets and the emulated AMX kernels.
pub fn forceable_isas() -> Vec<&'static str> {
    let mut v = detected_isas();
    v.push(AMX_EMULATED);
    v
}

/// The instruction set `name` of [`forceable_isas`], or `None` where this CPU lacks it.
pub fn isa_named(name: &str) -> Option<&'static str> {
    forceable_isas().into_iter().find(|d| *d == name)
}

/// Make the kernels use the instruction set `name` (one of [`forceable_isas`]), or go back
/// to the best one with `None`. For tests and benchmarks that compare the code paths.
pub fn force_isa(name: Option<&str>) -> crate::error::Result<()> {
    let pick = match name {
        None | Some("") | Some("auto") => None,
        Some(n) => Some(isa_named(n).ok_or_else(|| {
            crate::error::MlxError::InvalidArgument(format!(
                "instruction set {n:?} is not available here (available: {})",
                forceable_isas().join(", ")
            ))
        })?),
    };
    *FORCED.lock().unwrap_or_else(|e| e.into_inner()) = pick;
    Ok(())
}

/// The implementation the kernels use: the one forced by [`force_isa`], else the one named
/// by `MLX_NATIVE_CPU_ISA` if this CPU has it, else the best detected.
pub fn selected_isa() -> &'static str {
    if let Some(n) = *FORCED.lock().unwrap_or_else(|e| e.into_inner()) {
        return n;
    }
    default_isa()
}

/// The instruction set without [`force_isa`]: `MLX_NATIVE_CPU_ISA`'s (read once, by
/// `settings`) if this CPU has it, else the best detected. A name this CPU lacks is
/// ignored with a complaint that names it and the ones it has.
pub fn default_isa() -> &'static str {
    static DEFAULT: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();
    DEFAULT.get_or_init(|| {
        let detected = detected_isas();
        let Some(want) = crate::settings::get().cpu_isa.as_deref() else { return detected[0] };
        if want == "auto" {
            return detected[0];
        }
        detected.iter().find(|n| **n == want).copied().unwrap_or_else(|| {
            crate::settings::complain(format!(
                "{}={want:?} is not an instruction set of this CPU (it has: {}): ignored, {} is used",
                crate::settings::CPU_ISA,
                detected.join(", "),
                detected[0]
            ));
            detected[0]
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The instruction sets listed (and offered to `force_isa`) are this CPU's, best
    /// first, the portable one always last; a name not listed is refused.
    #[test]
    fn the_listed_instruction_sets_are_this_cpus() {
        let v = detected_isas();
        assert_eq!(v.last(), Some(&"portable"), "{v:?}");
        #[cfg(target_arch = "x86_64")]
        {
            let f = |s: &str| match s {
                "avx512f" => std::is_x86_feature_detected!("avx512f"),
                "avx2" => std::is_x86_feature_detected!("avx2"),
                "fma" => std::is_x86_feature_detected!("fma"),
                _ => std::is_x86_feature_detected!("f16c"),
            };
            let avx2 = f("avx2") && f("fma") && f("f16c");
            let mut want = Vec::new();
            if super::super::amx::available() {
                want.push("amx");
            }
            if avx2 && f("avx512f") {
                want.push("avx512");
            }
            if avx2 {
                want.push("avx2+fma+f16c");
            }
            want.push("portable");
            assert_eq!(v, want);
        }
        assert!(force_isa(Some("xyzzy")).is_err()); // refused before the setting changes
        assert!(!v.contains(&AMX_EMULATED), "the emulated tiles are never detected");
        assert_eq!(forceable_isas().last(), Some(&AMX_EMULATED), "but can be forced");
    }

    fn check_exp<S: Simd>() {
        unsafe {
            for &x in &[-100.0f32, -87.0, -20.0, -1.5, -0.3, 0.0, 0.25, 1.0, 3.0, 8.0, 30.0] {
                let got = {
                    let mut out = [0f32; W];
                    S::store(out.as_mut_ptr(), S::exp(S::splat(x)));
                    out[3]
                };
                let want = (x as f64).exp();
                if x < -87.33 {
                    assert_eq!(got, 0.0);
                } else {
                    let rel = ((got as f64 - want) / want).abs();
                    assert!(rel < 3e-7, "{} exp({x}) = {got}, want {want}", S::NAME);
                }
            }
            let mut out = [0f32; W];
            S::store(out.as_mut_ptr(), S::exp(S::splat(f32::NEG_INFINITY)));
            assert_eq!(out[0], 0.0);
            S::store(out.as_mut_ptr(), S::exp(S::splat(f32::NAN)));
            assert!(out[0].is_nan(), "{}: NaN must survive exp", S::NAME);
        }
    }

    fn check_tanh<S: Simd>() {
        let xs: Vec<f32> =
            (-400..=400).map(|i| i as f32 * 0.0271).chain([1e-6, -3e-5, 0.3124, 0.3126, 20.0, -90.0]).collect();
        unsafe {
            for chunk in xs.chunks(W) {
                let mut v = [0f32; W];
                v[..chunk.len()].copy_from_slice(chunk);
                let mut out = [0f32; W];
                S::store(out.as_mut_ptr(), S::tanh(S::load(v.as_ptr())));
                for (i, &x) in chunk.iter().enumerate() {
                    let want = (x as f64).tanh();
                    let err = (out[i] as f64 - want).abs();
                    assert!(err <= 3e-7 * want.abs().max(1e-30), "{} tanh({x}) = {}, want {want}", S::NAME, out[i]);
                }
            }
            let mut out = [0f32; W];
            S::store(out.as_mut_ptr(), S::tanh(S::splat(f32::NAN)));
            assert!(out[0].is_nan(), "{}: NaN must survive tanh", S::NAME);
            S::store(out.as_mut_ptr(), S::tanh(S::splat(f32::NEG_INFINITY)));
            assert_eq!(out[0], -1.0);
        }
    }

    fn check_round_half<S: Simd>() {
        let vals: Vec<f32> = (0..W)
            .map(|i| {
                [1.0009766f32, 0.33333, -7.12345, 65519.0, 65520.0, 1e-6, -3e-8, 2.5e-5][i % 8]
                    * (1.0 + i as f32 * 1e-4)
            })
            .collect();
        unsafe {
            let mut out = [0f32; W];
            S::store(out.as_mut_ptr(), S::round_half(S::load(vals.as_ptr())));
            for i in 0..W {
                assert_eq!(out[i].to_bits(), half::f16::from_f32(vals[i]).to_f32().to_bits(), "{} lane {i}", S::NAME);
            }
        }
    }

    fn check_bf16<S: Simd>() {
        // One, minus one, +-inf, a quiet NaN, the smallest subnormal, -0, pi, and others.
        let vals: [u16; W] = [
            0x3f80, 0xbf80, 0x7f80, 0xff80, 0x7fc1, 0x0001, 0x8000, 0x4049, 0xc2f7, 0x0080, 0x7f7f, 0xff7f, 0x3c23,
            0xbe00, 0x4780, 0x0000,
        ];
        unsafe {
            let mut out = [0f32; W];
            S::store(out.as_mut_ptr(), S::load_bf16(vals.as_ptr()));
            for i in 0..W {
                assert_eq!(out[i].to_bits(), half::bf16::from_bits(vals[i]).to_f32().to_bits(), "{} lane {i}", S::NAME);
            }
        }
    }

    fn check_max_min<S: Simd>() {
        let pairs = [
            (1.0f32, 2.0f32),
            (2.0, 1.0),
            (0.0, -0.0),
            (-0.0, 0.0),
            (f32::NAN, 1.0),
            (1.0, f32::NAN),
            (f32::NEG_INFINITY, -3.0),
            (5.0, 5.0),
        ];
        let a: Vec<f32> = (0..W).map(|i| pairs[i % 8].0).collect();
        let b: Vec<f32> = (0..W).map(|i| pairs[i % 8].1).collect();
        unsafe {
            let (mut mx, mut mn) = ([0f32; W], [0f32; W]);
            S::store(mx.as_mut_ptr(), S::max(S::load(a.as_ptr()), S::load(b.as_ptr())));
            S::store(mn.as_mut_ptr(), S::min(S::load(a.as_ptr()), S::load(b.as_ptr())));
            for i in 0..W {
                let want_max = if a[i] > b[i] { a[i] } else { b[i] };
                let want_min = if a[i] < b[i] { a[i] } else { b[i] };
                assert_eq!(mx[i].to_bits(), want_max.to_bits(), "{} max lane {i}", S::NAME);
                assert_eq!(mn[i].to_bits(), want_min.to_bits(), "{} min lane {i}", S::NAME);
            }
        }
    }

    /// bfloat16 rounding is `half::bf16`'s (nearest, ties to even; NaN kept, carries into
    /// the exponent and to inf), and the stores keep each lane's top 16 bits, the pairs
    /// interleaved even/odd.
    fn check_bf16_rounding_and_stores<S: Simd>() {
        let vals: [f32; W] = [
            1.0,
            1.0 + 1.0 / 256.0, // a tie: to even (1.0)
            1.0 + 3.0 / 256.0, // a tie: to even (1 + 4/256)
            -3.140_625_5,
            f32::from_bits(0x3f80_8001), // just above a tie: up
            f32::from_bits(0x7f7f_ffff), // the largest f32: rounds to inf
            f32::NAN,
            f32::from_bits(0x7fff_ffff), // a NaN whose rounding would carry into the sign
            f32::NEG_INFINITY,
            -0.0,
            1e-40, // subnormal
            65504.0,
            2.5e-5,
            -7.123_45,
            0.333_333_34,
            1e30,
        ];
        unsafe {
            let mut out = [0f32; W];
            S::store(out.as_mut_ptr(), S::round_bf16(S::load(vals.as_ptr())));
            for i in 0..W {
                let want = half::bf16::from_f32(vals[i]).to_f32();
                if want.is_nan() {
                    assert!(out[i].is_nan(), "{} lane {i}: NaN lost", S::NAME);
                } else {
                    assert_eq!(out[i].to_bits(), want.to_bits(), "{} lane {i} ({})", S::NAME, vals[i]);
                }
            }
            let even: [f32; W] = std::array::from_fn(|i| f32::from_bits(0x3f80_0000 + ((i as u32) << 16)));
            let odd: [f32; W] = std::array::from_fn(|i| f32::from_bits(0xc100_0000 + ((i as u32) << 16) + 0x1234));
            let mut cut = [0f32; W];
            S::store(cut.as_mut_ptr(), S::trunc_bf16(S::load(vals.as_ptr())));
            for i in 0..W {
                assert_eq!(cut[i].to_bits(), vals[i].to_bits() & 0xffff_0000, "{} trunc lane {i}", S::NAME);
            }
            let mut one = [0u16; W];
            S::store_bf16(one.as_mut_ptr(), S::load(even.as_ptr()));
            let mut pairs = [0u16; 2 * W];
            S::store_bf16_pairs(pairs.as_mut_ptr(), S::load(even.as_ptr()), S::load(odd.as_ptr()));
            for i in 0..W {
                assert_eq!(one[i], (even[i].to_bits() >> 16) as u16, "{} store_bf16 lane {i}", S::NAME);
                assert_eq!(pairs[2 * i], (even[i].to_bits() >> 16) as u16, "{} pair {i} even", S::NAME);
                assert_eq!(pairs[2 * i + 1], (odd[i].to_bits() >> 16) as u16, "{} pair {i} odd", S::NAME);
            }
        }
    }

    /// The transpose moves lane x of vector y to lane y of vector x, bits as they were (NaN
    /// patterns included: the lanes are data, not numbers).
    fn check_transpose<S: Simd>() {
        let bits = |y: usize, x: usize| 0x7f80_0001u32 + (y * 16 + x) as u32 * 0x0101;
        unsafe {
            let mut v: [S::V; W] = std::array::from_fn(|y| {
                let row: [u32; W] = std::array::from_fn(|x| bits(y, x));
                S::load(row.as_ptr() as *const f32)
            });
            S::transpose16(&mut v);
            for (x, vec) in v.iter().enumerate() {
                let mut out = [0u32; W];
                S::store(out.as_mut_ptr() as *mut f32, *vec);
                for (y, &b) in out.iter().enumerate() {
                    assert_eq!(b, bits(y, x), "{} transpose: vector {x} lane {y}", S::NAME);
                }
            }
        }
    }

    /// The stores to half and bfloat16 against the `half` crate's conversions on f32 bit
    /// patterns of every kind (every top half with low halves at, around and past the tie;
    /// NaNs with payloads only in the low half, infinities, subnormals), and the bfloat16
    /// pairs from memory against those made from widened values.
    fn check_nearest_stores_and_pairs<S: Simd>() {
        let lows = [0u32, 1, 0x7fff, 0x8000, 0x8001, 0xffff, 0x1000, 0x2000, 0x1fff, 0xe000];
        let mut all: Vec<u32> = Vec::new();
        for top in 0..=0xffffu32 {
            for &low in &lows {
                all.push(top << 16 | low);
            }
        }
        for chunk in all.chunks(W) {
            let mut x = [0f32; W];
            for (e, &b) in chunk.iter().enumerate() {
                x[e] = f32::from_bits(b);
            }
            let (mut f, mut b) = ([0u16; W], [0u16; W]);
            unsafe {
                let v = S::load(x.as_ptr());
                S::store_f16_nearest(f.as_mut_ptr(), v);
                S::store_bf16_nearest(b.as_mut_ptr(), v);
            }
            for e in 0..chunk.len() {
                let want_f = half::f16::from_f32(x[e]).to_bits();
                let want_b = half::bf16::from_f32(x[e]).to_bits();
                assert_eq!(f[e], want_f, "{} f16 of {:#x}", S::NAME, x[e].to_bits());
                assert_eq!(b[e], want_b, "{} bf16 of {:#x}", S::NAME, x[e].to_bits());
            }
        }
        let even: Vec<u16> = (0..W as u16).map(|i| i.wrapping_mul(40503) ^ 0x7fc1).collect();
        let odd: Vec<u16> = (0..W as u16).map(|i| i.wrapping_mul(2654) ^ 0x8001).collect();
        let (mut got, mut want) = ([0f32; W], [0f32; W]);
        unsafe {
            S::store(got.as_mut_ptr(), S::load_bf16_pairs(even.as_ptr(), odd.as_ptr()));
            S::store(want.as_mut_ptr(), S::bf16_pairs(S::load_bf16(even.as_ptr()), S::load_bf16(odd.as_ptr())));
        }
        for e in 0..W {
            assert_eq!(got[e].to_bits(), (odd[e] as u32) << 16 | even[e] as u32, "{} pair {e}", S::NAME);
            assert_eq!(got[e].to_bits(), want[e].to_bits(), "{} pair {e}", S::NAME);
        }
        // Pairs of values with low halves of their own (the parts of a split): each lane's top
        // halves, whatever the low ones hold.
        let e32: Vec<u32> = (0..W as u32).map(|i| i.wrapping_mul(2654435761) ^ 0x3f80_1234).collect();
        let o32: Vec<u32> = (0..W as u32).map(|i| i.wrapping_mul(40503) ^ 0xbf7f_ffff).collect();
        unsafe {
            let (ev, ov) = (S::load(e32.as_ptr() as *const f32), S::load(o32.as_ptr() as *const f32));
            S::store(got.as_mut_ptr(), S::bf16_pairs(ev, ov));
        }
        for e in 0..W {
            assert_eq!(got[e].to_bits(), (o32[e] & 0xffff_0000) | e32[e] >> 16, "{} split pair {e}", S::NAME);
        }
        // `ldexp_unless_below`: 0 below the bound, ldexp at and above it and for NaN.
        let t = [
            f32::NEG_INFINITY,
            -1e30,
            -127.0,
            -126.5,
            -126.0,
            -125.5,
            -3.0,
            0.0,
            2.0,
            f32::NAN,
            11.5,
            -126.0001,
            1.0,
            0.5,
            -0.5,
            3.0,
        ];
        let n: [f32; W] = std::array::from_fn(|i| if t[i] >= -126.0 { t[i].round() } else { -126.0 });
        let p: [f32; W] = std::array::from_fn(|i| if t[i].is_nan() { f32::NAN } else { 1.0 + i as f32 / 32.0 });
        unsafe {
            let v =
                S::ldexp_unless_below(S::load(p.as_ptr()), S::load(n.as_ptr()), S::load(t.as_ptr()), S::splat(-126.0));
            S::store(got.as_mut_ptr(), v);
        }
        for e in 0..W {
            let want = if t[e] < -126.0 { 0.0 } else { p[e] * 2f32.powi(n[e] as i32) };
            assert!(
                got[e].to_bits() == want.to_bits() || (got[e].is_nan() && want.is_nan()),
                "{} ldexp_unless_below lane {e}: {} against {want}",
                S::NAME,
                got[e]
            );
        }
    }

    /// The FP8 and int8 loaders against each byte's value (E4M3 from its fields; E5M2 the
    /// half whose top byte it is), every byte in every lane, bit for bit (NaN as NaN).
    fn check_quant_loads<S: Simd>() {
        let e4m3 = |b: u8| {
            let (e, m) = ((b >> 3) & 0xf, b & 7);
            let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
            if e == 15 && m == 7 {
                f32::NAN
            } else if e == 0 {
                sign * m as f32 * 2f32.powi(-9)
            } else {
                sign * (1.0 + m as f32 / 8.0) * 2f32.powi(e as i32 - 7)
            }
        };
        let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
        for shift in 0..W {
            let bytes: Vec<u8> = (0..256 + W).map(|i| (i + shift) as u8).collect();
            for chunk in bytes.chunks_exact(W) {
                let (mut a, mut b, mut c) = ([0f32; W], [0f32; W], [0f32; W]);
                unsafe {
                    S::store(a.as_mut_ptr(), S::load_e4m3(chunk.as_ptr()));
                    S::store(b.as_mut_ptr(), S::load_e5m2(chunk.as_ptr()));
                    S::store(c.as_mut_ptr(), S::load_i8(chunk.as_ptr()));
                }
                for (e, &x) in chunk.iter().enumerate() {
                    assert!(same(a[e], e4m3(x)), "{} e4m3 {x:#x}: {}", S::NAME, a[e]);
                    let h = half::f16::from_bits((x as u16) << 8).to_f32();
                    assert!(same(b[e], h), "{} e5m2 {x:#x}: {}", S::NAME, b[e]);
                    assert_eq!(c[e], x as i8 as f32, "{} i8 {x:#x}", S::NAME);
                }
            }
        }
    }

    #[test]
    fn every_detected_isa_matches_the_reference_math() {
        check_nearest_stores_and_pairs::<Portable>();
        check_exp::<Portable>();
        check_tanh::<Portable>();
        check_round_half::<Portable>();
        check_max_min::<Portable>();
        check_bf16::<Portable>();
        check_bf16_rounding_and_stores::<Portable>();
        check_transpose::<Portable>();
        check_quant_loads::<Portable>();
        #[cfg(target_arch = "x86_64")]
        {
            if has_avx2() {
                check_exp::<Avx2>();
                check_tanh::<Avx2>();
                check_round_half::<Avx2>();
                check_max_min::<Avx2>();
                check_bf16::<Avx2>();
                check_bf16_rounding_and_stores::<Avx2>();
                check_transpose::<Avx2>();
                check_nearest_stores_and_pairs::<Avx2>();
                check_quant_loads::<Avx2>();
            }
            if has_avx512() {
                check_exp::<Avx512>();
                check_tanh::<Avx512>();
                check_round_half::<Avx512>();
                check_max_min::<Avx512>();
                check_bf16::<Avx512>();
                check_bf16_rounding_and_stores::<Avx512>();
                check_transpose::<Avx512>();
                check_nearest_stores_and_pairs::<Avx512>();
                check_quant_loads::<Avx512>();
            }
        }
    }
}
