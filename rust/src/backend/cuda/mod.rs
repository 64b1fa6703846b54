//! The CUDA backend: NVIDIA GPUs through the driver API, loaded at run time.
//!
//! - The driver (`libcuda.so.1`) and NVRTC are opened with `libloading` when a CUDA device
//!   is first asked for; a machine without them still builds, imports and runs the CPU
//!   backend, and `open("cuda")` is a clean `BackendUnavailable`. (A loader of our own
//!   rather than the `cudarc` crate: the backend needs about thirty entry points, and
//!   this way no CUDA version is chosen at build time.)
//! - One context (the device's primary context, shared with other CUDA users in the
//!   process such as PyTorch) and one non-blocking stream per device ordinal, shared by
//!   every `MlxDevice` opened on it. `execute` launches on that stream and synchronises.
//! - `shaders/*.cu` are compiled on first use with NVRTC for the device's own architecture
//!   (`sm_90a` on Hopper, where the attention runs on warpgroup MMA; `mma.sync` elsewhere),
//!   cached per process and on disk ([`nvrtc`]).
//! - How each named kernel is launched (its geometry and parameters) is decided by its
//!   op's host file here (`flash_attn_prefill_tensor.rs`, `flash_attn_prefill_blk.rs`,
//!   through their `KERNELS` tables, [`launch`]), so the op layer never asks which backend
//!   runs it.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CString};
use std::sync::{Arc, Mutex, OnceLock};

use crate::error::{MlxError, Result};
use crate::interface::{
    Backend, BackendKind, Choices, Dispatch, KernelSource, Memory, Pipeline, RunOptions, SourceFile,
};
use crate::options::CudaForm;

pub mod attention_geometry;
pub mod driver;
pub mod flash_attn_prefill;
pub mod flash_attn_prefill_blk;
pub mod flash_attn_prefill_tensor;
pub mod kv_split;
pub mod launch;
pub mod memory;
pub mod nvrtc;
pub mod sources;

use driver::{driver, CuContext, CuDevicePtr, CuFunction, CuModule, CuStream, Driver};
pub use launch::ModuleKind;
use launch::{CudaKernel, Launch, PrepareContext, Variant};
pub use memory::CudaMemory;

/// The launcher of the kernel `name`, from the op host files' tables; `None` for a kernel
/// launched as its op encoded it.
pub fn kernel(name: &str) -> Option<&'static CudaKernel> {
    kernels().find(|k| k.name == name)
}

/// Every kernel the CUDA backend knows, by op.
pub fn kernels() -> impl Iterator<Item = &'static CudaKernel> {
    flash_attn_prefill_tensor::KERNELS.iter().chain(flash_attn_prefill_blk::KERNELS).chain(flash_attn_prefill::KERNELS)
}

/// One device: its primary context, stream and loaded modules. Lives for the process.
pub struct CudaContext {
    pub ordinal: i32,
    ctx: CuContext,
    stream: CuStream,
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    pub multiprocessors: i32,
    /// Most shared memory one block may opt in to, bytes.
    pub max_shared_per_block: i32,
    /// Loaded modules by source (file name and text), architecture and entry set (one module
    /// holds all entry points of a file; others, its paged and quantised K/V entry points,
    /// are built for such a launch: [`ModuleKind`], [`nvrtc::module_options`]).
    modules: Mutex<HashMap<(u64, String, ModuleKind), Module>>,
}

#[derive(Clone, Copy)]
struct Module(CuModule);

// SAFETY: contexts, streams and modules are driver handles usable from any thread (the
// context is made current on each thread before use, see `bind`).
unsafe impl Send for CudaContext {}
unsafe impl Sync for CudaContext {}
unsafe impl Send for Module {}

static CONTEXTS: OnceLock<Mutex<HashMap<i32, Arc<CudaContext>>>> = OnceLock::new();

/// Number of CUDA devices, or why there are none to use.
pub fn device_count() -> Result<i32> {
    let d = driver()?;
    let mut n = 0;
    // SAFETY: valid out pointer.
    d.check(unsafe { (d.cuDeviceGetCount)(&mut n) }, "cuDeviceGetCount", MlxError::BackendUnavailable)?;
    Ok(n)
}

/// Whether a CUDA device can be opened and its kernels compiled here (driver, a device,
/// NVRTC). Probed once.
pub fn usable() -> bool {
    static USABLE: OnceLock<bool> = OnceLock::new();
    *USABLE.get_or_init(|| matches!(device_count(), Ok(n) if n > 0) && nvrtc::nvrtc().is_ok())
}

impl CudaContext {
    /// The context of device `ordinal`, made on first use.
    pub fn get(ordinal: i32) -> Result<Arc<CudaContext>> {
        let d = driver()?;
        let count = device_count()?;
        if count == 0 {
            return Err(MlxError::BackendUnavailable("the CUDA driver reports no device".into()));
        }
        if ordinal < 0 || ordinal >= count {
            return Err(MlxError::DeviceNotFound(format!(
                "cuda:{ordinal} does not exist ({count} CUDA device{} here)",
                if count == 1 { "" } else { "s" }
            )));
        }
        nvrtc::nvrtc()?;
        let map = CONTEXTS.get_or_init(|| Mutex::new(HashMap::new()));
        let mut map = map.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = map.get(&ordinal) {
            return Ok(c.clone());
        }
        let c = Arc::new(Self::create(d, ordinal)?);
        map.insert(ordinal, c.clone());
        Ok(c)
    }

    fn create(d: &Driver, ordinal: i32) -> Result<CudaContext> {
        let unavailable = MlxError::BackendUnavailable;
        let mut dev = 0;
        // SAFETY: valid out pointers and an ordinal below the device count, throughout.
        unsafe {
            d.check((d.cuDeviceGet)(&mut dev, ordinal), "cuDeviceGet", unavailable)?;
            let mut name = [0 as c_char; 256];
            d.check((d.cuDeviceGetName)(name.as_mut_ptr(), 256, dev), "cuDeviceGetName", unavailable)?;
            let name = std::ffi::CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned();
            let attr = |a: c_int| -> Result<i32> {
                let mut v = 0;
                d.check((d.cuDeviceGetAttribute)(&mut v, a, dev), "cuDeviceGetAttribute", unavailable)?;
                Ok(v)
            };
            let cc = (attr(driver::ATTR_COMPUTE_CAPABILITY_MAJOR)?, attr(driver::ATTR_COMPUTE_CAPABILITY_MINOR)?);
            let multiprocessors = attr(driver::ATTR_MULTIPROCESSOR_COUNT)?;
            let max_shared_per_block = attr(driver::ATTR_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
            let mut ctx: CuContext = std::ptr::null_mut();
            d.check((d.cuDevicePrimaryCtxRetain)(&mut ctx, dev), "cuDevicePrimaryCtxRetain", unavailable)?;
            d.check((d.cuCtxSetCurrent)(ctx), "cuCtxSetCurrent", unavailable)?;
            let mut stream: CuStream = std::ptr::null_mut();
            d.check((d.cuStreamCreate)(&mut stream, driver::STREAM_NON_BLOCKING), "cuStreamCreate", unavailable)?;
            Ok(CudaContext {
                ordinal,
                ctx,
                stream,
                name,
                compute_capability: cc,
                multiprocessors,
                max_shared_per_block,
                modules: Mutex::new(HashMap::new()),
            })
        }
    }

    /// Make this context current on the calling thread (every driver call needs it).
    pub fn bind(&self) -> Result<&'static Driver> {
        let d = driver()?;
        // SAFETY: a live context handle.
        d.check(unsafe { (d.cuCtxSetCurrent)(self.ctx) }, "cuCtxSetCurrent", MlxError::CommandBufferError)?;
        Ok(d)
    }

    /// The NVRTC target of this device: `sm_90a` on Hopper (its arch-specific features:
    /// the wgmma form of the attention), `sm_XY` elsewhere. `MLX_NATIVE_CUDA_ARCH`
    /// overrides it (`sm_90` on a Hopper GPU runs the portable mma.sync form).
    pub fn arch(&self) -> String {
        self.arch_for(None)
    }

    /// The NVRTC target for a plan's `cuda_form`: the portable form is built for the
    /// device's plain architecture (`sm_90` on Hopper, never the `a` target the wgmma form
    /// needs); `Auto` or none is [`arch`](Self::arch)'s rule.
    pub fn arch_for(&self, form: Option<CudaForm>) -> String {
        arch_of(self.compute_capability, form, crate::settings::get().cuda_arch.as_deref())
    }

    /// Wait for everything queued on this device's stream.
    pub fn synchronize(&self) -> Result<()> {
        let d = self.bind()?;
        // SAFETY: a live stream of the current context.
        d.check(
            unsafe { (d.cuStreamSynchronize)(self.stream) },
            "the device's work failed",
            MlxError::CommandBufferError,
        )
    }

    /// The module of `source` for `arch` (compiled or loaded once; `module`: which of its
    /// entry points), and its function `entry`.
    fn function(&self, src: SourceFile, entry: &str, arch: &str, module: ModuleKind) -> Result<CuFunction> {
        let text = sources::compiled_source(src)?;
        let (file, source) = (src.name, text.as_str());
        let d = self.bind()?;
        // By content: two ops may name the same file (their kernels share its entry points).
        let key = (
            {
                use std::hash::{Hash, Hasher};
                let mut h = std::collections::hash_map::DefaultHasher::new();
                (file, source).hash(&mut h);
                h.finish()
            },
            arch.to_string(),
            module,
        );
        let module = {
            let mut mods = self.modules.lock().unwrap_or_else(|e| e.into_inner());
            match mods.get(&key) {
                Some(m) => *m,
                None => {
                    let m = match load_module(d, &nvrtc::cubin(file, source, arch, module)?) {
                        Ok(m) => m,
                        Err(_) => {
                            // A damaged cache file: compile afresh once.
                            nvrtc::forget(file, source, arch, module);
                            load_module(d, &nvrtc::cubin(file, source, arch, module)?)?
                        }
                    };
                    mods.insert(key, Module(m));
                    Module(m)
                }
            }
        };
        let cname = CString::new(entry).map_err(|_| MlxError::KernelNotFound(format!("bad kernel name {entry:?}")))?;
        let mut f: CuFunction = std::ptr::null_mut();
        // SAFETY: a loaded module and a NUL-terminated name.
        let r = unsafe { (d.cuModuleGetFunction)(&mut f, module.0, cname.as_ptr()) };
        if r == driver::CUDA_ERROR_NOT_FOUND {
            return Err(MlxError::KernelNotFound(format!("{file} has no entry point {entry}")));
        }
        d.check(r, &format!("cuModuleGetFunction({entry})"), MlxError::CommandBufferError)?;
        Ok(f)
    }
}

/// The NVRTC target of a device of compute capability `cc` for the form `form`, with
/// `MLX_NATIVE_CUDA_ARCH`'s value `env` (an override of the default form, which an explicit
/// `Portable` beats).
pub fn arch_of(cc: (i32, i32), form: Option<CudaForm>, env: Option<&str>) -> String {
    let (maj, min) = cc;
    match (form, env) {
        (Some(CudaForm::Portable), _) => format!("sm_{maj}{min}"),
        (_, Some(a)) => a.to_string(),
        _ if cc == (9, 0) => "sm_90a".into(),
        _ => format!("sm_{maj}{min}"),
    }
}

/// Whether a kernel built for `arch` runs its Hopper (wgmma) form, where it has one.
pub fn is_hopper_arch(arch: &str) -> bool {
    arch == "sm_90a"
}

fn load_module(d: &Driver, cubin: &[u8]) -> Result<CuModule> {
    let mut m: CuModule = std::ptr::null_mut();
    // SAFETY: a complete cubin image in memory.
    let r = unsafe { (d.cuModuleLoadData)(&mut m, cubin.as_ptr() as *const c_void) };
    d.check(r, "cuModuleLoadData", |message| MlxError::ShaderCompilationError { name: "cubin".into(), message })?;
    Ok(m)
}

/// A compiled kernel: its function, its variants' functions, and how it is launched.
pub struct CudaPipeline {
    ctx: Arc<CudaContext>,
    function: CuFunction,
    /// The kernel's variants in the form it runs ([`CudaKernel::hopper_variants`] or
    /// [`CudaKernel::portable_variants`]), each with its function and entry point's name.
    variants: Vec<(Variant, CuFunction, String)>,
    /// The function of [`CudaKernel::merge_entry`], for launches that split.
    merge: Option<CuFunction>,
    kernel: Option<&'static CudaKernel>,
    /// Built with the Hopper (sm_90a, wgmma) forms of the kernels.
    hopper: bool,
    /// For the trace ([`launch::tracing`]): the entry point of `function`, of `merge`, and the
    /// architecture the module was built for.
    entry: String,
    merge_entry: Option<&'static str>,
    arch: String,
    /// The module of the source it was built from ([`ModuleKind`]; paged K/V: `function` is
    /// the `_paged` entry point, which a paged launch runs; a quantised K/V kernel's the
    /// `_kvq` or `_paged_kvq` one).
    module: ModuleKind,
    /// Its source, for the same kernel in another form (a plan's `cuda_form`) or on paged K/V.
    src: SourceFile,
}

// SAFETY: function handles of a module that lives as long as its context.
unsafe impl Send for CudaPipeline {}
unsafe impl Sync for CudaPipeline {}

/// A CUDA device.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    /// Kernels built in another form than the device's own (a plan's `cuda_form`) or from
    /// their paged K/V module, by name, architecture and module, built on first use.
    other_forms: Mutex<HashMap<(String, String, ModuleKind), Pipeline>>,
}

impl CudaBackend {
    /// Open device `ordinal`.
    pub fn open(ordinal: i32) -> Result<Self> {
        Ok(CudaBackend { ctx: CudaContext::get(ordinal)?, other_forms: Mutex::new(HashMap::new()) })
    }

    /// The pipeline of `p`'s kernel built for `arch` from the module `module` (`p` itself
    /// where it was).
    fn in_form(&self, pipeline: &Pipeline, p: &CudaPipeline, arch: String, module: ModuleKind) -> Result<Pipeline> {
        if p.arch == arch && p.module == module {
            return Ok(pipeline.clone());
        }
        let key = (pipeline.name().to_string(), arch, module);
        if let Some(other) = self.other_forms.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return Ok(other.clone());
        }
        let other = self.build(pipeline.name(), p.src, &key.1, module)?;
        self.other_forms.lock().unwrap_or_else(|e| e.into_inner()).insert(key, other.clone());
        Ok(other)
    }

    /// The device's context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

/// Parse `cuda` or `cuda:N` into an ordinal.
pub fn parse_name(name: &str) -> Result<i32> {
    match name.strip_prefix("cuda") {
        Some("") => Ok(0),
        Some(rest) => rest
            .strip_prefix(':')
            .and_then(|n| n.parse::<i32>().ok())
            .filter(|&n| n >= 0)
            .ok_or_else(|| MlxError::DeviceNotFound(format!("bad CUDA device name {name:?} (cuda or cuda:N)"))),
        None => Err(MlxError::DeviceNotFound(format!("{name:?} is not a CUDA device name"))),
    }
}

impl Backend for CudaBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }

    fn description(&self) -> String {
        let c = &self.ctx;
        format!(
            "cuda:{} {} (sm_{}{}, {} multiprocessors)",
            c.ordinal, c.name, c.compute_capability.0, c.compute_capability.1, c.multiprocessors
        )
    }

    fn alloc(&self, bytes: usize) -> Result<Arc<dyn Memory>> {
        if bytes == 0 {
            return Ok(Arc::new(CudaMemory { ctx: self.ctx.clone(), ptr: 0, len: 0, owned: false }));
        }
        let d = self.ctx.bind()?;
        let mut ptr: CuDevicePtr = 0;
        // SAFETY: valid out pointer.
        let r = unsafe { (d.cuMemAlloc_v2)(&mut ptr, bytes) };
        if r != driver::CUDA_SUCCESS {
            return Err(MlxError::BufferAllocationError { bytes: bytes as u64 });
        }
        let mem = CudaMemory { ctx: self.ctx.clone(), ptr, len: bytes, owned: true };
        // SAFETY: the whole new allocation.
        let r = unsafe { (d.cuMemsetD8Async)(ptr, 0, bytes, self.ctx.stream) };
        d.check(r, "zero-filling a new buffer", MlxError::CommandBufferError)?;
        self.ctx.synchronize()?;
        Ok(Arc::new(mem))
    }

    unsafe fn wrap_host(&self, _ptr: *mut u8, _bytes: usize) -> Result<Arc<dyn Memory>> {
        Err(MlxError::InvalidArgument(
            "the CUDA backend cannot use host memory in place: copy it into a device buffer".into(),
        ))
    }

    unsafe fn wrap_device(&self, addr: u64, bytes: usize) -> Result<Arc<dyn Memory>> {
        if bytes > 0 {
            memory::check_device_range(&self.ctx, addr, bytes)?;
        }
        Ok(Arc::new(CudaMemory { ctx: self.ctx.clone(), ptr: addr, len: bytes, owned: false }))
    }

    fn wait_stream(&self, stream: u64) -> Result<()> {
        let d = self.ctx.bind()?;
        // SAFETY: the caller names a stream of this process (CUDA Array Interface `stream`:
        // 1 and 2 are the driver's legacy and per-thread default streams).
        let r = unsafe { (d.cuStreamSynchronize)(stream as usize as CuStream) };
        d.check(r, &format!("synchronising stream {stream:#x}"), MlxError::InvalidArgument)
    }

    fn compile(&self, name: &str, source: &KernelSource) -> Result<Pipeline> {
        let src =
            source.cuda.ok_or_else(|| MlxError::KernelNotFound(format!("kernel {name} has no CUDA implementation")))?;
        // The contiguous module: a paged launch builds its own on first use (`launch_all`); a
        // quantised K/V kernel's every launch runs its quant module.
        self.build(name, src, &self.ctx.arch(), kernel_module(name, false))
    }

    fn choices(&self, kernel_name: &str, params: &[u8], options: &RunOptions) -> Choices {
        let arch = self.ctx.arch_for(options.cuda_form);
        let k = kernel(kernel_name);
        let hopper = is_hopper_arch(&arch) && k.is_some_and(|k| k.hopper_form);
        let sms = self.ctx.multiprocessors.max(0) as u32;
        let split = k.and_then(|k| (k.split)(hopper, sms, params, kv_split::forced_parts(options)));
        // Pairs run only in the Hopper form of a kernel that has them (and where TMA can
        // address K and V, which each run decides from its addresses); on paged K/V
        // (`flash_attn_prefill::is_paged`) where its paged module has them too and the host
        // launches them (`PAGED_PAIRS_LAUNCHED`); on quantised K/V where its quant module has
        // them and the launch is one they run (`quant_pairs_apply`: FP8, no explicit mask).
        let paged = flash_attn_prefill::is_paged(kernel_name, params);
        let paged_pairs = |k: &CudaKernel| k.paged_pairs && flash_attn_prefill::PAGED_PAIRS_LAUNCHED;
        let quant_pairs = |k: &CudaKernel| k.quant_pairs && flash_attn_prefill::quant_pairs_apply_to(params);
        let contiguous_pairs = |k: &CudaKernel| !k.hopper_variants.is_empty() && (!paged || paged_pairs(k));
        let pairs = if hopper && k.is_some_and(|k| contiguous_pairs(k) || quant_pairs(k)) {
            flash_attn_prefill::pairs_of(options).name()
        } else {
            "off"
        };
        Choices {
            workspace: split.map_or(0, |s| s.bytes()),
            report: vec![
                ("form", if hopper { "hopper" } else { "portable" }.into()),
                ("arch", arch),
                ("pairs", pairs.into()),
                ("splits", split.map_or(1, |s| s.parts).to_string()),
            ],
        }
    }

    /// FP8 (with descale factors) and Q8_0 K/V through each kernel's quant module
    /// (`CudaKernel::quant`; the loaders widen the bytes to F16 in shared memory).
    fn reads_quantised_kv(&self) -> bool {
        true
    }

    fn workspace_bytes(&self, kernel_name: &str, params: &[u8]) -> u64 {
        self.choices(kernel_name, params, &RunOptions::default()).workspace
    }

    fn execute(&self, dispatches: &[Dispatch]) -> Result<()> {
        self.launch_all(dispatches, self.ctx.stream)?;
        self.ctx.synchronize()
    }

    fn execute_on(&self, dispatches: &[Dispatch], stream: u64) -> Result<()> {
        // A stream of another library in this process: launching on it neither waits nor
        // allocates, so it can be captured in a CUDA graph.
        self.launch_all(dispatches, stream as usize as CuStream)
    }
}

impl CudaBackend {
    /// The pipeline of kernel `name` from `src`, built for `arch` from its module `module`
    /// (the paged K/V entry points, compiled with `-DMLXN_PAGED_ENTRIES=1` only for a paged
    /// launch, whose plain function is the `_paged` one; the quantised K/V ones,
    /// `-DMLXN_QUANT_ENTRIES=1`, `_kvq` / `_paged_kvq`).
    fn build(&self, name: &str, src: SourceFile, arch: &str, module: ModuleKind) -> Result<Pipeline> {
        let kernel = kernel(name);
        let arch = arch.to_string();
        // The Hopper form runs where the module is built for sm_90a and the kernel has one.
        let hopper = is_hopper_arch(&arch) && kernel.is_some_and(|k| k.hopper_form);
        let base = kernel.map_or(name, |k| k.entry);
        let variant_list = kernel.map_or(&[][..], |k| k.module_variants(module, hopper));
        if module != ModuleKind::CONTIGUOUS && variant_list.is_empty() {
            return Err(MlxError::Internal(format!("{name}: no entry points in its module {module:?}")));
        }
        let entry = module.plain_variant().map_or_else(|| base.to_string(), |v| v.entry(base));
        let function = self.ctx.function(src, &entry, &arch, module)?;
        let d = self.ctx.bind()?;
        let variants = variant_list
            .iter()
            .map(|&v| {
                let e = v.entry(base);
                Ok((v, self.ctx.function(src, &e, &arch, module)?, e))
            })
            .collect::<Result<Vec<_>>>()?;
        // (Each module has the merge: every attention source includes it.)
        let merge = match kernel.and_then(|k| k.merge_entry) {
            Some(entry) => Some(self.ctx.function(src, entry, &arch, module)?),
            None => None,
        };
        if let Some(smem) = kernel.and_then(|k| (k.shared_bytes)(hopper)) {
            if smem > self.ctx.max_shared_per_block as u32 {
                return Err(MlxError::KernelNotFound(format!(
                    "{name} needs {smem} bytes of shared memory per block; {} allows {}",
                    self.ctx.name, self.ctx.max_shared_per_block
                )));
            }
            for &f in std::iter::once(&function).chain(variants.iter().map(|(_, f, _)| f)) {
                // SAFETY: a valid function handle.
                let r = unsafe { (d.cuFuncSetAttribute)(f, driver::FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as c_int) };
                d.check(r, &format!("{name}: raising its shared memory limit"), MlxError::CommandBufferError)?;
            }
        }
        let mut max_threads = 0;
        // SAFETY: a valid function handle and out pointer.
        let r = unsafe { (d.cuFuncGetAttribute)(&mut max_threads, driver::FUNC_MAX_THREADS_PER_BLOCK, function) };
        d.check(r, "cuFuncGetAttribute", MlxError::CommandBufferError)?;
        Ok(Pipeline::new(
            name,
            max_threads.max(0) as u64,
            Arc::new(CudaPipeline {
                ctx: self.ctx.clone(),
                function,
                variants,
                merge,
                kernel,
                hopper,
                entry,
                merge_entry: kernel.and_then(|k| k.merge_entry),
                arch,
                module,
                src,
            }),
        ))
    }

    /// Launch the dispatches in order on `stream`, without waiting.
    fn launch_all(&self, dispatches: &[Dispatch], stream: CuStream) -> Result<()> {
        let d = self.ctx.bind()?;
        for dispatch in dispatches {
            let mut p = cuda_pipeline(&dispatch.pipeline)?;
            // The form the dispatch's options ask for (its plan's `cuda_form`), and on paged K/V
            // the kernel's paged module (a quantised K/V kernel's paged quant module), each
            // built once.
            let arch = dispatch.options.cuda_form.map_or_else(|| p.arch.clone(), |f| self.ctx.arch_for(Some(f)));
            let module = kernel_module(dispatch.pipeline.name(), flash_attn_prefill::dispatch_is_paged(dispatch));
            let other;
            if arch != p.arch || module != p.module {
                other = self.in_form(&dispatch.pipeline, p, arch, module)?;
                p = cuda_pipeline(&other)?;
            }
            if !Arc::ptr_eq(&p.ctx, &self.ctx) {
                return Err(MlxError::InvalidArgument(format!(
                    "pipeline {} was built for another CUDA device",
                    dispatch.pipeline.name()
                )));
            }
            let launch_with = |function: CuFunction, launch: &mut Launch| {
                let mut params = launch.param_pointers();
                // SAFETY: a function of this context, launch dimensions checked by `prepare`,
                // and one pointer per kernel parameter to storage that outlives the call.
                unsafe {
                    (d.cuLaunchKernel)(
                        function,
                        launch.grid[0],
                        launch.grid[1],
                        launch.grid[2],
                        launch.block[0],
                        launch.block[1],
                        launch.block[2],
                        launch.shared_bytes,
                        stream,
                        params.as_mut_ptr(),
                        std::ptr::null_mut(),
                    )
                }
            };
            // The variant the launch asks for, or the plain entry point; a variant the module
            // has not loaded is an error (the plain entry point would compute something else).
            let chosen = |launch: &Launch| match launch.variant {
                None => Ok((p.function, p.entry.as_str())),
                Some(v) => p.variants.iter().find(|x| x.0 == v).map(|x| (x.1, x.2.as_str())).ok_or_else(|| {
                    MlxError::Internal(format!(
                        "{}: the launch asks for the variant {v:?}, which the module has not loaded",
                        dispatch.pipeline.name()
                    ))
                }),
            };
            let pc = PrepareContext { ctx: &self.ctx, hopper: p.hopper, options: dispatch.options, module: p.module };
            let prepare = |variants: bool| match p.kernel {
                Some(k) => (k.prepare)(&pc, dispatch, variants && !p.variants.is_empty()),
                None => launch::launch_as_encoded(&self.ctx, dispatch),
            };
            let mut launch = prepare(true)?;
            let (mut function, mut entry) = chosen(&launch)?;
            // The trace names the entry point each launch runs and the module's architecture
            // (tests/test_kernel_coverage.py reads them: every entry point of the form a
            // device runs must be launched by some test).
            let trace = |launch: &Launch, entry: &str| {
                if launch::tracing() {
                    eprintln!(
                        "mlx_native cuda: {} variant {:?} grid {:?} block {:?} shared {} entry {entry} arch {}",
                        dispatch.pipeline.name(),
                        launch.variant,
                        launch.grid,
                        launch.block,
                        launch.shared_bytes,
                        p.arch
                    );
                }
            };
            if launch.merge.is_some() && p.merge.is_none() {
                return Err(MlxError::Internal(format!(
                    "{}: a split launch of a kernel without a merge entry",
                    dispatch.pipeline.name()
                )));
            }
            let mut r = launch_with(function, &mut launch);
            if r != driver::CUDA_SUCCESS && launch.variant.is_some() {
                // A GPU that cannot place the cluster (a launch-configuration error, which
                // leaves the context usable): the plain form, which computes the same bits
                // (and splits alike: the split depends on the shape alone).
                launch = prepare(false)?;
                (function, entry) = chosen(&launch)?;
                r = launch_with(function, &mut launch);
            }
            d.check(r, &format!("launching {}", dispatch.pipeline.name()), MlxError::CommandBufferError)?;
            trace(&launch, entry);
            if let (Some(merge), Some(f)) = (launch.merge.as_mut(), p.merge) {
                if launch::tracing() {
                    eprintln!(
                        "mlx_native cuda: {} merge entry {} arch {}",
                        dispatch.pipeline.name(),
                        p.merge_entry.unwrap_or("?"),
                        p.arch
                    );
                }
                let r = launch_with(f, merge);
                d.check(r, &format!("launching {}'s merge", dispatch.pipeline.name()), MlxError::CommandBufferError)?;
            }
        }
        Ok(())
    }
}

/// The CUDA state of `pipeline`, which another backend's is not.
fn cuda_pipeline(pipeline: &Pipeline) -> Result<&CudaPipeline> {
    pipeline.inner::<CudaPipeline>().ok_or_else(|| {
        MlxError::InvalidArgument(format!("pipeline {} was not built by the CUDA backend", pipeline.name()))
    })
}

/// Compile the CUDA sources `files` for `arch` (no device needed): the compiler's report
/// (ptxas resource usage per entry point), or the first compile error. A file that
/// [`crate::settings::CUDA_SOURCE_DIR`] replaces is compiled in its replaced form, as a device would run it.
/// The modules every call loads; [`compile_check_paged`] for the paged K/V ones,
/// [`compile_check_module`] for any.
pub fn compile_check(arch: &str, files: &[SourceFile]) -> Result<String> {
    compile_check_module(arch, files, ModuleKind::CONTIGUOUS)
}

/// [`compile_check`] of the sources' paged K/V modules (`-DMLXN_PAGED_ENTRIES=1`, which a
/// paged launch compiles: [`nvrtc::module_options`]).
pub fn compile_check_paged(arch: &str, files: &[SourceFile]) -> Result<String> {
    compile_check_module(arch, files, ModuleKind::PAGED)
}

/// [`compile_check`] of the sources' module `module` (the quantised K/V ones:
/// [`ModuleKind::QUANT`], [`ModuleKind::PAGED_QUANT`]).
pub fn compile_check_module(arch: &str, files: &[SourceFile], module: ModuleKind) -> Result<String> {
    let mut report = String::new();
    for &f in files {
        let text = sources::compiled_source(f)?;
        let log = nvrtc::compile_report(f.name, &text, arch, module)?;
        report.push_str(&format!("== {} ({arch}{})\n{log}\n", f.name, module.label()));
    }
    Ok(report)
}

/// The module a launch of kernel `name` runs (`paged`: on paged K/V): a quantised K/V
/// kernel's quant module ([`CudaKernel::quant`]), with the paged define where `paged`.
fn kernel_module(name: &str, paged: bool) -> ModuleKind {
    ModuleKind { paged, quant: kernel(name).is_some_and(|k| k.quant) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_parse() {
        assert_eq!(parse_name("cuda").unwrap(), 0);
        assert_eq!(parse_name("cuda:3").unwrap(), 3);
        for bad in ["cuda:", "cuda:-1", "cuda:x", "cuda3", "cpu"] {
            assert!(matches!(parse_name(bad), Err(MlxError::DeviceNotFound(_))), "{bad}");
        }
    }

    /// A plan's `cuda_form`: `portable` builds for the plain target (sm_90 on Hopper: the
    /// mma.sync form) whatever `MLX_NATIVE_CUDA_ARCH` says; left to the default, the
    /// variable overrides the device's own target, and Hopper's own is sm_90a.
    #[test]
    fn the_cuda_form_option_picks_the_target() {
        let portable = Some(CudaForm::Portable);
        assert_eq!(arch_of((9, 0), None, None), "sm_90a");
        assert!(is_hopper_arch(&arch_of((9, 0), Some(CudaForm::Auto), None)));
        assert_eq!(arch_of((9, 0), portable, None), "sm_90");
        assert_eq!(arch_of((9, 0), portable, Some("sm_90a")), "sm_90", "the option beats the variable");
        assert_eq!(arch_of((9, 0), None, Some("sm_90")), "sm_90", "the variable overrides the default");
        assert_eq!(arch_of((8, 0), None, None), "sm_80");
        assert_eq!(arch_of((8, 0), portable, None), "sm_80");
        assert!(!is_hopper_arch(&arch_of((9, 0), portable, None)));
    }

    /// A plan's `cta_pairs` beats the process-wide switch (`force_pair`) and the variable.
    #[test]
    fn the_cta_pairs_option_beats_the_switch() {
        use crate::options::CtaPairs;
        for p in [CtaPairs::Auto, CtaPairs::Off, CtaPairs::Queries] {
            let o = RunOptions { cta_pairs: Some(p), ..RunOptions::default() };
            assert_eq!(flash_attn_prefill::pairs_of(&o), p);
        }
        assert_eq!(flash_attn_prefill::pairs_of(&RunOptions::default()), crate::settings::get().cuda_pair);
    }
}
