// Part of shaders/flash_attn_prefill_tensor.cu (Hopper form, pipeline_sm90.cuh): the walk's
// 64-row steps grouped into the pipeline's tiles of NH steps, and what a consumer warp
// knows of a tile's rows before its scores arrive.
//
// Tile u holds cache steps u * NH .. u * NH + NH - 1 (fixed pairs, so a computed table and
// an all-ones one group the steps alike). A tile is walked when one of its steps is; a step
// of it that the walk does not walk (the table skips it, the description leaves nothing
// visible, or it is outside this CTA's share of a split) is -inf in every row, which is what
// the walk's skip means (SPEC 3: skipping changes no bit), and past the cache its K and V
// rows are zeros (the TMA fills them).
#pragma once

#include "flash_attn_prefill/block_range.cuh"

namespace hopper {

// One tile of the walk: its index, which of its steps are walked and need their mask tile,
// and the walked steps' packed table bytes (Walk::next's).
template <int NH, class TB>
struct Tile {
    int u = -1;          // below 0: none (the walk is done)
    u32 walked = 0;      // bit h: step u * NH + h is walked
    u32 need_mask = 0;   // bit h: its mask tile is read (some table byte of it is 1)
    TB sb[NH] = {};
    __device__ __forceinline__ bool valid() const { return u >= 0; }
    __device__ __forceinline__ int step(int h) const { return u * NH + h; }
};

// The walk (block_range.cuh's Walk, over 64-row steps) read a tile at a time, one walked
// step ahead. Every lane of a warp calls next() together (the walk shuffles and ballots).
template <int NH, class W>
struct TileWalk {
    typedef typename W::W TB;
    W& walk;
    int la;        // the next walked step (past walk.hi: none)
    bool la_nm;    // its mask tile is read
    TB la_sb;      // its table bytes

    __device__ __forceinline__ TileWalk(W& w, int first, bool nm, TB sb) : walk(w), la(first), la_nm(nm), la_sb(sb) {}

    __device__ __forceinline__ Tile<NH, TB> next(int lane) {
        Tile<NH, TB> tl;
        if (la > walk.hi) return tl;
        tl.u = (int)((u32)la / (u32)NH);
#pragma unroll
        for (int h = 0; h < NH; ++h) {
            // The steps of the tile come in order: each one the walk returns is taken.
            if (la <= walk.hi && la == tl.step(h)) {
                tl.walked |= 1u << h;
                tl.need_mask |= (u32)la_nm << h;
                tl.sb[h] = la_sb;
                la = walk.next(la, lane, la_nm, la_sb);
            }
        }
        return tl;
    }
};

// Whether a warpgroup computes a tile: some walked step of it has a pair visible to the
// warpgroup's rows and a table byte of them that is not 0 (wg_computes(t, sb) of a step).
template <int NH, class TB, class Computes>
__device__ __forceinline__ bool tile_computes(const Tile<NH, TB>& tl, Computes& wg_computes) {
    bool act = false;
#pragma unroll
    for (int h = 0; h < NH; ++h) act |= ((tl.walked >> h) & 1u) && wg_computes(tl.step(h), tl.sb[h]);
    return act;
}

// The class of a warp's 16 rows in each step of a tile (0 for a step not walked) and their
// table byte: what its softmax needs besides the scores.
template <int NH>
struct TileClasses {
    int cls[NH] = {};
    int table[NH] = {};
};

// rows_class(t, sb, table) -> the class of the warp's rows in step t.
template <int NH, class TB, class RowsClass>
__device__ __forceinline__ TileClasses<NH> tile_classes(const Tile<NH, TB>& tl, RowsClass& rows_class) {
    TileClasses<NH> r;
#pragma unroll
    for (int h = 0; h < NH; ++h) {
        if ((tl.walked >> h) & 1u) r.cls[h] = rows_class(tl.step(h), tl.sb[h], r.table[h]);
    }
    return r;
}

}  // namespace hopper
