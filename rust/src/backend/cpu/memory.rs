//! Host memory for the CPU backend: allocations of its own (64-byte aligned, zero-filled)
//! and the caller's arrays used in place.

use std::alloc::Layout;
use std::any::Any;

use crate::error::{MlxError, Result};
use crate::interface::Memory;

/// Alignment of CPU allocations (a cache line, and a zmm register).
const ALIGN: usize = 64;

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
            return Ok(HostMemory {
                ptr: std::ptr::NonNull::<u8>::dangling().as_ptr(),
                len,
                base: std::ptr::null_mut(),
            });
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

impl WrappedHostMemory {
    /// The caller's `len` bytes at `ptr`.
    ///
    /// # Safety
    /// As for [`crate::interface::Backend::wrap_host`]: the memory stays valid while the
    /// wrapper exists.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> Self {
        WrappedHostMemory { ptr, len }
    }
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
