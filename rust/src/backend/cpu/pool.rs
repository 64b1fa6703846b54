//! The CPU kernels' threads: a rayon pool of the library's own (not rayon's global one),
//! made the first time a kernel runs, with the number [`set_threads`] gives, else
//! `RAYON_NUM_THREADS` (read once, by `settings`), else one thread per core the process may
//! use.
//!
//! After `fork()` the child has only the thread that forked: a pool made before the fork
//! would wait for ever for workers that do not exist there (Python's default start method
//! on Linux, DataLoader workers and pre-forking servers all fork). So the pool remembers the
//! process that made it, and a child makes its own the first time it runs a kernel. The
//! parent's pool is leaked in the child, never dropped: its threads and locks are not the
//! child's. The slot that holds the pool is guarded by a spin lock that `pthread_atfork`
//! holds across the fork, so a fork can never copy it half-updated or locked.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Once, OnceLock};

use rayon::ThreadPool;

use super::openmp::OpenMp;

use crate::error::{MlxError, Result};

/// Most threads [`set_threads`] takes.
pub const MAX_THREADS: usize = 1024;

/// The pool and the process that made it.
struct Slot {
    pid: u32,
    pool: Arc<ThreadPool>,
}

/// The slot, behind [`LOCK`]. A `static mut` rather than a `Mutex` so that the fork handlers
/// can take and release the lock from different callbacks.
static mut SLOT: Option<Slot> = None;
static LOCK: AtomicBool = AtomicBool::new(false);
/// The number [`set_threads`] gave (0: none).
static WANTED: AtomicUsize = AtomicUsize::new(0);

fn lock() {
    while LOCK.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
        std::hint::spin_loop();
    }
}

fn unlock() {
    LOCK.store(false, Ordering::Release);
}

/// Run `f` with the slot, under the lock.
fn with_slot<R>(f: impl FnOnce(&mut Option<Slot>) -> R) -> R {
    install_fork_handlers();
    lock();
    // SAFETY: the lock gives this thread the slot alone until `unlock`.
    let r = f(unsafe { &mut *std::ptr::addr_of_mut!(SLOT) });
    unlock();
    r
}

#[cfg(unix)]
fn install_fork_handlers() {
    static ONCE: Once = Once::new();
    extern "C" fn prepare() {
        lock();
    }
    extern "C" fn parent() {
        unlock();
    }
    extern "C" fn child() {
        // The child's only thread owns nothing of the parent's pool: it forgets it, and
        // the next kernel makes a pool of its own.
        // SAFETY: the lock is held (taken in `prepare` by this very thread).
        if let Some(old) = unsafe { (*std::ptr::addr_of_mut!(SLOT)).take() } {
            std::mem::forget(old);
        }
        unlock();
    }
    ONCE.call_once(|| {
        // SAFETY: three extern "C" functions with no arguments, as pthread_atfork takes.
        unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) };
    });
}

#[cfg(not(unix))]
fn install_fork_handlers() {}

/// The thread count a new pool gets: [`set_threads`]'s, `RAYON_NUM_THREADS`'s, else the
/// cores this process may run on.
fn wanted_threads() -> usize {
    match WANTED.load(Ordering::Relaxed) {
        0 => crate::settings::get()
            .cpu_threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
            .min(MAX_THREADS),
        n => n,
    }
}

/// The pool the kernels run on (made here the first time, and again after a fork or a
/// change of [`set_threads`]).
pub fn pool() -> Result<Arc<ThreadPool>> {
    let pid = std::process::id();
    let threads = wanted_threads();
    with_slot(|slot| {
        if let Some(s) = slot {
            if s.pid == pid && s.pool.current_num_threads() == threads {
                return Ok(s.pool.clone());
            }
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("mlx_native-cpu-{i}"))
            .build()
            .map_err(|e| MlxError::Internal(format!("cannot start {threads} CPU threads: {e}")))?;
        let pool = Arc::new(pool);
        // A pool replaced in the same process ends when its last run does (the Arc); one
        // of the parent's was taken out by the fork handler already.
        *slot = Some(Slot { pid, pool: pool.clone() });
        Ok(pool)
    })
}

/// Run `f` on the kernels' pool (its `par_iter`s spread over the pool's threads).
pub fn run<R: Send>(f: impl FnOnce() -> R + Send) -> Result<R> {
    Ok(pool()?.install(f))
}

/// Work (in FLOP, or bytes for a pass over memory) below which [`for_each`] runs on the
/// caller's thread alone: about a fifth of a millisecond of one core. Handing it to the pool
/// costs tens of microseconds where the cores are idle, and milliseconds where another
/// library's threads spin on them (PyTorch's OpenMP workers do after each of its ops: 64
/// small calls among torch ops took 2.6 s through the pool against 0.07 s with those threads
/// asleep, on this 2-core machine).
pub const SERIAL_WORK: u64 = 4_000_000;

/// `f(i)` for every `i < n`, on the pool's threads (or the process's OpenMP threads, see
/// [`use_openmp`]), each taking the next `i` in order as it finishes one, or on the caller's
/// alone when the whole job (`work`, see [`SERIAL_WORK`]) is small, there is one item, or
/// the pool has one thread.
pub fn for_each(n: usize, work: u64, f: impl Fn(usize) + Send + Sync) -> Result<()> {
    if n <= 1 || work < SERIAL_WORK || threads() == 1 {
        (0..n).for_each(f);
        return Ok(());
    }
    if let Some(omp) = openmp_here() {
        if !omp.for_each(n, threads(), &f) {
            return Err(MlxError::Internal("a CPU kernel's work item panicked on an OpenMP thread".into()));
        }
        return Ok(());
    }
    // Items taken one at a time from a shared counter, in their order (as on OpenMP's
    // threads): the caller orders them longest first where their work differs, and a thread
    // that finishes early takes the next rather than stealing half of another's share.
    let next = AtomicUsize::new(0);
    pool()?.broadcast(|_| loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        if i >= n {
            break;
        }
        f(i);
    });
    Ok(())
}

/// The process's OpenMP runtime and the process that found it.
static OPENMP: OnceLock<Option<(u32, OpenMp)>> = OnceLock::new();
static USE_OPENMP: AtomicBool = AtomicBool::new(false);

/// Run the kernels' parallel jobs on the OpenMP runtime already loaded in this process
/// (PyTorch's), or go back to the library's own pool. The torch operators ask for it: their
/// caller's OpenMP workers spin after each torch operator, and a second pool beside them
/// fights them for the cores. Returns whether such a runtime was found (if not, the pool
/// stays). A fork child goes back to the pool (OpenMP's threads do not survive a fork).
pub fn use_openmp(on: bool) -> bool {
    let found = on && OPENMP.get_or_init(|| super::openmp::find().map(|o| (std::process::id(), o))).is_some();
    USE_OPENMP.store(found, Ordering::Relaxed);
    found
}

/// The OpenMP runtime to run a job on now: asked for, found in this very process, and not
/// already inside one of its parallel regions.
fn openmp_here() -> Option<&'static OpenMp> {
    if !USE_OPENMP.load(Ordering::Relaxed) {
        return None;
    }
    let (pid, omp) = OPENMP.get()?.as_ref()?;
    (*pid == std::process::id() && !omp.in_parallel()).then_some(omp)
}

/// What runs the kernels' parallel jobs: `rayon`, or `openmp (<path>)`.
pub fn runtime() -> String {
    match openmp_here() {
        Some(o) => format!("openmp ({})", o.path),
        None => "rayon".into(),
    }
}

/// Make the kernels use `n` threads from the next run on (0: back to the default,
/// `RAYON_NUM_THREADS` or every core).
pub fn set_threads(n: usize) -> Result<()> {
    if n > MAX_THREADS {
        return Err(MlxError::InvalidArgument(format!(
            "threads must be at most {MAX_THREADS} (0: every core), got {n}"
        )));
    }
    WANTED.store(n, Ordering::Relaxed);
    Ok(())
}

/// The threads the next kernel runs on.
pub fn threads() -> usize {
    wanted_threads()
}

/// Held by the unit tests that change or read the thread count (they run side by side).
#[cfg(test)]
pub(crate) static TEST_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[cfg(test)]
mod tests {
    use super::*;

    /// The pool has the threads asked for, and runs the work on them.
    #[test]
    fn the_pool_follows_set_threads() {
        let _serial = TEST_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        set_threads(3).unwrap();
        assert_eq!(threads(), 3);
        let n = run(rayon::current_num_threads).unwrap();
        assert_eq!(n, 3);
        set_threads(0).unwrap();
        assert!(threads() >= 1);
        assert!(set_threads(MAX_THREADS + 1).is_err());
        assert_eq!(run(rayon::current_num_threads).unwrap(), threads());
    }

    /// Every index runs once; small jobs on the caller's thread, large ones on the pool's.
    #[test]
    fn for_each_runs_every_item_once_small_jobs_on_the_caller() {
        let _serial = TEST_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        set_threads(2).unwrap();
        let caller = std::thread::current().id();
        for (n, work, on_caller) in [(100, SERIAL_WORK - 1, true), (1, u64::MAX, true), (100, SERIAL_WORK, false)] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            let here = AtomicUsize::new(0);
            for_each(n, work, |i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
                if std::thread::current().id() == caller {
                    here.fetch_add(1, Ordering::Relaxed);
                }
            })
            .unwrap();
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            assert_eq!(here.load(Ordering::Relaxed) == n, on_caller, "n {n}, work {work}");
        }
        set_threads(0).unwrap();
    }
}
