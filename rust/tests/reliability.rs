//! Limits, lifetimes, threads and resources at the op layer, on every backend present
//! (tests build with overflow checks on: an arithmetic overflow anywhere is a failure).

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use half::f16;
use mlx_native::backend::available_backends;
use mlx_native::ops::flash_attn_prefill_blk::{dispatch_flash_attn_prefill_blk, FlashAttnPrefillBlkParams};
use mlx_native::ops::flash_attn_prefill_tensor::{
    dispatch_flash_attn_prefill_tensor_f16, kv_pad, FlashAttnPrefillTensorParams,
};
use mlx_native::{default_registry, DType, MlxBuffer, MlxDevice, MlxError};

fn devices() -> Vec<MlxDevice> {
    available_backends().into_iter().map(|n| MlxDevice::new(n).unwrap()).collect()
}

const I32_MAX: u32 = i32::MAX as u32;

/// One query row, one head, 64 cache rows, contiguous: the smallest valid dispatch.
fn tiny() -> FlashAttnPrefillTensorParams {
    FlashAttnPrefillTensorParams {
        rows: 1,
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
    }
}

fn dispatch(dev: &MlxDevice, b: &[&MlxBuffer; 6], p: &FlashAttnPrefillTensorParams) -> mlx_native::Result<()> {
    let mut reg = default_registry();
    let mut enc = dev.command_encoder();
    dispatch_flash_attn_prefill_tensor_f16(&mut enc, &mut reg, dev, b[0], b[1], b[2], b[3], b[4], b[5], p)?;
    enc.commit_and_wait()
}

fn invalid_msg(r: mlx_native::Result<()>) -> String {
    match r {
        Err(MlxError::InvalidArgument(m)) => m,
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn strides_at_the_i32_limit_run_and_one_past_it_is_refused() {
    for dev in devices() {
        let mut rng = Rng::new(7);
        let q: Vec<f32> = (0..256).map(|_| rng.uniform(-1.0, 1.0)).collect();
        let k: Vec<u16> = (0..64 * 256).map(|_| f16::from_f32(rng.uniform(-1.0, 1.0)).to_bits()).collect();
        let v: Vec<u16> = (0..64 * 256).map(|_| f16::from_f32(rng.uniform(-1.0, 1.0)).to_bits()).collect();
        let bufs = [
            upload(&dev, DType::F32, &q),
            upload(&dev, DType::F16, &k),
            upload(&dev, DType::F16, &v),
            upload(&dev, DType::F16, &vec![0u16; 64]),
            upload(&dev, DType::U8, &[1u8]),
            dev.alloc_buffer(DType::F32, &[256]).unwrap(),
        ];
        let b = [&bufs[0], &bufs[1], &bufs[2], &bufs[3], &bufs[4], &bufs[5]];
        // With one row and one head, the row and head strides are never multiplied by more
        // than zero: the largest values the i32 rule accepts must run (and read only what
        // the buffers hold).
        let largest = FlashAttnPrefillTensorParams {
            q_row_stride: I32_MAX - 3,
            q_head_stride: I32_MAX - 3,
            k_head_stride: I32_MAX,
            v_head_stride: I32_MAX,
            ..tiny()
        };
        dispatch(&dev, &b, &largest).unwrap();
        let got = read_f32(&bufs[5]);
        let plain = dispatch(&dev, &b, &tiny());
        plain.unwrap();
        assert_eq!(got, read_f32(&bufs[5]), "unused strides changed the result");
        let case_ref = {
            // Exact softmax over 64 rows, in f64.
            let qh: Vec<f64> = q.iter().map(|&x| f16::from_f32(x).to_f64()).collect();
            let s: Vec<f64> =
                (0..64).map(|j| (0..256).map(|d| qh[d] * f16::from_bits(k[j * 256 + d]).to_f64()).sum()).collect();
            let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let p: Vec<f64> = s.iter().map(|x| (x - mx).exp()).collect();
            let den: f64 = p.iter().sum();
            (0..256)
                .map(|d| (0..64).map(|j| p[j] * f16::from_bits(v[j * 256 + d]).to_f64()).sum::<f64>() / den)
                .collect::<Vec<f64>>()
        };
        assert!(nmse(&got, &case_ref) < 5e-4);
        // One past the limit, each field alone: refused by the i32 rule.
        let past: [(&str, FlashAttnPrefillTensorParams); 6] = [
            ("q_row_stride", FlashAttnPrefillTensorParams { q_row_stride: I32_MAX + 1, ..largest }),
            ("q_head_stride", FlashAttnPrefillTensorParams { q_head_stride: I32_MAX + 1, ..largest }),
            ("k_head_stride", FlashAttnPrefillTensorParams { k_head_stride: I32_MAX + 1, ..largest }),
            ("v_head_stride", FlashAttnPrefillTensorParams { v_head_stride: I32_MAX + 1, ..largest }),
            ("k_row_stride", FlashAttnPrefillTensorParams { k_row_stride: I32_MAX + 1, ..largest }),
            ("v_row_stride", FlashAttnPrefillTensorParams { v_row_stride: u32::MAX, ..largest }),
        ];
        for (what, p) in past {
            let m = invalid_msg(dispatch(&dev, &b, &p));
            assert!(m.contains("exceeds i32"), "{what}: {m}");
        }
    }
}

#[test]
fn rows_heads_and_kv_pad_at_the_i32_limit_are_size_errors_past_it_i32_errors() {
    for dev in devices() {
        let small: Vec<MlxBuffer> = [DType::F32, DType::F16, DType::F16, DType::F16, DType::U8, DType::F32]
            .iter()
            .map(|&d| dev.alloc_buffer(d, &[64 * 256]).unwrap())
            .collect();
        let b = [&small[0], &small[1], &small[2], &small[3], &small[4], &small[5]];
        // At the limit the i32 rule passes and the (saturating) size rules refuse: the buffers
        // such shapes need are hundreds of GiB; no arithmetic overflows on the way.
        let at: [(FlashAttnPrefillTensorParams, &str); 4] = [
            (FlashAttnPrefillTensorParams { rows: I32_MAX, q_row_stride: 0, ..tiny() }, "mask holds"),
            (FlashAttnPrefillTensorParams { rows: I32_MAX, ..tiny() }, "q holds"),
            (
                FlashAttnPrefillTensorParams {
                    n_heads: I32_MAX,
                    n_kv_heads: I32_MAX,
                    q_head_stride: 0,
                    k_head_stride: 0,
                    v_head_stride: 0,
                    ..tiny()
                },
                "out holds",
            ),
            (FlashAttnPrefillTensorParams { kv_pad: I32_MAX - 63, ..tiny() }, "k holds"),
        ];
        for (p, needle) in at {
            let m = invalid_msg(dispatch(&dev, &b, &p));
            assert!(m.contains(needle), "{p:?}: {m}");
        }
        let past = [
            FlashAttnPrefillTensorParams { rows: I32_MAX + 1, ..tiny() },
            FlashAttnPrefillTensorParams { n_heads: I32_MAX + 1, n_kv_heads: 1, ..tiny() },
            FlashAttnPrefillTensorParams { n_heads: I32_MAX + 1, n_kv_heads: I32_MAX + 1, ..tiny() },
            FlashAttnPrefillTensorParams { kv_pad: I32_MAX + 1, ..tiny() },
            FlashAttnPrefillTensorParams { kv_pad: u32::MAX - 63, ..tiny() },
        ];
        for p in past {
            let m = invalid_msg(dispatch(&dev, &b, &p));
            assert!(m.contains("exceeds i32"), "{p:?}: {m}");
        }
        // kv_pad of the largest lengths saturates instead of overflowing; no dispatch takes it.
        assert_eq!(kv_pad(u32::MAX), u32::MAX);
        let m = invalid_msg(dispatch(&dev, &b, &FlashAttnPrefillTensorParams { kv_pad: kv_pad(u32::MAX), ..tiny() }));
        assert!(m.contains("not a multiple of 64"), "{m}");
    }
}

/// The largest `kv_pad` the op accepts, run for real: 2^31 - 64 cache rows, every one the
/// same K/V row (row strides 0), a 4 GiB mask of which only the last tile is read (the table
/// skips every other tile). Mask indices reach 2^31 - 1 (byte offsets past 2^32): any 32-bit
/// index arithmetic in a backend shows up here.
#[test]
fn the_largest_kv_pad_runs() {
    for dev in devices() {
        let kvp = I32_MAX - 63;
        let steps = kvp as usize / 64;
        let mut rng = Rng::new(11);
        let q: Vec<f32> = (0..256).map(|_| rng.uniform(-1.0, 1.0)).collect();
        let kv: Vec<u16> = (0..256).map(|_| f16::from_f32(rng.uniform(-1.0, 1.0)).to_bits()).collect();
        let qb = upload(&dev, DType::F32, &q);
        let kb = upload(&dev, DType::F16, &kv);
        let mask = dev
            .alloc_buffer(DType::F16, &[kvp as usize])
            .unwrap_or_else(|e| panic!("the 4 GiB mask of this test: {e}"));
        // Last tile: -inf but for 5 columns near the end.
        let mut tail = vec![f16::NEG_INFINITY.to_bits(); 64];
        for j in [0usize, 17, 40, 62, 63] {
            tail[j] = f16::from_f32(0.25 * j as f32 / 64.0).to_bits();
        }
        mask.write_bytes((kvp as usize - 64) * 2, bytemuck::cast_slice(&tail)).unwrap();
        let mut blk = vec![0u8; steps];
        blk[steps - 1] = 1;
        let blkb = upload(&dev, DType::U8, &blk);
        let out = dev.alloc_buffer(DType::F32, &[256]).unwrap();
        let p = FlashAttnPrefillTensorParams { kv_pad: kvp, k_row_stride: 0, v_row_stride: 0, ..tiny() };
        dispatch(&dev, &[&qb, &kb, &kb, &mask, &blkb, &out], &p).unwrap();
        // Five visible rows, all the same K/V row: the output is that V row.
        let got = read_f32(&out);
        for d in 0..256 {
            let want = f16::from_bits(kv[d]).to_f32();
            assert!((got[d] - want).abs() <= 1e-3 * want.abs().max(1e-2), "d {d}: {} vs {want}", got[d]);
        }
    }
}

#[test]
fn pending_dispatches_keep_their_buffers_and_dropped_encoders_free_them() {
    for dev in devices() {
        let c = Case::new(3, 40, 4, 2, 256, 100, 1, MaskKind::Peer);
        let reference = c.reference();
        let mut reg = default_registry();
        let out = dev.alloc_buffer(DType::F32, &[40 * 4 * 256]).unwrap();
        let out_memory = Arc::downgrade(out.memory());
        let mut enc = dev.command_encoder();
        {
            // Every handle but the encoder's copies is dropped before the commit.
            let b = bind(&dev, &c, 0);
            let bp = FlashAttnPrefillBlkParams { rows: 40, kv_pad: 128, bq: 32, bk: 64 };
            dispatch_flash_attn_prefill_blk(&mut enc, &mut reg, &dev, &b.mask, &b.blk, &bp).unwrap();
            dispatch_flash_attn_prefill_tensor_f16(
                &mut enc,
                &mut reg,
                &dev,
                &b.q,
                &b.k,
                &b.v,
                &b.mask,
                &b.blk,
                &out,
                &c.params(),
            )
            .unwrap();
        }
        enc.commit_and_wait().unwrap();
        assert!(nmse(&read_f32(&out), &reference) < 5e-4);

        // An encoder dropped with work pending: the work never runs and every buffer it held
        // is released (the memory goes when the last handle does).
        let b = bind(&dev, &c, 0);
        let held: Vec<_> = [&b.q, &b.k, &b.v, &b.mask, &b.blk].iter().map(|x| Arc::downgrade(x.memory())).collect();
        let before = read_u8(&out);
        for _ in 0..1000 {
            let mut enc = dev.command_encoder();
            dispatch_flash_attn_prefill_tensor_f16(
                &mut enc,
                &mut reg,
                &dev,
                &b.q,
                &b.k,
                &b.v,
                &b.mask,
                &b.blk,
                &out,
                &c.params(),
            )
            .unwrap();
            assert_eq!(enc.pending().len(), 1);
            assert_eq!(Arc::strong_count(out.memory()), 2, "the encoder holds one reference");
        }
        assert_eq!(read_u8(&out), before, "a dropped encoder ran its work");
        assert_eq!(Arc::strong_count(out.memory()), 1);
        drop(b);
        assert!(held.iter().all(|w| w.upgrade().is_none()), "an input outlived its last handle");
        drop(out);
        assert!(out_memory.upgrade().is_none());
    }
}

#[test]
fn threads_dispatching_on_one_device_and_on_several_get_correct_results() {
    const THREADS: usize = 8;
    const PER_THREAD: usize = 6;
    let cases: Vec<Case> = (0..4)
        .map(|i| {
            Case::new(
                100 + i,
                20 + 9 * i as usize,
                4,
                [1, 2, 4, 2][i as usize],
                [256, 512, 256, 512][i as usize],
                70 + 30 * i as usize,
                i as usize % 2,
                MaskKind::Peer,
            )
        })
        .collect();
    let refs: Vec<Vec<f64>> = cases.iter().map(|c| c.reference()).collect();
    let cases = Arc::new(cases);
    let refs = Arc::new(refs);
    for shared in [true, false] {
        let devs = devices();
        for dev in devs {
            // One registry for all threads of a device (behind a lock, as the C ABI has it).
            let reg = Arc::new(Mutex::new(default_registry()));
            let handles: Vec<_> = (0..THREADS)
                .map(|t| {
                    let (cases, refs, reg) = (cases.clone(), refs.clone(), reg.clone());
                    let dev = if shared { dev.clone() } else { MlxDevice::new(dev.backend_kind().name()).unwrap() };
                    std::thread::spawn(move || {
                        let mut worst = 0f64;
                        for i in 0..PER_THREAD {
                            let n = (t + i) % cases.len();
                            let (c, r) = (&cases[n], &refs[n]);
                            let b = bind(&dev, c, 0);
                            let got = {
                                let mut reg = if shared { Some(reg.lock().unwrap()) } else { None };
                                let mut own = default_registry();
                                let reg = reg.as_deref_mut().unwrap_or(&mut own);
                                let bq = if c.head_dim == 256 { 32 } else { 16 };
                                let mut enc = dev.command_encoder();
                                let bp = FlashAttnPrefillBlkParams {
                                    rows: c.rows as u32,
                                    kv_pad: c.kv_pad() as u32,
                                    bq,
                                    bk: 64,
                                };
                                dispatch_flash_attn_prefill_blk(&mut enc, reg, &dev, &b.mask, &b.blk, &bp).unwrap();
                                dispatch_flash_attn_prefill_tensor_f16(
                                    &mut enc,
                                    reg,
                                    &dev,
                                    &b.q,
                                    &b.k,
                                    &b.v,
                                    &b.mask,
                                    &b.blk,
                                    &b.out,
                                    &c.params(),
                                )
                                .unwrap();
                                enc
                            };
                            // Commit outside the registry lock: the kernels of all threads overlap.
                            let mut enc = got;
                            enc.commit_and_wait().unwrap();
                            worst = worst.max(nmse(&read_f32(&b.out), r));
                        }
                        worst
                    })
                })
                .collect();
            for h in handles {
                let worst = h.join().expect("a thread panicked");
                assert!(worst < 5e-4, "nmse {worst:e}");
            }
        }
    }
}

#[test]
fn more_memory_than_the_machine_has_is_an_allocation_error() {
    let dev = MlxDevice::cpu();
    let limit = mlx_native::backend::cpu::memory_limit();
    if cfg!(target_os = "linux") {
        assert!(limit.is_some_and(|l| l > 0), "Linux reports its memory");
    }
    // Past the machine (or past any machine, where it does not say): refused, not an abort.
    let bytes = limit.map_or(1usize << 50, |l| l as usize + 4096);
    match dev.alloc_buffer(DType::U8, &[bytes]) {
        Err(MlxError::BufferAllocationError { bytes: b }) => assert_eq!(b, bytes as u64),
        other => panic!("{other:?}"),
    }
    // A shape whose byte count does not fit in 64 bits.
    assert!(matches!(dev.alloc_buffer(DType::F32, &[1 << 40, 1 << 30]), Err(MlxError::BufferAllocationError { .. })));
    // A modest buffer still works.
    assert_eq!(dev.alloc_buffer(DType::F32, &[1 << 20]).unwrap().data_byte_len(), 4 << 20);
}

#[test]
fn missing_backends_are_clean_errors_and_auto_falls_back() {
    let names = available_backends();
    assert!(names.contains(&"cpu"));
    let auto = MlxDevice::new("auto").unwrap();
    assert_eq!(auto.backend_kind().name(), names[0], "auto opens the best backend present");
    for name in ["cuda", "metal"] {
        if !names.contains(&name) {
            match MlxDevice::new(name) {
                Err(MlxError::BackendUnavailable(m) | MlxError::DeviceNotFound(m)) => {
                    assert!(!m.is_empty())
                }
                other => panic!("{name}: {other:?}"),
            }
        }
    }
}

#[test]
fn cpu_buffers_are_aligned_and_zero_whatever_their_size() {
    let dev = MlxDevice::cpu();
    for bytes in [1usize, 3, 64, 100, 4096, 1 << 17, (1 << 20) + 5, 64 << 20] {
        let b = dev.alloc_buffer(DType::U8, &[bytes]).unwrap();
        assert_eq!(b.host_ptr().unwrap() as usize % 64, 0, "{bytes} bytes");
        let data = read_u8(&b);
        assert!(data.iter().all(|&x| x == 0), "{bytes} bytes");
        b.write_bytes(bytes - 1, &[7]).unwrap();
    }
}
