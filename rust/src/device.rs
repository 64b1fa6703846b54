//! Devices: a backend instance plus the identity the pipeline cache keys on.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::backend;
use crate::buffer::MlxBuffer;
use crate::dtypes::DType;
use crate::error::{MlxError, Result};
use crate::interface::{Backend, BackendKind};

static NEXT_DEVICE_ID: AtomicU64 = AtomicU64::new(1);

/// A compute device. Cloning shares it.
#[derive(Clone)]
pub struct MlxDevice {
    inner: Arc<DeviceInner>,
}

struct DeviceInner {
    id: u64,
    backend: Arc<dyn Backend>,
}

impl std::fmt::Debug for MlxDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MlxDevice({}, {})", self.inner.id, self.inner.backend.description())
    }
}

impl MlxDevice {
    /// Open a device: `auto` (Metal if present, else CUDA if a GPU is present, else the CPU),
    /// or a backend by name (`cpu`, `cuda`, `cuda:N`, `metal`).
    pub fn new(backend_name: &str) -> Result<Self> {
        Ok(Self::from_backend(backend::open(backend_name)?))
    }

    /// The CPU device.
    pub fn cpu() -> Self {
        Self::from_backend(Arc::new(backend::cpu::CpuBackend::new()))
    }

    /// A device over a backend of the caller's (tests use recording fakes).
    pub fn from_backend(backend: Arc<dyn Backend>) -> Self {
        let id = NEXT_DEVICE_ID.fetch_add(1, Ordering::Relaxed);
        MlxDevice { inner: Arc::new(DeviceInner { id, backend }) }
    }

    /// The id the kernel registry caches pipelines under; unique per opened device.
    pub fn registry_id(&self) -> u64 {
        self.inner.id
    }
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.inner.backend
    }
    pub fn backend_kind(&self) -> BackendKind {
        self.inner.backend.kind()
    }
    pub fn description(&self) -> String {
        self.inner.backend.description()
    }

    /// A zero-filled buffer of `shape` elements of `dtype`.
    pub fn alloc_buffer(&self, dtype: DType, shape: &[usize]) -> Result<MlxBuffer> {
        let bytes = shape
            .iter()
            .try_fold(dtype.size_of(), |a, &d| a.checked_mul(d))
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| MlxError::BufferAllocationError { bytes: u64::MAX })?;
        let mem = self.inner.backend.alloc(bytes)?;
        MlxBuffer::new(mem, self.inner.id, dtype, shape.to_vec())
    }

    /// A buffer over `bytes` bytes of host memory at `ptr`, without copying.
    ///
    /// # Safety
    /// The memory must stay valid while the buffer (or any clone or view) exists, and no
    /// one else may write it while a kernel reads or writes it.
    pub unsafe fn wrap_host(&self, ptr: *mut u8, bytes: usize, dtype: DType, shape: &[usize]) -> Result<MlxBuffer> {
        if ptr.is_null() && bytes > 0 {
            return Err(MlxError::InvalidArgument("null pointer for a non-empty buffer".into()));
        }
        if (ptr as usize) % dtype.size_of() != 0 {
            return Err(MlxError::InvalidArgument(format!("host pointer {ptr:p} is not aligned to {dtype} elements")));
        }
        let mem = self.inner.backend.wrap_host(ptr, bytes)?;
        MlxBuffer::new(mem, self.inner.id, dtype, shape.to_vec())
    }

    /// A buffer over `bytes` bytes of this device's memory at address `addr` (a CUDA
    /// tensor of another library), without copying.
    ///
    /// # Safety
    /// The memory must stay allocated while the buffer (or any clone or view) exists.
    pub unsafe fn wrap_device(&self, addr: u64, bytes: usize, dtype: DType, shape: &[usize]) -> Result<MlxBuffer> {
        if addr % dtype.size_of() as u64 != 0 {
            return Err(MlxError::InvalidArgument(format!(
                "device address {addr:#x} is not aligned to {dtype} elements"
            )));
        }
        let mem = self.inner.backend.wrap_device(addr, bytes)?;
        MlxBuffer::new(mem, self.inner.id, dtype, shape.to_vec())
    }
}
