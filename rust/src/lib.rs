//! mlx-native: flash attention for LLM prefill in the layouts llama.cpp and hf2q use
//! (F32 Q, F16 K/V with explicit strides, grouped-query heads, an additive F16 mask shared
//! by all heads, a tile-skip table), on a CPU backend everywhere, CUDA on NVIDIA GPUs and
//! Metal on Apple Silicon.
//!
//! Layers, from the top (the README's Layout section draws them): [`ffi`] is the only
//! place that speaks C; [`ops`] validate and encode named kernels; the runtime
//! ([`device`], [`buffer`], [`encoder`], [`kernel_registry`]) hands their dispatches to a
//! [`backend`]; every layer stands on [`interface`], the leaf of value types and backend
//! traits, and the ops and backends share [`params`], the params blocks of the dispatches;
//! [`settings`] (the environment variables, read once) is a leaf the backends read, over
//! [`options`], the leaf of a plan's run options.
//! Nothing lower imports anything higher.

pub mod backend;
pub mod buffer;
pub mod device;
pub mod dtypes;
pub mod encoder;
pub mod error;
pub mod ffi;
pub mod interface;
pub mod kernel_registry;
pub mod ops;
pub mod options;
pub mod params;
pub mod recorded;
pub mod settings;

pub use buffer::MlxBuffer;
pub use device::MlxDevice;
pub use dtypes::DType;
pub use encoder::{as_bytes, CommandEncoder, GridSize, KernelArg};
pub use error::{MlxError, Result};
pub use interface::{KernelSource, SourceFile};
pub use kernel_registry::KernelRegistry;

/// The library version (the crate's).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// A registry with every op of the library registered.
pub fn default_registry() -> KernelRegistry {
    let mut registry = KernelRegistry::new();
    ops::register_all(&mut registry);
    registry
}

#[cfg(test)]
mod tests {
    /// The ops name their kernels; each backend keeps its own table of forms by name. A
    /// kernel an op registers and a backend's table lacks would be `KernelNotFound` there.
    /// The prefill op registers every head dim's kernels and refuses, when validating, those
    /// outside `REGISTERED_KERNELS` (the ones some backend of this build lacks).
    #[test]
    fn every_registered_kernel_has_a_form_in_every_backend() {
        use crate::ops::flash_attn_prefill::{
            F32_KV_KERNELS, HEAD_DIMS, PAGED_KERNELS, QUANT_KV_KERNELS, REGISTERED_KERNELS,
        };
        let registry = super::default_registry();
        let names = registry.kernel_names();
        assert_eq!(names.len(), 4 + 7 * HEAD_DIMS.len(), "{names:?}");
        for name in names {
            // Paged K/V's entry points: Metal's alone (elsewhere the kernel itself reads them).
            if PAGED_KERNELS.iter().any(|(_, n)| *n == name) {
                assert_eq!(crate::backend::metal::function_of(name), name, "{name}: no Metal function");
                continue;
            }
            // F32 K/V: the CPU's alone (CUDA and Metal callers convert K/V to F16 first); so far
            if F32_KV_KERNELS.iter().any(|(_, n)| *n == name) {
                assert!(crate::backend::cpu::kernel(name).is_some(), "{name}: no CPU form");
                continue;
            }
            // Quantised K/V (SPEC 11): every backend's, CUDA's in its F16 kernel's quant module.
            if QUANT_KV_KERNELS.iter().any(|(_, n)| *n == name) {
                assert!(crate::backend::cpu::kernel(name).is_some(), "{name}: no CPU form");
                assert!(crate::backend::cuda::kernel(name).is_some(), "{name}: no CUDA launcher");
                assert_eq!(crate::backend::metal::function_of(name), name, "{name}: no Metal function");
                continue;
            }
            let attention = HEAD_DIMS.iter().any(|(_, a, b)| *a == name || *b == name);
            assert!(crate::backend::cuda::kernel(name).is_some(), "{name}: no CUDA launcher");
            if attention && !REGISTERED_KERNELS.contains(&name) {
                continue;
            }
            assert!(crate::backend::cpu::kernel(name).is_some(), "{name}: no CPU form");
            assert_eq!(crate::backend::metal::function_of(name), name, "{name}: no Metal function");
        }
        assert!(crate::backend::cpu::kernel("no_such_kernel").is_none());
        assert!(crate::backend::cuda::kernel("no_such_kernel").is_none());
    }
}
