// Part of shaders/flash_attn_prefill_tensor.cu: paged K/V (SPEC 11) in the Hopper form's
// CTA-pair forms (the paged module's NAME_pair_heads_paged / NAME_pair_queries_paged, head
// dims 64, 128 and 256). The TMA copies each 64-row box of a tile as boxes of R rows, each
// inside one block of the cache, found through the table; the host's tensor map is of the
// caches as they are laid out (head dim, KV heads, rows of a block, blocks) with boxes of
// R rows (rust/src/backend/cuda/flash_attn_prefill.rs, kv_paged_tensor_map).
//
// What the TMA cannot do is stop at the cache's end: the rows of the last block past it
// hold whatever the pool holds (another sequence's rows, NaN). Their scores become -inf
// (every step that reaches past the end is a class-1 step, whose pairs not visible are set,
// not added to) and their P is zero, but P V would still carry a NaN of V (0 x NaN), so the
// consumers zero V's rows past the end in their own copy of a tile before its product
// (zero_v_past_end). The contiguous pair forms need no such step: their map ends at the
// sequence's cache and the TMA writes zeros past it.
#pragma once

#include "flash_attn_prefill/block_range.cuh"
#include "flash_attn_prefill/sm90_ptx.cuh"

#if MLXN_PAGED_ENTRIES
namespace hopper {

// Rows of one box of a paged cache's map: the largest of 64, 32 and 16 that divides the
// block size (a multiple of 16), so a box that starts at a multiple of it never crosses a
// block. The host's map has boxes of as many rows (paged_box_rows there).
__device__ __forceinline__ int paged_box_rows(int block_size) {
    return block_size % 64 == 0 ? 64 : block_size % 32 == 0 ? 32 : 16;
}

// Cache rows j0 .. j0 + 63 of this CTA's sequence (lk rows long, lk > 0), the map's column
// block cb of KV head kvh, into `dst` (64 rows x 128 bytes, 1 KB aligned) of every CTA in
// `cta_mask`, completing bytes on `bar`: 64 / R boxes, each at its block's row. A box at
// or past the cache's end is read from the last one that starts inside it (its rows are
// past the end: their P is zero, and V's are zeroed before a product reads them), so the
// table is never read past the sequence's last block, and every box lands its bytes.
// Each box lands R x 128 bytes at dst + i x 128: a multiple of 2 KB, so the 128-byte
// swizzle's pattern (of the address bits) is the tile's.
// The grid z and the block size are read by asms the compiler neither merges nor hoists (as
// kv_row_paged does): what is derived from them (the table row's address, the divisor's
// reciprocal) is made here, never kept through the walk in the producer's few registers.
__device__ __forceinline__ void tma_box_paged(u32 dst, const TMap* map, const Launch& L, int cb, int kvh, int j0,
                                              int lk, u32 bar, unsigned short cta_mask) {
    u32 z;
    int bs;
    asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(z));
    asm volatile("mov.b32 %0, %1;" : "=r"(bs) : "r"(L.block_size));
    const int rows = paged_box_rows(bs);
    const int* __restrict__ table = L.block_table + (i64)(int)(z >> L.kv_split_log2) * L.table_stride;
    const int last = (lk - 1) / rows * rows;
    for (int i = 0; i < 64; i += rows) {
        const int j = min(j0 + i, last), b = j / bs;
        tma_load_4d_mc(dst + (u32)(i * 128), map, cb * 64, kvh, j - b * bs, __ldg(table + b), bar, cta_mask);
    }
}

// A consumer warpgroup's V tile (`rows` rows in the atom layout: D / 64 column blocks of
// rows x 128 bytes) once it is in: where the cache ends inside it (`from`, the tile's first
// row past the end, below rows), its rows from there set to zero by the warpgroup's 128
// threads (the swizzle moves chunks inside a row only, so whole rows are plain byte ranges),
// fenced for the tensor cores and met at the warpgroup's named barrier `bar_id`; else
// nothing. The other warpgroups' writes to the same tile are the same zeros.
template <int D>
__device__ __forceinline__ void zero_v_past_end(u32 tile, int rows, int from, int bar_id) {
    if (from >= rows) return;
    from = max(from, 0);
    const int chunks = (rows - from) * 8;  // 16-byte chunks of one column block's rows
    for (int i = (int)threadIdx.x & 127; i < (D / 64) * chunks; i += 128) {
        const int cb = i / chunks, c = i - cb * chunks;
        st_shared_v4(tile + (u32)(cb * rows * 128 + from * 128 + c * 16), 0u, 0u, 0u, 0u);
    }
    fence_proxy_async();
    named_barrier(bar_id, 128);
}

}  // namespace hopper
#endif
