// CUDA form of flash_attn_prefill_d256 / _d512 (SPEC sections 2 and 6-9), which the origin
// op's flash_attn_prefill_tensor_f16_d256 / _d512 also run, with a fixed layout (the host
// turns their params into these: one sequence, an explicit mask, F32 in and out).
//
// Compiled at run time with NVRTC for the device's own architecture (sm_80 and later:
// ldmatrix, cp.async, mma.sync m16n8k16 f16 -> f32). No CUDA header is included: every
// half-precision operation is inline PTX, so the source compiles with NVRTC alone.
//
// One CTA = 8 warps over ROWS (query row, head) pairs: RG row groups of 32 rows (32
// consecutive queries of one head) and G = D / 128 warps per row group. All heads of a
// CTA share one KV head, so a K/V tile in shared memory serves every head of the CTA
// (heads_per_cta of the `group` query heads of that KV head; more heads, fewer queries).
//
// Per 64-row cache step, warp w of a row group:
//   S  = Q K^T for its 32 rows and its JW = 64 / G columns of the step, over the full
//        head dim (Q and K from shared memory through ldmatrix, mma.sync);
//   the row maxima are exchanged inside the row group, so every warp applies the same
//        lazy rescale (threshold 8) of SPEC step 4;
//   P  = half(exp(S - M)) is written to shared memory as ready mma A-fragments, and every
//        warp reads the whole 32 x 64 P of its row group back;
//   O += P V for its 32 rows and its 128 output columns (O stays in registers).
// Each warp keeps the partial row sums of its own P columns; they are added at the end.
//
// A CTA works on one sequence of the batch (blockIdx.z): fixed length, at its batch
// strides, or variable length, at its rows of cu_seqlens (SPEC 7). The steps it walks are
// those its rows can see by the description (causal, window: a range of steps, computed,
// never classified) and, with an explicit mask, those its tile table does not skip. Each
// 16-row m-tile of a step has a class: the description's (0 nothing visible, 2 all
// visible and the step whole, 1 otherwise) combined with the table's byte (bq = 32 at 256,
// 16 at 512; 2 without a mask): 0 if either is 0 (-inf scores, which changes no bit), 2 if
// both are 2 (no per-element work), else 1 (-inf where a pair is not visible, the mask
// added where the byte is 1). The CTA loads a step's mask tile only if some byte is 1. K
// and V rows past the sequence's cache are never read (zero-filled in shared memory).

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;
typedef unsigned long long u64;

#define NWARPS 8
#define NTHREADS 256
#define STEP 64

// Mirror of the op's params block (FlashAttnPrefillParamsGpu, rust/src/params.rs): 64-bit
// strides in elements (the table's batch stride in bytes), then 32-bit fields.
struct Params {
    long long q_batch_stride, q_row_stride, q_head_stride;
    long long k_batch_stride, k_row_stride, k_head_stride;
    long long v_batch_stride, v_row_stride, v_head_stride;
    long long o_batch_stride, o_row_stride, o_head_stride;
    long long mask_batch_stride, mask_row_stride;
    long long lse_batch_stride, lse_head_stride;
    long long blk_batch_stride;
    int batch, rows, kv_len, n_heads, n_kv_heads, head_dim, max_rows, window, flags;
    int q_dtype, o_dtype;
    int blk_rows, blk_steps, blk_bq;
    float scale;
    int reserved;
};

#define PREFILL_CAUSAL 1
#define PREFILL_MASK 2
#define PREFILL_VARLEN 4
#define PREFILL_LSE 8
// DType codes of Q and O.
#define DT_F32 0
#define DT_F16 1
#define DT_BF16 2

// What the CUDA backend adds: the CTA geometry it chose and the alignment of the buffers.
struct Launch {
    int heads_per_cta;
    int queries_per_cta;
    int q_tiles;  // CTAs along the query rows: of the longest sequence
    int flags;
};

#define FLAG_Q_ALIGNED 1     // Q base and strides 16-byte aligned (8 elements of 16 bits, or 4 floats)
#define FLAG_K_ALIGNED 2     // K base and strides 16-byte aligned
#define FLAG_V_ALIGNED 4     // V base and strides 16-byte aligned
#define FLAG_MASK_ALIGNED 8  // mask base and strides 16-byte aligned
#define FLAG_OUT_ALIGNED 16  // out base and strides aligned to two elements

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
struct Swz4 {
    u32 base[4];
    __device__ __forceinline__ Swz4(int hi, int r7) {
#pragma unroll
        for (int i = 0; i < 4; ++i) base[i] = (u32)(((2 * i + hi) ^ r7) << 4);
    }
    __device__ __forceinline__ u32 at(int kc) const { return base[kc & 3] + (u32)((kc >> 2) << 7); }
};

// ------------------------------------------------------------------ sequences and visibility

// Where sequence b's rows are (element offsets; the table's in bytes) and how many.
struct Seq {
    i64 q, k, v, o, lse, mask, blk;
    int lq, lk;
};

__device__ __forceinline__ Seq sequence(const Params& p, const int* __restrict__ cu_q, const int* __restrict__ cu_k,
                                        int b) {
    Seq s;
    if (p.flags & PREFILL_VARLEN) {
        const int q0 = cu_q[b], k0 = cu_k[b];
        s.lq = cu_q[b + 1] - q0;
        s.lk = cu_k[b + 1] - k0;
        s.q = (i64)q0 * p.q_row_stride;
        s.k = (i64)k0 * p.k_row_stride;
        s.v = (i64)k0 * p.v_row_stride;
        s.o = (i64)q0 * p.o_row_stride;
        s.lse = q0;
        s.mask = 0;
        s.blk = 0;
    } else {
        s.lq = p.rows;
        s.lk = p.kv_len;
        s.q = (i64)b * p.q_batch_stride;
        s.k = (i64)b * p.k_batch_stride;
        s.v = (i64)b * p.v_batch_stride;
        s.o = (i64)b * p.o_batch_stride;
        s.lse = (i64)b * p.lse_batch_stride;
        s.mask = (i64)b * p.mask_batch_stride;
        s.blk = (i64)b * p.blk_batch_stride;
    }
    return s;
}

// Whether query row r may see cache row j (SPEC 6), offset = lk - lq.
__device__ __forceinline__ bool visible(const Params& p, int lk, int off, int r, int j) {
    if (j >= lk) return false;
    if ((p.flags & PREFILL_CAUSAL) && j > r + off) return false;
    if (p.window && j <= r + off - p.window) return false;
    return true;
}

// The cache rows query row r may see: [lo, hi] (SPEC 6; empty when lo > hi).
__device__ __forceinline__ void visible_range(const Params& p, int lk, int off, int r, int& lo, int& hi) {
    hi = (p.flags & PREFILL_CAUSAL) ? min(lk - 1, r + off) : lk - 1;
    lo = p.window ? r + off - p.window + 1 : 0;
}

// The description's class of query rows [ra, rb) (non-empty, below lq) and step t (below
// the cache's steps): 0 no pair visible, 2 every pair visible and the step whole, 1 else.
__device__ __forceinline__ int described_class(const Params& p, int lk, int off, int ra, int rb, int t) {
    const int c0 = t * STEP, c1 = min(c0 + STEP, lk);
    const bool causal = (p.flags & PREFILL_CAUSAL) != 0;
    if (causal && c0 > rb - 1 + off) return 0;
    if (p.window && c1 - 1 <= ra + off - p.window) return 0;
    bool full = c0 + STEP <= lk;
    if (causal && c1 - 1 > ra + off) full = false;
    if (p.window && c0 <= rb - 1 + off - p.window) full = false;
    return full ? 2 : 1;
}

// The steps query rows [ra, rb) (non-empty, below lq) can see: [lo, hi], empty if lo > hi.
__device__ __forceinline__ void visible_steps(const Params& p, int lk, int off, int ra, int rb, int& lo, int& hi) {
    lo = 0;
    hi = (lk + STEP - 1) / STEP - 1;
    if (p.flags & PREFILL_CAUSAL) {
        const int last = rb - 1 + off;
        hi = last < 0 ? -1 : min(hi, last / STEP);
    }
    if (p.window) {
        const int first = ra + off - p.window + 1;
        if (first > 0) lo = first / STEP;
    }
}

// The class of an m-tile from the description's and the table's (2 without a mask).
__device__ __forceinline__ int combine_class(int described, int table) {
    return (described == 0 || table == 0) ? 0 : (described == 2 && table == 2 ? 2 : 1);
}

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
// rounded to half: qh = half(scale * q), as 4 half2. `aligned`: 16-byte loads.
__device__ __forceinline__ void load_q8_half(u32 (&w)[4], const void* __restrict__ src, int dt, float scale, bool aligned) {
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
    for (int e = 0; e < 4; ++e) w[e] = pack_half2(scale * f[2 * e], scale * f[2 * e + 1]);
}

// Q row `qr` of sequence `sq` (rows past lq zero), head h, chunk c (8 elements), as half.
__device__ __forceinline__ void load_q_chunk(u32 (&w)[4], const Params& p, const Launch& L, const Seq& sq,
                                             const unsigned char* __restrict__ q, int qr, int h, int c) {
    w[0] = w[1] = w[2] = w[3] = 0u;
    if (qr < sq.lq) {
        const int esz = p.q_dtype == DT_F32 ? 4 : 2;
        const i64 e = sq.q + (i64)qr * p.q_row_stride + (i64)h * p.q_head_stride + c * 8;
        load_q8_half(w, q + e * esz, p.q_dtype, p.scale, (L.flags & FLAG_Q_ALIGNED) != 0);
    }
}

// The walk over the steps a CTA's query rows compute: by the description, the steps
// [lo, hi] (visible_steps); with an explicit mask, those of them some byte of table rows
// [tr_first, tr_last] does not skip (each lane looks at one step of a 32-step window).
struct Walk {
    const u8* blk;  // the sequence's table, or null without a mask
    int steps;      // the table's row stride (its columns)
    int lo, hi, tr_first, tr_last;

    // The first step after `t` that is walked (past hi: none), and in `need_mask` whether
    // some byte of it is 1 (its mask tile is read).
    __device__ __forceinline__ int next(int t, int lane, bool& need_mask) const {
        const int start = max(t + 1, lo);
        need_mask = false;
        if (blk == nullptr) return start <= hi ? start : hi + 1;
        for (int base = start; base <= hi; base += 32) {
            const int s = base + lane;
            bool act = false, nm = false;
            if (s <= hi) {
                for (int tr = tr_first; tr <= tr_last; ++tr) {
                    const u8 b = blk[(i64)tr * steps + s];
                    act |= b != 0;
                    nm |= b == 1;
                }
            }
            const u32 ba = __ballot_sync(0xffffffffu, act);
            const u32 bm = __ballot_sync(0xffffffffu, nm);
            if (ba) {
                const int f = __ffs(ba) - 1;
                need_mask = (bm >> f) & 1u;
                return base + f;
            }
        }
        return hi + 1;
    }
};

// `STEP` rows of `D` halves at `src + row * row_stride` into shared memory (swizzled,
// D * 2 bytes per row); rows at or past `nvalid` are zeros and are not read.
// Asynchronous when the rows are 16-byte aligned, else synchronous.
template <int D>
__device__ __forceinline__ void load_rows_f16(u32 dst, const u16* __restrict__ src, i64 row_stride, int nvalid,
                                              bool aligned) {
    constexpr int CH = D / 8;
    constexpr int total = STEP * CH;
    for (int i = threadIdx.x; i < total; i += NTHREADS) {
        const int r = i / CH, c = i % CH;
        const u16* s = src + (i64)r * row_stride + c * 8;
        copy8_f16(dst + (u32)(r * D * 2) + swz(c, r & 7), s, aligned, r < nvalid);
    }
}

// The mask tile of cache step `t` for the CTA's `qpc` query rows (`mask`: the
// sequence's): [qpc][64] halves,
// 128 bytes per row, swizzled. Rows at or past lq and columns at or past lk are zeros
// and are never read (the kernel makes those scores -inf by visibility).
__device__ __forceinline__ void load_mask_tile(u32 dst, const u16* __restrict__ mask, const Params& p, int lq, int lk,
                                               int q_cta, int qpc, int t, bool aligned) {
    const int total = qpc * 8;
    for (int i = threadIdx.x; i < total; i += NTHREADS) {
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

// Two output elements (columns c, c + 1) of row r of O in its dtype, and, where the
// element pair is aligned, in one store.
__device__ __forceinline__ void store_out2(void* __restrict__ out, int dt, i64 e, float x0, float x1, bool aligned) {
    if (dt == DT_F32) {
        float* o = reinterpret_cast<float*>(out) + e;
        if (aligned) {
            *reinterpret_cast<float2*>(o) = make_float2(x0, x1);
        } else {
            o[0] = x0;
            o[1] = x1;
        }
        return;
    }
    u32 h;
    if (dt == DT_F16) {
        h = pack_half2(x0, x1);
    } else {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(h) : "f"(x1), "f"(x0));
    }
    u16* o = reinterpret_cast<u16*>(out) + e;
    if (aligned) {
        *reinterpret_cast<u32*>(o) = h;
    } else {
        o[0] = (u16)(h & 0xffffu);
        o[1] = (u16)(h >> 16);
    }
}

// lse = M + ln(S) of one (row, head), -inf where the row saw nothing (SPEC 8).
__device__ __forceinline__ float lse_of(float m, float l) { return l > 0.f ? m + logf(l) : -__int_as_float(0x7f800000); }

// ------------------------------------------------------------------ the kernel

template <int D>
struct Cfg {
    static constexpr int G = D / 128;          // warps per row group (128 O columns each)
    static constexpr int RG = NWARPS / G;      // row groups
    static constexpr int ROWS = RG * 32;       // (query, head) rows of a CTA
    static constexpr int JW = STEP / G;        // score columns of a warp
    static constexpr int NB = JW / 8;          // n-blocks of S per m-tile
    static constexpr int KL = JW / 16;         // 16-column k-chunks of P a warp produces
    static constexpr int DW = 128;             // O columns of a warp
    static constexpr int BQ = D == 256 ? 32 : 16;  // query rows per blk table row
    // Shared memory, bytes.
    static constexpr int Q_BYTES = ROWS * D * 2;
    static constexpr int KV_BYTES = STEP * D * 2;
    static constexpr int MASK_BYTES = ROWS * STEP * 2;
    static constexpr int P_BYTES = NWARPS * 2 * KL * 32 * 16;
    static constexpr int RED_BYTES = NWARPS * 32 * 4;
    // The sequence's mask, output and lse offsets, kept here rather than in registers
    // through the walk (the d256 form has none to spare).
    static constexpr int SEQ_BYTES = 32;
    static constexpr int SMEM = Q_BYTES + 2 * KV_BYTES + MASK_BYTES + P_BYTES + RED_BYTES + SEQ_BYTES;
};

template <int D>
__device__ __forceinline__ void attention(const Params& p, const Launch& L, const unsigned char* __restrict__ q,
                                          const u16* __restrict__ k, const u16* __restrict__ v,
                                          const u16* __restrict__ mask, const u8* __restrict__ blk,
                                          void* __restrict__ out, float* __restrict__ lse,
                                          const int* __restrict__ cu_q, const int* __restrict__ cu_k) {
    typedef Cfg<D> C;
    extern __shared__ __align__(128) unsigned char smem[];
    const u32 s_q = smem_addr(smem);
    const u32 s_k = s_q + C::Q_BYTES;
    const u32 s_v = s_k + C::KV_BYTES;
    const u32 s_mask = s_v + C::KV_BYTES;
    const u32 s_p = s_mask + C::MASK_BYTES;
    const u32 s_red = s_p + C::P_BYTES;
    const u32 s_seq = s_red + C::RED_BYTES;  // the sequence's mask, out and lse offsets (i64)

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g8 = lane >> 2, tig = lane & 3;  // mma fragment row and column pair
    const int l7 = lane & 7;
    const int rg = warp / C::G, wg = warp % C::G;
    const int hpc = L.heads_per_cta, qpc = L.queries_per_cta;
    const Seq sq = sequence(p, cu_q, cu_k, (int)blockIdx.z);
    const int lq = sq.lq, lk = sq.lk, off = lk - lq;
    const int qt = (lq + qpc - 1) / qpc - 1 - (int)blockIdx.x;  // longest causal rows first
    if (qt < 0) return;  // a shorter sequence than the longest: no rows here (the whole CTA)
    if (tid == 0) {
        st_shared_i64(s_seq, sq.mask);
        st_shared_i64(s_seq + 8, sq.o);
        st_shared_i64(s_seq + 16, sq.lse);
    }
    __syncthreads();  // the offsets are visible to every thread, whether or not a step runs
    const int q_cta = qt * qpc;
    const int head = (int)blockIdx.y * hpc + rg % hpc;
    const int q_loc = (rg / hpc) * 32;  // first query of the row group, inside the CTA
    const int q0 = q_cta + q_loc;
    const int group = p.n_heads / p.n_kv_heads;
    const int kvh = ((int)blockIdx.y * hpc) / group;

    // ---- Q: qh = half(scale * q), rows past lq zero.
    {
        constexpr int CH = D / 8;
        for (int i = tid; i < C::ROWS * CH; i += NTHREADS) {
            const int r = i / CH, c = i % CH;
            const int rgi = r >> 5;
            const int qr = q_cta + (rgi / hpc) * 32 + (r & 31);
            const int h = (int)blockIdx.y * hpc + rgi % hpc;
            u32 w[4];
            load_q_chunk(w, p, L, sq, q, qr, h, c);
            st_shared_v4(s_q + (u32)(r * D * 2) + swz(c, r & 7), w[0], w[1], w[2], w[3]);
        }
    }

    // ---- The steps walked (the description's, and the table's), and the class of each of
    // this warp's two 16-row m-tiles in a step.
    const int q_end = min(q_cta + qpc, lq);
    Walk walk;
    walk.blk = (p.flags & PREFILL_MASK) ? blk + sq.blk : nullptr;
    walk.steps = p.blk_steps;
    walk.tr_first = q_cta / C::BQ;
    walk.tr_last = (q_end - 1) / C::BQ;
    visible_steps(p, lk, off, q_cta, q_end, walk.lo, walk.hi);
    const int t_end = walk.hi + 1;
    auto mtile_class = [&](int mt, int t, int& table) -> int {
        const int ra = q0 + mt * 16;
        if (ra >= lq) {
            table = 0;
            return 0;
        }
        table = walk.blk ? (int)walk.blk[(i64)(ra / C::BQ) * walk.steps + t] : 2;
        return combine_class(described_class(p, lk, off, ra, min(ra + 16, lq), t), table);
    };
    auto next_active = [&](int t, bool& need_mask) -> int { return walk.next(t, lane, need_mask); };

    const u16* k_base = k + sq.k + (i64)kvh * p.k_head_stride;
    const u16* v_base = v + sq.v + (i64)kvh * p.v_head_stride;
    const bool k_al = (L.flags & FLAG_K_ALIGNED) != 0;
    const bool v_al = (L.flags & FLAG_V_ALIGNED) != 0;
    const bool m_al = (L.flags & FLAG_MASK_ALIGNED) != 0;

    // ---- State: O (32 rows x 128 columns), running max and partial sums of 4 rows.
    float o[2][C::DW / 8][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nb = 0; nb < C::DW / 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[mt][nb][e] = 0.f;
    float m_run[2][2], l_run[2][2];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            m_run[mt][hh] = NEG_FLT_MAX_HALF;
            l_run[mt][hh] = 0.f;
        }

    // Per-thread shared addresses (row parts; the chunk part is added per use).
    const int wj0 = wg * C::JW;   // first score column of the warp in the step
    const int wd0 = wg * C::DW;   // first O column of the warp
    u32 q_row[2];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) q_row[mt] = s_q + (u32)((rg * 32 + mt * 16 + (lane & 15)) * D * 2);
    const Swz4 q_sw(lane >> 4, l7);       // A: chunk +1 for lanes 16..31
    u32 k_row[C::JW / 16];
#pragma unroll
    for (int jb = 0; jb < C::JW / 16; ++jb)
        k_row[jb] = s_k + (u32)((wj0 + jb * 16 + l7 + ((lane >> 4) << 3)) * D * 2);
    const Swz4 k_sw((lane >> 3) & 1, l7); // B (K): chunk +1 for lanes 8..15, 24..31
    const int v_r = l7 + (((lane >> 3) & 1) << 3);  // B (V^T): row within a 16-row k-chunk
    const Swz4& v_sw = q_sw;              // B (V^T): chunk +1 for lanes 16..31, as A
    const u32 v_col = (u32)(wd0 * 2);     // wd0 / 8 is a multiple of 16: no swizzle bits
    const u32 red_me = s_red + (u32)(warp * 32 * 4);
    const u32 red_group = s_red + (u32)(rg * C::G * 32 * 4);
    const u32 p_group = s_p + (u32)(rg * C::G * 2 * C::KL * 32 * 16);
    const u32 p_me = s_p + (u32)(warp * 2 * C::KL * 32 * 16);

    bool need_mask = false;
    int t = next_active(-1, need_mask);
    if (t < t_end) {
        load_rows_f16<D>(s_k, k_base + (i64)t * STEP * p.k_row_stride, p.k_row_stride, lk - t * STEP, k_al);
        if (need_mask) load_mask_tile(s_mask, mask + sq.mask, p, lq, lk, q_cta, qpc, t, m_al);
        cp_async_commit();
    }

    while (t < t_end) {
        cp_async_wait_all();
        __syncthreads();  // K_t and the mask tile are in; V is free (every P V of t-1 done)
        load_rows_f16<D>(s_v, v_base + (i64)t * STEP * p.v_row_stride, p.v_row_stride, lk - t * STEP, v_al);
        cp_async_commit();

        int tb0, tb1;
        const int b0 = mtile_class(0, t, tb0);
        const int b1 = mtile_class(1, t, tb1);
        const bool active = (b0 | b1) != 0;  // the same for every warp of the row group

        if (active) {
            // ---- S = Q K^T over the full head dim, this warp's JW columns.
            float s[2][C::NB][4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int nb = 0; nb < C::NB; ++nb)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[mt][nb][e] = 0.f;
#pragma unroll
            for (int kc = 0; kc < D / 16; ++kc) {
                u32 a[2][4];
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) ldsm_x4(a[mt], q_row[mt] + q_sw.at(kc));
#pragma unroll
                for (int jb = 0; jb < C::JW / 16; ++jb) {
                    u32 b[4];
                    ldsm_x4(b, k_row[jb] + k_sw.at(kc));
#pragma unroll
                    for (int mt = 0; mt < 2; ++mt) {
                        mma16816(s[mt][jb * 2], a[mt], b[0], b[1]);
                        mma16816(s[mt][jb * 2 + 1], a[mt], b[2], b[3]);
                    }
                }
            }

            // ---- Class 1: -inf where a pair is not visible, the mask where the byte is 1;
            // class 0: -inf for the m-tile.
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                const int bm = mt == 0 ? b0 : b1;
                const bool add_mask = (mt == 0 ? tb0 : tb1) == 1;
                if (bm == 1) {
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        const int rr = q_loc + mt * 16 + hh * 8 + g8;  // row of the mask tile
                        const u32 row_addr = s_mask + (u32)(rr * 128) + (u32)(tig * 4);
                        // The row's visible columns, relative to this thread's first one.
                        int vlo, vhi;
                        visible_range(p, lk, off, q_cta + rr, vlo, vhi);
                        vlo -= t * STEP + wj0 + tig * 2;
                        vhi -= t * STEP + wj0 + tig * 2;
#pragma unroll
                        for (int nb = 0; nb < C::NB; ++nb) {
                            float lo = 0.f, hi = 0.f;
                            if (add_mask) unpack_half2(ld_shared_u32(row_addr + swz(wj0 / 8 + nb, g8)), lo, hi);
                            const int j = nb * 8;
                            const float ninf = -__int_as_float(0x7f800000);
                            s[mt][nb][hh * 2] = (j >= vlo && j <= vhi) ? s[mt][nb][hh * 2] + lo : ninf;
                            s[mt][nb][hh * 2 + 1] = (j + 1 >= vlo && j + 1 <= vhi) ? s[mt][nb][hh * 2 + 1] + hi : ninf;
                        }
                    }
                } else if (bm == 0) {
#pragma unroll
                    for (int nb = 0; nb < C::NB; ++nb)
#pragma unroll
                        for (int e = 0; e < 4; ++e) s[mt][nb][e] = -__int_as_float(0x7f800000);
                }
            }

            // ---- Row maxima of the step, shared across the row group.
            float mx[2][2];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    float m = s[mt][0][hh * 2];
#pragma unroll
                    for (int nb = 0; nb < C::NB; ++nb)
                        m = fmaxf(m, fmaxf(s[mt][nb][hh * 2], s[mt][nb][hh * 2 + 1]));
                    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
                    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
                    mx[mt][hh] = m;
                }
            if (C::G > 1) {
                if (tig == 0) {
#pragma unroll
                    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                        for (int hh = 0; hh < 2; ++hh)
                            st_shared_f32(red_me + (u32)((mt * 16 + hh * 8 + g8) * 4), mx[mt][hh]);
                }
                named_barrier(1 + rg, C::G * 32);
#pragma unroll
                for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        const u32 off = (u32)((mt * 16 + hh * 8 + g8) * 4);
                        float m = ld_shared_f32(red_group + off);
#pragma unroll
                        for (int w = 1; w < C::G; ++w) m = fmaxf(m, ld_shared_f32(red_group + (u32)(w * 128) + off));
                        mx[mt][hh] = m;
                    }
            }

            // ---- Lazy rescale (only when the max grows by more than 8), P = half(exp(S - M)).
            float ms[2][2];
            bool any_rescale = false;
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    ms[mt][hh] = 1.f;
                    if (mx[mt][hh] > m_run[mt][hh] + 8.f) {
                        ms[mt][hh] = exp2_approx((m_run[mt][hh] - mx[mt][hh]) * LOG2E);
                        m_run[mt][hh] = mx[mt][hh];
                        any_rescale = true;
                    }
                }
            u32 pk[2][C::NB][2];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const float mr = m_run[mt][hh];
                    float sum = 0.f;
#pragma unroll
                    for (int nb = 0; nb < C::NB; ++nb) {
                        const float e0 = exp2_approx((s[mt][nb][hh * 2] - mr) * LOG2E);
                        const float e1 = exp2_approx((s[mt][nb][hh * 2 + 1] - mr) * LOG2E);
                        const u32 h2 = pack_half2(e0, e1);
                        float r0, r1;
                        unpack_half2(h2, r0, r1);
                        sum += r0 + r1;
                        pk[mt][nb][hh] = h2;
                    }
                    l_run[mt][hh] = l_run[mt][hh] * ms[mt][hh] + sum;
                }
            // P as A-fragments: k-chunk kl of m-tile mt = n-blocks 2kl, 2kl+1.
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int kl = 0; kl < C::KL; ++kl)
                    st_shared_v4(p_me + (u32)(((mt * C::KL + kl) * 32 + lane) * 16), pk[mt][2 * kl][0],
                                 pk[mt][2 * kl][1], pk[mt][2 * kl + 1][0], pk[mt][2 * kl + 1][1]);
            if (__any_sync(0xffffffffu, any_rescale)) {
#pragma unroll
                for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                    for (int nb = 0; nb < C::DW / 8; ++nb)
#pragma unroll
                        for (int e = 0; e < 4; ++e) o[mt][nb][e] *= ms[mt][e >> 1];
            }
        } else if (C::G > 1) {
            // An idle row group passes its barrier too: every warp sees the same barrier
            // sequence each step.
            named_barrier(1 + rg, C::G * 32);
        }

        bool need_mask_next = false;
        const int tn = next_active(t, need_mask_next);
        cp_async_wait_all();
        __syncthreads();  // V_t is in, P of the step is visible, K and the mask tile are free
        if (tn < t_end) {
            load_rows_f16<D>(s_k, k_base + (i64)tn * STEP * p.k_row_stride, p.k_row_stride, lk - tn * STEP, k_al);
            if (need_mask_next) load_mask_tile(s_mask, mask + ld_shared_i64(s_seq), p, lq, lk, q_cta, qpc, tn, m_al);
            cp_async_commit();
        }

        if (active) {
            // ---- O += P V over the 64 rows of the step, this warp's 128 columns.
#pragma unroll
            for (int kc = 0; kc < STEP / 16; ++kc) {
                const u32 pw = p_group + (u32)((kc / C::KL) * (2 * C::KL * 32 * 16));
                u32 a[2][4];
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) ld_shared_v4(pw + (u32)(((mt * C::KL + kc % C::KL) * 32 + lane) * 16), a[mt]);
                const u32 vrow = s_v + (u32)(v_r * D * 2) + v_col + (u32)(kc * 16 * D * 2);
#pragma unroll
                for (int dp = 0; dp < C::DW / 16; ++dp) {
                    u32 b[4];
                    ldsm_x4_trans(b, vrow + v_sw.at(dp));
#pragma unroll
                    for (int mt = 0; mt < 2; ++mt) {
                        mma16816(o[mt][dp * 2], a[mt], b[0], b[1]);
                        mma16816(o[mt][dp * 2 + 1], a[mt], b[2], b[3]);
                    }
                }
            }
        }
        t = tn;
    }

    // ---- Row sums: the quad's, then the row group's (in a fixed order), and O / S.
    float lt[2][2];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float l = l_run[mt][hh];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            lt[mt][hh] = l;
        }
    if (C::G > 1) {
        // Every reader of the last step's maxima passed the loop's last __syncthreads.
        if (tig == 0) {
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) st_shared_f32(red_me + (u32)((mt * 16 + hh * 8 + g8) * 4), lt[mt][hh]);
        }
        named_barrier(1 + rg, C::G * 32);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const u32 off = (u32)((mt * 16 + hh * 8 + g8) * 4);
                float l = ld_shared_f32(red_group + off);
#pragma unroll
                for (int w = 1; w < C::G; ++w) l += ld_shared_f32(red_group + (u32)(w * 128) + off);
                lt[mt][hh] = l;
            }
    }
    const bool out_al = (L.flags & FLAG_OUT_ALIGNED) != 0;
    const i64 o_seq = ld_shared_i64(s_seq + 8), lse_seq = ld_shared_i64(s_seq + 16);
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = q0 + mt * 16 + hh * 8 + g8;
            if (r >= lq) continue;
            const float inv = lt[mt][hh] > 0.f ? 1.f / lt[mt][hh] : 0.f;
            const i64 dst = o_seq + (i64)r * p.o_row_stride + (i64)head * p.o_head_stride + wd0 + tig * 2;
#pragma unroll
            for (int nb = 0; nb < C::DW / 8; ++nb)
                store_out2(out, p.o_dtype, dst + nb * 8, o[mt][nb][hh * 2] * inv, o[mt][nb][hh * 2 + 1] * inv, out_al);
            if ((p.flags & PREFILL_LSE) && wg == 0 && tig == 0)
                lse[lse_seq + (i64)head * p.lse_head_stride + r] = lse_of(m_run[mt][hh], lt[mt][hh]);
        }
}

// ================================================================== Hopper (sm_90a): wgmma
//
// The same computation with warpgroup MMA: 2 warpgroups of 4 warps; a warpgroup owns 64
// (query, head) rows, each warp 16 of them. Q, K and V sit in shared memory in the
// 128-byte-swizzle layout wgmma reads ([D / 64 atoms][rows][64 halves], 16-byte chunk c
// of row r at chunk c ^ (r % 8)), so both products read their operands from shared memory
// once per warpgroup instead of once per warp.
//
// Head dim 256: each warpgroup computes the scores of its 64 rows over the whole step
// (m64n64k16) and keeps its 64 x 256 block of O in registers (m64n256k16); the scores
// become P in registers and P is the A operand of P V (no shared-memory round trip).
// K, V and the mask tile are double-buffered: the next step loads during this one.
// Head dim 512: O (64 x 512) needs both warpgroups: each takes 256 of the output columns
// and 32 of the 64 score columns of the step (m64n32k16), the row maxima are exchanged
// through shared memory, and each warpgroup's half of P goes through shared memory to the
// other. Single-buffered (the tiles take 192 KB).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MLXN_HOPPER 1
namespace hopper {

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Ordinary and cp.async stores to shared memory, made visible to wgmma (the async proxy).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keep the compiler from moving reads of wgmma results above the wait (or writes below).
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// ---- CTA pairs (thread-block clusters of 2) and the tensor memory accelerator (TMA).
// A tensor map, made on the host (cuTensorMapEncodeTiled) and passed as a grid constant.
struct __align__(64) TMap {
    u64 opaque[16];
};
__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
// Split cluster barrier: every thread of both CTAs arrives, then waits for all arrivals.
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void fence_mbar_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// This thread's arrival on `bar`, expecting `bytes` more bytes of TMA writes this phase.
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Wait until the phase of `bar` with this parity has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}
// One box of a 4-d tensor map into shared memory at `dst` of every CTA in `cta_mask`
// (the same offset in each), completing bytes on the mbarrier at `bar` in each. Rows past
// the map's extent (the sequence's cache) land as zeros.
__device__ __forceinline__ void tma_load_4d_mc(u32 dst, const TMap* map, int c0, int c1, int c2, int c3, u32 bar,
                                               unsigned short cta_mask) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%2, %3, %4, %5}], [%6], %7;\n" ::"r"(dst),
        "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar), "h"(cta_mask)
        : "memory");
}

// Shared-memory matrix descriptor: start address, leading and stride byte offsets, and
// the 128-byte swizzle mode (bits 62-63 = 1).
__device__ __forceinline__ u64 desc_sw128(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)((lbo >> 4) & 0x3FFFu) << 16) |
           ((u64)((sbo >> 4) & 0x3FFFu) << 32) | (1ull << 62);
}

// Byte offset of 16-byte chunk `c` (of D / 8) of row `r` in a tile of `rows` rows.
__device__ __forceinline__ u32 atom_off(int rows, int r, int c) {
    return (u32)((c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// D (m64 x n64, f32) (+)= A (64 x 16, smem) * B (n64 x 16, smem)^T; both K-major, 128-byte swizzle.
__device__ __forceinline__ void wgmma_ss_n64(float (&d)[32], u64 a, u64 b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(a), "l"(b), "r"(scale_d));
}

// D (m64 x n32, f32) (+)= A (64 x 16, smem) * B (n32 x 16, smem)^T; both K-major, 128-byte swizzle.
__device__ __forceinline__ void wgmma_ss_n32(float (&d)[16], u64 a, u64 b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(a), "l"(b), "r"(scale_d));
}

// D (m64 x n256, f32) += A (64 x 16, registers: mma-style fragments of each warp's 16 rows)
// * B (16 x n256, smem, N-major: transposed), 128-byte swizzle.
__device__ __forceinline__ void wgmma_rs_n256(float (&d)[128], const u32 (&a)[4], u64 b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, {%128,%129,%130,%131}, %132, 1, 1, 1, 1;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}


template <int D>
struct HCfg {
    static constexpr int G = D / 256;          // warpgroups per row group
    static constexpr int RG = 2 / G;           // row groups of 64 rows
    static constexpr int ROWS = RG * 64;       // (query, head) rows of a CTA
    static constexpr int JW = STEP / G;        // score columns of a warpgroup
    static constexpr int NS = JW / 2;          // score registers per thread
    static constexpr int NB = JW / 8;          // 8-column blocks of the scores
    static constexpr int DW = 256;             // O columns of a warpgroup
    static constexpr int NSTAGE = G == 1 ? 2 : 1;
    static constexpr int BQ = D == 256 ? 32 : 16;
    static constexpr int Q_BYTES = ROWS * D * 2;
    static constexpr int KV_BYTES = STEP * D * 2;
    static constexpr int MASK_BYTES = ROWS * STEP * 2;
    static constexpr int P_BYTES = G > 1 ? 2 * 4 * 2 * 32 * 16 : 0;  // [warpgroup][warp][k-chunk][lane]
    static constexpr int RED_BYTES = G > 1 ? 2 * 64 * 4 : 0;          // [warpgroup][row]
    static constexpr int BAR_BYTES = 64;                              // the CTA-pair forms' mbarriers
    static constexpr int SMEM = 1024 + Q_BYTES + NSTAGE * (2 * KV_BYTES + MASK_BYTES) + P_BYTES + RED_BYTES + BAR_BYTES;
};

// 64 rows of D halves at src + row * row_stride into an atom-layout tile of 64 rows; rows
// at or past `nvalid` are zeros and are not read.
// Thread `tid` always copies chunk tid % (D / 8) of rows tid / (D / 8) + n * (256 / (D / 8)):
// its column, swizzle and addresses are per-thread constants plus immediates.
template <int D>
__device__ __forceinline__ void load_kv_tile(u32 dst, const u16* __restrict__ src, i64 row_stride, int nvalid,
                                             bool aligned) {
    constexpr int CH = D / 8, RPI = NTHREADS / CH;  // chunks per row, rows per pass (8 or 4)
    const int c = threadIdx.x % CH, r0 = threadIdx.x / CH;
    const u16* s = src + (i64)r0 * row_stride + c * 8;
    const i64 pass = (i64)RPI * row_stride;
    const u32 d0 = dst + (u32)((c >> 3) * STEP * 128 + r0 * 128);
    const u32 sw[2] = {(u32)(((c & 7) ^ (r0 & 7)) << 4), (u32)(((c & 7) ^ ((r0 + 4) & 7)) << 4)};
#pragma unroll 4  // fully unrolled, the addresses of 16 passes stay live and spill at 512
    for (int n = 0; n < STEP / RPI; ++n) {
        copy8_f16(d0 + (u32)(n * RPI * 128) + sw[RPI % 8 == 0 ? 0 : (n & 1)], s, aligned, r0 + n * RPI < nvalid);
        s += pass;
    }
}

// PAIR: the CTA is one of a cluster of two that read the same K/V tiles: PAIR_HEADS, the
// two take the two halves of one KV head's query heads for the same queries (clusters
// along y); PAIR_QUERIES, neighbouring query tiles of the same heads (clusters along x;
// the last CTA of an odd number of tiles has no rows). Both walk the union of their active
// steps. Each tile is read from memory once, by the TMA, and multicast into both CTAs'
// shared memory (each CTA issues half of its boxes): half the L2 traffic. Full tiles are
// waited on mbarriers; a split cluster barrier says when both CTAs are done with one.
#define PAIR_NONE 0
#define PAIR_HEADS 1
#define PAIR_QUERIES 2
template <int D, int PAIR = PAIR_NONE>
__device__ __forceinline__ void attention(const Params& p, const Launch& L, const unsigned char* __restrict__ q,
                                          const u16* __restrict__ k, const u16* __restrict__ v,
                                          const u16* __restrict__ mask, const u8* __restrict__ blk,
                                          void* __restrict__ out, float* __restrict__ lse,
                                          const int* __restrict__ cu_q, const int* __restrict__ cu_k,
                                          const TMap* kmap = nullptr, const TMap* vmap = nullptr) {
    typedef HCfg<D> C;
    extern __shared__ __align__(1024) unsigned char smem[];
    const u32 s_base = (smem_addr(smem) + 1023u) & ~1023u;  // swizzle atoms need 1 KB alignment
    const u32 s_q = s_base;
    const u32 s_kv = s_q + C::Q_BYTES;                       // stage i: K, then V
    const u32 s_mask = s_kv + C::NSTAGE * 2 * C::KV_BYTES;  // stage i
    const u32 s_p = s_mask + C::NSTAGE * C::MASK_BYTES;
    const u32 s_red = s_p + C::P_BYTES;
    const u32 s_bar = s_red + C::RED_BYTES;  // PAIR: two mbarriers (K, V at 512; stage 0, 1 at 256)

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g8 = lane >> 2, tig = lane & 3;
    // The warpgroup index, broadcast so the compiler knows it is warp-uniform: what is
    // derived from it (descriptors) then lives in uniform registers.
    const int wgi = __shfl_sync(0xffffffffu, tid >> 7, 0), wq = warp & 3;
    const int rg = wgi / C::G, ch = wgi % C::G;    // row group, column half (head dim 512)
    const int hpc = L.heads_per_cta, qpc = L.queries_per_cta;
    const Seq sq = sequence(p, cu_q, cu_k, (int)blockIdx.z);
    const int lq = sq.lq, lk = sq.lk, off = lk - lq;
    const int q_tiles = (lq + qpc - 1) / qpc;       // this sequence's CTAs along the rows
    const int qt = q_tiles - 1 - (int)blockIdx.x;  // longest causal rows first
    if constexpr (PAIR == PAIR_QUERIES) {
        if (q_tiles - 1 - (int)(blockIdx.x & ~1u) < 0) return;  // both CTAs of the pair are empty
    } else {
        if (qt < 0) return;  // no rows here (for the head pairs: in both CTAs alike)
    }
    const int q_cta = qt >= 0 ? qt * qpc : lq;     // qt < 0: a query pair's empty CTA
    const int r0 = rg * 64 + wq * 16;              // first CTA row of this warp
    const int head = (int)blockIdx.y * hpc + r0 / qpc;
    const int q_loc = r0 % qpc;                    // first query of the warp, inside the CTA
    const int q0 = q_cta + q_loc;
    const int group = p.n_heads / p.n_kv_heads;
    const int kvh = ((int)blockIdx.y * hpc) / group;

    // ---- Q: qh = half(scale * q) in the atom layout; rows past lq zero.
    {
        constexpr int CH = D / 8;
        for (int i = tid; i < C::ROWS * CH; i += NTHREADS) {
            const int r = i / CH, c = i % CH;
            const int qr = q_cta + r % qpc;
            const int h = (int)blockIdx.y * hpc + r / qpc;
            u32 w[4];
            load_q_chunk(w, p, L, sq, q, qr, h, c);
            st_shared_v4(s_q + atom_off(C::ROWS, r, c), w[0], w[1], w[2], w[3]);
        }
    }

    // ---- The steps walked: those of this CTA's rows, or of both CTAs' of a query pair
    // (the description's steps, and the table's); the classes of this warp's rows.
    int wa = q_cta, we = min(q_cta + qpc, lq);  // the rows walked, [wa, we)
    if constexpr (PAIR == PAIR_QUERIES) {
        wa = 0x7fffffff;
        we = -1;
        for (int m = 0; m < 2; ++m) {
            const int qm = q_tiles - 1 - (int)((blockIdx.x & ~1u) + m);
            if (qm >= 0) {
                wa = min(wa, qm * qpc);
                we = max(we, min(qm * qpc + qpc, lq));
            }
        }
    }
    Walk walk;
    walk.blk = (p.flags & PREFILL_MASK) ? blk + sq.blk : nullptr;
    walk.steps = p.blk_steps;
    walk.tr_first = wa / C::BQ;
    walk.tr_last = (we - 1) / C::BQ;
    visible_steps(p, lk, off, wa, we, walk.lo, walk.hi);
    const int steps = walk.hi + 1;  // the loops below walk t < steps
    // The class of 16 rows from `ra` in step t (and its table byte): 0 where no row is.
    auto rows_class = [&](int ra, int t, int& table) -> int {
        if (ra >= lq) {
            table = 0;
            return 0;
        }
        table = walk.blk ? (int)walk.blk[(i64)(ra / C::BQ) * walk.steps + t] : 2;
        return combine_class(described_class(p, lk, off, ra, min(ra + 16, lq), t), table);
    };
    auto next_active = [&](int t, bool& need_mask) -> int { return walk.next(t, lane, need_mask); };

    const u16* k_base = k + sq.k + (i64)kvh * p.k_head_stride;
    const u16* v_base = v + sq.v + (i64)kvh * p.v_head_stride;
    const bool k_al = (L.flags & FLAG_K_ALIGNED) != 0;
    const bool v_al = (L.flags & FLAG_V_ALIGNED) != 0;
    const bool m_al = (L.flags & FLAG_MASK_ALIGNED) != 0;
    auto load_k = [&](int stage, int t) {
        load_kv_tile<D>(s_kv + stage * 2 * C::KV_BYTES, k_base + (i64)t * STEP * p.k_row_stride, p.k_row_stride,
                        lk - t * STEP, k_al);
    };
    auto load_v = [&](int stage, int t) {
        load_kv_tile<D>(s_kv + stage * 2 * C::KV_BYTES + C::KV_BYTES, v_base + (i64)t * STEP * p.v_row_stride,
                        p.v_row_stride, lk - t * STEP, v_al);
    };
    auto load_mask = [&](int stage, int t) {
        load_mask_tile(s_mask + stage * C::MASK_BYTES, mask + sq.mask, p, lq, lk, q_cta, qpc, t, m_al);
    };

    // ---- State: this warp's 16 rows x 256 columns of O, running max and partial sums.
    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    float m_run[2] = {NEG_FLT_MAX_HALF, NEG_FLT_MAX_HALF};
    float l_run[2] = {0.f, 0.f};
    u32 pk[C::NB][2];  // P of this warpgroup's score columns, half2 pairs (mma A-fragment halves)

    // Scores of step t from stage `stage`; P left in pk. Returns whether the warpgroup
    // computed (it skips when every one of its 64 rows skips the step).
    auto scores_and_softmax = [&](int t, int stage) -> bool {
        int tb;
        const int b = rows_class(q0, t, tb);
        bool wg_active = false;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            int tw;
            wg_active |= rows_class(q_cta + (rg * 64 + w * 16) % qpc, t, tw) != 0;
        }
        float mx[2] = {0.f, 0.f};
        float s[C::NS];
        if (wg_active) {
            // Descriptors of k-chunk kc = the tile's descriptor + the chunk's offset / 16
            // (addresses stay below 2^18, so the 14-bit address field never carries).
            const u64 db0 = desc_sw128(s_kv + stage * 2 * C::KV_BYTES + (u32)(ch * C::JW * 128), 16, 1024);
            const u64 da0 = desc_sw128(s_q + (u32)(rg * 64 * 128), 16, 1024);
            wgmma_fence();
#pragma unroll
            for (int kc = 0; kc < D / 16; ++kc) {
                const u64 da = da0 + (u64)(((kc >> 2) * C::ROWS * 128 + (kc & 3) * 32) >> 4);
                const u64 db = db0 + (u64)(((kc >> 2) * STEP * 128 + (kc & 3) * 32) >> 4);
                if constexpr (C::JW == 64) wgmma_ss_n64(s, da, db, kc > 0);
                else wgmma_ss_n32(s, da, db, kc > 0);
            }
            wgmma_commit();
            wgmma_wait0();
            fence_regs(s);
            if (b == 1) {
                // -inf where a pair is not visible, the mask where the table's byte is 1.
                const u32 m_tile = s_mask + stage * C::MASK_BYTES;
                const float ninf = -__int_as_float(0x7f800000);
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int rr = q_loc + hh * 8 + g8;
                    const u32 row_addr = m_tile + (u32)(rr * 128) + (u32)(tig * 4);
                    // The row's visible columns, relative to this thread's first one.
                    int vlo, vhi;
                    visible_range(p, lk, off, q_cta + rr, vlo, vhi);
                    vlo -= t * STEP + ch * C::JW + tig * 2;
                    vhi -= t * STEP + ch * C::JW + tig * 2;
#pragma unroll
                    for (int nb = 0; nb < C::NB; ++nb) {
                        float lo = 0.f, hi = 0.f;
                        if (tb == 1) unpack_half2(ld_shared_u32(row_addr + swz(ch * C::NB + nb, g8)), lo, hi);
                        const int j = nb * 8;
                        s[nb * 4 + hh * 2] = (j >= vlo && j <= vhi) ? s[nb * 4 + hh * 2] + lo : ninf;
                        s[nb * 4 + hh * 2 + 1] = (j + 1 >= vlo && j + 1 <= vhi) ? s[nb * 4 + hh * 2 + 1] + hi : ninf;
                    }
                }
            } else if (b == 0) {
#pragma unroll
                for (int i = 0; i < C::NS; ++i) s[i] = -__int_as_float(0x7f800000);
            }
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                float m = s[hh * 2];
#pragma unroll
                for (int nb = 0; nb < C::NB; ++nb) m = fmaxf(m, fmaxf(s[nb * 4 + hh * 2], s[nb * 4 + hh * 2 + 1]));
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
                mx[hh] = m;
            }
        }
        if constexpr (PAIR && C::NSTAGE == 1) cluster_arrive();  // this thread is done with the step's K
        if constexpr (C::G > 1) {
            // Both warpgroups hold the same rows: exchange the maxima (every step, so the
            // barrier sequence is the same everywhere).
            if (wg_active && tig == 0) {
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) st_shared_f32(s_red + (u32)((wgi * 64 + wq * 16 + hh * 8 + g8) * 4), mx[hh]);
            }
            __syncthreads();
            if (wg_active) {
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const u32 off = (u32)((wq * 16 + hh * 8 + g8) * 4);
                    mx[hh] = fmaxf(ld_shared_f32(s_red + off), ld_shared_f32(s_red + 64 * 4 + off));
                }
            }
        }
        if (wg_active) {
            float ms[2];
            bool any_rescale = false;
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                ms[hh] = 1.f;
                if (mx[hh] > m_run[hh] + 8.f) {
                    ms[hh] = exp2_approx((m_run[hh] - mx[hh]) * LOG2E);
                    m_run[hh] = mx[hh];
                    any_rescale = true;
                }
            }
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const float mr = m_run[hh];
                float sum = 0.f;
#pragma unroll
                for (int nb = 0; nb < C::NB; ++nb) {
                    const float e0 = exp2_approx((s[nb * 4 + hh * 2] - mr) * LOG2E);
                    const float e1 = exp2_approx((s[nb * 4 + hh * 2 + 1] - mr) * LOG2E);
                    const u32 h2 = pack_half2(e0, e1);
                    float r0, r1;
                    unpack_half2(h2, r0, r1);
                    sum += r0 + r1;
                    pk[nb][hh] = h2;
                }
                l_run[hh] = l_run[hh] * ms[hh] + sum;
            }
            if (__any_sync(0xffffffffu, any_rescale)) {
#pragma unroll
                for (int i = 0; i < 128; ++i) o[i] *= ms[(i >> 1) & 1];
            }
            if constexpr (C::G > 1) {
                // This warpgroup's P (its 32 columns = 2 k-chunks) for the other one.
#pragma unroll
                for (int kl = 0; kl < 2; ++kl)
                    st_shared_v4(s_p + (u32)((((wgi * 4 + wq) * 2 + kl) * 32 + lane) * 16), pk[2 * kl][0], pk[2 * kl][1],
                                 pk[2 * kl + 1][0], pk[2 * kl + 1][1]);
            }
        }
        return wg_active;
    };

    // O += P V for the step, from stage `stage` (P in pk, or in shared memory at 512).
    auto pv = [&](int stage) {
        const u32 v_tile = s_kv + stage * 2 * C::KV_BYTES + C::KV_BYTES + (u32)(ch * (C::DW / 64) * STEP * 128);
        u32 a[4][4];
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) {
            if constexpr (C::G == 1) {
                a[kc][0] = pk[2 * kc][0];
                a[kc][1] = pk[2 * kc][1];
                a[kc][2] = pk[2 * kc + 1][0];
                a[kc][3] = pk[2 * kc + 1][1];
            } else {
                ld_shared_v4(s_p + (u32)(((((kc >> 1) * 4 + wq) * 2 + (kc & 1)) * 32 + lane) * 16), a[kc]);
            }
        }
        const u64 dv0 = desc_sw128(v_tile, STEP * 128, 1024);
        wgmma_fence();
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) wgmma_rs_n256(o, a[kc], dv0 + (u64)((kc * 16 * 128) >> 4));
        wgmma_commit();
        wgmma_wait0();
        fence_regs(o);
    };

    // PAIR: this CTA's half of a tile's boxes (64 rows x 64 halves, 8 KB each), for both.
    auto tma_half = [&](const TMap* map, u32 dst, u32 bar, int t) {
        const int rank = (int)cluster_rank();
#pragma unroll
        for (int i = 0; i < D / 128; ++i) {
            const int cb = rank * (D / 128) + i;
            tma_load_4d_mc(dst + (u32)(cb * STEP * 128), map, cb * 64, kvh, t * STEP, (int)blockIdx.z, bar, 3);
        }
    };
    if constexpr (PAIR != PAIR_NONE) {
        if (tid == 0) {
            mbar_init(s_bar, 1);
            mbar_init(s_bar + 8, 1);
            fence_mbar_init();
        }
        fence_proxy_async();  // Q (ordinary stores) before wgmma reads it
        cluster_arrive();
        cluster_wait();  // both CTAs' barriers exist before any tile lands in either
    }

    bool need_mask = false;
    int t = next_active(-1, need_mask);
    if constexpr (C::NSTAGE == 2 && PAIR != PAIR_NONE) {
        // Stage i's K and V complete on the mbarrier at s_bar + 8 i.
        auto issue = [&](int st, int t) {
            const u32 bar = s_bar + 8 * st, dst = s_kv + st * 2 * C::KV_BYTES;
            mbar_expect_tx(bar, 2 * C::KV_BYTES);
            tma_half(kmap, dst, bar, t);
            tma_half(vmap, dst + C::KV_BYTES, bar, t);
        };
        if (t < steps) {
            if (tid == 0) issue(0, t);
            if (need_mask) load_mask(0, t);
            cp_async_commit();
        }
        cluster_arrive();  // stage 1 is free (the first wait below)
        int stage = 0;
        u32 phases = 0;
        while (t < steps) {
            cp_async_wait_all();
            mbar_wait(s_bar + 8 * stage, (phases >> stage) & 1u);
            phases ^= 1u << stage;
            __syncthreads();  // step t's mask tile is in; this CTA is done with the other stage
            cluster_wait();   // and so is the partner
            bool nm = false;
            const int tn = next_active(t, nm);
            if (tn < steps) {
                if (tid == 0) issue(stage ^ 1, tn);
                if (nm) load_mask(stage ^ 1, tn);
                cp_async_commit();
            }
            if (scores_and_softmax(t, stage)) pv(stage);
            cluster_arrive();  // done with this stage
            stage ^= 1;
            t = tn;
        }
        cluster_wait();  // the partner no longer touches this CTA's shared memory
    } else if constexpr (C::NSTAGE == 2) {
        if (t < steps) {
            load_k(0, t);
            load_v(0, t);
            if (need_mask) load_mask(0, t);
            cp_async_commit();
        }
        int stage = 0;
        while (t < steps) {
            cp_async_wait_all();
            fence_proxy_async();
            __syncthreads();  // step t's tiles are in; the other stage is free
            bool nm = false;
            const int tn = next_active(t, nm);
            if (tn < steps) {
                load_k(stage ^ 1, tn);
                load_v(stage ^ 1, tn);
                if (nm) load_mask(stage ^ 1, tn);
                cp_async_commit();
            }
            if (scores_and_softmax(t, stage)) pv(stage);
            stage ^= 1;
            t = tn;
        }
    } else if constexpr (PAIR != PAIR_NONE) {
        const u32 bar_k = s_bar, bar_v = s_bar + 8;
        const u32 s_k = s_kv, s_v = s_kv + C::KV_BYTES;
        auto issue = [&](const TMap* map, u32 dst, u32 bar, int t) {
            mbar_expect_tx(bar, C::KV_BYTES);
            tma_half(map, dst, bar, t);
        };
        u32 ph_k = 0, ph_v = 0;
        if (t < steps) {
            if (tid == 0) issue(kmap, s_k, bar_k, t);
            if (need_mask) load_mask(0, t);
            cp_async_commit();
        }
        cluster_arrive();  // V is free (the first wait below)
        while (t < steps) {
            cp_async_wait_all();
            mbar_wait(bar_k, ph_k);
            ph_k ^= 1;
            __syncthreads();  // the mask tile is in
            cluster_wait();   // both CTAs are done with the last V
            if (tid == 0) issue(vmap, s_v, bar_v, t);
            bool nm = false;
            const int tn = next_active(t, nm);
            const bool act = scores_and_softmax(t, 0);  // arrives once its Q K^T is done
            cluster_wait();  // both CTAs are done with K
            if (tn < steps && tid == 0) issue(kmap, s_k, bar_k, tn);
            mbar_wait(bar_v, ph_v);
            ph_v ^= 1;
            __syncthreads();  // P is visible; the mask tile is free
            if (tn < steps && nm) {
                load_mask(0, tn);
                cp_async_commit();
            }
            if (act) pv(0);
            cluster_arrive();  // done with V
            t = tn;
        }
        cluster_wait();  // the partner no longer touches this CTA's shared memory
    } else {
        if (t < steps) {
            load_k(0, t);
            if (need_mask) load_mask(0, t);
            cp_async_commit();
        }
        while (t < steps) {
            cp_async_wait_all();
            fence_proxy_async();
            __syncthreads();  // K_t and the mask tile are in; V is free
            load_v(0, t);
            cp_async_commit();
            bool nm = false;
            const int tn = next_active(t, nm);
            const bool act = scores_and_softmax(t, 0);
            // Every warpgroup's Q K^T finished before the exchange barrier inside: K is
            // free. K of the next step loads while P V runs and the next step starts.
            if (tn < steps) load_k(0, tn);
            cp_async_commit();
            cp_async_wait_group1();  // V_t (the next K may still be in flight)
            fence_proxy_async();
            __syncthreads();  // V_t is in, P is visible; the mask tile is free
            if (tn < steps && nm) {
                load_mask(0, tn);
                cp_async_commit();
            }
            if (act) pv(0);
            t = tn;
        }
    }

    // ---- Row sums (quad, then both warpgroups at 512, in a fixed order) and O / S.
    float lt[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        float l = l_run[hh];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        lt[hh] = l;
    }
    if constexpr (C::G > 1) {
        __syncthreads();  // every reader of the last maxima is past them
        if (tig == 0) {
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) st_shared_f32(s_red + (u32)((wgi * 64 + wq * 16 + hh * 8 + g8) * 4), lt[hh]);
        }
        __syncthreads();
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const u32 off = (u32)((wq * 16 + hh * 8 + g8) * 4);
            lt[hh] = ld_shared_f32(s_red + off) + ld_shared_f32(s_red + 64 * 4 + off);
        }
    }
    const bool out_al = (L.flags & FLAG_OUT_ALIGNED) != 0;
    const int wd0 = ch * C::DW;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int r = q0 + hh * 8 + g8;
        if (r >= lq) continue;
        const float inv = lt[hh] > 0.f ? 1.f / lt[hh] : 0.f;
        const i64 dst = sq.o + (i64)r * p.o_row_stride + (i64)head * p.o_head_stride + wd0 + tig * 2;
#pragma unroll
        for (int nb = 0; nb < C::DW / 8; ++nb)
            store_out2(out, p.o_dtype, dst + nb * 8, o[nb * 4 + hh * 2] * inv, o[nb * 4 + hh * 2 + 1] * inv, out_al);
        if ((p.flags & PREFILL_LSE) && ch == 0 && tig == 0)
            lse[sq.lse + (i64)head * p.lse_head_stride + r] = lse_of(m_run[hh], lt[hh]);
    }
}

static_assert(HCfg<256>::SMEM == 230464, "Hopper d256 shared memory changed: update the CUDA backend");
static_assert(HCfg<512>::SMEM == 214592, "Hopper d512 shared memory changed: update the CUDA backend");

}  // namespace hopper
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// The entry points (the origin op's names; the new op launches them too). Parameters: the
// params block, the launch block, Q, K, V, the explicit mask, its table, O, lse,
// cu_seqlens_q, cu_seqlens_k (pointers the flags say are absent are never read).
#define MLXN_ARGS                                                                                          \
    const Params p, const Launch L, const unsigned char* __restrict__ q, const u16* __restrict__ k,         \
        const u16* __restrict__ v, const u16* __restrict__ mask, const u8* __restrict__ blk,               \
        void* __restrict__ out, float* __restrict__ lse, const int* __restrict__ cu_q,                     \
        const int* __restrict__ cu_k
#define MLXN_PASS p, L, q, k, v, mask, blk, out, lse, cu_q, cu_k

extern "C" __global__ void __launch_bounds__(NTHREADS, 1) flash_attn_prefill_tensor_f16_d256(MLXN_ARGS) {
#ifdef MLXN_HOPPER
    hopper::attention<256>(MLXN_PASS);
#else
    attention<256>(MLXN_PASS);
#endif
}

extern "C" __global__ void __launch_bounds__(NTHREADS, 1) flash_attn_prefill_tensor_f16_d512(MLXN_ARGS) {
#ifdef MLXN_HOPPER
    hopper::attention<512>(MLXN_PASS);
#else
    attention<512>(MLXN_PASS);
#endif
}

#ifdef MLXN_HOPPER
// The CTA-pair forms (`hopper::attention<D, PAIR_HEADS | PAIR_QUERIES>`), launched in
// clusters of two along y (heads) or x (query tiles). K and V come through tensor maps
// (4-d: head dim, KV heads, cache rows, sequences; boxes of 64 x 1 x 64 x 1 with the
// 128-byte swizzle), made by the host when the strides allow it.
#define MLXN_PAIR_ENTRY(NAME, DIM, MODE, CX, CY)                                                            \
    extern "C" __global__ void __cluster_dims__(CX, CY, 1) __launch_bounds__(NTHREADS, 1)                 \
    NAME(MLXN_ARGS, const __grid_constant__ hopper::TMap kmap, const __grid_constant__ hopper::TMap vmap) { \
        hopper::attention<DIM, MODE>(MLXN_PASS, &kmap, &vmap);                                              \
    }
MLXN_PAIR_ENTRY(flash_attn_prefill_tensor_f16_d256_pair_heads, 256, PAIR_HEADS, 1, 2)
MLXN_PAIR_ENTRY(flash_attn_prefill_tensor_f16_d256_pair_queries, 256, PAIR_QUERIES, 2, 1)
MLXN_PAIR_ENTRY(flash_attn_prefill_tensor_f16_d512_pair_heads, 512, PAIR_HEADS, 1, 2)
MLXN_PAIR_ENTRY(flash_attn_prefill_tensor_f16_d512_pair_queries, 512, PAIR_QUERIES, 2, 1)
#endif

// Shared memory of one CTA, for the host (kept in step with Cfg by a compile-time check).
static_assert(Cfg<256>::SMEM == 164896, "d256 shared memory changed: update the CUDA backend");
static_assert(Cfg<512>::SMEM == 214048, "d512 shared memory changed: update the CUDA backend");
