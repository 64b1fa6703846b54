//! A recording fake of [`MetalApi`] for the tests: buffers are host memory, a "library" is the
//! list of entry points found in the source ([`entry_points`]), and `run` records the
//! commands (and can stand in for a kernel by writing buffers, or fail).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use super::api::{Command, MetalApi, PipelineError, PipelineInfo};
use crate::interface::GridSize;

/// A command as recorded: buffers by id, bytes copied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recorded {
    SetPipeline(String),
    SetBytes { index: u64, bytes: Vec<u8> },
    SetBuffer { index: u64, buffer: usize, offset: u64 },
    SetThreadgroupMemoryLength { index: u64, bytes: u64 },
    DispatchThreadgroups { grid: GridSize, threadgroup: GridSize },
}

pub struct FakeBuffer {
    pub id: usize,
    /// Memory the fake owns (`new_buffer`), or none for a no-copy buffer.
    owned: Option<Box<[u8]>>,
    contents: *mut u8,
    pub len: usize,
    pub no_copy: bool,
}
// SAFETY: test memory; the backend orders access.
unsafe impl Send for FakeBuffer {}
unsafe impl Sync for FakeBuffer {}

pub struct FakeLibrary {
    pub functions: Vec<String>,
}

#[derive(Debug)]
pub struct FakePipeline {
    pub name: String,
}

/// What `run` does besides recording: stand in for the kernels by writing `byte` over the
/// buffer bound at `index`.
#[derive(Clone, Copy)]
pub struct FillOnRun {
    pub index: u64,
    pub byte: u8,
}

pub struct FakeMetal {
    pub max_threads: u64,
    pub max_threadgroup_memory: u64,
    pub page: usize,
    /// `compile_library` fails with this message when the source contains the needle.
    pub compile_error: Mutex<Option<(String, String)>>,
    pub fail_run: Mutex<Option<String>>,
    pub fail_alloc: Mutex<bool>,
    pub fill_on_run: Mutex<Option<FillOnRun>>,
    pub compiles: AtomicUsize,
    pub pipelines: AtomicUsize,
    pub runs: Mutex<Vec<Vec<Recorded>>>,
    /// Buffers by id: contents pointer and length (for `fill_on_run` and the tests).
    pub buffers: Mutex<HashMap<usize, (usize, usize)>>,
    next_id: AtomicUsize,
}

impl FakeMetal {
    pub fn new() -> Self {
        FakeMetal {
            max_threads: 1024,
            max_threadgroup_memory: 32 * 1024,
            page: 16384,
            compile_error: Mutex::new(None),
            fail_run: Mutex::new(None),
            fail_alloc: Mutex::new(false),
            fill_on_run: Mutex::new(None),
            compiles: AtomicUsize::new(0),
            pipelines: AtomicUsize::new(0),
            runs: Mutex::new(Vec::new()),
            buffers: Mutex::new(HashMap::new()),
            next_id: AtomicUsize::new(1),
        }
    }

    fn register(&self, contents: *mut u8, len: usize) -> usize {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.buffers.lock().unwrap().insert(id, (contents as usize, len));
        id
    }

    /// The last recorded command buffer.
    pub fn last_run(&self) -> Vec<Recorded> {
        self.runs.lock().unwrap().last().cloned().unwrap_or_default()
    }
}

impl MetalApi for FakeMetal {
    type Buffer = FakeBuffer;
    type Library = FakeLibrary;
    type Pipeline = FakePipeline;

    fn name(&self) -> String {
        "Fake GPU".into()
    }
    fn max_threadgroup_memory_length(&self) -> u64 {
        self.max_threadgroup_memory
    }
    fn page_size(&self) -> usize {
        self.page
    }

    fn new_buffer(&self, bytes: usize) -> Result<FakeBuffer, String> {
        assert!(bytes > 0, "Metal has no empty buffers");
        if *self.fail_alloc.lock().unwrap() {
            return Err("out of memory".into());
        }
        // Not zeroed: Metal does not promise zeroed contents.
        let mut owned = vec![0xA5u8; bytes].into_boxed_slice();
        let contents = owned.as_mut_ptr();
        let id = self.register(contents, bytes);
        Ok(FakeBuffer { id, owned: Some(owned), contents, len: bytes, no_copy: false })
    }

    unsafe fn new_buffer_no_copy(&self, ptr: *mut u8, bytes: usize) -> Result<FakeBuffer, String> {
        assert!(
            bytes > 0 && (ptr as usize).is_multiple_of(self.page) && bytes.is_multiple_of(self.page),
            "no-copy needs whole pages"
        );
        let id = self.register(ptr, bytes);
        Ok(FakeBuffer { id, owned: None, contents: ptr, len: bytes, no_copy: true })
    }

    fn contents(&self, buffer: &FakeBuffer) -> *mut u8 {
        let _ = &buffer.owned;
        buffer.contents
    }

    fn compile_library(&self, source: &str) -> Result<FakeLibrary, String> {
        self.compiles.fetch_add(1, Ordering::Relaxed);
        if let Some((needle, message)) = self.compile_error.lock().unwrap().as_ref() {
            if source.contains(needle.as_str()) {
                return Err(message.clone());
            }
        }
        Ok(FakeLibrary { functions: entry_points(source) })
    }

    fn new_pipeline(&self, library: &FakeLibrary, function: &str) -> Result<PipelineInfo<FakePipeline>, PipelineError> {
        if !library.functions.iter().any(|f| f == function) {
            return Err(PipelineError::NoFunction);
        }
        self.pipelines.fetch_add(1, Ordering::Relaxed);
        Ok(PipelineInfo {
            pipeline: FakePipeline { name: function.to_string() },
            max_total_threads_per_threadgroup: self.max_threads,
            thread_execution_width: 32,
        })
    }

    fn run(&self, commands: &[Command<'_, Self>]) -> Result<(), String> {
        let recorded: Vec<Recorded> = commands
            .iter()
            .map(|c| match c {
                Command::SetPipeline(p) => Recorded::SetPipeline(p.name.clone()),
                Command::SetBytes { index, bytes } => Recorded::SetBytes { index: *index, bytes: bytes.to_vec() },
                Command::SetBuffer { index, buffer, offset } => {
                    Recorded::SetBuffer { index: *index, buffer: buffer.id, offset: *offset }
                }
                Command::SetThreadgroupMemoryLength { index, bytes } => {
                    Recorded::SetThreadgroupMemoryLength { index: *index, bytes: *bytes }
                }
                Command::DispatchThreadgroups { grid, threadgroup } => {
                    Recorded::DispatchThreadgroups { grid: *grid, threadgroup: *threadgroup }
                }
            })
            .collect();
        self.runs.lock().unwrap().push(recorded);
        if let Some(message) = self.fail_run.lock().unwrap().clone() {
            return Err(message);
        }
        if let Some(fill) = *self.fill_on_run.lock().unwrap() {
            for c in commands {
                if let Command::SetBuffer { index, buffer, offset } = c {
                    if *index == fill.index {
                        // SAFETY: the buffer holds `len` bytes at `contents`.
                        unsafe {
                            std::ptr::write_bytes(
                                buffer.contents.add(*offset as usize),
                                fill.byte,
                                buffer.len - *offset as usize,
                            )
                        };
                    }
                }
            }
        }
        Ok(())
    }
}

/// The entry points of a Metal source, as the emulator finds them (`tests/metal_emu`'s
/// `entry_points`): each `kernel void NAME(`, and for an instantiation macro `M` whose body
/// declares `kernel void PREFIX##SUFFIX(` (SUFFIX its first parameter), each line
/// `M(x, ...)` as `PREFIX` + `x`. Comment lines are skipped.
pub fn entry_points(source: &str) -> Vec<String> {
    let is_name = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    let (mut names, mut macros) = (Vec::new(), Vec::new());
    // The macro whose definition the current line continues.
    let mut defining: Option<String> = None;
    for line in source.lines() {
        let t = line.trim_start();
        if t.starts_with("//") {
            continue;
        }
        if let Some(def) = t.strip_prefix("#define ") {
            defining = def.split_once('(').map(|(m, _)| m.trim().to_string());
        }
        if let Some(rest) = t.split("kernel void ").nth(1) {
            let name = rest.split('(').next().unwrap_or("").trim();
            match (name.split_once("##"), &defining) {
                (Some((prefix, _)), Some(m)) => macros.push((m.clone(), prefix.trim().to_string())),
                (None, _) if is_name(name) => names.push(name.to_string()),
                _ => {}
            }
        }
        if !t.ends_with('\\') {
            defining = None;
        }
    }
    for line in source.lines() {
        for (m, prefix) in &macros {
            let args = line.trim_start().strip_prefix(m.as_str()).and_then(|r| r.trim_start().strip_prefix('('));
            if let Some(suffix) = args.and_then(|a| a.split(',').next()).map(str::trim).filter(|s| is_name(s)) {
                names.push(format!("{prefix}{suffix}"));
            }
        }
    }
    names
}
