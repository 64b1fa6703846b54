// Part of shaders/flash_attn_prefill_tensor.cu: the integer types, the CTA's shape, and the
// PTX wrappers every form uses (ldmatrix, mma.sync, cp.async, shared-memory access, half
// conversions, the swizzle). No CUDA header is included: everything is inline PTX.
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;
typedef unsigned long long u64;

#define NWARPS 8
#define NTHREADS 256
#define STEP 64

#define LOG2E 1.4426950408889634f
#define NEG_FLT_MAX_HALF (-1.7014117e38f)  // -FLT_MAX / 2

// ------------------------------------------------------------------ PTX helpers

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// D = A * B + D, m16n8k16, f16 inputs, f32 accumulators.
__device__ __forceinline__ void mma16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16 bytes global -> shared, asynchronously; src_bytes 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, u32 src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_group1() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }

__device__ __forceinline__ void st_shared_v4(u32 addr, u32 a, u32 b, u32 c, u32 d) {
    asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d)
                 : "memory");
}
__device__ __forceinline__ void ld_shared_v4(u32 addr, u32 (&r)[4]) {
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ u32 ld_shared_u32(u32 addr) {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ void st_shared_u32(u32 addr, u32 v) {
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_shared_i64(u32 addr, long long v) {
    asm volatile("st.shared.s64 [%0], %1;\n" ::"r"(addr), "l"(v) : "memory");
}
__device__ __forceinline__ long long ld_shared_i64(u32 addr) {
    long long v;
    asm volatile("ld.shared.s64 %0, [%1];\n" : "=l"(v) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ void st_shared_f32(u32 addr, float v) {
    asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(addr), "f"(v) : "memory");
}
__device__ __forceinline__ float ld_shared_f32(u32 addr) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
    return v;
}

// Two floats rounded to half (round to nearest even), lo in bits 0..15.
__device__ __forceinline__ u32 pack_half2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ void unpack_half2(u32 v, float& lo, float& hi) {
    asm("{ .reg .f16 a, b; mov.b32 {a, b}, %2; cvt.f32.f16 %0, a; cvt.f32.f16 %1, b; }\n"
        : "=f"(lo), "=f"(hi)
        : "r"(v));
}
// Two floats rounded to bfloat16 (round to nearest even), lo in bits 0..15, and back.
__device__ __forceinline__ u32 pack_bf162(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ void unpack_bf162(u32 v, float& lo, float& hi) {
    lo = __uint_as_float(v << 16);
    hi = __uint_as_float(v & 0xffff0000u);
}

// D = A * B + D, m16n8k16, bf16 inputs, f32 accumulators.
__device__ __forceinline__ void mma16816_bf16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The element type of both products, chosen by K/V's dtype (SPEC 9). With F16 K/V, Q and P
// are half (SPEC 2). With BF16 K/V the tensor cores take no half x bfloat16 product, so Q
// and P are rounded to bfloat16 as well (FlashAttention's bf16 path): the products stay
// exact in F32 and the rounding of Q and P is 8 bits instead of 11 (docs/spec.md, 10).
struct ElemF16 {
    static constexpr bool BF16 = false;
    static __device__ __forceinline__ u32 pack2(float lo, float hi) { return pack_half2(lo, hi); }
    static __device__ __forceinline__ void unpack2(u32 v, float& lo, float& hi) { unpack_half2(v, lo, hi); }
    static __device__ __forceinline__ void mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
        mma16816(d, a, b0, b1);
    }
};
struct ElemBF16 {
    static constexpr bool BF16 = true;
    static __device__ __forceinline__ u32 pack2(float lo, float hi) { return pack_bf162(lo, hi); }
    static __device__ __forceinline__ void unpack2(u32 v, float& lo, float& hi) { unpack_bf162(v, lo, hi); }
    static __device__ __forceinline__ void mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
        mma16816_bf16(d, a, b0, b1);
    }
};

__device__ __forceinline__ float half_bits_to_float(u16 h) {
    float f;
    asm("{ .reg .f16 a; mov.b16 a, %1; cvt.f32.f16 %0, a; }\n" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
// 2^x on the FMA pipe, for a share of the softmax's exponentials (tile_softmax.cuh,
// MLXN_EXP2_POLY_EVERY), so that they do not all queue at the SFU (16 results a cycle an SM,
// where the FMA pipe gives 128): x = j + f with j the nearest integer (the 1.5 * 2^23 trick:
// the sum is j + magic exactly) and f in [-0.5, 0.5]; 2^f by a degree-5 polynomial (fitted
// to the relative error: 2.2e-7 at most in f32 arithmetic; the SFU's ex2.approx is 2^-22);
// 2^j as a float made from t's bits (t's bits times 2^23 is j's exponent field: the magic's
// own bits shift out) and multiplied in. x is clamped at -125 first by max.NaN, which
// turns -inf into 2^-125 (0 once rounded to half) and keeps a NaN a NaN (it reaches f, so p).
__device__ __forceinline__ float exp2_poly(float x) {
    asm("max.NaN.f32 %0, %0, 0fC2FA0000;\n" : "+f"(x));  // -125
    const float t = x + 12582912.f;
    const float f = x - (t - 12582912.f);
    float p = 1.32764154e-3f;
    p = fmaf(p, f, 9.67552885e-3f);
    p = fmaf(p, f, 5.55071346e-2f);
    p = fmaf(p, f, 2.40221202e-1f);
    p = fmaf(p, f, 6.93146944e-1f);
    p = fmaf(p, f, 1.00000012f);
    return p * __int_as_float(__float_as_int(t) * (1 << 23) + 0x3f800000);
}
__device__ __forceinline__ void named_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Byte offset of 16-byte chunk `c` of a row whose index has low bits `r7`: the chunk's
// low three bits are XORed with the row's, so the 8 rows of an ldmatrix hit 8 different
// bank groups.
__device__ __forceinline__ u32 swz(int c, int r7) { return (u32)((c ^ r7) << 4); }

// The same for chunk `2 * kc + hi` (kc a compile-time index, hi 0 or 1): only the low
// three bits interact with the row, so the four values of `base` (kc % 4) and an
// immediate (kc / 4 * 128) cover every kc. Keeps the unrolled loops from holding one
// address register per kc.
// `c0` (a first chunk, any value) shifts every chunk: adding 8 m to a chunk leaves its low
// three bits, so at(kc) stays one of four bases plus an immediate.
struct Swz4 {
    u32 base[4];
    __device__ __forceinline__ Swz4(int hi, int r7, int c0 = 0) {
#pragma unroll
        for (int i = 0; i < 4; ++i) base[i] = (u32)(((c0 + 2 * i + hi) ^ r7) << 4);
    }
    __device__ __forceinline__ u32 at(int kc) const { return base[kc & 3] + (u32)((kc >> 2) << 7); }
};
