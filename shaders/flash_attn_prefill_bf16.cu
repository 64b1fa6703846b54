// CUDA form of flash_attn_prefill_d256_bf16 / _d512_bf16 (SPEC 6-10): BF16 K/V at head
// dims 256 and 512, the products in bfloat16 (ElemBF16); the parts are
// flash_attn_prefill_tensor.cu's.

#include "flash_attn_prefill/entry.cuh"

MLXN_ENTRY(flash_attn_prefill_d256_bf16, 256, ElemBF16)
MLXN_ENTRY(flash_attn_prefill_d512_bf16, 512, ElemBF16)
#ifdef MLXN_HOPPER
MLXN_PAIR_ENTRY(flash_attn_prefill_d256_bf16_pair_heads, 256, PAIR_HEADS, 1, 2, ElemBF16, false)
MLXN_PAIR_ENTRY(flash_attn_prefill_d256_bf16_pair_queries, 256, PAIR_QUERIES, 2, 1, ElemBF16, false)
MLXN_PAIR_ENTRY(flash_attn_prefill_d512_bf16_pair_heads, 512, PAIR_HEADS, 1, 2, ElemBF16, false)
MLXN_PAIR_ENTRY(flash_attn_prefill_d512_bf16_pair_queries, 512, PAIR_QUERIES, 2, 1, ElemBF16, false)
#endif
