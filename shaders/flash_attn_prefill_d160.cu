// CUDA form of flash_attn_prefill_d160 and _d160_bf16 (SPEC 6-10) at head dim 160:
// the portable form (mma.sync) on every architecture; the parts are
// flash_attn_prefill_tensor.cu's.

#include "flash_attn_prefill/entry.cuh"

MLXN_PORTABLE_ENTRY(flash_attn_prefill_d160, 160, 160, ElemF16)
MLXN_PORTABLE_ENTRY(flash_attn_prefill_d160_bf16, 160, 160, ElemBF16)

// Shared memory of one CTA, for the host (rust/src/backend/cuda/flash_attn_prefill.rs).
static_assert(Cfg<160, 160>::SMEM == 132128, "d160 shared memory changed: update the CUDA backend");
