//! Running the kernels' items on an OpenMP runtime that is already in the process: PyTorch's
//! `libgomp` (or an Intel `libiomp5` / LLVM `libomp`, which speak the same GOMP entry
//! points). After each of its operators PyTorch's OpenMP workers spin, waiting for the next
//! one, for milliseconds; a pool of our own beside them fights them for the cores (a run of
//! small calls among torch ops was many times slower than with `OMP_WAIT_POLICY=PASSIVE`).
//! Handing our items to those very threads (`GOMP_parallel`, the caller included, as
//! PyTorch's own `parallel_for` does) has no one to fight.
//!
//! The runtime is found in `/proc/self/maps` (an object whose file name holds `libgomp`,
//! `libiomp5` or `libomp`) and opened with `RTLD_NOLOAD`, so nothing is loaded that was not
//! there. Linux only; elsewhere, or where none is loaded, the kernels keep the library's
//! own pool.

use std::ffi::{c_int, c_uint, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// The entry points used, resolved from the loaded runtime.
pub struct OpenMp {
    parallel: unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void, c_uint, c_uint),
    in_parallel: unsafe extern "C" fn() -> c_int,
    /// The file it was found in, for the report.
    pub path: String,
    /// Keeps the handle (the runtime stays loaded: it was loaded before us).
    _lib: libloading::Library,
}

// SAFETY: function pointers of a thread-safe runtime, and a library handle.
unsafe impl Send for OpenMp {}
unsafe impl Sync for OpenMp {}

/// The OpenMP runtime loaded in this process, if any.
#[cfg(target_os = "linux")]
pub fn find() -> Option<OpenMp> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let path = maps.lines().filter_map(|l| l.split_whitespace().nth(5)).find(|p| {
        let name = p.rsplit('/').next().unwrap_or("");
        name.starts_with("libgomp") || name.starts_with("libiomp5") || name.starts_with("libomp")
    })?;
    // SAFETY: RTLD_NOLOAD opens only an object already loaded (its initialisers have run).
    let lib = unsafe { libloading::os::unix::Library::open(Some(path), libc::RTLD_NOLOAD | libc::RTLD_LAZY) }.ok()?;
    let lib: libloading::Library = lib.into();
    // SAFETY: the GOMP ABI's signatures (GCC's libgomp.map, exported alike by libiomp5 and libomp).
    unsafe {
        let parallel = *lib.get(b"GOMP_parallel\0").ok()?;
        let in_parallel = *lib.get(b"omp_in_parallel\0").ok()?;
        Some(OpenMp { parallel, in_parallel, path: path.to_string(), _lib: lib })
    }
}

#[cfg(not(target_os = "linux"))]
pub fn find() -> Option<OpenMp> {
    None
}

/// What the threads of one parallel region share.
struct Job<'a> {
    next: AtomicUsize,
    n: usize,
    f: &'a (dyn Fn(usize) + Sync),
    panicked: AtomicBool,
}

extern "C" fn run_items(data: *mut c_void) {
    // SAFETY: `data` is the `Job` that `for_each` keeps alive until GOMP_parallel returns.
    let job = unsafe { &*(data as *const Job<'_>) };
    // Items are taken one at a time from a shared counter (the caller's thread among them), so
    // a thread that starts late finds the rest done rather than a share waiting for it.
    let r = catch_unwind(AssertUnwindSafe(|| loop {
        let i = job.next.fetch_add(1, Ordering::Relaxed);
        if i >= job.n {
            break;
        }
        (job.f)(i);
    }));
    if r.is_err() {
        // No unwinding through the runtime's frames: stop the others and say so after.
        job.panicked.store(true, Ordering::Relaxed);
        job.next.store(job.n, Ordering::Relaxed);
    }
}

impl OpenMp {
    /// Whether the calling thread is inside a parallel region of this runtime (then a nested
    /// region would run on this thread alone: the caller's pool serves better).
    pub fn in_parallel(&self) -> bool {
        // SAFETY: no arguments, no preconditions.
        unsafe { (self.in_parallel)() != 0 }
    }

    /// `f(i)` for every `i < n` on `threads` of the runtime's threads, the caller's among
    /// them. Returns false where `f` panicked (the rest of the items were then skipped).
    pub fn for_each(&self, n: usize, threads: usize, f: &(dyn Fn(usize) + Sync)) -> bool {
        let job = Job { next: AtomicUsize::new(0), n, f, panicked: AtomicBool::new(false) };
        let threads = threads.clamp(1, n.max(1)) as c_uint;
        // SAFETY: `run_items` reads `job`, which outlives the region (GOMP_parallel returns
        // once every thread of the team is done); flags 0.
        unsafe { (self.parallel)(run_items, &job as *const Job<'_> as *mut c_void, threads, 0) };
        !job.panicked.load(Ordering::Relaxed)
    }
}
