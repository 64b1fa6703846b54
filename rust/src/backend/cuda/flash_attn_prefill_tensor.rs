//! CUDA host side of `flash_attn_prefill_tensor_f16_d256` / `_d512`, the origin op: its
//! params block turned into the front door's ([`crate::params::FlashAttnPrefillTensorParamsGpu::as_prefill`])
//! and launched as [`super::flash_attn_prefill`] launches that op's kernels (the same entry
//! points, geometry and CTA-pair forms).

use super::flash_attn_prefill::{attention_launch, attention_shared_bytes, AttentionPointers};
use super::launch::{contract, device_buffer, no_workspace, CudaKernel, Launch, PrepareContext};
use crate::error::Result;
use crate::interface::Dispatch;
use crate::params::FlashAttnPrefillTensorParamsGpu as Params;

/// This op's kernels, by name.
pub const KERNELS: &[CudaKernel] = &[
    CudaKernel {
        name: "flash_attn_prefill_tensor_f16_d256",
        entry: "flash_attn_prefill_tensor_f16_d256",
        hopper_variants: &[
            "flash_attn_prefill_tensor_f16_d256_pair_heads",
            "flash_attn_prefill_tensor_f16_d256_pair_queries",
        ],
        hopper_form: true,
        portable_variants: &[],
        shared_bytes: |hopper| attention_shared_bytes(256, 256, hopper),
        prepare: |pc, d, variants| prepare(pc, 256, d, variants),
        merge_entry: None,
        workspace_bytes: no_workspace,
    },
    CudaKernel {
        name: "flash_attn_prefill_tensor_f16_d512",
        entry: "flash_attn_prefill_tensor_f16_d512",
        hopper_variants: &[
            "flash_attn_prefill_tensor_f16_d512_pair_heads",
            "flash_attn_prefill_tensor_f16_d512_pair_queries",
        ],
        hopper_form: true,
        portable_variants: &[],
        shared_bytes: |hopper| attention_shared_bytes(512, 512, hopper),
        prepare: |pc, d, variants| prepare(pc, 512, d, variants),
        merge_entry: None,
        workspace_bytes: no_workspace,
    },
];

fn prepare(pc: &PrepareContext<'_>, head_dim: u32, d: &Dispatch, variants: bool) -> Result<Launch> {
    let name = d.pipeline.name();
    let p: Params = d.constant(0)?;
    let bq: u64 = if head_dim == 256 { 32 } else { 16 };
    // The op validated the dispatch; a kernel that writes device memory checks what it
    // relies on, from the same extents.
    let e = p.extents(head_dim as u64, bq).ok_or_else(|| contract(name, "shape breaks the op's contract"))?;
    let mut b = [0u64; 6];
    for (i, need) in [e.q, e.k, e.v, e.mask, e.blk, e.out].into_iter().enumerate() {
        let (addr, len) = device_buffer(pc.ctx, d, i as u64 + 1)?;
        if (len as u64) < need {
            return Err(contract(name, "a buffer is smaller than its strides need"));
        }
        b[i] = addr;
    }
    let [q, k, v, mask, blk, out] = b;
    let ptrs = AttentionPointers { q, k, v, mask, blk, out, lse: 0, cu_q: 0, cu_k: 0, sinks: 0, alibi_slopes: 0 };
    attention_launch(pc, name, (head_dim, head_dim), &p.as_prefill(head_dim as i32, bq as i32), &ptrs, variants, None)
}
