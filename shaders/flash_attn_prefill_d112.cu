// CUDA form of flash_attn_prefill_d112 and _d112_bf16 (SPEC 6-10) at head dim 112:
// the portable form (mma.sync) on every architecture; the parts are
// flash_attn_prefill_tensor.cu's.

#include "flash_attn_prefill/entry.cuh"

MLXN_PORTABLE_ENTRY(flash_attn_prefill_d112, 112, 112, ElemF16)
MLXN_PORTABLE_ENTRY(flash_attn_prefill_d112_bf16, 112, 112, ElemBF16)

// Shared memory of one CTA, for the host (rust/src/backend/cuda/flash_attn_prefill.rs).
static_assert(Cfg<112, 112>::SMEM == 99360, "d112 shared memory changed: update the CUDA backend");
