//! [`MetalApi`] over `objc2-metal` (macOS only): one Metal call per trait method, no logic.

use std::ffi::c_void;
use std::ptr::NonNull;

use objc2::rc::{autoreleasepool, Retained};
use objc2::runtime::ProtocolObject;
use objc2_foundation::{NSPageSize, NSString};
use objc2_metal::{
    MTLBuffer, MTLCommandBuffer, MTLCommandBufferStatus, MTLCommandEncoder, MTLCommandQueue, MTLComputeCommandEncoder,
    MTLComputePipelineState, MTLCreateSystemDefaultDevice, MTLDevice, MTLLibrary, MTLResourceOptions, MTLSize,
};

use super::api::{Command, MetalApi, PipelineError, PipelineInfo};
use crate::interface::GridSize;

/// The system's default Metal device and one command queue on it.
pub struct ObjcMetal {
    device: Retained<ProtocolObject<dyn MTLDevice>>,
    queue: Retained<ProtocolObject<dyn MTLCommandQueue>>,
}

impl ObjcMetal {
    /// `MTLCreateSystemDefaultDevice()` and a command queue; None without a Metal device.
    pub fn system_default() -> Option<Self> {
        autoreleasepool(|_| {
            let device = MTLCreateSystemDefaultDevice()?;
            let queue = device.newCommandQueue()?;
            Some(ObjcMetal { device, queue })
        })
    }
}

/// A shared-storage `MTLBuffer`.
pub struct SharedBuffer(Retained<ProtocolObject<dyn MTLBuffer>>);

// SAFETY: Metal buffers may be used from any thread; the backend orders host access to the
// contents with command-buffer completion.
unsafe impl Send for SharedBuffer {}
unsafe impl Sync for SharedBuffer {}

fn mtl_size(s: GridSize) -> MTLSize {
    MTLSize { width: s.width as usize, height: s.height as usize, depth: s.depth as usize }
}

impl MetalApi for ObjcMetal {
    type Buffer = SharedBuffer;
    type Library = Retained<ProtocolObject<dyn MTLLibrary>>;
    type Pipeline = Retained<ProtocolObject<dyn MTLComputePipelineState>>;

    fn name(&self) -> String {
        self.device.name().to_string()
    }

    fn max_threadgroup_memory_length(&self) -> u64 {
        self.device.maxThreadgroupMemoryLength() as u64
    }

    fn page_size(&self) -> usize {
        NSPageSize()
    }

    fn new_buffer(&self, bytes: usize) -> Result<SharedBuffer, String> {
        self.device
            .newBufferWithLength_options(bytes, MTLResourceOptions::StorageModeShared)
            .map(SharedBuffer)
            .ok_or_else(|| format!("Metal could not allocate a buffer of {bytes} bytes"))
    }

    unsafe fn new_buffer_no_copy(&self, ptr: *mut u8, bytes: usize) -> Result<SharedBuffer, String> {
        let pointer = NonNull::new(ptr as *mut c_void).ok_or("a null pointer")?;
        // SAFETY: the caller passes page-aligned memory it keeps alive; no deallocator.
        unsafe {
            self.device.newBufferWithBytesNoCopy_length_options_deallocator(
                pointer,
                bytes,
                MTLResourceOptions::StorageModeShared,
                None,
            )
        }
        .map(SharedBuffer)
        .ok_or_else(|| format!("Metal could not wrap {bytes} bytes at {ptr:p}"))
    }

    fn contents(&self, buffer: &SharedBuffer) -> *mut u8 {
        buffer.0.contents().as_ptr() as *mut u8
    }

    fn compile_library(&self, source: &str) -> Result<Self::Library, String> {
        autoreleasepool(|_| {
            self.device
                .newLibraryWithSource_options_error(&NSString::from_str(source), None)
                .map_err(|e| e.localizedDescription().to_string())
        })
    }

    fn new_pipeline(
        &self,
        library: &Self::Library,
        function: &str,
    ) -> Result<PipelineInfo<Self::Pipeline>, PipelineError> {
        autoreleasepool(|_| {
            let f = library.newFunctionWithName(&NSString::from_str(function)).ok_or(PipelineError::NoFunction)?;
            let pipeline = self
                .device
                .newComputePipelineStateWithFunction_error(&f)
                .map_err(|e| PipelineError::Failed(e.localizedDescription().to_string()))?;
            Ok(PipelineInfo {
                max_total_threads_per_threadgroup: pipeline.maxTotalThreadsPerThreadgroup() as u64,
                thread_execution_width: pipeline.threadExecutionWidth() as u64,
                pipeline,
            })
        })
    }

    fn run(&self, commands: &[Command<'_, Self>]) -> Result<(), String> {
        autoreleasepool(|_| {
            let cb = self.queue.commandBuffer().ok_or("Metal could not make a command buffer")?;
            let enc = cb.computeCommandEncoder().ok_or("Metal could not make a compute command encoder")?;
            for c in commands {
                match c {
                    Command::SetPipeline(p) => enc.setComputePipelineState(p),
                    // SAFETY: the indices are checked (0..=30) and the pointers valid for the
                    // call (setBytes copies).
                    Command::SetBytes { index, bytes } => unsafe {
                        enc.setBytes_length_atIndex(
                            NonNull::new_unchecked(bytes.as_ptr() as *mut c_void),
                            bytes.len(),
                            *index as usize,
                        )
                    },
                    Command::SetBuffer { index, buffer, offset } => unsafe {
                        enc.setBuffer_offset_atIndex(Some(&buffer.0), *offset as usize, *index as usize)
                    },
                    Command::SetThreadgroupMemoryLength { index, bytes } => unsafe {
                        enc.setThreadgroupMemoryLength_atIndex(*bytes as usize, *index as usize)
                    },
                    Command::DispatchThreadgroups { grid, threadgroup } => {
                        enc.dispatchThreadgroups_threadsPerThreadgroup(mtl_size(*grid), mtl_size(*threadgroup))
                    }
                }
            }
            enc.endEncoding();
            cb.commit();
            cb.waitUntilCompleted();
            if cb.status() == MTLCommandBufferStatus::Error {
                return Err(cb
                    .error()
                    .map(|e| e.localizedDescription().to_string())
                    .unwrap_or_else(|| "the command buffer failed without an error object".into()));
            }
            Ok(())
        })
    }
}
