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
