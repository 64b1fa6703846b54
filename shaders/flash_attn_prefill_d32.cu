// CUDA form of flash_attn_prefill_d32 and _d32_bf16 (SPEC 6-10) at head dim 32:
// the portable form (mma.sync) on every architecture; the parts are
// flash_attn_prefill_tensor.cu's.

#include "flash_attn_prefill/entry.cuh"

MLXN_PORTABLE_ENTRY(flash_attn_prefill_d32, 32, 32, ElemF16)
MLXN_PORTABLE_ENTRY(flash_attn_prefill_d32_bf16, 32, 32, ElemBF16)

// Shared memory of one CTA, for the host (rust/src/backend/cuda/flash_attn_prefill.rs).
static_assert(Cfg<32, 32>::SMEM == 115744, "d32 shared memory changed: update the CUDA backend");
