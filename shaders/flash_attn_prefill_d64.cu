// CUDA form of flash_attn_prefill_d64 and _d64_bf16 (SPEC 6-10) at head dim 64:
// the Hopper form (wgmma) where the compiler targets sm_90a, with its CTA-pair forms, else the
// portable one; the parts are flash_attn_prefill_tensor.cu's.

#include "flash_attn_prefill/entry.cuh"

MLXN_ENTRY(flash_attn_prefill_d64, 64, ElemF16)
MLXN_ENTRY(flash_attn_prefill_d64_bf16, 64, ElemBF16)
#ifdef MLXN_HOPPER
// The CTA-pair forms: the warp-specialised pipeline (pipeline_sm90.cuh), where the host
// can address K and V by TMA (fixed length); else the forms above.
MLXN_PAIR_ENTRIES(flash_attn_prefill_d64, 64, ElemF16)
MLXN_PAIR_ENTRIES(flash_attn_prefill_d64_bf16, 64, ElemBF16)
static_assert(hopper::PipeCfg<64>::SMEM <= PIPE_SMEM_RESERVED, "the d64 pipeline's shared memory: update the CUDA backend");
#endif

// Shared memory of one CTA, for the host (rust/src/backend/cuda/flash_attn_prefill.rs).
static_assert(Cfg<64, 64>::SMEM == 115744, "d64 shared memory changed: update the CUDA backend");
