//! Kernel sources by name, and the pipelines built from them, cached per device.

use std::any::Any;
use std::collections::HashMap;
use std::sync::Arc;

use crate::device::MlxDevice;
use crate::encoder::Dispatch;
use crate::error::{MlxError, Result};

/// The CPU form of a kernel: runs one whole dispatch.
pub type CpuKernelFn = fn(&Dispatch) -> Result<()>;

/// A kernel in each of its forms. A backend takes the form it can run; a kernel without
/// that form is [`MlxError::KernelNotFound`] there.
#[derive(Clone, Copy)]
pub struct KernelSource {
    /// Metal Shading Language source (all entry points of one file).
    pub metal: Option<&'static str>,
    /// CUDA C++ source (all entry points of one file).
    pub cuda: Option<&'static str>,
    /// The CPU implementation.
    pub cpu: Option<CpuKernelFn>,
}

/// A compiled kernel, ready to dispatch on one device.
#[derive(Clone)]
pub struct Pipeline {
    name: Arc<str>,
    max_threads: u64,
    inner: Arc<dyn Any + Send + Sync>,
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pipeline({})", self.name)
    }
}

impl Pipeline {
    /// A pipeline whose backend-specific state is `inner`.
    pub fn new(name: &str, max_threads: u64, inner: Arc<dyn Any + Send + Sync>) -> Self {
        Pipeline { name: name.into(), max_threads, inner }
    }
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The most threads one threadgroup of this pipeline may have.
    pub fn max_total_threads_per_threadgroup(&self) -> u64 {
        self.max_threads
    }
    /// The backend's own state, if it is a `T`.
    pub fn inner<T: 'static>(&self) -> Option<&T> {
        self.inner.downcast_ref::<T>()
    }
}

/// Outcome of [`KernelRegistry::probe_optional_pipeline`].
#[derive(Debug, Clone, PartialEq)]
pub struct PipelineProbe {
    pub available: bool,
    /// Why not, when not available.
    pub reason: Option<String>,
}

/// Named kernel sources and a per-device cache of their pipelines.
#[derive(Default)]
pub struct KernelRegistry {
    sources: HashMap<String, KernelSource>,
    pipelines: HashMap<(u64, String), Pipeline>,
    probes: HashMap<(u64, String), PipelineProbe>,
}

impl KernelRegistry {
    pub fn new() -> Self {
        Self::default()
    }

    /// Register (or replace) the source of kernel `name`.
    pub fn register_source(&mut self, name: &str, source: KernelSource) {
        self.sources.insert(name.to_string(), source);
        self.pipelines.retain(|(_, n), _| n != name);
        self.probes.retain(|(_, n), _| n != name);
    }

    /// Whether `name` has a registered source.
    pub fn has_source(&self, name: &str) -> bool {
        self.sources.contains_key(name)
    }

    /// The pipeline of `name` on `device`, compiled on first use and cached.
    pub fn get_pipeline(&mut self, name: &str, device: &MlxDevice) -> Result<&Pipeline> {
        let key = (device.registry_id(), name.to_string());
        if !self.pipelines.contains_key(&key) {
            let source = self
                .sources
                .get(name)
                .ok_or_else(|| MlxError::KernelNotFound(format!("no kernel named {name} is registered")))?;
            let pipeline = device.backend().compile(name, source)?;
            self.pipelines.insert(key.clone(), pipeline);
        }
        Ok(&self.pipelines[&key])
    }

    /// Try to build `name` on `device`. A failure that `classifier` recognises as "this
    /// device or toolchain lacks the feature" is `available: false`; any other failure is
    /// an error. The outcome is cached under `registry_id`.
    pub fn probe_optional_pipeline(
        &mut self,
        name: &str,
        device: &MlxDevice,
        registry_id: u64,
        classifier: fn(&MlxError) -> bool,
    ) -> Result<PipelineProbe> {
        let key = (registry_id, name.to_string());
        if let Some(p) = self.probes.get(&key) {
            return Ok(p.clone());
        }
        let probe = match self.get_pipeline(name, device) {
            Ok(_) => PipelineProbe { available: true, reason: None },
            Err(e) if classifier(&e) => PipelineProbe { available: false, reason: Some(e.to_string()) },
            Err(e) => return Err(e),
        };
        self.probes.insert(key, probe.clone());
        Ok(probe)
    }
}
