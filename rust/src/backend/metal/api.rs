//! The only thing the Metal backend needs from Metal, as a small trait.
//!
//! On macOS [`super::objc::ObjcMetal`] implements it with `objc2-metal`; the tests implement
//! it with a recording fake. Everything above it (buffers, compilation and its cache, argument
//! binding, threadgroup memory, grid and threadgroup sizes, checks and error mapping) is
//! platform-independent code in [`super::backend`], compiled and tested everywhere.

use crate::interface::GridSize;

/// Why a pipeline could not be built from a compiled library.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PipelineError {
    /// The library has no function of that name.
    NoFunction,
    /// The function exists but the pipeline did not build; Metal's message.
    Failed(String),
}

/// A compute pipeline and the limits Metal reports for it.
#[derive(Debug)]
pub struct PipelineInfo<P> {
    pub pipeline: P,
    /// `maxTotalThreadsPerThreadgroup` of the pipeline.
    pub max_total_threads_per_threadgroup: u64,
    /// `threadExecutionWidth` (the simdgroup width) of the pipeline.
    pub thread_execution_width: u64,
}

/// One call on a compute command encoder, in the order the backend makes them.
pub enum Command<'a, A: MetalApi + ?Sized> {
    /// `setComputePipelineState:`
    SetPipeline(&'a A::Pipeline),
    /// `setBytes:length:atIndex:` (a copy, at most 4 KiB).
    SetBytes { index: u64, bytes: &'a [u8] },
    /// `setBuffer:offset:atIndex:`
    SetBuffer { index: u64, buffer: &'a A::Buffer, offset: u64 },
    /// `setThreadgroupMemoryLength:atIndex:` (a multiple of 16 bytes).
    SetThreadgroupMemoryLength { index: u64, bytes: u64 },
    /// `dispatchThreadgroups:threadsPerThreadgroup:`
    DispatchThreadgroups { grid: GridSize, threadgroup: GridSize },
}

/// A Metal device, reduced to what the backend uses. Errors are Metal's messages; the backend
/// maps them to [`crate::MlxError`] variants.
pub trait MetalApi: Send + Sync + 'static {
    /// An `MTLBuffer` in shared storage (host and GPU see the same memory).
    type Buffer: Send + Sync + 'static;
    /// An `MTLLibrary` compiled from source.
    type Library: Send + Sync + 'static;
    /// An `MTLComputePipelineState`.
    type Pipeline: Send + Sync + 'static;

    /// The device's name (`Apple M4 Max`).
    fn name(&self) -> String;
    /// `maxThreadgroupMemoryLength`: the most threadgroup memory one threadgroup may use.
    fn max_threadgroup_memory_length(&self) -> u64;
    /// The host's page size: `new_buffer_no_copy` needs addresses and lengths aligned to it.
    fn page_size(&self) -> usize;
    /// A new buffer of `bytes` bytes (`bytes > 0`) in shared storage.
    fn new_buffer(&self, bytes: usize) -> Result<Self::Buffer, String>;
    /// A shared-storage buffer over `bytes` bytes of host memory at `ptr`, without copying
    /// (`newBufferWithBytesNoCopy:length:options:deallocator:` with no deallocator).
    ///
    /// # Safety
    /// `ptr` and `bytes` are multiples of [`MetalApi::page_size`], `bytes > 0`; the memory
    /// stays valid, and is not freed by Metal, while the buffer exists.
    unsafe fn new_buffer_no_copy(&self, ptr: *mut u8, bytes: usize) -> Result<Self::Buffer, String>;
    /// The host address of a shared buffer's first byte (`contents`).
    fn contents(&self, buffer: &Self::Buffer) -> *mut u8;
    /// Compile Metal Shading Language source at run time (`newLibraryWithSource:options:error:`);
    /// the error is the compiler's log.
    fn compile_library(&self, source: &str) -> Result<Self::Library, String>;
    /// The compute pipeline of `function` in `library`.
    fn new_pipeline(
        &self,
        library: &Self::Library,
        function: &str,
    ) -> Result<PipelineInfo<Self::Pipeline>, PipelineError>;
    /// Encode `commands` on one compute command encoder of one new command buffer, commit it
    /// and wait until it completes; the error is the command buffer's when it failed.
    fn run(&self, commands: &[Command<'_, Self>]) -> Result<(), String>;
}
