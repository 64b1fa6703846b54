// CUDA form of flash_attn_prefill_d192 and _d192_bf16 (SPEC 6-10) at head dim 192:
// the portable form (mma.sync) on every architecture; the parts are
// flash_attn_prefill_tensor.cu's.

#include "flash_attn_prefill/entry.cuh"

MLXN_PORTABLE_ENTRY(flash_attn_prefill_d192, 192, 192, ElemF16)
MLXN_PORTABLE_ENTRY(flash_attn_prefill_d192_bf16, 192, 192, ElemBF16)

// Shared memory of one CTA, for the host (rust/src/backend/cuda/flash_attn_prefill.rs).
static_assert(Cfg<192, 192>::SMEM == 132128, "d192 shared memory changed: update the CUDA backend");
