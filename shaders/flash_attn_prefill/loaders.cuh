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

// 8 elements of Q at `src` (dtype `dt`: F32, F16 or BF16), read as float, scaled and
// rounded to the products' type T: qh = T(scale * q), as 4 pairs. `aligned`: 16-byte loads.
template <class T>
__device__ __forceinline__ void load_q8(u32 (&w)[4], const void* __restrict__ src, int dt, float scale, bool aligned) {
    float f[8];
    if (dt == DT_F32) {
        const float* q = reinterpret_cast<const float*>(src);
        if (aligned) {
            const float4 a = *reinterpret_cast<const float4*>(q);
            const float4 b = *reinterpret_cast<const float4*>(q + 4);
            f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
            f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) f[e] = q[e];
        }
    } else {
        const u16* q = reinterpret_cast<const u16*>(src);
        u32 h[4];
        if (aligned) {
            const uint4 a = *reinterpret_cast<const uint4*>(q);
            h[0] = a.x; h[1] = a.y; h[2] = a.z; h[3] = a.w;
        } else {
#pragma unroll
            for (int e = 0; e < 4; ++e) h[e] = (u32)q[2 * e] | ((u32)q[2 * e + 1] << 16);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            if (dt == DT_F16) {
                unpack_half2(h[e], f[2 * e], f[2 * e + 1]);
            } else {
                f[2 * e] = bf16_bits_to_float(h[e] & 0xffffu);
                f[2 * e + 1] = bf16_bits_to_float(h[e] >> 16);
            }
        }
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) w[e] = T::pack2(scale * f[2 * e], scale * f[2 * e + 1]);
}

// Q row `qr` of sequence `sq` (rows past lq zero), head h, chunk c (8 elements), as T.
template <class T>
__device__ __forceinline__ void load_q_chunk(u32 (&w)[4], const Params& p, const Launch& L, const Seq& sq,
                                             const unsigned char* __restrict__ q, int qr, int h, int c) {
    w[0] = w[1] = w[2] = w[3] = 0u;
    if (qr < sq.lq) {
        const int esz = p.q_dtype == DT_F32 ? 4 : 2;
        const i64 e = sq.q + (i64)qr * p.q_row_stride + (i64)h * p.q_head_stride + c * 8;
        load_q8<T>(w, q + e * esz, p.q_dtype, p.scale, (L.flags & FLAG_Q_ALIGNED) != 0);
    }
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
