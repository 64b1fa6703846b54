// CUDA form of flash_attn_prefill_d16 and _d16_bf16 (SPEC 6-10) at head dim 16:
// the portable form (mma.sync) on every architecture; the parts are
// flash_attn_prefill_tensor.cu's.

#include "flash_attn_prefill/entry.cuh"

MLXN_PORTABLE_ENTRY(flash_attn_prefill_d16, 16, 16, ElemF16)
MLXN_PORTABLE_ENTRY(flash_attn_prefill_d16_bf16, 16, 16, ElemBF16)

// Shared memory of one CTA, for the host (rust/src/backend/cuda/flash_attn_prefill.rs).
static_assert(Cfg<16, 16>::SMEM == 115744, "d16 shared memory changed: update the CUDA backend");
