// Part of shaders/flash_attn_prefill_tensor.cu: the Hopper form's warp-specialised pipeline
// (head dim 256, CTA pairs). A third warpgroup produces: one of its warps walks the steps,
// waits until both CTAs' consumers are done with a stage, and fills it (K and V by the TMA,
// multicast into both CTAs as in the other pair forms; the mask tile by cp.async). The two
// consumer warpgroups never meet at a CTA barrier: each waits on the mbarriers of the
// tiles it reads and releases each tile as soon as its products are done with it, so they
// can run half a step apart. They take turns (two named barriers) to issue their products,
// each issuing P V of the last step with Q K^T of this one, so one warpgroup's products run
// while the other does its softmax.
#pragma once

#include "flash_attn_prefill/sm90_ptx.cuh"

namespace hopper {

// Threads of the warp-specialised CTA: the two consumer warpgroups and the producer.
#define WS_THREADS (NTHREADS + 128)

// The pipeline's mbarriers, 8 bytes each from `base`: full and empty, of K, V and the mask
// tile, of each of the two stages (HCfg::BAR_BYTES holds them).
struct WsBars {
    u32 base;
    __device__ __forceinline__ u32 full_k(int st) const { return base + 8 * st; }
    __device__ __forceinline__ u32 full_v(int st) const { return base + 16 + 8 * st; }
    __device__ __forceinline__ u32 full_m(int st) const { return base + 32 + 8 * st; }
    __device__ __forceinline__ u32 empty_k(int st) const { return base + 48 + 8 * st; }
    __device__ __forceinline__ u32 empty_v(int st) const { return base + 64 + 8 * st; }
    __device__ __forceinline__ u32 empty_m(int st) const { return base + 80 + 8 * st; }
};
#define WS_BAR_BYTES 96

// The registers of a producer and of a consumer thread. The launch gives each thread 168;
// a consumer's claim of 240 waits until the producer has released as many: 256 x (240 -
// 168) = 128 x (168 - 24) (with 32 the claim would wait for ever).
#define WS_PRODUCER_REGS 24
#define WS_CONSUMER_REGS 240

// Phases: the j-th step walked uses stage j % 2 for the (j / 2)-th time; its full barriers
// complete phase j / 2 (parity (j / 2) & 1), and the producer refills the stage once its
// empty barrier has completed phase j / 2 - 1 (the consumers' release of step j - 2).
__device__ __forceinline__ u32 ws_parity(int j) { return (u32)(j >> 1) & 1u; }

// The pipeline of one CTA of a pair, from the first step walked `t` (its need for the mask
// tile `nm` and table bytes `sb`). Returns true in the consumers (their O, m_run and l_run
// hold the rows; they wait on the cluster after their epilogue), false in the producer
// warpgroup (done). The callbacks are the mainloop's: next_active(t, nm, sb),
// wg_computes(t, sb), step_class(t, sb) (the classes of the thread's rows), qk_issue(stage)
// (into s), pv_issue(stage), scores_and_softmax(t, stage, sb, act, cls) (the step's softmax once
// s holds its scores; act and cls are wg_computes and step_class, computed beforehand),
// issue_k(stage, t, bar) and issue_v(stage, t, bar) (this CTA's half of the boxes, for
// both), load_mask(stage, t, lane) (the producer warp's share of a mask tile), v_in(stage, t)
// (V of step t is in, before any product reads it: the paged forms zero its rows past the
// cache's end there, paged_tma.cuh; else nothing).
template <class TB, int NS, int NO, class Next, class Computes, class Class, class QK, class PV, class Softmax,
          class IssueK, class IssueV, class LoadMask, class VIn>
__device__ __forceinline__ bool ws_pipeline(u32 s_bar, int kv_bytes, int steps, int t, bool nm, TB sb, float (&s)[NS],
                                            float (&o)[NO], Next& next_active, Computes& wg_computes, Class& step_class,
                                            QK& qk_issue, PV& pv_issue, Softmax& scores_and_softmax, IssueK& issue_k,
                                            IssueV& issue_v, LoadMask& load_mask, VIn& v_in) {
    const WsBars bars{s_bar};
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    if (tid == 0) {
#pragma unroll
        for (int st = 0; st < 2; ++st) {
            mbar_init(bars.full_k(st), 1);   // the producer's expect_tx
            mbar_init(bars.full_v(st), 1);
            mbar_init(bars.full_m(st), 32);  // each producer lane, once its copies are in
            mbar_init(bars.empty_k(st), 2 * NTHREADS / 32);  // every consumer warp of both CTAs
            mbar_init(bars.empty_v(st), 2 * NTHREADS / 32);
            mbar_init(bars.empty_m(st), NTHREADS);  // every consumer thread of this CTA (its own tile)
        }
        fence_mbar_init();
    }
    fence_proxy_async();  // Q (ordinary stores) before wgmma reads it
    cluster_arrive();
    cluster_wait();  // both CTAs' barriers exist, and Q is in

    if (tid >= NTHREADS) {
        regs_release<WS_PRODUCER_REGS>();
        if (warp == NTHREADS / 32) {
            // V of the jv-th step walked (cache step tv) into stage sv, once its last
            // occupant (step jv - 2's) is released.
            auto fill_v = [&](int jv, int sv, int tv) {
                if (jv >= 2) mbar_wait(bars.empty_v(sv), ws_parity(jv) ^ 1u);
                if (lane == 0) {
                    mbar_expect_tx(bars.full_v(sv), (u32)kv_bytes);
                    issue_v(sv, tv, bars.full_v(sv));
                }
            };
            // Step j: K_j and the mask tile into stage j % 2, and V_{j-1} into the other.
            int st = 0, j = 0, tp = 0;
            while (t < steps) {
                if (j >= 2) mbar_wait(bars.empty_k(st), ws_parity(j) ^ 1u);
                if (lane == 0) {
                    mbar_expect_tx(bars.full_k(st), (u32)kv_bytes);
                    issue_k(st, t, bars.full_k(st));
                }
                if (j >= 1) fill_v(j - 1, st ^ 1, tp);
                if (j >= 2) mbar_wait(bars.empty_m(st), ws_parity(j) ^ 1u);
                if (nm) {
                    load_mask(st, t, lane);
                    cp_async_commit();
                    cp_async_wait_all();
                }
                mbar_arrive(bars.full_m(st));  // after this lane's part of the tile (if any)
                tp = t;
                ++j;
                st ^= 1;
                TB sbn;
                t = next_active(t, nm, sbn);
            }
            if (j >= 1) fill_v(j - 1, st ^ 1, tp);  // the last step's V
        }
        cluster_arrive();
        cluster_wait();  // the partner's consumers no longer arrive on this CTA's barriers
        return false;
    }

    regs_claim<WS_CONSUMER_REGS>();
    const int wgi = __shfl_sync(0xffffffffu, tid >> 7, 0);
    // Turns: warpgroup w issues its products after bar.sync on barrier 1 + w, then hands
    // the turn to the other (bar.arrive on its barrier). Warpgroup 0 takes the first turn.
    if (wgi == 1) named_barrier_arrive(1, NTHREADS);
    int st = 0, j = 0, tp = 0;  // tp: the last step walked
    bool act_prev = false;
    bool act = t < steps && wg_computes(t, sb);  // then each step's, while the last one's products run
    while (true) {
        const bool more = t < steps;
        if (more) mbar_wait(bars.full_k(st), ws_parity(j));
        if (j >= 1) {
            mbar_wait(bars.full_v(st ^ 1), ws_parity(j - 1));
            v_in(st ^ 1, tp);
        }
        named_barrier(1 + wgi, NTHREADS);
        if (act_prev) pv_issue(st ^ 1);  // O += P V of the last step
        if (act) qk_issue(st);
        named_barrier_arrive(2 - wgi, NTHREADS);
        // While the products run: the next step walked, whether this warpgroup computes it,
        // and this step's row classes (what the softmax needs besides the scores), so none of
        // them waits behind the products.
        TB sbn = 0;
        const int tn = more ? next_active(t, nm, sbn) : steps;
        const auto cls = more ? step_class(t, sb) : decltype(step_class(t, sb)){};
        const bool act_next = tn < steps && wg_computes(tn, sbn);
        wgmma_wait0();
        fence_regs(s);
        fence_regs(o);
        __syncwarp();
        if (lane == 0) {
            // This warp is done with K_j and V_{j-1}, in both CTAs' copies' barriers.
#pragma unroll
            for (u32 r = 0; r < 2; ++r) {
                if (more) mbar_arrive_cluster(bars.empty_k(st), r);
                if (j >= 1) mbar_arrive_cluster(bars.empty_v(st ^ 1), r);
            }
        }
        if (!more) break;
        mbar_wait(bars.full_m(st), ws_parity(j));
        scores_and_softmax(t, st, sb, act, cls);  // its Q K^T is in s
        mbar_arrive(bars.empty_m(st));  // each thread after its own reads of the mask tile
        act_prev = act;
        act = act_next;
        ++j;
        st ^= 1;
        tp = t;
        t = tn;
        sb = sbn;
    }
    if (wgi == 0) named_barrier(1, NTHREADS);  // warpgroup 1's last hand-over
    cluster_arrive();
    return true;
}

}  // namespace hopper
