//! The Metal backend (Apple GPUs): shared-storage buffers, the `.metal` sources of
//! `shaders/` compiled at run time, one command buffer per commit.
//!
//! Three layers, so that all the logic is built and tested on every platform:
//! - [`api::MetalApi`]: the few Metal calls the backend makes, as a trait;
//! - [`backend::MetalBackend`]: the [`Backend`](crate::backend::Backend) over any `MetalApi`
//!   (compiled everywhere, tested against a recording fake);
//! - `objc::ObjcMetal`: the `MetalApi` over `objc2-metal`, compiled on macOS only.
//!
//! See `docs/metal.md` for what has and has not been run on Apple hardware.

use std::sync::Arc;

use crate::error::{MlxError, Result};
use crate::interface::Backend;

pub mod api;
pub mod backend;
#[cfg(test)]
mod fake;
pub mod flash_attn_prefill;
pub mod flash_attn_prefill_blk;
pub mod flash_attn_prefill_tensor;
#[cfg(target_os = "macos")]
mod objc;
#[cfg(test)]
mod tests;

pub use api::MetalApi;
pub use backend::MetalBackend;

/// How the Metal backend runs one named kernel: the MSL function of the op's source that
/// implements it, dispatched with the grid, threadgroup and threadgroup memory the op
/// encoded (the Metal kernels are the origin's: the ops encode their geometry).
pub struct MetalKernel {
    pub name: &'static str,
    pub function: &'static str,
}

/// The MSL function of the kernel `name`, from the op host files' tables (a kernel no
/// table names is looked up by its own name).
pub fn function_of(name: &str) -> &str {
    flash_attn_prefill_tensor::KERNELS
        .iter()
        .chain(flash_attn_prefill_blk::KERNELS)
        .chain(flash_attn_prefill::KERNELS)
        .find(|k| k.name == name)
        .map_or(name, |k| k.function)
}

/// Whether a Metal device exists here (always false off macOS).
pub fn is_present() -> bool {
    #[cfg(target_os = "macos")]
    {
        objc::ObjcMetal::system_default().is_some()
    }
    #[cfg(not(target_os = "macos"))]
    {
        false
    }
}

/// The system's default Metal device.
pub fn open() -> Result<Arc<dyn Backend>> {
    #[cfg(target_os = "macos")]
    {
        match objc::ObjcMetal::system_default() {
            Some(api) => Ok(Arc::new(MetalBackend::new(api))),
            None => Err(MlxError::DeviceNotFound("no Metal device on this Mac".into())),
        }
    }
    #[cfg(not(target_os = "macos"))]
    {
        Err(MlxError::BackendUnavailable("the metal backend needs macOS (this build is for another system)".into()))
    }
}
