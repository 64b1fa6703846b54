//! CUDA device memory: allocations of the backend's own, and regions of other libraries'
//! tensors used in place (checked against the driver's allocation ranges).

use std::any::Any;
use std::ffi::{c_int, c_void};
use std::sync::Arc;

use super::driver::{self, CuDevicePtr};
use super::CudaContext;
use crate::error::{MlxError, Result};
use crate::interface::Memory;

/// Device memory: an allocation of ours (freed on drop) or a region someone else owns.
pub struct CudaMemory {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) ptr: CuDevicePtr,
    pub(super) len: usize,
    pub(super) owned: bool,
}

impl CudaMemory {
    /// Device address of byte 0.
    pub fn device_ptr(&self) -> CuDevicePtr {
        self.ptr
    }
    /// The context the memory belongs to.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

impl Drop for CudaMemory {
    fn drop(&mut self) {
        if self.owned && self.ptr != 0 {
            if let Ok(d) = self.ctx.bind() {
                // SAFETY: allocated by cuMemAlloc in this context; every kernel that used it
                // has completed (execute synchronises before returning).
                unsafe { (d.cuMemFree_v2)(self.ptr) };
            }
        }
    }
}

impl Memory for CudaMemory {
    fn len(&self) -> usize {
        self.len
    }
    fn host_ptr(&self) -> Option<*mut u8> {
        None
    }
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        if offset.checked_add(dst.len()).is_none_or(|e| e > self.len) {
            return Err(MlxError::InvalidArgument("read past the end of a buffer".into()));
        }
        if dst.is_empty() {
            return Ok(());
        }
        let d = self.ctx.bind()?;
        // SAFETY: the range is inside the allocation; the host buffer holds dst.len() bytes
        // and outlives the synchronisation below.
        let r = unsafe {
            (d.cuMemcpyDtoHAsync_v2)(
                dst.as_mut_ptr() as *mut c_void,
                self.ptr + offset as u64,
                dst.len(),
                self.ctx.stream,
            )
        };
        d.check(r, "copy to the host", MlxError::CommandBufferError)?;
        self.ctx.synchronize()
    }
    fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        if offset.checked_add(src.len()).is_none_or(|e| e > self.len) {
            return Err(MlxError::InvalidArgument("write past the end of a buffer".into()));
        }
        if src.is_empty() {
            return Ok(());
        }
        let d = self.ctx.bind()?;
        // SAFETY: as for read; the source stays valid until the stream is synchronised.
        let r = unsafe {
            (d.cuMemcpyHtoDAsync_v2)(
                self.ptr + offset as u64,
                src.as_ptr() as *const c_void,
                src.len(),
                self.ctx.stream,
            )
        };
        d.check(r, "copy to the device", MlxError::CommandBufferError)?;
        self.ctx.synchronize()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn device_addr(&self) -> Option<u64> {
        Some(self.ptr)
    }
}

/// Check that `[addr, addr + bytes)` is device memory of `ctx`'s device.
pub(super) fn check_device_range(ctx: &CudaContext, addr: u64, bytes: usize) -> Result<()> {
    let d = ctx.bind()?;
    let bad = |what: String| MlxError::InvalidArgument(format!("device address {addr:#x}: {what}"));
    let attr_u32 = |a: c_int| -> Result<u32> {
        let mut v: u32 = 0;
        // SAFETY: the attribute is a 32-bit value for these attributes.
        let r = unsafe { (d.cuPointerGetAttribute)(&mut v as *mut u32 as *mut c_void, a, addr) };
        if r != driver::CUDA_SUCCESS {
            return Err(bad(format!("not CUDA memory ({})", d.error_text(r))));
        }
        Ok(v)
    };
    let attr_u64 = |a: c_int| -> Result<u64> {
        let mut v: u64 = 0;
        // SAFETY: the range attributes are pointer-sized values.
        let r = unsafe { (d.cuPointerGetAttribute)(&mut v as *mut u64 as *mut c_void, a, addr) };
        if r != driver::CUDA_SUCCESS {
            return Err(bad(format!("not CUDA memory ({})", d.error_text(r))));
        }
        Ok(v)
    };
    let ty = attr_u32(driver::POINTER_MEMORY_TYPE)?;
    if ty != driver::MEMORYTYPE_DEVICE && ty != driver::MEMORYTYPE_UNIFIED {
        return Err(bad(format!("memory type {ty} is not device memory")));
    }
    let ordinal = attr_u32(driver::POINTER_DEVICE_ORDINAL)? as i32;
    if ordinal != ctx.ordinal {
        return Err(bad(format!("it belongs to cuda:{ordinal}, not cuda:{}", ctx.ordinal)));
    }
    let start = attr_u64(driver::POINTER_RANGE_START_ADDR)?;
    let size = attr_u64(driver::POINTER_RANGE_SIZE)?;
    let end = addr.checked_add(bytes as u64);
    if end.is_none_or(|e| e > start.saturating_add(size)) {
        return Err(bad(format!("{bytes} bytes run past the end of its allocation ({size} bytes at {start:#x})")));
    }
    Ok(())
}
