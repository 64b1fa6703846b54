//! mlx-native: flash attention for LLM prefill in the layouts llama.cpp and hf2q use
//! (F32 Q, F16 K/V with explicit strides, grouped-query heads, an additive F16 mask shared
//! by all heads, a tile-skip table), on a CPU backend everywhere, CUDA on NVIDIA GPUs and
//! Metal on Apple Silicon.
//!
//! Layers (see `DESIGN.md` of the project): [`ops`] validate and encode named kernels;
//! the runtime ([`device`], [`buffer`], [`encoder`], [`kernel_registry`]) hands them to a
//! [`backend`]; [`ffi`] is the only place that speaks C.

pub mod backend;
pub mod buffer;
pub mod device;
pub mod dtypes;
pub mod encoder;
pub mod error;
pub mod ffi;
pub mod kernel_registry;
pub mod ops;

pub use buffer::MlxBuffer;
pub use device::MlxDevice;
pub use dtypes::DType;
pub use encoder::{as_bytes, CommandEncoder, GridSize, KernelArg};
pub use error::{MlxError, Result};
pub use kernel_registry::{KernelRegistry, KernelSource};

/// The library version (the crate's).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// A registry with every op of the library registered.
pub fn default_registry() -> KernelRegistry {
    let mut registry = KernelRegistry::new();
    ops::register_all(&mut registry);
    registry
}
