//! CUDA host side of `flash_attn_prefill_tensor_f16_d256` / `_d512`, the origin op: its
//! params block turned into the front door's ([`crate::params::FlashAttnPrefillTensorParamsGpu::as_prefill`])
//! and launched as [`super::flash_attn_prefill`] launches that op's kernels (the same entry
//! points, geometry and CTA-pair forms).

use super::flash_attn_prefill::{attention_launch, attention_pointers, attention_shared_bytes};
use super::launch::{contract, no_split, CudaKernel, Launch, PrepareContext, Variant};
use crate::error::Result;
use crate::interface::Dispatch;
use crate::recorded::{Broken, RecordedTensor};

/// This op's kernels, by name.
pub const KERNELS: &[CudaKernel] = &[
    CudaKernel {
        name: "flash_attn_prefill_tensor_f16_d256",
        entry: "flash_attn_prefill_tensor_f16_d256",
        hopper_variants: &[Variant::PairHeads, Variant::PairQueries],
        hopper_form: true,
        portable_variants: &[],
        paged: false,
        paged_pairs: false,
        quant_pairs: false,
        quant: false,
        shared_bytes: |hopper| attention_shared_bytes(256, 256, hopper),
        prepare: |pc, d, variants| prepare(pc, 256, d, variants),
        merge_entry: None,
        split: no_split,
    },
    CudaKernel {
        name: "flash_attn_prefill_tensor_f16_d512",
        entry: "flash_attn_prefill_tensor_f16_d512",
        hopper_variants: &[Variant::PairHeads, Variant::PairQueries],
        hopper_form: true,
        portable_variants: &[],
        paged: false,
        paged_pairs: false,
        quant_pairs: false,
        quant: false,
        shared_bytes: |hopper| attention_shared_bytes(512, 512, hopper),
        prepare: |pc, d, variants| prepare(pc, 512, d, variants),
        merge_entry: None,
        split: no_split,
    },
];

fn prepare(pc: &PrepareContext<'_>, head_dim: u32, d: &Dispatch, variants: bool) -> Result<Launch> {
    let name = d.pipeline.name();
    // The op validated the dispatch; a kernel that writes device memory checks what it
    // relies on: the origin's contract, then the prefill's it runs as.
    let bad = |Broken(what)| contract(name, what);
    let r = RecordedTensor::decode(d, head_dim)?.map_err(bad)?;
    let prefill = r.as_prefill().map_err(bad)?;
    let ptrs = attention_pointers(pc, name, &prefill)?;
    attention_launch(pc, name, (head_dim, head_dim), &prefill.params, &ptrs, variants, None)
}
