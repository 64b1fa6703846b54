//! The C ABI as a C caller sees it: status codes, last-error messages, handles that are
//! null, stale or of the wrong kind, out-parameters untouched on failure.

use std::ffi::{CStr, CString};
use std::ptr;

use mlx_native::ffi::*;

fn last_error() -> String {
    unsafe { CStr::from_ptr(mlxn_last_error()) }.to_string_lossy().into_owned()
}

fn open_cpu() -> u64 {
    let mut dev = 0u64;
    let name = CString::new("cpu").unwrap();
    assert_eq!(unsafe { mlxn_device_open(name.as_ptr(), &mut dev) }, 0);
    assert_ne!(dev, 0);
    dev
}

const INVALID_ARGUMENT: i32 = 6;
const INVALID_HANDLE: i32 = 9;

#[test]
fn version_and_backends() {
    let v = unsafe { CStr::from_ptr(mlxn_version()) }.to_str().unwrap();
    assert_eq!(v, env!("CARGO_PKG_VERSION"));
    let mut needed = 0usize;
    assert_eq!(unsafe { mlxn_backends(ptr::null_mut(), 0, &mut needed) }, 0);
    let mut buf = vec![0 as std::ffi::c_char; needed];
    assert_eq!(unsafe { mlxn_backends(buf.as_mut_ptr(), needed, &mut needed) }, 0);
    let s = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap();
    assert!(s.split(',').any(|b| b == "cpu"), "{s}");
    // A too-small buffer is truncated, NUL-terminated, and says how much it needed.
    let mut small = [1 as std::ffi::c_char; 2];
    assert_eq!(unsafe { mlxn_backends(small.as_mut_ptr(), 2, &mut needed) }, 0);
    assert_eq!(small[1], 0);
    assert_eq!(needed, s.len() + 1);
}

#[test]
fn unknown_backends_and_null_arguments() {
    let mut dev = 77u64;
    let name = CString::new("quantum").unwrap();
    assert_eq!(unsafe { mlxn_device_open(name.as_ptr(), &mut dev) }, 1);
    assert!(last_error().contains("unknown backend"), "{}", last_error());
    assert_eq!(dev, 77, "out untouched on failure");
    assert_eq!(unsafe { mlxn_device_open(ptr::null(), &mut dev) }, INVALID_ARGUMENT);
    assert!(last_error().contains("backend is a null pointer"));
    let cpu = CString::new("cpu").unwrap();
    assert_eq!(unsafe { mlxn_device_open(cpu.as_ptr(), ptr::null_mut()) }, INVALID_ARGUMENT);
}

#[test]
fn stale_null_and_wrong_kind_handles() {
    let dev = open_cpu();
    let mut buf = 0u64;
    let shape = [4u64];
    assert_eq!(unsafe { mlxn_buffer_new(dev, 0, shape.as_ptr(), 1, &mut buf) }, 0);
    let mut info = std::mem::MaybeUninit::<MlxnBufferInfo>::uninit();
    assert_eq!(unsafe { mlxn_buffer_info(buf, info.as_mut_ptr()) }, 0);
    let info = unsafe { info.assume_init() };
    assert_eq!((info.dtype, info.ndim, info.shape[0], info.byte_len), (0, 1, 4, 16));

    // Wrong kind.
    let mut enc = 0u64;
    assert_eq!(unsafe { mlxn_encoder_new(buf, &mut enc) }, INVALID_HANDLE);
    assert!(last_error().contains("is a buffer, not a device"), "{}", last_error());
    // Null.
    assert_eq!(mlxn_buffer_free(0), INVALID_HANDLE);
    assert!(last_error().contains("null buffer handle"));
    // Stale.
    assert_eq!(mlxn_buffer_free(buf), 0);
    assert_eq!(mlxn_buffer_free(buf), INVALID_HANDLE);
    let mut x = [0u8; 4];
    assert_eq!(unsafe { mlxn_buffer_read(buf, 0, x.as_mut_ptr().cast(), 4) }, INVALID_HANDLE);
    // Never issued.
    assert_eq!(mlxn_encoder_commit_and_wait(u64::MAX), INVALID_HANDLE);
    assert_eq!(mlxn_device_close(dev), 0);
    assert_eq!(mlxn_device_close(dev), INVALID_HANDLE);
}

#[test]
fn bad_dtypes_shapes_and_ranges() {
    let dev = open_cpu();
    let mut buf = 5u64;
    let shape = [4u64, 4];
    assert_eq!(unsafe { mlxn_buffer_new(dev, 99, shape.as_ptr(), 2, &mut buf) }, 8);
    assert!(last_error().contains("no dtype has code 99"));
    assert_eq!(unsafe { mlxn_buffer_new(dev, 0, ptr::null(), 2, &mut buf) }, INVALID_ARGUMENT);
    assert_eq!(unsafe { mlxn_buffer_new(dev, 0, shape.as_ptr(), 9, &mut buf) }, INVALID_ARGUMENT);
    let huge = [u64::MAX, 2];
    assert_eq!(unsafe { mlxn_buffer_new(dev, 0, huge.as_ptr(), 2, &mut buf) }, 5);
    assert_eq!(buf, 5);
    assert_eq!(unsafe { mlxn_buffer_new(dev, 0, shape.as_ptr(), 2, &mut buf) }, 0);
    let mut dst = [0u8; 8];
    assert_eq!(unsafe { mlxn_buffer_read(buf, 60, dst.as_mut_ptr().cast(), 8) }, INVALID_ARGUMENT);
    assert!(last_error().contains("exceed the buffer's 64 bytes"), "{}", last_error());
    assert_eq!(unsafe { mlxn_buffer_read(buf, usize::MAX, dst.as_mut_ptr().cast(), 8) }, INVALID_ARGUMENT);
    assert_eq!(unsafe { mlxn_buffer_write(buf, 0, ptr::null(), 8) }, INVALID_ARGUMENT);
    // A wrapped region whose shape needs more bytes than it has.
    let mut host = [0f32; 4];
    assert_eq!(
        unsafe { mlxn_buffer_wrap_host(dev, host.as_mut_ptr().cast(), 16, 0, shape.as_ptr(), 2, &mut buf) },
        INVALID_ARGUMENT
    );
    // A misaligned host pointer.
    let bytes = [0u8; 20];
    let one = [4u64];
    assert_eq!(
        unsafe { mlxn_buffer_wrap_host(dev, bytes.as_ptr().add(1) as *mut _, 16, 0, one.as_ptr(), 1, &mut buf) },
        INVALID_ARGUMENT
    );
    assert!(last_error().contains("not aligned"));
    mlxn_device_close(dev);
}

#[test]
fn op_entry_points_validate_and_report() {
    let dev = open_cpu();
    let mut enc = 0u64;
    assert_eq!(unsafe { mlxn_encoder_new(dev, &mut enc) }, 0);
    let mut mask = 0u64;
    let mut blk = 0u64;
    let ms = [32u64, 64];
    let bs = [1u64];
    unsafe {
        assert_eq!(mlxn_buffer_new(dev, 1, ms.as_ptr(), 2, &mut mask), 0);
        assert_eq!(mlxn_buffer_new(dev, 3, bs.as_ptr(), 1, &mut blk), 0);
    }
    assert_eq!(mlxn_dispatch_flash_attn_prefill_blk(enc, mask, blk, 32, 64, 0, 64), INVALID_ARGUMENT);
    assert!(last_error().starts_with("invalid argument: flash_attn_prefill_blk: empty shape"), "{}", last_error());
    let mut pending = 9u64;
    assert_eq!(unsafe { mlxn_encoder_pending(enc, &mut pending) }, 0);
    assert_eq!(pending, 0);
    assert_eq!(mlxn_dispatch_flash_attn_prefill_blk(enc, mask, blk, 32, 64, 32, 64), 0);
    assert_eq!(unsafe { mlxn_encoder_pending(enc, &mut pending) }, 0);
    assert_eq!(pending, 1);
    assert_eq!(mlxn_encoder_commit_and_wait(enc), 0);
    let mut b = [7u8];
    assert_eq!(unsafe { mlxn_buffer_read(blk, 0, b.as_mut_ptr().cast(), 1) }, 0);
    assert_eq!(b[0], 2, "an all-zero mask tile is class 2");
    assert_eq!(
        unsafe { mlxn_dispatch_flash_attn_prefill_tensor_f16(enc, mask, mask, mask, mask, blk, blk, ptr::null()) },
        INVALID_ARGUMENT
    );
    let mut q = 0u32;
    assert_eq!(unsafe { mlxn_queries_per_threadgroup(512, &mut q) }, 0);
    assert_eq!(q, 16);
    let mut kvp = 0u32;
    assert_eq!(unsafe { mlxn_kv_pad(u32::MAX, &mut kvp) }, INVALID_ARGUMENT);
    assert_eq!(unsafe { mlxn_kv_pad(65, &mut kvp) }, 0);
    assert_eq!(kvp, 128);
    assert_eq!(mlxn_cache_rows_per_step(), 64);
    // An encoder freed with work pending drops it.
    assert_eq!(mlxn_dispatch_flash_attn_prefill_blk(enc, mask, blk, 32, 64, 32, 64), 0);
    assert_eq!(mlxn_encoder_free(enc), 0);
    for h in [mask, blk] {
        assert_eq!(mlxn_buffer_free(h), 0);
    }
    assert_eq!(mlxn_device_close(dev), 0);
}

#[test]
fn errors_are_per_thread() {
    assert_eq!(mlxn_buffer_free(0), INVALID_HANDLE);
    let here = last_error();
    std::thread::spawn(|| {
        assert_eq!(last_error(), "", "a new thread starts with no error");
        assert_eq!(mlxn_device_close(0), INVALID_HANDLE);
        assert!(last_error().contains("null device handle"));
    })
    .join()
    .unwrap();
    assert_eq!(last_error(), here);
}

#[test]
fn fma_peak_is_measured_and_checks_its_arguments() {
    let mut one = -1.0f64;
    assert_eq!(unsafe { mlxn_cpu_fma_peak(1, &mut one) }, 0);
    assert!(one.is_finite() && one > 0.1, "one-thread peak {one}");
    let mut all = -1.0f64;
    assert_eq!(unsafe { mlxn_cpu_fma_peak(0, &mut all) }, 0);
    assert!(all.is_finite() && all > 0.1, "all-thread peak {all}");
    assert_eq!(unsafe { mlxn_cpu_fma_peak(1, ptr::null_mut()) }, INVALID_ARGUMENT);
    assert!(last_error().contains("out_gflops is a null pointer"), "{}", last_error());
    let mut untouched = 5.0f64;
    assert_eq!(unsafe { mlxn_cpu_fma_peak(100_000, &mut untouched) }, INVALID_ARGUMENT);
    assert!(last_error().contains("at most"), "{}", last_error());
    assert_eq!(untouched, 5.0, "out untouched on failure");
}
