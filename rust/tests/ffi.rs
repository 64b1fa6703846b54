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
        unsafe { mlxn_buffer_wrap_host(dev, host.as_mut_ptr().cast(), 16, 0, shape.as_ptr(), 2, &mut buf,) },
        INVALID_ARGUMENT
    );
    // A misaligned host pointer.
    let bytes = [0u8; 20];
    let one = [4u64];
    assert_eq!(
        unsafe { mlxn_buffer_wrap_host(dev, bytes.as_ptr().add(1) as *mut _, 16, 0, one.as_ptr(), 1, &mut buf,) },
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
        unsafe { mlxn_dispatch_flash_attn_prefill_tensor_f16(enc, mask, mask, mask, mask, blk, blk, ptr::null(),) },
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

/// Every entry point that takes a handle, called with a null, a freed, a never-issued and
/// a wrong-kind one: `MLXN_INVALID_HANDLE`, out-parameters untouched, nothing else changed.
#[test]
fn every_entry_point_refuses_every_bad_handle() {
    let dev = open_cpu();
    let (mut enc, mut buf, mut blk) = (0u64, 0u64, 0u64);
    let ms = [32u64, 64];
    let one = [1u64];
    unsafe {
        assert_eq!(mlxn_encoder_new(dev, &mut enc), 0);
        assert_eq!(mlxn_buffer_new(dev, 1, ms.as_ptr(), 2, &mut buf), 0);
        assert_eq!(mlxn_buffer_new(dev, 3, one.as_ptr(), 1, &mut blk), 0);
    }
    // A freed one of each kind.
    let (mut dead_dev, mut dead_enc, mut dead_buf) = (0u64, 0u64, 0u64);
    let cpu = CString::new("cpu").unwrap();
    unsafe {
        assert_eq!(mlxn_device_open(cpu.as_ptr(), &mut dead_dev), 0);
        assert_eq!(mlxn_encoder_new(dead_dev, &mut dead_enc), 0);
        assert_eq!(mlxn_buffer_new(dead_dev, 1, ms.as_ptr(), 2, &mut dead_buf), 0);
    }
    assert_eq!(mlxn_encoder_free(dead_enc), 0);
    assert_eq!(mlxn_buffer_free(dead_buf), 0);
    assert_eq!(mlxn_device_close(dead_dev), 0);
    let never = u64::MAX - 1;
    let bad_devices = [0, dead_dev, never, buf, enc];
    let bad_buffers = [0, dead_buf, never, dev, enc];
    let bad_encoders = [0, dead_enc, never, dev, buf];
    let p = MlxnFlashAttnPrefillTensorParams {
        rows: 32,
        n_heads: 1,
        n_kv_heads: 1,
        head_dim: 256,
        kv_pad: 64,
        q_row_stride: 256,
        q_head_stride: 256,
        k_row_stride: 256,
        k_head_stride: 256,
        v_row_stride: 256,
        v_head_stride: 256,
        scale: 1.0,
    };
    let mut host = [0f32; 4];
    let shape = [4u64];
    for h in bad_devices {
        let (mut out, mut flag, mut code) = (77u64, 77i32, 77u32);
        let mut needed = 77usize;
        unsafe {
            assert_eq!(mlxn_device_info(h, &mut code, ptr::null_mut(), 0, &mut needed), INVALID_HANDLE, "{h}");
            assert_eq!((code, needed), (77, 77));
            assert_eq!(mlxn_flash_attn_prefill_tensor_available(h, 256, &mut flag), INVALID_HANDLE);
            assert_eq!(flag, 77);
            assert_eq!(mlxn_buffer_new(h, 0, shape.as_ptr(), 1, &mut out), INVALID_HANDLE);
            assert_eq!(
                mlxn_buffer_wrap_host(h, host.as_mut_ptr().cast(), 16, 0, shape.as_ptr(), 1, &mut out),
                INVALID_HANDLE
            );
            assert_eq!(mlxn_buffer_wrap_device(h, 1 << 20, 16, 0, shape.as_ptr(), 1, &mut out), INVALID_HANDLE);
            assert_eq!(mlxn_encoder_new(h, &mut out), INVALID_HANDLE);
            assert_eq!(out, 77);
        }
        assert_eq!(mlxn_device_wait_stream(h, 1), INVALID_HANDLE);
        assert_eq!(mlxn_device_close(h), INVALID_HANDLE);
    }
    for h in bad_buffers {
        let mut out = 77u64;
        let mut bytes = [9u8; 4];
        let mut info = std::mem::MaybeUninit::<MlxnBufferInfo>::uninit();
        unsafe {
            assert_eq!(mlxn_buffer_info(h, info.as_mut_ptr()), INVALID_HANDLE, "{h}");
            assert_eq!(mlxn_buffer_read(h, 0, bytes.as_mut_ptr().cast(), 4), INVALID_HANDLE);
            assert_eq!(bytes, [9; 4]);
            assert_eq!(mlxn_buffer_write(h, 0, bytes.as_ptr().cast(), 4), INVALID_HANDLE);
            assert_eq!(mlxn_buffer_view(h, 0, 4, 3, shape.as_ptr(), 1, &mut out), INVALID_HANDLE);
            assert_eq!(out, 77);
        }
        assert_eq!(mlxn_buffer_free(h), INVALID_HANDLE);
        // In each buffer position of both ops.
        assert_eq!(mlxn_dispatch_flash_attn_prefill_blk(enc, h, blk, 32, 64, 32, 64), INVALID_HANDLE);
        assert_eq!(mlxn_dispatch_flash_attn_prefill_blk(enc, buf, h, 32, 64, 32, 64), INVALID_HANDLE);
        for pos in 0..6 {
            let mut hs = [buf; 6];
            hs[pos] = h;
            let s = unsafe {
                mlxn_dispatch_flash_attn_prefill_tensor_f16(enc, hs[0], hs[1], hs[2], hs[3], hs[4], hs[5], &p)
            };
            assert_eq!(s, INVALID_HANDLE, "buffer position {pos}, handle {h}");
        }
    }
    for h in bad_encoders {
        let mut out = 77u64;
        unsafe {
            assert_eq!(mlxn_encoder_pending(h, &mut out), INVALID_HANDLE, "{h}");
            assert_eq!(out, 77);
            assert_eq!(
                mlxn_dispatch_flash_attn_prefill_tensor_f16(h, buf, buf, buf, buf, blk, buf, &p),
                INVALID_HANDLE
            );
        }
        assert_eq!(mlxn_dispatch_flash_attn_prefill_blk(h, buf, blk, 32, 64, 32, 64), INVALID_HANDLE);
        assert_eq!(mlxn_encoder_commit_and_wait(h), INVALID_HANDLE);
        assert_eq!(mlxn_encoder_free(h), INVALID_HANDLE);
    }
    // Nothing was recorded along the way; the good handles still work.
    let mut pending = 9u64;
    assert_eq!(unsafe { mlxn_encoder_pending(enc, &mut pending) }, 0);
    assert_eq!(pending, 0);
    assert_eq!(mlxn_dispatch_flash_attn_prefill_blk(enc, buf, blk, 32, 64, 32, 64), 0);
    assert_eq!(mlxn_encoder_commit_and_wait(enc), 0);
    assert_eq!(mlxn_encoder_free(enc), 0);
    assert_eq!(mlxn_buffer_free(buf), 0);
    assert_eq!(mlxn_buffer_free(blk), 0);
    assert_eq!(mlxn_device_close(dev), 0);
}

/// A view shares its memory and outlives the buffer it was made from; a bad view is refused.
#[test]
fn views_share_memory_and_are_checked() {
    let dev = open_cpu();
    let mut base = 0u64;
    let n = [16u64];
    unsafe { assert_eq!(mlxn_buffer_new(dev, 0, n.as_ptr(), 1, &mut base), 0) };
    let mut view = 77u64;
    let two = [2u64];
    // Past the end, misaligned, too small for its shape, an unknown dtype.
    unsafe {
        assert_eq!(mlxn_buffer_view(base, 60, 8, 0, two.as_ptr(), 1, &mut view), INVALID_ARGUMENT);
        assert!(last_error().contains("exceeds the buffer"), "{}", last_error());
        assert_eq!(mlxn_buffer_view(base, 2, 8, 0, two.as_ptr(), 1, &mut view), INVALID_ARGUMENT);
        assert!(last_error().contains("not aligned"), "{}", last_error());
        assert_eq!(mlxn_buffer_view(base, 0, 4, 0, two.as_ptr(), 1, &mut view), INVALID_ARGUMENT);
        assert_eq!(mlxn_buffer_view(base, usize::MAX, 8, 0, two.as_ptr(), 1, &mut view), INVALID_ARGUMENT);
        assert_eq!(mlxn_buffer_view(base, 0, 8, 42, two.as_ptr(), 1, &mut view), 8);
        assert_eq!(view, 77);
        assert_eq!(mlxn_buffer_view(base, 8, 8, 0, two.as_ptr(), 1, &mut view), 0);
    }
    let vals = [1.5f32, -2.0];
    unsafe { assert_eq!(mlxn_buffer_write(view, 0, vals.as_ptr().cast(), 8), 0) };
    let mut all = [0f32; 16];
    unsafe { assert_eq!(mlxn_buffer_read(base, 0, all.as_mut_ptr().cast(), 64), 0) };
    assert_eq!(&all[2..4], &vals);
    assert_eq!(mlxn_buffer_free(base), 0);
    let mut back = [0f32; 2];
    unsafe { assert_eq!(mlxn_buffer_read(view, 0, back.as_mut_ptr().cast(), 8), 0) };
    assert_eq!(back, vals, "the view keeps the memory");
    assert_eq!(mlxn_buffer_free(view), 0);
    assert_eq!(mlxn_device_close(dev), 0);
}
