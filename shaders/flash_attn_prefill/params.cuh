// Part of shaders/flash_attn_prefill_tensor.cu: the params block (held to rust/src/params.rs
// by a test) and the launch block the CUDA backend adds.
#pragma once

#include "flash_attn_prefill/common.cuh"

// MLXN_PAGED_ENTRIES (0 unless the host defines it): the module of a source's paged K/V
// entry points (SPEC 11), whose K/V loaders read each row through the block table; 0, the
// module every call loads, with contiguous K/V (entry.cuh says why they are apart).
#ifndef MLXN_PAGED_ENTRIES
#define MLXN_PAGED_ENTRIES 0
#endif
// MLXN_QUANT_ENTRIES (0 unless the host defines it): the module of a source's quantised K/V
// entry points (SPEC 11: FP8 E4M3 / E5M2 with descale factors, Q8_0), whose K/V loaders
// widen the bytes to F16 in shared memory. With MLXN_PAGED_ENTRIES as well: those entry
// points on paged K/V (the two defines are orthogonal: one picks how a row is found, the
// other how its bytes become halves; entry.cuh says why each pair is a module of its own).
#ifndef MLXN_QUANT_ENTRIES
#define MLXN_QUANT_ENTRIES 0
#endif

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
    int offset;  // with PREFILL_OFFSET: query row r is at r + offset of its cache
    int head_dim_v;  // columns of V and O
    int kv_dtype;    // DType code of K and V
    float softcap;   // SPEC 10: s = softcap * tanh(s / softcap) when above 0
    float max_bias;  // SPEC 10: ALiBi slopes on the explicit mask when above 0
    int window_right;        // with PREFILL_WINDOW_RIGHT: j <= p + window_right (two-sided window)
    int alibi_batch_stride;  // with PREFILL_ALIBI_SLOPES: slopes from one sequence to the next (0 or n_heads)
};

#define PREFILL_CAUSAL 1
#define PREFILL_MASK 2
#define PREFILL_VARLEN 4
#define PREFILL_LSE 8
#define PREFILL_OFFSET 16
#define PREFILL_SINKS 32
#define PREFILL_WINDOW_RIGHT 64
#define PREFILL_ALIBI_SLOPES 128
#define PREFILL_PAGED 256  // paged K/V (SPEC 11): the host launches the _paged entries with the launch block's table
#define PREFILL_DESCALE 512  // FP8 K/V's descale factors (SPEC 11): the quant module's Launch::descale
// DType codes of Q and O.
#define DT_F32 0
#define DT_F16 1
#define DT_BF16 2
// DType codes of quantised K/V (the quant module's kv_dtype; K/V strides then in bytes).
#define DT_F8E4M3 7
#define DT_F8E5M2 8
#define DT_Q8_0 9

// What the CUDA backend adds: the CTA geometry it chose and the alignment of the buffers.
struct Launch {
    int heads_per_cta;
    int queries_per_cta;
    int q_tiles;  // CTAs along the query rows: of the longest sequence
    int flags;
    // Split-KV (split_merge.cuh): grid z is batch x 2^kv_split_log2 parts (part in the low
    // bits: a shift and a mask, no division), and the CTA of part i walks the i-th of the
    // equal shares of its visible steps. Its out and lse are then the workspace's part i
    // (F32 O over its own row sum, lse without the sinks), at i * o_split_stride and
    // i * lse_split_stride elements. 0: no split.
    int kv_split_log2;
    int o_split_stride;
    int lse_split_stride;
    // The described mask's sides (block_range.cuh): the right bound's distance from a row's
    // place (a two-sided window's window_right; 0 for causal, or without FLAG_RIGHT_BOUND)
    // and the window's span from that right edge (window + window_right; 0: no left side).
    int window_right;
    int window_left;
    int reserved;  // 0 (the slopes' pointer is 8-byte aligned)
    // With PREFILL_ALIBI_SLOPES: F32 [n_heads], or [batch, n_heads] at the params block's
    // alibi_batch_stride (flash-attn's alibi_slopes); else null.
    const float* alibi_slopes;
#if MLXN_PAGED_ENTRIES
    // Paged K/V (SPEC 11, PREFILL_PAGED), in the paged module only (its launch block is these
    // 24 bytes longer; the contiguous module's is main's): the I32 block table [batch,
    // table_stride] and the I32 cache lengths seqused_k [batch]. The params block's K/V batch
    // strides are the caches' block strides (row and head strides as ever) and sequence b's
    // cache row j is row j % block_size of block block_table[b * table_stride + j /
    // block_size] (block_size a multiple of 16 from 16 to 256, not always a power of two);
    // b's length is seqused_k[b].
    const int* block_table;
    const int* seqused_k;
    int table_stride;
    int block_size;
#endif
#if MLXN_QUANT_ENTRIES
    // Quantised K/V (SPEC 11), in the quant modules only (these 8 bytes after the paged
    // fields where both are there): with PREFILL_DESCALE, FP8 K/V's F32 descale factors
    // [2][n_kv_heads] (K's, then V's); else null.
    const float* descale;
#endif
};
// The host's AttentionLaunch, then PagedPointers in a paged module and the descale pointer in
// a quant module (rust/src/backend/cuda/flash_attn_prefill.rs launch_block).
static_assert(sizeof(Launch) == 48 + (MLXN_PAGED_ENTRIES ? 24 : 0) + (MLXN_QUANT_ENTRIES ? 8 : 0),
              "the launch block changed: update the CUDA backend");

#define FLAG_Q_ALIGNED 1     // Q base and strides 16-byte aligned (8 elements of 16 bits, or 4 floats)
#define FLAG_K_ALIGNED 2     // K base and strides 16-byte aligned
#define FLAG_V_ALIGNED 4     // V base and strides 16-byte aligned
#define FLAG_MASK_ALIGNED 8  // mask base and strides 16-byte aligned
#define FLAG_OUT_ALIGNED 16  // out base and strides aligned to two elements
#define FLAG_RIGHT_BOUND 32  // the described mask has a right bound (causal, or window_right)
#define FLAG_GROUP_FIRST 64  // the CTAs dealt head group first (block_range.cuh, cta_xy)
