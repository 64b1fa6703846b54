// CUDA form of flash_attn_prefill_d128 and _d128_bf16 (SPEC 6-10) at head dim 128:
// the Hopper form (wgmma) where the compiler targets sm_90a, with its CTA-pair forms, else the
// portable one; the parts are flash_attn_prefill_tensor.cu's.

#include "flash_attn_prefill/entry.cuh"

MLXN_ENTRY(flash_attn_prefill_d128, 128, ElemF16)
MLXN_ENTRY(flash_attn_prefill_d128_bf16, 128, ElemBF16)
#ifdef MLXN_HOPPER
// The CTA-pair forms: the warp-specialised pipeline (pipeline_sm90.cuh), where the host
// can address K and V by TMA (fixed length); else the forms above.
MLXN_PAIR_ENTRIES(flash_attn_prefill_d128, 128, ElemF16)
MLXN_PAIR_ENTRIES(flash_attn_prefill_d128_bf16, 128, ElemBF16)
static_assert(hopper::PipeCfg<128>::SMEM <= PIPE_SMEM_RESERVED, "the d128 pipeline's shared memory: update the CUDA backend");
#if MLXN_WS_WIDE_ENTRIES
// Where no explicit mask is given: tiles of 192 cache rows, no room for mask tiles. Compiled
// only where the host launches them (attention_geometry.rs WIDE_LAUNCHED passes the define):
// they lost to the 128-row forms (docs/benchmarks.md, 2026-12-07) and were 60% of this
// file's ptxas time.
MLXN_PAIR_WIDE_ENTRIES(flash_attn_prefill_d128, 128, ElemF16)
MLXN_PAIR_WIDE_ENTRIES(flash_attn_prefill_d128_bf16, 128, ElemBF16)
static_assert(hopper::PipeCfg<128, hopper::WideTiles<128>>::SMEM <= PIPE_SMEM_RESERVED,
              "the wide d128 pipeline's shared memory: update the CUDA backend");
#endif
#endif

// Shared memory of one CTA, for the host (rust/src/backend/cuda/flash_attn_prefill.rs).
static_assert(Cfg<128, 128>::SMEM == 99360, "d128 shared memory changed: update the CUDA backend");
