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
// The kernel is in parts (shaders/flash_attn_prefill/, handed to NVRTC as headers by the
// CUDA backend): common (types, PTX), params, block_range (sequences, visibility, classes,
// the walk), loaders, softmax, epilogue, and one mainloop per architecture: the portable
// one (mma.sync) and, where the compiler targets sm_90a, the Hopper one (wgmma); this
// file holds the entry points.

#include "flash_attn_prefill/mainloop_sm80.cuh"
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MLXN_HOPPER 1
#include "flash_attn_prefill/mainloop_sm90.cuh"
#endif

// The entry points (the origin op's names; the new op launches them too). Parameters: the
// params block, the launch block, Q, K, V, the explicit mask, its table, O, lse,
// cu_seqlens_q, cu_seqlens_k (pointers the flags say are absent are never read).
#define MLXN_ARGS                                                                                          \
    const Params p, const Launch L, const unsigned char* __restrict__ q, const u16* __restrict__ k,         \
        const u16* __restrict__ v, const u16* __restrict__ mask, const u8* __restrict__ blk,               \
        void* __restrict__ out, float* __restrict__ lse, const int* __restrict__ cu_q,                     \
        const int* __restrict__ cu_k
#define MLXN_PASS p, L, q, k, v, mask, blk, out, lse, cu_q, cu_k

extern "C" __global__ void __launch_bounds__(NTHREADS, 1) flash_attn_prefill_tensor_f16_d256(MLXN_ARGS) {
#ifdef MLXN_HOPPER
    hopper::attention<256>(MLXN_PASS);
#else
    attention<256>(MLXN_PASS);
#endif
}

extern "C" __global__ void __launch_bounds__(NTHREADS, 1) flash_attn_prefill_tensor_f16_d512(MLXN_ARGS) {
#ifdef MLXN_HOPPER
    hopper::attention<512>(MLXN_PASS);
#else
    attention<512>(MLXN_PASS);
#endif
}

#ifdef MLXN_HOPPER
// The CTA-pair forms (`hopper::attention<D, PAIR_HEADS | PAIR_QUERIES>`), launched in
// clusters of two along y (heads) or x (query tiles). K and V come through tensor maps
// (4-d: head dim, KV heads, cache rows, sequences; boxes of 64 x 1 x 64 x 1 with the
// 128-byte swizzle), made by the host when the strides allow it.
#define MLXN_PAIR_ENTRY(NAME, DIM, MODE, CX, CY)                                                            \
    extern "C" __global__ void __cluster_dims__(CX, CY, 1) __launch_bounds__(NTHREADS, 1)                 \
    NAME(MLXN_ARGS, const __grid_constant__ hopper::TMap kmap, const __grid_constant__ hopper::TMap vmap) { \
        hopper::attention<DIM, MODE>(MLXN_PASS, &kmap, &vmap);                                              \
    }
MLXN_PAIR_ENTRY(flash_attn_prefill_tensor_f16_d256_pair_heads, 256, PAIR_HEADS, 1, 2)
MLXN_PAIR_ENTRY(flash_attn_prefill_tensor_f16_d256_pair_queries, 256, PAIR_QUERIES, 2, 1)
MLXN_PAIR_ENTRY(flash_attn_prefill_tensor_f16_d512_pair_heads, 512, PAIR_HEADS, 1, 2)
MLXN_PAIR_ENTRY(flash_attn_prefill_tensor_f16_d512_pair_queries, 512, PAIR_QUERIES, 2, 1)
#endif

// Shared memory of one CTA, for the host (kept in step with Cfg by a compile-time check).
static_assert(Cfg<256>::SMEM == 164896, "d256 shared memory changed: update the CUDA backend");
static_assert(Cfg<512>::SMEM == 214048, "d512 shared memory changed: update the CUDA backend");

