//! Kernel sources by name, and the pipelines built from them, cached per device.

use std::collections::HashMap;

use crate::device::MlxDevice;
use crate::error::{MlxError, Result};
pub use crate::interface::{KernelSource, Pipeline, SourceFile};

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

    /// The names of every registered kernel, sorted.
    pub fn kernel_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.sources.keys().map(String::as_str).collect();
        names.sort();
        names
    }

    /// The CUDA source file of kernel `name`, if it has one.
    pub fn cuda_source_of(&self, name: &str) -> Option<SourceFile> {
        self.sources.get(name).and_then(|s| s.cuda)
    }

    /// Whether kernel `name` has a Metal source.
    pub fn has_metal_source(&self, name: &str) -> bool {
        self.sources.get(name).is_some_and(|s| s.metal.is_some())
    }

    /// Every distinct CUDA source file of the registered kernels, by file name.
    pub fn cuda_sources(&self) -> Vec<SourceFile> {
        let mut files: Vec<SourceFile> = self.sources.values().filter_map(|s| s.cuda).collect();
        files.sort_by_key(|f| f.name);
        files.dedup_by_key(|f| f.name);
        files
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
