// Part of shaders/flash_attn_prefill_tensor.cu (Hopper form, pipeline_sm90.cuh): a consumer
// thread's work on the scores of one tile of NH 64-row steps, once its Q K^T is in: SPEC 10's
// softcap, ALiBi's slopes given as data, each step's class (-inf where nothing is visible,
// visibility, the explicit mask and max_bias's ALiBi where the class is 1), the row maxima,
// the lazy rescale and P in registers with the row sums (SPEC 2, steps 4 and 5). O's
// rescale is the caller's (rescale_o), at the point where O is not on the tensor cores.
//
// Scores: a warpgroup's m64nN accumulator, this thread's part: rows g8 and g8 + 8 of its
// warp's 16, columns nb * 8 + tig * 2 + {0, 1} of each 8-column block nb, at
// s[nb * 4 + hh * 2 + {0, 1}] (hh: the row). Step h of the tile is blocks h * 8 .. h * 8 + 7.
#pragma once

#include "flash_attn_prefill/softmax.cuh"
#include "flash_attn_prefill/tile_walk.cuh"

namespace hopper {

// What a consumer thread's masks need of its rows, the same for the whole walk.
struct RowGeom {
    int q_loc;  // the warp's first query inside the CTA (a multiple of 16)
    int q_cta;  // the CTA's first query of the sequence
    int lk, off, head;
    int g8, tig;       // the thread's rows (g8, g8 + 8) and column pair (tig) in an 8 x 8 block
    bool by_distance;  // ALiBi by distance (softmax.cuh)
#if MLXN_QUANT_ENTRIES
    float kd = 1.f;  // quantised K's descale factor (quant_pipe.cuh): the scores' first factor
#endif
};

// Step H of a tile (cache step t, this warp's class cls and table byte tb; its mask tile at
// m_tile, [queries][64] halves, swizzled) applied to the scores: class 0, -inf; class 1,
// -inf where a pair is not visible, else the mask times ALiBi's slope (table byte 1) or
// ALiBi's distance bias; class 2, nothing.
template <int H, int NS>
__device__ __forceinline__ void mask_step(float (&s)[NS], int cls, int tb, int t, u32 m_tile, const RowGeom& g,
                                          const Params& p, const Launch& L) {
    const float ninf = -__int_as_float(0x7f800000);
    if (cls == 0) {
#pragma unroll
        // fminf(s, -inf) is -inf, and keeps the scores in their registers: a plain -inf
        // store let ptxas build the class-0 values before the branch, in other registers,
        // and copy all 32 scores there on the common path (two moves a score, every tile).
        for (int i = 0; i < 32; ++i) s[H * 32 + i] = fminf(s[H * 32 + i], ninf);
        return;
    }
    if (cls != 1) return;
    const float slope = alibi_slope(p, g.head);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int rr = g.q_loc + hh * 8 + g.g8;  // the row's query inside the CTA (its mask row)
        const u32 row_addr = m_tile + (u32)(rr * 128) + (u32)(g.tig * 4);
        // The row's visible columns, relative to this thread's first one of the step.
        int vlo, vhi;
        visible_range(p, L, g.lk, g.off, g.q_cta + rr, vlo, vhi);
        const int j0 = t * STEP + g.tig * 2;
        vlo -= j0;
        vhi -= j0;
        const float d0 = (float)(j0 - (g.q_cta + rr + g.off - L.window_right));  // j0 - p_r
#pragma unroll
        for (int nb = 0; nb < 8; ++nb) {
            float lo = 0.f, hi = 0.f;
            if (tb == 1) {
                unpack_half2(ld_shared_u32(row_addr + swz(nb, g.g8)), lo, hi);
                lo *= slope;
                hi *= slope;
            } else if (g.by_distance) {
                lo = slope * (d0 + (float)(nb * 8));
                hi = slope * (d0 + (float)(nb * 8 + 1));
            }
            const int j = nb * 8, i = (H * 8 + nb) * 4 + hh * 2;
            s[i] = (j >= vlo && j <= vhi) ? s[i] + lo : ninf;
            s[i + 1] = (j + 1 >= vlo && j + 1 <= vhi) ? s[i + 1] + hi : ninf;
        }
    }
}

// Steps H .. NH - 1 of tile u (mask tiles of the stage from m_stage, MASK_BYTES apart).
template <int H, int NH, int MASK_BYTES, int NS>
__device__ __forceinline__ void mask_steps(float (&s)[NS], const TileClasses<NH>& tc, int u, u32 m_stage,
                                           const RowGeom& g, const Params& p, const Launch& L) {
    mask_step<H>(s, tc.cls[H], tc.table[H], u * NH + H, m_stage + (u32)(H * MASK_BYTES), g, p, L);
    if constexpr (H + 1 < NH) mask_steps<H + 1, NH, MASK_BYTES>(s, tc, u, m_stage, g, p, L);
}

// Timing variants of the softmax (docs/benchmarks.md, 2026-12-07): MLXN_ROWMAX_CHAINS, the
// independent chains of each row's maximum (1: one chain of NS / 4 dependent maxima, as
// before; 4: four chains of NS / 16, then two levels; the maximum is exact in any order, so
// every bit stays); MLXN_SUM_UNROUNDED 1 sums P before its rounding to T (a variant that
// leaves SPEC 2 step 5, to measure what the sums of the rounded values cost: one conversion
// of each value back to f32).
#ifndef MLXN_ROWMAX_CHAINS
#define MLXN_ROWMAX_CHAINS 1
#endif
#ifndef MLXN_SUM_UNROUNDED
#define MLXN_SUM_UNROUNDED 0
#endif
// The independent chains of each row's sum (1: the pairs added in column order, as before;
// 2 or 4: round robin over the chains, then added in pairs): the same rounded values in
// another order, so the sums' last bits may change (SPEC 2 leaves the order open; the
// one-CTA forms keep column order, so pair and one-CTA forms then differ in those bits).
// The exponentials of every MLXN_EXP2_POLY_EVERY-th 8-column block (the last of each group)
// on the FMA pipe (common.cuh, exp2_poly), the rest on the SFU; 0: all on the SFU. Lost
// (docs/benchmarks.md, 2026-12-07 10:30 UTC): every 8th 0.93x-0.97x, every 4th 0.87x-0.93x;
// the SFU's throughput is not what the softmax waits on, its instructions are.
#ifndef MLXN_EXP2_POLY_EVERY
#define MLXN_EXP2_POLY_EVERY 0
#endif
#ifndef MLXN_SUM_CHAINS
#define MLXN_SUM_CHAINS 1
#endif

// The maxima of this thread's two rows over the tile, across the quad that holds them.
template <int NS>
__device__ __forceinline__ void tile_row_max(const float (&s)[NS], float (&mx)[2]) {
    constexpr int C = MLXN_ROWMAX_CHAINS;
    static_assert(C == 1 || C == 2 || C == 4, "one, two or four chains");
    static_assert((NS / 4) % C == 0, "the 8-column blocks split evenly over the chains");
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        float c[C];
#pragma unroll
        for (int k = 0; k < C; ++k) c[k] = fmaxf(s[k * 4 + hh * 2], s[k * 4 + hh * 2 + 1]);
#pragma unroll
        for (int nb = C; nb < NS / 4; ++nb) c[nb % C] = fmaxf(c[nb % C], fmaxf(s[nb * 4 + hh * 2], s[nb * 4 + hh * 2 + 1]));
        float m = c[0];
        if constexpr (C == 2) m = fmaxf(c[0], c[1]);
        if constexpr (C == 4) m = fmaxf(fmaxf(c[0], c[1]), fmaxf(c[2], c[3]));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        mx[hh] = m;
    }
}

// The lazy rescale of both rows (the factors in ms), P = T(exp(s - M)) and, where SUM, the
// row sums of the rounded P (SPEC 2 step 5: the sums are of the values rounded to T; without
// SUM the tensor cores sum P beside P V, pipeline_sm90.cuh), each pair of P handed to `put`
// packed and as its two floats. Returns whether a row of the warp rescaled (then O must be
// scaled by ms before this tile's P V adds to it).
template <class T, bool SUM, int NS, class Put>
__device__ __forceinline__ bool tile_exp_each(const float (&s)[NS], const float (&mx)[2], float (&m_run)[2],
                                              float (&l_run)[2], float (&ms)[2], Put put) {
    bool any = false;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) any |= softmax_rescale(mx[hh], m_run[hh], ms[hh]);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const float ml = m_run[hh] * LOG2E;  // the same for every pair of the row
        constexpr int SC = MLXN_SUM_CHAINS;
        static_assert(SC == 1 || SC == 2 || SC == 4, "one, two or four chains");
        float sums[SC];
#pragma unroll
        for (int k = 0; k < SC; ++k) sums[k] = 0.f;
#pragma unroll
        for (int nb = 0; nb < NS / 4; ++nb) {
            float& sum = sums[nb % SC];
            const int i = nb * 4 + hh * 2;
            constexpr int PE = MLXN_EXP2_POLY_EVERY;
            const float x0 = fmaf(s[i], LOG2E, -ml), x1 = fmaf(s[i + 1], LOG2E, -ml);
            const bool poly = PE > 0 && nb % (PE > 0 ? PE : 1) == PE - 1;
            const float e0 = poly ? exp2_poly(x0) : exp2_approx(x0), e1 = poly ? exp2_poly(x1) : exp2_approx(x1);
            const u32 pair = T::pack2(e0, e1);
            float a, b;
            T::unpack2(pair, a, b);  // dead where neither put nor the sum reads them
            put(nb, hh, pair, a, b);
            if constexpr (SUM) sum += MLXN_SUM_UNROUNDED ? e0 + e1 : a + b;
        }
        float sum = sums[0];
        if constexpr (SC == 2) sum = sums[0] + sums[1];
        if constexpr (SC == 4) sum = (sums[0] + sums[1]) + (sums[2] + sums[3]);
        if constexpr (SUM) l_run[hh] = l_run[hh] * ms[hh] + sum;
    }
    return __any_sync(0xffffffffu, any);
}

// P left in s, each value rounded to T and kept as a float, for take_p to pack once the last
// tile's P V no longer reads the fragments (the overlap): a second set of P registers made
// the consumers spill at head dim 128, and P packed into the scores' own registers let the
// compiler merge them with the next Q K^T's accumulators.
template <class T, bool SUM, int NS>
__device__ __forceinline__ bool tile_exp(float (&s)[NS], const float (&mx)[2], float (&m_run)[2], float (&l_run)[2],
                                         float (&ms)[2]) {
    return tile_exp_each<T, SUM>(s, mx, m_run, l_run, ms, [&](int nb, int hh, u32, float a, float b) {
        s[nb * 4 + hh * 2] = a;
        s[nb * 4 + hh * 2 + 1] = b;
    });
}

// For a warpgroup whose last P V is done (no overlap): P packed straight into P V's A
// fragments (pk, rows g8 and g8 + 8 (hh) of 8-column block nb), the scores left as they were.
template <class T, bool SUM, int NS>
__device__ __forceinline__ bool tile_exp_packed(const float (&s)[NS], const float (&mx)[2], float (&m_run)[2],
                                                float (&l_run)[2], float (&ms)[2], u32 (&pk)[NS / 4][2]) {
    return tile_exp_each<T, SUM>(s, mx, m_run, l_run, ms,
                            [&](int nb, int hh, u32 pair, float, float) { pk[nb][hh] = pair; });
}

// P of tile_exp as P V's A fragments: rows g8 and g8 + 8 (hh) of 8-column block nb (the
// values are T's already: packing them again is exact).
template <class T, int NS>
__device__ __forceinline__ void take_p(const float (&s)[NS], u32 (&pk)[NS / 4][2]) {
#pragma unroll
    for (int nb = 0; nb < NS / 4; ++nb) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) pk[nb][hh] = T::pack2(s[nb * 4 + hh * 2], s[nb * 4 + hh * 2 + 1]);
    }
}

// A tile's scores made ready for the exponentials: softcap, ALiBi's given slopes, the steps'
// classes and masks; then the rows' maxima into mx.
template <int NH, int MASK_BYTES, int NS>
__device__ __forceinline__ void tile_scores(float (&s)[NS], float (&mx)[2], const TileClasses<NH>& tc, int u,
                                            u32 m_stage, const RowGeom& g, const Params& p, const Launch& L) {
    static_assert(NS == NH * 32, "32 scores a thread per 64-row step");
#if MLXN_QUANT_ENTRIES
#pragma unroll
    for (int i = 0; i < NS; ++i) s[i] *= g.kd;  // SPEC 11: before anything else, as the one-CTA forms
#endif
    if (p.softcap > 0.f) {
        const float inv = 1.f / p.softcap;
#pragma unroll
        for (int i = 0; i < NS; ++i) s[i] = softcap_score(s[i], p.softcap, inv);
    }
    if (p.flags & PREFILL_ALIBI_SLOPES) {
        // ALiBi's slopes given as data: s - slope * |j - p_r| on every pair of the tile, before
        // the classes make the pairs not visible -inf.
        const float slope = alibi_given_slope(p, L, g.head);
        alibi_distance_bias<NS / 4>(s, slope, alibi_d0(L, u * NH * STEP, 0, g.tig, g.q_cta, g.q_loc, g.g8, g.off));
    }
    mask_steps<0, NH, MASK_BYTES>(s, tc, u, m_stage, g, p, L);
    tile_row_max(s, mx);
}

// The whole of a tile's softmax for a warpgroup that computes it: scores in s, P left in s
// (tile_exp).
template <class T, int NH, int MASK_BYTES, bool SUM, int NS>
__device__ __forceinline__ bool tile_softmax(float (&s)[NS], float (&m_run)[2], float (&l_run)[2], float (&ms)[2],
                                             const TileClasses<NH>& tc, int u, u32 m_stage, const RowGeom& g,
                                             const Params& p, const Launch& L) {
    float mx[2];
    tile_scores<NH, MASK_BYTES>(s, mx, tc, u, m_stage, g, p, L);
    return tile_exp<T, SUM>(s, mx, m_run, l_run, ms);
}

// tile_softmax with P packed straight into pk (tile_exp_packed).
template <class T, int NH, int MASK_BYTES, bool SUM, int NS>
__device__ __forceinline__ bool tile_softmax_packed(float (&s)[NS], float (&m_run)[2], float (&l_run)[2],
                                                    float (&ms)[2], const TileClasses<NH>& tc, int u, u32 m_stage,
                                                    const RowGeom& g, const Params& p, const Launch& L,
                                                    u32 (&pk)[NS / 4][2]) {
    float mx[2];
    tile_scores<NH, MASK_BYTES>(s, mx, tc, u, m_stage, g, p, L);
    return tile_exp_packed<T, SUM>(s, mx, m_run, l_run, ms, pk);
}

// O scaled by the rows' factors (after a rescale), where no product holds it.
template <int NO>
__device__ __forceinline__ void rescale_o(float (&o)[NO], const float (&ms)[2]) {
#pragma unroll
    for (int i = 0; i < NO; ++i) o[i] *= ms[(i >> 1) & 1];
}

}  // namespace hopper
