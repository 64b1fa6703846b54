// Part of shaders/flash_attn_prefill_tensor.cu: the Hopper form (sm_90a; wgmma, CTA pairs).
#pragma once

#include "flash_attn_prefill/epilogue.cuh"
#include "flash_attn_prefill/loaders.cuh"
#include "flash_attn_prefill/softmax.cuh"
#include "flash_attn_prefill/mainloop_sm90_ws.cuh"
#include "flash_attn_prefill/paged_tma.cuh"
#include "flash_attn_prefill/sm90_ptx.cuh"
#include "flash_attn_prefill/tiles_sm90.cuh"

// ================================================================== Hopper (sm_90a): wgmma
//
// The same computation with warpgroup MMA: 2 warpgroups of 4 warps; a warpgroup owns 64
// (query, head) rows, each warp 16 of them. Q, K and V sit in shared memory in the
// 128-byte-swizzle layout wgmma reads ([D / 64 atoms][rows][64 halves], 16-byte chunk c
// of row r at chunk c ^ (r % 8)), so both products read their operands from shared memory
// once per warpgroup instead of once per warp.
//
// Head dims 64, 128 and 256 (DW = D): each warpgroup computes the scores of its 64 rows
// over the whole step (m64n64k16) and keeps its 64 x D block of O in registers
// (m64nDk16); the scores become P in registers and P is the A operand of P V (no
// shared-memory round trip).
// K, V and the mask tile are double-buffered: the next step loads during this one.
// The products in T: half, or bfloat16 with BF16 K/V (common.cuh).
// Head dim 512: O (64 x 512) needs both warpgroups: each takes 256 of the output columns
// and 32 of the 64 score columns of the step (m64n32k16), the row maxima are exchanged
// through shared memory, and each warpgroup's half of P goes through shared memory to the
// other. Single-buffered (the tiles take 192 KB).
// Head dim 256 in CTA pairs (fixed-length K/V the TMA can address): the warp-specialised
// pipeline of mainloop_sm90_ws.cuh (a producer warpgroup; the two consumer warpgroups
// synchronise on mbarriers, not on CTA barriers, and take turns at the tensor cores).
// Head dims 64 and 128 in CTA pairs: mainloop_sm90_pipe.cuh (tiles of 128 cache rows). The
// shapes of every form: tiles_sm90.cuh.
namespace hopper {

template <int D>
struct HCfg {
    static_assert(D == 64 || D == 128 || D == 256 || D == 512, "the wgmma form's head dims");
    static constexpr int G = D > 256 ? D / 256 : 1;  // warpgroups per row group
    static constexpr int RG = 2 / G;           // row groups of 64 rows
    static constexpr int ROWS = RG * 64;       // (query, head) rows of a CTA
    static constexpr int JW = STEP / G;        // score columns of a warpgroup
    static constexpr int NS = JW / 2;          // score registers per thread
    static constexpr int NB = JW / 8;          // 8-column blocks of the scores
    static constexpr int DW = D / G;           // O columns of a warpgroup
    // Two CTAs share an SM at head dims 64 and 128 (MINB; the softmax and products of one
    // overlap the other's), though ptxas spills a little at 128 registers; the K/V buffers
    // (NSTAGE) and the reasons: tiles_sm90.cuh.
    static constexpr int NSTAGE = Tiles<D>::NSTAGE;
    static constexpr int MINB = Tiles<D>::MINB;
    static constexpr int BQ = D <= 256 ? 32 : 16;  // the table's rows (the op's mask_tile_rows)
    static constexpr int Q_BYTES = ROWS * D * 2;
    static constexpr int KV_BYTES = STEP * D * 2;
    static constexpr int MASK_BYTES = ROWS * STEP * 2;
    static constexpr int P_BYTES = G > 1 ? 2 * 4 * 2 * 32 * 16 : 0;  // [warpgroup][warp][k-chunk][lane]
    static constexpr int RED_BYTES = G > 1 ? 2 * 64 * 4 : 0;          // [warpgroup][row]
    static constexpr int BAR_BYTES = D == 256 ? 128 : 64;  // the CTA-pair forms' mbarriers (WS_BAR_BYTES at 256)
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

#if MLXN_PAGED_ENTRIES
// Paged K/V (SPEC 11): load_kv_tile of the 64 cache rows from row `j0` of this CTA's
// sequence, each found through the block table (kv_row_paged) from `src`, the head's column
// 0 in block 0; rows at or past `nvalid` are zeros and are not read (nor is their table
// entry). The same threads, chunks and shared layout as load_kv_tile.
template <int D>
__device__ __forceinline__ void load_kv_tile_paged(u32 dst, const u16* __restrict__ src, const Launch& L,
                                                   i64 block_stride, i64 row_stride, int j0, int nvalid,
                                                   bool aligned) {
    constexpr int CH = D / 8, RPI = NTHREADS / CH;
    const int c = threadIdx.x % CH, r0 = threadIdx.x / CH;
    const u16* s0 = src + c * 8;
    const u32 d0 = dst + (u32)((c >> 3) * STEP * 128 + r0 * 128);
    const u32 sw[2] = {(u32)(((c & 7) ^ (r0 & 7)) << 4), (u32)(((c & 7) ^ ((r0 + 4) & 7)) << 4)};
#pragma unroll 4
    for (int n = 0; n < STEP / RPI; ++n) {
        const int r = r0 + n * RPI;
        const bool in = r < nvalid;
        const u16* s = in ? s0 + kv_row_paged(L, j0 + r, block_stride, row_stride) : s0;
        copy8_f16(d0 + (u32)(n * RPI * 128) + sw[RPI % 8 == 0 ? 0 : (n & 1)], s, aligned, in);
    }
}
#endif

// The class of a warp's 16 rows in a step (0 skip, 1 masked, 2 full) and their table byte.
struct RowsClass {
    int cls = 0, table = 0;
};

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
// WS: the warp-specialised pipeline (mainloop_sm90_ws.cuh) instead of the loops below.
// In the paged module (MLXN_PAGED_ENTRIES; the one-CTA form's NAME_paged entry) K/V are
// read through the launch block's table (SPEC 11): a module of its own, so that the
// contiguous entries compile as before (a runtime branch between the loaders made d128
// spill more).
template <int D, int PAIR = PAIR_NONE, class T = ElemF16, bool WS = false>
__device__ __forceinline__ void attention(const Params& p, const Launch& L, const unsigned char* __restrict__ q,
                                          const u16* __restrict__ k, const u16* __restrict__ v,
                                          const u16* __restrict__ mask, const u8* __restrict__ blk,
                                          void* __restrict__ out, float* __restrict__ lse,
                                          const int* __restrict__ cu_q, const int* __restrict__ cu_k,
                                          const float* __restrict__ sinks,
                                          const TMap* kmap = nullptr, const TMap* vmap = nullptr) {
    typedef HCfg<D> C;
    static_assert(!WS || (PAIR != PAIR_NONE && C::G == 1 && C::NSTAGE == 2), "the warp-specialised form: pairs, double-buffered");
    static_assert(WS || PAIR == PAIR_NONE || C::NSTAGE == 1, "double-buffered pairs are the warp-specialised form");
    static_assert(!WS || C::BAR_BYTES >= WS_BAR_BYTES, "the pipeline's mbarriers fit HCfg::BAR_BYTES");
    static_assert(!MLXN_PAGED_ENTRIES || PAIR == PAIR_NONE || WS,
                  "paged K/V: the one-CTA form, or the warp-specialised pair form (its boxes through the table)");
    extern __shared__ __align__(1024) unsigned char smem[];
    const u32 s_base = (smem_addr(smem) + 1023u) & ~1023u;  // swizzle atoms need 1 KB alignment
    const u32 s_q = s_base;
    const u32 s_kv = s_q + C::Q_BYTES;                       // stage i: K, then V
    const u32 s_mask = s_kv + C::NSTAGE * 2 * C::KV_BYTES;  // stage i
    const u32 s_p = s_mask + C::NSTAGE * C::MASK_BYTES;
    const u32 s_red = s_p + C::P_BYTES;
    const u32 s_bar = s_red + C::RED_BYTES;  // PAIR: the mbarriers (K and V at 512; the WS pipeline's at 256)

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g8 = lane >> 2, tig = lane & 3;
    // The warpgroup index, broadcast so the compiler knows it is warp-uniform: what is
    // derived from it (descriptors) then lives in uniform registers.
    const int wgi = __shfl_sync(0xffffffffu, tid >> 7, 0), wq = warp & 3;
    const int rg = wgi / C::G, ch = wgi % C::G;    // row group, column half (head dim 512)
    const int hpc = L.heads_per_cta, qpc = L.queries_per_cta;
#if MLXN_PAGED_ENTRIES
    // Split-KV: this part's out and lse; the length from seqused_k, the rows through the table.
    const Seq sq = with_pages(cta_seq(p, L, cu_q, cu_k), L);
#else
    const Seq sq = cta_seq(p, L, cu_q, cu_k);  // split-KV: this part's out and lse
#endif
    const int lq = sq.lq, lk = sq.lk, off = query_offset(p, L, lq, lk);
    const int q_tiles = (lq + qpc - 1) / qpc;       // this sequence's CTAs along the rows
    const int qt = q_tiles - 1 - (int)cta_xy(L).x;  // longest causal rows first
    if constexpr (PAIR == PAIR_QUERIES) {
        if (q_tiles - 1 - (int)(cta_xy(L).x & ~1u) < 0) return;  // both CTAs of the pair are empty
    } else {
        if (qt < 0) return;  // no rows here (for the head pairs: in both CTAs alike)
    }
    const int q_cta = qt >= 0 ? qt * qpc : lq;     // qt < 0: a query pair's empty CTA
    const int r0 = rg * 64 + wq * 16;              // first CTA row of this warp
    const int head = (int)cta_xy(L).y * hpc + r0 / qpc;
    const int q_loc = r0 % qpc;                    // first query of the warp, inside the CTA
    const int q0 = q_cta + q_loc;
    const int group = p.n_heads / p.n_kv_heads;
    const int kvh = ((int)cta_xy(L).y * hpc) / group;

    // ---- Q: qh = T(scale * q) in the atom layout; rows past lq zero (by the consumers).
    // QB chunks a thread at a time, all loaded before any is converted: loading and
    // converting one chunk at a time waited on each load in turn (16 in a row at head dim
    // 256: a fifth of a short walk's samples, the sliding layer's).
    if (!WS || tid < NTHREADS) {
        constexpr int CH = D / 8, QB = 4;
        static_assert(C::ROWS * CH % (NTHREADS * QB) == 0, "whole batches of Q chunks");
        for (int i0 = tid; i0 < C::ROWS * CH; i0 += NTHREADS * QB) {
            u32 raw[QB][8];
#pragma unroll
            for (int b = 0; b < QB; ++b) {
                const int i = i0 + b * NTHREADS, r = i / CH;
                load_q_chunk_raw(raw[b], p, L, sq, q, q_cta + r % qpc, (int)cta_xy(L).y * hpc + r / qpc, i % CH);
            }
#pragma unroll
            for (int b = 0; b < QB; ++b) {
                const int i = i0 + b * NTHREADS;
                u32 w[4];
                q_from_raw<T>(w, raw[b], p.q_dtype, p.scale);
                st_shared_v4(s_q + atom_off(C::ROWS, i / CH, i % CH), w[0], w[1], w[2], w[3]);
            }
        }
    }

    // ---- The steps walked: those of this CTA's rows, or of both CTAs' of a query pair
    // (the description's steps, and the table's); the classes of this warp's rows.
    int wa = q_cta, we = min(q_cta + qpc, lq);  // the rows walked, [wa, we)
    if constexpr (PAIR == PAIR_QUERIES) {
        wa = 0x7fffffff;
        we = -1;
        for (int m = 0; m < 2; ++m) {
            const int qm = q_tiles - 1 - (int)((cta_xy(L).x & ~1u) + m);
            if (qm >= 0) {
                wa = min(wa, qm * qpc);
                we = max(we, min(qm * qpc + qpc, lq));
            }
        }
    }
    const bool by_distance = alibi_by_distance(p);
    constexpr int CAP = PAIR == PAIR_QUERIES ? 8 : 4;
    static_assert(C::ROWS / C::BQ * (PAIR == PAIR_QUERIES ? 2 : 1) <= CAP, "the table rows a walk can span");
    Walk<CAP> walk;
    typedef typename decltype(walk)::W TB;  // a step's packed table bytes
    walk.init((p.flags & PREFILL_MASK) ? blk + sq.blk : nullptr, p.blk_steps, C::BQ, wa, we);
    visible_steps(p, L, lk, off, wa, we, walk.lo, walk.hi);
    narrow_to_part(L.kv_split_log2, cta_part(L), walk.lo, walk.hi);  // split-KV: this part's share
    const int steps = walk.hi + 1;  // the loops below walk t < steps
    // The class of 16 rows from `ra` in step t (and its table byte; `sb`: the step's packed
    // bytes, from next_active): 0 where no row is.
    auto rows_class = [&](int ra, int t, TB sb, int& table) -> int {
        if (ra >= lq) {
            table = 0;
            return 0;
        }
        table = walk.table_byte(ra, sb);
        const int c = combine_class(described_class(p, L, lk, off, ra, min(ra + 16, lq), t), table);
        return c == 2 && by_distance ? 1 : c;  // ALiBi by distance: a bias on every pair
    };
    auto next_active = [&](int t, bool& need_mask, TB& sb) -> int { return walk.next(t, lane, need_mask, sb); };
    // WS: rows_class of this warp's rows, taken while the step's products run.
    auto step_class = [&](int t, TB sb) -> RowsClass {
        RowsClass c;
        c.cls = rows_class(q0, t, sb, c.table);
        return c;
    };

#if !MLXN_QUANT_ENTRIES
    const u16* k_base = k + sq.k + (i64)kvh * p.k_head_stride;
    const u16* v_base = v + sq.v + (i64)kvh * p.v_head_stride;
#endif
    const bool k_al = (L.flags & FLAG_K_ALIGNED) != 0;
    const bool v_al = (L.flags & FLAG_V_ALIGNED) != 0;
    const bool m_al = (L.flags & FLAG_MASK_ALIGNED) != 0;
    // (Paged K/V: the params block's K/V batch strides are the caches' block strides.)
#if MLXN_QUANT_ENTRIES
    // Quantised K/V (the quant modules): the bytes widened to F16 in the atom layout, K/V's
    // offsets and strides in bytes; K's descale factor multiplies the scores.
    static_assert(PAIR == PAIR_NONE && !WS, "quantised K/V: the one-CTA form (the TMA cannot widen)");
    const u8* kq_base = reinterpret_cast<const u8*>(k) + sq.k + (i64)kvh * p.k_head_stride;
    const u8* vq_base = reinterpret_cast<const u8*>(v) + sq.v + (i64)kvh * p.v_head_stride;
    const float kd = kdescale(p, L, kvh);
    auto atom = [](int r, int c) -> u32 { return (u32)((c >> 3) * STEP * 128 + r * 128) + (u32)(((c & 7) ^ (r & 7)) << 4); };
    auto load_k = [&](int stage, int t) {
        const u32 dst = s_kv + stage * 2 * C::KV_BYTES;
#if MLXN_PAGED_ENTRIES
        load_rows_quant<D>(dst, atom, kq_base, L, p.k_batch_stride, p.k_row_stride, t * STEP, lk - t * STEP,
                           p.kv_dtype, k_al);
#else
        load_rows_quant<D>(dst, atom, kq_base + (i64)t * STEP * p.k_row_stride, L, 0, p.k_row_stride, 0,
                           lk - t * STEP, p.kv_dtype, k_al);
#endif
    };
    auto load_v = [&](int stage, int t) {
        const u32 dst = s_kv + stage * 2 * C::KV_BYTES + C::KV_BYTES;
#if MLXN_PAGED_ENTRIES
        load_rows_quant<D>(dst, atom, vq_base, L, p.v_batch_stride, p.v_row_stride, t * STEP, lk - t * STEP,
                           p.kv_dtype, v_al);
#else
        load_rows_quant<D>(dst, atom, vq_base + (i64)t * STEP * p.v_row_stride, L, 0, p.v_row_stride, 0,
                           lk - t * STEP, p.kv_dtype, v_al);
#endif
    };
#else
    auto load_k = [&](int stage, int t) {
        const u32 dst = s_kv + stage * 2 * C::KV_BYTES;
#if MLXN_PAGED_ENTRIES
        load_kv_tile_paged<D>(dst, k_base, L, p.k_batch_stride, p.k_row_stride, t * STEP, lk - t * STEP, k_al);
#else
        load_kv_tile<D>(dst, k_base + (i64)t * STEP * p.k_row_stride, p.k_row_stride, lk - t * STEP, k_al);
#endif
    };
    auto load_v = [&](int stage, int t) {
        const u32 dst = s_kv + stage * 2 * C::KV_BYTES + C::KV_BYTES;
#if MLXN_PAGED_ENTRIES
        load_kv_tile_paged<D>(dst, v_base, L, p.v_batch_stride, p.v_row_stride, t * STEP, lk - t * STEP, v_al);
#else
        load_kv_tile<D>(dst, v_base + (i64)t * STEP * p.v_row_stride, p.v_row_stride, lk - t * STEP, v_al);
#endif
    };
#endif
    auto load_mask = [&](int stage, int t) {
        load_mask_tile(s_mask + stage * C::MASK_BYTES, mask + sq.mask, p, lq, lk, q_cta, qpc, t, m_al);
    };

    // ---- State: this warp's 16 rows x DW columns of O, running max and partial sums.
    float o[C::DW / 2];
#pragma unroll
    for (int i = 0; i < C::DW / 2; ++i) o[i] = 0.f;
    float m_run[2] = {NEG_FLT_MAX_HALF, NEG_FLT_MAX_HALF};
    float l_run[2] = {0.f, 0.f};
    u32 pk[C::NB][2];  // P of this warpgroup's score columns, half2 pairs (mma A-fragment halves)

    // Scores of step t from stage `stage`; P left in pk. Returns whether the warpgroup
    // computed (it skips when every one of its 64 rows skips the step).
    // Whether the warpgroup computes step t: some pair of its rows is visible and some
    // table byte of its rows is not 0. Its warps' rows are queries [ua, ub) of the CTA's
    // heads (qpc queries when they are at most 64, else this row group's 64). Both tests
    // over the union are "some warp's" tests: a pair visible to the union is visible to
    // one of its 16-row parts (their visible cache rows are overlapping intervals), but
    // the byte that is not 0 may be another part's; a warp whose own class is 0 then sets
    // its scores to -inf, as it does when another warp of the warpgroup computes.
    // The union's bounds are the same at every step: computed once, here (inside the lambda
    // the compiler left a division by qpc in every step, 11% of a consumer's samples).
    const int wg_ua = q_cta + (rg * 64) % qpc, wg_ub = min(wg_ua + min(64, qpc), lq);
    auto wg_computes = [&](int t, TB sb) -> bool {
        const int ua = wg_ua, ub = wg_ub;
        if (ua >= lq) return false;
        if (described_class(p, L, lk, off, ua, ub, t) == 0) return false;
        if (walk.blk == nullptr) return true;
        const int i0 = ua / C::BQ - walk.tr_first, n = (ub - 1) / C::BQ - ua / C::BQ + 1;
        TB bytes = sb >> (8 * i0);
        if (n < CAP) bytes &= ((TB)1 << (8 * n)) - 1;
        return bytes != 0;
    };

    // S = Q K^T of the step in `stage`, into s (this thread's scores): issued and
    // committed; the caller waits.
    auto qk_issue = [&](int stage, float (&s)[C::NS]) {
        // WS: the stage broadcast, so the compiler knows it is warp-uniform and keeps the
        // descriptors in uniform registers (else each product's costs 64-bit adds and moves).
        if constexpr (WS) stage = __shfl_sync(0xffffffffu, stage, 0);
        // Descriptors of k-chunk kc = the tile's descriptor + the chunk's offset / 16
        // (addresses stay below 2^18, so the 14-bit address field never carries).
        const u64 db0 = desc_sw128(s_kv + stage * 2 * C::KV_BYTES + (u32)(ch * C::JW * 128), 16, 1024);
        const u64 da0 = desc_sw128(s_q + (u32)(rg * 64 * 128), 16, 1024);
        wgmma_fence();
#pragma unroll
        for (int kc = 0; kc < D / 16; ++kc) {
            const u64 da = da0 + (u64)(((kc >> 2) * C::ROWS * 128 + (kc & 3) * 32) >> 4);
            const u64 db = db0 + (u64)(((kc >> 2) * STEP * 128 + (kc & 3) * 32) >> 4);
            if constexpr (C::JW == 64) wgmma_ss_n64<T>(s, da, db, kc > 0);
            else wgmma_ss_n32<T>(s, da, db, kc > 0);
        }
        wgmma_commit();
    };
    // WS: the scores, written by the Q K^T its pipeline issues before this step's softmax;
    // `act` and `rc` are the step's wg_computes and step_class, which its pipeline computes
    // while the products run (computing them here, after the products, lengthens the
    // softmax's critical path: 8% at causal 16k for wg_computes alone).
    float s_ws[C::NS];  // unused (and dropped by the compiler) in the other forms
    auto scores_and_softmax = [&](int t, int stage, TB sb, bool act = false, RowsClass rc = {}) -> bool {
        int tb = rc.table, b = rc.cls;
        if constexpr (!WS) b = rows_class(q0, t, sb, tb);
        const bool wg_active = WS ? act : wg_computes(t, sb);
        float mx[2] = {0.f, 0.f};
        float s_own[C::NS];
        float(&s)[C::NS] = WS ? s_ws : s_own;
        if (wg_active) {
            if constexpr (!WS) {
                qk_issue(stage, s);
                wgmma_wait0();
                fence_regs(s);
            }
#if MLXN_QUANT_ENTRIES
            // SPEC 11: K's value is descale * x; the product took x.
#pragma unroll
            for (int i = 0; i < C::NS; ++i) s[i] *= kd;
#endif
            if (p.softcap > 0.f) {
                const float inv = 1.f / p.softcap;
#pragma unroll
                for (int i = 0; i < C::NS; ++i) s[i] = softcap_score(s[i], p.softcap, inv);
            }
            if (p.flags & PREFILL_ALIBI_SLOPES) {
                // ALiBi's slopes given as data: s - slope * |j - p_r| on every computed pair,
                // before the pairs not visible become -inf below.
                const float slope = alibi_given_slope(p, L, head);
                alibi_distance_bias<C::NB>(s, slope, alibi_d0(L, t * STEP, ch * C::JW, tig, q0, 0, g8, off));
            }
            if (b == 1) {
                // -inf where a pair is not visible, the mask (times ALiBi's slope) where the
                // table's byte is 1, or ALiBi's distance bias.
                const u32 m_tile = s_mask + stage * C::MASK_BYTES;
                const float ninf = -__int_as_float(0x7f800000);
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int rr = q_loc + hh * 8 + g8;
                    const u32 row_addr = m_tile + (u32)(rr * 128) + (u32)(tig * 4);
                    // The row's visible columns, relative to this thread's first one.
                    int vlo, vhi;
                    visible_range(p, L, lk, off, q_cta + rr, vlo, vhi);
                    const int j0 = t * STEP + ch * C::JW + tig * 2;  // this thread's first column
                    vlo -= j0;
                    vhi -= j0;
                    const float d0 = (float)(j0 - (q_cta + rr + off - L.window_right));  // j0 - p_r
                    const float slope = alibi_slope(p, head);
#pragma unroll
                    for (int nb = 0; nb < C::NB; ++nb) {
                        float lo = 0.f, hi = 0.f;
                        if (tb == 1) {
                            unpack_half2(ld_shared_u32(row_addr + swz(ch * C::NB + nb, g8)), lo, hi);
                            lo *= slope;
                            hi *= slope;
                        } else if (by_distance) {
                            lo = slope * (d0 + (float)(nb * 8));
                            hi = slope * (d0 + (float)(nb * 8 + 1));
                        }
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
            for (int hh = 0; hh < 2; ++hh) any_rescale |= softmax_rescale(mx[hh], m_run[hh], ms[hh]);
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const float mr = m_run[hh];
                float sum = 0.f;
#pragma unroll
                for (int nb = 0; nb < C::NB; ++nb) pk[nb][hh] = softmax_p2<T>(s[nb * 4 + hh * 2], s[nb * 4 + hh * 2 + 1], mr, sum);
                l_run[hh] = l_run[hh] * ms[hh] + sum;
            }
            if (__any_sync(0xffffffffu, any_rescale)) {
#pragma unroll
                for (int i = 0; i < C::DW / 2; ++i) o[i] *= ms[(i >> 1) & 1];
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

    // O += P V for the step, from stage `stage` (P in pk, or in shared memory at 512):
    // issued and committed; pk and o stay the product's until the caller waits.
    auto pv_issue = [&](int stage) {
        if constexpr (WS) stage = __shfl_sync(0xffffffffu, stage, 0);  // as in qk_issue
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
        for (int kc = 0; kc < 4; ++kc) wgmma_rs<T, C::DW>(o, a[kc], dv0 + (u64)((kc * 16 * 128) >> 4));
        wgmma_commit();
    };
    auto pv = [&](int stage) {
        pv_issue(stage);
        wgmma_wait0();
        fence_regs(o);
    };

    // PAIR: this CTA's half of a tile's boxes (64 rows x 64 halves, 8 KB each), for both.
    // Paged (the WS form): each box as boxes of a block's rows through the table
    // (paged_tma.cuh; V's rows past the cache's end are zeroed by v_in below).
    auto tma_half = [&](const TMap* map, u32 dst, u32 bar, int t) {
        const int rank = (int)cluster_rank();
#pragma unroll
        for (int i = 0; i < D / 128; ++i) {
            const int cb = rank * (D / 128) + i;
#if MLXN_PAGED_ENTRIES
            tma_box_paged(dst + (u32)(cb * STEP * 128), map, L, cb, kvh, t * STEP, lk, bar, 3);
#else
            tma_load_4d_mc(dst + (u32)(cb * STEP * 128), map, cb * 64, kvh, t * STEP, cta_sequence(L), bar, 3);
#endif
        }
    };
    if constexpr (PAIR != PAIR_NONE && !WS) {
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
    TB sb = 0;  // step t's table bytes
    int t = next_active(-1, need_mask, sb);
    if constexpr (WS) {
        auto qk_ws = [&](int st) { qk_issue(st, s_ws); };
        auto issue_k = [&](int st, int t, u32 bar) { tma_half(kmap, s_kv + st * 2 * C::KV_BYTES, bar, t); };
        auto issue_v = [&](int st, int t, u32 bar) { tma_half(vmap, s_kv + st * 2 * C::KV_BYTES + C::KV_BYTES, bar, t); };
        auto load_mask_warp = [&](int st, int t, int lane) {
            load_mask_tile(s_mask + st * C::MASK_BYTES, mask + sq.mask, p, lq, lk, q_cta, qpc, t, m_al, lane, 32);
        };
        // V of step t in stage st: paged, its rows past the cache's end zeroed in this CTA's
        // copy before the warpgroup's product (paged_tma.cuh; its barrier 3 + wgi: the turns
        // are 1 and 2).
        auto v_in = [&](int st, int t) {
#if MLXN_PAGED_ENTRIES
            st = __shfl_sync(0xffffffffu, st, 0);
            zero_v_past_end<D>(s_kv + st * 2 * C::KV_BYTES + C::KV_BYTES, STEP, lk - t * STEP, 3 + wgi);
#else
            (void)st;
            (void)t;
#endif
        };
        if (!ws_pipeline(s_bar, C::KV_BYTES, steps, t, need_mask, sb, s_ws, o, next_active, wg_computes, step_class, qk_ws,
                         pv_issue, scores_and_softmax, issue_k, issue_v, load_mask_warp, v_in))
            return;  // the producer warpgroup
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
            TB sbn;
            const int tn = next_active(t, nm, sbn);
            if (tn < steps) {
                load_k(stage ^ 1, tn);
                load_v(stage ^ 1, tn);
                if (nm) load_mask(stage ^ 1, tn);
                cp_async_commit();
            }
            if (scores_and_softmax(t, stage, sb)) pv(stage);
            stage ^= 1;
            t = tn;
            sb = sbn;
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
            TB sbn;
            const int tn = next_active(t, nm, sbn);
            const bool act = scores_and_softmax(t, 0, sb);  // arrives once its Q K^T is done
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
            sb = sbn;
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
            TB sbn;
            const int tn = next_active(t, nm, sbn);
            const bool act = scores_and_softmax(t, 0, sb);
            // Every warpgroup's Q K^T finished before the exchange barrier inside (at 512;
            // one warpgroup per row group has none, so a barrier here): K is free. K of the
            // next step loads while P V runs and the next step starts.
            if constexpr (C::G == 1) __syncthreads();
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
            sb = sbn;
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
        float o_scale;
        softmax_sink(p, sinks, head, m_run[hh], lt[hh], o_scale);
#if MLXN_QUANT_ENTRIES
        const float inv = lt[hh] > 0.f ? o_scale / lt[hh] * vdescale(p, L, kvh) : 0.f;  // V's factor
#else
        const float inv = lt[hh] > 0.f ? o_scale / lt[hh] : 0.f;
#endif
        const i64 dst = sq.o + (i64)r * p.o_row_stride + (i64)head * p.o_head_stride + wd0 + tig * 2;
#pragma unroll
        for (int nb = 0; nb < C::DW / 8; ++nb)
            store_out2(out, p.o_dtype, dst + nb * 8, o[nb * 4 + hh * 2] * inv, o[nb * 4 + hh * 2 + 1] * inv, out_al);
        if ((p.flags & PREFILL_LSE) && ch == 0 && tig == 0)
            lse[sq.lse + (i64)head * p.lse_head_stride + r] = lse_of(m_run[hh], lt[hh]);
    }
    if constexpr (WS) cluster_wait();  // the partner no longer touches this CTA's shared memory
}

static_assert(HCfg<64>::SMEM == 83008, "Hopper d64 shared memory changed: update the CUDA backend");
static_assert(HCfg<128>::SMEM == 83008, "Hopper d128 shared memory changed: update the CUDA backend");
static_assert(HCfg<256>::SMEM == 230528, "Hopper d256 shared memory changed: update the CUDA backend");
static_assert(HCfg<512>::SMEM == 214592, "Hopper d512 shared memory changed: update the CUDA backend");

}  // namespace hopper
