//! The CPU backend: always present. A kernel is a Rust function that runs a whole dispatch,
//! spreading its tiles over the library's thread pool (`pool`: rayon, every core unless the
//! caller sets a number) with SIMD inner loops chosen at run time.
//! Each op's host file (`flash_attn_prefill.rs`, `flash_attn_prefill_tensor.rs`,
//! `flash_attn_prefill_blk.rs`) lists its kernels by name in a `KERNELS` table; [`kernel`]
//! looks a name up in all of them. The attention of both prefill ops is one kernel body,
//! `prefill_tile.rs` (the origin's kernels are the general one with a fixed layout).

use std::sync::{Arc, OnceLock};

use crate::error::{MlxError, Result};
use crate::interface::{
    Backend, BackendKind, BufferBinding, Choices, Dispatch, KernelSource, Memory, Pipeline, RunOptions,
};

pub mod amx;
pub mod flash_attn_prefill;
pub mod flash_attn_prefill_blk;
pub mod flash_attn_prefill_tensor;
pub mod memory;
mod openmp;
pub mod peak;
pub mod pool;
mod prefill_tile;
pub mod simd;

pub use memory::{HostMemory, WrappedHostMemory};

/// The CPU form of a kernel: runs one whole dispatch.
pub type CpuKernelFn = fn(&Dispatch) -> Result<()>;

/// The CPU form of the kernel `name`, from the op host files' tables.
pub fn kernel(name: &str) -> Option<CpuKernelFn> {
    flash_attn_prefill::KERNELS
        .iter()
        .chain(flash_attn_prefill_tensor::KERNELS)
        .chain(flash_attn_prefill_blk::KERNELS)
        .find(|(n, _)| *n == name)
        .map(|(_, f)| *f)
}

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

/// The instruction set a dispatch with `options` runs on: its plan's `cpu_isa` (checked
/// against [`simd::forceable_isas`] when the options were made), else [`simd::selected_isa`].
pub fn isa_of(options: &RunOptions) -> &'static str {
    options.cpu_isa.unwrap_or_else(simd::selected_isa)
}

/// Threads the kernels use.
pub fn threads() -> usize {
    pool::threads()
}

impl Backend for CpuBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cpu
    }

    fn description(&self) -> String {
        format!("cpu ({} threads, {})", threads(), simd::selected_isa())
    }

    fn reads_quantised_kv(&self) -> bool {
        true // `prefill_tile::pages` dequantises each step's rows to f32 as it loads them
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
        Ok(Arc::new(WrappedHostMemory::new(ptr, bytes)))
    }

    fn compile(&self, name: &str, _source: &KernelSource) -> Result<Pipeline> {
        let kernel =
            kernel(name).ok_or_else(|| MlxError::KernelNotFound(format!("kernel {name} has no CPU implementation")))?;
        Ok(Pipeline::new(name, 1024, Arc::new(CpuPipeline { kernel })))
    }

    fn choices(&self, kernel_name: &str, params: &[u8], options: &RunOptions) -> Choices {
        let _ = (kernel_name, params);
        Choices { workspace: 0, report: vec![("form", "cpu".into()), ("isa", isa_of(options).into())] }
    }

    fn execute(&self, dispatches: &[Dispatch]) -> Result<()> {
        let mut kernels = Vec::with_capacity(dispatches.len());
        for d in dispatches {
            let state = d.pipeline.inner::<CpuPipeline>().ok_or_else(|| {
                MlxError::InvalidArgument(format!("pipeline {} was not built by the CPU backend", d.pipeline.name()))
            })?;
            kernels.push(state.kernel);
        }
        // Each kernel spreads its items with `pool::for_each` (the library's pool, or the
        // caller's thread for a small job), never through rayon's global pool.
        dispatches.iter().zip(kernels).try_for_each(|(d, kernel)| kernel(d))
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

/// Host address of a recorded dispatch's buffer, for a CPU kernel (its length was checked by
/// the op's decoder, `crate::recorded`).
pub(crate) fn host_ptr(b: &BufferBinding) -> Result<*mut u8> {
    b.host_ptr().ok_or_else(|| {
        MlxError::InvalidArgument(format!("a {}-byte buffer of the dispatch is not in host memory", b.byte_len))
    })
}

/// A raw pointer that may cross threads; the kernels write disjoint ranges through it.
#[derive(Clone, Copy)]
pub(crate) struct SendPtr<T>(pub *mut T);
// SAFETY: see the type's comment; every use writes a range no other task touches.
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

#[cfg(test)]
mod tests {
    use super::*;

    /// The thread count the kernels and the description report is the pool's the kernels
    /// run on, and the description names it and the instruction set in use.
    #[test]
    fn the_description_names_the_kernels_threads_and_instruction_set() {
        let _serial = pool::TEST_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        assert_eq!(threads(), pool::run(rayon::current_num_threads).unwrap());
        assert!(threads() >= 1);
        let d = CpuBackend::new().description();
        assert_eq!(d, format!("cpu ({} threads, {})", threads(), simd::selected_isa()));
    }
}
