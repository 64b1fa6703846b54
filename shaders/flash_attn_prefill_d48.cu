// CUDA form of flash_attn_prefill_d48 and _d48_bf16 (SPEC 6-10) at head dim 48:
// the portable form (mma.sync) on every architecture; the parts are
// flash_attn_prefill_tensor.cu's.

#include "flash_attn_prefill/entry.cuh"

MLXN_PORTABLE_ENTRY(flash_attn_prefill_d48, 48, 48, ElemF16)
MLXN_PORTABLE_ENTRY(flash_attn_prefill_d48_bf16, 48, 48, ElemBF16)

// Shared memory of one CTA, for the host (rust/src/backend/cuda/flash_attn_prefill.rs).
static_assert(Cfg<48, 48>::SMEM == 115744, "d48 shared memory changed: update the CUDA backend");
