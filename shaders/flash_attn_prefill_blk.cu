// CUDA form of flash_attn_prefill_blk (SPEC section 1): one U8 per (bq x bk) tile of the
// additive F16 mask [rows, kv_pad]: 0 = every value -inf or <= -65504, 2 = every value +0
// or -0, 1 = anything else. Only mask rows < rows are read (the last tile is clamped).
//
// One warp classifies one tile; a CTA of 8 warps takes 8 consecutive tiles of the
// row-major table. No CUDA header is needed.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;

struct BlkParams {
    int rows, kv_pad, bq, bk;
};

__device__ __forceinline__ void classify_half(u32 h, bool& masked, bool& zero) {
    const u32 mag = h & 0x7fffu;
    // Negative, magnitude in [65504, inf]: NaN magnitudes (> 0x7c00) are not masked.
    masked = masked && (h & 0x8000u) != 0u && mag >= 0x7bffu && mag <= 0x7c00u;
    zero = zero && mag == 0u;
}

// `aligned`: the mask base is 16-byte aligned and bk is a multiple of 8 (16-byte loads).
extern "C" __global__ void __launch_bounds__(256)
flash_attn_prefill_blk(const BlkParams p, const u16* __restrict__ mask, u8* __restrict__ blk, int aligned) {
    const int lane = threadIdx.x & 31;
    const i64 k_tiles = p.kv_pad / p.bk;
    const i64 q_tiles = ((i64)p.rows + p.bq - 1) / p.bq;  // in 64 bits: rows + bq may pass 2^31
    const i64 tile = (i64)blockIdx.x * 8 + (threadIdx.x >> 5);
    if (tile >= q_tiles * k_tiles) return;  // the whole warp leaves together
    const i64 qt = tile / k_tiles, kt = tile % k_tiles;
    const i64 r0 = qt * p.bq;
    const i64 r1 = min((i64)p.rows, r0 + p.bq);
    const i64 c0 = kt * p.bk;
    bool masked = true, zero = true;
    if (aligned) {
        const int cpr = p.bk / 8;  // 16-byte chunks per tile row
        const i64 total = (r1 - r0) * cpr;
        for (i64 i = lane; i < total && (masked || zero); i += 32) {
            const i64 r = r0 + i / cpr;
            const uint4 w = *reinterpret_cast<const uint4*>(mask + r * p.kv_pad + c0 + (i % cpr) * 8);
            const u32 ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                classify_half(ws[e] & 0xffffu, masked, zero);
                classify_half(ws[e] >> 16, masked, zero);
            }
        }
    } else {
        const i64 total = (r1 - r0) * p.bk;
        for (i64 i = lane; i < total && (masked || zero); i += 32) {
            const i64 r = r0 + i / p.bk;
            classify_half(mask[r * p.kv_pad + c0 + i % p.bk], masked, zero);
        }
    }
    masked = __all_sync(0xffffffffu, masked);
    zero = __all_sync(0xffffffffu, zero);
    if (lane == 0) blk[tile] = masked ? 0 : (zero ? 2 : 1);
}

// ------------------------------------------------------------------ the front door's table
//
// flash_attn_prefill_mask_blk: the table of an explicit mask over a batch, [batch or 1,
// rows, kv_len] at its strides: per table batch b, tile (qt, kt) of rows [qt * bq,
// min(qt * bq + bq, rows)) and columns [kt * bk, kt * bk + bk); columns at or past kv_len
// count as masked (they do not exist). Byte at b * (table_rows * steps) + qt * steps + kt.

struct MaskBlkParams {
    long long mask_batch_stride, mask_row_stride;
    int batch, rows, kv_len, bq, bk, steps;
};

// `aligned`: the mask base and its strides are 16-byte aligned and bk is a multiple of 8.
extern "C" __global__ void __launch_bounds__(256)
flash_attn_prefill_mask_blk(const MaskBlkParams p, const u16* __restrict__ mask, u8* __restrict__ blk, int aligned) {
    const int lane = threadIdx.x & 31;
    const i64 q_tiles = ((i64)p.rows + p.bq - 1) / p.bq;
    const i64 per_batch = q_tiles * p.steps;
    const i64 tile = (i64)blockIdx.x * 8 + (threadIdx.x >> 5);
    if (tile >= per_batch * p.batch) return;  // the whole warp leaves together
    const i64 b = tile / per_batch, in_b = tile % per_batch;
    const i64 qt = in_b / p.steps, kt = in_b % p.steps;
    const i64 r0 = qt * p.bq;
    const i64 r1 = min((i64)p.rows, r0 + p.bq);
    const i64 c0 = kt * p.bk;
    const i64 c1 = min((i64)p.kv_len, c0 + p.bk);  // columns past kv_len are masked: not read
    const u16* base = mask + b * p.mask_batch_stride;
    bool masked = true, zero = c1 == c0 + p.bk;  // a cut tile is never all zero
    if (aligned && c1 == c0 + p.bk) {
        const int cpr = p.bk / 8;  // 16-byte chunks per tile row
        const i64 total = (r1 - r0) * cpr;
        for (i64 i = lane; i < total && (masked || zero); i += 32) {
            const i64 r = r0 + i / cpr;
            const uint4 w = *reinterpret_cast<const uint4*>(base + r * p.mask_row_stride + c0 + (i % cpr) * 8);
            const u32 ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                classify_half(ws[e] & 0xffffu, masked, zero);
                classify_half(ws[e] >> 16, masked, zero);
            }
        }
    } else {
        const i64 width = c1 - c0;
        const i64 total = (r1 - r0) * width;
        for (i64 i = lane; i < total && (masked || zero); i += 32) {
            const i64 r = r0 + i / width;
            classify_half(base[r * p.mask_row_stride + c0 + i % width], masked, zero);
        }
    }
    masked = __all_sync(0xffffffffu, masked);
    zero = __all_sync(0xffffffffu, zero);
    if (lane == 0) blk[tile] = masked ? 0 : (zero ? 2 : 1);
}
