//! Buffers: a typed, shaped view of device memory.

use std::sync::Arc;

use crate::dtypes::DType;
use crate::error::{MlxError, Result};
use crate::interface::{BufferBinding, Memory};

/// A typed view (`dtype`, `shape`, byte offset and length) of one allocation. Cloning is
/// cheap and shares the memory.
#[derive(Clone)]
pub struct MlxBuffer {
    memory: Arc<dyn Memory>,
    device_id: u64,
    dtype: DType,
    shape: Vec<usize>,
    byte_offset: usize,
    byte_len: usize,
}

impl std::fmt::Debug for MlxBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MlxBuffer")
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("byte_offset", &self.byte_offset)
            .field("byte_len", &self.byte_len)
            .field("device_id", &self.device_id)
            .finish()
    }
}

impl MlxBuffer {
    /// A view of all of `memory`. `shape` may be empty (a flat buffer); if it is not, its
    /// product times the dtype size must not exceed the memory.
    pub(crate) fn new(memory: Arc<dyn Memory>, device_id: u64, dtype: DType, shape: Vec<usize>) -> Result<Self> {
        let byte_len = memory.len();
        check_shape(&shape, dtype, byte_len)?;
        Ok(MlxBuffer { memory, device_id, dtype, shape, byte_offset: 0, byte_len })
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// Offset of this view's first byte in its allocation.
    pub fn byte_offset(&self) -> usize {
        self.byte_offset
    }
    /// Bytes visible through this view.
    pub fn data_byte_len(&self) -> usize {
        self.byte_len
    }
    /// Whole elements visible through this view.
    pub fn element_count(&self) -> usize {
        self.byte_len / self.dtype.size_of()
    }
    /// The device (its registry id) the memory belongs to.
    pub fn device_id(&self) -> u64 {
        self.device_id
    }
    pub fn memory(&self) -> &Arc<dyn Memory> {
        &self.memory
    }
    /// The typed byte range this view covers, as a dispatch binds it.
    pub fn binding(&self) -> BufferBinding {
        BufferBinding {
            memory: self.memory.clone(),
            dtype: self.dtype,
            byte_offset: self.byte_offset,
            byte_len: self.byte_len,
        }
    }

    /// A view of `byte_len` bytes at `byte_offset` (relative to this view), as `dtype`.
    pub fn view(&self, byte_offset: usize, byte_len: usize, dtype: DType, shape: Vec<usize>) -> Result<Self> {
        let end = byte_offset.checked_add(byte_len);
        if end.is_none_or(|e| e > self.byte_len) {
            return Err(MlxError::InvalidArgument(format!(
                "view of {byte_len} bytes at offset {byte_offset} exceeds the buffer's {} bytes",
                self.byte_len
            )));
        }
        if (self.byte_offset + byte_offset) % dtype.size_of() != 0 {
            return Err(MlxError::InvalidArgument(format!(
                "view offset {byte_offset} is not aligned to {dtype} elements"
            )));
        }
        check_shape(&shape, dtype, byte_len)?;
        Ok(MlxBuffer {
            memory: self.memory.clone(),
            device_id: self.device_id,
            dtype,
            shape,
            byte_offset: self.byte_offset + byte_offset,
            byte_len,
        })
    }

    /// Host address of this view's first byte, where the memory is host-visible.
    pub fn host_ptr(&self) -> Option<*mut u8> {
        // SAFETY: byte_offset <= memory.len() by construction.
        self.memory.host_ptr().map(|p| unsafe { p.add(self.byte_offset) })
    }

    /// Copy `dst.len()` bytes at `offset` (relative to this view) to the host.
    pub fn read_bytes(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check_range(offset, dst.len())?;
        self.memory.read(self.byte_offset + offset, dst)
    }

    /// Copy `src` into this view at `offset`.
    pub fn write_bytes(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check_range(offset, src.len())?;
        self.memory.write(self.byte_offset + offset, src)
    }

    /// Whether this view and `other` share any byte of the same allocation.
    pub fn overlaps(&self, other: &MlxBuffer) -> bool {
        let same = match (self.memory.host_ptr(), other.memory.host_ptr()) {
            // Two wrappers of the same host memory are different allocations to us but the
            // same bytes to the kernel: compare addresses.
            (Some(a), Some(b)) => {
                let (a0, b0) = (a as usize + self.byte_offset, b as usize + other.byte_offset);
                return self.byte_len > 0 && other.byte_len > 0 && a0 < b0 + other.byte_len && b0 < a0 + self.byte_len;
            }
            _ => match (self.memory.device_addr(), other.memory.device_addr()) {
                // The same for two wrappers of one CUDA tensor.
                (Some(a), Some(b)) if a != 0 && b != 0 => {
                    let (a0, b0) = (a + self.byte_offset as u64, b + other.byte_offset as u64);
                    let (al, bl) = (self.byte_len as u64, other.byte_len as u64);
                    return al > 0 && bl > 0 && a0 < b0 + bl && b0 < a0 + al;
                }
                _ => Arc::ptr_eq(&self.memory, &other.memory),
            },
        };
        same && self.byte_len > 0
            && other.byte_len > 0
            && self.byte_offset < other.byte_offset + other.byte_len
            && other.byte_offset < self.byte_offset + self.byte_len
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.byte_len => Ok(()),
            _ => Err(MlxError::InvalidArgument(format!(
                "{len} bytes at offset {offset} exceed the buffer's {} bytes",
                self.byte_len
            ))),
        }
    }
}

fn check_shape(shape: &[usize], dtype: DType, byte_len: usize) -> Result<()> {
    if shape.is_empty() {
        return Ok(());
    }
    let elems = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    match elems.and_then(|e| e.checked_mul(dtype.size_of())) {
        Some(bytes) if bytes <= byte_len => Ok(()),
        _ => Err(MlxError::InvalidArgument(format!(
            "shape {shape:?} of {dtype} needs more than the {byte_len} bytes available"
        ))),
    }
}
