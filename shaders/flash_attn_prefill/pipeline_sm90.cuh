// Part of shaders/flash_attn_prefill_tensor.cu: the Hopper form's warp-specialised pipeline
// over tiles of N cache rows (tiles_sm90.cuh, PIPE 2: head dims 64 and 128), for one CTA of
// a pair that receives each K/V tile once, by TMA multicast into both CTAs.
//
// Roles (128 x (CONSUMERS + 1) threads): warpgroups 0 .. CONSUMERS - 1 consume (64 query
// rows each, O in registers); the last warpgroup produces: two of its warps walk the tiles
// (the walk is the producer's alone: one tells the consumers each tile through shared
// memory, beside the tile's K), wait until
// both CTAs' consumers are done with a stage, and fill it (one K and V by the TMA, the
// other the mask tiles of its steps by cp.async). Nothing meets at a CTA barrier: every
// hand-over is an mbarrier.
//
// A consumer warpgroup's step j (its turn at the tensor cores is a pair of named barriers,
// so the warpgroups' products take turns in a ring and one's softmax runs beside the
// others' products):
//   issue S_j = Q K_j^T, scale O by step j-1's rescale while it runs, issue O += P_{j-1}
//   V_{j-1};
//   OVERLAP: wait for S_j only, release K_j, run the softmax of S_j (its classes, masks,
//   maxima, P in the scores' registers) while P_{j-1} V_{j-1} is still on the tensor cores,
//   then wait for it, release V_{j-1} and take P_j as the next P V's operand
//   (FlashAttention-3's intra-warpgroup overlap); else (the default) wait for both, then the
//   softmax, which packs P straight into P V's operand (pk is free once P_{j-1} V_{j-1} is
//   done): one conversion of P where the overlap needs P kept as floats, then packed again.
#pragma once

#include "flash_attn_prefill/loaders.cuh"
#include "flash_attn_prefill/mainloop_sm90_ws.cuh"
#include "flash_attn_prefill/paged_tma.cuh"
#include "flash_attn_prefill/tile_softmax.cuh"
#include "flash_attn_prefill/tile_walk.cuh"
#include "flash_attn_prefill/tiles_sm90.cuh"

namespace hopper {

// A timing variant (docs/benchmarks.md, "Each CTA of a pair on its own K/V"): 1, each CTA of
// a pair loads its own K/V tiles (the TMA's multicast to itself alone) and waits only for
// its own consumers before refilling a stage, so the two CTAs no longer hold each other
// back; K/V cross L2 twice as often. 0 (the default): a pair shares every tile.
#ifndef MLXN_WS_SOLO
#define MLXN_WS_SOLO 0
#endif
// The CTAs whose consumers release a stage, and into which a tile's boxes are multicast.
// The quant module's pairs (quant_pipe.cuh) widen each CTA's own copy of a tile: its own.
constexpr int PIPE_PEERS = (MLXN_WS_SOLO || MLXN_QUANT_ENTRIES) ? 1 : 2;

// The shape and shared memory of the pipeline at head dim D (TILES: its row of tiles_sm90.cuh): Q [D / 64][ROWS][64 halves],
// then per stage K and V ([D / 64][N rows][64 halves] each), then per stage the mask tiles
// of its NH steps ([ROWS queries][64] halves each), then (quantised K/V, RS > 0) RS raw
// slots of a tile's K and V bytes as the TMA copies them (quant_pipe.cuh), then the
// mbarriers and each stage's tile (then the raw slots' mbarriers and records), then
// (ROWSUM) each consumer warpgroup's block of ones (the B of its rows' sums' product).
template <int D, class TILES = Tiles<D>>
struct PipeCfg {
    typedef TILES TL;
    static constexpr int HEAD_DIM = D;
    static constexpr int N = TL::N, NH = N / STEP, S = TL::STAGES;
    static constexpr bool OVERLAP = TL::OVERLAP, ROWSUM = TL::ROWSUM_MMA;
    static constexpr bool TURNS = MLXN_WS_TURNS != 0;  // the consumers' products take turns (tiles_sm90.cuh)
    // A consumer's accumulators: O (D / 2 a thread), then with ROWSUM the m64n8 one of its
    // rows' sums (4 a thread), so that O's rescale and register fences cover both.
    static constexpr int NO = D / 2 + (ROWSUM ? 4 : 0);
    static constexpr int CW = TL::CONSUMERS;         // consumer warpgroups
    static constexpr int CT = 128 * CW;              // consumer threads; the CTA has CT + 128
    static constexpr int THREADS = CT + 128;
    static constexpr int ROWS = 64 * CW;             // query rows of the CTA: 64 a consumer warpgroup
    // Named barriers: 1 .. CW the turns (warpgroup w issues at 1 + w), then each
    // warpgroup's own (its Q is in).
    static constexpr int BAR_TURN = 1, BAR_Q = 1 + CW;
    static constexpr int NS = N / 2, NB = N / 8;     // scores a thread; 8-column blocks of a tile
    static constexpr int Q_BYTES = ROWS * D * 2;
    static constexpr int KV_BYTES = N * D * 2;       // K (or V) of one stage
    static constexpr int MASK_BYTES = ROWS * STEP * 2;  // one step's mask tile
    static constexpr bool MASK_TILES = TL::MASK_TILES;  // room for them (else a tile that needs one traps)
    static constexpr int MASK_STAGE_BYTES = MASK_TILES ? NH * MASK_BYTES : 0;
    static constexpr int RS = TL::RAW_SLOTS, RAW_BYTES = N * D;  // raw slots; one K (or V) tile's bytes
    static constexpr int RAW = Q_BYTES + S * (2 * KV_BYTES + MASK_STAGE_BYTES);  // the raw slots, from Q's start
    static constexpr int RAW_BAR_BYTES = 64 * RS;  // RawBars: four mbarriers and a tile's record a slot
    static constexpr int BAR_BYTES = 48 * S + 32 * S + RAW_BAR_BYTES;  // the mbarriers, then each stage's tile (PipeBars)
    static constexpr int BARS = RAW + RS * 2 * RAW_BYTES;  // from Q's start
    // A warpgroup's ones: one k16 x n8 block (256 bytes), read by every k-chunk's product.
    static constexpr int ONES = BARS + (BAR_BYTES + 127) / 128 * 128;
    static constexpr int SMEM = 1024 + (ROWSUM ? ONES + 2 * 256 : BARS + BAR_BYTES);
    static_assert(N == 64 || N == 128 || N == 192, "tiles of one to three table steps (the products' n64 / n128 / n192)");
    static_assert(8 + 8 * NH <= 32, "a stage's tile as put_tile writes it: 32 bytes (PipeBars)");
    static_assert(S >= 2, "the producer fills one stage while the consumers read another");
    static_assert(CW == 2 || CW == 3, "two or three consumer warpgroups");
    static_assert(!(ROWSUM && CW != 2), "the rows' sums' ones: two warpgroups' blocks");
    static_assert(RS == 0 || !MASK_TILES, "the raw slots take the mask tiles' room");
    static_assert(TL::PRODUCER_REGS % 8 == 0 && TL::CONSUMER_REGS % 8 == 0, "setmaxnreg takes multiples of 8");
    static_assert(128 * TL::PRODUCER_REGS + CT * TL::CONSUMER_REGS <= THREADS * (65536 / THREADS / 8 * 8),
                  "the consumers' claim must fit what the producer releases");
};

// The shared memory the host reserves for this pipeline's CTAs (attention_geometry.rs,
// WS_SHARED_BYTES): the most any head dim's table row (or a variant of it) may take.
#define PIPE_SMEM_RESERVED 231424

// The pipeline's mbarriers, 8 bytes each from `base`: full and empty of K, V and the mask
// tiles, of each of the S stages; then each stage's tile, 32 bytes (put_tile).
template <int S>
struct PipeBars {
    u32 base;
    __device__ __forceinline__ u32 at(int kind, int st) const { return base + (u32)(8 * (kind * S + st)); }
    __device__ __forceinline__ u32 tile(int st) const { return base + (u32)(48 * S + 32 * st); }
    __device__ __forceinline__ u32 full_k(int st) const { return at(0, st); }
    __device__ __forceinline__ u32 full_v(int st) const { return at(1, st); }
    __device__ __forceinline__ u32 full_m(int st) const { return at(2, st); }
    __device__ __forceinline__ u32 empty_k(int st) const { return at(3, st); }
    __device__ __forceinline__ u32 empty_v(int st) const { return at(4, st); }
    __device__ __forceinline__ u32 empty_m(int st) const { return at(5, st); }
    __device__ __forceinline__ u32 end() const { return tile(S); }  // the first byte past them
};

// The mbarriers, by one thread, before the cluster barrier that publishes them to both CTAs
// (the partner's TMA completes bytes on this CTA's full barriers, its consumers arrive on
// this CTA's empty ones).
template <int CT, int S>
__device__ __forceinline__ void init_bars(const PipeBars<S>& bars, u32 fillers = 1) {
#pragma unroll
    for (int st = 0; st < S; ++st) {
        // The producer's expect_tx (or, at the end, its arrival); quantised K/V, each
        // converter warp's arrival (quant_pipe.cuh).
        mbar_init(bars.full_k(st), fillers);
        mbar_init(bars.full_v(st), fillers);
        mbar_init(bars.full_m(st), 32);  // each producer lane, once its copies are in
        mbar_init(bars.empty_k(st), PIPE_PEERS * CT / 32);  // every consumer warp of both CTAs (SOLO: of this one)
        mbar_init(bars.empty_v(st), PIPE_PEERS * CT / 32);
        mbar_init(bars.empty_m(st), CT);  // every consumer thread of this CTA (its own tiles)
    }
    fence_mbar_init();
}

// A place in the ring of S stages: the j-th tile walked uses stage j % S for the (j / S)-th
// time; its full barriers complete phase j / S (parity ph), and the stage is refilled once
// its empty barrier has completed phase j / S - 1 (parity ph ^ 1).
struct Ring {
    int st = 0;
    u32 ph = 0;
    __device__ __forceinline__ void advance(int stages) {
        if (++st == stages) {
            st = 0;
            ph ^= 1u;
        }
    }
};

// This CTA's share of a tile's boxes (64 rows each, IB bytes of a row wide), for both CTAs:
// box i of the tile's CB x NH is column block i / NH and row block i % NH, at dst + (i / NH)
// x N x IB + (i % NH) x 64 x IB; CTA r issues boxes r, r + 2, ... (at head dim 64 with tiles
// of 64 rows, CTA 0 the one box; with PIPE_PEERS 1 every box, to itself alone).
// box(dst, cb, rb, cta_mask): issue column block cb, row block rb into dst for the CTAs in
// cta_mask.
template <int CB, int IB, int N, class Box>
__device__ __forceinline__ void own_boxes(u32 dst, Box box) {
    constexpr int NH = N / STEP, NBOX = CB * NH;
    const int rank = (int)cluster_rank();
#pragma unroll
    for (int i = 0; i < NBOX; ++i) {
        if (PIPE_PEERS == 1 || (i & 1) == rank)
            box(dst + (u32)((i / NH) * N * IB + (i % NH) * 64 * IB), i / NH, i % NH,
                PIPE_PEERS == 1 ? (unsigned short)(1u << rank) : (unsigned short)3);
    }
}

// A tile's boxes from a map whose boxes are IB bytes (IB / 2 16-bit elements) wide, rows
// from row0. A row block past the cache (the last tile's second step, never walked: its
// scores are -inf and its P zero) is read from the cache's last block, `last_row`, instead:
// finite rows that change nothing, where a box wholly outside the tensor is something the
// pipeline need not rely on (the rows of a partial block past the cache are zeros, as in the
// other forms).
template <int CB, int IB, int N>
__device__ __forceinline__ void tma_boxes(const TMap* map, u32 dst, u32 bar, int kvh, int row0, int last_row, int seq) {
    own_boxes<CB, IB, N>(dst, [&](u32 d, int cb, int rb, unsigned short ctas) {
        tma_load_4d_mc(d, map, cb * (IB / 2), kvh, min(row0 + rb * 64, last_row), seq, bar, ctas);
    });
}

// A tile of 16-bit K or V: D / 64 column blocks of 128-byte boxes (the stage's layout).
template <int D, int N>
__device__ __forceinline__ void tma_tile(const TMap* map, u32 dst, u32 bar, int kvh, int row0, int last_row, int seq) {
    tma_boxes<D / 64, 128, N>(map, dst, bar, kvh, row0, last_row, seq);
}

#if MLXN_PAGED_ENTRIES
// tma_tile on a paged cache (paged_tma.cuh): the same boxes, each as boxes of a block's rows
// found through the table; the rows past the cache's end (lk) are the consumers' to zero.
template <int D, int N>
__device__ __forceinline__ void tma_tile_paged(const TMap* map, u32 dst, u32 bar, const Launch& L, int kvh, int row0,
                                               int lk) {
    own_boxes<D / 64, 128, N>(dst, [&](u32 d, int cb, int rb, unsigned short ctas) {
        tma_box_paged(d, map, L, cb, kvh, row0 + rb * 64, lk, bar, ctas);
    });
}
#endif

// A tile as the producer tells it to the consumers (written before the arrival that
// completes the stage's K barrier, which releases it): u (below 0: the walk is done), the
// steps walked, each step's table bytes.
template <int NH, class TB>
__device__ __forceinline__ void put_tile(u32 addr, const Tile<NH, TB>& tl) {
    asm volatile("st.shared.v2.u32 [%0], {%1, %2};\n" ::"r"(addr), "r"(tl.u), "r"(tl.walked) : "memory");
#pragma unroll
    for (int h = 0; h < NH; ++h) st_shared_i64(addr + 8 + 8 * h, (long long)tl.sb[h]);
}
template <int NH, class TB>
__device__ __forceinline__ Tile<NH, TB> get_tile(u32 addr) {
    Tile<NH, TB> tl;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(tl.u), "=r"(tl.walked) : "r"(addr) : "memory");
#pragma unroll
    for (int h = 0; h < NH; ++h) tl.sb[h] = (TB)ld_shared_i64(addr + 8 + 8 * h);
    return tl;
}

// The producer's K/V warp: every tile of the walk, told to the consumers, its K into stage
// j % S and V of the tile before into its stage (the consumers issue K_j's and V_{j-1}'s
// products together, so K_j comes first); then the end of the walk in the next stage.
// issue_k(st, u, bar), issue_v(st, u, bar): the TMA boxes of tile u, BYTES of them. BARS:
// the ring's mbarriers and tile records (PipeBars; quantised K/V, the raw slots' RawBars of
// quant_pipe.cuh, whose converter warps fill the stages).
template <int S, int BYTES, class Bars, class TW, class IssueK, class IssueV>
__device__ __forceinline__ void pipe_produce_kv(const Bars& bars, TW& tw, int lane, IssueK& issue_k, IssueV& issue_v) {
    Ring r, rv;  // the stage of this tile's K; that of the last tile's V
    int j = 0, uv = 0;
    auto fill_v = [&]() {  // V of tile j - 1, once that stage's V of tile j - 1 - S is released
        if (j - 1 >= S) mbar_wait(bars.empty_v(rv.st), rv.ph ^ 1u);
        if (lane == 0) {
            mbar_expect_tx(bars.full_v(rv.st), (u32)BYTES);
            issue_v(rv.st, uv, bars.full_v(rv.st));
        }
    };
    for (auto tl = tw.next(lane); tl.valid(); tl = tw.next(lane)) {
        if (j >= S) mbar_wait(bars.empty_k(r.st), r.ph ^ 1u);
        if (lane == 0) {
            put_tile(bars.tile(r.st), tl);
            mbar_expect_tx(bars.full_k(r.st), (u32)BYTES);
            issue_k(r.st, tl.u, bars.full_k(r.st));
        }
        if (j >= 1) fill_v();
        rv = r;
        uv = tl.u;
        r.advance(S);
        ++j;
    }
    if (j >= 1) fill_v();  // the last tile's V
    // The end: a tile of u -1 and the K barrier's arrival, with no bytes to wait for.
    if (j >= S) mbar_wait(bars.empty_k(r.st), r.ph ^ 1u);
    if (lane == 0) {
        put_tile(bars.tile(r.st), decltype(tw.next(lane)){});
        mbar_arrive(bars.full_k(r.st));
    }
}

// The producer's mask warp (its own walk of the same tiles, so that neither producer warp
// holds both the walk's and the other's registers): the mask tiles of each tile's steps
// whose table byte is 1 into stage j % S, once the consumers are done with its last ones;
// every lane arrives on the stage's barrier after its copies, tiles to load or not.
// load_mask(slot, t, lane): this lane's share of step t's mask tile into slot st * NH + h.
template <class PC, class TW, class LoadMask>
__device__ __forceinline__ void pipe_produce_masks(const PipeBars<PC::S>& bars, TW& tw, int lane, LoadMask& load_mask) {
    Ring r;
    int j = 0;
    for (auto tl = tw.next(lane); tl.valid(); tl = tw.next(lane)) {
        if (j >= PC::S) mbar_wait(bars.empty_m(r.st), r.ph ^ 1u);
        if (tl.need_mask) {
            if constexpr (!PC::MASK_TILES) asm volatile("trap;");  // the host launches this form without such tiles
#pragma unroll
            for (int h = 0; h < PC::NH; ++h) {
                if ((tl.need_mask >> h) & 1u) load_mask(r.st * PC::NH + h, tl.step(h), lane);
            }
            cp_async_commit();
            cp_async_wait_all();
        }
        mbar_arrive(bars.full_m(r.st));  // after this lane's part of the tiles (if any)
        r.advance(PC::S);
        ++j;
    }
}

// This warp is done with a stage's K (or V): one arrival on that barrier in both CTAs (with
// MLXN_WS_SOLO, in this CTA alone).
__device__ __forceinline__ void release_pair(u32 bar) {
    if constexpr (PIPE_PEERS == 1) {
        mbar_arrive(bar);
    } else {
#pragma unroll
        for (u32 rank = 0; rank < 2; ++rank) mbar_arrive_cluster(bar, rank);
    }
}

// A consumer warpgroup over the whole walk; O, m_run and l_run (in softmax) hold its rows
// after. Both warpgroups compute every tile the walk gives (a warpgroup none of whose rows
// sees a tile gets -inf scores: nothing changes, bit for bit, as when the walk skips it), so
// every product is issued and waited on unconditionally: ptxas serialises all the products
// of a kernel whose waits it finds in paths it cannot prove uniform (C7514-C7520).
// classes(t, sb, table): the class of the warp's rows in step t; qk(st, s) and pv(st, pk):
// the products of a stage, issued, not committed; softmax(s, ms, classes, st, u) leaves P in
// s and the rows' rescale factors in ms; v_in(st, u): V of tile u is in stage st, before
// any product reads it (the paged forms zero its rows past the cache's end there; else
// nothing). TB: the walk's packed table bytes.
template <class PC, class T, class TB, class Classes, class QK, class PV, class Softmax, class VIn, int NO>
__device__ __forceinline__ void pipe_consume(const PipeBars<PC::S>& bars, float (&o)[NO], Classes& classes, QK& qk,
                                             PV& pv, Softmax& softmax, VIn& v_in) {
    const int lane = threadIdx.x & 31;
    const int wgi = __shfl_sync(0xffffffffu, (int)threadIdx.x >> 7, 0);
    // Turns: warpgroup w issues after bar.sync on barrier BAR_TURN + w, then hands the turn
    // to the next in the ring (bar.arrive on its barrier; each barrier: the one that waits
    // and the one that hands over, 256 threads). Warpgroup 0 takes the first turn.
    // Without turns (MLXN_WS_TURNS 0, a variant to time) each warpgroup issues when it is ready.
    constexpr int CW = PC::CW;
    if (PC::TURNS && wgi == CW - 1) named_barrier_arrive(PC::BAR_TURN, 256);
    auto turn = [&]() {
        if constexpr (PC::TURNS) named_barrier(PC::BAR_TURN + wgi, 256);
    };
    auto hand_over = [&]() {
        if constexpr (PC::TURNS) named_barrier_arrive(PC::BAR_TURN + (wgi + 1 == CW ? 0 : wgi + 1), 256);
    };
    auto release = [&](u32 bar) {
        __syncwarp();
        if (lane == 0) release_pair(bar);
    };
    Ring r, rp;         // this tile's stage; the last tile's
    int up = 0;         // the last tile's u
    float ms[2];        // the last softmax's rescale of O, applied before its P V
    u32 pk[PC::NB][2];  // P of the last tile, P V's operand
    // The tile of stage q, once its K is in (or the end of the walk).
    auto tile_at = [&](const Ring& q) {
        mbar_wait(bars.full_k(q.st), q.ph);
        return get_tile<PC::NH, TB>(bars.tile(q.st));
    };
    // The softmax of the tile in stage r once its scores are in (tc: its steps' classes, taken
    // while the products ran: after them, they lengthen the softmax's critical path). P goes
    // to pk where the last P V is done (no overlap), else it stays in s for take_p.
    auto scores = [&](float (&s)[PC::NS], const TileClasses<PC::NH>& tc, int u) {
        mbar_wait(bars.full_m(r.st), r.ph);
        softmax(s, ms, tc, r.st, u, pk);
        mbar_arrive(bars.empty_m(r.st));  // each thread after its own reads of the mask tiles
    };
    auto cur = tile_at(r);
    if (!cur.valid()) return;
    {  // the first tile: Q K^T alone
        float s[PC::NS];
        turn();
        qk(r.st, s);
        wgmma_commit();
        hand_over();
        const auto tc = tile_classes(cur, classes);
        wgmma_wait<0>();
        fence_regs(s);
        release(bars.empty_k(r.st));
        scores(s, tc, cur.u);
        if constexpr (PC::OVERLAP) take_p<T>(s, pk);
        fence_regs(pk);
    }
    while (true) {  // tile j: its Q K^T, and P V of tile j - 1
        rp = r;
        up = cur.u;
        r.advance(PC::S);
        cur = tile_at(r);
        if (!cur.valid()) break;
        float s[PC::NS];  // a fresh array each tile: nothing carried from one tile's scores to the next
        mbar_wait(bars.full_v(rp.st), rp.ph);
        v_in(rp.st, up);
        turn();
        qk(r.st, s);
        wgmma_commit();
        rescale_o(o, ms);  // while Q K^T runs (O is no product's until P V below)
        pv(rp.st, pk);
        wgmma_commit();
        hand_over();
        const auto tc = tile_classes(cur, classes);
        if constexpr (PC::OVERLAP) {
            wgmma_wait<1>();  // S_j is in; P_{j-1} V_{j-1} may still run
            fence_regs(s);
            release(bars.empty_k(r.st));
            scores(s, tc, cur.u);
            wgmma_wait<0>();
            fence_regs(o);
            release(bars.empty_v(rp.st));
            take_p<T>(s, pk);
        } else {
            wgmma_wait<0>();  // S_j and P_{j-1} V_{j-1}: pk is free for this tile's P
            fence_regs(s);
            fence_regs(o);
            release(bars.empty_k(r.st));
            release(bars.empty_v(rp.st));
            scores(s, tc, cur.u);
        }
        fence_regs(pk);
    }
    // P V of the last tile (in stage rp; r holds the end of the walk).
    mbar_wait(bars.full_v(rp.st), rp.ph);
    v_in(rp.st, up);
    turn();
    rescale_o(o, ms);
    pv(rp.st, pk);
    wgmma_commit();
    hand_over();
    wgmma_wait<0>();
    fence_regs(o);
    release(bars.empty_v(rp.st));
}

// S = Q K^T of a tile into s: the warpgroup's 64 query rows from `q_rows` (rows of the
// ROWS-row Q tile), the N rows of the K tile at `k_tile`; issued, not committed. Descriptors of
// k-chunk kc = the tile's + the chunk's offset / 16 (addresses stay below 2^18, so the 14-bit
// field never carries). The caller passes warp-uniform addresses (a broadcast stage), so the
// descriptors live in uniform registers.
template <class T, int D, int N, int ROWS>
__device__ __forceinline__ void pipe_qk(float (&s)[N / 2], u32 q_rows, u32 k_tile) {
    const u64 da0 = desc_sw128(q_rows, 16, 1024), db0 = desc_sw128(k_tile, 16, 1024);
    wgmma_fence();
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
        const u64 da = da0 + (u64)(((kc >> 2) * ROWS * 128 + (kc & 3) * 32) >> 4);
        const u64 db = db0 + (u64)(((kc >> 2) * N * 128 + (kc & 3) * 32) >> 4);
        if (kc == 0) wgmma_ss_zero<T, N>(s, da, db);
        else wgmma_ss<T, N>(s, da, db, 1);
    }
}

// O += P V of a tile: P in registers (A fragments, 16 columns a k-chunk), V's N rows at
// `v_tile` (N-major for the product: its 64-column blocks N * 128 bytes apart); issued, not
// committed. pk stays the product's until the caller waits. With ROWSUM (acc holds O, then
// the rows' sums: PipeCfg::NO) each k-chunk's P also times the warpgroup's ones at `ones`:
// the rows' sums of the rounded P, in every column of the m64n8 accumulator.
template <class T, int D, int N, bool ROWSUM, int NO>
__device__ __forceinline__ void pipe_pv(float (&acc)[NO], const u32 (&pk)[N / 8][2], u32 v_tile, u32 ones) {
    static_assert(NO == D / 2 + (ROWSUM ? 4 : 0), "O's accumulators, then the sums'");
    float(&o)[D / 2] = *reinterpret_cast<float(*)[D / 2]>(&acc[0]);
    const u64 dv0 = desc_sw128(v_tile, N * 128, 1024), d1 = desc_plain(ones, 128, 128);
    wgmma_fence();
#pragma unroll
    for (int kc = 0; kc < N / 16; ++kc) {
        const u32 a[4] = {pk[2 * kc][0], pk[2 * kc][1], pk[2 * kc + 1][0], pk[2 * kc + 1][1]};
        wgmma_rs<T, D>(o, a, dv0 + (u64)((kc * 16 * 128) >> 4));
    }
    if constexpr (ROWSUM) {
        // Another accumulator's chain: ptxas wants a fence before it (it injects one if not).
        wgmma_fence();
#pragma unroll
        for (int kc = 0; kc < N / 16; ++kc) {
            const u32 a[4] = {pk[2 * kc][0], pk[2 * kc][1], pk[2 * kc + 1][0], pk[2 * kc + 1][1]};
            wgmma_rs_n8<T>(*reinterpret_cast<float(*)[4]>(&acc[D / 2]), a, d1);
        }
    }
}

}  // namespace hopper
