// CUDA form of flash_attn_prefill_d96 and _d96_bf16 (SPEC 6-10) at head dim 96:
// the portable form (mma.sync) on every architecture; the parts are
// flash_attn_prefill_tensor.cu's.

#include "flash_attn_prefill/entry.cuh"

MLXN_PORTABLE_ENTRY(flash_attn_prefill_d96, 96, 96, ElemF16)
MLXN_PORTABLE_ENTRY(flash_attn_prefill_d96_bf16, 96, 96, ElemBF16)

// Shared memory of one CTA, for the host (rust/src/backend/cuda/flash_attn_prefill.rs).
static_assert(Cfg<96, 96>::SMEM == 99360, "d96 shared memory changed: update the CUDA backend");
