//! How a named kernel runs on each kind of device. The runtime talks to a backend only
//! through [`Backend`] and [`Memory`]; the op layer never sees either.

use std::any::Any;
use std::sync::Arc;

use crate::encoder::Dispatch;
use crate::error::Result;
use crate::kernel_registry::{KernelSource, Pipeline};

pub mod cpu;
pub mod params;
pub mod cuda;
pub mod metal;

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
    /// Use `bytes` bytes of device memory at address `addr` (a PyTorch or CuPy tensor)
    /// without copying. Backends without device memory refuse.
    ///
    /// # Safety
    /// The region must stay allocated while any buffer that wraps it exists.
    unsafe fn wrap_device(&self, addr: u64, bytes: usize) -> Result<Arc<dyn Memory>> {
        let _ = (addr, bytes);
        Err(crate::error::MlxError::InvalidArgument(format!(
            "the {} backend has no device memory to wrap",
            self.kind().name()
        )))
    }
    /// Wait until the work queued on another library's stream (a CUDA stream handle) is
    /// done, before this device uses memory that work writes. Backends without streams
    /// refuse.
    fn wait_stream(&self, stream: u64) -> Result<()> {
        let _ = stream;
        Err(crate::error::MlxError::InvalidArgument(format!(
            "the {} backend has no streams",
            self.kind().name()
        )))
    }
}

/// Names of the backends that can open a device on this machine, best first.
pub fn available_backends() -> Vec<&'static str> {
    let mut names = Vec::new();
    if metal::is_present() {
        names.push(BackendKind::Metal.name());
    }
    if cuda::usable() {
        names.push(BackendKind::Cuda.name());
    }
    names.push(BackendKind::Cpu.name());
    names
}

/// Open the backend `name`: `auto` (Metal if present, else CUDA if a GPU, its driver and
/// NVRTC are usable, else the CPU), `cpu`, `cuda`, `cuda:N` or `metal`.
pub fn open(name: &str) -> Result<Arc<dyn Backend>> {
    match name {
        "auto" => {
            if let Ok(m) = metal::open() {
                return Ok(m);
            }
            if cuda::usable() {
                if let Ok(c) = cuda::CudaBackend::open(0) {
                    return Ok(Arc::new(c));
                }
            }
            Ok(Arc::new(cpu::CpuBackend::new()))
        }
        "cpu" => Ok(Arc::new(cpu::CpuBackend::new())),
        "metal" => metal::open(),
        n if n == "cuda" || n.starts_with("cuda:") => {
            Ok(Arc::new(cuda::CudaBackend::open(cuda::parse_name(n)?)?))
        }
        other => Err(crate::error::MlxError::DeviceNotFound(format!(
            "unknown backend {other:?} (expected one of auto, cpu, cuda, cuda:N, metal)"
        ))),
    }
}
