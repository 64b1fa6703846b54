// CUDA form of flash_attn_prefill_d64 and _d64_bf16 (SPEC 6-10) at head dim 64:
// the Hopper form (wgmma) where the compiler targets sm_90a, else the portable one; the parts are
// flash_attn_prefill_tensor.cu's.

#include "flash_attn_prefill/entry.cuh"

MLXN_ENTRY(flash_attn_prefill_d64, 64, ElemF16)
MLXN_ENTRY(flash_attn_prefill_d64_bf16, 64, ElemBF16)

// Shared memory of one CTA, for the host (rust/src/backend/cuda/flash_attn_prefill.rs).
static_assert(Cfg<64, 64>::SMEM == 115744, "d64 shared memory changed: update the CUDA backend");
