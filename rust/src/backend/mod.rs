//! How each kernel runs on each kind of device: one folder per backend, one host file per
//! op in each (`cpu/<op>.rs`, `cuda/<op>.rs`, `metal/<op>.rs`, as MLX lays out its
//! backends), each keeping its own table from kernel name to its form. The runtime talks
//! to a backend only through the [`Backend`] and [`Memory`] traits of
//! [`crate::interface`]; a backend reads the params blocks of [`crate::params`] and
//! nothing else above it.

use std::sync::Arc;

use crate::error::{MlxError, Result};
pub use crate::interface::{Backend, BackendKind, Memory};

pub mod cpu;
pub mod cuda;
pub mod metal;

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
        n if n == "cuda" || n.starts_with("cuda:") => Ok(Arc::new(cuda::CudaBackend::open(cuda::parse_name(n)?)?)),
        other => Err(MlxError::DeviceNotFound(format!(
            "unknown backend {other:?} (expected one of auto, cpu, cuda, cuda:N, metal)"
        ))),
    }
}
