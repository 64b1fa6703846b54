//! The Metal backend above the [`MetalApi`] interface: memory, compilation with its cache,
//! argument binding and dispatch checks, error mapping. Platform-independent; on macOS it runs
//! over [`super::objc::ObjcMetal`], in the tests over a recording fake.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::api::{Command, MetalApi, PipelineError};
use crate::error::{MlxError, Result};
use crate::interface::{Backend, BackendKind, BoundArg, BufferBinding, Dispatch, KernelSource, Memory, Pipeline};

/// The most bytes `setBytes:length:atIndex:` takes.
pub const MAX_SET_BYTES: usize = 4096;
/// Buffer and threadgroup-memory argument indices of a compute function (`[[buffer(0..30)]]`).
pub const MAX_ARGUMENT_INDEX: u64 = 30;
/// Threadgroup memory lengths must be multiples of this.
pub const THREADGROUP_MEMORY_GRANULE: u64 = 16;

/// How a [`MetalMemory`] relates to host memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    /// A shared buffer the backend allocated; the host uses its contents directly.
    Owned,
    /// A shared buffer over the caller's page-aligned memory, without a copy.
    NoCopy,
    /// The caller's memory is not page-aligned: a shared buffer of its own, filled from the
    /// host memory before each command buffer that binds it and copied back after.
    Staged,
}

/// Memory the Metal backend runs kernels on: a shared-storage buffer.
pub struct MetalMemory<A: MetalApi> {
    buffer: A::Buffer,
    storage: Storage,
    /// Where the host reads and writes it (the buffer's contents, or the wrapped memory).
    host: *mut u8,
    /// The buffer's contents (differs from `host` only when staged).
    contents: *mut u8,
    len: usize,
}

// SAFETY: the buffer is Send + Sync; the pointers address memory that lives as long as the
// buffer (its contents) or that the wrapper's caller keeps alive (the `wrap_host` contract).
unsafe impl<A: MetalApi> Send for MetalMemory<A> {}
unsafe impl<A: MetalApi> Sync for MetalMemory<A> {}

impl<A: MetalApi> MetalMemory<A> {
    pub fn storage(&self) -> Storage {
        self.storage
    }
    pub fn buffer(&self) -> &A::Buffer {
        &self.buffer
    }
}

fn check_range(len: usize, offset: usize, n: usize) -> Result<()> {
    match offset.checked_add(n) {
        Some(end) if end <= len => Ok(()),
        _ => Err(MlxError::InvalidArgument(format!("{n} bytes at offset {offset} exceed the buffer's {len} bytes"))),
    }
}

impl<A: MetalApi> Memory for MetalMemory<A> {
    fn len(&self) -> usize {
        self.len
    }
    fn host_ptr(&self) -> Option<*mut u8> {
        Some(self.host)
    }
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        check_range(self.len, offset, dst.len())?;
        // SAFETY: in range; shared storage is host-visible.
        unsafe { std::ptr::copy_nonoverlapping(self.host.add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
    fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        check_range(self.len, offset, src.len())?;
        // SAFETY: in range; `copy` allows `src` to overlap the buffer.
        unsafe { std::ptr::copy(src.as_ptr(), self.host.add(offset), src.len()) };
        Ok(())
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The backend state of a Metal pipeline.
pub struct MetalPipeline<A: MetalApi> {
    pub pipeline: A::Pipeline,
    pub thread_execution_width: u64,
}

/// Compiled libraries by source text (address and length of the `&'static str`).
type LibraryCache<L> = Mutex<HashMap<(usize, usize), Arc<L>>>;

/// A Metal device behind [`MetalApi`].
pub struct MetalBackend<A: MetalApi> {
    api: A,
    /// Every entry point of one `.metal` file shares one compilation. (Pipelines are cached
    /// per device by the kernel registry.)
    libraries: LibraryCache<A::Library>,
}

impl<A: MetalApi> MetalBackend<A> {
    pub fn new(api: A) -> Self {
        MetalBackend { api, libraries: Mutex::new(HashMap::new()) }
    }

    pub fn api(&self) -> &A {
        &self.api
    }

    fn library(&self, name: &str, source: &'static str) -> Result<Arc<A::Library>> {
        let key = (source.as_ptr() as usize, source.len());
        if let Some(lib) = self.libraries.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return Ok(lib.clone());
        }
        // Compile outside the lock: a compilation takes long and another source may be asked
        // for meanwhile. Two threads compiling the same source both succeed; one result stays.
        let lib = Arc::new(
            self.api
                .compile_library(source)
                .map_err(|message| MlxError::ShaderCompilationError { name: name.to_string(), message })?,
        );
        let mut libs = self.libraries.lock().unwrap_or_else(|e| e.into_inner());
        Ok(libs.entry(key).or_insert(lib).clone())
    }

    fn owned(&self, bytes: usize) -> Result<MetalMemory<A>> {
        // Metal has no empty buffers: an empty allocation is one byte nobody sees.
        let buffer =
            self.api.new_buffer(bytes.max(1)).map_err(|_| MlxError::BufferAllocationError { bytes: bytes as u64 })?;
        let contents = self.api.contents(&buffer);
        // Metal does not promise zeroed contents; the Backend contract does.
        // SAFETY: the buffer holds at least `bytes.max(1)` bytes at `contents`.
        unsafe { std::ptr::write_bytes(contents, 0, bytes) };
        Ok(MetalMemory { buffer, storage: Storage::Owned, host: contents, contents, len: bytes })
    }

    /// The Metal memory behind the buffer bound at `index` of `d`.
    fn metal_memory<'d>(&self, d: &'d Dispatch, index: u64, b: &'d BufferBinding) -> Result<&'d MetalMemory<A>> {
        b.memory.as_any().downcast_ref::<MetalMemory<A>>().ok_or_else(|| {
            MlxError::InvalidArgument(format!(
                "{}: the buffer at index {index} is not memory of the Metal backend",
                d.pipeline.name()
            ))
        })
    }
}

impl<A: MetalApi> Backend for MetalBackend<A> {
    fn kind(&self) -> BackendKind {
        BackendKind::Metal
    }

    fn description(&self) -> String {
        format!("metal ({})", self.api.name())
    }

    /// Paged K/V (SPEC 11) through the `flash_attn_prefill_paged_*` entry points.
    fn paged_kv_entry_points(&self) -> bool {
        true
    }

    /// Quantised K/V (SPEC 11) through the `_kvq` entry points (K and V widened to half in
    /// threadgroup memory as they are read).
    fn reads_quantised_kv(&self) -> bool {
        true
    }

    fn alloc(&self, bytes: usize) -> Result<Arc<dyn Memory>> {
        Ok(Arc::new(self.owned(bytes)?))
    }

    unsafe fn wrap_host(&self, ptr: *mut u8, bytes: usize) -> Result<Arc<dyn Memory>> {
        let page = self.api.page_size().max(1);
        if bytes > 0 && (ptr as usize).is_multiple_of(page) {
            // Metal wants whole pages; the last page is mapped since the region ends in it,
            // and no kernel reads past the region (the ops check every size).
            let whole = bytes.div_ceil(page) * page;
            // SAFETY: page-aligned address and length; the caller keeps the memory alive.
            if let Ok(buffer) = unsafe { self.api.new_buffer_no_copy(ptr, whole) } {
                let contents = self.api.contents(&buffer);
                return Ok(Arc::new(MetalMemory::<A> {
                    buffer,
                    storage: Storage::NoCopy,
                    host: ptr,
                    contents,
                    len: bytes,
                }));
            }
        }
        let mut m = self.owned(bytes)?;
        m.storage = Storage::Staged;
        m.host = ptr;
        Ok(Arc::new(m))
    }

    fn compile(&self, name: &str, source: &KernelSource) -> Result<Pipeline> {
        let file = source.metal.ok_or_else(|| MlxError::KernelNotFound(format!("kernel {name} has no Metal form")))?;
        let library = self.library(name, file.text)?;
        let function = super::function_of(name);
        let info = self.api.new_pipeline(&library, function).map_err(|e| match e {
            PipelineError::NoFunction => {
                MlxError::KernelNotFound(format!("the Metal source of {name} has no function of that name"))
            }
            PipelineError::Failed(message) => MlxError::ShaderCompilationError { name: name.to_string(), message },
        })?;
        Ok(Pipeline::new(
            name,
            info.max_total_threads_per_threadgroup,
            Arc::new(MetalPipeline::<A> {
                pipeline: info.pipeline,
                thread_execution_width: info.thread_execution_width,
            }),
        ))
    }

    fn execute(&self, dispatches: &[Dispatch]) -> Result<()> {
        // Everything is checked and the commands are built before anything runs: a refused
        // dispatch leaves every buffer as it was.
        let mut commands: Vec<Command<'_, A>> = Vec::new();
        let mut staged: Vec<&MetalMemory<A>> = Vec::new();
        let max_tg_memory = self.api.max_threadgroup_memory_length();
        for d in dispatches {
            let name = d.pipeline.name();
            let state = d.pipeline.inner::<MetalPipeline<A>>().ok_or_else(|| {
                MlxError::InvalidArgument(format!("pipeline {name} was not built by the Metal backend"))
            })?;
            let threads = d.threadgroup.count();
            let max_threads = d.pipeline.max_total_threads_per_threadgroup();
            if threads == 0 || threads > max_threads {
                return Err(MlxError::InvalidArgument(format!(
                    "{name}: a threadgroup of {}x{}x{} threads; the pipeline allows 1 to {max_threads}",
                    d.threadgroup.width, d.threadgroup.height, d.threadgroup.depth
                )));
            }
            let mut tg_total = 0u64;
            for &(index, bytes) in &d.shared {
                if index > MAX_ARGUMENT_INDEX || bytes % THREADGROUP_MEMORY_GRANULE != 0 {
                    return Err(MlxError::InvalidArgument(format!(
                        "{name}: threadgroup memory {index} of {bytes} bytes (index 0..={MAX_ARGUMENT_INDEX}, \
                         length a multiple of {THREADGROUP_MEMORY_GRANULE})"
                    )));
                }
                tg_total = tg_total.saturating_add(bytes);
            }
            if tg_total > max_tg_memory {
                return Err(MlxError::InvalidArgument(format!(
                    "{name}: {tg_total} bytes of threadgroup memory exceed the device's {max_tg_memory}"
                )));
            }
            commands.push(Command::SetPipeline(&state.pipeline));
            for (index, arg) in &d.args {
                let index = *index;
                if index > MAX_ARGUMENT_INDEX {
                    return Err(MlxError::InvalidArgument(format!(
                        "{name}: argument index {index} is past {MAX_ARGUMENT_INDEX}"
                    )));
                }
                match arg {
                    BoundArg::Bytes(bytes) => {
                        if bytes.is_empty() || bytes.len() > MAX_SET_BYTES {
                            return Err(MlxError::InvalidArgument(format!(
                                "{name}: a constant block of {} bytes at index {index} (1 to {MAX_SET_BYTES})",
                                bytes.len()
                            )));
                        }
                        commands.push(Command::SetBytes { index, bytes });
                    }
                    BoundArg::Buffer(b) => {
                        let mem = self.metal_memory(d, index, b)?;
                        if mem.storage == Storage::Staged && !staged.iter().any(|m| std::ptr::eq(*m, mem)) {
                            staged.push(mem);
                        }
                        commands.push(Command::SetBuffer { index, buffer: &mem.buffer, offset: b.byte_offset as u64 });
                    }
                }
            }
            for &(index, bytes) in &d.shared {
                commands.push(Command::SetThreadgroupMemoryLength { index, bytes });
            }
            if d.grid.count() > 0 {
                commands.push(Command::DispatchThreadgroups { grid: d.grid, threadgroup: d.threadgroup });
            }
        }
        for m in &staged {
            // SAFETY: both regions hold `len` bytes (the wrap_host contract, and the buffer).
            unsafe { std::ptr::copy_nonoverlapping(m.host, m.contents, m.len) };
        }
        self.api.run(&commands).map_err(|message| {
            let names: Vec<&str> = dispatches.iter().map(|d| d.pipeline.name()).collect();
            MlxError::CommandBufferError(format!("{}: {message}", names.join(", ")))
        })?;
        for m in &staged {
            // SAFETY: as above; the command buffer has completed.
            unsafe { std::ptr::copy_nonoverlapping(m.contents, m.host, m.len) };
        }
        Ok(())
    }
}
