// CUDA form of flash_attn_prefill_tensor_f16_d256 / _d512 (SPEC section 2).
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
// The tile-skip table is the standard one (bq = 32 at 256, 16 at 512). A warp reads the
// byte of each of its two 16-row m-tiles: 0 skips (the whole row group skips the step
// when both are 0; an m-tile alone gets -inf scores, which changes no bit), 2 computes
// without the mask, 1 adds the mask. The CTA loads a step's K/V only if some byte of its
// query rows is non-zero, and its mask tile only if some byte is 1.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;

#define NWARPS 8
#define NTHREADS 256
#define STEP 64

// Mirror of the op's params block (twelve 32-bit words).
struct Params {
    int rows, n_heads, n_kv_heads, kv_pad;
    int q_row_stride, q_head_stride;
    int k_row_stride, k_head_stride;
    int v_row_stride, v_head_stride;
    int mask_row_stride;
    float scale;
};

// What the CUDA backend adds: the CTA geometry it chose and the alignment of the buffers.
struct Launch {
    int heads_per_cta;
    int queries_per_cta;
    int q_tiles;
    int flags;
};

#define FLAG_Q_ALIGNED 1     // Q base 16-byte aligned (strides are multiples of 4 floats)
#define FLAG_K_ALIGNED 2     // K base and strides 16-byte aligned
#define FLAG_V_ALIGNED 4     // V base and strides 16-byte aligned
#define FLAG_MASK_ALIGNED 8  // mask base 16-byte aligned (rows are 128-byte multiples)
#define FLAG_OUT_ALIGNED 16  // out base 8-byte aligned

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

// ------------------------------------------------------------------ tile loads

// `nrows` rows of `D` halves at `src + row * row_stride` into shared memory (swizzled,
// D * 2 bytes per row). Asynchronous when the rows are 16-byte aligned, else synchronous.
template <int D>
__device__ __forceinline__ void load_rows_f16(u32 dst, const u16* __restrict__ src, i64 row_stride, int nrows,
                                              bool aligned) {
    constexpr int CH = D / 8;
    const int total = nrows * CH;
    for (int i = threadIdx.x; i < total; i += NTHREADS) {
        const int r = i / CH, c = i % CH;
        const u16* s = src + (i64)r * row_stride + c * 8;
        const u32 d = dst + (u32)(r * D * 2) + swz(c, r & 7);
        if (aligned) {
            cp_async16(d, s, 16);
        } else {
            u32 w[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) w[e] = (u32)s[2 * e] | ((u32)s[2 * e + 1] << 16);
            st_shared_v4(d, w[0], w[1], w[2], w[3]);
        }
    }
}

// The mask tile of cache step `t` for the CTA's `qpc` query rows: [qpc][64] halves,
// 128 bytes per row, swizzled. Rows at or past `rows` are zeros and are never read.
__device__ __forceinline__ void load_mask_tile(u32 dst, const u16* __restrict__ mask, const Params& p, int q_cta,
                                               int qpc, int t, bool aligned) {
    const int total = qpc * 8;
    for (int i = threadIdx.x; i < total; i += NTHREADS) {
        const int r = i >> 3, c = i & 7;
        const int qr = q_cta + r;
        const u32 d = dst + (u32)(r * 128) + swz(c, r & 7);
        const bool in = qr < p.rows;
        const u16* s = mask + (in ? (i64)qr * p.mask_row_stride + (i64)t * STEP + c * 8 : 0);
        if (aligned) {
            cp_async16(d, s, in ? 16u : 0u);
        } else {
            u32 w[4] = {0u, 0u, 0u, 0u};
            if (in) {
#pragma unroll
                for (int e = 0; e < 4; ++e) w[e] = (u32)s[2 * e] | ((u32)s[2 * e + 1] << 16);
            }
            st_shared_v4(d, w[0], w[1], w[2], w[3]);
        }
    }
}

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
    static constexpr int SMEM = Q_BYTES + 2 * KV_BYTES + MASK_BYTES + P_BYTES + RED_BYTES;
};

template <int D>
__device__ __forceinline__ void attention(const Params& p, const Launch& L, const float* __restrict__ q,
                                          const u16* __restrict__ k, const u16* __restrict__ v,
                                          const u16* __restrict__ mask, const u8* __restrict__ blk,
                                          float* __restrict__ out) {
    typedef Cfg<D> C;
    extern __shared__ __align__(128) unsigned char smem[];
    const u32 s_q = smem_addr(smem);
    const u32 s_k = s_q + C::Q_BYTES;
    const u32 s_v = s_k + C::KV_BYTES;
    const u32 s_mask = s_v + C::KV_BYTES;
    const u32 s_p = s_mask + C::MASK_BYTES;
    const u32 s_red = s_p + C::P_BYTES;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g8 = lane >> 2, tig = lane & 3;  // mma fragment row and column pair
    const int l7 = lane & 7;
    const int rg = warp / C::G, wg = warp % C::G;
    const int hpc = L.heads_per_cta, qpc = L.queries_per_cta;
    const int qt = L.q_tiles - 1 - (int)blockIdx.x;  // longest causal rows first
    const int q_cta = qt * qpc;
    const int head = (int)blockIdx.y * hpc + rg % hpc;
    const int q_loc = (rg / hpc) * 32;  // first query of the row group, inside the CTA
    const int q0 = q_cta + q_loc;
    const int group = p.n_heads / p.n_kv_heads;
    const int kvh = ((int)blockIdx.y * hpc) / group;
    const int steps = p.kv_pad / STEP;
    const int rows = p.rows;

    // ---- Q: qh = half(scale * q), rows past `rows` zero.
    {
        constexpr int CH = D / 8;
        for (int i = tid; i < C::ROWS * CH; i += NTHREADS) {
            const int r = i / CH, c = i % CH;
            const int rgi = r >> 5;
            const int qr = q_cta + (rgi / hpc) * 32 + (r & 31);
            const int h = (int)blockIdx.y * hpc + rgi % hpc;
            u32 w[4] = {0u, 0u, 0u, 0u};
            if (qr < rows) {
                const float* s = q + (i64)qr * p.q_row_stride + (i64)h * p.q_head_stride + c * 8;
                float f[8];
                if (L.flags & FLAG_Q_ALIGNED) {
                    const float4 a = *reinterpret_cast<const float4*>(s);
                    const float4 b = *reinterpret_cast<const float4*>(s + 4);
                    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
                    f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
                } else {
#pragma unroll
                    for (int e = 0; e < 8; ++e) f[e] = s[e];
                }
#pragma unroll
                for (int e = 0; e < 4; ++e) w[e] = pack_half2(p.scale * f[2 * e], p.scale * f[2 * e + 1]);
            }
            st_shared_v4(s_q + (u32)(r * D * 2) + swz(c, r & 7), w[0], w[1], w[2], w[3]);
        }
    }

    // ---- The blk table rows of the CTA's queries, and of this warp's two m-tiles.
    const int q_end = min(q_cta + qpc, rows);  // q_cta < rows: the grid has no empty tile
    const int tr_first = q_cta / C::BQ, tr_last = (q_end - 1) / C::BQ;
    const i64 tr_m0 = (q0 < rows) ? (i64)(q0 / C::BQ) * steps : -1;
    const i64 tr_m1 = (q0 + 16 < rows) ? (i64)((q0 + 16) / C::BQ) * steps : -1;

    // The next step after `t` that some row of the CTA computes (steps if none), and
    // whether some row needs its mask. Each lane looks at one step of a 32-step window.
    auto next_active = [&](int t, bool& need_mask) -> int {
        for (int base = t + 1; base < steps; base += 32) {
            const int s = base + lane;
            bool act = false, nm = false;
            if (s < steps) {
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
        need_mask = false;
        return steps;
    };

    const u16* k_base = k + (i64)kvh * p.k_head_stride;
    const u16* v_base = v + (i64)kvh * p.v_head_stride;
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
    if (t < steps) {
        load_rows_f16<D>(s_k, k_base + (i64)t * STEP * p.k_row_stride, p.k_row_stride, STEP, k_al);
        if (need_mask) load_mask_tile(s_mask, mask, p, q_cta, qpc, t, m_al);
        cp_async_commit();
    }

    while (t < steps) {
        cp_async_wait_all();
        __syncthreads();  // K_t and the mask tile are in; V is free (every P V of t-1 done)
        load_rows_f16<D>(s_v, v_base + (i64)t * STEP * p.v_row_stride, p.v_row_stride, STEP, v_al);
        cp_async_commit();

        const int b0 = tr_m0 >= 0 ? (int)blk[tr_m0 + t] : 0;
        const int b1 = tr_m1 >= 0 ? (int)blk[tr_m1 + t] : 0;
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

            // ---- Mask (byte 1), or -inf for an m-tile whose byte is 0.
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                const int bm = mt == 0 ? b0 : b1;
                if (bm == 1) {
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        const int rr = q_loc + mt * 16 + hh * 8 + g8;  // row of the mask tile
                        const u32 row_addr = s_mask + (u32)(rr * 128) + (u32)(tig * 4);
#pragma unroll
                        for (int nb = 0; nb < C::NB; ++nb) {
                            const u32 w = ld_shared_u32(row_addr + swz(wj0 / 8 + nb, g8));
                            float lo, hi;
                            unpack_half2(w, lo, hi);
                            s[mt][nb][hh * 2] += lo;
                            s[mt][nb][hh * 2 + 1] += hi;
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
        if (tn < steps) {
            load_rows_f16<D>(s_k, k_base + (i64)tn * STEP * p.k_row_stride, p.k_row_stride, STEP, k_al);
            if (need_mask_next) load_mask_tile(s_mask, mask, p, q_cta, qpc, tn, m_al);
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
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = q0 + mt * 16 + hh * 8 + g8;
            if (r >= rows) continue;
            const float inv = lt[mt][hh] > 0.f ? 1.f / lt[mt][hh] : 0.f;
            float* dst = out + ((i64)r * p.n_heads + head) * D + wd0 + tig * 2;
#pragma unroll
            for (int nb = 0; nb < C::DW / 8; ++nb) {
                const float x0 = o[mt][nb][hh * 2] * inv, x1 = o[mt][nb][hh * 2 + 1] * inv;
                if (out_al) {
                    *reinterpret_cast<float2*>(dst + nb * 8) = make_float2(x0, x1);
                } else {
                    dst[nb * 8] = x0;
                    dst[nb * 8 + 1] = x1;
                }
            }
        }
}

extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
flash_attn_prefill_tensor_f16_d256(const Params p, const Launch L, const float* __restrict__ q,
                                   const u16* __restrict__ k, const u16* __restrict__ v,
                                   const u16* __restrict__ mask, const u8* __restrict__ blk,
                                   float* __restrict__ out) {
    attention<256>(p, L, q, k, v, mask, blk, out);
}

extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
flash_attn_prefill_tensor_f16_d512(const Params p, const Launch L, const float* __restrict__ q,
                                   const u16* __restrict__ k, const u16* __restrict__ v,
                                   const u16* __restrict__ mask, const u8* __restrict__ blk,
                                   float* __restrict__ out) {
    attention<512>(p, L, q, k, v, mask, blk, out);
}

// Shared memory of one CTA, for the host (kept in step with Cfg by a compile-time check).
static_assert(Cfg<256>::SMEM == 164864, "d256 shared memory changed: update the CUDA backend");
static_assert(Cfg<512>::SMEM == 214016, "d512 shared memory changed: update the CUDA backend");
