// Classify an additive F16 mask into (bq x bk) tiles for the attention kernel
// (docs/spec.md section 1): 0 = every value -inf or <= -65504 (the tile is skipped),
// 2 = every value +0 or -0 (the mask is not read), 1 = anything else.
//
// Bindings (rust/src/ops/flash_attn_prefill_blk.rs): params bytes at buffer 0, the mask
// [rows, kv_pad] at 1, the table [ceil(rows / bq), kv_pad / bk] at 2; a grid of
// (kv_pad / bk, ceil(rows / bq), 1) threadgroups of 32 threads, one tile per threadgroup.
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

kernel void flash_attn_prefill_blk(
    constant FlashAttnPrefillBlkParams & p [[buffer(0)]],
    device const ushort * mask [[buffer(1)]],  // F16 values, read as their bit patterns
    device uchar * blk [[buffer(2)]],
    uint3 tgpig [[threadgroup_position_in_grid]],
    ushort lane [[thread_index_in_simdgroup]])
{
    const int kt = int(tgpig.x);
    const int qt = int(tgpig.y);
    const int r0 = qt * p.bq;
    const int r1 = min(r0 + p.bq, p.rows);
    const int c0 = kt * p.bk;

    bool all_masked = true;
    bool all_zero = true;
    for (int r = r0; r < r1 && (all_masked || all_zero); ++r) {
        device const ushort * row = mask + ulong(r) * ulong(p.kv_pad) + ulong(c0);
        for (int j = int(lane); j < p.bk; j += 32) {
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
        blk[ulong(qt) * ulong(p.kv_pad / p.bk) + ulong(kt)] = all_masked ? 0 : (all_zero ? 2 : 1);
    }
}
