// Part of shaders/flash_attn_prefill_tensor.cu: the portable form (sm_80 and later; mma.sync).
#pragma once

#include "flash_attn_prefill/epilogue.cuh"
#include "flash_attn_prefill/loaders.cuh"
#include "flash_attn_prefill/softmax.cuh"

// ------------------------------------------------------------------ the kernel

// The CTA's shape for Q/K head dim DK and V/O head dim DV: G warps per row group of 32
// query rows, each taking DW of the O columns and JW of a step's score columns. V's
// columns are padded to DVP = G * DW (the padded columns of O are computed and never
// stored); shared rows are padded to whole swizzle groups of 64 elements (SW_K, SW_V).
//   DV 64: G 1 (DW 64); 80, 96: 2 (48, DVP 96); 112, 128: 2 (64, DVP 128); 192: 2 (96);
//   256: 2 (128); 512: 4 (128).
template <int DK, int DV>
struct Cfg {
    static constexpr int G = DV <= 64 ? 1 : (DV <= 256 ? 2 : 4);  // warps per row group
    static constexpr int DVP = DV <= 64 ? 64 : (DV <= 96 ? 96 : (DV <= 128 ? 128 : DV));
    static constexpr int DW = DVP / G;          // O columns of a warp
    static constexpr int RG = NWARPS / G;       // row groups
    static constexpr int ROWS = RG * 32;        // (query, head) rows of a CTA
    static constexpr int JW = STEP / G;         // score columns of a warp
    static constexpr int NB = JW / 8;           // n-blocks of S per m-tile
    static constexpr int KL = JW / 16;          // 16-column k-chunks of P a warp produces
    static constexpr int SW_K = (DK + 63) / 64 * 64;   // shared row of Q and K, elements
    static constexpr int SW_V = (DVP + 63) / 64 * 64;  // shared row of V
    static constexpr int BQ = DK <= 256 ? 32 : 16;     // query rows per blk table row
    static_assert(DW % 16 == 0 && DK % 16 == 0 && DV % 16 == 0, "whole 16-column k-chunks and n-pairs");
    // Shared memory, bytes.
    static constexpr int Q_BYTES = ROWS * SW_K * 2;
    static constexpr int K_BYTES = STEP * SW_K * 2;
    static constexpr int V_BYTES = STEP * SW_V * 2;
    static constexpr int MASK_BYTES = ROWS * STEP * 2;
    static constexpr int P_BYTES = NWARPS * 2 * KL * 32 * 16;
    static constexpr int RED_BYTES = NWARPS * 32 * 4;
    // The sequence's mask, output and lse offsets, kept here rather than in registers
    // through the walk (the d256 form has none to spare).
    static constexpr int SEQ_BYTES = 32;
    static constexpr int SMEM = Q_BYTES + K_BYTES + V_BYTES + MASK_BYTES + P_BYTES + RED_BYTES + SEQ_BYTES;
};

// T: the products' element type (ElemF16, ElemBF16). XF: the form with SPEC 10's score
// transforms (softcap, ALiBi), a separate instantiation: at 256 and 512 the form without
// them fills the register file exactly, and a branch left in it makes it spill.
// In the paged module (MLXN_PAGED_ENTRIES; the entries NAME_paged and NAME_xf_paged) K/V
// are read through the launch block's table (SPEC 11): a module of its own, so that the
// contiguous entries compile as before (a runtime branch between the loaders cost d256 its
// last registers: it spilled).
template <int DK, int DV, class T, bool XF>
__device__ __forceinline__ void attention(const Params& p, const Launch& L, const unsigned char* __restrict__ q,
                                          const u16* __restrict__ k, const u16* __restrict__ v,
                                          const u16* __restrict__ mask, const u8* __restrict__ blk,
                                          void* __restrict__ out, float* __restrict__ lse,
                                          const int* __restrict__ cu_q, const int* __restrict__ cu_k,
                                          const float* __restrict__ sinks) {
    typedef Cfg<DK, DV> C;
    extern __shared__ __align__(128) unsigned char smem[];
    const u32 s_q = smem_addr(smem);
    const u32 s_k = s_q + C::Q_BYTES;
    const u32 s_v = s_k + C::K_BYTES;
    const u32 s_mask = s_v + C::V_BYTES;
    const u32 s_p = s_mask + C::MASK_BYTES;
    const u32 s_red = s_p + C::P_BYTES;
    const u32 s_seq = s_red + C::RED_BYTES;  // the sequence's mask, out and lse offsets (i64)

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g8 = lane >> 2, tig = lane & 3;  // mma fragment row and column pair
    const int l7 = lane & 7;
    const int rg = warp / C::G, wg = warp % C::G;
    const int hpc = L.heads_per_cta, qpc = L.queries_per_cta;
#if MLXN_PAGED_ENTRIES
    // Split-KV: this part's out and lse; the length from seqused_k, the rows through the table.
    const Seq sq = with_pages(cta_seq(p, L, cu_q, cu_k), L);
#else
    const Seq sq = cta_seq(p, L, cu_q, cu_k);  // split-KV: this part's out and lse
#endif
    const int lq = sq.lq, lk = sq.lk, off = query_offset(p, L, lq, lk);
    const int qt = (lq + qpc - 1) / qpc - 1 - (int)cta_xy(L).x;  // longest causal rows first
    if (qt < 0) return;  // a shorter sequence than the longest: no rows here (the whole CTA)
    if (tid == 0) {
        st_shared_i64(s_seq, sq.mask);
        st_shared_i64(s_seq + 8, sq.o);
        st_shared_i64(s_seq + 16, sq.lse);
    }
    __syncthreads();  // the offsets are visible to every thread, whether or not a step runs
    const int q_cta = qt * qpc;
    const int head = (int)cta_xy(L).y * hpc + rg % hpc;
    const int q_loc = (rg / hpc) * 32;  // first query of the row group, inside the CTA
    const int q0 = q_cta + q_loc;
    const int group = p.n_heads / p.n_kv_heads;
    const int kvh = ((int)cta_xy(L).y * hpc) / group;

    // ---- Q: qh = T(scale * q), rows past lq zero.
    {
        constexpr int CH = DK / 8;
        for (int i = tid; i < C::ROWS * CH; i += NTHREADS) {
            const int r = i / CH, c = i % CH;
            const int rgi = r >> 5;
            const int qr = q_cta + (rgi / hpc) * 32 + (r & 31);
            const int h = (int)cta_xy(L).y * hpc + rgi % hpc;
            u32 w[4];
            load_q_chunk<T>(w, p, L, sq, q, qr, h, c);
            st_shared_v4(s_q + (u32)(r * C::SW_K * 2) + swz(c, r & 7), w[0], w[1], w[2], w[3]);
        }
    }

    // ---- The steps walked (the description's, and the table's), and the class of each of
    // this warp's two 16-row m-tiles in a step.
    const int q_end = min(q_cta + qpc, lq);
    constexpr int CAP = C::ROWS / C::BQ > 4 ? 8 : 4;
    static_assert(C::ROWS / C::BQ <= CAP, "the table rows a walk can span");
    Walk<CAP> walk;
    typedef typename Walk<CAP>::W TB;  // a step's packed table bytes
    walk.init((p.flags & PREFILL_MASK) ? blk + sq.blk : nullptr, p.blk_steps, C::BQ, q_cta, q_end);
    visible_steps(p, L, lk, off, q_cta, q_end, walk.lo, walk.hi);
    narrow_to_part(L.kv_split_log2, cta_part(L), walk.lo, walk.hi);  // split-KV: this part's share
    const int t_end = walk.hi + 1;
    auto mtile_class = [&](int mt, int t, TB sb, int& table) -> int {
        const int ra = q0 + mt * 16;
        if (ra >= lq) {
            table = 0;
            return 0;
        }
        table = walk.table_byte(ra, sb);
        return combine_class(described_class(p, L, lk, off, ra, min(ra + 16, lq), t), table);
    };
    auto next_active = [&](int t, bool& need_mask, TB& sb) -> int { return walk.next(t, lane, need_mask, sb); };

#if !MLXN_QUANT_ENTRIES
    const u16* k_base = k + sq.k + (i64)kvh * p.k_head_stride;
    const u16* v_base = v + sq.v + (i64)kvh * p.v_head_stride;
#endif
    const bool k_al = (L.flags & FLAG_K_ALIGNED) != 0;
    const bool v_al = (L.flags & FLAG_V_ALIGNED) != 0;
    const bool m_al = (L.flags & FLAG_MASK_ALIGNED) != 0;
    // K and V of step t (paged K/V: the params block's K/V batch strides are the caches'
    // block strides).
#if MLXN_QUANT_ENTRIES
    // Quantised K/V (the quant modules): the bytes widened to F16 in the same layout, K/V's
    // offsets and strides in bytes; K's descale factor multiplies the scores.
    const u8* kq_base = reinterpret_cast<const u8*>(k) + sq.k + (i64)kvh * p.k_head_stride;
    const u8* vq_base = reinterpret_cast<const u8*>(v) + sq.v + (i64)kvh * p.v_head_stride;
    const float kd = kdescale(p, L, kvh);
    auto load_k = [&](int t) {
        auto chunk = [](int r, int c) -> u32 { return (u32)(r * C::SW_K * 2) + swz(c, r & 7); };
#if MLXN_PAGED_ENTRIES
        load_rows_quant<DK>(s_k, chunk, kq_base, L, p.k_batch_stride, p.k_row_stride, t * STEP, lk - t * STEP,
                            p.kv_dtype, k_al);
#else
        load_rows_quant<DK>(s_k, chunk, kq_base + (i64)t * STEP * p.k_row_stride, L, 0, p.k_row_stride, 0,
                            lk - t * STEP, p.kv_dtype, k_al);
#endif
    };
    auto load_v = [&](int t) {
        auto chunk = [](int r, int c) -> u32 { return (u32)(r * C::SW_V * 2) + swz(c, r & 7); };
#if MLXN_PAGED_ENTRIES
        load_rows_quant<DV>(s_v, chunk, vq_base, L, p.v_batch_stride, p.v_row_stride, t * STEP, lk - t * STEP,
                            p.kv_dtype, v_al);
#else
        load_rows_quant<DV>(s_v, chunk, vq_base + (i64)t * STEP * p.v_row_stride, L, 0, p.v_row_stride, 0,
                            lk - t * STEP, p.kv_dtype, v_al);
#endif
    };
#else
    auto load_k = [&](int t) {
#if MLXN_PAGED_ENTRIES
        load_rows_f16_paged<DK, C::SW_K>(s_k, k_base, L, p.k_batch_stride, p.k_row_stride, t * STEP, lk - t * STEP,
                                         k_al);
#else
        load_rows_f16<DK, C::SW_K>(s_k, k_base + (i64)t * STEP * p.k_row_stride, p.k_row_stride, lk - t * STEP, k_al);
#endif
    };
    auto load_v = [&](int t) {
#if MLXN_PAGED_ENTRIES
        load_rows_f16_paged<DV, C::SW_V>(s_v, v_base, L, p.v_batch_stride, p.v_row_stride, t * STEP, lk - t * STEP,
                                         v_al);
#else
        load_rows_f16<DV, C::SW_V>(s_v, v_base + (i64)t * STEP * p.v_row_stride, p.v_row_stride, lk - t * STEP, v_al);
#endif
    };
#endif

    // ---- State: O (32 rows x DW columns), running max and partial sums of 4 rows.
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
    for (int mt = 0; mt < 2; ++mt) q_row[mt] = s_q + (u32)((rg * 32 + mt * 16 + (lane & 15)) * C::SW_K * 2);
    const Swz4 q_sw(lane >> 4, l7);       // A: chunk +1 for lanes 16..31
    u32 k_row[C::JW / 16];
#pragma unroll
    for (int jb = 0; jb < C::JW / 16; ++jb)
        k_row[jb] = s_k + (u32)((wj0 + jb * 16 + l7 + ((lane >> 4) << 3)) * C::SW_K * 2);
    const Swz4 k_sw((lane >> 3) & 1, l7); // B (K): chunk +1 for lanes 8..15, 24..31
    const int v_r = l7 + (((lane >> 3) & 1) << 3);  // B (V^T): row within a 16-row k-chunk
    // B (V^T): chunk +1 for lanes 16..31, from the warp's first column wd0 / 8. Where that
    // is a multiple of 8 (DW a multiple of 64) it has no swizzle bits: A's bases serve, and
    // the column is a byte offset (four registers fewer where d256 has none to spare).
    const Swz4 v_sw_shifted(lane >> 4, l7, wd0 / 8);
    const Swz4& v_sw = C::DW % 64 == 0 ? q_sw : v_sw_shifted;
    const u32 v_col = C::DW % 64 == 0 ? (u32)(wd0 * 2) : 0u;
    const u32 red_me = s_red + (u32)(warp * 32 * 4);
    const u32 red_group = s_red + (u32)(rg * C::G * 32 * 4);
    const u32 p_group = s_p + (u32)(rg * C::G * 2 * C::KL * 32 * 16);
    const u32 p_me = s_p + (u32)(warp * 2 * C::KL * 32 * 16);

    bool need_mask = false;
    TB sb = 0;  // step t's table bytes
    int t = next_active(-1, need_mask, sb);
    if (t < t_end) {
        load_k(t);
        if (need_mask) load_mask_tile(s_mask, mask + sq.mask, p, lq, lk, q_cta, qpc, t, m_al);
        cp_async_commit();
    }

    while (t < t_end) {
        cp_async_wait_all();
        __syncthreads();  // K_t and the mask tile are in; V is free (every P V of t-1 done)
        load_v(t);
        cp_async_commit();

        int tb0, tb1;
        const int b0 = mtile_class(0, t, sb, tb0);
        const int b1 = mtile_class(1, t, sb, tb1);
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
            for (int kc = 0; kc < DK / 16; ++kc) {
                u32 a[2][4];
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) ldsm_x4(a[mt], q_row[mt] + q_sw.at(kc));
#pragma unroll
                for (int jb = 0; jb < C::JW / 16; ++jb) {
                    u32 b[4];
                    ldsm_x4(b, k_row[jb] + k_sw.at(kc));
#pragma unroll
                    for (int mt = 0; mt < 2; ++mt) {
                        T::mma(s[mt][jb * 2], a[mt], b[0], b[1]);
                        T::mma(s[mt][jb * 2 + 1], a[mt], b[2], b[3]);
                    }
                }
            }

#if MLXN_QUANT_ENTRIES
            // SPEC 11: K's value is descale * x; the products took x.
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int nb = 0; nb < C::NB; ++nb)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[mt][nb][e] *= kd;
#endif
            if (XF && p.softcap > 0.f) {
                const float inv = 1.f / p.softcap;
#pragma unroll
                for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                    for (int nb = 0; nb < C::NB; ++nb)
#pragma unroll
                        for (int e = 0; e < 4; ++e) s[mt][nb][e] = softcap_score(s[mt][nb][e], p.softcap, inv);
            }

            // ---- ALiBi (SPEC 10), in passes around the class pass below, which stays as it is
            // without it. By distance (slopes given as data, or max_bias without an explicit
            // mask): s - slope * |j - p_r| before it, on every computed pair (the class pass
            // then hides the pairs not visible, whatever the bias made them). max_bias on an
            // explicit mask: s + slope * mask = slope * (s / slope + mask).
            if (XF && ((p.flags & PREFILL_ALIBI_SLOPES) || alibi_by_distance(p))) {
                const float slope =
                    (p.flags & PREFILL_ALIBI_SLOPES) ? alibi_given_slope(p, L, head) : alibi_slope(p, head);
                // j - p_r of this thread's first pair, row q_loc + g8 (rows +8 and +16 follow).
                const int d0 = alibi_d0(L, t * STEP, wj0, tig, q_cta, q_loc, g8, off);
#pragma unroll
                for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                    for (int nb = 0; nb < C::NB; ++nb)
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            s[mt][nb][e] += alibi_bias(slope, (float)(d0 + nb * 8 + (e & 1) - mt * 16 - (e >> 1) * 8));
            }
            if (XF && p.max_bias > 0.f && (p.flags & PREFILL_MASK)) {
                const float inv = 1.f / alibi_slope(p, head);
#pragma unroll
                for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                    for (int nb = 0; nb < C::NB; ++nb)
#pragma unroll
                        for (int e = 0; e < 4; ++e) s[mt][nb][e] *= inv;
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
                        visible_range(p, L, lk, off, q_cta + rr, vlo, vhi);
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
            if (XF && p.max_bias > 0.f && (p.flags & PREFILL_MASK)) {
                const float slope = alibi_slope(p, head);
#pragma unroll
                for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                    for (int nb = 0; nb < C::NB; ++nb)
#pragma unroll
                        for (int e = 0; e < 4; ++e) s[mt][nb][e] *= slope;
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
                for (int hh = 0; hh < 2; ++hh) any_rescale |= softmax_rescale(mx[mt][hh], m_run[mt][hh], ms[mt][hh]);
            u32 pk[2][C::NB][2];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const float mr = m_run[mt][hh];
                    float sum = 0.f;
#pragma unroll
                    for (int nb = 0; nb < C::NB; ++nb) pk[mt][nb][hh] = softmax_p2<T>(s[mt][nb][hh * 2], s[mt][nb][hh * 2 + 1], mr, sum);
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
        TB sbn;
        const int tn = next_active(t, need_mask_next, sbn);
        cp_async_wait_all();
        __syncthreads();  // V_t is in, P of the step is visible, K and the mask tile are free
        if (tn < t_end) {
            load_k(tn);
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
                const u32 vrow = s_v + (u32)(v_r * C::SW_V * 2) + v_col + (u32)(kc * 16 * C::SW_V * 2);
#pragma unroll
                for (int dp = 0; dp < C::DW / 16; ++dp) {
                    u32 b[4];
                    ldsm_x4_trans(b, vrow + v_sw.at(dp));
#pragma unroll
                    for (int mt = 0; mt < 2; ++mt) {
                        T::mma(o[mt][dp * 2], a[mt], b[0], b[1]);
                        T::mma(o[mt][dp * 2 + 1], a[mt], b[2], b[3]);
                    }
                }
            }
        }
        t = tn;
        sb = sbn;
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
            float o_scale;
            softmax_sink(p, sinks, head, m_run[mt][hh], lt[mt][hh], o_scale);
#if MLXN_QUANT_ENTRIES
            const float inv = lt[mt][hh] > 0.f ? o_scale / lt[mt][hh] * vdescale(p, L, kvh) : 0.f;  // V's factor
#else
            const float inv = lt[mt][hh] > 0.f ? o_scale / lt[mt][hh] : 0.f;
#endif
            const i64 dst = o_seq + (i64)r * p.o_row_stride + (i64)head * p.o_head_stride + wd0 + tig * 2;
#pragma unroll
            for (int nb = 0; nb < C::DW / 8; ++nb)
                if (C::DVP == DV || wd0 + nb * 8 < DV)  // the padded columns are not O's
                    store_out2(out, p.o_dtype, dst + nb * 8, o[mt][nb][hh * 2] * inv, o[mt][nb][hh * 2 + 1] * inv, out_al);
            if ((p.flags & PREFILL_LSE) && wg == 0 && tig == 0)
                lse[lse_seq + (i64)head * p.lse_head_stride + r] = lse_of(m_run[mt][hh], lt[mt][hh]);
        }
}
