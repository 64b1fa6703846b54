// CUDA form of flash_attn_prefill_d80 and _d80_bf16 (SPEC 6-10) at head dim 80:
// the portable form (mma.sync) on every architecture; the parts are
// flash_attn_prefill_tensor.cu's.

#include "flash_attn_prefill/entry.cuh"

MLXN_PORTABLE_ENTRY(flash_attn_prefill_d80, 80, 80, ElemF16)
MLXN_PORTABLE_ENTRY(flash_attn_prefill_d80_bf16, 80, 80, ElemBF16)

// Shared memory of one CTA, for the host (rust/src/backend/cuda/flash_attn_prefill.rs).
static_assert(Cfg<80, 80>::SMEM == 99360, "d80 shared memory changed: update the CUDA backend");
