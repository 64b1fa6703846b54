// Part of the CUDA attention's instantiation files (shaders/flash_attn_prefill*.cu): the
// entry points' parameters and the macros that instantiate them. The forms it includes: the
// portable one (mma.sync) and, where the compiler targets sm_90a, the Hopper one (wgmma).
#pragma once

#include "flash_attn_prefill/mainloop_sm80.cuh"
#include "flash_attn_prefill/split_merge.cuh"
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MLXN_HOPPER 1
#include "flash_attn_prefill/mainloop_sm90_pipe.cuh"
#endif

// Parameters of every attention entry point: the params block, the launch block, Q, K, V,
// the explicit mask, its table, O, lse, cu_seqlens_q, cu_seqlens_k, the sinks (pointers the
// flags say are absent are never read).
#define MLXN_ARGS                                                                                          \
    const Params p, const Launch L, const unsigned char* __restrict__ q, const u16* __restrict__ k,         \
        const u16* __restrict__ v, const u16* __restrict__ mask, const u8* __restrict__ blk,               \
        void* __restrict__ out, float* __restrict__ lse, const int* __restrict__ cu_q,                     \
        const int* __restrict__ cu_k, const float* __restrict__ sinks
#define MLXN_PASS p, L, q, k, v, mask, blk, out, lse, cu_q, cu_k, sinks

// MLXN_PAGED_ENTRIES (params.cuh): which entry points a module of this source holds. 0,
// what every contiguous call loads: the contiguous forms, as if paged K/V did not exist (the
// same entry points, launch block and machine code). 1: the paged K/V forms alone (SPEC 11:
// NAME_paged, NAME_xf_paged; the mainloops' K/V loaders read each row through the table),
// with the split-KV merge and without the CTA pairs (TMA needs contiguous K/V). The host
// compiles the second module only for a paged launch and caches it under its own key
// (rust/src/backend/cuda/nvrtc.rs module_options): a user's first call compiles a head dim's
// source, and the paged forms would add half again to that compile for every user, paged
// or not.

// MLXN_QUANT_ENTRIES (params.cuh): the module of a source's quantised K/V entry points
// (SPEC 11; FP8 E4M3 / E5M2, Q8_0: the params block's kv_dtype says which), NAME_kvq (and
// NAME_xf_kvq in the portable form), with MLXN_PAGED_ENTRIES NAME_paged_kvq (and
// NAME_xf_paged_kvq): the one-CTA forms whose K/V loaders widen the bytes to F16 in shared
// memory (loaders.cuh load_rows_quant), the products in F16. Only the F16 instantiations
// (T = ElemF16) have them: quantised K/V are no BF16 K/V, and the BF16 forms would only add to
// the module's compile. A module of its own, as the paged one is (compiled on the first
// quantised launch, under its own cache key): the contiguous module keeps its machine code
// and its compile time, and a quantised call compiles only its own entry points. Paged and
// quantised together are a fourth module (both defines), not the quant module with both
// walks: a user of quantised K/V calls one layout, and one module of each would double the
// first call's compile for every quantised user.
#define MLXN_IF_F16_ElemF16(...) __VA_ARGS__
#define MLXN_IF_F16_ElemBF16(...)
#define MLXN_IF_F16(T, ...) MLXN_IF_F16_##T(__VA_ARGS__)
#if MLXN_QUANT_ENTRIES && MLXN_PAGED_ENTRIES
#define MLXN_MODULE_SUFFIX(NAME) NAME##_paged_kvq
#define MLXN_MODULE_XF_SUFFIX(NAME) NAME##_xf_paged_kvq
#elif MLXN_QUANT_ENTRIES
#define MLXN_MODULE_SUFFIX(NAME) NAME##_kvq
#define MLXN_MODULE_XF_SUFFIX(NAME) NAME##_xf_kvq
#endif

// The portable form only, at (Q/K, V/O) head dims (DK, DV), products in T: NAME without
// softcap and ALiBi, NAME_xf with them (the host picks by the params block); with
// MLXN_PAGED_ENTRIES both on paged K/V instead: NAME_paged, NAME_xf_paged; with
// MLXN_QUANT_ENTRIES (F16 only) the quant module's names above.
#if MLXN_QUANT_ENTRIES
#define MLXN_PORTABLE_ENTRY(NAME, DK, DV, T)                                                               \
    MLXN_IF_F16(T, extern "C" __global__ void __launch_bounds__(NTHREADS, 1)                               \
                       MLXN_MODULE_SUFFIX(NAME)(MLXN_ARGS) { attention<DK, DV, T, false>(MLXN_PASS); }     \
                   extern "C" __global__ void __launch_bounds__(NTHREADS, 1)                               \
                       MLXN_MODULE_XF_SUFFIX(NAME)(MLXN_ARGS) { attention<DK, DV, T, true>(MLXN_PASS); })
#elif MLXN_PAGED_ENTRIES
#define MLXN_PORTABLE_ENTRY(NAME, DK, DV, T)                                                  \
    extern "C" __global__ void __launch_bounds__(NTHREADS, 1) NAME##_paged(MLXN_ARGS) {       \
        attention<DK, DV, T, false>(MLXN_PASS);                                               \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(NTHREADS, 1) NAME##_xf_paged(MLXN_ARGS) {    \
        attention<DK, DV, T, true>(MLXN_PASS);                                                \
    }
#else
#define MLXN_PORTABLE_ENTRY(NAME, DK, DV, T)                                                  \
    extern "C" __global__ void __launch_bounds__(NTHREADS, 1) NAME(MLXN_ARGS) {               \
        attention<DK, DV, T, false>(MLXN_PASS);                                               \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(NTHREADS, 1) NAME##_xf(MLXN_ARGS) {          \
        attention<DK, DV, T, true>(MLXN_PASS);                                                \
    }
#endif

// The Hopper form where the compiler targets sm_90a (head dims 64, 128, 256 and 512; the
// transforms are branches there, which cost its registers nothing), else the portable one;
// with MLXN_PAGED_ENTRIES NAME_paged instead (its cp.async loaders read each row through
// the table); with MLXN_QUANT_ENTRIES (F16 only) NAME_kvq or NAME_paged_kvq (its loaders
// widen the bytes).
#ifdef MLXN_HOPPER
#if MLXN_QUANT_ENTRIES
#define MLXN_ENTRY(NAME, D, T)                                                                             \
    MLXN_IF_F16(T, extern "C" __global__ void __launch_bounds__(NTHREADS, hopper::HCfg<D>::MINB)           \
                       MLXN_MODULE_SUFFIX(NAME)(MLXN_ARGS) { hopper::attention<D, PAIR_NONE, T>(MLXN_PASS); })
#elif MLXN_PAGED_ENTRIES
#define MLXN_ENTRY(NAME, D, T)                                                                \
    extern "C" __global__ void __launch_bounds__(NTHREADS, hopper::HCfg<D>::MINB) NAME##_paged(MLXN_ARGS) { \
        hopper::attention<D, PAIR_NONE, T>(MLXN_PASS);                                        \
    }
#else
#define MLXN_ENTRY(NAME, D, T)                                                                \
    extern "C" __global__ void __launch_bounds__(NTHREADS, hopper::HCfg<D>::MINB) NAME(MLXN_ARGS) { \
        hopper::attention<D, PAIR_NONE, T>(MLXN_PASS);                                        \
    }
#endif
#else
#define MLXN_ENTRY(NAME, D, T) MLXN_PORTABLE_ENTRY(NAME, D, D, T)
#endif

#ifdef MLXN_HOPPER
// The CTA-pair forms (`hopper::attention<D, PAIR_HEADS | PAIR_QUERIES>`), launched in
// clusters of two along y (heads) or x (query tiles). K and V come through tensor maps
// (4-d: head dim, KV heads, cache rows, sequences; boxes of 64 x 1 x 64 x 1 with the
// 128-byte swizzle), made by the host when the strides allow it. Head dims 64, 128 and 256
// are warp-specialised forms (tiles_sm90.cuh's PIPE; a producer warpgroup beside
// Tiles<DIM>::CONSUMERS consumer warpgroups: WS_THREADS threads with two).
#define MLXN_PAIR_WS(DIM) (hopper::Tiles<DIM>::PIPE != 0)
#define MLXN_PAIR_THREADS(DIM) (MLXN_PAIR_WS(DIM) ? 128 * (hopper::Tiles<DIM>::CONSUMERS + 1) : NTHREADS)
// One pair form's entry point FN: the pair kernel of DIM in mode MODE (clusters of CX x CY),
// its K and V tensor maps as grid constants.
#define MLXN_PAIR_KERNEL(FN, DIM, MODE, CX, CY, T, WIDE)                                                      \
    extern "C" __global__ void __cluster_dims__(CX, CY, 1) __launch_bounds__(MLXN_PAIR_THREADS(DIM), 1)     \
    FN(MLXN_ARGS, const __grid_constant__ hopper::TMap kmap, const __grid_constant__ hopper::TMap vmap) {     \
        hopper::pair_attention<DIM, MODE, T, WIDE>(MLXN_PASS, &kmap, &vmap);                                  \
    }
// The head dims whose pair forms have twins in the paged and quant modules (the pipelined
// and warp-specialised forms: 64, 128 and 256; head dim 512's pair form has none, a paged or
// quantised launch there runs its one-CTA form).
#define MLXN_PAIR_TWIN_64(...) __VA_ARGS__
#define MLXN_PAIR_TWIN_128(...) __VA_ARGS__
#define MLXN_PAIR_TWIN_256(...) __VA_ARGS__
#define MLXN_PAIR_TWIN_512(...)
#if MLXN_QUANT_ENTRIES && MLXN_PAGED_ENTRIES
// The paged quant module has none (a paged quantised launch runs the one-CTA forms).
#define MLXN_PAIR_ENTRY(NAME, DIM, MODE, CX, CY, T, WIDE)
#elif MLXN_QUANT_ENTRIES
// The quant module's: NAME_kvq, F16 only (quant_pipe.cuh: the TMA copies FP8 K/V's bytes,
// which the producer's converter warps widen to F16), whose tensor maps read the FP8 rows
// as 16-bit elements; no explicit mask (no mask tiles), nor the WIDE shape.
#define MLXN_PAIR_ENTRY(NAME, DIM, MODE, CX, CY, T, WIDE) \
    MLXN_PAIR_TWIN_##DIM(MLXN_IF_F16(T, MLXN_PAIR_KERNEL(NAME##_kvq, DIM, MODE, CX, CY, T, false)))
#elif MLXN_PAGED_ENTRIES
// The paged module's: NAME_paged (paged_tma.cuh), whose tensor maps are of the caches'
// blocks (head dim, KV heads, rows of a block, blocks) and whose boxes go through the
// table; not the shape without the mask's tiles (WIDE).
#define MLXN_PAIR_ENTRY(NAME, DIM, MODE, CX, CY, T, WIDE) \
    MLXN_PAIR_TWIN_##DIM(MLXN_PAIR_KERNEL(NAME##_paged, DIM, MODE, CX, CY, T, false))
#else
#define MLXN_PAIR_ENTRY(NAME, DIM, MODE, CX, CY, T, WIDE) MLXN_PAIR_KERNEL(NAME, DIM, MODE, CX, CY, T, WIDE)
#endif
// Both pair forms of one kernel: NAME_pair_heads (clusters along y) and NAME_pair_queries
// (along x).
#define MLXN_PAIR_ENTRIES(NAME, DIM, T)                                    \
    MLXN_PAIR_ENTRY(NAME##_pair_heads, DIM, PAIR_HEADS, 1, 2, T, false)    \
    MLXN_PAIR_ENTRY(NAME##_pair_queries, DIM, PAIR_QUERIES, 2, 1, T, false)
// The same in the pipeline's shape without the explicit mask's tiles (tiles_sm90.cuh's
// WideTiles; the same threads): NAME_pair_heads_wide and NAME_pair_queries_wide, which the
// host launches where no explicit mask is given.
#if MLXN_PAGED_ENTRIES || MLXN_QUANT_ENTRIES
#define MLXN_PAIR_WIDE_ENTRIES(NAME, DIM, T)
#else
#define MLXN_PAIR_WIDE_ENTRIES(NAME, DIM, T)                                    \
    MLXN_PAIR_ENTRY(NAME##_pair_heads_wide, DIM, PAIR_HEADS, 1, 2, T, true)     \
    MLXN_PAIR_ENTRY(NAME##_pair_queries_wide, DIM, PAIR_QUERIES, 2, 1, T, true)
#endif
#endif
