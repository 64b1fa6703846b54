// Part of shaders/flash_attn_prefill_tensor.cu: the online softmax of SPEC section 2, steps
// 4 and 5, as both forms run it on the rows their threads hold: the lazy rescale and P =
// half(exp(s - M)) with the row sums of the rounded values; and section 10's transforms of
// the scores (softcap, ALiBi) and start of the softmax (sinks).
#pragma once

#include "flash_attn_prefill/block_range.cuh"

// A running max moves only when a step's max exceeds it by more than this, so every
// exp(s - M) stays below e^8 and fits in half.
#define RESCALE_THRESHOLD 8.f

// The lazy rescale of one row: with the step's max `mx`, moves the running max `m` and
// sets the factor `ms` the row's sum and O are scaled by; whether it moved.
__device__ __forceinline__ bool softmax_rescale(float mx, float& m, float& ms) {
    ms = 1.f;
    if (mx > m + RESCALE_THRESHOLD) {
        ms = exp2_approx((m - mx) * LOG2E);
        m = mx;
        return true;
    }
    return false;
}

// P of two scores of one row, T(exp(s - m)) (half or bfloat16) as a pair (s0 in the low
// half), and their rounded values added to `sum`.
template <class T>
__device__ __forceinline__ u32 softmax_p2(float s0, float s1, float m, float& sum) {
    const float ml = m * LOG2E;  // the same for every pair of the row: computed once
    const float e0 = exp2_approx(fmaf(s0, LOG2E, -ml));
    const float e1 = exp2_approx(fmaf(s1, LOG2E, -ml));
    const u32 h2 = T::pack2(e0, e1);
    float r0, r1;
    T::unpack2(h2, r0, r1);
    sum += r0 + r1;
    return h2;
}

// ------------------------------------------------------------------ SPEC 10's score transforms

// softcap * tanh(s / softcap), with tanh(x) = 1 - 2 / (e^2x + 1): its absolute error stays
// near float's epsilon at every x (tanh.approx's relative 2^-11 would move the scores by
// up to softcap * 5e-4), and e^2x = inf gives 1, e^2x = 0 gives -1. The reciprocal is the
// approximate one (relative error 2^-23; an IEEE division costs a subroutine per score).
__device__ __forceinline__ float softcap_score(float s, float softcap, float inv_softcap) {
    const float e = exp2_approx(2.f * LOG2E * inv_softcap * s);
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(e + 1.f));
    return fmaf(-2.f * softcap, r, softcap);
}

// ALiBi's slope of head h (SPEC 10): 1 when max_bias is 0; m0^(h + 1) = 2^(-(h + 1) b / n2)
// and m1^(2 (h - n2) + 1) = 2^(-(2 (h - n2) + 1) b / (2 n2)). Cheap enough to compute where
// it is used (the forms keep no register for it).
__device__ __forceinline__ float alibi_slope(const Params& p, int h) {
    if (!(p.max_bias > 0.f)) return 1.f;
    const int n2 = 1 << (31 - __clz(p.n_heads));  // 2^floor(log2(n_heads))
    const float e = h < n2 ? (float)(h + 1) : 0.5f * (float)(2 * (h - n2) + 1);
    return exp2f(-e * p.max_bias / (float)n2);
}

// Whether ALiBi biases by distance: with max_bias and a described mask but no explicit one,
// the described mask's value on a visible pair is -(p_r - j), p_r the row's place in the
// cache (what llama.cpp writes into its mask for ALiBi models; docs/spec.md, 10). Every
// computed tile then takes the per-element path.
__device__ __forceinline__ bool alibi_by_distance(const Params& p) {
    return p.max_bias > 0.f && !(p.flags & PREFILL_MASK) && (p.flags & PREFILL_CAUSAL);
}

// With PREFILL_ALIBI_SLOPES (flash-attn's alibi_slopes): head h's slope, of this CTA's
// sequence (at the params block's alibi_batch_stride). Read where it is used, its address
// computed inside one volatile asm: the slope and its address are loop-invariant, and the
// compiler hoisted them out of the walk into registers held throughout (the forms at the
// register file's limit then spilled).
__device__ __forceinline__ float alibi_given_slope(const Params& p, const Launch& L, int h) {
    float v;
    asm volatile(
        "{ .reg .u32 z; .reg .s64 a;\n"
        "  mov.u32 z, %%ctaid.z;\n"
        "  shr.u32 z, z, %2;\n"
        "  mad.lo.s32 z, z, %3, %4;\n"
        "  mad.wide.s32 a, z, 4, %1;\n"
        "  ld.global.nc.f32 %0, [a]; }\n"
        : "=f"(v)
        : "l"(L.alibi_slopes), "r"(L.kv_split_log2), "r"(p.alibi_batch_stride), "r"(h));
    return v;
}

// j - p_r of a thread's first pair (cache row j = c0 + c1 + 2 tig, query row r0 + r1 + g8 at
// p_r = r0 + r1 + g8 + off - window_right, block_range.cuh) from the values its form holds
// anyway, in one volatile asm: an invariant part of it (everything but the step) was
// hoisted out of the walk into a register held throughout.
__device__ __forceinline__ int alibi_d0(const Launch& L, int c0, int c1, int tig, int r0, int r1, int g8, int off) {
    int d;
    asm volatile(
        "{ .reg .s32 j, q;\n"
        "  add.s32 j, %1, %2;\n"
        "  mad.lo.s32 j, %3, 2, j;\n"
        "  add.s32 q, %4, %5;\n"
        "  add.s32 q, q, %6;\n"
        "  add.s32 q, q, %7;\n"
        "  sub.s32 q, q, %8;\n"
        "  sub.s32 %0, j, q; }\n"
        : "=r"(d)
        : "r"(c0), "r"(c1), "r"(tig), "r"(r0), "r"(r1), "r"(g8), "r"(off), "r"(L.window_right));
    return d;
}

// flash-attn's ALiBi bias of a pair at d = j - p_r: -slope |d|.
__device__ __forceinline__ float alibi_bias(float slope, float d) { return -slope * fabsf(d); }

// The bias on a thread's scores in the mma / wgmma accumulator layout (NB 8-column blocks:
// s[nb * 4 + hh * 2 + e] is row g8 + 8 hh, column nb * 8 + tig * 2 + e), with d0 = j - p_r of
// its first pair (row g8, column tig * 2 of block 0).
template <int NB, int NS>
__device__ __forceinline__ void alibi_distance_bias(float (&s)[NS], float slope, int d0) {
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int d = d0 + nb * 8 + (i & 1) - (i >> 1) * 8;
            s[nb * 4 + i] += alibi_bias(slope, (float)d);
        }
}

// The sink logit sigma of head h (SPEC 10), one more score with no value, taken once the
// row's sum S is whole (so the walk keeps no register for it): with M' = max(M, sigma), S
// becomes S e^(M - M') + e^(sigma - M'), O is scaled by e^(M - M') (`o_scale`) and M becomes
// M'. The same softmax as starting from M = sigma, S = 1; sigma = -inf changes nothing, and
// a row that sees nothing gets O = 0, lse = sigma.
__device__ __forceinline__ void softmax_sink(const Params& p, const float* __restrict__ sinks, int h, float& m,
                                             float& l, float& o_scale) {
    o_scale = 1.f;
    if (!(p.flags & PREFILL_SINKS)) return;
    const float sigma = sinks[h];
    const float mn = fmaxf(m, sigma);
    o_scale = exp2_approx((m - mn) * LOG2E);
    l = l * o_scale + exp2_approx((sigma - mn) * LOG2E);
    m = mn;
}
