// Part of shaders/flash_attn_prefill_tensor.cu: tiles from global into shared memory (Q in any
// dtype as half, K and V rows zero-filled past the cache, the explicit mask's tile).
#pragma once

#include "flash_attn_prefill/block_range.cuh"

// ------------------------------------------------------------------ tile loads

// 16 bytes (8 halves) from `src` into shared memory at `dst`: asynchronous when `src` is
// 16-byte aligned, else read as halves and stored in one go; zeros (nothing read) when
// `in` is false.
__device__ __forceinline__ void copy8_f16(u32 dst, const u16* __restrict__ src, bool aligned, bool in = true) {
    if (aligned) {
        cp_async16(dst, src, in ? 16u : 0u);  // src-size 0: nothing is read
    } else {
        u32 w[4] = {0u, 0u, 0u, 0u};
        if (in) {
#pragma unroll
            for (int e = 0; e < 4; ++e) w[e] = (u32)src[2 * e] | ((u32)src[2 * e + 1] << 16);
        }
        st_shared_v4(dst, w[0], w[1], w[2], w[3]);
    }
}

__device__ __forceinline__ float bf16_bits_to_float(u32 h) { return __uint_as_float(h << 16); }

// The bits of 8 elements of Q at `src` (dtype `dt`): 32 bytes of F32 in r[0..7], or 16 of
// F16 / BF16 in r[0..3]. Loaded only, never used here, so a caller can have several chunks'
// loads in flight before it converts any (q_from_raw). `aligned`: 16-byte loads.
__device__ __forceinline__ void load_q_raw(u32 (&r)[8], const void* __restrict__ src, int dt, bool aligned) {
    const u32* q = reinterpret_cast<const u32*>(src);
    if (dt == DT_F32) {
        if (aligned) {
            const uint4 a = *reinterpret_cast<const uint4*>(q);
            const uint4 b = *reinterpret_cast<const uint4*>(q + 4);
            r[0] = a.x; r[1] = a.y; r[2] = a.z; r[3] = a.w;
            r[4] = b.x; r[5] = b.y; r[6] = b.z; r[7] = b.w;
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) r[e] = q[e];
        }
    } else {
        const u16* h = reinterpret_cast<const u16*>(src);
        if (aligned) {
            const uint4 a = *reinterpret_cast<const uint4*>(h);
            r[0] = a.x; r[1] = a.y; r[2] = a.z; r[3] = a.w;
        } else {
#pragma unroll
            for (int e = 0; e < 4; ++e) r[e] = (u32)h[2 * e] | ((u32)h[2 * e + 1] << 16);
        }
    }
}

// The chunk of load_q_raw's bits as the products' type T: qh = T(scale * q), as 4 pairs.
template <class T>
__device__ __forceinline__ void q_from_raw(u32 (&w)[4], const u32 (&r)[8], int dt, float scale) {
    float f[8];
    if (dt == DT_F32) {
#pragma unroll
        for (int e = 0; e < 8; ++e) f[e] = __uint_as_float(r[e]);
    } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            if (dt == DT_F16) {
                unpack_half2(r[e], f[2 * e], f[2 * e + 1]);
            } else {
                f[2 * e] = bf16_bits_to_float(r[e] & 0xffffu);
                f[2 * e + 1] = bf16_bits_to_float(r[e] >> 16);
            }
        }
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) w[e] = T::pack2(scale * f[2 * e], scale * f[2 * e + 1]);
}

// The bits of Q row `qr` of sequence `sq` (rows past lq zero), head h, chunk c (8 elements).
__device__ __forceinline__ void load_q_chunk_raw(u32 (&r)[8], const Params& p, const Launch& L, const Seq& sq,
                                                 const unsigned char* __restrict__ q, int qr, int h, int c) {
#pragma unroll
    for (int e = 0; e < 8; ++e) r[e] = 0u;
    if (qr < sq.lq) {
        const int esz = p.q_dtype == DT_F32 ? 4 : 2;
        const i64 e = sq.q + (i64)qr * p.q_row_stride + (i64)h * p.q_head_stride + c * 8;
        load_q_raw(r, q + e * esz, p.q_dtype, (L.flags & FLAG_Q_ALIGNED) != 0);
    }
}

// Q row `qr` of sequence `sq` (rows past lq zero), head h, chunk c (8 elements), as T.
template <class T>
__device__ __forceinline__ void load_q_chunk(u32 (&w)[4], const Params& p, const Launch& L, const Seq& sq,
                                             const unsigned char* __restrict__ q, int qr, int h, int c) {
    u32 r[8];
    load_q_chunk_raw(r, p, L, sq, q, qr, h, c);
    q_from_raw<T>(w, r, p.q_dtype, p.scale);
}

// `STEP` rows of `D` 16-bit elements at `src + row * row_stride` into shared memory rows of
// `W` elements (W a multiple of 64, at least D: the swizzle works in groups of 8 chunks; the
// chunks past D are left as they are and never read), swizzled; rows at or past `nvalid`
// are zeros and are not read. Asynchronous when the rows are 16-byte aligned, else
// synchronous.
template <int D, int W = D>
__device__ __forceinline__ void load_rows_f16(u32 dst, const u16* __restrict__ src, i64 row_stride, int nvalid,
                                              bool aligned) {
    static_assert(W % 64 == 0 && W >= D && D % 8 == 0, "shared rows: whole swizzle groups");
    constexpr int CH = D / 8;
    constexpr int total = STEP * CH;
    for (int i = threadIdx.x; i < total; i += NTHREADS) {
        const int r = i / CH, c = i % CH;
        const u16* s = src + (i64)r * row_stride + c * 8;
        copy8_f16(dst + (u32)(r * W * 2) + swz(c, r & 7), s, aligned, r < nvalid);
    }
}

#if MLXN_PAGED_ENTRIES
// Paged K/V (SPEC 11): load_rows_f16 of the STEP cache rows from row `j0` of this CTA's
// sequence, each found through the block table (kv_row_paged) from `src`, the head's column
// 0 in block 0; rows at or past `nvalid` are zeros and are not read (nor is their table
// entry). The same shared layout as load_rows_f16.
template <int D, int W = D>
__device__ __forceinline__ void load_rows_f16_paged(u32 dst, const u16* __restrict__ src, const Launch& L,
                                                    i64 block_stride, i64 row_stride, int j0, int nvalid,
                                                    bool aligned) {
    static_assert(W % 64 == 0 && W >= D && D % 8 == 0, "shared rows: whole swizzle groups");
    constexpr int CH = D / 8;
    constexpr int total = STEP * CH;
    for (int i = threadIdx.x; i < total; i += NTHREADS) {
        const int r = i / CH, c = i % CH;
        const bool in = r < nvalid;
        const u16* s = src + c * 8;
        if (in) s += kv_row_paged(L, j0 + r, block_stride, row_stride);
        copy8_f16(dst + (u32)(r * W * 2) + swz(c, r & 7), s, aligned, in);
    }
}
#endif

#if MLXN_QUANT_ENTRIES
// ------------------------------------------------------------------ quantised K/V (SPEC 11)
//
// The quant module's K/V loaders read the bytes into registers, widen them to F16 and store
// the halves in the layout the 16-bit loaders give (the products read F16 there). Every FP8
// value is a half exactly (E5M2 is a half's top byte; E4M3's range and precision lie inside
// F16's), so an FP8 tile in shared memory is the F16 tile of the same values, bit for bit;
// the descale factors are folded in by the mainloops (K's into the scores, V's into O).
// Q8_0's value float(d) * q is exact in F32 and rounded once to F16 here (to nearest even;
// above 65504 it is inf): the one rounding the format adds on CUDA (docs/spec.md 11b).

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}
__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
    u32 r;
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

// The 4 FP8 values of `x` (byte i: element i) of dtype `dt` (DT_F8E4M3, DT_F8E5M2) as two
// half2 words, elements 0 and 1 in `lo` (element 0 in bits 0..15), 2 and 3 in `hi`. On
// sm_89 and later the hardware's conversion (cvt.rn.f16x2.e4m3x2 / e5m2x2: exact); before,
// or with MLXN_FP8_CVT_INT (a test of this path on a newer GPU), integer operations: E5M2 is
// a half's top byte; E4M3's bits less the sign, shifted to a half's exponent and mantissa,
// are its value times 2^-8 (subnormals included), times 256 in F16 (exact), the sign put
// back, and 0x7f / 0xff (E4M3's NaN, which would be 480 times 256: inf) made NaN.
#ifndef MLXN_FP8_CVT_INT
#define MLXN_FP8_CVT_INT 0
#endif
__device__ __forceinline__ void fp8x4_to_f16(u32 x, int dt, u32& lo, u32& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !MLXN_FP8_CVT_INT
    if (dt == DT_F8E4M3) {
        asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.rn.f16x2.e4m3x2 %0, l; cvt.rn.f16x2.e4m3x2 %1, h; }\n"
            : "=r"(lo), "=r"(hi)
            : "r"(x));
    } else {
        asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.rn.f16x2.e5m2x2 %0, l; cvt.rn.f16x2.e5m2x2 %1, h; }\n"
            : "=r"(lo), "=r"(hi)
            : "r"(x));
    }
#else
    const u32 a = prmt(x, 0u, 0x1404u), b = prmt(x, 0u, 0x3424u);  // each byte the top of a half
    if (dt == DT_F8E4M3) {
        u32 w[2] = {a, b};
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const u32 sign = w[e] & 0x80008000u;
            const u32 mag = (w[e] >> 1) & 0x3f803f80u;  // (byte & 0x7f) << 7 in each half
            u32 h = hmul2(mag, 0x5c005c00u) | sign;     // times 256
            if ((mag & 0xffffu) == 0x3f80u) h |= 0x7fffu;
            if ((mag >> 16) == 0x3f80u) h |= 0x7fff0000u;
            w[e] = h;
        }
        lo = w[0];
        hi = w[1];
    } else {
        lo = a;
        hi = b;
    }
#endif
}

// The 16 K/V values `16 * c2 ..` of the row at `row` (bytes; dtype `dt`) as 8 half2 words:
// w[0..3] the first 8 (a 16-byte chunk of shared memory), w[4..7] the next 8. FP8: 16 bytes,
// one 16-byte load where `aligned` (the row and its place 16-byte aligned), else bytes.
// Q8_0: half of block c2 / 2 (its F16 scale, then 16 of its 32 int8), 2-byte loads where
// `aligned` (the row's address even), else bytes.
__device__ __forceinline__ void quant16_to_f16(u32 (&w)[8], const u8* __restrict__ row, int c2, int dt, bool aligned) {
    u32 r[4];
    if (dt == DT_Q8_0) {
        const u8* blk = row + (c2 >> 1) * 34;
        const u8* qs = blk + 2 + (c2 & 1) * 16;
        u32 sb;
        if (aligned) {
            sb = *reinterpret_cast<const u16*>(blk);
            const u16* q16 = reinterpret_cast<const u16*>(qs);
#pragma unroll
            for (int e = 0; e < 4; ++e) r[e] = (u32)q16[2 * e] | ((u32)q16[2 * e + 1] << 16);
        } else {
            sb = (u32)blk[0] | ((u32)blk[1] << 8);
#pragma unroll
            for (int e = 0; e < 4; ++e)
                r[e] = (u32)qs[4 * e] | ((u32)qs[4 * e + 1] << 8) | ((u32)qs[4 * e + 2] << 16) | ((u32)qs[4 * e + 3] << 24);
        }
        const float d = half_bits_to_float((u16)sb);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const u32 x = r[e];  // int8 i: (int)(x << (24 - 8 i)) >> 24
            w[2 * e] = pack_half2(d * (float)((int)(x << 24) >> 24), d * (float)((int)(x << 16) >> 24));
            w[2 * e + 1] = pack_half2(d * (float)((int)(x << 8) >> 24), d * (float)((int)x >> 24));
        }
    } else {
        const u8* s = row + c2 * 16;
        if (aligned) {
            const uint4 a = *reinterpret_cast<const uint4*>(s);
            r[0] = a.x;
            r[1] = a.y;
            r[2] = a.z;
            r[3] = a.w;
        } else {
#pragma unroll
            for (int e = 0; e < 4; ++e)
                r[e] = (u32)s[4 * e] | ((u32)s[4 * e + 1] << 8) | ((u32)s[4 * e + 2] << 16) | ((u32)s[4 * e + 3] << 24);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) fp8x4_to_f16(r[e], dt, w[2 * e], w[2 * e + 1]);
    }
}

// The STEP cache rows of a step from quantised K or V (dtype `dt`, D values a row) into
// shared memory as F16: chunk c (8 halves) of row r at `dst + chunk(r, c)` (the 16-bit
// loaders' layouts: load_rows_f16's swizzled rows, the Hopper form's atoms). Contiguous
// (the base module's walk): row r at `src + r * row_stride`, `src` the step's first row.
// Paged (with MLXN_PAGED_ENTRIES): row r is cache row j0 + r of this CTA's sequence, found
// through the table from `src`, the head's column 0 in block 0 (kv_row_paged). Rows at or
// past `nvalid` are zeros and are not read (nor their table entries). Synchronous: each
// thread's stores are made visible by the barrier (and, on Hopper, the proxy fence) that
// the mainloops pass before a product reads the tile, as for copy8_f16's unaligned stores.
template <int D, class Chunk>
__device__ __forceinline__ void load_rows_quant(u32 dst, Chunk chunk, const u8* __restrict__ src, const Launch& L,
                                                i64 block_stride, i64 row_stride, int j0, int nvalid, int dt,
                                                bool aligned) {
    static_assert(D % 16 == 0, "quantised rows: whole 16-value pieces");
    constexpr int C2 = D / 16;
    for (int i = threadIdx.x; i < STEP * C2; i += NTHREADS) {
        const int r = i / C2, c2 = i % C2;
        u32 w[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
        if (r < nvalid) {
#if MLXN_PAGED_ENTRIES
            const u8* row = src + kv_row_paged(L, j0 + r, block_stride, row_stride);
#else
            const u8* row = src + (i64)r * row_stride;
#endif
            quant16_to_f16(w, row, c2, dt, aligned);
        }
        st_shared_v4(dst + chunk(r, 2 * c2), w[0], w[1], w[2], w[3]);
        st_shared_v4(dst + chunk(r, 2 * c2 + 1), w[4], w[5], w[6], w[7]);
    }
}

// The K descale factor of KV head `kvh` (1 without PREFILL_DESCALE): the mainloops multiply
// the scores by it before anything is added to them; V's factor multiplies O at the end
// (vdescale). A product by 1 changes no bit.
__device__ __forceinline__ float kdescale(const Params& p, const Launch& L, int kvh) {
    return (p.flags & PREFILL_DESCALE) ? __ldg(L.descale + kvh) : 1.f;
}
__device__ __forceinline__ float vdescale(const Params& p, const Launch& L, int kvh) {
    return (p.flags & PREFILL_DESCALE) ? __ldg(L.descale + p.n_kv_heads + kvh) : 1.f;
}
#endif

// The mask tile of cache step `t` for the CTA's `qpc` query rows (`mask`: the
// sequence's): [qpc][64] halves,
// 128 bytes per row, swizzled. Rows at or past lq and columns at or past lk are zeros
// and are never read (the kernel makes those scores -inf by visibility). Thread `first` of
// `threads` (the CTA's, or one producer warp's lanes) copies every threads-th chunk.
__device__ __forceinline__ void load_mask_tile(u32 dst, const u16* __restrict__ mask, const Params& p, int lq, int lk,
                                               int q_cta, int qpc, int t, bool aligned, int first = threadIdx.x,
                                               int threads = NTHREADS) {
    const int total = qpc * 8;
    for (int i = first; i < total; i += threads) {
        const int r = i >> 3, c = i & 7;
        const int qr = q_cta + r;
        const int j0 = t * STEP + c * 8;
        const u32 d = dst + (u32)(r * 128) + swz(c, r & 7);
        const bool row_in = qr < lq;
        const int n = row_in ? min(8, lk - j0) : 0;  // columns of the chunk in the cache
        const u16* s = mask + (row_in ? (i64)qr * p.mask_row_stride + j0 : 0);
        if (aligned && (n >= 8 || n <= 0)) {
            cp_async16(d, s, n > 0 ? 16u : 0u);
        } else {
            u32 w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const u32 lo = 2 * e < n ? (u32)s[2 * e] : 0u;
                const u32 hi = 2 * e + 1 < n ? (u32)s[2 * e + 1] : 0u;
                w[e] = lo | (hi << 16);
            }
            st_shared_v4(d, w[0], w[1], w[2], w[3]);
        }
    }
}
