//! SPEC 10 on the CPU through the op, against the float64 reference (`common::prefill`):
//! every head dim of the table (576/512 with V a view of K too) with F16 and BF16 K/V,
//! softcap, ALiBi on described and explicit masks, attention sinks (rows that see nothing
//! included), lse with the sink; and the typed errors of bad values, with nothing written.

mod common;

use std::sync::{Mutex, MutexGuard};

use common::prefill::{run, Output, Prefill, Table};
use common::{nmse, read_u8, upload};
use mlx_native::backend::cpu::simd;
use mlx_native::ops::flash_attn_prefill::{dispatch_flash_attn_prefill, FlashAttnPrefillBuffers, HEAD_DIMS};
use mlx_native::{default_registry, DType, KernelRegistry, MlxDevice, MlxError};

/// The instruction set is process-wide: each test holds this lock while it runs kernels.
static SWITCHES: Mutex<()> = Mutex::new(());

fn setup() -> (MutexGuard<'static, ()>, MlxDevice, KernelRegistry) {
    (SWITCHES.lock().unwrap_or_else(|e| e.into_inner()), MlxDevice::cpu(), default_registry())
}

/// F32 output against the reference (NMSE below 1e-5), lse within 2e-3 and -inf exactly
/// where the reference's is. Returns the NMSE.
fn check(name: &str, c: &Prefill, o: &Output) -> f64 {
    let (reference, lse) = c.reference();
    assert!(o.out.iter().all(|x| x.is_finite()), "{name}: non-finite output");
    let out: Vec<f32> = o.out.iter().map(|&x| x as f32).collect();
    let e = nmse(&out, &reference);
    eprintln!("{name:60} nmse {e:.2e}");
    assert!(e < 1e-5, "{name}: nmse {e:e}");
    if c.lse_strides.is_some() {
        for (i, (&got, &want)) in o.lse.iter().zip(&lse).enumerate() {
            if want == f64::NEG_INFINITY {
                assert_eq!(got, f64::NEG_INFINITY, "{name}: lse {i} of a row that sees nothing");
            } else {
                assert!((got - want).abs() < 2e-3, "{name}: lse {i} is {got}, the reference {want}");
            }
        }
    }
    e
}

fn causal(mut c: Prefill, window: usize) -> Prefill {
    (c.causal, c.window) = (true, window);
    c
}

fn sinks(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = common::Rng::new(seed);
    (0..n).map(|_| rng.uniform(-3.0, 3.0)).collect()
}

#[test]
fn every_head_dim_with_f16_and_bf16_kv_matches_the_reference() {
    let (_l, dev, mut reg) = setup();
    for (i, ((dk, dv), _, _)) in HEAD_DIMS.iter().enumerate() {
        for (j, kv) in [DType::F16, DType::BF16].into_iter().enumerate() {
            let seed = 300 + 2 * i as u64 + j as u64;
            // GQA 2, odd rows and cache, a cache longer than the prompt, strided views.
            let base = causal(Prefill::fixed(seed, 2, 37, 101, 4, 2, 64, 1), 0).with_lse();
            let c = base.with_kv(seed, (*dk as usize, *dv as usize), kv, false);
            let o = run(&dev, &mut reg, &c, Table::Computed);
            check(&format!("d{dk}/{dv} {kv} causal gqa2"), &c, &o);
        }
    }
}

#[test]
fn v_as_a_view_of_k_at_576_512() {
    let (_l, dev, mut reg) = setup();
    for kv in [DType::F16, DType::BF16] {
        let c = causal(Prefill::fixed(311, 1, 40, 90, 4, 1, 64, 0), 0).with_lse().with_kv(311, (576, 512), kv, true);
        assert_eq!(c.v_strides, c.k_strides);
        let o = run(&dev, &mut reg, &c, Table::Computed);
        check(&format!("576/512 {kv} v = k[..512]"), &c, &o);
    }
}

#[test]
fn softcap_alibi_and_sinks_on_described_and_explicit_masks() {
    let (_l, dev, mut reg) = setup();
    // (Q/K, V) dims with a full V slice, an odd one (80) and the MLA pair; every ISA.
    for isa in simd::detected_isas() {
        simd::force_isa(Some(isa)).unwrap();
        for (n, dims) in [(128, 128), (80, 80), (576, 512)].into_iter().enumerate() {
            let seed = 320 + n as u64;
            let fixed = |s| Prefill::fixed(s, 2, 45, 150, 6, 2, 64, 1).with_lse();
            let mut cases = vec![
                ("softcap 4", causal(fixed(seed), 0).with_transforms(4.0, 0.0, None)),
                ("alibi 8 causal", causal(fixed(seed + 10), 0).with_transforms(0.0, 8.0, None)),
                ("alibi 8 window 40", causal(fixed(seed + 20), 40).with_transforms(0.0, 8.0, None)),
                ("sinks causal", causal(fixed(seed + 30), 0).with_transforms(0.0, 0.0, Some(sinks(6, seed)))),
                ("all three window 50", causal(fixed(seed + 40), 50).with_transforms(3.0, 5.0, Some(sinks(6, seed)))),
            ];
            cases.push((
                "explicit mask softcap alibi sinks",
                fixed(seed + 50).with_transforms(6.0, 4.0, Some(sinks(6, 1))),
            ));
            cases.push(("explicit mask + causal alibi", causal(fixed(seed + 60), 0).with_transforms(0.0, 2.0, None)));
            for (name, c) in cases {
                let kv = if n == 1 { DType::BF16 } else { DType::F16 };
                let mut c = c.with_kv(seed, dims, kv, false);
                if name.starts_with("explicit") {
                    // Per sequence with softcap alone; shared with the description.
                    c.set_peer_mask(seed, c.causal);
                }
                let o = run(&dev, &mut reg, &c, Table::Computed);
                check(&format!("{isa} {dims:?} {kv} {name}"), &c, &o);
            }
        }
    }
    simd::force_isa(None).unwrap();
}

#[test]
fn variable_length_with_the_transforms() {
    let (_l, dev, mut reg) = setup();
    let lens = [(17, 40), (0, 9), (33, 33), (5, 70)];
    for (hd, window) in [(96, 0), (192, 30)] {
        let c = Prefill::varlen(330 + hd as u64, &lens, 4, 2, 64, 1).with_lse();
        let c = causal(c, window).with_transforms(5.0, 3.0, Some(sinks(4, hd as u64))).with_kv(
            331,
            (hd, hd),
            DType::BF16,
            false,
        );
        let o = run(&dev, &mut reg, &c, Table::Computed);
        check(&format!("varlen d{hd} window {window} transforms"), &c, &o);
    }
    // Without a description a sequence may have no cache: it sees nothing, so it is zeros
    // with lse = its head's sink.
    let c = Prefill::varlen(332, &[(9, 30), (20, 0), (4, 4)], 4, 2, 64, 1).with_lse();
    let c = c.with_transforms(2.0, 0.0, Some(sinks(4, 3))).with_kv(333, (64, 64), DType::F16, false);
    let o = run(&dev, &mut reg, &c, Table::Computed);
    check("varlen d64 no description, a sequence without a cache", &c, &o);
    for r in c.logical_row(1, 0)..c.logical_row(1, 0) + 20 {
        for h in 0..4 {
            assert_eq!(o.lse[r * 4 + h], c.sinks.as_ref().unwrap()[h] as f64);
        }
    }
}

#[test]
fn sinks_with_rows_that_see_nothing_give_zeros_and_lse_sigma() {
    let (_l, dev, mut reg) = setup();
    let c = Prefill::fixed(340, 2, 40, 100, 4, 2, 64, 1).with_lse().with_transforms(0.0, 0.0, Some(sinks(4, 7)));
    let mut c = c.with_kv(342, (112, 112), DType::F16, false);
    c.set_peer_mask(341, false);
    let masked_rows = [0usize, 13, 39];
    let m = c.mask.as_mut().unwrap();
    for b in 0..2 {
        for &r in &masked_rows {
            for j in 0..100 {
                m.data[b * m.strides[0] + r * m.strides[1] + j] = half::f16::NEG_INFINITY.to_bits();
            }
        }
    }
    let o = run(&dev, &mut reg, &c, Table::Computed);
    check("sinks, rows masked whole", &c, &o);
    let s = c.sinks.clone().unwrap();
    for b in 0..2 {
        for &r in &masked_rows {
            let row = c.logical_row(b, r);
            for (h, &sigma) in s.iter().enumerate() {
                assert_eq!(o.lse[row * 4 + h], sigma as f64, "lse of a row that sees nothing is its sink");
                let at = (row * 4 + h) * 112;
                assert!(o.out_bits[at..at + 112].iter().all(|&x| x == 0), "a row that sees nothing is +0");
            }
        }
    }
    // A sink of -inf is no sink: the same output bits as none.
    let none = Prefill { sinks: None, ..c.clone() };
    let minus_inf = Prefill { sinks: Some(vec![f32::NEG_INFINITY; 4]), ..c.clone() };
    let (a, b) = (run(&dev, &mut reg, &none, Table::Computed), run(&dev, &mut reg, &minus_inf, Table::Computed));
    assert_eq!(a.out_bits, b.out_bits);
}

/// What a bad argument must give: an error of the kind wanted whose message holds `needle`,
/// nothing encoded, the output untouched.
fn expect_refused(dev: &MlxDevice, reg: &mut KernelRegistry, c: &Prefill, edit: impl Fn(&mut Bufs), needle: &str) {
    let mut b = Bufs::new(dev, c);
    edit(&mut b);
    let before = read_u8(&b.out);
    let mut enc = dev.command_encoder();
    let bufs = FlashAttnPrefillBuffers {
        q: &b.q,
        k: &b.k,
        v: &b.v,
        out: &b.out,
        mask: None,
        blk: None,
        cu_seqlens_q: None,
        cu_seqlens_k: None,
        lse: None,
        sinks: b.sinks.as_ref(),
        alibi_slopes: None,
        workspace: None,
    };
    let err = dispatch_flash_attn_prefill(&mut enc, reg, dev, &bufs, &b.params).expect_err(needle);
    let msg = match &err {
        MlxError::InvalidArgument(m) | MlxError::UnsupportedDtype(m) => m.clone(),
        other => panic!("{needle}: expected InvalidArgument or UnsupportedDtype, got {other:?}"),
    };
    assert!(msg.contains(needle), "message {msg:?} lacks {needle:?}");
    assert!(enc.pending().is_empty(), "{needle}: something was encoded");
    enc.commit_and_wait().unwrap();
    assert_eq!(read_u8(&b.out), before, "{needle}: out was written");
}

/// The buffers and params of a case, to spoil one by one.
struct Bufs {
    q: mlx_native::MlxBuffer,
    k: mlx_native::MlxBuffer,
    v: mlx_native::MlxBuffer,
    out: mlx_native::MlxBuffer,
    sinks: Option<mlx_native::MlxBuffer>,
    params: mlx_native::ops::flash_attn_prefill::FlashAttnPrefillParams,
}

impl Bufs {
    fn new(dev: &MlxDevice, c: &Prefill) -> Bufs {
        Bufs {
            q: upload(dev, DType::F32, &c.q),
            k: upload(dev, c.kv_dtype, &c.k),
            v: upload(dev, c.kv_dtype, &c.v),
            out: upload(dev, DType::F32, &vec![7f32; c.q.len() * 2]),
            sinks: c.sinks.as_ref().map(|s| upload(dev, DType::F32, s)),
            params: c.params(),
        }
    }
}

#[test]
fn bad_transforms_head_dims_and_kv_dtypes_are_typed_errors() {
    let (_l, dev, mut reg) = setup();
    let c = causal(Prefill::fixed(350, 1, 20, 40, 4, 2, 64, 0), 0).with_transforms(0.0, 0.0, Some(sinks(4, 1)));
    let r = &mut reg;
    expect_refused(&dev, r, &c, |b| b.params.softcap = f32::NAN, "softcap NaN must be a finite number >= 0");
    expect_refused(&dev, r, &c, |b| b.params.softcap = -1.0, "softcap -1 must be a finite number >= 0");
    expect_refused(&dev, r, &c, |b| b.params.max_bias = f32::INFINITY, "max_bias inf must be a finite number");
    expect_refused(&dev, r, &c, |b| b.params.max_bias = -0.5, "max_bias -0.5 must be a finite number");
    expect_refused(
        &dev,
        r,
        &c,
        |b| (b.params.max_bias, b.params.causal) = (8.0, 0),
        "ALiBi needs positions: pass causal=True, a window, or an explicit mask",
    );
    expect_refused(&dev, r, &c, |b| b.sinks = Some(upload(&dev, DType::F32, &[0f32; 3])), "sinks holds 12 bytes");
    expect_refused(&dev, r, &c, |b| b.sinks = Some(upload(&dev, DType::F16, &[0u16; 4])), "sinks must be F32");
    expect_refused(&dev, r, &c, |b| b.params.head_dim_v = 512, "unsupported head_dim 64 (v head dim 512)");
    expect_refused(&dev, r, &c, |b| b.params.head_dim = 100, "unsupported head_dim 100");
    expect_refused(&dev, r, &c, |b| b.v = upload(&dev, DType::BF16, &c.v), "k is F16 and v is BF16");
    expect_refused(
        &dev,
        r,
        &c,
        |b| (b.k, b.v) = (upload(&dev, DType::I32, &c.k), upload(&dev, DType::I32, &c.v)),
        "k and v must be",
    );
    let mla = c.clone().with_kv(351, (576, 512), DType::F16, false);
    expect_refused(&dev, r, &mla, |b| b.params.head_dim_v = 256, "unsupported head_dim 576 (v head dim 256)");
    expect_refused(&dev, r, &mla, |b| b.params.head_dim_v = 576, "unsupported head_dim 576 (v head dim 576)");
    // V sized for 512 columns but read as 576 (head_dim_v 0 = head_dim): refused by its size or dims.
    expect_refused(&dev, r, &mla, |b| b.params.head_dim_v = 0, "unsupported head_dim 576");
}
