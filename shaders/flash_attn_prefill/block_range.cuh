// Part of shaders/flash_attn_prefill_tensor.cu: which rows a CTA's sequence has, which pairs
// are visible (SPEC 6), the class of a tile, and the walk over the steps a CTA computes.
#pragma once

#include "flash_attn_prefill/params.cuh"

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

// The CTA's place in the grid's plane of query tiles (x: tile q_tiles - 1 - x, the longest
// causal rows first) and head groups (y). With FLAG_GROUP_FIRST (the host's choice, for
// walks of unequal length in launches of few waves: backend/cuda/flash_attn_prefill.rs,
// group_first) the launch order's CTAs (clusters, on Hopper) are dealt head group first, so
// the longest tiles of every head group go in the first waves, where in the grid's own order
// (x fastest) one group's tiles, longest to shortest, come before the next group's and the
// last groups' longest tiles start late and run alone at the end.
struct CtaXY {
    u32 x, y;
};
__device__ __forceinline__ CtaXY cta_xy(const Launch& L) {
    if (!(L.flags & FLAG_GROUP_FIRST)) return {blockIdx.x, blockIdx.y};
// The Hopper test is the compiler's own macro: entry.cuh includes this file (through
// mainloop_sm80.cuh) before it defines MLXN_HOPPER, and an order blind to clusters parts the
// two CTAs of a pair (different tiles and KV heads: their shared stages never complete, the
// hang of 2026-12-07 07:35 UTC).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    // Whole clusters are moved: the cluster's index in launch order, dealt over the head
    // groups' clusters, and the CTA's place inside its cluster kept (a launch without a
    // cluster is one of clusters of one CTA).
    u32 cx, cy, ncx, ncy, rx, ry, nx, ny;
    asm("mov.u32 %0, %%clusterid.x;" : "=r"(cx));
    asm("mov.u32 %0, %%clusterid.y;" : "=r"(cy));
    asm("mov.u32 %0, %%nclusterid.x;" : "=r"(ncx));
    asm("mov.u32 %0, %%nclusterid.y;" : "=r"(ncy));
    asm("mov.u32 %0, %%cluster_ctaid.x;" : "=r"(rx));
    asm("mov.u32 %0, %%cluster_ctaid.y;" : "=r"(ry));
    asm("mov.u32 %0, %%cluster_nctaid.x;" : "=r"(nx));
    asm("mov.u32 %0, %%cluster_nctaid.y;" : "=r"(ny));
    const u32 c = cy * ncx + cx;
    return {c / ncy * nx + rx, c % ncy * ny + ry};
#else
    const u32 c = blockIdx.y * gridDim.x + blockIdx.x;
    return {c / gridDim.y, c % gridDim.y};
#endif
}

// The sequence of this CTA (grid z is batch x the launch's KV parts) and its part.
__device__ __forceinline__ int cta_sequence(const Launch& L) { return (int)(blockIdx.z >> L.kv_split_log2); }
__device__ __forceinline__ int cta_part(const Launch& L) { return (int)(blockIdx.z & ((1u << L.kv_split_log2) - 1u)); }

// The sequence of the CTA at grid z `z`, its out and lse moved to its part of a split
// launch's workspace.
__device__ __forceinline__ Seq cta_seq_at(const Params& p, const Launch& L, const int* __restrict__ cu_q,
                                          const int* __restrict__ cu_k, u32 z) {
    Seq s = sequence(p, cu_q, cu_k, (int)(z >> L.kv_split_log2));
    const int part = (int)(z & ((1u << L.kv_split_log2) - 1u));
    s.o += (i64)part * L.o_split_stride;
    s.lse += (i64)part * L.lse_split_stride;
    return s;
}

// The sequence of this CTA (cta_seq_at).
__device__ __forceinline__ Seq cta_seq(const Params& p, const Launch& L, const int* __restrict__ cu_q,
                                       const int* __restrict__ cu_k) {
    return cta_seq_at(p, L, cu_q, cu_k, blockIdx.z);
}

// The same, from grid z read again by an asm the compiler does not merge with earlier
// reads: an epilogue that takes its out and lse offsets from it keeps no register for them
// through the walk (where the consumers have none to spare, ptxas spilled them).
__device__ __forceinline__ Seq cta_seq_again(const Params& p, const Launch& L, const int* __restrict__ cu_q,
                                             const int* __restrict__ cu_k) {
    u32 z;
    asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(z));
    return cta_seq_at(p, L, cu_q, cu_k, z);
}

#if MLXN_PAGED_ENTRIES
// Paged K/V (the paged module's entries; Launch::block_table): sequence `s` of this
// CTA with its cache length from seqused_k and its K/V offsets 0 (its rows are found through
// the table, kv_row_paged).
__device__ __forceinline__ Seq with_pages(Seq s, const Launch& L) {
    s.k = 0;
    s.v = 0;
    s.lk = L.seqused_k[cta_sequence(L)];
    return s;
}

// Paged K/V: the offset (elements) of cache row j of this CTA's sequence in the caches, at
// the caches' block and row strides (the head's column 0 is the caller's base). The grid z
// and the block size are read by asms the compiler neither merges nor hoists: what is
// derived from them (the table row's address, the divisor's reciprocal) is made where a
// tile loads, never kept in registers through the walk (where the contiguous path has
// none to spare).
__device__ __forceinline__ i64 kv_row_paged(const Launch& L, int j, i64 block_stride, i64 row_stride) {
    u32 z;
    int bs;
    asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(z));
    asm volatile("mov.b32 %0, %1;" : "=r"(bs) : "r"(L.block_size));
    const int* __restrict__ table = L.block_table + (i64)(int)(z >> L.kv_split_log2) * L.table_stride;
    const int i = j / bs;  // block sizes are multiples of 16, not always powers of two
    return (i64)__ldg(table + i) * block_stride + (i64)(j - i * bs) * row_stride;
}
#endif

// A split launch's share of the steps [lo, hi] (non-empty or not): part `part` of the
// 2^log2 equal shares, in order; past the end, empty. The shares depend on the
// description alone (never on the table), so a computed table and an all-ones one split
// alike.
// Branch-free: with log2 = 0 (part 0) it keeps [lo, hi]; an empty range (lo > hi) gives
// a share <= 0 and stays empty.
__device__ __forceinline__ void narrow_to_part(int log2, int part, int& lo, int& hi) {
    const int share = ((hi - lo) >> log2) + 1;  // ceil((hi - lo + 1) / 2^log2)
    lo += part * share;
    hi = min(hi, lo + share - 1);
}

// The described mask (SPEC 6) as the kernels read it. Query row r sits at r + offset of
// its cache (the prompt is the cache's end, offset = lk - lq, unless the block gives one)
// and sees cache row j iff j < lk and, with a right bound (causal, or a two-sided window's
// window_right), j <= r + offset + right, and with a window (its left side),
// j > r + offset + right - left. The host folds both sides into the launch block
// (FLAG_RIGHT_BOUND; Launch::window_right, 0 for causal or none; Launch::window_left =
// window + right, 0 for none; a side that binds no row is left out), so the kernels keep
// one offset, `off` = offset + right (the right edge of row 0's visible range), and each
// bound is that offset and a launch constant, as causal's was.

// The sequence's `off`: the right edge of row 0's visible range (see above).
__device__ __forceinline__ int query_offset(const Params& p, const Launch& L, int lq, int lk) {
    return ((p.flags & PREFILL_OFFSET) ? p.offset : lk - lq) + L.window_right;
}

// Whether query row r may see cache row j (SPEC 6), with the sequence's `off`.
__device__ __forceinline__ bool visible(const Params& p, const Launch& L, int lk, int off, int r, int j) {
    if (j >= lk) return false;
    if ((L.flags & FLAG_RIGHT_BOUND) && j > r + off) return false;
    if (L.window_left && j <= r + off - L.window_left) return false;
    return true;
}

// The cache rows query row r may see: [lo, hi] (SPEC 6; empty when lo > hi).
__device__ __forceinline__ void visible_range(const Params& p, const Launch& L, int lk, int off, int r, int& lo,
                                              int& hi) {
    hi = (L.flags & FLAG_RIGHT_BOUND) ? min(lk - 1, r + off) : lk - 1;
    lo = L.window_left ? r + off - L.window_left + 1 : 0;
}

// The description's class of query rows [ra, rb) (non-empty, below lq) and step t (below
// the cache's steps): 0 no pair visible, 2 every pair visible and the step whole, 1 else.
__device__ __forceinline__ int described_class(const Params& p, const Launch& L, int lk, int off, int ra, int rb,
                                               int t) {
    const int c0 = t * STEP, c1 = min(c0 + STEP, lk);
    const bool right = (L.flags & FLAG_RIGHT_BOUND) != 0;
    if (right && c0 > rb - 1 + off) return 0;
    if (L.window_left && c1 - 1 <= ra + off - L.window_left) return 0;
    bool full = c0 + STEP <= lk;
    if (right && c1 - 1 > ra + off) full = false;
    if (L.window_left && c0 <= rb - 1 + off - L.window_left) full = false;
    return full ? 2 : 1;
}

// The steps query rows [ra, rb) (non-empty, below lq) can see: [lo, hi], empty if lo > hi.
__device__ __forceinline__ void visible_steps(const Params& p, const Launch& L, int lk, int off, int ra, int rb,
                                              int& lo, int& hi) {
    lo = 0;
    hi = (lk + STEP - 1) / STEP - 1;
    if (L.flags & FLAG_RIGHT_BOUND) {
        const int last = rb - 1 + off;
        hi = last < 0 ? -1 : min(hi, last / STEP);
    }
    if (L.window_left) {
        const int first = ra + off - L.window_left + 1;
        if (first > 0) lo = first / STEP;
    }
}

// The class of an m-tile from the description's and the table's (2 without a mask).
__device__ __forceinline__ int combine_class(int described, int table) {
    return (described == 0 || table == 0) ? 0 : (described == 2 && table == 2 ? 2 : 1);
}

// The walk over the steps a CTA's query rows compute: by the description, the steps
// [lo, hi] (visible_steps); with an explicit mask, those of them some byte of table rows
// [tr_first, tr_last] does not skip.
//
// The table is read a window of 32 steps at a time (lane l: step win + l), the bytes of
// the CTA's table rows packed in one word per lane (byte i: table row tr_first + i), so a
// step costs two ballots and a shuffle, not a load whose latency each step would wait on
// before its first product. CAP: the table rows a CTA's rows can span, 4 (a u32) or 8 (a
// u64, a query pair's rows); the smaller word keeps registers for the products. A CTA's
// first query row is a multiple of its queries_per_cta, a power of two like the table's
// tile rows, so its rows span at most max(1, rows / bq) table rows; the mainloops assert
// that this is at most CAP.
template <int CAP> struct PackedBytes;
template <> struct PackedBytes<4> { typedef u32 T; };
template <> struct PackedBytes<8> { typedef u64 T; };

// LOADS: the table loads a lane has in flight when it reads a window (all CAP by default; a
// warp short of registers, the pipeline's producer, reads fewer at a time).
template <int CAP, int LOADS = CAP>
struct Walk {
    typedef typename PackedBytes<CAP>::T W;
    const u8* blk;  // the sequence's table, or null without a mask
    int steps;      // the table's row stride (its columns)
    int lo, hi, tr_first, tr_last;
    int bq;                 // the table's rows per tile
    int win = -0x40000000;  // the window's first step (none read yet)
    W bytes = 0;            // this lane's bytes of step win + lane

    __device__ __forceinline__ void init(const u8* table, int table_steps, int rows_per_tile, int ra, int rb) {
        blk = table;
        steps = table_steps;
        bq = rows_per_tile;
        tr_first = ra / bq;
        tr_last = (rb - 1) / bq;
    }

    __device__ __forceinline__ void read_window(int base, int lane) {
        win = base;
        const int s = base + lane;
        W b = 0;
#pragma unroll LOADS
        for (int i = 0; i < CAP; ++i) {
            // Independent loads, issued together.
            if (s <= hi && tr_first + i <= tr_last) b |= (W)blk[(i64)(tr_first + i) * steps + s] << (8 * i);
        }
        bytes = b;
    }

    // The first step after `t` that is walked (past hi: none); in `need_mask` whether some
    // byte of it is 1 (its mask tile is read), in `step_bytes` its packed bytes (for
    // table_byte).
    __device__ __forceinline__ int next(int t, int lane, bool& need_mask, W& step_bytes) {
        const int start = max(t + 1, lo);
        need_mask = false;
        step_bytes = 0;
        if (blk == nullptr) return start <= hi ? start : hi + 1;
        for (int base = start; base <= hi;) {
            if (base >= win + 32) read_window(base, lane);  // base is the same in every lane
            const int s = win + lane;
            bool act = false, nm = false;
#pragma unroll
            for (int i = 0; i < CAP; ++i) {
                const u32 b = (u32)(bytes >> (8 * i)) & 0xffu;
                act |= b != 0;
                nm |= b == 1;
            }
            const bool in = s >= base && s <= hi;
            const u32 ba = __ballot_sync(0xffffffffu, in && act);
            const u32 bm = __ballot_sync(0xffffffffu, in && nm);
            if (ba) {
                const int f = __ffs(ba) - 1;
                need_mask = (bm >> f) & 1u;
                step_bytes = __shfl_sync(0xffffffffu, bytes, f);
                return win + f;
            }
            base = win + 32;
        }
        return hi + 1;
    }

    // The table byte of query rows from `ra` (below lq, among the CTA's rows) in a step
    // that next() returned with `step_bytes`; 2 without a mask.
    __device__ __forceinline__ int table_byte(int ra, W step_bytes) const {
        if (blk == nullptr) return 2;
        return (int)(step_bytes >> (8 * (ra / bq - tr_first))) & 0xff;
    }
};
