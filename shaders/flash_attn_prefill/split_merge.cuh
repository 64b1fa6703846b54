// Part of the CUDA attention's instantiation files: the second kernel of a split-KV launch.
// The attention's CTAs of part i (2^Launch::kv_split_log2 parts) wrote, for each (row, head), O_i
// over its own row sum (F32) and lse_i = M_i + ln(S_i) without the sinks into a workspace;
// this merges them as SPEC 8 merges two results, over all the parts at once, with the sink
// in the denominator:
//
//   M = max(max_i lse_i, sink),  w_i = e^(lse_i - M),  D = sum_i w_i + e^(sink - M),
//   O = sum_i w_i O_i / D (in O's dtype),  lse = M + ln(D).
//
// A row no part saw (every lse_i -inf) and no sink: O = +0 and lse = -inf; with a sink:
// O = +0 and lse = the sink, as the attention gives them unsplit. One warp per (row,
// head): each lane takes columns 2 lane + 64 n of the row.
#pragma once

#include "flash_attn_prefill/block_range.cuh"
#include "flash_attn_prefill/epilogue.cuh"

// Rows (warps) of one merge CTA.
#define MERGE_ROWS 8

// p: the call's params block (O's dtype, strides and lse); pw: the attention launch's (the
// workspace's layout: F32 O at its strides, lse at its strides); L: the attention
// launch's block (the parts, their strides, and FLAG_OUT_ALIGNED of the call's O). Grid:
// (ceil(max_rows / MERGE_ROWS), n_heads, batch).
__device__ __forceinline__ void split_merge(const Params& p, const Params& pw, const Launch& L,
                                            const float* __restrict__ ws_o, const float* __restrict__ ws_lse,
                                            void* __restrict__ out, float* __restrict__ lse,
                                            const int* __restrict__ cu_q, const int* __restrict__ cu_k,
                                            const float* __restrict__ sinks) {
    const int lane = threadIdx.x & 31;
    const int r = (int)blockIdx.x * MERGE_ROWS + (int)(threadIdx.x >> 5), h = (int)blockIdx.y, b = (int)blockIdx.z;
    const Seq s = sequence(p, cu_q, cu_k, b);
    if (r >= s.lq) return;
    const Seq w = sequence(pw, cu_q, cu_k, b);
    const float ninf = -__int_as_float(0x7f800000);
    const i64 part_lse = w.lse + (i64)h * pw.lse_head_stride + r;
    float m = (p.flags & PREFILL_SINKS) ? sinks[h] : ninf;
    const int parts = 1 << L.kv_split_log2;
    for (int i = 0; i < parts; ++i) m = fmaxf(m, ws_lse[part_lse + (i64)i * L.lse_split_stride]);
    const bool seen = m > ninf;  // some part saw the row, or its sink is finite
    float den = 0.f;
    if (seen && (p.flags & PREFILL_SINKS)) den = expf(sinks[h] - m);
    const i64 part_o = w.o + (i64)r * pw.o_row_stride + (i64)h * pw.o_head_stride;
    const i64 dst = s.o + (i64)r * p.o_row_stride + (i64)h * p.o_head_stride;
    const bool out_al = (L.flags & FLAG_OUT_ALIGNED) != 0;
    const int dv = p.head_dim_v;
    // Each lane's columns in registers while the parts are summed: at most 512 / 64 = 8
    // pairs.
    float acc[16];
#pragma unroll
    for (int n = 0; n < 16; ++n) acc[n] = 0.f;
    // Every part is read, a weight of 0 included: a NaN in a part's O (from a NaN input)
    // reaches the result as it does unsplit, and 0 x +-0 adds +0 to the +0 start.
    for (int i = 0; i < parts; ++i) {
        const float li = ws_lse[part_lse + (i64)i * L.lse_split_stride];
        const float wi = seen ? expf(li - m) : 0.f;  // 0 for a part that saw nothing (lse -inf)
        den += wi;
        const float* src = ws_o + part_o + (i64)i * L.o_split_stride;
#pragma unroll
        for (int n = 0; n < 8; ++n) {
            const int c = 2 * lane + 64 * n;
            if (c < dv) {
                const float2 x = *reinterpret_cast<const float2*>(src + c);
                acc[2 * n] = fmaf(wi, x.x, acc[2 * n]);
                acc[2 * n + 1] = fmaf(wi, x.y, acc[2 * n + 1]);
            }
        }
    }
    const float inv = den > 0.f ? 1.f / den : 0.f;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
        const int c = 2 * lane + 64 * n;
        if (c < dv) store_out2(out, p.o_dtype, dst + c, acc[2 * n] * inv, acc[2 * n + 1] * inv, out_al);
    }
    if ((p.flags & PREFILL_LSE) && lane == 0) lse[s.lse + (i64)h * p.lse_head_stride + r] = den > 0.f ? m + logf(den) : ninf;
}

// One entry point per instantiation file (each compiles to a module of its own).
extern "C" __global__ void __launch_bounds__(MERGE_ROWS * 32)
    flash_attn_prefill_split_merge(const Params p, const Params pw, const Launch L, const float* __restrict__ ws_o,
                                   const float* __restrict__ ws_lse, void* __restrict__ out, float* __restrict__ lse,
                                   const int* __restrict__ cu_q, const int* __restrict__ cu_k,
                                   const float* __restrict__ sinks) {
    split_merge(p, pw, L, ws_o, ws_lse, out, lse, cu_q, cu_k, sinks);
}
