//! Flash attention for prefill over a batch (SPEC sections 6-9), beside the origin op
//! [`super::flash_attn_prefill_tensor`], which stays as it is.
//!
//! What it adds to the origin op:
//! - **batches**: `batch` sequences of `rows` query rows and `kv_len` cache rows each, with
//!   batch strides (fixed length), or variable length through `cu_seqlens_q` /
//!   `cu_seqlens_k` (FlashAttention's convention, SPEC 7);
//! - **described masks**: `causal` and `window`, with each prompt at the end of its cache
//!   (SPEC 6): the kernels decide visibility from indices, and no `[rows, kv]` array
//!   exists; an explicit additive F16 mask may be added on the visible pairs, with its tile
//!   table from [`dispatch_flash_attn_prefill_mask_blk`];
//! - **lse** (SPEC 8), and the dtypes of SPEC 9: Q F32, F16 or BF16, O F32, F16 or BF16
//!   (written by the kernel itself);
//! - any cache length: K and V need not be padded (the last step is partial).
//!
//! Strides are in elements, the last axis of every tensor contiguous. Validation follows
//! the origin's care: every failure is `InvalidArgument` (or `UnsupportedDtype`) naming the
//! problem, and nothing is dispatched.

use super::flash_attn_prefill_blk::{FLASH_ATTN_PREFILL_BLK_CUDA, FLASH_ATTN_PREFILL_BLK_METAL};
use super::flash_attn_prefill_tensor::{
    FLASH_ATTN_PREFILL_CUDA_PARTS, FLASH_ATTN_PREFILL_TENSOR_CUDA, FLASH_ATTN_PREFILL_TENSOR_METAL,
};
use crate::buffer::MlxBuffer;
use crate::device::MlxDevice;
use crate::dtypes::DType;
use crate::encoder::{as_bytes, CommandEncoder, GridSize, KernelArg, RunOptions};
use crate::error::{MlxError, Result};
use crate::interface::Choices;
use crate::kernel_registry::{KernelRegistry, KernelSource, SourceFile};
pub use crate::params::PrefillExtents;
use crate::params::{
    FlashAttnPrefillMaskBlkParamsGpu, FlashAttnPrefillParamsGpu, PagedKvParamsGpu, PREFILL_ALIBI_SLOPES,
    PREFILL_CAUSAL, PREFILL_DESCALE, PREFILL_LSE, PREFILL_MASK, PREFILL_OFFSET, PREFILL_PAGED, PREFILL_SINKS,
    PREFILL_VARLEN, PREFILL_WINDOW_RIGHT,
};
use crate::recorded::{attention_slot as slot, classifier_slot};

/// The attention's device sources (MSL, CUDA): the same files as the origin op's, whose
/// kernels are this one's with a fixed layout.
pub static FLASH_ATTN_PREFILL_SHADER_SOURCE: KernelSource =
    KernelSource { metal: Some(FLASH_ATTN_PREFILL_TENSOR_METAL), cuda: Some(FLASH_ATTN_PREFILL_TENSOR_CUDA) };

/// The explicit mask's classifier (MSL, CUDA): the origin's classifier's files.
pub static FLASH_ATTN_PREFILL_MASK_BLK_SHADER_SOURCE: KernelSource =
    KernelSource { metal: Some(FLASH_ATTN_PREFILL_BLK_METAL), cuda: Some(FLASH_ATTN_PREFILL_BLK_CUDA) };

/// Kernel entry point at head dim 256.
pub const K_PREFILL_D256: &str = "flash_attn_prefill_d256";
/// Kernel entry point at head dim 512.
pub const K_PREFILL_D512: &str = "flash_attn_prefill_d512";

/// The head dims of SPEC 10, as (Q and K columns, V and O columns), and the kernel of each
/// for F16 and for BF16 K/V.
pub const HEAD_DIMS: [((u32, u32), &str, &str); 14] = [
    ((16, 16), "flash_attn_prefill_d16", "flash_attn_prefill_d16_bf16"),
    ((32, 32), "flash_attn_prefill_d32", "flash_attn_prefill_d32_bf16"),
    ((48, 48), "flash_attn_prefill_d48", "flash_attn_prefill_d48_bf16"),
    ((64, 64), "flash_attn_prefill_d64", "flash_attn_prefill_d64_bf16"),
    ((80, 80), "flash_attn_prefill_d80", "flash_attn_prefill_d80_bf16"),
    ((96, 96), "flash_attn_prefill_d96", "flash_attn_prefill_d96_bf16"),
    ((112, 112), "flash_attn_prefill_d112", "flash_attn_prefill_d112_bf16"),
    ((128, 128), "flash_attn_prefill_d128", "flash_attn_prefill_d128_bf16"),
    ((160, 160), "flash_attn_prefill_d160", "flash_attn_prefill_d160_bf16"),
    ((192, 192), "flash_attn_prefill_d192", "flash_attn_prefill_d192_bf16"),
    ((224, 224), "flash_attn_prefill_d224", "flash_attn_prefill_d224_bf16"),
    ((256, 256), K_PREFILL_D256, "flash_attn_prefill_d256_bf16"),
    ((512, 512), K_PREFILL_D512, "flash_attn_prefill_d512_bf16"),
    ((576, 512), "flash_attn_prefill_d576_512", "flash_attn_prefill_d576_512_bf16"),
];

/// The kernels of the head dims and K/V dtypes every backend runs: all of [`HEAD_DIMS`], F16
/// and BF16 (a name outside this list is refused when validating, with the dims it takes).
pub const REGISTERED_KERNELS: &[&str] = &[
    "flash_attn_prefill_d16",
    "flash_attn_prefill_d16_bf16",
    "flash_attn_prefill_d32",
    "flash_attn_prefill_d32_bf16",
    "flash_attn_prefill_d48",
    "flash_attn_prefill_d48_bf16",
    "flash_attn_prefill_d64",
    "flash_attn_prefill_d64_bf16",
    "flash_attn_prefill_d80",
    "flash_attn_prefill_d80_bf16",
    "flash_attn_prefill_d96",
    "flash_attn_prefill_d96_bf16",
    "flash_attn_prefill_d112",
    "flash_attn_prefill_d112_bf16",
    "flash_attn_prefill_d128",
    "flash_attn_prefill_d128_bf16",
    "flash_attn_prefill_d160",
    "flash_attn_prefill_d160_bf16",
    "flash_attn_prefill_d192",
    "flash_attn_prefill_d192_bf16",
    "flash_attn_prefill_d224",
    "flash_attn_prefill_d224_bf16",
    K_PREFILL_D256,
    "flash_attn_prefill_d256_bf16",
    K_PREFILL_D512,
    "flash_attn_prefill_d512_bf16",
    "flash_attn_prefill_d576_512",
    "flash_attn_prefill_d576_512_bf16",
];
/// The kernels of F32 K/V, by head dim pair: the CPU reads F32 K/V natively; CUDA and
/// Metal have no such kernels (the callers convert K/V to F16 first, docs/spec.md).
pub const F32_KV_KERNELS: [((u32, u32), &str); 14] = [
    ((16, 16), "flash_attn_prefill_d16_f32"),
    ((32, 32), "flash_attn_prefill_d32_f32"),
    ((48, 48), "flash_attn_prefill_d48_f32"),
    ((64, 64), "flash_attn_prefill_d64_f32"),
    ((80, 80), "flash_attn_prefill_d80_f32"),
    ((96, 96), "flash_attn_prefill_d96_f32"),
    ((112, 112), "flash_attn_prefill_d112_f32"),
    ((128, 128), "flash_attn_prefill_d128_f32"),
    ((160, 160), "flash_attn_prefill_d160_f32"),
    ((192, 192), "flash_attn_prefill_d192_f32"),
    ((224, 224), "flash_attn_prefill_d224_f32"),
    ((256, 256), "flash_attn_prefill_d256_f32"),
    ((512, 512), "flash_attn_prefill_d512_f32"),
    ((576, 512), "flash_attn_prefill_d576_512_f32"),
];

/// The entry points that read paged K/V (SPEC 11) on a backend whose paged walk is a kernel of
/// its own (`Backend::paged_kv_entry_points`: Metal), by the kernel of [`REGISTERED_KERNELS`]
/// they stand for. Elsewhere a paged prefill runs that kernel itself, with `PREFILL_PAGED`.
pub const PAGED_KERNELS: [(&str, &str); 42] = [
    ("flash_attn_prefill_d16", "flash_attn_prefill_paged_d16"),
    ("flash_attn_prefill_d16_bf16", "flash_attn_prefill_paged_d16_bf16"),
    ("flash_attn_prefill_d32", "flash_attn_prefill_paged_d32"),
    ("flash_attn_prefill_d32_bf16", "flash_attn_prefill_paged_d32_bf16"),
    ("flash_attn_prefill_d48", "flash_attn_prefill_paged_d48"),
    ("flash_attn_prefill_d48_bf16", "flash_attn_prefill_paged_d48_bf16"),
    ("flash_attn_prefill_d64", "flash_attn_prefill_paged_d64"),
    ("flash_attn_prefill_d64_bf16", "flash_attn_prefill_paged_d64_bf16"),
    ("flash_attn_prefill_d80", "flash_attn_prefill_paged_d80"),
    ("flash_attn_prefill_d80_bf16", "flash_attn_prefill_paged_d80_bf16"),
    ("flash_attn_prefill_d96", "flash_attn_prefill_paged_d96"),
    ("flash_attn_prefill_d96_bf16", "flash_attn_prefill_paged_d96_bf16"),
    ("flash_attn_prefill_d112", "flash_attn_prefill_paged_d112"),
    ("flash_attn_prefill_d112_bf16", "flash_attn_prefill_paged_d112_bf16"),
    ("flash_attn_prefill_d128", "flash_attn_prefill_paged_d128"),
    ("flash_attn_prefill_d128_bf16", "flash_attn_prefill_paged_d128_bf16"),
    ("flash_attn_prefill_d160", "flash_attn_prefill_paged_d160"),
    ("flash_attn_prefill_d160_bf16", "flash_attn_prefill_paged_d160_bf16"),
    ("flash_attn_prefill_d192", "flash_attn_prefill_paged_d192"),
    ("flash_attn_prefill_d192_bf16", "flash_attn_prefill_paged_d192_bf16"),
    ("flash_attn_prefill_d224", "flash_attn_prefill_paged_d224"),
    ("flash_attn_prefill_d224_bf16", "flash_attn_prefill_paged_d224_bf16"),
    ("flash_attn_prefill_d256", "flash_attn_prefill_paged_d256"),
    ("flash_attn_prefill_d256_bf16", "flash_attn_prefill_paged_d256_bf16"),
    ("flash_attn_prefill_d512", "flash_attn_prefill_paged_d512"),
    ("flash_attn_prefill_d512_bf16", "flash_attn_prefill_paged_d512_bf16"),
    ("flash_attn_prefill_d576_512", "flash_attn_prefill_paged_d576_512"),
    ("flash_attn_prefill_d576_512_bf16", "flash_attn_prefill_paged_d576_512_bf16"),
    // Quantised K/V (SPEC 11): their paged walk.
    ("flash_attn_prefill_d16_kvq", "flash_attn_prefill_paged_d16_kvq"),
    ("flash_attn_prefill_d32_kvq", "flash_attn_prefill_paged_d32_kvq"),
    ("flash_attn_prefill_d48_kvq", "flash_attn_prefill_paged_d48_kvq"),
    ("flash_attn_prefill_d64_kvq", "flash_attn_prefill_paged_d64_kvq"),
    ("flash_attn_prefill_d80_kvq", "flash_attn_prefill_paged_d80_kvq"),
    ("flash_attn_prefill_d96_kvq", "flash_attn_prefill_paged_d96_kvq"),
    ("flash_attn_prefill_d112_kvq", "flash_attn_prefill_paged_d112_kvq"),
    ("flash_attn_prefill_d128_kvq", "flash_attn_prefill_paged_d128_kvq"),
    ("flash_attn_prefill_d160_kvq", "flash_attn_prefill_paged_d160_kvq"),
    ("flash_attn_prefill_d192_kvq", "flash_attn_prefill_paged_d192_kvq"),
    ("flash_attn_prefill_d224_kvq", "flash_attn_prefill_paged_d224_kvq"),
    ("flash_attn_prefill_d256_kvq", "flash_attn_prefill_paged_d256_kvq"),
    ("flash_attn_prefill_d512_kvq", "flash_attn_prefill_paged_d512_kvq"),
    ("flash_attn_prefill_d576_512_kvq", "flash_attn_prefill_paged_d576_512_kvq"),
];

/// The paged entry points are Metal's only.
static PAGED_SOURCE: KernelSource = KernelSource { metal: Some(FLASH_ATTN_PREFILL_TENSOR_METAL), cuda: None };

/// The kernel that runs a prefill of `kernel` on `device`: its paged entry point
/// ([`PAGED_KERNELS`]) where the prefill is paged and the backend has such entry points (a
/// kernel without one, F32 K/V's, stays itself: Metal has neither form of it).
fn kernel_on(device: &MlxDevice, kernel: &'static str, paged: bool) -> &'static str {
    if !paged || !device.backend().paged_kv_entry_points() {
        return kernel;
    }
    PAGED_KERNELS.iter().find(|(k, _)| *k == kernel).map_or(kernel, |(_, p)| *p)
}

/// The kernels of quantised K/V (SPEC 11: FP8 E4M3 and E5M2 with descale factors, Q8_0),
/// by head dim pair: one per pair for the three formats (the block's K/V code says which);
/// the CPU dequantises each K/V step as it loads it, CUDA runs its F16 kernel's source in
/// that source's quant module (its loaders widen the bytes to F16 in shared memory:
/// `backend/cuda/flash_attn_prefill.rs` `quant_kernel!`), Metal entry points of their own
/// (`shaders/flash_attn_prefill_tensor.metal`: K sub-tiles and V slices widened to half in
/// threadgroup memory; paged, [`PAGED_KERNELS`]).
pub const QUANT_KV_KERNELS: [((u32, u32), &str); 14] = [
    ((16, 16), "flash_attn_prefill_d16_kvq"),
    ((32, 32), "flash_attn_prefill_d32_kvq"),
    ((48, 48), "flash_attn_prefill_d48_kvq"),
    ((64, 64), "flash_attn_prefill_d64_kvq"),
    ((80, 80), "flash_attn_prefill_d80_kvq"),
    ((96, 96), "flash_attn_prefill_d96_kvq"),
    ((112, 112), "flash_attn_prefill_d112_kvq"),
    ((128, 128), "flash_attn_prefill_d128_kvq"),
    ((160, 160), "flash_attn_prefill_d160_kvq"),
    ((192, 192), "flash_attn_prefill_d192_kvq"),
    ((224, 224), "flash_attn_prefill_d224_kvq"),
    ((256, 256), "flash_attn_prefill_d256_kvq"),
    ((512, 512), "flash_attn_prefill_d512_kvq"),
    ((576, 512), "flash_attn_prefill_d576_512_kvq"),
];

/// The F32 K/V kernels have no device source: only the CPU runs them.
static F32_KV_SOURCE: KernelSource = KernelSource { metal: None, cuda: None };

/// The device sources of a quantised K/V kernel at head dims `dims`: the CUDA file of the F16
/// kernel of those dims (whose quant module holds its entry points) and the Metal file.
fn quant_kv_source(dims: (u32, u32)) -> KernelSource {
    let f16 = HEAD_DIMS.iter().find(|(d, _, _)| *d == dims).map_or("", |(_, f16, _)| *f16);
    *prefill_kernel_source(f16)
}

/// The explicit mask's classifier.
pub const K_PREFILL_MASK_BLK: &str = "flash_attn_prefill_mask_blk";

/// Cache rows per step, and columns of a tile of the explicit mask's table.
pub const CACHE_ROWS_PER_STEP: u32 = 64;
const SIMDGROUPS: u64 = 8;

/// A CUDA instantiation file of the attention (`shaders/flash_attn_prefill_*.cu`) with the
/// kernel's parts, and the Metal file every head dim shares.
macro_rules! prefill_source {
    ($file:literal) => {
        KernelSource {
            metal: Some(FLASH_ATTN_PREFILL_TENSOR_METAL),
            cuda: Some(SourceFile {
                name: $file,
                text: include_str!(concat!("../../../shaders/", $file)),
                headers: FLASH_ATTN_PREFILL_CUDA_PARTS,
            }),
        }
    };
}

static PREFILL_BF16_SOURCE: KernelSource = prefill_source!("flash_attn_prefill_bf16.cu");
static PREFILL_D16_SOURCE: KernelSource = prefill_source!("flash_attn_prefill_d16.cu");
static PREFILL_D32_SOURCE: KernelSource = prefill_source!("flash_attn_prefill_d32.cu");
static PREFILL_D48_SOURCE: KernelSource = prefill_source!("flash_attn_prefill_d48.cu");
static PREFILL_D64_SOURCE: KernelSource = prefill_source!("flash_attn_prefill_d64.cu");
static PREFILL_D80_SOURCE: KernelSource = prefill_source!("flash_attn_prefill_d80.cu");
static PREFILL_D96_SOURCE: KernelSource = prefill_source!("flash_attn_prefill_d96.cu");
static PREFILL_D112_SOURCE: KernelSource = prefill_source!("flash_attn_prefill_d112.cu");
static PREFILL_D128_SOURCE: KernelSource = prefill_source!("flash_attn_prefill_d128.cu");
static PREFILL_D160_SOURCE: KernelSource = prefill_source!("flash_attn_prefill_d160.cu");
static PREFILL_D192_SOURCE: KernelSource = prefill_source!("flash_attn_prefill_d192.cu");
static PREFILL_D224_SOURCE: KernelSource = prefill_source!("flash_attn_prefill_d224.cu");
static PREFILL_D576_512_SOURCE: KernelSource = prefill_source!("flash_attn_prefill_d576_512.cu");

/// The device sources of each kernel of [`HEAD_DIMS`]: one CUDA file per head-dim pair (its
/// F16 and BF16 kernels; at 256 and 512, the origin's file for F16 and one file for BF16),
/// so a device compiles only the head dims it runs.
fn prefill_kernel_source(name: &str) -> &'static KernelSource {
    let dims =
        HEAD_DIMS.iter().find(|(_, f16, bf16)| *f16 == name || *bf16 == name).map(|(d, f16, _)| (*d, *f16 == name));
    match dims {
        Some(((256 | 512, _), true)) => &FLASH_ATTN_PREFILL_SHADER_SOURCE,
        Some(((256 | 512, _), false)) => &PREFILL_BF16_SOURCE,
        Some(((16, _), _)) => &PREFILL_D16_SOURCE,
        Some(((32, _), _)) => &PREFILL_D32_SOURCE,
        Some(((48, _), _)) => &PREFILL_D48_SOURCE,
        Some(((64, _), _)) => &PREFILL_D64_SOURCE,
        Some(((80, _), _)) => &PREFILL_D80_SOURCE,
        Some(((96, _), _)) => &PREFILL_D96_SOURCE,
        Some(((112, _), _)) => &PREFILL_D112_SOURCE,
        Some(((128, _), _)) => &PREFILL_D128_SOURCE,
        Some(((160, _), _)) => &PREFILL_D160_SOURCE,
        Some(((192, _), _)) => &PREFILL_D192_SOURCE,
        Some(((224, _), _)) => &PREFILL_D224_SOURCE,
        _ => &PREFILL_D576_512_SOURCE,
    }
}

/// Register the entry points against their sources: every kernel of [`HEAD_DIMS`] (the op
/// refuses those a backend of this build lacks, [`REGISTERED_KERNELS`]) and the classifier.
pub fn register(registry: &mut KernelRegistry) {
    for name in HEAD_DIMS.iter().flat_map(|(_, f16, bf16)| [*f16, *bf16]) {
        registry.register_source(name, *prefill_kernel_source(name));
    }
    for (_, name) in F32_KV_KERNELS {
        registry.register_source(name, F32_KV_SOURCE);
    }
    for (dims, name) in QUANT_KV_KERNELS {
        registry.register_source(name, quant_kv_source(dims));
    }
    for (_, name) in PAGED_KERNELS {
        registry.register_source(name, PAGED_SOURCE);
    }
    registry.register_source(K_PREFILL_MASK_BLK, FLASH_ATTN_PREFILL_MASK_BLK_SHADER_SOURCE);
}

/// Shapes, strides and the mask description of one prefill. Strides are in elements (the
/// last axis of every tensor is contiguous); `#[repr(C)]`: the C ABI passes it as it is.
///
/// Fixed length: `batch` sequences of `rows` query rows and `kv_len` cache rows, sequence
/// `b` at `b * <x>_strides[0]`. Variable length (`cu_seqlens_*` bound): `rows` and `kv_len`
/// are the totals, the batch strides must be 0, and sequence `b` owns rows
/// `cu_seqlens_q[b]..cu_seqlens_q[b + 1]` of Q and O and `cu_seqlens_k[b]..` of K and V.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct FlashAttnPrefillParams {
    /// Q `[batch, rows, n_heads, head_dim]`: batch, row and head strides.
    pub q_strides: [u64; 3],
    /// K `[batch, kv_len, n_kv_heads, head_dim]`.
    pub k_strides: [u64; 3],
    /// V, as K.
    pub v_strides: [u64; 3],
    /// O `[batch, rows, n_heads, head_dim]`.
    pub out_strides: [u64; 3],
    /// The explicit mask `[batch or 1, rows, kv_len]`: batch stride (0: one mask for every
    /// sequence) and row stride. Ignored without a mask.
    pub mask_strides: [u64; 2],
    /// lse `[batch, n_heads, rows]` (variable length: `[n_heads, total rows]`): batch and
    /// head strides; rows are contiguous. Ignored without lse.
    pub lse_strides: [u64; 2],
    pub batch: u32,
    pub rows: u32,
    pub kv_len: u32,
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    /// 1: query row r sees cache row j only if `j <= r + kv_len - rows` (per sequence).
    pub causal: u32,
    /// `w >= 1`: also only if `j > r + kv_len - rows - w` (needs `causal`); 0: no window.
    pub window: u32,
    /// Folded into Q before Q is rounded to half (SPEC 2, step 1).
    pub scale: f32,
    /// Columns of V and O; 0: `head_dim` (they differ only at (576, 512), SPEC 10).
    pub head_dim_v: u32,
    /// SPEC 10: above 0, `s = softcap * tanh(s / softcap)` before the mask is added.
    pub softcap: f32,
    /// SPEC 10: above 0, the explicit mask is scaled by each head's ALiBi slope.
    pub max_bias: f32,
    /// With `has_offset` 1: query row r of every sequence sits at position `r + offset` of its
    /// cache, for `causal` and `window` (a chunk of queries against a chunk of the cache, as
    /// context parallelism computes them); with 0, the prompt is the end of its cache
    /// (`offset = kv_len - rows` per sequence, SPEC 6).
    pub offset: i32,
    pub has_offset: u32,
    /// With `has_window_right` 1: query row r (at cache position `p = r + offset`) sees cache
    /// row j only if `j <= p + window_right` (the right side of flash-attn's
    /// `window_size=(left, right)`; its left side is `window = left + 1`). Without causal
    /// only: causal caps the right side at 0 and this is then ignored.
    pub window_right: u32,
    pub has_window_right: u32,
    /// flash-attn's `alibi_slopes`: 0 none; 1 an F32 `[n_heads]` buffer; 2 `[batch, n_heads]`.
    /// Each computed score gains `-slope_h * |p - j|`. Not with `max_bias > 0`.
    pub alibi_slopes: u32,
}

/// The buffers of one prefill. `mask` and `blk` go together (the table of `mask`, made by
/// [`dispatch_flash_attn_prefill_mask_blk`]); so do the two `cu_seqlens`.
#[derive(Debug, Clone, Copy)]
pub struct FlashAttnPrefillBuffers<'a> {
    pub q: &'a MlxBuffer,
    pub k: &'a MlxBuffer,
    pub v: &'a MlxBuffer,
    pub out: &'a MlxBuffer,
    pub mask: Option<&'a MlxBuffer>,
    pub blk: Option<&'a MlxBuffer>,
    pub cu_seqlens_q: Option<&'a MlxBuffer>,
    pub cu_seqlens_k: Option<&'a MlxBuffer>,
    pub lse: Option<&'a MlxBuffer>,
    /// SPEC 10: F32 `[n_heads]`, each head's sink logit.
    pub sinks: Option<&'a MlxBuffer>,
    /// F32 `[n_heads]` or `[batch, n_heads]` (`FlashAttnPrefillParams::alibi_slopes`).
    pub alibi_slopes: Option<&'a MlxBuffer>,
    /// Scratch memory the backend may use to run faster ([`workspace_bytes`]: the CUDA
    /// attention's split-KV parts when the shape leaves the GPU idle); `None` runs without.
    /// It must hold at least that many bytes and overlap no other buffer.
    pub workspace: Option<&'a MlxBuffer>,
}

/// Bytes of workspace a prefill [`validate`]d as `v` can use on `device` under `options`
/// (0: none). Give a buffer of at least this many bytes as
/// [`FlashAttnPrefillBuffers::workspace`] to let the backend split the cache's walk (the
/// plan's extents report it).
pub fn workspace_bytes(device: &MlxDevice, v: &ValidatedPrefill, options: &RunOptions) -> u64 {
    choices(device, v, options).workspace
}

/// What `device`'s backend will run for a prefill [`validate`]d as `v` under `options`
/// (its workspace and its choices: the plan reports them). A prefill with no query row
/// runs nothing and uses no workspace.
pub fn choices(device: &MlxDevice, v: &ValidatedPrefill, options: &RunOptions) -> Choices {
    let c = device.backend().choices(v.kernel, as_bytes(&v.gpu), options);
    if v.empty {
        return Choices { workspace: 0, ..c };
    }
    c
}

/// A given workspace must hold `need` bytes, the prefill's [`workspace_bytes`] (a smaller
/// one is a mistake, not a quiet fall-back: the caller asked for the split).
pub fn check_workspace(b: &FlashAttnPrefillBuffers<'_>, need: u64) -> Result<()> {
    let Some(ws) = b.workspace else { return Ok(()) };
    if (ws.data_byte_len() as u64) < need {
        return Err(invalid(format!(
            "the workspace holds {} bytes; this prefill needs {need} (mlxn_prefill_plan_extents gives it), or none",
            ws.data_byte_len()
        )));
    }
    Ok(())
}

/// Query rows of one row of the explicit mask's tile table (its `bq`), per head dim (of Q
/// and K): 32 up to 256 and 16 at 512 and 576, the origin's `queries_per_threadgroup`, so one
/// classifier serves both ops. Each backend's query tiles read this table (SPEC 1).
pub fn mask_tile_rows(head_dim: u32) -> Result<u32> {
    match head_dim {
        16 | 32 | 48 | 64 | 80 | 96 | 112 | 128 | 160 | 192 | 224 | 256 => Ok(32),
        512 | 576 => Ok(16),
        _ => Err(unsupported_head_dim(head_dim, head_dim)),
    }
}

fn unsupported_head_dim(head_dim: u32, head_dim_v: u32) -> MlxError {
    unsupported_head_dim_among(REGISTERED_KERNELS, head_dim, head_dim_v)
}

/// The error for a head dim pair without a kernel among `registered`, with the dims it has.
fn unsupported_head_dim_among(registered: &[&str], head_dim: u32, head_dim_v: u32) -> MlxError {
    let dims: Vec<String> = HEAD_DIMS
        .iter()
        .filter(|(_, f16, bf16)| registered.contains(f16) || registered.contains(bf16))
        .map(|((k, v), _, _)| if k == v { k.to_string() } else { format!("{k} with v {v}") })
        .collect();
    MlxError::InvalidArgument(format!(
        "flash_attn_prefill: unsupported head_dim {head_dim} (v head dim {head_dim_v}); this build's kernels take {}",
        dims.join(", ")
    ))
}

/// The kernel of a (Q/K, V) head dim pair and K/V dtype.
pub fn kernel_name(head_dim: u32, head_dim_v: u32, kv_dtype: DType) -> Result<&'static str> {
    kernel_name_among(REGISTERED_KERNELS, head_dim, head_dim_v, kv_dtype)
}

/// [`kernel_name`] in a build whose kernels are `registered` (a test gives a list that
/// lacks some, as a build without a backend's form of them would).
fn kernel_name_among(registered: &[&str], head_dim: u32, head_dim_v: u32, kv_dtype: DType) -> Result<&'static str> {
    let unsupported = || unsupported_head_dim_among(registered, head_dim, head_dim_v);
    let (_, f16, bf16) = HEAD_DIMS.iter().find(|(d, _, _)| *d == (head_dim, head_dim_v)).ok_or_else(unsupported)?;
    let name = match kv_dtype {
        DType::F16 => f16,
        DType::BF16 => bf16,
        DType::F32 => {
            let f32 = F32_KV_KERNELS.iter().find(|(d, _)| *d == (head_dim, head_dim_v)).map(|(_, n)| *n);
            return f32.ok_or_else(unsupported);
        }
        DType::F8E4M3 | DType::F8E5M2 | DType::Q8_0 => {
            if kv_dtype == DType::Q8_0 && (!head_dim.is_multiple_of(32) || !head_dim_v.is_multiple_of(32)) {
                return Err(MlxError::InvalidArgument(format!(
                    "flash_attn_prefill: Q8_0 k and v store 32 values per block along the head dim; head_dim {head_dim} \
                     (v {head_dim_v}) is not a multiple of 32: use FP8 or F16 K/V at this head dim"
                )));
            }
            let q = QUANT_KV_KERNELS.iter().find(|(d, _)| *d == (head_dim, head_dim_v)).map(|(_, n)| *n);
            return q.ok_or_else(unsupported);
        }
        other => {
            return Err(MlxError::UnsupportedDtype(format!(
                "flash_attn_prefill: k and v must be F16, BF16, F32 or quantised (F8E4M3, F8E5M2, Q8_0), got {other}"
            )))
        }
    };
    if registered.contains(name) {
        Ok(name)
    } else if kv_dtype == DType::BF16 && registered.contains(f16) {
        Err(MlxError::UnsupportedDtype(format!(
            "flash_attn_prefill: this build has no BF16 K/V kernel at head dim {head_dim}; convert k and v to F16"
        )))
    } else {
        Err(unsupported())
    }
}

/// Threadgroup memory of one dispatch of the Metal kernel: the origin's formula at the
/// head dim's tile rows (queries at Q/K's width, scores, probabilities, row scale, rescale
/// flag), padded to 16.
pub fn threadgroup_memory_bytes(head_dim: u32) -> Result<u64> {
    let q = mask_tile_rows(head_dim)? as u64;
    let c = CACHE_ROWS_PER_STEP as u64;
    let raw = q * head_dim as u64 * 2 + q * c * (4 + 2) + q * 4 + 4;
    Ok(raw.div_ceil(16) * 16)
}

/// Threadgroup memory of one dispatch of a quantised K/V Metal kernel (`_kvq`): the queries,
/// then from the scores' offset on the larger of the 16-bit kernel's rest and one K sub-tile
/// widened to half (16 rows where they fit the scores' and probabilities' memory, else 8:
/// head dims 512 and 576, whose sub-tile reaches past it), padded to 16.
pub fn quant_threadgroup_memory_bytes(head_dim: u32) -> Result<u64> {
    let q = mask_tile_rows(head_dim)? as u64;
    let (c, d) = (CACHE_ROWS_PER_STEP as u64, head_dim as u64);
    let rest = q * c * (4 + 2) + q * 4 + 4;
    let k_rows = if 16 * d * 2 <= q * c * 6 { 16 } else { 8 };
    Ok((q * d * 2 + rest.max(k_rows * d * 2)).div_ceil(16) * 16)
}

/// Bytes of the explicit mask's tile table for `p`: `[batch or 1][ceil(rows / bq)][ceil(kv_len / 64)]`
/// (one table when the mask has batch stride 0).
pub fn mask_table_bytes(p: &FlashAttnPrefillParams) -> Result<u64> {
    let bq = mask_tile_rows(p.head_dim)? as u64;
    let tables = if p.mask_strides[0] == 0 { 1 } else { p.batch as u64 };
    Ok(tables
        .saturating_mul((p.rows as u64).div_ceil(bq))
        .saturating_mul((p.kv_len as u64).div_ceil(CACHE_ROWS_PER_STEP as u64)))
}

fn invalid(msg: String) -> MlxError {
    MlxError::InvalidArgument(format!("flash_attn_prefill: {msg}"))
}

/// Elements a `[n0, n1, n2, width]` view with strides `s` spans: 0 when any count is 0.
fn span(counts: [u64; 3], s: [u64; 3], width: u64) -> u64 {
    if counts.contains(&0) || width == 0 {
        return 0;
    }
    (counts[0] - 1)
        .saturating_mul(s[0])
        .saturating_add((counts[1] - 1).saturating_mul(s[1]))
        .saturating_add((counts[2] - 1).saturating_mul(s[2]))
        .saturating_add(width)
}

fn dtype_in(name: &str, got: DType, allowed: &[DType]) -> Result<()> {
    if allowed.contains(&got) {
        return Ok(());
    }
    let names: Vec<String> = allowed.iter().map(|d| d.to_string()).collect();
    Err(MlxError::UnsupportedDtype(format!("flash_attn_prefill: {name} must be {}, got {got}", names.join(" or "))))
}

fn need(name: &str, buf: &MlxBuffer, dtype: DType, elems: u64) -> Result<()> {
    dtype_in(name, buf.dtype(), &[dtype])?;
    let bytes = elems.saturating_mul(dtype.size_of() as u64);
    if (buf.data_byte_len() as u64) < bytes {
        return Err(invalid(format!("{name} holds {} bytes, its shape and strides need {bytes}", buf.data_byte_len())));
    }
    Ok(())
}

/// Read the `cu_seqlens` of a variable-length batch (`batch + 1` int32 each, a copy to the
/// host for device memory) and check them (SPEC 7).
pub fn read_sequence_lengths(
    p: &FlashAttnPrefillParams,
    cu_q: &MlxBuffer,
    cu_k: &MlxBuffer,
) -> Result<Vec<(u32, u32)>> {
    let n = p.batch as usize + 1;
    let read = |name: &str, b: &MlxBuffer| -> Result<Vec<i32>> {
        dtype_in(name, b.dtype(), &[DType::I32])?;
        if b.element_count() < n {
            return Err(invalid(format!(
                "{name} has {} entries, a batch of {} needs {n} (batch + 1)",
                b.element_count(),
                p.batch
            )));
        }
        let mut bytes = vec![0u8; n * 4];
        b.read_bytes(0, &mut bytes)?;
        Ok(bytes.chunks_exact(4).map(|c| i32::from_ne_bytes([c[0], c[1], c[2], c[3]])).collect())
    };
    sequence_lengths(p, &read("cu_seqlens_q", cu_q)?, &read("cu_seqlens_k", cu_k)?)
}

/// The sequences' (query rows, cache rows) from `cu_seqlens` values, checked (SPEC 7):
/// `batch + 1` entries each, starting at 0, non-decreasing, ending at the totals; and a
/// causal sequence's cache no shorter than its prompt.
pub fn sequence_lengths(p: &FlashAttnPrefillParams, cq: &[i32], ck: &[i32]) -> Result<Vec<(u32, u32)>> {
    let n = p.batch as usize + 1;
    let check = |name: &str, cu: &[i32], total: u32| -> Result<()> {
        if cu.len() != n {
            return Err(invalid(format!(
                "{name} has {} entries, a batch of {} needs {n} (batch + 1)",
                cu.len(),
                p.batch
            )));
        }
        if cu[0] != 0 {
            return Err(invalid(format!("{name}[0] is {}, it must be 0", cu[0])));
        }
        if let Some(i) = cu.windows(2).position(|w| w[1] < w[0]) {
            return Err(invalid(format!("{name} decreases at entry {}: {} then {}", i + 1, cu[i], cu[i + 1])));
        }
        if cu[n - 1] as i64 != total as i64 {
            return Err(invalid(format!(
                "{name} ends at {}, not at the total of {total} rows its tensor has",
                cu[n - 1]
            )));
        }
        Ok(())
    };
    check("cu_seqlens_q", cq, p.rows)?;
    check("cu_seqlens_k", ck, p.kv_len)?;
    let lens: Vec<(u32, u32)> =
        (0..p.batch as usize).map(|b| ((cq[b + 1] - cq[b]) as u32, (ck[b + 1] - ck[b]) as u32)).collect();
    if p.causal != 0 && p.has_offset == 0 {
        if let Some(b) = lens.iter().position(|&(lq, lk)| lk < lq) {
            return Err(invalid(format!(
                "sequence {b} has {} query rows but {} cache rows: a causal prompt is the end of its cache, which cannot be shorter",
                lens[b].0, lens[b].1
            )));
        }
    }
    Ok(lens)
}

/// What a prefill's buffers are, before any exists: their dtypes and which are given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillOperands {
    pub q_dtype: DType,
    pub kv_dtype: DType,
    pub out_dtype: DType,
    pub mask: bool,
    pub lse: bool,
    pub sinks: bool,
    /// ALiBi slopes are given (their shape in `FlashAttnPrefillParams::alibi_slopes`).
    pub alibi_slopes: bool,
}

/// A prefill whose shapes, strides, description and dtypes were checked: the params
/// block, the kernel, the grid and what each buffer must hold.
#[derive(Debug, Clone)]
pub struct ValidatedPrefill {
    pub gpu: FlashAttnPrefillParamsGpu,
    pub kernel: &'static str,
    pub grid: GridSize,
    /// Nothing to compute (no query row): no dispatch.
    pub empty: bool,
    pub operands: PrefillOperands,
    pub extents: PrefillExtents,
}

/// The largest `max_bias` taken: every ALiBi slope (the smallest is `2^-max_bias`) stays a
/// normal f32.
pub const MAX_BIAS_LIMIT: f32 = 126.0;

/// Check `p` with its operands' dtypes (SPEC 6-9), and, for a variable-length batch, the
/// sequence lengths (`lens`, from [`sequence_lengths`]; `None` for fixed length). Every
/// check that needs no buffer.
pub fn validate_shapes(
    p: &FlashAttnPrefillParams,
    o: &PrefillOperands,
    lens: Option<&[(u32, u32)]>,
) -> Result<ValidatedPrefill> {
    let head_dim_v = if p.head_dim_v == 0 { p.head_dim } else { p.head_dim_v };
    let kernel = kernel_name(p.head_dim, head_dim_v, o.kv_dtype)?;
    let bq = mask_tile_rows(p.head_dim)?;
    if p.n_heads == 0 || p.n_kv_heads == 0 {
        return Err(invalid(format!("n_heads {} and n_kv_heads {} must be at least 1", p.n_heads, p.n_kv_heads)));
    }
    if !p.n_heads.is_multiple_of(p.n_kv_heads) {
        return Err(invalid(format!("n_heads {} is not a multiple of n_kv_heads {}", p.n_heads, p.n_kv_heads)));
    }
    if p.causal > 1 {
        return Err(invalid(format!("causal must be 0 or 1, got {}", p.causal)));
    }
    if p.has_offset > 1 {
        return Err(invalid(format!("has_offset must be 0 or 1, got {}", p.has_offset)));
    }
    if p.has_window_right > 1 {
        return Err(invalid(format!("has_window_right must be 0 or 1, got {}", p.has_window_right)));
    }
    if p.alibi_slopes > 2 {
        return Err(invalid(format!(
            "alibi_slopes must be 0 (none), 1 ([n_heads]) or 2 ([batch, n_heads]), got {}",
            p.alibi_slopes
        )));
    }
    if (p.alibi_slopes != 0) != o.alibi_slopes {
        return Err(invalid(format!(
            "params.alibi_slopes is {} but the slopes are {}given",
            p.alibi_slopes,
            if o.alibi_slopes { "" } else { "not " }
        )));
    }
    // A right bound counts only without causal (causal's is 0, the tightest a window takes).
    let right = p.has_window_right == 1 && p.causal == 0;
    if p.has_offset == 1 && p.causal == 0 && p.window == 0 && !right {
        return Err(invalid(format!(
            "an offset ({}) places the queries for a described mask (causal or a window); without one it means nothing",
            p.offset
        )));
    }
    if !p.scale.is_finite() {
        return Err(invalid(format!("scale {} is not a finite number", p.scale)));
    }
    if !p.softcap.is_finite() || p.softcap < 0.0 {
        return Err(invalid(format!("softcap {} must be a finite number >= 0 (0: none)", p.softcap)));
    }
    if !p.max_bias.is_finite() || p.max_bias < 0.0 {
        return Err(invalid(format!("max_bias {} must be a finite number >= 0 (0: no ALiBi)", p.max_bias)));
    }
    // The smallest slope is head n2 - 1's, 2^-max_bias: past 2^-126 it is no normal f32, and at
    // 0 a masked (-inf) entry would become 0 * -inf = NaN.
    if p.max_bias > MAX_BIAS_LIMIT {
        return Err(invalid(format!(
            "max_bias {} is above {MAX_BIAS_LIMIT}: the smallest ALiBi slope, 2^-max_bias, would underflow float32",
            p.max_bias
        )));
    }
    if p.max_bias > 0.0 && p.alibi_slopes != 0 {
        return Err(invalid(
            "max_bias and alibi_slopes are two ways to give ALiBi's slopes: pass one of them (max_bias 0 with \
             alibi_slopes)"
                .into(),
        ));
    }
    if p.max_bias > 0.0 && !o.mask && p.causal == 0 {
        return Err(invalid(
            "ALiBi needs positions: pass causal=True, a window, or an explicit mask holding -|i-j| (max_bias > 0 \
             scales the mask by each head's slope; with neither there is nothing to scale)"
                .into(),
        ));
    }
    let dims = [p.batch, p.rows, p.kv_len, p.n_heads, p.n_kv_heads, p.window, p.window_right];
    if dims.iter().any(|&x| x > i32::MAX as u32) {
        return Err(invalid(format!("a dimension exceeds i32: {p:?}")));
    }
    let strides = [p.q_strides, p.k_strides, p.v_strides, p.out_strides];
    if strides.iter().flatten().chain(p.mask_strides.iter()).chain(p.lse_strides.iter()).any(|&s| s > i64::MAX as u64) {
        return Err(invalid(format!("a stride exceeds i64: {p:?}")));
    }
    dtype_in("q", o.q_dtype, &[DType::F32, DType::F16, DType::BF16])?;
    dtype_in("k and v", o.kv_dtype, &[DType::F16, DType::BF16, DType::F32, DType::F8E4M3, DType::F8E5M2, DType::Q8_0])?;
    dtype_in("out", o.out_dtype, &[DType::F32, DType::F16, DType::BF16])?;
    if let Some(lens) = lens {
        if o.mask {
            return Err(invalid(
                "an explicit mask cannot go with cu_seqlens: describe the mask (causal, window) or pad the batch to a fixed length"
                    .into(),
            ));
        }
        let batch_strides = [p.q_strides[0], p.k_strides[0], p.v_strides[0], p.out_strides[0], p.lse_strides[0]];
        if batch_strides.iter().any(|&s| s != 0) {
            return Err(invalid(
                "with cu_seqlens the sequences are rows of one tensor: the batch strides (of q, k, v, out, lse) must be 0"
                    .into(),
            ));
        }
        if lens.len() != p.batch as usize {
            return Err(invalid(format!("{} sequence lengths for a batch of {}", lens.len(), p.batch)));
        }
    } else if p.causal != 0 && p.has_offset == 0 && p.kv_len < p.rows {
        return Err(invalid(format!(
            "causal with {} query rows and a cache of {} rows: the prompt is the end of its cache, which cannot be shorter",
            p.rows, p.kv_len
        )));
    }
    let (nb, rows, kvl) = (p.batch as u64, p.rows as u64, p.kv_len as u64);
    let max_rows = match lens {
        Some(l) => l.iter().map(|&(lq, _)| lq).max().unwrap_or(0),
        None => p.rows,
    };
    let mut flags = 0;
    if p.causal != 0 {
        flags |= PREFILL_CAUSAL;
    }
    if o.mask {
        flags |= PREFILL_MASK;
    }
    if lens.is_some() {
        flags |= PREFILL_VARLEN;
    }
    if o.lse {
        flags |= PREFILL_LSE;
    }
    if o.sinks {
        flags |= PREFILL_SINKS;
    }
    if p.has_offset == 1 {
        flags |= PREFILL_OFFSET;
    }
    if right {
        flags |= PREFILL_WINDOW_RIGHT;
    }
    if p.alibi_slopes != 0 {
        flags |= PREFILL_ALIBI_SLOPES;
    }
    let blk_rows = rows.div_ceil(bq as u64);
    let blk_steps = kvl.div_ceil(CACHE_ROWS_PER_STEP as u64);
    let i = |x: u64| x as i64;
    let gpu = FlashAttnPrefillParamsGpu {
        q_batch_stride: i(p.q_strides[0]),
        q_row_stride: i(p.q_strides[1]),
        q_head_stride: i(p.q_strides[2]),
        k_batch_stride: i(p.k_strides[0]),
        k_row_stride: i(p.k_strides[1]),
        k_head_stride: i(p.k_strides[2]),
        v_batch_stride: i(p.v_strides[0]),
        v_row_stride: i(p.v_strides[1]),
        v_head_stride: i(p.v_strides[2]),
        o_batch_stride: i(p.out_strides[0]),
        o_row_stride: i(p.out_strides[1]),
        o_head_stride: i(p.out_strides[2]),
        mask_batch_stride: if o.mask { i(p.mask_strides[0]) } else { 0 },
        mask_row_stride: if o.mask { i(p.mask_strides[1]) } else { 0 },
        lse_batch_stride: if o.lse { i(p.lse_strides[0]) } else { 0 },
        lse_head_stride: if o.lse { i(p.lse_strides[1]) } else { 0 },
        blk_batch_stride: if o.mask && p.mask_strides[0] != 0 { i(blk_rows * blk_steps) } else { 0 },
        batch: p.batch as i32,
        rows: p.rows as i32,
        kv_len: p.kv_len as i32,
        n_heads: p.n_heads as i32,
        n_kv_heads: p.n_kv_heads as i32,
        head_dim: p.head_dim as i32,
        max_rows: max_rows as i32,
        window: p.window as i32,
        flags,
        q_dtype: o.q_dtype as i32,
        o_dtype: o.out_dtype as i32,
        blk_rows: blk_rows as i32,
        blk_steps: blk_steps as i32,
        blk_bq: bq as i32,
        scale: p.scale,
        offset: if p.has_offset == 1 { p.offset } else { 0 },
        head_dim_v: head_dim_v as i32,
        kv_dtype: o.kv_dtype as i32,
        softcap: p.softcap,
        max_bias: p.max_bias,
        window_right: if right { p.window_right as i32 } else { 0 },
        alibi_batch_stride: if p.alibi_slopes == 2 { p.n_heads as i32 } else { 0 },
    };
    let extents = gpu.extents().ok_or_else(|| invalid(format!("a field does not fit the params block: {p:?}")))?;
    let grid = GridSize::new((max_rows as u64).div_ceil(bq as u64), p.n_heads as u64, nb);
    Ok(ValidatedPrefill { gpu, kernel, grid, empty: nb == 0 || max_rows == 0, operands: *o, extents })
}

/// Check the buffers of a prefill [`validate_shapes`] accepted: which are given, their
/// dtypes and sizes, and that no output overlaps an input or the other output.
pub fn validate_buffers(b: &FlashAttnPrefillBuffers<'_>, v: &ValidatedPrefill) -> Result<()> {
    let (o, e) = (&v.operands, &v.extents);
    if b.mask.is_some() != o.mask || b.blk.is_some() != o.mask {
        return Err(invalid(if o.mask {
            "this prefill has an explicit mask: give the mask and its tile table (blk)".into()
        } else {
            "this prefill has no explicit mask: give neither a mask nor a table".into()
        }));
    }
    if b.sinks.is_some() != o.sinks {
        return Err(invalid(if o.sinks {
            "this prefill has attention sinks: give their buffer".into()
        } else {
            "this prefill has no attention sinks".into()
        }));
    }
    if b.alibi_slopes.is_some() != o.alibi_slopes {
        return Err(invalid(if o.alibi_slopes {
            "this prefill has ALiBi slopes: give their buffer".into()
        } else {
            "this prefill has no ALiBi slopes (params.alibi_slopes is 0)".into()
        }));
    }
    if b.lse.is_some() != o.lse {
        return Err(invalid(if o.lse {
            "this prefill returns lse: give its buffer".into()
        } else {
            "this prefill returns no lse".into()
        }));
    }
    let varlen = v.gpu.flags & PREFILL_VARLEN != 0;
    if b.cu_seqlens_q.is_some() != varlen || b.cu_seqlens_k.is_some() != varlen {
        return Err(invalid(if varlen {
            "this prefill is variable length: give cu_seqlens_q and cu_seqlens_k".into()
        } else {
            "cu_seqlens_q and cu_seqlens_k go together with a variable-length prefill; this one is fixed length".into()
        }));
    }
    need("q", b.q, o.q_dtype, e.q)?;
    need("k", b.k, o.kv_dtype, e.k)?;
    need("v", b.v, o.kv_dtype, e.v)?;
    need("out", b.out, o.out_dtype, e.out)?;
    if let Some(lse) = b.lse {
        need("lse", lse, DType::F32, e.lse)?;
    }
    if let Some(sinks) = b.sinks {
        need("sinks", sinks, DType::F32, e.sinks)?;
    }
    if let Some(slopes) = b.alibi_slopes {
        need("alibi_slopes", slopes, DType::F32, e.alibi_slopes)?;
    }
    if let Some(mask) = b.mask {
        need("mask", mask, DType::F16, e.mask)?;
    }
    if let Some(blk) = b.blk {
        need("blk", blk, DType::U8, e.blk)?;
    }
    for (name, cu) in [("cu_seqlens_q", b.cu_seqlens_q), ("cu_seqlens_k", b.cu_seqlens_k)] {
        if let Some(cu) = cu {
            need(name, cu, DType::I32, v.gpu.batch as u64 + 1)?;
        }
    }
    let inputs = [
        ("q", Some(b.q)),
        ("k", Some(b.k)),
        ("v", Some(b.v)),
        ("mask", b.mask),
        ("blk", b.blk),
        ("cu_seqlens_q", b.cu_seqlens_q),
        ("cu_seqlens_k", b.cu_seqlens_k),
        ("sinks", b.sinks),
        ("alibi_slopes", b.alibi_slopes),
    ];
    for (name, buf) in inputs {
        if let Some(buf) = buf {
            if b.out.overlaps(buf) {
                return Err(invalid(format!("out overlaps {name}")));
            }
            if b.lse.is_some_and(|l| l.overlaps(buf)) {
                return Err(invalid(format!("lse overlaps {name}")));
            }
        }
    }
    if b.lse.is_some_and(|l| l.overlaps(b.out)) {
        return Err(invalid("lse overlaps out".into()));
    }
    if let Some(ws) = b.workspace {
        let others = inputs.into_iter().chain([("out", Some(b.out)), ("lse", b.lse)]);
        if let Some((name, _)) = others.filter_map(|(n, x)| x.map(|x| (n, x))).find(|(_, x)| ws.overlaps(x)) {
            return Err(invalid(format!("the workspace overlaps {name}")));
        }
    }
    Ok(())
}

/// Check `p` and the buffers against each other (SPEC 6-9) and build the params block.
/// Reads the `cu_seqlens` of a variable-length batch (a copy to the host for device memory).
pub fn validate(b: &FlashAttnPrefillBuffers<'_>, p: &FlashAttnPrefillParams) -> Result<ValidatedPrefill> {
    let lens = match (b.cu_seqlens_q, b.cu_seqlens_k) {
        (None, None) => None,
        (Some(q), Some(k)) => Some(read_sequence_lengths(p, q, k)?),
        _ => return Err(invalid("cu_seqlens_q and cu_seqlens_k go together: give both or neither".into())),
    };
    if b.mask.is_some() != b.blk.is_some() {
        return Err(invalid("an explicit mask needs its tile table (blk), and a table its mask".into()));
    }
    let operands = PrefillOperands {
        q_dtype: b.q.dtype(),
        kv_dtype: b.k.dtype(),
        out_dtype: b.out.dtype(),
        mask: b.mask.is_some(),
        lse: b.lse.is_some(),
        sinks: b.sinks.is_some(),
        alibi_slopes: b.alibi_slopes.is_some(),
    };
    if b.v.dtype() != b.k.dtype() {
        return Err(MlxError::UnsupportedDtype(format!(
            "flash_attn_prefill: k is {} and v is {}: they must have one dtype",
            b.k.dtype(),
            b.v.dtype()
        )));
    }
    let v = validate_shapes(p, &operands, lens.as_deref())?;
    validate_buffers(b, &v)?;
    Ok(v)
}

/// Encode one prefill (SPEC 6-9): validates, then records the dispatch (none when there is
/// no query row). Binds the params block at 0, Q at 1, K 2, V 3, the mask 4, its table 5,
/// O 6, lse 7, `cu_seqlens_q` 8, `cu_seqlens_k` 9, the sinks 10, the ALiBi slopes 12; a
/// buffer that is not given is bound as Q, which the kernel then never reads. The workspace
/// (11) is bound only when given.
pub fn dispatch_flash_attn_prefill(
    encoder: &mut CommandEncoder,
    registry: &mut KernelRegistry,
    device: &MlxDevice,
    b: &FlashAttnPrefillBuffers<'_>,
    p: &FlashAttnPrefillParams,
) -> Result<()> {
    let v = validate(b, p)?;
    if b.workspace.is_some() {
        check_workspace(b, workspace_bytes(device, &v, &encoder.options()))?;
    }
    encode_validated(encoder, registry, device, b, &v)
}

/// Record the dispatch of a prefill [`validate`] accepted with these buffers.
pub fn encode_validated<'a>(
    encoder: &mut CommandEncoder,
    registry: &mut KernelRegistry,
    device: &MlxDevice,
    b: &FlashAttnPrefillBuffers<'a>,
    v: &ValidatedPrefill,
) -> Result<()> {
    encode_validated_paged(encoder, registry, device, b, v, None, None)
}

/// The paged K/V of a dispatch (SPEC 11, [`super::flash_attn_prefill_paged`]): the caches'
/// block, the I32 block table and the I32 cache lengths, bound at `PAGED`, `BLOCK_TABLE` and
/// `SEQUSED_K` (`k` and `v` of the buffers are then the caches).
#[derive(Debug, Clone, Copy)]
pub struct PagedBuffers<'a> {
    pub params: &'a PagedKvParamsGpu,
    pub block_table: &'a MlxBuffer,
    pub seqused_k: &'a MlxBuffer,
}

/// [`encode_validated`] of a prefill that may be paged (`pages` given exactly when its block
/// says `PREFILL_PAGED`) and may have FP8 K/V's descale factors (`descale`, F32 `[2][n_kv_heads]`,
/// given exactly when it says `PREFILL_DESCALE`; bound at `DESCALE`).
pub fn encode_validated_paged<'a>(
    encoder: &mut CommandEncoder,
    registry: &mut KernelRegistry,
    device: &MlxDevice,
    b: &FlashAttnPrefillBuffers<'a>,
    v: &ValidatedPrefill,
    pages: Option<PagedBuffers<'a>>,
    descale: Option<&'a MlxBuffer>,
) -> Result<()> {
    if (v.gpu.flags & PREFILL_PAGED != 0) != pages.is_some() {
        return Err(invalid(
            "a paged prefill needs its block table and lengths, and only a paged one takes them".into(),
        ));
    }
    if (v.gpu.flags & PREFILL_DESCALE != 0) != descale.is_some() {
        return Err(invalid("a prefill with descale factors needs their buffer, and only such a one takes it".into()));
    }
    if v.empty {
        return Ok(());
    }
    let kernel = kernel_on(device, v.kernel, pages.is_some());
    let pipeline = match registry.get_pipeline(kernel, device) {
        Err(MlxError::KernelNotFound(_)) if v.operands.kv_dtype.is_quantised_kv() => {
            return Err(MlxError::UnsupportedDtype(format!(
                "flash_attn_prefill: quantised k and v ({}) have no kernel at these head dims in this build; pass \
                 F16 or BF16 k and v",
                v.operands.kv_dtype
            )))
        }
        Err(MlxError::KernelNotFound(_)) if v.operands.kv_dtype == DType::F32 => {
            return Err(MlxError::UnsupportedDtype(
                "flash_attn_prefill: float32 k and v run on the CPU only; on CUDA and Metal convert them to float16 \
                 first (the Python API does, on the device)"
                    .into(),
            ))
        }
        r => r?,
    };
    if pipeline.max_total_threads_per_threadgroup() < 32 * SIMDGROUPS {
        return Err(invalid(format!(
            "{}: pipeline allows {} threads per threadgroup, needs {}",
            kernel,
            pipeline.max_total_threads_per_threadgroup(),
            32 * SIMDGROUPS
        )));
    }
    let quantised = v.operands.kv_dtype.is_quantised_kv();
    let smem =
        if quantised { quant_threadgroup_memory_bytes } else { threadgroup_memory_bytes }(v.gpu.head_dim as u32)?;
    let q = b.q;
    let or_q = |x: Option<&'a MlxBuffer>| KernelArg::Buffer(x.unwrap_or(q));
    let workspace = b.workspace.map(|w| (slot::WORKSPACE, KernelArg::Buffer(w)));
    let paged = pages.into_iter().flat_map(|pg| {
        [
            (slot::PAGED, KernelArg::Bytes(as_bytes(pg.params))),
            (slot::BLOCK_TABLE, KernelArg::Buffer(pg.block_table)),
            (slot::SEQUSED_K, KernelArg::Buffer(pg.seqused_k)),
        ]
    });
    encoder.encode_threadgroups_with_args_and_shared(
        pipeline,
        &[
            (slot::PARAMS, KernelArg::Bytes(as_bytes(&v.gpu))),
            (slot::Q, KernelArg::Buffer(b.q)),
            (slot::K, KernelArg::Buffer(b.k)),
            (slot::V, KernelArg::Buffer(b.v)),
            (slot::MASK, or_q(b.mask)),
            (slot::BLK, or_q(b.blk)),
            (slot::OUT, KernelArg::Buffer(b.out)),
            (slot::LSE, or_q(b.lse)),
            (slot::CU_SEQLENS_Q, or_q(b.cu_seqlens_q)),
            (slot::CU_SEQLENS_K, or_q(b.cu_seqlens_k)),
            (slot::SINKS, or_q(b.sinks)),
            (slot::ALIBI_SLOPES, or_q(b.alibi_slopes)),
        ]
        .into_iter()
        .chain(workspace)
        .chain(paged)
        // A quantised kernel's descale factors, or Q bound unread (Metal binds every argument
        // an entry point declares).
        .chain(quantised.then(|| (slot::DESCALE, or_q(descale))))
        .collect::<Vec<_>>(),
        &[(0, smem)],
        v.grid,
        GridSize::new(32, SIMDGROUPS, 1),
    )
}

/// The params block of the classification of `p`'s explicit mask (tiles of
/// `mask_tile_rows(head_dim) x 64`).
pub fn mask_blk_params(p: &FlashAttnPrefillParams) -> Result<FlashAttnPrefillMaskBlkParamsGpu> {
    let bq = mask_tile_rows(p.head_dim)?;
    let masks = if p.mask_strides[0] == 0 { p.batch.min(1) } else { p.batch };
    Ok(FlashAttnPrefillMaskBlkParamsGpu {
        mask_batch_stride: p.mask_strides[0] as i64,
        mask_row_stride: p.mask_strides[1] as i64,
        batch: masks as i32,
        rows: p.rows as i32,
        kv_len: p.kv_len as i32,
        bq: bq as i32,
        bk: CACHE_ROWS_PER_STEP as i32,
        steps: p.kv_len.div_ceil(CACHE_ROWS_PER_STEP) as i32,
    })
}

/// Encode the classification of `mask` (F16 `[batch or 1, rows, kv_len]`, `p.mask_strides`)
/// into `blk`, the table [`dispatch_flash_attn_prefill`] reads: per tile, 0 when every value
/// is -inf (or <= -65504; columns at or past `kv_len` count as such), 2 when every value is
/// +0 or -0, 1 otherwise (SPEC 1). One threadgroup of 32 threads per tile.
pub fn dispatch_flash_attn_prefill_mask_blk(
    encoder: &mut CommandEncoder,
    registry: &mut KernelRegistry,
    device: &MlxDevice,
    mask: &MlxBuffer,
    blk: &MlxBuffer,
    p: &FlashAttnPrefillParams,
) -> Result<()> {
    let g = mask_blk_params(p)?;
    if p.batch > i32::MAX as u32 || p.rows > i32::MAX as u32 || p.kv_len > i32::MAX as u32 {
        return Err(invalid(format!("a dimension exceeds i32: {p:?}")));
    }
    if p.mask_strides.iter().any(|&s| s > i64::MAX as u64) {
        return Err(invalid(format!("a mask stride exceeds i64: {:?}", p.mask_strides)));
    }
    let (masks, rows, kvl) = (g.batch as u64, p.rows as u64, p.kv_len as u64);
    need("mask", mask, DType::F16, span([masks, rows, 1], [p.mask_strides[0], p.mask_strides[1], 0], kvl))?;
    let table = g.table_bytes();
    if blk.dtype() != DType::U8 || (blk.data_byte_len() as u64) < table {
        return Err(invalid(format!(
            "blk must be U8 with at least {table} bytes, got {} {} bytes",
            blk.dtype(),
            blk.data_byte_len()
        )));
    }
    if blk.overlaps(mask) {
        return Err(invalid("blk overlaps the mask".into()));
    }
    if table == 0 {
        return Ok(());
    }
    let pipeline = registry.get_pipeline(K_PREFILL_MASK_BLK, device)?;
    encoder.encode_threadgroups_with_args_and_shared(
        pipeline,
        &[
            (classifier_slot::PARAMS, KernelArg::Bytes(as_bytes(&g))),
            (classifier_slot::MASK, KernelArg::Buffer(mask)),
            (classifier_slot::BLK, KernelArg::Buffer(blk)),
        ],
        &[],
        GridSize::new(g.steps as u64, g.table_rows() as u64, masks),
        GridSize::new(32, 1, 1),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_params_block_has_no_padding() {
        assert_eq!(std::mem::size_of::<FlashAttnPrefillParamsGpu>(), 17 * 8 + 22 * 4);
        assert_eq!(std::mem::size_of::<FlashAttnPrefillMaskBlkParamsGpu>(), 2 * 8 + 6 * 4);
    }

    #[test]
    fn quantised_kernels_take_more_threadgroup_memory_only_where_a_k_sub_tile_needs_it() {
        // Up to 256 (32 query rows) 16 rows of K fit the scores' and probabilities' memory;
        // at 512 and 576 (16 rows) 8 rows reach past it; all within Metal's 32 KiB.
        for (d, _, _) in HEAD_DIMS {
            let (plain, quant) = (threadgroup_memory_bytes(d.0).unwrap(), quant_threadgroup_memory_bytes(d.0).unwrap());
            assert_eq!(quant == plain, d.0 <= 256, "head dim {}", d.0);
            assert!(quant <= 32 * 1024);
        }
        assert_eq!(quant_threadgroup_memory_bytes(512).unwrap(), 16 * 512 * 2 + 8 * 512 * 2);
        assert_eq!(quant_threadgroup_memory_bytes(576).unwrap(), 16 * 576 * 2 + 8 * 576 * 2);
    }

    #[test]
    fn spans_count_every_axis() {
        assert_eq!(span([2, 3, 4], [1000, 100, 10], 8), 1000 + 200 + 30 + 8);
        assert_eq!(span([0, 3, 4], [1000, 100, 10], 8), 0);
        assert_eq!(span([1, 1, 1], [u64::MAX, u64::MAX, 0], 8), 8);
        assert_eq!(span([2, 1, 1], [u64::MAX, 0, 0], 8), u64::MAX, "saturates");
    }

    #[test]
    fn a_head_dim_without_a_kernel_in_this_build_is_refused_with_the_dims_it_takes() {
        assert_eq!(kernel_name(256, 256, DType::F16).unwrap(), K_PREFILL_D256);
        assert_eq!(kernel_name(512, 512, DType::F16).unwrap(), K_PREFILL_D512);
        for (dk, dv) in [(100, 100), (256, 512)] {
            let e = kernel_name(dk, dv, DType::F16).unwrap_err().to_string();
            assert!(e.contains(&format!("unsupported head_dim {dk}")) && e.contains("256"), "{e}");
        }
        for name in HEAD_DIMS.iter().flat_map(|(_, a, b)| [*a, *b]) {
            let ((dk, dv), f16, _) = HEAD_DIMS.iter().find(|(_, a, b)| *a == name || *b == name).unwrap();
            let dtype = if *f16 == name { DType::F16 } else { DType::BF16 };
            assert_eq!(kernel_name(*dk, *dv, dtype).is_ok(), REGISTERED_KERNELS.contains(&name), "{name}");
        }
        assert_eq!(kernel_name(256, 256, DType::F32).unwrap(), "flash_attn_prefill_d256_f32");
        assert!(matches!(kernel_name(256, 256, DType::I32), Err(MlxError::UnsupportedDtype(_))));
    }

    #[test]
    fn a_build_without_some_kernels_refuses_them_and_names_what_it_has() {
        // Without the BF16 kernel at 128: BF16 K/V there is a dtype error that says what to
        // do; F16 still runs, and 128 is still among the dims the build takes.
        let some: Vec<&str> =
            REGISTERED_KERNELS.iter().copied().filter(|n| *n != "flash_attn_prefill_d128_bf16").collect();
        assert_eq!(kernel_name_among(&some, 128, 128, DType::F16).unwrap(), "flash_attn_prefill_d128");
        let e = kernel_name_among(&some, 128, 128, DType::BF16).unwrap_err();
        assert!(matches!(&e, MlxError::UnsupportedDtype(m) if m.contains("convert k and v to F16")), "{e}");
        let e = kernel_name_among(&some, 100, 100, DType::F16).unwrap_err().to_string();
        assert!(e.contains("128, 160"), "{e}");
        // Without either kernel at 128: an unsupported head dim, 128 gone from the list.
        let fewer: Vec<&str> = some.iter().copied().filter(|n| *n != "flash_attn_prefill_d128").collect();
        for dtype in [DType::F16, DType::BF16] {
            let e = kernel_name_among(&fewer, 128, 128, dtype).unwrap_err();
            assert!(matches!(&e, MlxError::InvalidArgument(_)), "{e}");
            let e = e.to_string();
            assert!(e.contains("unsupported head_dim 128") && e.contains("112, 160"), "{e}");
        }
        // Without the F16 kernel alone: BF16 runs, F16 is an unsupported head dim.
        let no_f16: Vec<&str> = REGISTERED_KERNELS.iter().copied().filter(|n| *n != "flash_attn_prefill_d64").collect();
        assert_eq!(kernel_name_among(&no_f16, 64, 64, DType::BF16).unwrap(), "flash_attn_prefill_d64_bf16");
        let e = kernel_name_among(&no_f16, 64, 64, DType::F16).unwrap_err().to_string();
        assert!(e.contains("unsupported head_dim 64") && e.contains("48, 64, 80"), "{e}");
    }

    #[test]
    fn every_kernel_is_registered_against_the_cuda_file_that_defines_it() {
        // The entry macros name the head dims and the K/V element type: `(name, DK, Elem)`
        // for the tensor-core forms, `(name, DK, DV, Elem)` for the portable ones.
        for ((dk, dv), f16, bf16) in HEAD_DIMS {
            for (name, elem) in [(f16, "ElemF16"), (bf16, "ElemBF16")] {
                let text = prefill_kernel_source(name).cuda.expect("every prefill kernel has a CUDA source").text;
                let tensor = format!(", {dk}, {elem})");
                let portable = format!(", {dk}, {dv}, {elem})");
                assert!(text.contains(&tensor) || text.contains(&portable), "{name}: its file lacks {tensor}");
            }
        }
    }

    #[test]
    fn the_mask_table_has_one_row_per_tile_of_queries() {
        let p = FlashAttnPrefillParams {
            q_strides: [0; 3],
            k_strides: [0; 3],
            v_strides: [0; 3],
            out_strides: [0; 3],
            mask_strides: [0, 130],
            lse_strides: [0; 2],
            batch: 3,
            rows: 33,
            kv_len: 129,
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 256,
            causal: 0,
            window: 0,
            scale: 1.0,
            offset: 0,
            has_offset: 0,
            ..Default::default()
        };
        assert_eq!(mask_table_bytes(&p).unwrap(), 2 * 3);
        assert_eq!(
            mask_table_bytes(&FlashAttnPrefillParams { mask_strides: [33 * 130, 130], ..p }).unwrap(),
            3 * 2 * 3
        );
        assert_eq!(mask_table_bytes(&FlashAttnPrefillParams { head_dim: 512, ..p }).unwrap(), 3 * 3);
        assert_eq!(mask_table_bytes(&FlashAttnPrefillParams { head_dim: 128, ..p }).unwrap(), 2 * 3);
        assert!(mask_table_bytes(&FlashAttnPrefillParams { head_dim: 100, ..p }).is_err());
    }
}
