//! A prefill planned once on its shapes and run on any data of those shapes, as
//! FlashInfer's `plan` / `run`: [`FlashAttnPrefillPlan::new`] checks everything that needs
//! no buffer ([`super::flash_attn_prefill::validate_shapes`]), copies a variable-length
//! batch's `cu_seqlens` to the device (checked once, on the host), and allocates the
//! explicit mask's tile table; each run checks only its buffers, classifies the mask (when
//! there is one) and encodes the attention. On CUDA a run on the caller's stream neither
//! waits nor allocates device memory, so it can be captured in a CUDA graph. Where the
//! backend can use a workspace for the shape ([`FlashAttnPrefillPlan::workspace_bytes`]: the
//! CUDA attention's split-KV parts), each run may bring one (allocated by the caller, as
//! the outputs are, so runs on different streams never share it).

use crate::buffer::MlxBuffer;
use crate::device::MlxDevice;
use crate::dtypes::DType;
use crate::encoder::{CommandEncoder, RunOptions};
use crate::error::{MlxError, Result};
use crate::interface::{BackendKind, Choices};
use crate::kernel_registry::KernelRegistry;

use super::flash_attn_prefill::{
    check_workspace, choices, dispatch_flash_attn_prefill_mask_blk, encode_validated_paged, sequence_lengths,
    validate_buffers, validate_shapes, FlashAttnPrefillBuffers, FlashAttnPrefillParams, PagedBuffers, PrefillExtents,
    PrefillOperands, ValidatedPrefill,
};
use super::flash_attn_prefill_paged::{validate_paged, PagedKv};
use crate::params::{kv_row_width, PagedKvParamsGpu, PREFILL_DESCALE, PREFILL_PAGED};

/// One planned prefill on one device.
pub struct FlashAttnPrefillPlan {
    device: MlxDevice,
    params: FlashAttnPrefillParams,
    validated: ValidatedPrefill,
    /// The explicit mask's tile table, made by every run.
    blk: Option<MlxBuffer>,
    /// A variable-length batch's `cu_seqlens_q` and `cu_seqlens_k`, on the device.
    cu_seqlens: Option<(MlxBuffer, MlxBuffer)>,
    /// The caller's run options, carried by every dispatch of a run.
    options: RunOptions,
    /// What the backend chose under them (the workspace a run can use, 0: none).
    choices: Choices,
    /// Paged K/V: the caches' block, the block table and the cache lengths, on the device.
    pages: Option<(PagedKvParamsGpu, MlxBuffer, MlxBuffer)>,
    /// FP8 K/V's descale factors (SPEC 11), F32 `[2][n_kv_heads]` on the device: K's, then V's.
    descale: Option<MlxBuffer>,
}

/// The data of one run: the plan's operands (the mask only if the plan has one, lse only
/// if it returns it, the sinks only if it has them).
#[derive(Debug, Clone, Copy)]
pub struct PrefillRunBuffers<'a> {
    pub q: &'a MlxBuffer,
    pub k: &'a MlxBuffer,
    pub v: &'a MlxBuffer,
    pub out: &'a MlxBuffer,
    pub mask: Option<&'a MlxBuffer>,
    pub lse: Option<&'a MlxBuffer>,
    pub sinks: Option<&'a MlxBuffer>,
    /// F32 ALiBi slopes when the plan has them (`FlashAttnPrefillParams::alibi_slopes`).
    pub alibi_slopes: Option<&'a MlxBuffer>,
    /// At least [`FlashAttnPrefillPlan::workspace_bytes`] bytes of scratch (U8) for this run
    /// alone, or `None` (the run is then not split).
    pub workspace: Option<&'a MlxBuffer>,
}

impl FlashAttnPrefillPlan {
    /// Plan a prefill of `params` with these operands and the library's own choices.
    /// `cu_seqlens`: the `(q, k)` offsets of a variable-length batch (`batch + 1` entries
    /// each), checked here and copied to the device; `None` for fixed length.
    pub fn new(
        device: &MlxDevice,
        params: &FlashAttnPrefillParams,
        operands: &PrefillOperands,
        cu_seqlens: Option<(&[i32], &[i32])>,
    ) -> Result<Self> {
        Self::with_options(device, params, operands, cu_seqlens, RunOptions::default())
    }

    /// [`new`](Self::new) with the caller's run options (each run's dispatches carry them;
    /// [`choices`](Self::choices) says what the backend chose under them).
    pub fn with_options(
        device: &MlxDevice,
        params: &FlashAttnPrefillParams,
        operands: &PrefillOperands,
        cu_seqlens: Option<(&[i32], &[i32])>,
        options: RunOptions,
    ) -> Result<Self> {
        if operands.kv_dtype.is_quantised_kv() && !device.backend().reads_quantised_kv() {
            return Err(MlxError::InvalidArgument(format!(
                "flash_attn_prefill: quantised k and v ({}, kv_dtype) are not read by the {:?} backend: pass F16 \
                 or BF16 k and v, or run on the CPU, CUDA or Metal",
                operands.kv_dtype,
                device.backend_kind()
            )));
        }
        let lens = match cu_seqlens {
            Some((cq, ck)) => Some(sequence_lengths(params, cq, ck)?),
            None => None,
        };
        let validated = validate_shapes(params, operands, lens.as_deref())?;
        let blk =
            if operands.mask { Some(device.alloc_buffer(DType::U8, &[validated.extents.blk as usize])?) } else { None };
        let cu_seqlens = match cu_seqlens {
            Some((cq, ck)) => {
                let upload = |v: &[i32]| -> Result<MlxBuffer> {
                    let b = device.alloc_buffer(DType::I32, &[v.len()])?;
                    b.write_bytes(0, bytemuck::cast_slice(v))?;
                    Ok(b)
                };
                Some((upload(cq)?, upload(ck)?))
            }
            None => None,
        };
        let choices = choices(device, &validated, &options);
        Ok(FlashAttnPrefillPlan {
            device: device.clone(),
            params: *params,
            validated,
            blk,
            cu_seqlens,
            options,
            choices,
            pages: None,
            descale: None,
        })
    }

    /// This plan with FP8 K/V's descale factors (SPEC 11, FlashAttention-3's `k_descale`,
    /// `v_descale`): each `None` (every factor 1), one value for every KV head, or one per KV
    /// head (`[n_kv_heads]`); the value of an element `x` of K is `k_descale[g] * float(x)`.
    /// Finite values only; they belong to the plan (copied to the device once, as the block
    /// table is). Refused, by name, for K/V that are not FP8.
    pub fn with_descale(mut self, k_descale: Option<&[f32]>, v_descale: Option<&[f32]>) -> Result<Self> {
        if k_descale.is_none() && v_descale.is_none() {
            return Ok(self);
        }
        let kv = self.validated.operands.kv_dtype;
        if !matches!(kv, DType::F8E4M3 | DType::F8E5M2) {
            return Err(MlxError::InvalidArgument(format!(
                "flash_attn_prefill: k_descale and v_descale go with FP8 k and v (F8E4M3, F8E5M2), not {kv}: {}",
                if kv == DType::Q8_0 { "Q8_0 blocks carry their own scales" } else { "leave them out" }
            )));
        }
        let nkv = self.params.n_kv_heads as usize;
        let mut factors = vec![1.0f32; 2 * nkv];
        for (i, (name, given)) in [("k_descale", k_descale), ("v_descale", v_descale)].into_iter().enumerate() {
            let Some(d) = given else { continue };
            if d.len() != 1 && d.len() != nkv {
                return Err(MlxError::InvalidArgument(format!(
                    "flash_attn_prefill: {name} has {} values; give one (for every KV head) or n_kv_heads = {nkv} \
                     (one per KV head)",
                    d.len()
                )));
            }
            if let Some(j) = d.iter().position(|x| !x.is_finite()) {
                return Err(MlxError::InvalidArgument(format!(
                    "flash_attn_prefill: {name}[{j}] is {}; descale factors must be finite",
                    d[j]
                )));
            }
            for g in 0..nkv {
                factors[i * nkv + g] = d[if d.len() == 1 { 0 } else { g }];
            }
        }
        let b = self.device.alloc_buffer(DType::F32, &[factors.len()])?;
        b.write_bytes(0, bytemuck::cast_slice(&factors))?;
        self.descale = Some(b);
        self.validated.gpu.flags |= PREFILL_DESCALE;
        Ok(self)
    }

    /// Plan a prefill on paged K/V (SPEC 11, [`validate_paged`]): `params.k_strides` and
    /// `v_strides` are the caches' (block, row, head) strides, `cu_seqlens_q` the queries'
    /// offsets for variable length (`None`: `params.rows` per sequence), and the block table
    /// and the lengths, checked here, are copied to the device for every run (every backend
    /// reads paged K/V: the CPU, CUDA and Metal). `options` as in
    /// [`with_options`](Self::with_options).
    pub fn new_paged(
        device: &MlxDevice,
        params: &FlashAttnPrefillParams,
        operands: &PrefillOperands,
        cu_seqlens_q: Option<&[i32]>,
        paged: &PagedKv<'_>,
        options: RunOptions,
    ) -> Result<Self> {
        let pp = validate_paged(params, cu_seqlens_q, paged)?;
        let cu = cu_seqlens_q.zip(pp.cu_seqlens_k.as_deref());
        let mut plan = Self::with_options(device, &pp.params, operands, cu, options)?;
        plan.validated.gpu.flags |= PREFILL_PAGED;
        // What the backend chooses for a paged prefill (CUDA: no CTA pairs; the workspace
        // depends on the shape alone, so it is unchanged).
        plan.choices = choices(device, &plan.validated, &plan.options);
        let p = &plan.validated.gpu;
        let (k, v) = pp
            .gpu
            .extents(p.n_kv_heads, kv_row_width(p.kv_dtype, p.head_dim), kv_row_width(p.kv_dtype, p.head_dim_v))
            .ok_or_else(|| {
                MlxError::InvalidArgument(format!("flash_attn_prefill: a negative paged field {:?}", pp.gpu))
            })?;
        (plan.validated.extents.k, plan.validated.extents.v) = (k, v);
        let upload = |v: &[i32]| -> Result<MlxBuffer> {
            let b = device.alloc_buffer(DType::I32, &[v.len().max(1)])?;
            b.write_bytes(0, bytemuck::cast_slice(v))?;
            Ok(b)
        };
        plan.pages = Some((pp.gpu, upload(paged.block_table)?, upload(paged.seqused_k)?));
        Ok(plan)
    }

    /// The device the plan runs on.
    pub fn device(&self) -> &MlxDevice {
        &self.device
    }

    /// What each operand must hold: elements of q, k, v, out, mask, lse (bytes of the
    /// table, which the plan owns).
    pub fn extents(&self) -> &PrefillExtents {
        &self.validated.extents
    }

    /// Bytes of workspace a run can use to go faster (the CUDA attention splits each CTA's
    /// walk over the cache when the shape leaves the GPU idle); 0 where none helps.
    pub fn workspace_bytes(&self) -> u64 {
        self.choices.workspace
    }

    /// What the backend chose for this plan under its options: the kernels' `form`, and
    /// where they apply the CTA `pairs`, the KV `splits` of a run given its workspace and
    /// the CPU's `isa`.
    pub fn choices(&self) -> &Choices {
        &self.choices
    }

    /// The operands' dtypes and which are given.
    pub fn operands(&self) -> &PrefillOperands {
        &self.validated.operands
    }

    /// The (query row, cache row, head) shape the plan was made for.
    pub fn params(&self) -> &FlashAttnPrefillParams {
        &self.params
    }

    /// Record one run on `encoder` (of the plan's device): the mask's classification when
    /// the plan has a mask, then the attention. Nothing is recorded if a buffer is wrong.
    pub fn encode(
        &self,
        encoder: &mut CommandEncoder,
        registry: &mut KernelRegistry,
        b: &PrefillRunBuffers<'_>,
    ) -> Result<()> {
        let bufs = FlashAttnPrefillBuffers {
            q: b.q,
            k: b.k,
            v: b.v,
            out: b.out,
            mask: b.mask,
            blk: self.blk.as_ref(),
            cu_seqlens_q: self.cu_seqlens.as_ref().map(|c| &c.0),
            cu_seqlens_k: self.cu_seqlens.as_ref().map(|c| &c.1),
            lse: b.lse,
            sinks: b.sinks,
            alibi_slopes: b.alibi_slopes,
            workspace: b.workspace,
        };
        validate_buffers(&bufs, &self.validated)?;
        check_workspace(&bufs, self.choices.workspace)?;
        // The plan's options on its own dispatches only: the encoder's stay for the rest.
        let theirs = encoder.options();
        encoder.set_options(self.options);
        let pages =
            self.pages.as_ref().map(|(params, block_table, seqused_k)| PagedBuffers { params, block_table, seqused_k });
        let r = (|| {
            if let (Some(mask), Some(blk)) = (b.mask, self.blk.as_ref()) {
                dispatch_flash_attn_prefill_mask_blk(encoder, registry, &self.device, mask, blk, &self.params)?;
            }
            encode_validated_paged(
                encoder,
                registry,
                &self.device,
                &bufs,
                &self.validated,
                pages,
                self.descale.as_ref(),
            )
        })();
        encoder.set_options(theirs);
        r
    }

    /// Run once and wait (`stream` `None`), or enqueue on the caller's CUDA stream and
    /// return at once (`Some(stream)`; other backends run now).
    pub fn run(&self, registry: &mut KernelRegistry, b: &PrefillRunBuffers<'_>, stream: Option<u64>) -> Result<()> {
        let mut encoder = self.device.command_encoder();
        self.encode(&mut encoder, registry, b)?;
        match stream {
            Some(s) => encoder.commit_on_stream(s),
            None => encoder.commit_and_wait(),
        }
    }

    /// A buffer over `elems` elements of `dtype` at `addr` of the plan's device's memory: a
    /// host pointer on the CPU and Metal, a device address on CUDA (checked against the
    /// driver's allocation there).
    ///
    /// # Safety
    /// The memory must stay valid, and hold that many elements, until the run that uses
    /// the buffer is complete.
    pub unsafe fn wrap(&self, name: &str, addr: u64, elems: u64, dtype: DType) -> Result<MlxBuffer> {
        let bytes = usize::try_from(elems.saturating_mul(dtype.size_of() as u64))
            .map_err(|_| MlxError::InvalidArgument(format!("flash_attn_prefill: {name} is larger than memory")))?;
        if addr == 0 && bytes > 0 {
            return Err(MlxError::InvalidArgument(format!("flash_attn_prefill: {name} is a null address")));
        }
        if !addr.is_multiple_of(dtype.size_of() as u64) {
            return Err(MlxError::InvalidArgument(format!(
                "flash_attn_prefill: {name} at address {addr:#x} is not aligned to its {dtype} elements: pass an \
                 array whose data starts at a multiple of {} bytes (a copy of it is)",
                dtype.size_of()
            )));
        }
        match self.device.backend_kind() {
            BackendKind::Cuda => self.device.wrap_device(addr, bytes, dtype, &[]),
            _ => self.device.wrap_host(addr as usize as *mut u8, bytes, dtype, &[]),
        }
    }
}
