// Part of shaders/flash_attn_prefill_tensor.cu: quantised K/V (SPEC 11; FP8 E4M3 and E5M2)
// in the Hopper form's CTA-pair forms, the quant module's NAME_pair_heads_kvq and
// NAME_pair_queries_kvq at head dims 64, 128 and 256 (the pipeline of pipeline_sm90.cuh in
// QuantTiles' shapes, tiles_sm90.cuh).
//
// The products read F16, and the TMA copies bytes as they are, so a tile takes two hops:
// the producer's walk warp (warp 0) has the TMA copy its K (and the last tile's V) bytes
// into a raw slot (the host's map reads the FP8 rows as 16-bit elements, D / 2 a row, in
// boxes of 64 rows and IB = min(D, 128) bytes with the IB-byte swizzle), and the converter
// warps (warps 2 and 3) widen each raw slot into the stage's F16 tile, in the layout the
// 16-bit forms' TMA gives, then arrive on the stage's full barrier (one arrival a warp).
// Every FP8 value is a half exactly (loaders.cuh fp8x4_to_f16), so the stage holds the F16
// tile of the same values, bit for bit; the descale factors are the consumers' (K's times
// the scores, V's times O). Warp 1 keeps its mask role (a quant pair form has no mask
// tiles: the host launches it without an explicit mask, and a tile that needs one traps).
//
// Each CTA of a pair widens its own copy of every tile (PIPE_PEERS 1: no multicast, and
// each CTA's consumers release only its own stages); FP8 tiles are half the bytes of F16's,
// so the pair's L2 traffic is what the multicast F16 forms move.
//
// Rows past the cache's end: the raw boxes clamp to its last 64-row block, as tma_tile's
// do (finite values whose scores the class masks make -inf, and whose P is zero).
#pragma once

#include "flash_attn_prefill/loaders.cuh"
#include "flash_attn_prefill/pipeline_sm90.cuh"

#if MLXN_QUANT_ENTRIES && !MLXN_PAGED_ENTRIES
namespace hopper {

// The converter warps of the producer warpgroup (warps 4 - CONVERTERS .. 3).
constexpr int CONVERTERS = 2;

// The raw slots' mbarriers, 8 bytes each from `base` (full and empty of K and V, RS slots
// each), then each slot's tile record (32 bytes, put_tile's): the same interface as
// PipeBars, so that pipe_produce_kv fills the raw ring as it fills the stages.
template <int RS>
struct RawBars {
    u32 base;
    __device__ __forceinline__ u32 at(int kind, int st) const { return base + (u32)(8 * (kind * RS + st)); }
    __device__ __forceinline__ u32 tile(int st) const { return base + (u32)(32 * RS + 32 * st); }
    __device__ __forceinline__ u32 full_k(int st) const { return at(0, st); }
    __device__ __forceinline__ u32 full_v(int st) const { return at(1, st); }
    __device__ __forceinline__ u32 empty_k(int st) const { return at(2, st); }
    __device__ __forceinline__ u32 empty_v(int st) const { return at(3, st); }
};

// The raw slots' mbarriers of a pipeline, right after its PipeBars (PipeCfg::BAR_BYTES).
template <class PC>
__device__ __forceinline__ RawBars<PC::RS> raw_bars(const PipeBars<PC::S>& bars) {
    return RawBars<PC::RS>{bars.end()};
}

template <int RS>
__device__ __forceinline__ void init_raw_bars(const RawBars<RS>& rb) {
#pragma unroll
    for (int st = 0; st < RS; ++st) {
        mbar_init(rb.full_k(st), 1);  // the walk warp's expect_tx (or, at the end, its arrival)
        mbar_init(rb.full_v(st), 1);
        mbar_init(rb.empty_k(st), CONVERTERS);  // each converter warp, once it has read the slot
        mbar_init(rb.empty_v(st), CONVERTERS);
    }
}

// Row r's 16-byte chunk c of a raw box IB bytes wide, as the IB-byte swizzle places it (the
// box 1 KB aligned for 128, 512 bytes for 64): the chunk index XOR the address bits 7..9
// (128) or 7..8 (64) of the row.
template <int IB>
__device__ __forceinline__ u32 raw_chunk(int r, int c) {
    static_assert(IB == 64 || IB == 128, "the 64- and 128-byte swizzles");
    return (u32)(r * IB) + (u32)((IB == 128 ? c ^ (r & 7) : c ^ ((r >> 1) & 3)) << 4);
}

// This converter thread's share of a tile (N rows of D FP8 values of dtype `dt` in the raw
// slot at `raw`: D / IB column blocks of N x IB bytes) widened into the stage's tile at
// `dst` (D / 64 column blocks of N x 128 bytes, 128-byte swizzle). Item i is 16 values:
// row i % N, values (i / N) x 16 .. + 15, so a warp's 32 lanes read and write 32 rows'
// chunks at one column (the swizzles spread them over the banks).
template <int D, int N>
__device__ __forceinline__ void widen_tile(u32 raw, u32 dst, int t, int dt) {
    constexpr int IB = D < 128 ? D : 128, CPR = IB / 16, C16 = D / 16;
#pragma unroll 2
    for (int i = t; i < N * C16; i += CONVERTERS * 32) {
        const int c16 = i / N, r = i % N;
        u32 x[4];
        ld_shared_v4(raw + (u32)((c16 / CPR) * N * IB) + raw_chunk<IB>(r, c16 % CPR), x);
        u32 w[8];
#pragma unroll
        for (int e = 0; e < 4; ++e) fp8x4_to_f16(x[e], dt, w[2 * e], w[2 * e + 1]);
        const int c8 = (c16 & 3) * 2;  // the first of its two 8-half chunks in the 64-column block
        const u32 row = dst + (u32)((c16 >> 2) * N * 128 + r * 128);
        st_shared_v4(row + swz(c8, r & 7), w[0], w[1], w[2], w[3]);
        st_shared_v4(row + swz(c8 + 1, r & 7), w[4], w[5], w[6], w[7]);
    }
}

// A converter warp (cw of CONVERTERS) over the walk: the raw ring in the order the walk
// warp fills it (K of tile j, then V of tile j - 1, then the end's record), each raw slot
// widened into its stage once the consumers have released that stage, the stage's full
// barrier arrived on after the warp's stores are fenced for the tensor cores; the record of
// each tile copied to its stage (by converter 0) before that arrival. stage_k(st) and
// stage_v(st): the stage's K and V tiles; raw_k(st), raw_v(st): the raw slot's.
template <class PC, class StageK, class StageV, class RawK, class RawV>
__device__ __forceinline__ void quant_convert_kv(const PipeBars<PC::S>& bars, const RawBars<PC::RS>& rb, int cw,
                                                 int lane, int dt, StageK& stage_k, StageV& stage_v, RawK& raw_k,
                                                 RawV& raw_v) {
    const int t = cw * 32 + lane;
    auto done = [&](u32 full, u32 empty) {  // this warp's stores, fenced, then its arrivals
        fence_proxy_async();
        __syncwarp();
        if (lane == 0) {
            mbar_arrive(full);
            mbar_arrive(empty);
        }
    };
    Ring r, rv, q, qv;  // stages and raw slots: this tile's K, the last tile's V
    int j = 0;
    while (true) {
        mbar_wait(rb.full_k(q.st), q.ph);
        const bool more = (int)ld_shared_u32(rb.tile(q.st)) >= 0;  // the record's u (below 0: the end)
        if (j >= PC::S) mbar_wait(bars.empty_k(r.st), r.ph ^ 1u);
        if (cw == 0 && lane < 8) st_shared_u32(bars.tile(r.st) + (u32)(4 * lane), ld_shared_u32(rb.tile(q.st) + (u32)(4 * lane)));
        if (more) widen_tile<PC::HEAD_DIM, PC::N>(raw_k(q.st), stage_k(r.st), t, dt);
        done(bars.full_k(r.st), rb.empty_k(q.st));
        if (j >= 1) {  // V of tile j - 1
            mbar_wait(rb.full_v(qv.st), qv.ph);
            if (j - 1 >= PC::S) mbar_wait(bars.empty_v(rv.st), rv.ph ^ 1u);
            widen_tile<PC::HEAD_DIM, PC::N>(raw_v(qv.st), stage_v(rv.st), t, dt);
            done(bars.full_v(rv.st), rb.empty_v(qv.st));
        }
        if (!more) break;
        rv = r;
        qv = q;
        r.advance(PC::S);
        q.advance(PC::RS);
        ++j;
    }
}

}  // namespace hopper
#endif
