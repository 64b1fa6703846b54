// Flash attention for prefill with the Metal 4 tensor API, F16 or BF16 K/V: the kernels of
// flash_attn_prefill (docs/spec.md sections 6-10) and, as thin entry points over the same
// body, the origin op's flash_attn_prefill_tensor_f16_* (section 2).
//
// One threadgroup = Q query rows (32 at head dims up to 256, 16 at 512 and 576: the op's
// mask_tile_rows) of one head of one sequence, 8 simdgroups (256 threads). Q and K have DK
// columns, V and O DV (they differ only at (576, 512)). It walks the sequence's cache 64 rows
// (C) at a time:
//   S = Q.K^T      mpp::tensor_ops::matmul2d into a cooperative tensor, stored to threadgroup
//   softmax        one simdgroup per Q/8 rows, two columns per lane; online, lazily rescaled
//   O = O*ms + P.V mpp::tensor_ops::matmul2d accumulating into a cooperative tensor (O lives
//                  in the threads' registers for the whole walk)
// Each step has a class: that of the described mask (causal, window, the cache's end) for the
// tile's rows, combined with the explicit mask's tile-skip byte. 0 skips the step, 2 computes
// it with no per-element work, 1 sets the scores of invisible pairs to -inf and adds the
// explicit mask where its byte is 1.
//
// SPEC 10's score transforms: softcap on every score as it is read; ALiBi as the head's slope
// times the explicit mask, or, without one, times the described mask's distance j - (r +
// offset) (the mask llama.cpp writes for ALiBi models; this makes every step per-element);
// the sink logit joins each row's running max and sum once, after the walk, so that P stays
// relative to the scores' own max while half rounds it.
//
// flash_attn_prefill_d<DK>[_<DV>][_bf16] (rust/src/ops/flash_attn_prefill.rs): params bytes
// (FlashAttnPrefillParams) at buffer 0, Q (F32, F16 or BF16) at 1, K (F16, or BF16 for the
// _bf16 kernels) at 2, V (as K) at 3, the explicit mask (F16) at 4, its table (U8) at 5, O
// (F32, F16 or BF16) at 6, lse (F32) at 7, cu_seqlens_q (I32) at 8, cu_seqlens_k at 9, the
// sinks (F32 [n_heads]) at 10, the ALiBi slopes (F32 [n_heads] or [batch, n_heads]) at 12 (a
// buffer the flags leave out is bound, never read); a grid of
// (ceil(max_rows / Q), n_heads, batch) threadgroups. BF16 K/V meet the half Q and P in
// matmul2d's documented (half, bfloat) -> float combination.
//
// flash_attn_prefill_tensor_f16_d256 / _d512 (rust/src/ops/flash_attn_prefill_tensor.rs):
// params bytes (FlashAttnPrefillTensorParams) at buffer 0, Q (F32) at 1, K at 2, V at 3, mask
// at 4, blk at 5, O (F32) at 6; a grid of (ceil(rows / Q), n_heads, 1) threadgroups. They run
// the same body as one sequence over a cache of kv_pad rows with an explicit mask.
//
// flash_attn_prefill_d<DK>[_<DV>]_kvq and flash_attn_prefill_paged_d<DK>[_<DV>]_kvq (SPEC 11,
// quantised K/V): K and V as bytes, FP8 E4M3 or E5M2 or ggml's Q8_0 blocks (the params
// block's kv_dtype; strides in bytes), widened to half as they are read (kv_walk), FP8's
// descale factors (F32 [2][n_kv_heads], K's then V's, with PREFILL_DESCALE) at 16: K's
// multiply the scores, V's the output. Every FP8 value is a half, so with factors of 1 the
// result is the F16 kernel's on the same values, to the bit; Q8_0's float(d) * q is rounded
// once to half (as CUDA's loaders round it). Their threadgroup memory is
// quant_threadgroup_memory_bytes(head_dim) (longer at 512 and 576: kv_walk).
//
// All: threadgroups of (32, 8, 1) threads, one block of threadgroup memory at index 0 of
// threadgroup_memory_bytes(head_dim) bytes (the _kvq ones' own, above).
//
// Only what Apple documents is relied on: the layout of a cooperative tensor among the
// threads is implementation defined, so its elements are reached only through get_capacity,
// is_valid_element, get_multidimensional_index and store; matmul2d run() is not a barrier,
// so every hand-over of threadgroup memory between threads has a threadgroup_barrier; run()
// checks its operands' edges against their extents (MPPTensorOpsMatMul2d.h), so a partial
// last step gives K and V tensors of only the rows that exist and no row past the cache is
// read.

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

// Mirror of FlashAttnPrefillParamsGpu (rust/src/params.rs): 17 longs, then 16 words.
// Strides in elements (the table's batch stride in bytes).
struct FlashAttnPrefillParams {
    long q_batch_stride;
    long q_row_stride;
    long q_head_stride;
    long k_batch_stride;
    long k_row_stride;
    long k_head_stride;
    long v_batch_stride;
    long v_row_stride;
    long v_head_stride;
    long o_batch_stride;
    long o_row_stride;
    long o_head_stride;
    long mask_batch_stride;
    long mask_row_stride;
    long lse_batch_stride;
    long lse_head_stride;
    long blk_batch_stride;
    int batch;
    int rows;
    int kv_len;
    int n_heads;
    int n_kv_heads;
    int head_dim;
    int max_rows;
    int window;
    int flags;
    int q_dtype;
    int o_dtype;
    int blk_rows;
    int blk_steps;
    int blk_bq;
    float scale;
    int offset;  // with PREFILL_OFFSET: query row r is at r + offset of its cache
    int head_dim_v;  // columns of V and O
    int kv_dtype;    // DType code of K and V
    float softcap;   // SPEC 10: s = softcap * tanh(s / softcap) when above 0
    float max_bias;  // SPEC 10: ALiBi slopes on the explicit mask when above 0
    int window_right;        // with PREFILL_WINDOW_RIGHT: j <= p + window_right (two-sided window)
    int alibi_batch_stride;  // with PREFILL_ALIBI_SLOPES: slopes from one sequence to the next (0 or n_heads)
};

// Mirror of PagedKvParamsGpu (rust/src/params.rs): 6 longs, then 4 words. Strides in elements.
struct PagedKvParams {
    long k_block_stride;
    long k_row_stride;
    long k_head_stride;
    long v_block_stride;
    long v_row_stride;
    long v_head_stride;
    int num_blocks;
    int block_size;
    int max_blocks;
    int batch;
};

// FlashAttnPrefillParams::flags (PREFILL_* in rust/src/params.rs).
constant constexpr int PREFILL_CAUSAL = 1;
constant constexpr int PREFILL_MASK = 2;
constant constexpr int PREFILL_VARLEN = 4;
constant constexpr int PREFILL_LSE = 8;
constant constexpr int PREFILL_OFFSET = 16;
constant constexpr int PREFILL_SINKS = 32;
constant constexpr int PREFILL_WINDOW_RIGHT = 64;
constant constexpr int PREFILL_ALIBI_SLOPES = 128;
constant constexpr int PREFILL_PAGED = 256;  // the _paged entry points' only: K/V through a block table
constant constexpr int PREFILL_DESCALE = 512;  // the _kvq entry points' only: FP8 descale factors at 16

// DType codes of Q and O (rust/src/dtypes.rs).
constant constexpr int DTYPE_F32 = 0;
constant constexpr int DTYPE_F16 = 1;
constant constexpr int DTYPE_BF16 = 2;
// ... and of quantised K/V (the _kvq entry points' kv_dtype).
constant constexpr int KV_F8E5M2 = 8;
constant constexpr int KV_Q8_0 = 9;

// Cache rows per step (the blk table's bk), simdgroups and their width.
constant constexpr int C = 64;
constant constexpr int SG = 8;
constant constexpr int NW = 32;
// A running max is only moved when a step's max exceeds it by more than this, so every
// exp(s - M) stays below e^8 and fits in half.
constant constexpr float RESCALE_THRESHOLD = 8.0f;

// Paged K/V (SPEC 11): cache rows per sub-tile of a step's K. Blocks hold a multiple of 16
// rows and steps start at multiples of 64, so the 16 rows of a sub-tile lie in one block.
constant constexpr int PAGE_ROWS = 16;

using tg_half_tensor = tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline>;
using tg_float_tensor = tensor<threadgroup float, dextents<int32_t, 2>, tensor_inline>;
template <typename KT>
using dev_kv_tensor = tensor<device KT, dextents<int32_t, 2>, tensor_inline>;
template <typename KT>
using tg_kv_tensor = tensor<threadgroup KT, dextents<int32_t, 2>, tensor_inline>;

// How a tile reads K and V (the right operands of its two products).
//   contiguous: each step's rows in place, one K tensor of C rows and one V tensor of DV
//     columns; O is one cooperative tensor of Q x DV.
//   paged (SPEC 11): K in sub-tiles of PAGE_ROWS rows, each in place in its block; V a slice
//     of `width` columns at a time, its rows gathered through the block table into the scores'
//     threadgroup memory (free while P.V runs), so that each P.V product still sums over the
//     step's rows in one run, as the contiguous one does (the result is the same to the bit);
//     O is DV / width cooperative tensors of Q x width.
//   quantised (SPEC 11, contiguous or paged): K in sub-tiles of k_rows rows, each widened to
//     half into the scores' and probabilities' threadgroup memory (Q x C x 6 bytes, free until
//     the scores are stored: each sub-tile's scores wait in a cooperative tensor of their own
//     until the step's last one has run); 16 rows where they fit there, else 8 (head dims 512
//     and 576, whose threadgroup memory reaches past it: quant_threadgroup_memory_bytes). V as
//     paged V, widened to half as it is gathered. A half tile holds the same values as the
//     FP8 bytes, so the products are the 16-bit kernel's.
template <int DV, int Q>
struct gathered_v {
    // The widest of 64, 32, 16 columns that divides DV and whose C rows of 2-byte elements fit
    // in the scores' Q x C floats.
    static constexpr int width = DV % 64 == 0 && 64 <= 2 * Q ? 64 : (DV % 32 == 0 && 32 <= 2 * Q ? 32 : 16);
    static_assert(DV % width == 0 && C * width * 2 <= Q * C * 4, "V's slices fit the scores' memory");
};
template <int DK, int DV, int Q, typename KT, bool PAGED, bool QUANT>
struct kv_walk {
    static constexpr int k_rows = C;
    static constexpr int width = DV;
    using k_tensor = dev_kv_tensor<KT>;
    using v_tensor = dev_kv_tensor<KT>;
};
template <int DK, int DV, int Q, typename KT>
struct kv_walk<DK, DV, Q, KT, true, false> {
    static constexpr int k_rows = PAGE_ROWS;
    static constexpr int width = gathered_v<DV, Q>::width;
    using k_tensor = dev_kv_tensor<KT>;
    using v_tensor = tg_kv_tensor<KT>;
    using v_element = KT;
};
template <int DK, int DV, int Q, typename KT, bool PAGED>
struct kv_walk<DK, DV, Q, KT, PAGED, true> {
    static constexpr int k_rows = PAGE_ROWS * DK * 2 <= Q * C * 6 ? PAGE_ROWS : PAGE_ROWS / 2;
    static constexpr int width = gathered_v<DV, Q>::width;
    using k_tensor = tg_half_tensor;
    using v_tensor = tg_half_tensor;
    using v_element = half;
};

// Paged K/V: the first of rows j.. of a sequence whose block table row is `table` (row j %
// block_size of block table[j / block_size]), at a KV head's offset `head`.
template <typename KT>
inline device const KT * paged_row(device const KT * cache, device const int * table, int block_size,
                                   long block_stride, long row_stride, ulong head, int j)
{
    return cache + ulong(table[j / block_size]) * ulong(block_stride) + ulong(j % block_size) * ulong(row_stride) + head;
}

// One FP8 byte as half, exactly (every E4M3 and E5M2 value is a half): E5M2 is a half's top
// byte; E4M3's bits but the sign, shifted into a half's exponent and mantissa, are its value
// times 2^-8 (subnormals too), so times 256 in half (exact); 0x7f and 0xff are E4M3's NaN.
inline half fp8_to_half(uchar x, int fmt)
{
    if (fmt == KV_F8E5M2) {
        return as_type<half>(ushort(ushort(x) << 8));
    }
    if ((x & 0x7f) == 0x7f) {
        return as_type<half>(ushort(0x7e00));
    }
    const half m = as_type<half>(ushort(ushort(x & 0x7f) << 7)) * half(256.0f);
    return (x & 0x80) != 0 ? -m : m;
}

// Value i of a quantised K/V row (`row`: its first byte; format `fmt`, the kv_dtype code) as
// half: FP8 exactly; Q8_0's float(d) * q of its block (exact in float), rounded once.
inline half kv_value(device const uchar * row, int i, int fmt)
{
    if (fmt == KV_Q8_0) {
        device const uchar * blk = row + (i / 32) * 34;
        const half d = as_type<half>(ushort(ushort(blk[0]) | ushort(ushort(blk[1]) << 8)));
        return half(float(d) * float(as_type<char>(blk[2 + i % 32])));
    }
    return fp8_to_half(row[i], fmt);
}

// SPEC 10: the ALiBi slope of head h (1 without ALiBi): n2 = 2^floor(log2(n_heads)),
// 2^(-max_bias / n2 * (h + 1)) for h < n2, else 2^(-max_bias / 2 / n2 * (2 (h - n2) + 1)).
inline float alibi_slope(float max_bias, int n_heads, int h)
{
    if (max_bias <= 0.0f) {
        return 1.0f;
    }
    const int n2 = 1 << (31 - int(clz(uint(n_heads))));
    const float e = h < n2 ? -max_bias / float(n2) * float(h + 1) : -max_bias / 2.0f / float(n2) * float(2 * (h - n2) + 1);
    return exp2(e);
}

// The described mask of one sequence (SPEC 6): query row r (of the sequence) sees cache row
// j iff lo(r) <= j <= hi(r), that is j < lk, j <= r + offset + right when a right bound is
// given (causal: right 0), and j > r + offset - window when a window is given.
struct Visibility {
    int lk;      // cache rows of the sequence
    int offset;  // query row r sits at r + offset of the cache (SPEC 6: lk - lq, the prompt at its end)
    int right;   // -1: no right bound; causal: 0; a two-sided window's right side
    int window;  // 0: none

    int hi(int r) const { return right >= 0 ? min(r + offset + right, lk - 1) : lk - 1; }
    int lo(int r) const { return window > 0 ? max(r + offset - window + 1, 0) : 0; }
    bool sees(int r, int j) const { return j >= lo(r) && j <= hi(r); }

    // The class of the step of cache rows [c, c + C) for the query rows [r_first, r_last]:
    // 0 no pair visible, 2 every pair visible and the step whole, 1 otherwise. Both bounds
    // grow with r and each row's range is non-empty and at most one row past the previous
    // one's, so the rows' ranges cover [lo(r_first), hi(r_last)] without a gap: some pair is
    // visible iff the step meets that span, every pair iff the step lies in every row's range.
    int step_class(int c, int r_first, int r_last) const {
        const bool whole = lk - c >= C;
        const int last = whole ? c + C - 1 : lk - 1;
        if (c > hi(r_last) || lo(r_first) > last) {
            return 0;
        }
        return whole && lo(r_last) <= c && hi(r_first) >= last ? 2 : 1;
    }
};

// Four consecutive elements of Q, as float.
inline float4 load_q4(device const uchar * q, int dtype, ulong at)
{
    if (dtype == DTYPE_F16) {
        const half4 x = *((device const packed_half4 *) ((device const half *) q + at));
        return float4(x);
    }
    if (dtype == DTYPE_BF16) {
        device const bfloat * x = (device const bfloat *) q + at;
        return float4(float(x[0]), float(x[1]), float(x[2]), float(x[3]));
    }
    return float4(*((device const packed_float4 *) ((device const float *) q + at)));
}

// float -> bfloat, rounded to nearest even (NaN stays NaN), in bits: the rounding is spelled
// out rather than left to a conversion whose rounding mode the documentation does not state.
inline ushort bfloat_bits(float x)
{
    const uint u = as_type<uint>(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return ushort((u >> 16) | 0x0040u);
    }
    return ushort((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// One element of O in its dtype.
inline void store_o(device uchar * out, int dtype, ulong at, float x)
{
    if (dtype == DTYPE_F16) {
        ((device half *) out)[at] = half(x);
    } else if (dtype == DTYPE_BF16) {
        ((device ushort *) out)[at] = bfloat_bits(x);
    } else {
        ((device float *) out)[at] = x;
    }
}

template <int DK, int DV, int Q, typename KT, bool PAGED = false, bool QUANT = false>
void flash_attn_prefill_tile(
    FlashAttnPrefillParams p,
    device const uchar * q,
    device const KT * k,
    device const KT * v,
    device const half * mask,
    device const uchar * blk,
    device uchar * out,
    device float * lse,
    device const int * cu_q,
    device const int * cu_k,
    device const float * sinks,
    device const float * alibi,
    PagedKvParams pg,
    device const int * block_table,
    device const int * seqused_k,
    device const float * descale,
    threadgroup uchar * smem,
    uint3 tgpig,
    ushort lane,
    ushort sg)
{
    constexpr int R = Q / SG;  // rows of the softmax per simdgroup
    static_assert(R * SG == Q && C == 2 * NW, "two columns per lane, whole rows per simdgroup");

    // The sequence: its query rows [q_start, q_start + lq) and cache rows [k_start, +lk).
    const int b = int(tgpig.z);
    const bool varlen = (p.flags & PREFILL_VARLEN) != 0;
    int q_start = 0, lq = p.rows, k_start = 0, lk = p.kv_len;
    if (varlen) {
        q_start = cu_q[b];
        lq = cu_q[b + 1] - q_start;
        k_start = cu_k[b];
        lk = cu_k[b + 1] - k_start;
    }
    if (PAGED) {
        lk = seqused_k[b];  // the sequence's rows, through its row of the block table
    }
    const int tile = int(tgpig.x);
    const int r0 = tile * Q;
    if (r0 >= lq) {
        return;  // past this sequence's rows (uniform: the whole threadgroup leaves)
    }

    // Threadgroup memory, exactly threadgroup_memory_bytes(DK): queries half [Q][DK], scores
    // float [Q][C], probabilities half [Q][C], row scale float [Q], the rescale flag.
    threadgroup half  * sq    = (threadgroup half *) smem;
    threadgroup float * ss    = (threadgroup float *) (sq + Q * DK);
    threadgroup half  * sp    = (threadgroup half *) (ss + Q * C);
    threadgroup float * srow  = (threadgroup float *) (sp + Q * C);
    threadgroup int   * sflag = (threadgroup int *) (srow + Q);

    const int h = int(tgpig.y);
    const int valid = min(Q, lq - r0);  // rows of this tile that exist
    const int g = h / (p.n_heads / p.n_kv_heads);
    const int tid = int(sg) * NW + int(lane);
    const int n_steps = lk / C + (lk % C != 0 ? 1 : 0);
    const bool has_mask = (p.flags & PREFILL_MASK) != 0;
    const int offset = (p.flags & PREFILL_OFFSET) != 0 ? p.offset : lk - lq;
    const int right = (p.flags & PREFILL_CAUSAL) != 0 ? 0 : ((p.flags & PREFILL_WINDOW_RIGHT) != 0 ? p.window_right : -1);
    const Visibility vis = {lk, offset, right, p.window};
    const float softcap = p.softcap;
    const bool given_slopes = (p.flags & PREFILL_ALIBI_SLOPES) != 0;
    // The explicit mask's scale: max_bias's slope (1 without ALiBi, and with given slopes).
    const float slope = alibi_slope(p.max_bias, p.n_heads, h);
    // ALiBi on the positions, -slope * |p - j| on every pair: the slopes given as data, or
    // max_bias's without an explicit mask (causal: j <= p, llama.cpp's mask value -(p - j)).
    const bool alibi_distance = given_slopes || (p.max_bias > 0.0f && !has_mask);
    const float dslope = given_slopes ? alibi[b * p.alibi_batch_stride + h] : slope;

    // Where this sequence starts in each buffer (elements; the table in bytes).
    const ulong q_at = varlen ? ulong(q_start) * ulong(p.q_row_stride) : ulong(b) * ulong(p.q_batch_stride);
    const ulong k_at = varlen ? ulong(k_start) * ulong(p.k_row_stride) : ulong(b) * ulong(p.k_batch_stride);
    const ulong v_at = varlen ? ulong(k_start) * ulong(p.v_row_stride) : ulong(b) * ulong(p.v_batch_stride);
    const ulong o_at = varlen ? ulong(q_start) * ulong(p.o_row_stride) : ulong(b) * ulong(p.o_batch_stride);
    const ulong lse_at = varlen ? ulong(q_start) : ulong(b) * ulong(p.lse_batch_stride);

    // 1. qh = half(scale * q) for the tile's rows, zeros for rows past the end.
    for (int e = tid; e < Q * DK / 4; e += SG * NW) {
        const int r = e / (DK / 4);
        const int d4 = e % (DK / 4);
        float4 x = 0.0f;
        if (r < valid) {
            const ulong at = q_at + ulong(r0 + r) * ulong(p.q_row_stride) + ulong(h) * ulong(p.q_head_stride);
            x = load_q4(q, p.q_dtype, at + ulong(4 * d4)) * p.scale;
        }
        ((threadgroup half4 *) sq)[e] = half4(x);
    }
    if (tid == 0) {
        *sflag = -1;  // the step whose scores moved a running max (none yet)
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    tg_half_tensor tq(sq, dextents<int32_t, 2>(DK, Q), array<int32_t, 2>({1, DK}));
    tg_float_tensor ts(ss, dextents<int32_t, 2>(C, Q), array<int32_t, 2>({1, C}));

    // S[Q][C] = Q[Q][DK] . K[C][DK]^T, and O[Q][DV] += P[Q][C] . V[C][DV] (kv_walk: paged, S in
    // sub-tiles of K's rows and O in slices of V's columns; contiguous, one of each).
    using walk = kv_walk<DK, DV, Q, KT, PAGED, QUANT>;
    constexpr int NS = DV / walk::width;  // O's slices
    constexpr auto qk_desc = matmul2d_descriptor(Q, walk::k_rows, DK, false, true, false,
                                                 matmul2d_descriptor::mode::multiply);
    constexpr auto pv_desc = matmul2d_descriptor(Q, walk::width, C, false, false, false,
                                                 matmul2d_descriptor::mode::multiply_accumulate);
    matmul2d<qk_desc, execution_simdgroups<SG>> qk;
    matmul2d<pv_desc, execution_simdgroups<SG>> pv;

    auto cs = qk.template get_destination_cooperative_tensor<tg_half_tensor, typename walk::k_tensor, float>();
    using k_scores = decltype(cs);
    using o_tensor = decltype(pv.template get_destination_cooperative_tensor<tg_half_tensor, typename walk::v_tensor, float>());
    o_tensor cos[NS];
    for (int w = 0; w < NS; ++w) {
        thread o_tensor & co = cos[w];
        for (ushort i = 0; i < co.get_capacity(); ++i) {
            if (co.is_valid_element(i)) {
                co[i] = 0.0f;
            }
        }
    }

    // Online softmax state of this simdgroup's rows (every lane holds the same values).
    float m_run[R];
    float s_run[R];
    for (int i = 0; i < R; ++i) {
        m_run[i] = -FLT_MAX / 2;
        s_run[i] = 0.0f;
    }

    device const KT * k_head = k + k_at + ulong(g) * ulong(p.k_head_stride);
    device const KT * v_head = v + v_at + ulong(g) * ulong(p.v_head_stride);
    // Paged: the sequence's row of the block table, and the KV head's offset in a cache row.
    device const int * table = block_table + ulong(b) * ulong(pg.max_blocks);
    const ulong k_head_at = ulong(g) * ulong(pg.k_head_stride);
    const ulong v_head_at = ulong(g) * ulong(pg.v_head_stride);
    device const half * mask_seq = mask + ulong(b) * ulong(p.mask_batch_stride);
    device const uchar * blk_row =
        blk + ulong(b) * ulong(p.blk_batch_stride) + ulong(r0 / p.blk_bq) * ulong(p.blk_steps);
    // Quantised K/V: FP8's descale factors of this KV head (1 without them: a product by 1
    // changes no bit).
    const bool descaled = QUANT && (p.flags & PREFILL_DESCALE) != 0;
    const float kd = descaled ? descale[g] : 1.0f;
    const float vd = descaled ? descale[p.n_kv_heads + g] : 1.0f;

    for (int step = 0; step < n_steps; ++step) {
        // The step's class: the description's for the tile's rows and the table's byte (2
        // without an explicit mask); 0 if either is 0, 2 if both are 2, 1 otherwise (uniform).
        const int c = step * C;
        const int kn = min(C, lk - c);  // cache rows of this step (the last one may be partial)
        const int dt = vis.step_class(c, r0, r0 + valid - 1);
        const uchar tb = has_mask && dt != 0 ? blk_row[step] : uchar(2);
        const uchar t = dt == 0 || tb == 0 ? 0 : (dt == 2 && tb == 2 ? 2 : 1);
        if (t == 0) {
            continue;  // no visible pair, or every mask value -inf: nothing to add
        }

        // 2. Scores of this step into ss. The K tensor holds the step's kn rows only; columns
        // past them are set to -inf below, whatever they hold.
        if constexpr (QUANT) {
            // Each sub-tile's rows widened to half over the scores' memory, one product each
            // into its own scores; stored once every sub-tile has run. A sub-tile past the
            // step's rows is not run (its columns are past the cache: -inf below).
            constexpr int KR = walk::k_rows;
            threadgroup half * sk = (threadgroup half *) ss;
            k_scores csub[C / KR];
            int subs = 0;
            for (; subs * KR < kn; ++subs) {
                const int rows = min(KR, kn - subs * KR);
                for (int e = tid; e < rows * DK; e += SG * NW) {
                    const int j = c + subs * KR + e / DK;
                    device const KT * row = PAGED ? paged_row(k, table, pg.block_size, pg.k_block_stride, pg.k_row_stride, k_head_at, j)
                                                  : k_head + ulong(j) * ulong(p.k_row_stride);
                    sk[e] = kv_value(row, e % DK, p.kv_dtype);
                }
                threadgroup_barrier(mem_flags::mem_threadgroup);
                tg_half_tensor tk(sk, dextents<int32_t, 2>(DK, rows), array<int32_t, 2>({1, DK}));
                qk.run(tq, tk, csub[subs]);
                // Every thread is done with the sub-tile before the next one (or the scores)
                // overwrites it: run() is not a barrier.
                threadgroup_barrier(mem_flags::mem_threadgroup);
            }
            for (int sub = 0; sub < subs; ++sub) {
                csub[sub].store(tg_float_tensor(ss + sub * KR, dextents<int32_t, 2>(KR, Q), array<int32_t, 2>({1, C})));
            }
            if (tid == 0) {
                *sflag = -1;  // at 512 and 576 the sub-tiles reach over the row scales and this flag
            }
        } else if constexpr (PAGED) {
            // Each sub-tile's rows in place in their block; a sub-tile past the step's rows is
            // not run (its columns are past the cache: -inf below).
            for (int sub = 0; sub * PAGE_ROWS < kn; ++sub) {
                const int j = c + sub * PAGE_ROWS;
                device const KT * rows = paged_row(k, table, pg.block_size, pg.k_block_stride, pg.k_row_stride, k_head_at, j);
                dev_kv_tensor<KT> tk(const_cast<device KT *>(rows), dextents<int32_t, 2>(DK, min(PAGE_ROWS, kn - sub * PAGE_ROWS)),
                                     array<int32_t, 2>({1, int32_t(pg.k_row_stride)}));
                qk.run(tq, tk, cs);
                cs.store(tg_float_tensor(ss + sub * PAGE_ROWS, dextents<int32_t, 2>(PAGE_ROWS, Q), array<int32_t, 2>({1, C})));
            }
        } else {
            dev_kv_tensor<KT> tk(const_cast<device KT *>(k_head + ulong(c) * ulong(p.k_row_stride)),
                                 dextents<int32_t, 2>(DK, kn), array<int32_t, 2>({1, int32_t(p.k_row_stride)}));
            qk.run(tq, tk, cs);
            cs.store(ts);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);

        // 3. Softmax of this simdgroup's rows: visibility and mask, lazy max, half P, row sums.
        const bool add_mask = has_mask && tb == 1;
        bool rescaled = false;
        for (int i = 0; i < R; ++i) {
            const int row = int(sg) * R + i;
            float s0 = ss[row * C + lane] * kd;  // K's descale factor (SPEC 11)
            float s1 = ss[row * C + lane + NW] * kd;
            if (softcap > 0.0f) {
                s0 = softcap * precise::tanh(s0 / softcap);
                s1 = softcap * precise::tanh(s1 / softcap);
            }
            if (t == 1 || alibi_distance) {
                const int r = r0 + row;
                const bool v0 = vis.sees(r, c + int(lane));
                const bool v1 = vis.sees(r, c + int(lane) + NW);
                if (add_mask && row < valid) {
                    device const half * mrow = mask_seq + ulong(r) * ulong(p.mask_row_stride) + ulong(c);
                    if (v0) {
                        s0 += slope * float(mrow[lane]);
                    }
                    if (v1) {
                        s1 += slope * float(mrow[lane + NW]);
                    }
                }
                if (alibi_distance) {
                    // -|p - j|, p = r + offset the query's position (llama.cpp's -(p - j) where j <= p).
                    s0 += dslope * float(-abs(c + int(lane) - (r + offset)));
                    s1 += dslope * float(-abs(c + int(lane) + NW - (r + offset)));
                }
                s0 = v0 ? s0 : -INFINITY;
                s1 = v1 ? s1 : -INFINITY;
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

        // 4. O = O * ms (only when some row moved its max), then O += P . V over the step's kn
        // rows (P is 0 past them, and V past them is outside the tensor).
        if (*sflag == step) {
            for (int w = 0; w < NS; ++w) {
                thread o_tensor & co = cos[w];
                for (ushort i = 0; i < co.get_capacity(); ++i) {
                    if (co.is_valid_element(i)) {
                        const auto idx = co.get_multidimensional_index(i);
                        co[i] *= srow[idx[1]];
                    }
                }
            }
        }
        tg_half_tensor tp(sp, dextents<int32_t, 2>(kn, Q), array<int32_t, 2>({1, C}));
        if constexpr (PAGED || QUANT) {
            // V a slice of VW columns at a time: the step's kn rows gathered (paged: each
            // through the block table; quantised: widened to half), into ss (every thread has
            // read its scores), then one product over all of them into the slice's O.
            constexpr int VW = walk::width;
            threadgroup typename walk::v_element * sv = (threadgroup typename walk::v_element *) ss;
            for (int w = 0; w < NS; ++w) {
                for (int e = tid; e < kn * VW; e += SG * NW) {
                    const int j = c + e / VW;
                    device const KT * row = PAGED ? paged_row(v, table, pg.block_size, pg.v_block_stride, pg.v_row_stride, v_head_at, j)
                                                  : v_head + ulong(j) * ulong(p.v_row_stride);
                    if constexpr (QUANT) {
                        sv[e] = kv_value(row, w * VW + e % VW, p.kv_dtype);
                    } else {
                        sv[e] = row[w * VW + e % VW];
                    }
                }
                threadgroup_barrier(mem_flags::mem_threadgroup);
                typename walk::v_tensor tv(sv, dextents<int32_t, 2>(VW, kn), array<int32_t, 2>({1, VW}));
                pv.run(tp, tv, cos[w]);
                // Every thread is done with the slice before the next one (or the next step's
                // scores) overwrites it: run() is not a barrier.
                threadgroup_barrier(mem_flags::mem_threadgroup);
            }
        } else {
            dev_kv_tensor<KT> tv(const_cast<device KT *>(v_head + ulong(c) * ulong(p.v_row_stride)),
                                 dextents<int32_t, 2>(DV, kn), array<int32_t, 2>({1, int32_t(p.v_row_stride)}));
            pv.run(tp, tv, cos[0]);
        }
    }

    // 5. O / S per row; a row that saw nothing (S == 0) is zeros, and its lse -inf. With
    // sinks the head's logit sigma joins first: the max becomes mf = max(M, sigma), the sum
    // S e^(M - mf) + e^(sigma - mf), and O is divided by that sum over e^(M - mf) (infinite
    // when the factor underflows: zeros); a row that saw nothing is then zeros with lse sigma.
    // Rows past the end are not written. srow is reused for the divisor once every thread is
    // done with the last step's scales.
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (lane == 0) {
        const bool has_sinks = (p.flags & PREFILL_SINKS) != 0;
        for (int i = 0; i < R; ++i) {
            const int row = int(sg) * R + i;
            float div = s_run[i];
            float row_lse = s_run[i] == 0.0f ? -INFINITY : m_run[i] + log(s_run[i]);
            if (has_sinks) {
                const float sigma = sinks[h];
                const float mf = max(m_run[i], sigma);
                const float f = exp(m_run[i] - mf);
                const float sum = s_run[i] * f + exp(sigma - mf);
                div = f == 0.0f ? INFINITY : sum / f;
                row_lse = sum == 0.0f ? -INFINITY : mf + log(sum);
            }
            srow[row] = div;
            if ((p.flags & PREFILL_LSE) != 0 && row < valid) {
                lse[lse_at + ulong(h) * ulong(p.lse_head_stride) + ulong(r0 + row)] = row_lse;
            }
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int w = 0; w < NS; ++w) {
        thread o_tensor & co = cos[w];
        for (ushort i = 0; i < co.get_capacity(); ++i) {
            if (!co.is_valid_element(i)) {
                continue;
            }
            const auto idx = co.get_multidimensional_index(i);
            const int row = idx[1];
            const int col = w * walk::width + idx[0];
            if (row < valid) {
                const float s = srow[row];
                const ulong at = o_at + ulong(r0 + row) * ulong(p.o_row_stride) + ulong(h) * ulong(p.o_head_stride);
                store_o(out, p.o_dtype, at + ulong(col), s == 0.0f ? 0.0f : co[i] / s * vd);  // V's descale factor
            }
        }
    }
}

// The entry points of flash_attn_prefill, one line each: the name's suffix, the (Q/K, V)
// head dims, the Q rows per threadgroup (the op's mask_tile_rows) and the K/V element type.
// Every entry point binds the same buffers at the same indices. Tools that list the entry
// points from the text (the emulator, the tests' fake Metal) read a macro's name from its
// `kernel void PREFIX##NAME(` and the suffix from each line's first argument.
#define INSTANTIATE_PREFILL(NAME, DK, DV, BQ, KV)                                                                \
    kernel void flash_attn_prefill_##NAME(                                                                       \
        constant FlashAttnPrefillParams & p [[buffer(0)]],                                                       \
        device const uchar * q [[buffer(1)]],                                                                    \
        device const KV * k [[buffer(2)]],                                                                       \
        device const KV * v [[buffer(3)]],                                                                       \
        device const half * mask [[buffer(4)]],                                                                  \
        device const uchar * blk [[buffer(5)]],                                                                  \
        device uchar * out [[buffer(6)]],                                                                        \
        device float * lse [[buffer(7)]],                                                                        \
        device const int * cu_q [[buffer(8)]],                                                                   \
        device const int * cu_k [[buffer(9)]],                                                                   \
        device const float * sinks [[buffer(10)]],                                                               \
        device const float * alibi [[buffer(12)]],                                                               \
        threadgroup uchar * smem [[threadgroup(0)]],                                                             \
        uint3 tgpig [[threadgroup_position_in_grid]],                                                            \
        ushort lane [[thread_index_in_simdgroup]],                                                               \
        ushort sg [[simdgroup_index_in_threadgroup]])                                                            \
    {                                                                                                            \
        flash_attn_prefill_tile<DK, DV, BQ, KV>(p, q, k, v, mask, blk, out, lse, cu_q, cu_k, sinks, alibi,       \
                                                PagedKvParams{}, nullptr, nullptr, nullptr, smem, tgpig, lane, sg); \
    }

// The paged K/V entry points (SPEC 11), flash_attn_prefill_paged_<NAME>: the same body reading
// K and V through a block table (kv_walk), with the contiguous entry points' bindings and the
// paged block (PagedKvParams) at 13, the block table (I32 [batch][max_blocks]) at 14 and each
// sequence's cache length (I32 [batch]) at 15. The params block's K/V strides describe no
// tensor then (0); the caches' are the paged block's.
#define INSTANTIATE_PREFILL_PAGED(NAME, DK, DV, BQ, KV)                                                          \
    kernel void flash_attn_prefill_paged_##NAME(                                                                 \
        constant FlashAttnPrefillParams & p [[buffer(0)]],                                                       \
        device const uchar * q [[buffer(1)]],                                                                    \
        device const KV * k [[buffer(2)]],                                                                       \
        device const KV * v [[buffer(3)]],                                                                       \
        device const half * mask [[buffer(4)]],                                                                  \
        device const uchar * blk [[buffer(5)]],                                                                  \
        device uchar * out [[buffer(6)]],                                                                        \
        device float * lse [[buffer(7)]],                                                                        \
        device const int * cu_q [[buffer(8)]],                                                                   \
        device const int * cu_k [[buffer(9)]],                                                                   \
        device const float * sinks [[buffer(10)]],                                                               \
        device const float * alibi [[buffer(12)]],                                                               \
        constant PagedKvParams & pg [[buffer(13)]],                                                              \
        device const int * block_table [[buffer(14)]],                                                           \
        device const int * seqused_k [[buffer(15)]],                                                             \
        threadgroup uchar * smem [[threadgroup(0)]],                                                             \
        uint3 tgpig [[threadgroup_position_in_grid]],                                                            \
        ushort lane [[thread_index_in_simdgroup]],                                                               \
        ushort sg [[simdgroup_index_in_threadgroup]])                                                            \
    {                                                                                                            \
        flash_attn_prefill_tile<DK, DV, BQ, KV, true>(p, q, k, v, mask, blk, out, lse, cu_q, cu_k, sinks, alibi, \
                                                      pg, block_table, seqused_k, nullptr, smem, tgpig, lane, sg); \
    }

// The quantised K/V entry points (SPEC 11), flash_attn_prefill_<NAME> and
// flash_attn_prefill_paged_<NAME> with NAME d<DK>[_<DV>]_kvq: the contiguous and the paged
// bodies with K and V as bytes (the params block's kv_dtype says which format) widened to
// half as they are read (kv_walk), each with its layout's bindings and FP8's descale factors
// (F32 [2][n_kv_heads]; with PREFILL_DESCALE) at 16.
#define INSTANTIATE_PREFILL_KVQ(NAME, DK, DV, BQ)                                                                \
    kernel void flash_attn_prefill_##NAME(                                                                       \
        constant FlashAttnPrefillParams & p [[buffer(0)]],                                                       \
        device const uchar * q [[buffer(1)]],                                                                    \
        device const uchar * k [[buffer(2)]],                                                                    \
        device const uchar * v [[buffer(3)]],                                                                    \
        device const half * mask [[buffer(4)]],                                                                  \
        device const uchar * blk [[buffer(5)]],                                                                  \
        device uchar * out [[buffer(6)]],                                                                        \
        device float * lse [[buffer(7)]],                                                                        \
        device const int * cu_q [[buffer(8)]],                                                                   \
        device const int * cu_k [[buffer(9)]],                                                                   \
        device const float * sinks [[buffer(10)]],                                                               \
        device const float * alibi [[buffer(12)]],                                                               \
        device const float * descale [[buffer(16)]],                                                             \
        threadgroup uchar * smem [[threadgroup(0)]],                                                             \
        uint3 tgpig [[threadgroup_position_in_grid]],                                                            \
        ushort lane [[thread_index_in_simdgroup]],                                                               \
        ushort sg [[simdgroup_index_in_threadgroup]])                                                            \
    {                                                                                                            \
        flash_attn_prefill_tile<DK, DV, BQ, uchar, false, true>(p, q, k, v, mask, blk, out, lse, cu_q, cu_k, sinks, \
                                                                alibi, PagedKvParams{}, nullptr, nullptr, descale,  \
                                                                smem, tgpig, lane, sg);                             \
    }
#define INSTANTIATE_PREFILL_PAGED_KVQ(NAME, DK, DV, BQ)                                                          \
    kernel void flash_attn_prefill_paged_##NAME(                                                                 \
        constant FlashAttnPrefillParams & p [[buffer(0)]],                                                       \
        device const uchar * q [[buffer(1)]],                                                                    \
        device const uchar * k [[buffer(2)]],                                                                    \
        device const uchar * v [[buffer(3)]],                                                                    \
        device const half * mask [[buffer(4)]],                                                                  \
        device const uchar * blk [[buffer(5)]],                                                                  \
        device uchar * out [[buffer(6)]],                                                                        \
        device float * lse [[buffer(7)]],                                                                        \
        device const int * cu_q [[buffer(8)]],                                                                   \
        device const int * cu_k [[buffer(9)]],                                                                   \
        device const float * sinks [[buffer(10)]],                                                               \
        device const float * alibi [[buffer(12)]],                                                               \
        constant PagedKvParams & pg [[buffer(13)]],                                                              \
        device const int * block_table [[buffer(14)]],                                                           \
        device const int * seqused_k [[buffer(15)]],                                                             \
        device const float * descale [[buffer(16)]],                                                             \
        threadgroup uchar * smem [[threadgroup(0)]],                                                             \
        uint3 tgpig [[threadgroup_position_in_grid]],                                                            \
        ushort lane [[thread_index_in_simdgroup]],                                                               \
        ushort sg [[simdgroup_index_in_threadgroup]])                                                            \
    {                                                                                                            \
        flash_attn_prefill_tile<DK, DV, BQ, uchar, true, true>(p, q, k, v, mask, blk, out, lse, cu_q, cu_k, sinks,  \
                                                               alibi, pg, block_table, seqused_k, descale, smem,    \
                                                               tgpig, lane, sg);                                    \
    }

INSTANTIATE_PREFILL(d16, 16, 16, 32, half)
INSTANTIATE_PREFILL(d16_bf16, 16, 16, 32, bfloat)
INSTANTIATE_PREFILL(d32, 32, 32, 32, half)
INSTANTIATE_PREFILL(d32_bf16, 32, 32, 32, bfloat)
INSTANTIATE_PREFILL(d48, 48, 48, 32, half)
INSTANTIATE_PREFILL(d48_bf16, 48, 48, 32, bfloat)
INSTANTIATE_PREFILL(d64, 64, 64, 32, half)
INSTANTIATE_PREFILL(d64_bf16, 64, 64, 32, bfloat)
INSTANTIATE_PREFILL(d80, 80, 80, 32, half)
INSTANTIATE_PREFILL(d80_bf16, 80, 80, 32, bfloat)
INSTANTIATE_PREFILL(d96, 96, 96, 32, half)
INSTANTIATE_PREFILL(d96_bf16, 96, 96, 32, bfloat)
INSTANTIATE_PREFILL(d112, 112, 112, 32, half)
INSTANTIATE_PREFILL(d112_bf16, 112, 112, 32, bfloat)
INSTANTIATE_PREFILL(d128, 128, 128, 32, half)
INSTANTIATE_PREFILL(d128_bf16, 128, 128, 32, bfloat)
INSTANTIATE_PREFILL(d160, 160, 160, 32, half)
INSTANTIATE_PREFILL(d160_bf16, 160, 160, 32, bfloat)
INSTANTIATE_PREFILL(d192, 192, 192, 32, half)
INSTANTIATE_PREFILL(d192_bf16, 192, 192, 32, bfloat)
INSTANTIATE_PREFILL(d224, 224, 224, 32, half)
INSTANTIATE_PREFILL(d224_bf16, 224, 224, 32, bfloat)
INSTANTIATE_PREFILL(d256, 256, 256, 32, half)
INSTANTIATE_PREFILL(d256_bf16, 256, 256, 32, bfloat)
INSTANTIATE_PREFILL(d512, 512, 512, 16, half)
INSTANTIATE_PREFILL(d512_bf16, 512, 512, 16, bfloat)
INSTANTIATE_PREFILL(d576_512, 576, 512, 16, half)
INSTANTIATE_PREFILL(d576_512_bf16, 576, 512, 16, bfloat)

INSTANTIATE_PREFILL_PAGED(d16, 16, 16, 32, half)
INSTANTIATE_PREFILL_PAGED(d16_bf16, 16, 16, 32, bfloat)
INSTANTIATE_PREFILL_PAGED(d32, 32, 32, 32, half)
INSTANTIATE_PREFILL_PAGED(d32_bf16, 32, 32, 32, bfloat)
INSTANTIATE_PREFILL_PAGED(d48, 48, 48, 32, half)
INSTANTIATE_PREFILL_PAGED(d48_bf16, 48, 48, 32, bfloat)
INSTANTIATE_PREFILL_PAGED(d64, 64, 64, 32, half)
INSTANTIATE_PREFILL_PAGED(d64_bf16, 64, 64, 32, bfloat)
INSTANTIATE_PREFILL_PAGED(d80, 80, 80, 32, half)
INSTANTIATE_PREFILL_PAGED(d80_bf16, 80, 80, 32, bfloat)
INSTANTIATE_PREFILL_PAGED(d96, 96, 96, 32, half)
INSTANTIATE_PREFILL_PAGED(d96_bf16, 96, 96, 32, bfloat)
INSTANTIATE_PREFILL_PAGED(d112, 112, 112, 32, half)
INSTANTIATE_PREFILL_PAGED(d112_bf16, 112, 112, 32, bfloat)
INSTANTIATE_PREFILL_PAGED(d128, 128, 128, 32, half)
INSTANTIATE_PREFILL_PAGED(d128_bf16, 128, 128, 32, bfloat)
INSTANTIATE_PREFILL_PAGED(d160, 160, 160, 32, half)
INSTANTIATE_PREFILL_PAGED(d160_bf16, 160, 160, 32, bfloat)
INSTANTIATE_PREFILL_PAGED(d192, 192, 192, 32, half)
INSTANTIATE_PREFILL_PAGED(d192_bf16, 192, 192, 32, bfloat)
INSTANTIATE_PREFILL_PAGED(d224, 224, 224, 32, half)
INSTANTIATE_PREFILL_PAGED(d224_bf16, 224, 224, 32, bfloat)
INSTANTIATE_PREFILL_PAGED(d256, 256, 256, 32, half)
INSTANTIATE_PREFILL_PAGED(d256_bf16, 256, 256, 32, bfloat)
INSTANTIATE_PREFILL_PAGED(d512, 512, 512, 16, half)
INSTANTIATE_PREFILL_PAGED(d512_bf16, 512, 512, 16, bfloat)
INSTANTIATE_PREFILL_PAGED(d576_512, 576, 512, 16, half)
INSTANTIATE_PREFILL_PAGED(d576_512_bf16, 576, 512, 16, bfloat)
INSTANTIATE_PREFILL_KVQ(d16_kvq, 16, 16, 32)
INSTANTIATE_PREFILL_KVQ(d32_kvq, 32, 32, 32)
INSTANTIATE_PREFILL_KVQ(d48_kvq, 48, 48, 32)
INSTANTIATE_PREFILL_KVQ(d64_kvq, 64, 64, 32)
INSTANTIATE_PREFILL_KVQ(d80_kvq, 80, 80, 32)
INSTANTIATE_PREFILL_KVQ(d96_kvq, 96, 96, 32)
INSTANTIATE_PREFILL_KVQ(d112_kvq, 112, 112, 32)
INSTANTIATE_PREFILL_KVQ(d128_kvq, 128, 128, 32)
INSTANTIATE_PREFILL_KVQ(d160_kvq, 160, 160, 32)
INSTANTIATE_PREFILL_KVQ(d192_kvq, 192, 192, 32)
INSTANTIATE_PREFILL_KVQ(d224_kvq, 224, 224, 32)
INSTANTIATE_PREFILL_KVQ(d256_kvq, 256, 256, 32)
INSTANTIATE_PREFILL_KVQ(d512_kvq, 512, 512, 16)
INSTANTIATE_PREFILL_KVQ(d576_512_kvq, 576, 512, 16)
INSTANTIATE_PREFILL_PAGED_KVQ(d16_kvq, 16, 16, 32)
INSTANTIATE_PREFILL_PAGED_KVQ(d32_kvq, 32, 32, 32)
INSTANTIATE_PREFILL_PAGED_KVQ(d48_kvq, 48, 48, 32)
INSTANTIATE_PREFILL_PAGED_KVQ(d64_kvq, 64, 64, 32)
INSTANTIATE_PREFILL_PAGED_KVQ(d80_kvq, 80, 80, 32)
INSTANTIATE_PREFILL_PAGED_KVQ(d96_kvq, 96, 96, 32)
INSTANTIATE_PREFILL_PAGED_KVQ(d112_kvq, 112, 112, 32)
INSTANTIATE_PREFILL_PAGED_KVQ(d128_kvq, 128, 128, 32)
INSTANTIATE_PREFILL_PAGED_KVQ(d160_kvq, 160, 160, 32)
INSTANTIATE_PREFILL_PAGED_KVQ(d192_kvq, 192, 192, 32)
INSTANTIATE_PREFILL_PAGED_KVQ(d224_kvq, 224, 224, 32)
INSTANTIATE_PREFILL_PAGED_KVQ(d256_kvq, 256, 256, 32)
INSTANTIATE_PREFILL_PAGED_KVQ(d512_kvq, 512, 512, 16)
INSTANTIATE_PREFILL_PAGED_KVQ(d576_512_kvq, 576, 512, 16)

// The origin op as a prefill: one sequence of `rows` query rows over a cache of kv_pad rows,
// the explicit mask [rows][mask_row_stride] with its table (tiles of Q x C), F32 Q, F32 O
// contiguous [rows][n_heads][D], no description, no lse.
template <int D, int Q>
FlashAttnPrefillParams origin_params(constant FlashAttnPrefillTensorParams & o)
{
    FlashAttnPrefillParams p = {};
    p.q_row_stride = o.q_row_stride;
    p.q_head_stride = o.q_head_stride;
    p.k_row_stride = o.k_row_stride;
    p.k_head_stride = o.k_head_stride;
    p.v_row_stride = o.v_row_stride;
    p.v_head_stride = o.v_head_stride;
    p.o_row_stride = long(o.n_heads) * D;
    p.o_head_stride = D;
    p.mask_row_stride = o.mask_row_stride;
    p.batch = 1;
    p.rows = o.rows;
    p.kv_len = o.kv_pad;
    p.n_heads = o.n_heads;
    p.n_kv_heads = o.n_kv_heads;
    p.head_dim = D;
    p.max_rows = o.rows;
    p.flags = PREFILL_MASK;
    p.q_dtype = DTYPE_F32;
    p.o_dtype = DTYPE_F32;
    p.blk_rows = o.rows / Q + (o.rows % Q != 0 ? 1 : 0);
    p.blk_steps = o.kv_pad / C;
    p.blk_bq = Q;
    p.scale = o.scale;
    p.head_dim_v = D;
    p.kv_dtype = 1;  // F16
    return p;
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
    flash_attn_prefill_tile<256, 256, 32, half>(origin_params<256, 32>(p), (device const uchar *) q, k, v, mask, blk,
                                                (device uchar *) out, nullptr, nullptr, nullptr, nullptr, nullptr, PagedKvParams{},
                                                nullptr, nullptr, nullptr, smem, tgpig, lane, sg);
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
    flash_attn_prefill_tile<512, 512, 16, half>(origin_params<512, 16>(p), (device const uchar *) q, k, v, mask, blk,
                                                (device uchar *) out, nullptr, nullptr, nullptr, nullptr, nullptr, PagedKvParams{},
                                                nullptr, nullptr, nullptr, smem, tgpig, lane, sg);
}
