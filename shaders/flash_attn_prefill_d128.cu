// CUDA form of flash_attn_prefill_d128 and _d128_bf16 (SPEC 6-10) at head dim 128:
// the Hopper form (wgmma) where the compiler targets sm_90a, else the portable one; the parts are
// flash_attn_prefill_tensor.cu's.

#include "flash_attn_prefill/entry.cuh"

MLXN_ENTRY(flash_attn_prefill_d128, 128, ElemF16)
MLXN_ENTRY(flash_attn_prefill_d128_bf16, 128, ElemBF16)

// Shared memory of one CTA, for the host (rust/src/backend/cuda/flash_attn_prefill.rs).
static_assert(Cfg<128, 128>::SMEM == 99360, "d128 shared memory changed: update the CUDA backend");
