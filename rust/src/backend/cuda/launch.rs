//! What the CUDA backend knows of each kernel, and one launch ready to go.
//!
//! Each op's host file (`flash_attn_prefill_tensor.rs`, `flash_attn_prefill_blk.rs`) lists
//! its kernels in a `KERNELS` table of [`CudaKernel`]s: how a dispatch of that name becomes
//! a [`Launch`] (grid, block, shared memory, parameter bytes). A kernel that no table names
//! is launched as its op encoded it ([`launch_as_encoded`]): its arguments in index order,
//! constant blocks by value and buffers as device pointers.

use std::ffi::c_void;
use std::sync::Arc;

use super::kv_split::KvSplit;
use super::memory::CudaMemory;
use super::CudaContext;
use crate::error::{MlxError, Result};
use crate::interface::{BoundArg, BufferBinding, Dispatch, RunOptions};

/// How the CUDA backend runs one named kernel.
pub struct CudaKernel {
    pub name: &'static str,
    /// The entry point of the source it launches (two ops' kernels may share one).
    pub entry: &'static str,
    /// Other entry points of the same source this kernel may launch instead, on Hopper
    /// builds (the CTA-pair forms): `entry` and each one's suffix.
    pub hopper_variants: &'static [Variant],
    /// Whether it has a Hopper form (wgmma) that runs where the module is built for sm_90a;
    /// without one it runs its portable form there too.
    pub hopper_form: bool,
    /// Entry points it may launch instead where it runs its portable form (the form with
    /// SPEC 10's score transforms).
    pub portable_variants: &'static [Variant],
    /// Whether its source has paged K/V entry points (SPEC 11, [`CudaKernel::paged_variants`]).
    /// They are a module of their own, compiled for the first paged launch
    /// (`nvrtc::module_options`), not in the module the variants above come from.
    pub paged: bool,
    /// Whether its paged module has CTA-pair forms in the Hopper form (`<entry>_pair_heads_paged`,
    /// `_pair_queries_paged`: head dims 64, 128 and 256, `attention_geometry::paged_pair_form`).
    pub paged_pairs: bool,
    /// Whether its quant module has CTA-pair forms in the Hopper form (`<entry>_pair_heads_kvq`,
    /// `_pair_queries_kvq`: FP8 K/V at head dims 64, 128 and 256,
    /// `attention_geometry::quant_pair_form`).
    pub quant_pairs: bool,
    /// Whether it is a quantised K/V kernel (SPEC 11, the op's `_kvq` kernels: FP8 E4M3 /
    /// E5M2 with descale factors, Q8_0): every launch of it runs its source's quant module
    /// (`-DMLXN_QUANT_ENTRIES=1`, [`ModuleKind`]), compiled for its first pipeline, never the
    /// module the variants above come from.
    pub quant: bool,
    /// Dynamic shared memory one CTA needs beyond the default 48 KiB; `hopper`: it runs its
    /// Hopper form.
    pub shared_bytes: fn(hopper: bool) -> Option<u32>,
    /// The launch of a dispatch; with `variants` false, the plain entry point only.
    pub prepare: fn(&PrepareContext<'_>, &Dispatch, bool) -> Result<Launch>,
    /// The entry point of the same source that a [`Launch::merge`] launches (the
    /// attention's split-KV merge), if the kernel has one.
    pub merge_entry: Option<&'static str>,
    /// How a dispatch with this constant block (index 0) splits its walk over the cache
    /// (the attention's split-KV parts, whose workspace the op's plan reports and the caller
    /// brings to each run; `None`: it does not), on a device of `multiprocessors` running
    /// the kernel's Hopper form or not, its parts forced to `forced_splits` where given
    /// ([`super::kv_split::forced_parts`]).
    pub split: fn(hopper: bool, multiprocessors: u32, params: &[u8], forced_splits: Option<u32>) -> Option<KvSplit>,
}

/// Which entry points of a source a module holds (the defines it is compiled with,
/// `nvrtc::module_options`): the contiguous forms (every F16 / BF16 K/V call's), the paged
/// K/V forms (`-DMLXN_PAGED_ENTRIES=1`), the quantised K/V forms (`-DMLXN_QUANT_ENTRIES=1`),
/// or both (paged quantised K/V). Each is compiled on its first launch and cached under its
/// own key, so a call of one kind never waits for the others' compile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ModuleKind {
    pub paged: bool,
    pub quant: bool,
}

impl ModuleKind {
    /// The module every F16 / BF16 K/V call loads.
    pub const CONTIGUOUS: ModuleKind = ModuleKind { paged: false, quant: false };
    pub const PAGED: ModuleKind = ModuleKind { paged: true, quant: false };
    pub const QUANT: ModuleKind = ModuleKind { paged: false, quant: true };
    pub const PAGED_QUANT: ModuleKind = ModuleKind { paged: true, quant: true };

    /// The `-D` options that select its entry points (`shaders/flash_attn_prefill/params.cuh`).
    pub fn defines(self) -> Vec<&'static str> {
        let mut d = Vec::new();
        if self.paged {
            d.push("-DMLXN_PAGED_ENTRIES=1");
        }
        if self.quant {
            d.push("-DMLXN_QUANT_ENTRIES=1");
        }
        d
    }

    /// The variant whose entry point is a kernel's plain one in this module (`None`: the
    /// contiguous module's plain entry point itself).
    pub fn plain_variant(self) -> Option<Variant> {
        match (self.paged, self.quant) {
            (false, false) => None,
            (true, false) => Some(Variant::Paged),
            (false, true) => Some(Variant::Quant),
            (true, true) => Some(Variant::PagedQuant),
        }
    }

    /// For reports: `""`, `", paged"`, `", quant"`, `", paged, quant"`.
    pub fn label(self) -> &'static str {
        match (self.paged, self.quant) {
            (false, false) => "",
            (true, false) => ", paged",
            (false, true) => ", quant",
            (true, true) => ", paged, quant",
        }
    }
}

impl CudaKernel {
    /// The entry points of the module `module` it may launch in the form it runs (`hopper`):
    /// the contiguous module's variants, or the paged / quant modules' ([`Self::paged_variants`],
    /// [`Self::quant_variants`]).
    pub fn module_variants(&self, module: ModuleKind, hopper: bool) -> &'static [Variant] {
        match (module.paged, module.quant) {
            (false, false) if hopper => self.hopper_variants,
            (false, false) => self.portable_variants,
            (true, false) => self.paged_variants(hopper),
            (paged, true) => self.quant_variants(hopper, paged),
        }
    }

    /// The entry points of its quant module (`-DMLXN_QUANT_ENTRIES=1`, with `paged` also
    /// `-DMLXN_PAGED_ENTRIES=1`) in the form it runs (`hopper`: the Hopper form's one-CTA
    /// `_kvq` / `_paged_kvq`; else the portable form's with and without the score
    /// transforms); none where it is no quantised K/V kernel (paged ones only where it has a
    /// paged module).
    pub fn quant_variants(&self, hopper: bool, paged: bool) -> &'static [Variant] {
        if !self.quant || (paged && !self.paged) {
            return &[];
        }
        match (paged, hopper) {
            (false, true) if self.quant_pairs => &[Variant::Quant, Variant::PairHeadsQuant, Variant::PairQueriesQuant],
            (false, true) => &[Variant::Quant],
            (false, false) => &[Variant::Quant, Variant::QuantScoreTransforms],
            (true, true) => &[Variant::PagedQuant],
            (true, false) => &[Variant::PagedQuant, Variant::PagedQuantScoreTransforms],
        }
    }

    /// The entry points of its paged K/V module (`-DMLXN_PAGED_ENTRIES=1`) in the form it
    /// runs (`hopper`: the Hopper form's one-CTA `_paged`, with its CTA-pair forms
    /// `_pair_heads_paged` and `_pair_queries_paged` where it has them; else the portable
    /// form's `_paged` and `_xf_paged`); none where it has no such module.
    pub fn paged_variants(&self, hopper: bool) -> &'static [Variant] {
        match (self.paged && !self.quant, hopper) {
            (false, _) => &[],
            (true, true) if self.paged_pairs => &[Variant::Paged, Variant::PairHeadsPaged, Variant::PairQueriesPaged],
            (true, true) => &[Variant::Paged],
            (true, false) => &[Variant::Paged, Variant::PagedScoreTransforms],
        }
    }
}

/// An entry point a kernel may launch instead of its plain one, named `<entry><suffix>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    /// Hopper: a CTA pair over the two halves of one KV head's query heads.
    PairHeads,
    /// Hopper: a CTA pair over neighbouring query tiles.
    PairQueries,
    /// Hopper: [`Variant::PairHeads`] in the pipeline's shape without the explicit mask's
    /// tiles (head dim 128: tiles of 192 cache rows; `tiles_sm90.cuh`'s `WideTiles`).
    PairHeadsWide,
    /// Hopper: [`Variant::PairQueries`] in that shape.
    PairQueriesWide,
    /// Hopper: [`Variant::PairHeads`] on paged K/V (SPEC 11), from the paged module: its
    /// TMA boxes are found through the block table.
    PairHeadsPaged,
    /// Hopper: [`Variant::PairQueries`] on paged K/V, from the paged module.
    PairQueriesPaged,
    /// Hopper: [`Variant::PairHeads`] on FP8 K/V (SPEC 11), from the quant module: its
    /// producer widens each tile's bytes to F16 after the TMA copies them.
    PairHeadsQuant,
    /// Hopper: [`Variant::PairQueries`] on FP8 K/V, from the quant module.
    PairQueriesQuant,
    /// The portable form with SPEC 10's score transforms (softcap, ALiBi).
    ScoreTransforms,
    /// The one-CTA form on paged K/V (SPEC 11: the Hopper form's, or the portable form's
    /// without the score transforms), from the kernel's paged module.
    Paged,
    /// The portable form with the score transforms on paged K/V, from the paged module.
    PagedScoreTransforms,
    /// The one-CTA form on quantised K/V (SPEC 11; the Hopper form's, or the portable form's
    /// without the score transforms), from the kernel's quant module.
    Quant,
    /// The portable form with the score transforms on quantised K/V, from the quant module.
    QuantScoreTransforms,
    /// [`Variant::Quant`] on paged quantised K/V, from the module with both defines.
    PagedQuant,
    /// [`Variant::QuantScoreTransforms`] on paged quantised K/V.
    PagedQuantScoreTransforms,
}

impl Variant {
    /// What its entry point's name adds to the kernel's.
    pub fn suffix(self) -> &'static str {
        match self {
            Variant::PairHeads => "_pair_heads",
            Variant::PairQueries => "_pair_queries",
            Variant::PairHeadsWide => "_pair_heads_wide",
            Variant::PairQueriesWide => "_pair_queries_wide",
            Variant::PairHeadsPaged => "_pair_heads_paged",
            Variant::PairQueriesPaged => "_pair_queries_paged",
            Variant::PairHeadsQuant => "_pair_heads_kvq",
            Variant::PairQueriesQuant => "_pair_queries_kvq",
            Variant::ScoreTransforms => "_xf",
            Variant::Paged => "_paged",
            Variant::PagedScoreTransforms => "_xf_paged",
            Variant::Quant => "_kvq",
            Variant::QuantScoreTransforms => "_xf_kvq",
            Variant::PagedQuant => "_paged_kvq",
            Variant::PagedQuantScoreTransforms => "_xf_paged_kvq",
        }
    }

    /// Whether it is an entry point of a module on paged K/V ([`CudaKernel::paged_variants`],
    /// and the paged ones of [`CudaKernel::quant_variants`]).
    pub fn is_paged(self) -> bool {
        matches!(
            self,
            Variant::Paged
                | Variant::PagedScoreTransforms
                | Variant::PagedQuant
                | Variant::PagedQuantScoreTransforms
                | Variant::PairHeadsPaged
                | Variant::PairQueriesPaged
        )
    }

    /// A contiguous CTA-pair form's twin in the paged module (`None`: it has none, as the
    /// shape without the mask's tiles, or it is no pair form).
    pub fn paged_pair(self) -> Option<Variant> {
        match self {
            Variant::PairHeads => Some(Variant::PairHeadsPaged),
            Variant::PairQueries => Some(Variant::PairQueriesPaged),
            _ => None,
        }
    }

    /// A contiguous CTA-pair form's twin in the quant module (`None`: it has none).
    pub fn quant_pair(self) -> Option<Variant> {
        match self {
            Variant::PairHeads => Some(Variant::PairHeadsQuant),
            Variant::PairQueries => Some(Variant::PairQueriesQuant),
            _ => None,
        }
    }

    /// Whether it is an entry point of a quant module ([`CudaKernel::quant_variants`]).
    pub fn is_quant(self) -> bool {
        matches!(
            self,
            Variant::Quant
                | Variant::QuantScoreTransforms
                | Variant::PagedQuant
                | Variant::PagedQuantScoreTransforms
                | Variant::PairHeadsQuant
                | Variant::PairQueriesQuant
        )
    }

    /// The module whose entry point it is.
    pub fn module(self) -> ModuleKind {
        ModuleKind { paged: self.is_paged(), quant: self.is_quant() }
    }

    /// The variant of the module `module` a launch runs: the form with the score transforms
    /// (`transforms`, the portable form's) or without.
    pub fn of_module(module: ModuleKind, transforms: bool) -> Option<Variant> {
        match (module.paged, module.quant, transforms) {
            (false, false, false) => None,
            (false, false, true) => Some(Variant::ScoreTransforms),
            (true, false, false) => Some(Variant::Paged),
            (true, false, true) => Some(Variant::PagedScoreTransforms),
            (false, true, false) => Some(Variant::Quant),
            (false, true, true) => Some(Variant::QuantScoreTransforms),
            (true, true, false) => Some(Variant::PagedQuant),
            (true, true, true) => Some(Variant::PagedQuantScoreTransforms),
        }
    }

    /// Its entry point for a kernel whose plain one is `entry`.
    pub fn entry(self, entry: &str) -> String {
        format!("{entry}{}", self.suffix())
    }
}

/// The split of a kernel that never splits.
pub fn no_split(_: bool, _: u32, _: &[u8], _: Option<u32>) -> Option<KvSplit> {
    None
}

/// What [`CudaKernel::prepare`] may consult besides the dispatch.
pub struct PrepareContext<'a> {
    pub ctx: &'a Arc<CudaContext>,
    /// The kernel runs its Hopper (wgmma) form: the module was built for sm_90a and the
    /// kernel has one.
    pub hopper: bool,
    /// The dispatch's run options (its plan's): the CTA pairs and KV splits it allows.
    pub options: RunOptions,
    /// The module the kernel runs from (paged K/V, quantised K/V: [`ModuleKind`]), whose
    /// launch block is longer than the contiguous module's.
    pub module: ModuleKind,
}

/// One launch, ready: geometry and the bytes of each kernel parameter.
pub struct Launch {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_bytes: u32,
    /// Each parameter's value, 8-byte aligned storage.
    params: Vec<Vec<u64>>,
    /// The variant to launch instead of the plain entry point (one of the kernel's
    /// [`CudaKernel::hopper_variants`] in the Hopper form, [`CudaKernel::portable_variants`]
    /// in the portable one, [`CudaKernel::paged_variants`] on paged K/V; another is an error,
    /// never the plain entry point in its place).
    pub variant: Option<Variant>,
    /// A launch of the kernel's [`CudaKernel::merge_entry`] right after this one, on the same
    /// stream (it reads what this one wrote).
    pub merge: Option<Box<Launch>>,
}

impl Launch {
    pub fn new(grid: [u32; 3], block: [u32; 3], shared_bytes: u32) -> Self {
        Launch { grid, block, shared_bytes, params: Vec::new(), variant: None, merge: None }
    }

    /// One pointer per kernel parameter, valid while `self` lives.
    pub fn param_pointers(&mut self) -> Vec<*mut c_void> {
        self.params.iter_mut().map(|p| p.as_mut_ptr() as *mut c_void).collect()
    }

    /// The next parameter: a block of bytes passed by value.
    pub fn push_bytes(&mut self, bytes: &[u8]) {
        let mut v = vec![0u64; bytes.len().div_ceil(8).max(1)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut v)[..bytes.len()].copy_from_slice(bytes);
        self.params.push(v);
    }

    /// The next parameter: a device pointer.
    pub fn push_ptr(&mut self, p: u64) {
        self.params.push(vec![p]);
    }
}

/// Device address of a dispatch's buffer (for the kernels with a table, a role of
/// `crate::recorded`'s decoded types, its length checked there); it must be memory of `ctx`.
pub fn device_addr(ctx: &Arc<CudaContext>, b: &BufferBinding, name: &str) -> Result<u64> {
    let mem = b
        .memory
        .as_any()
        .downcast_ref::<CudaMemory>()
        .ok_or_else(|| MlxError::InvalidArgument(format!("{name}: a buffer is not CUDA device memory")))?;
    if !Arc::ptr_eq(mem.context(), ctx) {
        return Err(MlxError::InvalidArgument(format!("{name}: a buffer belongs to another CUDA device")));
    }
    Ok(mem.device_ptr() + b.byte_offset as u64)
}

/// The address of an optional buffer, 0 where absent (what the kernels test).
pub fn device_addr_or_null(ctx: &Arc<CudaContext>, b: Option<&BufferBinding>, name: &str) -> Result<u64> {
    b.map_or(Ok(0), |b| device_addr(ctx, b, name))
}

/// Whether (`MLX_NATIVE_CUDA_TRACE=1`, a development knob read once by `settings`) each
/// launch (kernel, entry variant, grid, block, shared memory) and each refused tensor map is
/// printed to stderr.
pub fn tracing() -> bool {
    crate::settings::get().cuda_trace
}

/// An internal error of a kernel's launch preparation: the op's contract was broken.
pub fn contract(name: &str, what: &str) -> MlxError {
    MlxError::Internal(format!("{name} (cuda): {what}"))
}

/// A kernel no table names, launched as its op encoded it.
pub fn launch_as_encoded(ctx: &Arc<CudaContext>, d: &Dispatch) -> Result<Launch> {
    let name = d.pipeline.name();
    let dim = |x: u64, what: &str| -> Result<u32> {
        u32::try_from(x).map_err(|_| MlxError::InvalidArgument(format!("{name}: {what} {x} is too large for CUDA")))
    };
    let mut l = Launch::new(
        [dim(d.grid.width, "grid")?, dim(d.grid.height, "grid")?, dim(d.grid.depth, "grid")?],
        [dim(d.threadgroup.width, "block")?, dim(d.threadgroup.height, "block")?, dim(d.threadgroup.depth, "block")?],
        dim(d.shared.iter().map(|(_, b)| *b).sum(), "shared memory")?,
    );
    let mut args: Vec<&(u64, BoundArg)> = d.args.iter().collect();
    args.sort_by_key(|(i, _)| *i);
    for (_, arg) in args {
        match arg {
            BoundArg::Bytes(b) => l.push_bytes(b),
            BoundArg::Buffer(b) => l.push_ptr(device_addr(ctx, b, name)?),
        }
    }
    Ok(l)
}
