// CUDA form of flash_attn_prefill_d576_512 and _d576_512_bf16 (SPEC 6-10) at Q/K head dim 576 with V/O head dim 512 (DeepSeek's absorbed MLA):
// the portable form (mma.sync) on every architecture; the parts are
// flash_attn_prefill_tensor.cu's.

#include "flash_attn_prefill/entry.cuh"

MLXN_PORTABLE_ENTRY(flash_attn_prefill_d576_512, 576, 512, ElemF16)
MLXN_PORTABLE_ENTRY(flash_attn_prefill_d576_512_bf16, 576, 512, ElemBF16)

// Shared memory of one CTA, for the host (rust/src/backend/cuda/flash_attn_prefill.rs).
static_assert(Cfg<576, 512>::SMEM == 230432, "d576_512 shared memory changed: update the CUDA backend");
