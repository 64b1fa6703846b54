// CUDA form of flash_attn_prefill_d224 and _d224_bf16 (SPEC 6-10) at head dim 224:
// the portable form (mma.sync) on every architecture; the parts are
// flash_attn_prefill_tensor.cu's.

#include "flash_attn_prefill/entry.cuh"

MLXN_PORTABLE_ENTRY(flash_attn_prefill_d224, 224, 224, ElemF16)
MLXN_PORTABLE_ENTRY(flash_attn_prefill_d224_bf16, 224, 224, ElemBF16)

// Shared memory of one CTA, for the host (rust/src/backend/cuda/flash_attn_prefill.rs).
static_assert(Cfg<224, 224>::SMEM == 164896, "d224 shared memory changed: update the CUDA backend");
