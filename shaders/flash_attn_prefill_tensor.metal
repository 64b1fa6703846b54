// Flash attention for prefill with the Metal 4 tensor API (docs/spec.md section 2), F16 K/V.
//
// One threadgroup = Q query rows (32 at head dim 256, 16 at 512) of one head, 8 simdgroups
// (256 threads). It walks the cache 64 rows (C) at a time:
//   S = Q.K^T      mpp::tensor_ops::matmul2d into a cooperative tensor, stored to threadgroup
//   softmax        one simdgroup per Q/8 rows, two columns per lane; online, lazily rescaled
//   O = O*ms + P.V mpp::tensor_ops::matmul2d accumulating into a cooperative tensor (O lives
//                  in the threads' registers for the whole walk)
// and skips a step when the tile-skip table says every mask value of it is -inf.
//
// Bindings (rust/src/ops/flash_attn_prefill_tensor.rs): params bytes at buffer 0, Q (F32)
// at 1, K (F16) at 2, V (F16) at 3, mask (F16) at 4, blk (U8) at 5, O (F32) at 6; one block of
// threadgroup memory at index 0 of threadgroup_memory_bytes(head_dim) bytes; a grid of
// (ceil(rows / Q), n_heads, 1) threadgroups of (32, 8, 1) threads.
//
// Only what Apple documents is relied on: the layout of a cooperative tensor among the
// threads is implementation defined, so its elements are reached only through get_capacity,
// is_valid_element, get_multidimensional_index and store; matmul2d run() is not a barrier,
// so every hand-over of threadgroup memory between threads has a threadgroup_barrier.

#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>

using namespace metal;
using namespace mpp::tensor_ops;

// Mirror of FlashAttnPrefillTensorParamsGpu (12 words, strides in elements).
struct FlashAttnPrefillTensorParams {
    int rows;
    int n_heads;
    int n_kv_heads;
    int kv_pad;
    int q_row_stride;
    int q_head_stride;
    int k_row_stride;
    int k_head_stride;
    int v_row_stride;
    int v_head_stride;
    int mask_row_stride;
    float scale;
};

// Cache rows per step (the blk table's bk), simdgroups and their width.
constant constexpr int C = 64;
constant constexpr int SG = 8;
constant constexpr int NW = 32;
// A running max is only moved when a step's max exceeds it by more than this, so every
// exp(s - M) stays below e^8 and fits in half.
constant constexpr float RESCALE_THRESHOLD = 8.0f;

using tg_half_tensor = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>;
using tg_float_tensor = tensor<threadgroup float, dextents<int32_t, 2>, tensor_inline>;
using dev_half_tensor = tensor<device half, dextents<int32_t, 2>, tensor_inline>;

template <int D, int Q>
void flash_attn_prefill_tensor_tile(
    constant FlashAttnPrefillTensorParams & p,
    device const float * q,
    device const half * k,
    device const half * v,
    device const half * mask,
    device const uchar * blk,
    device float * out,
    threadgroup uchar * smem,
    uint3 tgpig,
    ushort lane,
    ushort sg)
{
    constexpr int R = Q / SG;  // rows of the softmax per simdgroup
    static_assert(R * SG == Q && C == 2 * NW, "two columns per lane, whole rows per simdgroup");

    // Threadgroup memory, exactly threadgroup_memory_bytes(D): queries half [Q][D], scores
    // float [Q][C], probabilities half [Q][C], row scale float [Q], the rescale flag.
    threadgroup half  * sq    = (threadgroup half *) smem;
    threadgroup float * ss    = (threadgroup float *) (sq + Q * D);
    threadgroup half  * sp    = (threadgroup half *) (ss + Q * C);
    threadgroup float * srow  = (threadgroup float *) (sp + Q * C);
    threadgroup int   * sflag = (threadgroup int *) (srow + Q);

    const int tile = int(tgpig.x);
    const int h = int(tgpig.y);
    const int r0 = tile * Q;
    const int valid = min(Q, p.rows - r0);  // rows of this tile that exist
    const int g = h / (p.n_heads / p.n_kv_heads);
    const int tid = int(sg) * NW + int(lane);
    const int n_steps = p.kv_pad / C;

    // 1. qh = half(scale * q) for the tile's rows, zeros for rows past the end.
    for (int e = tid; e < Q * D / 4; e += SG * NW) {
        const int r = e / (D / 4);
        const int d4 = e % (D / 4);
        float4 x = 0.0f;
        if (r < valid) {
            device const packed_float4 * qrow = (device const packed_float4 *)
                (q + ulong(r0 + r) * ulong(p.q_row_stride) + ulong(h) * ulong(p.q_head_stride));
            x = float4(qrow[d4]) * p.scale;
        }
        ((threadgroup half4 *) sq)[e] = half4(x);
    }
    if (tid == 0) {
        *sflag = -1;  // the step whose scores moved a running max (none yet)
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    tg_half_tensor tq(sq, dextents<int32_t, 2>(D, Q), array<int32_t, 2>({1, D}));
    tg_float_tensor ts(ss, dextents<int32_t, 2>(C, Q), array<int32_t, 2>({1, C}));
    tg_half_tensor tp(sp, dextents<int32_t, 2>(C, Q), array<int32_t, 2>({1, C}));

    // S[Q][C] = Q[Q][D] . K[C][D]^T, and O[Q][D] += P[Q][C] . V[C][D].
    constexpr auto qk_desc = matmul2d_descriptor(Q, C, D, false, true, false,
                                                 matmul2d_descriptor::mode::multiply);
    constexpr auto pv_desc = matmul2d_descriptor(Q, D, C, false, false, false,
                                                 matmul2d_descriptor::mode::multiply_accumulate);
    matmul2d<qk_desc, execution_simdgroups<SG>> qk;
    matmul2d<pv_desc, execution_simdgroups<SG>> pv;

    auto cs = qk.template get_destination_cooperative_tensor<tg_half_tensor, dev_half_tensor, float>();
    auto co = pv.template get_destination_cooperative_tensor<tg_half_tensor, dev_half_tensor, float>();
    for (ushort i = 0; i < co.get_capacity(); ++i) {
        if (co.is_valid_element(i)) {
            co[i] = 0.0f;
        }
    }

    // Online softmax state of this simdgroup's rows (every lane holds the same values).
    float m_run[R];
    float s_run[R];
    for (int i = 0; i < R; ++i) {
        m_run[i] = -FLT_MAX / 2;
        s_run[i] = 0.0f;
    }

    device const half * k_head = k + ulong(g) * ulong(p.k_head_stride);
    device const half * v_head = v + ulong(g) * ulong(p.v_head_stride);
    device const uchar * blk_row = blk + ulong(tile) * ulong(n_steps);

    for (int step = 0; step < n_steps; ++step) {
        const uchar t = blk_row[step];
        if (t == 0) {
            continue;  // every mask value of the tile is -inf: nothing to add (uniform)
        }
        const int c = step * C;

        // 2. Scores of this step into ss.
        dev_half_tensor tk(const_cast<device half *>(k_head + ulong(c) * ulong(p.k_row_stride)),
                           dextents<int32_t, 2>(D, C), array<int32_t, 2>({1, p.k_row_stride}));
        qk.run(tq, tk, cs);
        cs.store(ts);
        threadgroup_barrier(mem_flags::mem_threadgroup);

        // 3. Softmax of this simdgroup's rows: mask, lazy max, half P, row sums.
        bool rescaled = false;
        for (int i = 0; i < R; ++i) {
            const int row = int(sg) * R + i;
            float s0 = ss[row * C + lane];
            float s1 = ss[row * C + lane + NW];
            if (t == 1 && row < valid) {
                device const half * mrow = mask + ulong(r0 + row) * ulong(p.mask_row_stride) + ulong(c);
                s0 += float(mrow[lane]);
                s1 += float(mrow[lane + NW]);
            }
            const float m = simd_max(max(s0, s1));
            float ms = 1.0f;
            if (m > m_run[i] + RESCALE_THRESHOLD) {
                ms = exp(m_run[i] - m);
                m_run[i] = m;
                rescaled = true;
            }
            const half p0 = half(exp(s0 - m_run[i]));
            const half p1 = half(exp(s1 - m_run[i]));
            sp[row * C + lane] = p0;
            sp[row * C + lane + NW] = p1;
            s_run[i] = s_run[i] * ms + simd_sum(float(p0) + float(p1));
            if (lane == 0) {
                srow[row] = ms;
            }
        }
        if (rescaled && lane == 0) {
            *sflag = step;  // no reset needed: a later step writes its own number
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);

        // 4. O = O * ms (only when some row moved its max), then O += P . V.
        if (*sflag == step) {
            for (ushort i = 0; i < co.get_capacity(); ++i) {
                if (co.is_valid_element(i)) {
                    const auto idx = co.get_multidimensional_index(i);
                    co[i] *= srow[idx[1]];
                }
            }
        }
        dev_half_tensor tv(const_cast<device half *>(v_head + ulong(c) * ulong(p.v_row_stride)),
                           dextents<int32_t, 2>(D, C), array<int32_t, 2>({1, p.v_row_stride}));
        pv.run(tp, tv, co);
    }

    // 5. O / S per row; a row that saw nothing (S == 0) is zeros. Rows past the end are not
    // written. srow is reused for S once every thread is done with the last step's scales.
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (lane == 0) {
        for (int i = 0; i < R; ++i) {
            srow[int(sg) * R + i] = s_run[i];
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (ushort i = 0; i < co.get_capacity(); ++i) {
        if (!co.is_valid_element(i)) {
            continue;
        }
        const auto idx = co.get_multidimensional_index(i);
        const int row = idx[1];
        const int col = idx[0];
        if (row < valid) {
            const float s = srow[row];
            out[(ulong(r0 + row) * ulong(p.n_heads) + ulong(h)) * ulong(D) + ulong(col)] =
                s == 0.0f ? 0.0f : co[i] / s;
        }
    }
}

kernel void flash_attn_prefill_tensor_f16_d256(
    constant FlashAttnPrefillTensorParams & p [[buffer(0)]],
    device const float * q [[buffer(1)]],
    device const half * k [[buffer(2)]],
    device const half * v [[buffer(3)]],
    device const half * mask [[buffer(4)]],
    device const uchar * blk [[buffer(5)]],
    device float * out [[buffer(6)]],
    threadgroup uchar * smem [[threadgroup(0)]],
    uint3 tgpig [[threadgroup_position_in_grid]],
    ushort lane [[thread_index_in_simdgroup]],
    ushort sg [[simdgroup_index_in_threadgroup]])
{
    flash_attn_prefill_tensor_tile<256, 32>(p, q, k, v, mask, blk, out, smem, tgpig, lane, sg);
}

kernel void flash_attn_prefill_tensor_f16_d512(
    constant FlashAttnPrefillTensorParams & p [[buffer(0)]],
    device const float * q [[buffer(1)]],
    device const half * k [[buffer(2)]],
    device const half * v [[buffer(3)]],
    device const half * mask [[buffer(4)]],
    device const uchar * blk [[buffer(5)]],
    device float * out [[buffer(6)]],
    threadgroup uchar * smem [[threadgroup(0)]],
    uint3 tgpig [[threadgroup_position_in_grid]],
    ushort lane [[thread_index_in_simdgroup]],
    ushort sg [[simdgroup_index_in_threadgroup]])
{
    flash_attn_prefill_tensor_tile<512, 16>(p, q, k, v, mask, blk, out, smem, tgpig, lane, sg);
}
