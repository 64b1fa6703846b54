//! The runtime's value types and the traits a backend implements: the leaf every other
//! module stands on. It imports only [`crate::error`], [`crate::dtypes`] and
//! [`crate::options`] (the run options a dispatch carries).
//!
//! - [`Memory`]: one allocation (or wrapped region) a backend runs kernels on;
//!   [`BufferBinding`]: a typed byte range of one, as a dispatch binds it.
//! - [`KernelSource`]: the device sources of a kernel, as an op names them;
//!   [`Pipeline`]: a kernel built for one device.
//! - [`Dispatch`] (with [`BoundArg`] and [`GridSize`]): one recorded kernel launch.
//! - [`Backend`]: memory, compilation and execution for one kind of device.
//!
//! The device, the encoder and the kernel registry stand above this module; the backends
//! implement its traits and read its values, and never see anything above it.

use std::any::Any;
use std::sync::Arc;

use crate::dtypes::DType;
use crate::error::{MlxError, Result};
pub use crate::options::RunOptions;

/// A 3-D size (a grid of threadgroups, or the threads of one threadgroup).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GridSize {
    pub width: u64,
    pub height: u64,
    pub depth: u64,
}

impl GridSize {
    pub const fn new(width: u64, height: u64, depth: u64) -> Self {
        GridSize { width, height, depth }
    }
    /// width * height * depth (saturating).
    pub fn count(&self) -> u64 {
        self.width.saturating_mul(self.height).saturating_mul(self.depth)
    }
}

/// The kinds of backend the library knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackendKind {
    Cpu,
    Cuda,
    Metal,
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Cuda => "cuda",
            BackendKind::Metal => "metal",
        }
    }
}

/// One allocation (or one wrapped region) that a backend can run kernels on.
pub trait Memory: Send + Sync {
    /// Size in bytes.
    fn len(&self) -> usize;
    /// Whether the region is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Address of byte 0 where the host can read and write it directly (CPU memory,
    /// Metal shared storage); `None` for device-only memory.
    fn host_ptr(&self) -> Option<*mut u8>;
    /// Copy `dst.len()` bytes starting at `offset` to the host.
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()>;
    /// Copy `src` into the region starting at `offset`.
    fn write(&self, offset: usize, src: &[u8]) -> Result<()>;
    /// For the backend that made it, to reach its own type.
    fn as_any(&self) -> &dyn Any;
    /// Device address of byte 0 for device memory (unique in the process), else `None`.
    fn device_addr(&self) -> Option<u64> {
        None
    }
}

/// A typed byte range of one [`Memory`]: what a dispatch binds and a backend reads.
#[derive(Clone)]
pub struct BufferBinding {
    pub memory: Arc<dyn Memory>,
    pub dtype: DType,
    /// Offset of the range's first byte in the memory.
    pub byte_offset: usize,
    /// Bytes in the range.
    pub byte_len: usize,
}

impl std::fmt::Debug for BufferBinding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BufferBinding({} bytes of {} at {})", self.byte_len, self.dtype, self.byte_offset)
    }
}

impl BufferBinding {
    /// Host address of the range's first byte, where the memory is host-visible.
    pub fn host_ptr(&self) -> Option<*mut u8> {
        // SAFETY: byte_offset <= memory.len() (the buffer that made the binding checked it).
        self.memory.host_ptr().map(|p| unsafe { p.add(self.byte_offset) })
    }
    /// Device address of the range's first byte, for device memory.
    pub fn device_addr(&self) -> Option<u64> {
        self.memory.device_addr().map(|a| a + self.byte_offset as u64)
    }
}

/// A device source file of a kernel: its name (for messages and caches), its text, and the
/// headers it includes, by the name its `#include "..."` gives them (the backend hands them
/// to the compiler: the kernel is in parts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SourceFile {
    pub name: &'static str,
    pub text: &'static str,
    pub headers: &'static [(&'static str, &'static str)],
}

impl SourceFile {
    /// A file that includes nothing of the library's.
    pub const fn single(name: &'static str, text: &'static str) -> Self {
        SourceFile { name, text, headers: &[] }
    }
}

/// The device sources of a kernel, as its op names them. A backend that compiles sources
/// takes its own form (a kernel without it is [`MlxError::KernelNotFound`] there); the CPU
/// backend keeps its forms in a table of its own, by kernel name.
#[derive(Debug, Clone, Copy)]
pub struct KernelSource {
    /// Metal Shading Language (all entry points of one file).
    pub metal: Option<SourceFile>,
    /// CUDA C++ (all entry points of one file).
    pub cuda: Option<SourceFile>,
}

/// A compiled kernel, ready to dispatch on one device.
#[derive(Clone)]
pub struct Pipeline {
    name: Arc<str>,
    max_threads: u64,
    inner: Arc<dyn Any + Send + Sync>,
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pipeline({})", self.name)
    }
}

impl Pipeline {
    /// A pipeline whose backend-specific state is `inner`.
    pub fn new(name: &str, max_threads: u64, inner: Arc<dyn Any + Send + Sync>) -> Self {
        Pipeline { name: name.into(), max_threads, inner }
    }
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The most threads one threadgroup of this pipeline may have.
    pub fn max_total_threads_per_threadgroup(&self) -> u64 {
        self.max_threads
    }
    /// The backend's own state, if it is a `T`.
    pub fn inner<T: 'static>(&self) -> Option<&T> {
        self.inner.downcast_ref::<T>()
    }
}

/// One argument as the encoder keeps it: the buffer's range shared, the bytes copied.
#[derive(Debug, Clone)]
pub enum BoundArg {
    Buffer(BufferBinding),
    Bytes(Vec<u8>),
}

/// A recorded dispatch: what a backend runs.
#[derive(Clone)]
pub struct Dispatch {
    pub pipeline: Pipeline,
    pub args: Vec<(u64, BoundArg)>,
    /// (index, bytes) of threadgroup memory blocks.
    pub shared: Vec<(u64, u64)>,
    pub grid: GridSize,
    pub threadgroup: GridSize,
    /// The caller's choices of how it runs (its plan's options; the default: the
    /// library's), which the backend that runs it reads.
    pub options: RunOptions,
}

impl Dispatch {
    /// The buffer bound at `index`.
    pub fn buffer(&self, index: u64) -> Result<&BufferBinding> {
        match self.args.iter().find(|(i, _)| *i == index) {
            Some((_, BoundArg::Buffer(b))) => Ok(b),
            _ => Err(MlxError::Internal(format!("{}: no buffer bound at index {index}", self.pipeline.name()))),
        }
    }

    /// The constant block bound at `index`, read as `T` (the op's params mirror).
    pub fn constant<T: bytemuck::Pod>(&self, index: u64) -> Result<T> {
        match self.args.iter().find(|(i, _)| *i == index) {
            Some((_, BoundArg::Bytes(b))) if b.len() == std::mem::size_of::<T>() => Ok(bytemuck::pod_read_unaligned(b)),
            _ => Err(MlxError::Internal(format!(
                "{}: no {}-byte constant bound at index {index}",
                self.pipeline.name(),
                std::mem::size_of::<T>()
            ))),
        }
    }

    /// Bytes of the threadgroup memory block `index`.
    pub fn shared_bytes(&self, index: u64) -> u64 {
        self.shared.iter().find(|(i, _)| *i == index).map_or(0, |(_, b)| *b)
    }
}

/// A backend's choices for one planned dispatch ([`Backend::choices`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choices {
    /// Bytes of workspace a run can use (0: none).
    pub workspace: u64,
    /// What runs, by name: `form` (the kernels' form: `cpu`, `hopper`, `portable`, ...)
    /// and where they apply `pairs`, `splits` and `isa`.
    pub report: Vec<(&'static str, String)>,
}

/// A device's implementation: memory, kernel compilation and execution.
pub trait Backend: Send + Sync {
    fn kind(&self) -> BackendKind;
    /// One line that names the device (`cpu (2 threads, avx512)`, `cuda:0 NVIDIA H200`).
    fn description(&self) -> String;
    /// Zero-filled memory of `bytes` bytes.
    fn alloc(&self, bytes: usize) -> Result<Arc<dyn Memory>>;
    /// Use `bytes` bytes at `ptr` without copying.
    ///
    /// # Safety
    /// The region must stay valid, and not be freed or reused, while any buffer that wraps
    /// it exists.
    unsafe fn wrap_host(&self, ptr: *mut u8, bytes: usize) -> Result<Arc<dyn Memory>>;
    /// Build the pipeline of the kernel `name` from its source.
    fn compile(&self, name: &str, source: &KernelSource) -> Result<Pipeline>;
    /// Run the dispatches in order; returns once they are complete.
    fn execute(&self, dispatches: &[Dispatch]) -> Result<()>;
    /// Bytes of workspace a dispatch of kernel `kernel_name` with the constant block
    /// `params` (its index 0) can use to run faster (CUDA: the attention's split-KV parts);
    /// 0 where it has no use for one. The op's plan hands it over as a buffer of its own.
    fn workspace_bytes(&self, kernel_name: &str, params: &[u8]) -> u64 {
        let _ = (kernel_name, params);
        0
    }
    /// What this backend will run for a dispatch of `kernel_name` with the constant block
    /// `params` under `options`, decided when a plan is made so that a fallback is visible
    /// there: the workspace it can use (as [`Backend::workspace_bytes`], under the options)
    /// and the choices it made, by name (`form`, `pairs`, `splits`, `isa`).
    fn choices(&self, kernel_name: &str, params: &[u8], options: &RunOptions) -> Choices {
        let _ = options;
        Choices {
            workspace: self.workspace_bytes(kernel_name, params),
            report: vec![("form", self.kind().name().into())],
        }
    }
    /// Whether the attention's kernels read paged K/V in entry points of their own (Metal: the
    /// op's `PAGED_KERNELS`, a walk whose products differ in form from the contiguous one's),
    /// not in the contiguous kernels themselves behind the flag (the CPU; CUDA picks its
    /// `_paged` entry points in its own host).
    fn paged_kv_entry_points(&self) -> bool {
        false
    }
    /// Whether the attention's kernels read quantised K/V (FP8 E4M3 / E5M2 with descale
    /// factors, Q8_0: SPEC 11): the plan refuses them, by name, on a backend that does not.
    fn reads_quantised_kv(&self) -> bool {
        false
    }
    /// Run the dispatches in order on the caller's stream (a CUDA stream handle) and return
    /// without waiting for them: the stream orders what the caller queues after. Backends
    /// without streams run them now and return once they are complete.
    fn execute_on(&self, dispatches: &[Dispatch], stream: u64) -> Result<()> {
        let _ = stream;
        self.execute(dispatches)
    }
    /// Use `bytes` bytes of device memory at address `addr` (a PyTorch or CuPy tensor)
    /// without copying. Backends without device memory refuse.
    ///
    /// # Safety
    /// The region must stay allocated while any buffer that wraps it exists.
    unsafe fn wrap_device(&self, addr: u64, bytes: usize) -> Result<Arc<dyn Memory>> {
        let _ = (addr, bytes);
        Err(MlxError::InvalidArgument(format!("the {} backend has no device memory to wrap", self.kind().name())))
    }
    /// Wait until the work queued on another library's stream (a CUDA stream handle) is
    /// done, before this device uses memory that work writes. Backends without streams
    /// refuse.
    fn wait_stream(&self, stream: u64) -> Result<()> {
        let _ = stream;
        Err(MlxError::InvalidArgument(format!("the {} backend has no streams", self.kind().name())))
    }
}
