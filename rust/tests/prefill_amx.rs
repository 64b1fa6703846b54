//! The AMX kernels of `flash_attn_prefill` (tiles for both products) through the op,
//! against the float64 reference: on the emulated tile unit (`amx-emulated`, every CPU) and
//! on the tiles themselves where this CPU has them (`amx`). Every head dim with F16 and BF16
//! K/V and SPEC 10's transforms, described and explicit masks with the bit-identities of
//! SPEC 3, variable length, Q and O dtypes, fully masked rows; the accuracy of each choice of
//! split products against the FMA kernels' (printed: `--nocapture`).

mod common;

use std::sync::{Mutex, MutexGuard};

use common::nmse;
use common::prefill::{round_to, run, Output, Prefill, Table};
use mlx_native::backend::cpu::amx::{self, Products};
use mlx_native::backend::cpu::{flash_attn_prefill, simd};
use mlx_native::ops::flash_attn_prefill::HEAD_DIMS;
use mlx_native::{default_registry, DType, KernelRegistry, MlxDevice};

/// The instruction set, the products and column skipping are process-wide: each test holds
/// this lock while it runs kernels.
static SWITCHES: Mutex<()> = Mutex::new(());

fn setup() -> (MutexGuard<'static, ()>, MlxDevice, KernelRegistry) {
    (SWITCHES.lock().unwrap_or_else(|e| e.into_inner()), MlxDevice::cpu(), default_registry())
}

/// The AMX paths here: the emulated tiles always, the hardware where detected.
fn amx_paths() -> Vec<&'static str> {
    let mut v = vec![simd::AMX_EMULATED];
    if simd::detected_isas().contains(&simd::AMX) {
        v.push(simd::AMX);
    }
    v
}

/// The best FMA instruction set here (what the AMX kernels are compared with).
fn fma_isa() -> &'static str {
    simd::detected_isas().into_iter().find(|i| *i != simd::AMX).unwrap_or("portable")
}

/// Run `c` with instruction set `isa` forced.
fn run_on(dev: &MlxDevice, reg: &mut KernelRegistry, isa: &str, c: &Prefill, table: Table) -> Output {
    simd::force_isa(Some(isa)).unwrap();
    assert_eq!(simd::selected_isa(), isa);
    let o = run(dev, reg, c, table);
    simd::force_isa(None).unwrap();
    o
}

/// NMSE against the reference (for F16/BF16 outputs, against the reference rounded the
/// same way), with every value finite, below `bar`; lse within 2e-3 and -inf exactly
/// where the reference's is. Returns the NMSE.
fn check(name: &str, c: &Prefill, o: &Output, bar: f64) -> f64 {
    let (reference, lse) = c.reference();
    assert!(o.out.iter().all(|x| x.is_finite()), "{name}: non-finite output");
    let reference: Vec<f64> = reference.iter().map(|&x| round_to(c.out_dtype, x as f32) as f64).collect();
    let out: Vec<f32> = o.out.iter().map(|&x| x as f32).collect();
    let e = nmse(&out, &reference);
    eprintln!("{name:64} nmse {e:.2e}");
    assert!(e < bar, "{name}: nmse {e:e} (bar {bar:e})");
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

fn same_bits(a: &Output, b: &Output) -> bool {
    a.out_bits == b.out_bits && a.lse_bits == b.lse_bits
}

fn described(mut c: Prefill, causal: bool, window: usize) -> Prefill {
    (c.causal, c.window) = (causal, window);
    c
}

/// The bar of the default products, which keep the FMA kernels' accuracy (their cases here
/// stay below 1e-6 with an F32 output).
fn bar(_c: &Prefill) -> f64 {
    1e-6
}

#[test]
fn every_head_dim_with_f16_and_bf16_kv_and_every_transform() {
    let (_l, dev, mut reg) = setup();
    for (i, ((dk, dv), _, _)) in HEAD_DIMS.iter().enumerate() {
        for (j, kv) in [DType::F16, DType::BF16].into_iter().enumerate() {
            let seed = 500 + 2 * i as u64 + j as u64;
            // GQA 2, a partial last query tile and cache step, a cache longer than the
            // prompt, strided views; softcap, ALiBi on the description, sinks, lse.
            let sinks: Vec<f32> = (0..4).map(|h| h as f32 - 1.5).collect();
            let base = described(Prefill::fixed(seed, 2, 37, 101, 4, 2, 64, 1), true, 0).with_lse().with_transforms(
                3.0,
                6.0,
                Some(sinks),
            );
            let c = Prefill { scale: 0.3, ..base.with_kv(seed, (*dk as usize, *dv as usize), kv, false) };
            let fma = run_on(&dev, &mut reg, fma_isa(), &c, Table::Computed);
            for isa in amx_paths() {
                let o = run_on(&dev, &mut reg, isa, &c, Table::Computed);
                check(&format!("d{dk}/{dv} {kv} causal gqa2 transforms [{isa}]"), &c, &o, bar(&c));
                let out: Vec<f32> = o.out.iter().map(|&x| x as f32).collect();
                let apart = nmse(&out, &fma.out);
                assert!(apart < bar(&c), "d{dk}/{dv} {kv} [{isa}]: {apart:e} from the FMA kernels");
            }
        }
    }
}

#[test]
fn v_as_a_view_of_k_at_576_512() {
    let (_l, dev, mut reg) = setup();
    for kv in [DType::F16, DType::BF16] {
        let c = described(Prefill::fixed(311, 1, 40, 90, 4, 1, 64, 0), true, 0).with_lse().with_kv(
            311,
            (576, 512),
            kv,
            true,
        );
        for isa in amx_paths() {
            let o = run_on(&dev, &mut reg, isa, &c, Table::Computed);
            check(&format!("576/512 {kv} v = k[..512] [{isa}]"), &c, &o, bar(&c));
        }
    }
}

#[test]
fn described_masks_with_offsets_and_longer_caches_equal_their_explicit_form() {
    let (_l, dev, mut reg) = setup();
    let at = |mut c: Prefill, off: i64| {
        c.offset = Some(off);
        c
    };
    let cases = [
        ("causal kv 200 rows 70 d128 gqa4", described(Prefill::fixed(11, 2, 70, 200, 8, 2, 128, 1), true, 0)),
        ("window 40 kv 200 rows 70 d64", described(Prefill::fixed(12, 2, 70, 200, 4, 2, 64, 0), true, 40)),
        ("window 1 kv 100 rows 33 d512", described(Prefill::fixed(13, 1, 33, 100, 2, 1, 512, 1), true, 1)),
        ("causal fresh 130 d256 mha", described(Prefill::fixed(14, 1, 130, 130, 2, 2, 256, 0), true, 0)),
        ("window 95 fresh 230 d96", described(Prefill::fixed(15, 1, 230, 230, 2, 2, 96, 0), true, 95)),
        ("causal offset -20 d128", at(described(Prefill::fixed(16, 2, 40, 150, 4, 2, 128, 1), true, 0), -20)),
        ("window 30 offset 60 d80", at(described(Prefill::fixed(17, 1, 70, 150, 4, 2, 80, 1), true, 30), 60)),
        ("dense kv < rows d112", Prefill::fixed(18, 2, 90, 40, 3, 3, 112, 1)),
    ];
    for (name, c) in cases {
        let c = c.with_lse();
        let mut explicit = Prefill { causal: false, window: 0, offset: None, ..c.clone() };
        explicit.set_mask(true, 0, |b, r, j| if c.visible(b, r, j) { 0.0 } else { f32::NEG_INFINITY });
        for isa in amx_paths() {
            let o = run_on(&dev, &mut reg, isa, &c, Table::Computed);
            check(&format!("{name} [{isa}]"), &c, &o, bar(&c));
            let e = run_on(&dev, &mut reg, isa, &explicit, Table::Computed);
            assert!(same_bits(&o, &e), "{name} [{isa}]: described and explicit differ");
            // Rows that see nothing: zeros (+0) and lse -inf.
            let (nh, hd) = (c.n_heads, c.head_dim_v);
            for (b, &(lq, lk)) in c.lens.iter().enumerate() {
                for r in (0..lq).filter(|&r| !(0..lk).any(|j| c.visible(b, r, j))) {
                    let row = c.logical_row(b, r);
                    assert!(
                        o.out_bits[row * nh * hd..(row + 1) * nh * hd].iter().all(|&x| x == 0),
                        "{name}: row {row}"
                    );
                    assert!(
                        o.lse[row * nh..(row + 1) * nh].iter().all(|&x| x == f64::NEG_INFINITY),
                        "{name}: lse {row}"
                    );
                }
            }
        }
    }
}

#[test]
fn variable_length_sequences() {
    let (_l, dev, mut reg) = setup();
    let causal_lens = [(37, 37), (0, 20), (50, 130), (1, 1), (70, 75), (0, 0), (33, 200)];
    // Without a causal description a cache may be empty (the rows see nothing).
    let dense_lens = [(37, 37), (20, 0), (50, 130), (1, 1), (0, 0), (33, 200)];
    for (name, causal, window, hd, kv) in [
        ("varlen causal d128 f16", true, 0, 128, DType::F16),
        ("varlen window 30 d256 bf16", true, 30, 256, DType::BF16),
        ("varlen dense d64 f16", false, 0, 64, DType::F16),
    ] {
        let lens: &[(usize, usize)] = if causal { &causal_lens } else { &dense_lens };
        let base = described(Prefill::varlen(21 + hd as u64, lens, 4, 2, 64, 1), causal, window).with_lse();
        let c = base.with_kv(21 + hd as u64, (hd, hd), kv, false);
        for isa in amx_paths() {
            let o = run_on(&dev, &mut reg, isa, &c, Table::Computed);
            check(&format!("{name} [{isa}]"), &c, &o, bar(&c));
        }
    }
}

#[test]
fn explicit_masks_their_table_and_fully_masked_rows() {
    let (_l, dev, mut reg) = setup();
    for (name, causal, window, shared, hd, kv) in [
        ("peer mask per batch d128 f16", false, 0, false, 128, DType::F16),
        ("peer mask shared + causal d256 bf16", true, 0, true, 256, DType::BF16),
        ("peer mask + window 40 d512 f16", true, 40, false, 512, DType::F16),
    ] {
        let base = described(Prefill::fixed(41 + hd as u64, 2, 300, 450, 2, 1, 64, 1), causal, window).with_lse();
        let mut c = base.with_kv(41 + hd as u64, (hd, hd), kv, false);
        c.set_peer_mask(7, shared);
        // Whole rows -inf (one in a partial last tile) in the first sequence.
        let at: Vec<usize> = [5usize, 299]
            .iter()
            .flat_map(|&r| (0..450).map(move |j| (r, j)))
            .map(|(r, j)| c.mask_at(0, r, j))
            .collect();
        let m = c.mask.as_mut().unwrap();
        for i in at {
            m.data[i] = half::f16::NEG_INFINITY.to_bits();
        }
        for isa in amx_paths() {
            let computed = run_on(&dev, &mut reg, isa, &c, Table::Computed);
            check(&format!("{name} [{isa}]"), &c, &computed, bar(&c));
            let classes: std::collections::BTreeSet<u8> = computed.blk.iter().copied().collect();
            assert_eq!(classes.into_iter().collect::<Vec<_>>(), vec![0, 1, 2], "{name}: not every tile class");
            let ones = run_on(&dev, &mut reg, isa, &c, Table::AllOnes);
            assert!(same_bits(&computed, &ones), "{name} [{isa}]: the computed table changes the output");
            let (nh, hd) = (c.n_heads, c.head_dim_v);
            for r in [5usize, 299] {
                let row = c.logical_row(0, r);
                assert!(computed.out_bits[row * nh * hd..(row + 1) * nh * hd].iter().all(|&x| x == 0), "row {r}");
                assert!(computed.lse[row * nh..(row + 1) * nh].iter().all(|&x| x == f64::NEG_INFINITY), "lse {r}");
            }
        }
    }
}

#[test]
fn leaving_out_unseen_cache_rows_changes_no_bit() {
    let (_l, dev, mut reg) = setup();
    let mut peer = described(Prefill::fixed(101, 2, 45, 150, 4, 2, 128, 1), true, 0).with_lse();
    peer.set_peer_mask(17, false);
    let cases = [
        ("window 40 d64", described(Prefill::fixed(102, 2, 70, 200, 4, 2, 64, 0), true, 40).with_lse()),
        ("causal + peer d128", peer),
    ];
    for (name, c) in cases {
        for isa in amx_paths() {
            let skipping = run_on(&dev, &mut reg, isa, &c, Table::Computed);
            flash_attn_prefill::set_column_skipping(false);
            let full = run_on(&dev, &mut reg, isa, &c, Table::Computed);
            flash_attn_prefill::set_column_skipping(true);
            assert!(same_bits(&skipping, &full), "{name} [{isa}]: skipping unseen cache rows changes the output");
        }
    }
}

#[test]
fn every_q_and_out_dtype() {
    let (_l, dev, mut reg) = setup();
    for kv in [DType::F16, DType::BF16] {
        let base = described(Prefill::fixed(51, 2, 33, 100, 4, 2, 64, 1), true, 50).with_lse().with_kv(
            51,
            (128, 128),
            kv,
            false,
        );
        for q_dtype in [DType::F32, DType::F16, DType::BF16] {
            let c32 = base.clone().with_q_dtype(q_dtype);
            for isa in amx_paths() {
                let o32 = run_on(&dev, &mut reg, isa, &c32, Table::Computed);
                check(&format!("{kv} q {q_dtype} out float32 [{isa}]"), &c32, &o32, bar(&c32));
                for out_dtype in [DType::F16, DType::BF16] {
                    let c = Prefill { out_dtype, ..c32.clone() };
                    let o = run_on(&dev, &mut reg, isa, &c, Table::Computed);
                    check(&format!("{kv} q {q_dtype} out {out_dtype} [{isa}]"), &c, &o, bar(&c).max(2e-5));
                    // Rounded by the kernel from its F32 result, to nearest even.
                    for (i, (&got, &f)) in o.out_bits.iter().zip(&o32.out_bits).enumerate() {
                        let x = f32::from_bits(f);
                        let want = match out_dtype {
                            DType::F16 => half::f16::from_f32(x).to_bits(),
                            _ => half::bf16::from_f32(x).to_bits(),
                        };
                        assert_eq!(got, want as u32, "{kv} q {q_dtype} out {out_dtype}: element {i}");
                    }
                }
            }
        }
    }
}

/// The tiles in hardware compute what the emulation computes (where this CPU has them):
/// the same products in the same order give the same bits, unless the hardware orders its
/// additions otherwise than the SDM's pseudo-code, which would show here as a tiny NMSE.
#[test]
fn the_hardware_tiles_agree_with_the_emulation() {
    let (_l, dev, mut reg) = setup();
    if !simd::detected_isas().contains(&simd::AMX) {
        eprintln!("this CPU has no AMX: nothing to compare");
        return;
    }
    for kv in [DType::F16, DType::BF16] {
        let c = described(Prefill::fixed(61, 2, 70, 150, 8, 2, 64, 1), true, 0).with_lse().with_kv(
            61,
            (128, 128),
            kv,
            false,
        );
        let emulated = run_on(&dev, &mut reg, simd::AMX_EMULATED, &c, Table::Computed);
        let hardware = run_on(&dev, &mut reg, simd::AMX, &c, Table::Computed);
        let out: Vec<f32> = hardware.out.iter().map(|&x| x as f32).collect();
        let e = nmse(&out, &emulated.out);
        eprintln!("{kv}: hardware vs emulated tiles nmse {e:.2e}, bit-identical {}", same_bits(&hardware, &emulated));
        assert!(e < 1e-12, "{kv}: the hardware tiles differ from the emulation by {e:e}");
    }
}

/// The accuracy of each split (products for Q.K^T, for P.V) against the FMA kernels' on the
/// same cases, the error against the float64 reference itself (an output's rounding
/// included), printed as a table with `--nocapture`: every choice within SPEC's bar; all
/// products at least as accurate as one; the defaults, exact, at the FMA kernels' accuracy.
/// (How close each split's P rounding stays to SPEC's is the planted cases' bar, planted.rs.)
#[test]
fn the_accuracy_of_each_split_against_the_fma_kernels() {
    let (_l, dev, mut reg) = setup();
    let f16_choices = [(1, 1), (2, 2), (2, 3), (3, 2), (3, 3), (4, 4)];
    let bf16_choices = [(1, 1), (1, 2), (2, 1), (2, 2)];
    for (kv, q_dtype, out_dtype) in [
        (DType::F16, DType::F32, DType::F32),
        (DType::BF16, DType::BF16, DType::BF16),
        (DType::BF16, DType::BF16, DType::F32),
    ] {
        // Causal GQA 4 at d128, a fresh prompt (the shape, smaller for the emulation).
        let base = described(Prefill::fixed(71, 1, 192, 192, 8, 2, 64, 0), true, 0);
        let c = Prefill {
            out_dtype,
            scale: 1.0 / (128f32).sqrt(),
            ..base.with_kv(71, (128, 128), kv, false).with_q_dtype(q_dtype)
        };
        // The metric: against the float64 reference itself (O's rounding included).
        let (reference, _) = c.reference();
        let err = |o: &Output| nmse(&o.out.iter().map(|&x| x as f32).collect::<Vec<_>>(), &reference);
        let fma = err(&run_on(&dev, &mut reg, fma_isa(), &c, Table::Computed));
        eprintln!("K/V {kv}, Q {q_dtype}, O {out_dtype}: FMA kernels ({}) nmse {fma:.2e}", fma_isa());
        let bf16 = kv == DType::BF16;
        let choices: &[(u8, u8)] = if bf16 { &bf16_choices } else { &f16_choices };
        let mut errors = Vec::new();
        for &(qk, pv) in choices {
            amx::set_products(bf16, Some(Products { qk, pv })).unwrap();
            let o = run_on(&dev, &mut reg, simd::AMX_EMULATED, &c, Table::Computed);
            let e = err(&o);
            eprintln!("  products qk {qk} pv {pv}: nmse {e:.2e} ({:.2}x the FMA kernels)", e / fma);
            assert!(e < 5e-4, "qk {qk} pv {pv}: nmse {e:e} over SPEC's bar");
            errors.push(((qk, pv), e));
        }
        amx::set_products(bf16, None).unwrap();
        let of = |p: (u8, u8)| errors.iter().find(|x| x.0 == p).unwrap().1;
        let most = if bf16 { (2, 2) } else { (4, 4) };
        assert!(of(most) <= of((1, 1)), "all products no more accurate than one");
        let q_bf16 = q_dtype == DType::BF16;
        let default = amx::products(bf16);
        let d = of((default.qk, default.pv));
        if !q_bf16 {
            // The defaults are the exact products: the FMA kernels' error (to rounding noise).
            assert!(d <= 1.05 * fma, "{kv} default {default:?}: nmse {d:e}, the FMA kernels {fma:e}");
        } else {
            // BF16 Q is read exactly: a second product of Q (its low part, zero) changes no
            // bit; the default, the exact products, is as near the reference as the FMA
            // kernels (which round `scale * q` to half as the reference does; the AMX item's
            // scores are nearer the exact ones, so a little further from the reference's).
            assert_eq!(of((2, 2)), of((1, 2)), "BF16 Q has no low part");
            assert_eq!(of((2, 1)), of((1, 1)), "BF16 Q has no low part");
            assert!(d <= 1.25 * fma, "{kv} default {default:?}: nmse {d:e}, the FMA kernels {fma:e}");
        }
    }
}
