//! The CPU backend: always present. A kernel is a Rust function that runs a whole dispatch,
//! spreading its tiles over all cores (rayon) with SIMD inner loops chosen at run time.

use std::alloc::Layout;
use std::any::Any;
use std::sync::{Arc, OnceLock};

use super::{Backend, BackendKind, Memory};
use crate::encoder::Dispatch;
use crate::error::{MlxError, Result};
use crate::kernel_registry::{CpuKernelFn, KernelSource, Pipeline};

pub mod flash_attn_prefill_blk;
pub mod flash_attn_prefill_tensor;
pub mod peak;
pub mod simd;

/// Alignment of CPU allocations (a cache line, and a zmm register).
const ALIGN: usize = 64;

/// The CPU device.
pub struct CpuBackend;

impl CpuBackend {
    pub fn new() -> Self {
        CpuBackend
    }
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

/// The pipeline state of a CPU kernel: the function itself.
pub struct CpuPipeline {
    pub kernel: CpuKernelFn,
}

/// Threads the kernels use.
pub fn threads() -> usize {
    rayon::current_num_threads()
}

impl Backend for CpuBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cpu
    }

    fn description(&self) -> String {
        format!("cpu ({} threads, {})", threads(), simd::selected_isa())
    }

    fn alloc(&self, bytes: usize) -> Result<Arc<dyn Memory>> {
        // Linux overcommits: a huge zeroed allocation can succeed and the process be killed
        // later, when the pages are touched. More than the machine has is refused here.
        if memory_limit().is_some_and(|limit| bytes as u64 > limit) {
            return Err(MlxError::BufferAllocationError { bytes: bytes as u64 });
        }
        Ok(Arc::new(HostMemory::zeroed(bytes)?))
    }

    unsafe fn wrap_host(&self, ptr: *mut u8, bytes: usize) -> Result<Arc<dyn Memory>> {
        Ok(Arc::new(WrappedHostMemory { ptr, len: bytes }))
    }

    fn compile(&self, name: &str, source: &KernelSource) -> Result<Pipeline> {
        let kernel = source.cpu.ok_or_else(|| {
            MlxError::KernelNotFound(format!("kernel {name} has no CPU implementation"))
        })?;
        Ok(Pipeline::new(name, 1024, Arc::new(CpuPipeline { kernel })))
    }

    fn execute(&self, dispatches: &[Dispatch]) -> Result<()> {
        for d in dispatches {
            let state = d.pipeline.inner::<CpuPipeline>().ok_or_else(|| {
                MlxError::InvalidArgument(format!(
                    "pipeline {} was not built by the CPU backend",
                    d.pipeline.name()
                ))
            })?;
            (state.kernel)(d)?;
        }
        Ok(())
    }
}

/// Bytes of memory the process could ever get: RAM plus swap, capped by the cgroup's
/// limit, read once. `None` where the system does not say (then the allocator decides).
pub fn memory_limit() -> Option<u64> {
    static LIMIT: OnceLock<Option<u64>> = OnceLock::new();
    *LIMIT.get_or_init(read_memory_limit)
}

#[cfg(target_os = "linux")]
fn read_memory_limit() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| {
        info.lines().find_map(|l| {
            let kb = l.strip_prefix(name)?.trim().strip_suffix("kB")?.trim();
            kb.parse::<u64>().ok().map(|kb| kb.saturating_mul(1024))
        })
    };
    let total = field("MemTotal:")?.saturating_add(field("SwapTotal:").unwrap_or(0));
    // cgroup v2, then v1; "max" or a huge number means no limit.
    let cgroup = ["/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"]
        .iter()
        .find_map(|p| std::fs::read_to_string(p).ok()?.trim().parse::<u64>().ok());
    Some(cgroup.map_or(total, |c| c.min(total)))
}

#[cfg(not(target_os = "linux"))]
fn read_memory_limit() -> Option<u64> {
    None
}

/// Host memory the library owns: 64-byte aligned, zero-filled.
pub struct HostMemory {
    ptr: *mut u8,
    len: usize,
    /// The block as allocated (`ptr` is its first 64-byte aligned address).
    base: *mut u8,
}

// SAFETY: the allocation is owned and only reached through raw pointers whose use the
// kernels and the buffer API coordinate (a dispatch's writes are to its output alone).
unsafe impl Send for HostMemory {}
unsafe impl Sync for HostMemory {}

impl HostMemory {
    pub fn zeroed(len: usize) -> Result<Self> {
        if len == 0 {
            return Ok(HostMemory { ptr: std::ptr::NonNull::<u8>::dangling().as_ptr(), len, base: std::ptr::null_mut() });
        }
        // A small alignment keeps `alloc_zeroed` on calloc, whose large blocks are fresh
        // zero pages, untouched until used (an over-aligned layout is allocated, then
        // zeroed byte by byte); the 64-byte alignment is made by hand inside the block.
        let layout = Self::layout(len).ok_or(MlxError::BufferAllocationError { bytes: len as u64 })?;
        // SAFETY: layout has a non-zero size.
        let base = unsafe { std::alloc::alloc_zeroed(layout) };
        if base.is_null() {
            return Err(MlxError::BufferAllocationError { bytes: len as u64 });
        }
        // SAFETY: the block has ALIGN spare bytes, so the aligned start plus len stays inside.
        let ptr = unsafe { base.add(base.align_offset(ALIGN)) };
        Ok(HostMemory { ptr, len, base })
    }

    fn layout(len: usize) -> Option<Layout> {
        Layout::from_size_align(len.checked_add(ALIGN)?, std::mem::align_of::<u64>()).ok()
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: allocated in `zeroed` with this layout.
            unsafe { std::alloc::dealloc(self.base, Self::layout(self.len).unwrap_unchecked()) }
        }
    }
}

/// Host memory owned by someone else (a numpy array), used in place.
pub struct WrappedHostMemory {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: as for HostMemory; the owner keeps it alive (the contract of `wrap_host`).
unsafe impl Send for WrappedHostMemory {}
unsafe impl Sync for WrappedHostMemory {}

fn host_read(ptr: *mut u8, len: usize, offset: usize, dst: &mut [u8]) -> Result<()> {
    if offset.checked_add(dst.len()).is_none_or(|e| e > len) {
        return Err(MlxError::InvalidArgument("read past the end of a buffer".into()));
    }
    // SAFETY: range checked above.
    unsafe { std::ptr::copy_nonoverlapping(ptr.add(offset), dst.as_mut_ptr(), dst.len()) };
    Ok(())
}

fn host_write(ptr: *mut u8, len: usize, offset: usize, src: &[u8]) -> Result<()> {
    if offset.checked_add(src.len()).is_none_or(|e| e > len) {
        return Err(MlxError::InvalidArgument("write past the end of a buffer".into()));
    }
    // SAFETY: range checked above; `copy` allows the source to overlap the buffer.
    unsafe { std::ptr::copy(src.as_ptr(), ptr.add(offset), src.len()) };
    Ok(())
}

macro_rules! host_memory_impl {
    ($t:ty) => {
        impl Memory for $t {
            fn len(&self) -> usize {
                self.len
            }
            fn host_ptr(&self) -> Option<*mut u8> {
                Some(self.ptr)
            }
            fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
                host_read(self.ptr, self.len, offset, dst)
            }
            fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
                host_write(self.ptr, self.len, offset, src)
            }
            fn as_any(&self) -> &dyn Any {
                self
            }
        }
    };
}
host_memory_impl!(HostMemory);
host_memory_impl!(WrappedHostMemory);

/// Host address and length of a dispatch's buffer, for a CPU kernel.
pub(crate) fn host_slice(d: &Dispatch, index: u64) -> Result<(*mut u8, usize)> {
    let b = d.buffer(index)?;
    let p = b.host_ptr().ok_or_else(|| {
        MlxError::InvalidArgument(format!(
            "{}: buffer {index} is not in host memory",
            d.pipeline.name()
        ))
    })?;
    Ok((p, b.data_byte_len()))
}

/// A raw pointer that may cross threads; the kernels write disjoint ranges through it.
#[derive(Clone, Copy)]
pub(crate) struct SendPtr<T>(pub *mut T);
// SAFETY: see the type's comment; every use writes a range no other task touches.
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}
