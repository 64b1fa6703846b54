// CUDA form of flash_attn_prefill_d256 / _d512 (SPEC sections 2 and 6-9), which the origin
// op's flash_attn_prefill_tensor_f16_d256 / _d512 also run, with a fixed layout (the host
// turns their params into these: one sequence, an explicit mask, F32 in and out).
//
// Compiled at run time with NVRTC for the device's own architecture (sm_80 and later:
// ldmatrix, cp.async, mma.sync m16n8k16 f16 -> f32). No CUDA header is included: every
// half-precision operation is inline PTX, so the source compiles with NVRTC alone.
//
// One CTA = 8 warps over ROWS (query row, head) pairs: RG row groups of 32 rows (32
// consecutive queries of one head) and G = D / 128 warps per row group. All heads of a
// CTA share one KV head, so a K/V tile in shared memory serves every head of the CTA
// (heads_per_cta of the `group` query heads of that KV head; more heads, fewer queries).
//
// Per 64-row cache step, warp w of a row group:
//   S  = Q K^T for its 32 rows and its JW = 64 / G columns of the step, over the full
//        head dim (Q and K from shared memory through ldmatrix, mma.sync);
//   the row maxima are exchanged inside the row group, so every warp applies the same
//        lazy rescale (threshold 8) of SPEC step 4;
//   P  = half(exp(S - M)) is written to shared memory as ready mma A-fragments, and every
//        warp reads the whole 32 x 64 P of its row group back;
//   O += P V for its 32 rows and its 128 output columns (O stays in registers).
// Each warp keeps the partial row sums of its own P columns; they are added at the end.
//
// A CTA works on one sequence of the batch (blockIdx.z): fixed length, at its batch
// strides, or variable length, at its rows of cu_seqlens (SPEC 7). The steps it walks are
// those its rows can see by the description (causal, window: a range of steps, computed,
// never classified) and, with an explicit mask, those its tile table does not skip. Each
// 16-row m-tile of a step has a class: the description's (0 nothing visible, 2 all
// visible and the step whole, 1 otherwise) combined with the table's byte (bq = 32 at 256,
// 16 at 512; 2 without a mask): 0 if either is 0 (-inf scores, which changes no bit), 2 if
// both are 2 (no per-element work), else 1 (-inf where a pair is not visible, the mask
// added where the byte is 1). The CTA loads a step's mask tile only if some byte is 1. K
// and V rows past the sequence's cache are never read (zero-filled in shared memory).

//
// The kernel is in parts (shaders/flash_attn_prefill/, joined with this file by the CUDA
// backend): common (types, PTX), params, block_range (sequences, visibility, classes, the
// walk), loaders, softmax (with SPEC 10's score transforms), epilogue, one mainloop per
// architecture (the portable one, mma.sync; the Hopper one, wgmma, where the compiler
// targets sm_90a) and entry (the entry points' parameters and macros). This file and its
// siblings (flash_attn_prefill_bf16.cu, flash_attn_prefill_d<dims>.cu) instantiate them:
// here F16 K/V at head dims 256 and 512.

#include "flash_attn_prefill/entry.cuh"

// The entry points (the origin op's names; the new op launches them too).
MLXN_ENTRY(flash_attn_prefill_tensor_f16_d256, 256, ElemF16)
MLXN_ENTRY(flash_attn_prefill_tensor_f16_d512, 512, ElemF16)
#ifdef MLXN_HOPPER
MLXN_PAIR_ENTRY(flash_attn_prefill_tensor_f16_d256_pair_heads, 256, PAIR_HEADS, 1, 2, ElemF16, false)
MLXN_PAIR_ENTRY(flash_attn_prefill_tensor_f16_d256_pair_queries, 256, PAIR_QUERIES, 2, 1, ElemF16, false)
MLXN_PAIR_ENTRY(flash_attn_prefill_tensor_f16_d512_pair_heads, 512, PAIR_HEADS, 1, 2, ElemF16, false)
MLXN_PAIR_ENTRY(flash_attn_prefill_tensor_f16_d512_pair_queries, 512, PAIR_QUERIES, 2, 1, ElemF16, false)
#endif

// Shared memory of one CTA, for the host (kept in step with Cfg by a compile-time check).
static_assert(Cfg<256, 256>::SMEM == 164896, "d256 shared memory changed: update the CUDA backend");
static_assert(Cfg<512, 512>::SMEM == 214048, "d512 shared memory changed: update the CUDA backend");
