// Part of shaders/flash_attn_prefill_tensor.cu: the Hopper form's CTA-pair kernel at head
// dims 64 and 128 (tiles_sm90.cuh, PIPE 2) around the pipeline of pipeline_sm90.cuh: the
// rows of a CTA, its Q, the roles, the epilogue.
//
// The roles split first (as FlashAttention-3's kernel does) and each derives what it needs
// itself: ptxas holds what is live where the roles split within a few dozen registers, and
// spilled it there (the consumers reloaded it in their softmax). What is common is the
// shared memory's layout, the mbarriers and the early exit of an empty pair.
//
// The pair forms run where the host can address K and V by TMA: fixed-length batches
// (SPEC 7's variable length runs the one-CTA forms), so a sequence's rows are p.rows.
#pragma once

#include "flash_attn_prefill/epilogue.cuh"
#include "flash_attn_prefill/mainloop_sm90.cuh"
#include "flash_attn_prefill/pipeline_sm90.cuh"
#include "flash_attn_prefill/quant_pipe.cuh"

namespace hopper {

// The rows of one CTA of a pair: its sequence (split-KV: its part's out and lse), its query
// tile, and the rows its walk covers, [wa, we) (a query pair walks both CTAs' rows, so both
// walk the same tiles).
struct PairRows {
    Seq sq;
    int lq, lk, off, q_cta, wa, we;
};

template <int PAIR>
__device__ __forceinline__ PairRows pair_rows(const Params& p, const Launch& L, const int* __restrict__ cu_q,
                                              const int* __restrict__ cu_k) {
    PairRows r;
#if MLXN_PAGED_ENTRIES
    r.sq = with_pages(cta_seq(p, L, cu_q, cu_k), L);  // the length from seqused_k; rows through the table
#else
    r.sq = cta_seq(p, L, cu_q, cu_k);
#endif
    r.lq = r.sq.lq;
    r.lk = r.sq.lk;
    r.off = query_offset(p, L, r.lq, r.lk);
    const int qpc = L.queries_per_cta, q_tiles = (r.lq + qpc - 1) / qpc;
    const int qt = q_tiles - 1 - (int)cta_xy(L).x;  // longest causal rows first
    r.q_cta = qt >= 0 ? qt * qpc : r.lq;            // qt < 0: a query pair's empty CTA
    r.wa = r.q_cta;
    r.we = min(r.q_cta + qpc, r.lq);
    if constexpr (PAIR == PAIR_QUERIES) {
        r.wa = 0x7fffffff;
        r.we = -1;
        for (int m = 0; m < 2; ++m) {
            const int qm = q_tiles - 1 - (int)((cta_xy(L).x & ~1u) + m);
            if (qm >= 0) {
                r.wa = min(r.wa, qm * qpc);
                r.we = max(r.we, min(qm * qpc + qpc, r.lq));
            }
        }
    }
    return r;
}

// Whether neither CTA of the pair has rows (both return before any barrier).
template <int PAIR>
__device__ __forceinline__ bool pair_is_empty(const Params& p, const Launch& L) {
    const int q_tiles = (p.rows + L.queries_per_cta - 1) / L.queries_per_cta;
    return q_tiles - 1 - (int)(PAIR == PAIR_QUERIES ? cta_xy(L).x & ~1u : cta_xy(L).x) < 0;
}

// The walk of a pair's CTA (block_range.cuh): the steps its rows [wa, we) see, by the
// description, its table and its share of a split.
template <int PAIR>
using PairWalk = Walk<PAIR == PAIR_QUERIES ? 8 : 4, 2>;  // two table loads in flight: the producer's registers are few

template <int PAIR>
__device__ __forceinline__ void pair_walk(PairWalk<PAIR>& walk, const Params& p, const Launch& L, const PairRows& r,
                                          const u8* __restrict__ blk) {
    walk.init((p.flags & PREFILL_MASK) ? blk + r.sq.blk : nullptr, p.blk_steps, 32, r.wa, r.we);
    visible_steps(p, L, r.lk, r.off, r.wa, r.we, walk.lo, walk.hi);
    narrow_to_part(L.kv_split_log2, cta_part(L), walk.lo, walk.hi);
}

// A consumer warpgroup's 64 rows of Q into the atom layout: qh = T(scale * q), rows past lq
// zero. QB chunks a thread at a time, all loaded before any is converted (one at a time,
// each waited on its load: a fifth of a short walk's samples at head dim 256).
template <int D, int ROWS, class T>
__device__ __forceinline__ void load_q_rows(u32 s_q, int wgi, const Params& p, const Launch& L, const Seq& sq,
                                            const unsigned char* __restrict__ q, int q_cta) {
    constexpr int CH = D / 8, QB = 4;
    static_assert(64 * CH % (128 * QB) == 0, "whole batches of Q chunks");
    const int hpc = L.heads_per_cta, qpc = L.queries_per_cta;
    for (int i0 = (int)threadIdx.x & 127; i0 < 64 * CH; i0 += 128 * QB) {
        u32 raw[QB][8];
#pragma unroll
        for (int b = 0; b < QB; ++b) {
            const int i = i0 + b * 128, r = wgi * 64 + i / CH;
            load_q_chunk_raw(raw[b], p, L, sq, q, q_cta + r % qpc, (int)cta_xy(L).y * hpc + r / qpc, i % CH);
        }
#pragma unroll
        for (int b = 0; b < QB; ++b) {
            const int i = i0 + b * 128;
            u32 w[4];
            q_from_raw<T>(w, raw[b], p.q_dtype, p.scale);
            st_shared_v4(s_q + atom_off(ROWS, wgi * 64 + i / CH, i % CH), w[0], w[1], w[2], w[3]);
        }
    }
}

// A thread's two rows of O divided by their sums (SPEC 2 step 6, with SPEC 10's sink) in
// O's dtype, and their lse (SPEC 8). l_run: the thread's partial sums of its rows, or (WHOLE)
// the rows' whole sums (the tensor cores' m64n8 sums hold every column of a row).
template <int D, bool WHOLE>
__device__ __forceinline__ void store_rows(const Params& p, const Launch& L, const Seq& sq, int lq, int q0, int head,
                                           const float (&o)[D / 2], float (&m_run)[2], const float (&l_run)[2],
                                           void* __restrict__ out, float* __restrict__ lse,
                                           const float* __restrict__ sinks) {
    const int lane = threadIdx.x & 31, g8 = lane >> 2, tig = lane & 3;
    const bool out_al = (L.flags & FLAG_OUT_ALIGNED) != 0;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        float l = l_run[hh];
        if constexpr (!WHOLE) {  // the quad's partial sums, in a fixed order
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
        }
        const int r = q0 + hh * 8 + g8;
        if (r >= lq) continue;
        float o_scale;
        softmax_sink(p, sinks, head, m_run[hh], l, o_scale);
        const float inv = l > 0.f ? o_scale / l : 0.f;
        const i64 dst = sq.o + (i64)r * p.o_row_stride + (i64)head * p.o_head_stride + tig * 2;
#pragma unroll
        for (int nb = 0; nb < D / 8; ++nb)
            store_out2(out, p.o_dtype, dst + nb * 8, o[nb * 4 + hh * 2] * inv, o[nb * 4 + hh * 2 + 1] * inv, out_al);
        if ((p.flags & PREFILL_LSE) && tig == 0) lse[sq.lse + (i64)head * p.lse_head_stride + r] = lse_of(m_run[hh], l);
    }
}

// The producer's roles: warp 0 of its warpgroup the walk, told tile by tile, and K and V by
// TMA multicast; warp 1 the same walk and the mask tiles by cp.async. Quantised K/V
// (quant_pipe.cuh): warp 0's TMA copies each tile's bytes into the raw slots, and warps 2
// and 3 widen them into the stages.
template <int D, int PAIR, class PC>
__device__ __forceinline__ void pipe_producer(const PipeBars<PC::S>& bars, u32 s_q, const Params& p,
                                              const Launch& L, const u16* __restrict__ mask, const u8* __restrict__ blk,
                                              const int* __restrict__ cu_q, const int* __restrict__ cu_k,
                                              const TMap* kmap, const TMap* vmap) {
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
#if MLXN_QUANT_ENTRIES && !MLXN_PAGED_ENTRIES
    const RawBars<PC::RS> rb = raw_bars<PC>(bars);
    const u32 s_raw = s_q + PC::RAW;
    auto raw_k = [&](int st) { return s_raw + (u32)(st * 2 * PC::RAW_BYTES); };
    auto raw_v = [&](int st) { return s_raw + (u32)(st * 2 * PC::RAW_BYTES + PC::RAW_BYTES); };
    if (warp >= 4 - CONVERTERS) {
        const u32 s_stages = s_q + PC::Q_BYTES;
        auto stage_k = [&](int st) { return s_stages + (u32)(st * 2 * PC::KV_BYTES); };
        auto stage_v = [&](int st) { return s_stages + (u32)(st * 2 * PC::KV_BYTES + PC::KV_BYTES); };
        quant_convert_kv<PC>(bars, rb, warp - (4 - CONVERTERS), lane, p.kv_dtype, stage_k, stage_v, raw_k, raw_v);
        return;
    }
#else
    if (warp > 1) return;
#endif
    const PairRows r = pair_rows<PAIR>(p, L, cu_q, cu_k);
    PairWalk<PAIR> walk;
    pair_walk<PAIR>(walk, p, L, r, blk);
    bool nm = false;
    typename PairWalk<PAIR>::W sb = 0;
    const int t = walk.next(-1, lane, nm, sb);
    TileWalk<PC::NH, PairWalk<PAIR>> tw(walk, t, nm, sb);
    const u32 s_kv = s_q + PC::Q_BYTES, s_mask = s_kv + PC::S * 2 * PC::KV_BYTES;
    if (warp == 0) {
        const int kvh = ((int)cta_xy(L).y * L.heads_per_cta) / (p.n_heads / p.n_kv_heads), seq = cta_sequence(L);
#if MLXN_QUANT_ENTRIES && !MLXN_PAGED_ENTRIES
        // The raw boxes: IB bytes of a row (the map's IB / 2 16-bit elements), 64 rows.
        constexpr int IB = D < 128 ? D : 128;
        const int last = (r.lk - 1) / STEP * STEP;
        auto issue_k = [&](int st, int u, u32 bar) {
            tma_boxes<D / IB, IB, PC::N>(kmap, raw_k(st), bar, kvh, u * PC::N, last, seq);
        };
        auto issue_v = [&](int st, int u, u32 bar) {
            tma_boxes<D / IB, IB, PC::N>(vmap, raw_v(st), bar, kvh, u * PC::N, last, seq);
        };
        pipe_produce_kv<PC::RS, PC::RAW_BYTES>(rb, tw, lane, issue_k, issue_v);
        return;
#elif MLXN_PAGED_ENTRIES
        auto issue_k = [&](int st, int u, u32 bar) {
            tma_tile_paged<D, PC::N>(kmap, s_kv + (u32)(st * 2 * PC::KV_BYTES), bar, L, kvh, u * PC::N, r.lk);
        };
        auto issue_v = [&](int st, int u, u32 bar) {
            tma_tile_paged<D, PC::N>(vmap, s_kv + (u32)(st * 2 * PC::KV_BYTES + PC::KV_BYTES), bar, L, kvh, u * PC::N,
                                     r.lk);
        };
        (void)seq;
#else
        const int last = (r.lk - 1) / STEP * STEP;  // the cache's last 64-row block (a walked tile has r.lk > 0)
        auto issue_k = [&](int st, int u, u32 bar) {
            tma_tile<D, PC::N>(kmap, s_kv + (u32)(st * 2 * PC::KV_BYTES), bar, kvh, u * PC::N, last, seq);
        };
        auto issue_v = [&](int st, int u, u32 bar) {
            tma_tile<D, PC::N>(vmap, s_kv + (u32)(st * 2 * PC::KV_BYTES + PC::KV_BYTES), bar, kvh, u * PC::N, last,
                               seq);
        };
#endif
        pipe_produce_kv<PC::S, PC::KV_BYTES>(bars, tw, lane, issue_k, issue_v);
    } else {
        const bool m_al = (L.flags & FLAG_MASK_ALIGNED) != 0;
        auto load_mask = [&](int slot, int ts, int ln) {
            load_mask_tile(s_mask + (u32)(slot * PC::MASK_BYTES), mask + r.sq.mask, p, r.lq, r.lk, r.q_cta,
                           L.queries_per_cta, ts, m_al, ln, 32);
        };
        pipe_produce_masks<PC>(bars, tw, lane, load_mask);
    }
}

// A consumer warpgroup's role: its rows, its Q, the pipeline, the epilogue.
template <int D, int PAIR, class T, class PC>
__device__ __forceinline__ void pipe_consumer(const PipeBars<PC::S>& bars, u32 s_q, const Params& p,
                                              const Launch& L, const unsigned char* __restrict__ q,
                                              const u8* __restrict__ blk, void* __restrict__ out,
                                              float* __restrict__ lse, const int* __restrict__ cu_q,
                                              const int* __restrict__ cu_k, const float* __restrict__ sinks) {
    typedef typename PairWalk<PAIR>::W TB;
    const int tid = threadIdx.x, lane = tid & 31;
    const int wgi = __shfl_sync(0xffffffffu, tid >> 7, 0);  // warp-uniform: descriptors in uniform registers
    const PairRows r = pair_rows<PAIR>(p, L, cu_q, cu_k);
    load_q_rows<D, PC::ROWS, T>(s_q, wgi, p, L, r.sq, q, r.q_cta);
    const u32 s_ones = s_q + (u32)(PC::ONES + wgi * 256);  // this warpgroup's ones (ROWSUM)
    if constexpr (PC::ROWSUM) {
        const u32 one = T::pack2(1.f, 1.f);
        if ((tid & 127) < 16) st_shared_v4(s_ones + (u32)((tid & 127) * 16), one, one, one, one);
    }
    fence_proxy_async();                    // Q and the ones (ordinary stores) before wgmma reads them
    named_barrier(PC::BAR_Q + wgi, 128);   // the warpgroup's Q is in (its products read only its rows)
    const int qpc = L.queries_per_cta, r0 = wgi * 64 + ((tid >> 5) & 3) * 16;  // the warp's first CTA row
    const int head = (int)cta_xy(L).y * L.heads_per_cta + r0 / qpc, q0 = r.q_cta + r0 % qpc;
    const bool by_distance = alibi_by_distance(p);
    PairWalk<PAIR> walk;  // for its table rows only (the producer walks)
    walk.init((p.flags & PREFILL_MASK) ? blk + r.sq.blk : nullptr, p.blk_steps, 32, r.wa, r.we);
    RowGeom geo{r0 % qpc, r.q_cta, r.lk, r.off, head, lane >> 2, lane & 3, by_distance};
#if MLXN_QUANT_ENTRIES
    // SPEC 11: K's value is descale x the FP8 value the product took (the scores' factor).
    const int kvh = head / (p.n_heads / p.n_kv_heads);
    geo.kd = kdescale(p, L, kvh);
#endif
    float o[PC::NO];  // O, then (ROWSUM) the rows' sums: PipeCfg::NO
#pragma unroll
    for (int i = 0; i < PC::NO; ++i) o[i] = 0.f;
    float m_run[2] = {NEG_FLT_MAX_HALF, NEG_FLT_MAX_HALF}, l_run[2] = {0.f, 0.f};
    // The class of the warp's rows in step t (0 where none is), and their table byte.
    auto classes = [&](int t, TB sb, int& table) -> int {
        if (q0 >= r.lq) {
            table = 0;
            return 0;
        }
        table = walk.table_byte(q0, sb);
        const int c = combine_class(described_class(p, L, r.lk, r.off, q0, min(q0 + 16, r.lq), t), table);
        return c == 2 && by_distance ? 1 : c;  // ALiBi by distance: a bias on every pair
    };
    const u32 s_kv = s_q + PC::Q_BYTES, s_mask = s_kv + PC::S * 2 * PC::KV_BYTES;
    // The stage broadcast, so the compiler knows it is warp-uniform (uniform descriptors).
    auto qk = [&](int st, float (&s)[PC::NS]) {
        st = __shfl_sync(0xffffffffu, st, 0);
        pipe_qk<T, D, PC::N, PC::ROWS>(s, s_q + (u32)(wgi * 64 * 128), s_kv + (u32)(st * 2 * PC::KV_BYTES));
    };
    auto pv = [&](int st, const u32 (&pk)[PC::NB][2]) {
        st = __shfl_sync(0xffffffffu, st, 0);
        pipe_pv<T, D, PC::N, PC::ROWSUM>(o, pk, s_kv + (u32)(st * 2 * PC::KV_BYTES + PC::KV_BYTES), s_ones);
    };
    // The tile's softmax: P into pk where the last P V is done (no overlap), else left in s.
    auto softmax = [&](float (&s)[PC::NS], float (&ms)[2], const TileClasses<PC::NH>& tc, int st, int u,
                       u32 (&pk)[PC::NB][2]) {
        const u32 m_stage = s_mask + (u32)(st * PC::MASK_STAGE_BYTES);
        if constexpr (PC::OVERLAP) {
            return tile_softmax<T, PC::NH, PC::MASK_BYTES, !PC::ROWSUM>(s, m_run, l_run, ms, tc, u, m_stage, geo, p, L);
        } else {
            return tile_softmax_packed<T, PC::NH, PC::MASK_BYTES, !PC::ROWSUM>(s, m_run, l_run, ms, tc, u, m_stage, geo,
                                                                               p, L, pk);
        }
    };
    // V of tile u in stage st: paged, its rows past the cache's end zeroed in this CTA's
    // copy before the warpgroup's product (paged_tma.cuh; the warpgroup's barrier is its Q's).
    auto v_in = [&](int st, int u) {
#if MLXN_PAGED_ENTRIES
        st = __shfl_sync(0xffffffffu, st, 0);
        zero_v_past_end<D>(s_kv + (u32)(st * 2 * PC::KV_BYTES + PC::KV_BYTES), PC::N, r.lk - u * PC::N,
                           PC::BAR_Q + wgi);
#else
        (void)st;
        (void)u;
#endif
    };
    pipe_consume<PC, T, TB>(bars, o, classes, qk, pv, softmax, v_in);
    if (PC::TURNS && wgi == 0) named_barrier(PC::BAR_TURN, 256);  // the last warpgroup's last hand-over
    cluster_arrive();                          // done with the partner's barriers
    if constexpr (PC::ROWSUM) {
        l_run[0] = o[D / 2];  // the sums' accumulator: rows g8 and g8 + 8, every column the whole row's
        l_run[1] = o[D / 2 + 2];
    }
#if MLXN_QUANT_ENTRIES
    // V's factor: O's rows are sums of P times the FP8 values of V.
    const float vd = vdescale(p, L, kvh);
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] *= vd;
#endif
    store_rows<D, PC::ROWSUM>(p, L, cta_seq_again(p, L, cu_q, cu_k), r.lq, q0, head,
                              *reinterpret_cast<const float(*)[D / 2]>(&o[0]), m_run, l_run, out, lse, sinks);
    (void)lane;
}

// The kernel at head dims 64 and 128 for one CTA of a pair (entry.cuh's pair forms), in the
// pipeline's shape PC (PipeCfg of a row of tiles_sm90.cuh).
template <int D, int PAIR, class T, class PC>
__device__ __forceinline__ void attention_pipe(const Params& p, const Launch& L, const unsigned char* __restrict__ q,
                                               const u16* __restrict__ mask, const u8* __restrict__ blk,
                                               void* __restrict__ out, float* __restrict__ lse,
                                               const int* __restrict__ cu_q, const int* __restrict__ cu_k,
                                               const float* __restrict__ sinks, const TMap* kmap, const TMap* vmap) {
    static_assert(PAIR != PAIR_NONE, "the pipeline is the pair forms'");
    if (p.flags & PREFILL_VARLEN) asm volatile("trap;");  // the host launches fixed-length pairs only
    // A launch with less shared memory than this table row lays out stops here, loudly,
    // rather than running over the end of it.
    if (dynamic_smem_bytes() < (u32)PC::SMEM) asm volatile("trap;");
    // So does a launch whose threads (or rows a CTA) are not this table row's consumers'
    // (the host's WS_CONSUMERS_D64 against a -DMLXN_WS_CONSUMERS_D64 of its own).
    if (blockDim.x != (u32)PC::THREADS || L.heads_per_cta * L.queries_per_cta != PC::ROWS) asm volatile("trap;");
    if (pair_is_empty<PAIR>(p, L)) return;
    extern __shared__ __align__(1024) unsigned char smem[];
    const u32 s_q = (smem_addr(smem) + 1023u) & ~1023u;  // swizzle atoms need 1 KB alignment
    const PipeBars<PC::S> bars{s_q + PC::BARS};
    const int tid = threadIdx.x;
#if MLXN_QUANT_ENTRIES && !MLXN_PAGED_ENTRIES
    if (tid == 0) {
        init_raw_bars(raw_bars<PC>(bars));
        init_bars<PC::CT>(bars, CONVERTERS);  // (fences the raw slots' barriers too)
    }
#else
    if (tid == 0) init_bars<PC::CT>(bars);
#endif
    cluster_arrive();
    cluster_wait();  // both CTAs' barriers exist before any tile lands in either
    if (tid >= PC::CT) {
        regs_release<PC::TL::PRODUCER_REGS>();
        pipe_producer<D, PAIR, PC>(bars, s_q, p, L, mask, blk, cu_q, cu_k, kmap, vmap);
        cluster_arrive();
        cluster_wait();  // the partner's consumers no longer arrive on this CTA's barriers
        return;
    }
    regs_claim<PC::TL::CONSUMER_REGS>();
    pipe_consumer<D, PAIR, T, PC>(bars, s_q, p, L, q, blk, out, lse, cu_q, cu_k, sinks);
    cluster_wait();  // the partner no longer touches this CTA's shared memory
}

// A CTA-pair form (entry.cuh): the tiled pipeline at head dims 64 and 128, the mainloop's
// forms at 256 and 512 (tiles_sm90.cuh's PIPE); WIDE: the pipeline's shape without the
// explicit mask's tiles (WideTiles, the `_wide` entry points).
template <int D, int PAIR, class T, bool WIDE = false>
__device__ __forceinline__ void pair_attention(const Params& p, const Launch& L, const unsigned char* __restrict__ q,
                                               const u16* __restrict__ k, const u16* __restrict__ v,
                                               const u16* __restrict__ mask, const u8* __restrict__ blk,
                                               void* __restrict__ out, float* __restrict__ lse,
                                               const int* __restrict__ cu_q, const int* __restrict__ cu_k,
                                               const float* __restrict__ sinks, const TMap* kmap, const TMap* vmap) {
#if MLXN_QUANT_ENTRIES && !MLXN_PAGED_ENTRIES
    attention_pipe<D, PAIR, T, PipeCfg<D, QuantTiles<D>>>(p, L, q, mask, blk, out, lse, cu_q, cu_k, sinks, kmap, vmap);
    (void)k;
    (void)v;
#else
    if constexpr (WIDE) {
        attention_pipe<D, PAIR, T, PipeCfg<D, WideTiles<D>>>(p, L, q, mask, blk, out, lse, cu_q, cu_k, sinks, kmap,
                                                             vmap);
    } else if constexpr (Tiles<D>::PIPE == 2) {
        attention_pipe<D, PAIR, T, PipeCfg<D>>(p, L, q, mask, blk, out, lse, cu_q, cu_k, sinks, kmap, vmap);
    } else {
        attention<D, PAIR, T, Tiles<D>::PIPE == 1>(p, L, q, k, v, mask, blk, out, lse, cu_q, cu_k, sinks, kmap, vmap);
    }
#endif
}

}  // namespace hopper
