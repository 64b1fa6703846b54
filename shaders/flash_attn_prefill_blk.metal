// Classify an additive F16 mask into (bq x bk) tiles for the attention kernels
// (docs/spec.md section 1): 0 = every value -inf or <= -65504 (the tile is skipped),
// 2 = every value +0 or -0 (the mask is not read), 1 = anything else.
//
// flash_attn_prefill_mask_blk (rust/src/ops/flash_attn_prefill.rs): params bytes
// (FlashAttnPrefillMaskBlkParams) at buffer 0, the masks [batch][rows][kv_len] (batch and row
// strides in elements) at 1, the tables [batch][ceil(rows / bq)][steps] at 2; a grid of
// (steps, ceil(rows / bq), batch) threadgroups of 32 threads, one tile per threadgroup.
// Columns at or past kv_len are not read and count as masked.
//
// flash_attn_prefill_blk (rust/src/ops/flash_attn_prefill_blk.rs): params bytes at buffer 0,
// the mask [rows, kv_pad] at 1, the table [ceil(rows / bq), kv_pad / bk] at 2; a grid of
// (kv_pad / bk, ceil(rows / bq), 1) threadgroups of 32 threads: the same classifier over one
// mask of kv_pad columns.
//
// Only mask rows < rows are read: the last query tile is clamped.

#include <metal_stdlib>

using namespace metal;

// Mirror of FlashAttnPrefillBlkParamsGpu.
struct FlashAttnPrefillBlkParams {
    int rows;
    int kv_pad;
    int bq;
    int bk;
};

// Mirror of FlashAttnPrefillMaskBlkParamsGpu (rust/src/params.rs): 2 longs, then 6 words.
struct FlashAttnPrefillMaskBlkParams {
    long mask_batch_stride;
    long mask_row_stride;
    int batch;
    int rows;
    int kv_len;
    int bq;
    int bk;
    int steps;
};

// The tile (qt, kt) of mask b, by the threadgroup (kt, qt, b); positions in 64 bits.
inline void classify_tile(
    FlashAttnPrefillMaskBlkParams p,
    device const ushort * mask,  // F16 values, read as their bit patterns
    device uchar * blk,
    uint3 tgpig,
    ushort lane)
{
    const long kt = long(tgpig.x);
    const long qt = long(tgpig.y);
    const long b = long(tgpig.z);
    const long r0 = qt * long(p.bq);
    const long r1 = r0 + long(p.bq) < long(p.rows) ? r0 + long(p.bq) : long(p.rows);
    const long c0 = kt * long(p.bk);
    device const ushort * tile_mask = mask + ulong(b) * ulong(p.mask_batch_stride);

    bool all_masked = true;
    bool all_zero = true;
    for (long r = r0; r < r1 && (all_masked || all_zero); ++r) {
        device const ushort * row = tile_mask + ulong(r) * ulong(p.mask_row_stride) + ulong(c0);
        for (int j = int(lane); j < p.bk; j += 32) {
            if (c0 + j >= long(p.kv_len)) {
                all_zero = false;  // past the cache: masked, not read
                continue;
            }
            const ushort bits = row[j];
            const ushort mag = bits & 0x7fff;
            // Negative and at least 65504 in magnitude; NaN magnitudes (above 0x7c00) are not.
            all_masked = all_masked && (bits & 0x8000) != 0 && mag >= 0x7bff && mag <= 0x7c00;
            all_zero = all_zero && mag == 0;
        }
    }
    // The 32 threads of the threadgroup are one simdgroup.
    all_masked = simd_all(all_masked);
    all_zero = simd_all(all_zero);
    if (lane == 0) {
        const long table_rows = long(p.rows) / long(p.bq) + (long(p.rows) % long(p.bq) != 0 ? 1 : 0);
        blk[(ulong(b) * ulong(table_rows) + ulong(qt)) * ulong(p.steps) + ulong(kt)] =
            all_masked ? 0 : (all_zero ? 2 : 1);
    }
}

kernel void flash_attn_prefill_mask_blk(
    constant FlashAttnPrefillMaskBlkParams & p [[buffer(0)]],
    device const ushort * mask [[buffer(1)]],
    device uchar * blk [[buffer(2)]],
    uint3 tgpig [[threadgroup_position_in_grid]],
    ushort lane [[thread_index_in_simdgroup]])
{
    classify_tile(p, mask, blk, tgpig, lane);
}

kernel void flash_attn_prefill_blk(
    constant FlashAttnPrefillBlkParams & p [[buffer(0)]],
    device const ushort * mask [[buffer(1)]],
    device uchar * blk [[buffer(2)]],
    uint3 tgpig [[threadgroup_position_in_grid]],
    ushort lane [[thread_index_in_simdgroup]])
{
    FlashAttnPrefillMaskBlkParams g = {};
    g.mask_row_stride = p.kv_pad;
    g.batch = 1;
    g.rows = p.rows;
    g.kv_len = p.kv_pad;
    g.bq = p.bq;
    g.bk = p.bk;
    g.steps = p.kv_pad / p.bk;
    classify_tile(g, mask, blk, tgpig, lane);
}
