//! The CPU backend's own allocations go back to the allocator when their buffers drop, and
//! an empty one frees nothing: a counting global allocator watches the bytes this test
//! binary holds (its only test, so no other test allocates meanwhile).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, AtomicUsize, Ordering};

use mlx_native::backend::cpu::memory::HostMemory;
use mlx_native::{DType, MlxDevice};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);
static NULL_FREES: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is passed to the system allocator unchanged; the counters are atomics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::SeqCst);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::SeqCst);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if ptr.is_null() {
            // Freeing a null pointer breaks GlobalAlloc's contract (and the system allocator
            // would hide it): count it for the test to see.
            NULL_FREES.fetch_add(1, Ordering::SeqCst);
            return;
        }
        LIVE.fetch_sub(layout.size() as isize, Ordering::SeqCst);
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[test]
fn host_buffers_give_their_memory_back_and_empty_ones_free_nothing() {
    const BYTES: usize = 64 << 20;
    let dev = MlxDevice::cpu();
    let _warm = dev.alloc_buffer(DType::F32, &[4]).unwrap(); // lazily made state, if any
    let before = LIVE.load(Ordering::SeqCst);
    for _ in 0..4 {
        let buf = dev.alloc_buffer(DType::F32, &[BYTES / 4]).unwrap();
        let held = LIVE.load(Ordering::SeqCst) - before;
        assert!(held >= BYTES as isize, "a {BYTES}-byte buffer holds {held} bytes");
        drop(buf);
        let left = LIVE.load(Ordering::SeqCst) - before;
        assert!(left < (1 << 20), "{left} bytes still held after the buffer dropped");
    }
    for len in [0usize, 1, 63, 64, 65, 4096] {
        let m = HostMemory::zeroed(len).unwrap();
        drop(m);
        let left = LIVE.load(Ordering::SeqCst) - before;
        assert!(left < (1 << 20), "{left} bytes still held after a {len}-byte block dropped");
    }
    let empty = dev.alloc_buffer(DType::F16, &[0]).unwrap();
    drop(empty);
    assert_eq!(NULL_FREES.load(Ordering::SeqCst), 0, "an empty block was freed through a null pointer");
}
