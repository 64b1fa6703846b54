//! The CPU kernels of `flash_attn_prefill` (SPEC 6-9) through the op, against a float64
//! reference: batches of fixed and variable length, described and explicit masks, every Q
//! and O dtype, lse, the bit-identities of SPEC 3, every instruction set. Every run also
//! checks that nothing outside the output rows was written (`common::prefill::run`).

mod common;

use std::sync::{Mutex, MutexGuard};

#[cfg(unix)]
use common::prefill::{run_placed, Placement};
use std::sync::Arc;

use common::prefill::{round_to, run, Buffers, Output, Prefill, Table};
use common::{nmse, read_u8, upload};
use half::f16;
use mlx_native::backend::cpu::{flash_attn_prefill, simd, CpuKernelFn, CpuPipeline};
use mlx_native::interface::{BoundArg, BufferBinding, Dispatch, GridSize, Pipeline};
use mlx_native::ops::flash_attn_prefill::{dispatch_flash_attn_prefill_mask_blk, mask_blk_params, validate};
use mlx_native::params::{FlashAttnPrefillMaskBlkParamsGpu, FlashAttnPrefillParamsGpu};
use mlx_native::{default_registry, DType, KernelRegistry, MlxDevice};

/// The instruction set and the column-skipping switch are process-wide, and several tests
/// compare runs bit for bit: each test holds this lock while it runs kernels.
static SWITCHES: Mutex<()> = Mutex::new(());

fn lock() -> MutexGuard<'static, ()> {
    SWITCHES.lock().unwrap_or_else(|e| e.into_inner())
}

fn setup() -> (MutexGuard<'static, ()>, MlxDevice, KernelRegistry) {
    (lock(), MlxDevice::cpu(), default_registry())
}

/// Runs `f` once per instruction set this CPU has, with that set forced.
fn for_each_isa(mut f: impl FnMut(&str)) {
    for isa in simd::detected_isas() {
        simd::force_isa(Some(isa)).unwrap();
        assert_eq!(simd::selected_isa(), isa, "the forced instruction set is not the one the kernels pick");
        f(isa);
    }
    simd::force_isa(None).unwrap();
}

/// The output against the float64 reference: every value finite, NMSE below 1e-5 (F32
/// output; F16 and BF16 against the reference rounded the same way, each value within one
/// unit of its last place plus 1e-3), lse within 2e-3 and -inf exactly where the reference
/// row sees nothing.
/// Returns the NMSE.
fn check(name: &str, c: &Prefill, o: &Output) -> f64 {
    let (reference, lse) = c.reference();
    assert!(o.out.iter().all(|x| x.is_finite()), "{name}: non-finite output");
    let e = if c.out_dtype == DType::F32 {
        let out: Vec<f32> = o.out.iter().map(|&x| x as f32).collect();
        nmse(&out, &reference)
    } else {
        let rounded: Vec<f64> = reference.iter().map(|&x| round_to(c.out_dtype, x as f32) as f64).collect();
        let ulp = if c.out_dtype == DType::F16 { 2f64.powi(-10) } else { 2f64.powi(-7) };
        for (i, (&a, &b)) in o.out.iter().zip(&rounded).enumerate() {
            let tol = ulp * b.abs() * 1.01 + 1e-3;
            assert!((a - b).abs() <= tol, "{name}: element {i} is {a}, the rounded reference {b}");
        }
        let out: Vec<f32> = o.out.iter().map(|&x| x as f32).collect();
        nmse(&out, &rounded)
    };
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

fn same_bits(a: &Output, b: &Output) -> bool {
    a.out_bits == b.out_bits && a.lse_bits == b.lse_bits
}

fn described(mut c: Prefill, causal: bool, window: usize) -> Prefill {
    (c.causal, c.window) = (causal, window);
    c
}

#[test]
fn fixed_length_batches_with_batch_strides() {
    let (_l, dev, mut reg) = setup();
    let cases = [
        ("d256 gqa2 batch 3 kv 130", Prefill::fixed(1, 3, 45, 130, 4, 2, 256, 1).with_lse()),
        ("d512 mha batch 2 kv 77 causal", described(Prefill::fixed(2, 2, 20, 77, 2, 2, 512, 2), true, 0).with_lse()),
        ("d256 gqa8 batch 4 kv 64 rows 1", Prefill::fixed(3, 4, 1, 64, 8, 1, 256, 0)),
        ("d256 mha batch 2 kv < rows", Prefill::fixed(4, 2, 90, 40, 3, 3, 256, 1).with_lse()),
    ];
    for (name, c) in cases {
        let o = run(&dev, &mut reg, &c, Table::Computed);
        check(name, &c, &o);
    }
    // The sequences are independent: a batch's output is its sequences' outputs one by one.
    let c = Prefill::fixed(5, 3, 33, 100, 4, 2, 256, 1).with_lse();
    let whole = run(&dev, &mut reg, &c, Table::Computed);
    let (rows, nh, hd) = (33, 4, 256);
    let mut c1 = c.clone();
    c1.lens.truncate(1);
    for b in 0..3 {
        c1.q = c.q[b * c.q_strides[0]..].to_vec();
        c1.k = c.k[b * c.k_strides[0]..].to_vec();
        c1.v = c.v[b * c.v_strides[0]..].to_vec();
        let one = run(&dev, &mut reg, &c1, Table::Computed);
        let part = &whole.out_bits[b * rows * nh * hd..(b + 1) * rows * nh * hd];
        assert_eq!(one.out_bits, part, "sequence {b} alone differs from its place in the batch");
    }
}

#[test]
fn causal_and_window_with_a_longer_cache() {
    let (_l, dev, mut reg) = setup();
    let cases = [
        ("d256 causal rows 70 kv 200", described(Prefill::fixed(11, 2, 70, 200, 4, 2, 256, 1), true, 0)),
        ("d256 window 40 rows 70 kv 200", described(Prefill::fixed(12, 2, 70, 200, 4, 2, 256, 0), true, 40)),
        ("d512 window 1 rows 33 kv 100", described(Prefill::fixed(13, 1, 33, 100, 4, 1, 512, 1), true, 1)),
        ("d512 window 100 rows 50 kv 300", described(Prefill::fixed(14, 2, 50, 300, 2, 2, 512, 0), true, 100)),
        ("d256 window 64 fresh rows 150", described(Prefill::fixed(15, 1, 150, 150, 3, 3, 256, 1), true, 64)),
        ("d256 causal fresh rows 100 gqa4", described(Prefill::fixed(16, 1, 100, 100, 8, 2, 256, 0), true, 0)),
    ];
    for (name, c) in cases {
        let c = c.with_lse();
        let o = run(&dev, &mut reg, &c, Table::Computed);
        check(name, &c, &o);
    }
}

#[test]
fn variable_length_sequences() {
    let (_l, dev, mut reg) = setup();
    // An empty prompt, prompts shorter than their caches, one of one row, caches not
    // multiples of 64.
    let lens = [(37, 37), (0, 20), (50, 130), (1, 1), (70, 75), (0, 0), (33, 200)];
    for (name, causal, window, hd) in [
        ("varlen causal d256", true, 0, 256),
        ("varlen window 30 d256", true, 30, 256),
        ("varlen causal d512", true, 0, 512),
        ("varlen window 7 d512", true, 7, 512),
        ("varlen dense d256", false, 0, 256),
    ] {
        let c = described(Prefill::varlen(21 + hd as u64, &lens, 4, 2, hd, 1), causal, window).with_lse();
        let o = run(&dev, &mut reg, &c, Table::Computed);
        check(name, &c, &o);
    }
}

#[test]
fn an_empty_cache_gives_zeros_and_lse_minus_inf() {
    let (_l, dev, mut reg) = setup();
    let lens = [(20, 0), (33, 100), (5, 64), (17, 3), (9, 0)];
    let c = Prefill::varlen(31, &lens, 4, 2, 256, 1).with_lse();
    let o = run(&dev, &mut reg, &c, Table::Computed);
    check("varlen with empty caches", &c, &o);
    let (nh, hd) = (4, 256);
    for (b, &(lq, lk)) in lens.iter().enumerate() {
        if lk > 0 {
            continue;
        }
        for r in 0..lq {
            let row = c.logical_row(b, r);
            assert!(
                o.out_bits[row * nh * hd..(row + 1) * nh * hd].iter().all(|&x| x == 0),
                "sequence {b} row {r}: not +0"
            );
            assert!(
                o.lse[row * nh..(row + 1) * nh].iter().all(|&x| x == f64::NEG_INFINITY),
                "sequence {b} row {r}: lse"
            );
        }
    }
}

#[test]
fn explicit_masks_alone_and_with_causal_shared_and_per_batch() {
    let (_l, dev, mut reg) = setup();
    for (name, causal, window, shared, hd) in [
        ("explicit per batch d256", false, 0, false, 256),
        ("explicit shared d256", false, 0, true, 256),
        ("explicit per batch + causal d512", true, 0, false, 512),
        ("explicit shared + window 50 d256", true, 50, true, 256),
    ] {
        let mut c = described(Prefill::fixed(41 + hd as u64, 2, 45, 150, 4, 2, hd, 1), causal, window).with_lse();
        c.set_peer_mask(7, shared);
        let o = run(&dev, &mut reg, &c, Table::Computed);
        check(name, &c, &o);
    }
}

#[test]
fn every_q_and_out_dtype() {
    let (_l, dev, mut reg) = setup();
    for hd in [256, 512] {
        let base = described(Prefill::fixed(51, 2, 33, 100, 4, 2, hd, 1), true, 50).with_lse();
        for q_dtype in [DType::F32, DType::F16, DType::BF16] {
            let c32 = base.clone().with_q_dtype(q_dtype);
            let o32 = run(&dev, &mut reg, &c32, Table::Computed);
            check(&format!("d{hd} q {q_dtype} out float32"), &c32, &o32);
            for out_dtype in [DType::F16, DType::BF16] {
                let c = Prefill { out_dtype, ..c32.clone() };
                let o = run(&dev, &mut reg, &c, Table::Computed);
                check(&format!("d{hd} q {q_dtype} out {out_dtype}"), &c, &o);
                // Rounded by the kernel from its F32 result, to nearest even.
                for (i, (&got, &f)) in o.out_bits.iter().zip(&o32.out_bits).enumerate() {
                    let x = f32::from_bits(f);
                    let want = if out_dtype == DType::F16 {
                        f16::from_f32(x).to_bits()
                    } else {
                        half::bf16::from_f32(x).to_bits()
                    };
                    assert_eq!(
                        got, want as u32,
                        "d{hd} q {q_dtype} out {out_dtype}: element {i} not the F32 result rounded"
                    );
                }
                assert_eq!(o.lse_bits, o32.lse_bits, "lse depends on the output dtype");
            }
        }
    }
}

/// SPEC 8 over any number of parts: `o = sum_k e^(lse_k - L) o_k`, `L = ln(sum_k e^lse_k)`.
fn merge_all(parts: &[&Output], nh: usize, hd: usize) -> (Vec<f32>, Vec<f64>) {
    let rows = parts[0].lse.len() / nh;
    let (mut out, mut lse) = (vec![0f32; rows * nh * hd], vec![f64::NEG_INFINITY; rows * nh]);
    for i in 0..rows * nh {
        let mx = parts.iter().map(|p| p.lse[i]).fold(f64::NEG_INFINITY, f64::max);
        if mx == f64::NEG_INFINITY {
            continue;
        }
        let l = mx + parts.iter().map(|p| (p.lse[i] - mx).exp()).sum::<f64>().ln();
        for d in 0..hd {
            out[i * hd + d] = parts.iter().map(|p| (p.lse[i] - l).exp() * p.out[i * hd + d]).sum::<f64>() as f32;
        }
        lse[i] = l;
    }
    (out, lse)
}

fn merge(a: &Output, b: &Output, nh: usize, hd: usize) -> (Vec<f32>, Vec<f64>) {
    merge_all(&[a, b], nh, hd)
}

#[test]
fn two_parts_of_a_cache_merge_to_the_whole() {
    let (_l, dev, mut reg) = setup();
    for (name, hd, split, masked) in [
        ("d256 halves, peer mask", 256, 128, true),
        ("d256 100 + 156, peer mask", 256, 100, true),
        ("d512 70 + 186, no mask", 512, 70, false),
    ] {
        let mut c = Prefill::fixed(61, 2, 40, 256, 4, 2, hd, 1).with_lse();
        if masked {
            c.set_peer_mask(9, false);
        }
        let whole = run(&dev, &mut reg, &c, Table::Computed);
        check(name, &c, &whole);
        let first = run(&dev, &mut reg, &c.cache_part(0, split), Table::Computed);
        let second = run(&dev, &mut reg, &c.cache_part(split, 256), Table::Computed);
        let (out, lse) = merge(&first, &second, 4, hd);
        let (reference, ref_lse) = c.reference();
        let e = nmse(&out, &reference);
        eprintln!("{name:60} merged nmse {e:.2e}");
        assert!(e < 1e-5, "{name}: merged nmse {e:e}");
        for (i, (&got, &want)) in lse.iter().zip(&ref_lse).enumerate() {
            assert!(got == want || (got - want).abs() < 2e-3, "{name}: merged lse {i} is {got}, the reference {want}");
            assert!(got == whole.lse[i] || (got - whole.lse[i]).abs() < 2e-3, "{name}: merged lse {i} vs the whole's");
        }
    }
}

#[test]
fn an_explicit_offset_places_the_queries_in_the_cache() {
    let (_l, dev, mut reg) = setup();
    let with_offset = |mut c: Prefill, off: i64| {
        c.offset = Some(off);
        c
    };
    let cases = [
        // Rows below 20 see nothing; a chunk inside the cache; one past it (every row sees all).
        ("causal offset -20 d256", with_offset(described(Prefill::fixed(131, 2, 40, 150, 4, 2, 256, 1), true, 0), -20)),
        ("causal offset 37 d512", with_offset(described(Prefill::fixed(132, 2, 40, 150, 4, 2, 512, 1), true, 0), 37)),
        ("causal offset 200 d256", with_offset(described(Prefill::fixed(133, 1, 40, 150, 2, 1, 256, 0), true, 0), 200)),
        (
            "window 30 offset 60 d256",
            with_offset(described(Prefill::fixed(134, 2, 70, 150, 4, 2, 256, 1), true, 30), 60),
        ),
        // A cache shorter than the prompt, and an empty prompt.
        (
            "varlen causal offset 10 d256",
            with_offset(described(Prefill::varlen(135, &[(30, 80), (0, 10), (50, 20)], 4, 2, 256, 1), true, 0), 10),
        ),
        (
            "varlen window 16 offset -5 d512",
            with_offset(described(Prefill::varlen(136, &[(40, 70), (33, 33)], 2, 2, 512, 0), true, 16), -5),
        ),
    ];
    for (name, c) in cases {
        let c = c.with_lse();
        let o = run(&dev, &mut reg, &c, Table::Computed);
        check(name, &c, &o);
        let (nh, hd) = (c.n_heads, c.head_dim);
        for (b, &(lq, lk)) in c.lens.iter().enumerate() {
            for r in 0..lq {
                if (0..lk).any(|j| c.visible(b, r, j)) {
                    continue;
                }
                let row = c.logical_row(b, r);
                assert!(
                    o.out_bits[row * nh * hd..(row + 1) * nh * hd].iter().all(|&x| x == 0),
                    "{name}: row {row} not +0"
                );
                assert!(
                    o.lse[row * nh..(row + 1) * nh].iter().all(|&x| x == f64::NEG_INFINITY),
                    "{name}: row {row} lse"
                );
            }
        }
        if !c.varlen {
            // The same placement given as an explicit mask: the same bits.
            let mut explicit = Prefill { causal: false, window: 0, offset: None, ..c.clone() };
            explicit.set_mask(true, 0, |b, r, j| if c.visible(b, r, j) { 0.0 } else { f32::NEG_INFINITY });
            let e = run(&dev, &mut reg, &explicit, Table::Computed);
            assert!(same_bits(&o, &e), "{name}: described and explicit differ");
        }
    }
}

#[test]
fn parts_of_a_cache_with_their_offsets_merge_to_the_whole_causal_prefill() {
    let (_l, dev, mut reg) = setup();
    for (name, hd, window, cuts) in [
        ("d256 causal, cut at 128 and 200", 256, 0, vec![0, 128, 200, 300]),
        ("d512 window 100, cut at 150", 512, 100, vec![0, 150, 300]),
        ("d256 window 40, cut at 70, 230 and 250", 256, 40, vec![0, 70, 230, 250, 300]),
    ] {
        let c = described(Prefill::fixed(141, 2, 64, 300, 4, 2, hd, 1), true, window).with_lse();
        let parts: Vec<Output> =
            cuts.windows(2).map(|w| run(&dev, &mut reg, &c.cache_part(w[0], w[1]), Table::Computed)).collect();
        let (out, lse) = merge_all(&parts.iter().collect::<Vec<_>>(), 4, hd);
        let (reference, ref_lse) = c.reference();
        let e = nmse(&out, &reference);
        eprintln!("{name:60} merged nmse {e:.2e}");
        assert!(e < 1e-5, "{name}: merged nmse {e:e}");
        for (i, (&got, &want)) in lse.iter().zip(&ref_lse).enumerate() {
            assert!(got == want || (got - want).abs() < 2e-3, "{name}: merged lse {i} is {got}, the reference {want}");
        }
    }
}

#[test]
fn fully_masked_rows_give_zeros_and_lse_minus_inf() {
    let (_l, dev, mut reg) = setup();
    for (hd, causal) in [(256, false), (512, true)] {
        let mut c = described(Prefill::fixed(71, 2, 37, 150, 4, 2, hd, 1), causal, 0).with_lse();
        let mut rng = common::Rng::new(3);
        // Sequence 1, rows 3 and 36 (the last, in a partial tile): every column -inf;
        // row 10 of sequence 0: -inf exactly where causal would let it see.
        let off = 150 - 37;
        c.set_mask(false, 2, |b, r, j| {
            if (b == 1 && (r == 3 || r == 36)) || (b == 0 && r == 10 && j <= r + off) {
                f32::NEG_INFINITY
            } else {
                rng.uniform(-1.0, 1.0)
            }
        });
        let o = run(&dev, &mut reg, &c, Table::Computed);
        check(&format!("d{hd} fully masked rows, causal {causal}"), &c, &o);
        let (nh, hd) = (4, hd);
        let mut rows = vec![c.logical_row(1, 3), c.logical_row(1, 36)];
        if causal {
            rows.push(c.logical_row(0, 10));
        }
        for row in rows {
            assert!(o.out_bits[row * nh * hd..(row + 1) * nh * hd].iter().all(|&x| x == 0), "row {row}: not +0");
            assert!(o.lse[row * nh..(row + 1) * nh].iter().all(|&x| x == f64::NEG_INFINITY), "row {row}: lse not -inf");
        }
    }
}

#[test]
fn a_computed_table_changes_no_bit() {
    let (_l, dev, mut reg) = setup();
    for (name, causal, window, shared, hd) in [
        ("per batch d256", false, 0, false, 256),
        ("shared d512", false, 0, true, 512),
        ("per batch + causal d256", true, 0, false, 256),
        ("shared + window 40 d512", true, 40, true, 512),
    ] {
        let mut c = described(Prefill::fixed(81, 2, 50, 170, 4, 2, hd, 1), causal, window).with_lse();
        c.set_peer_mask(11, shared);
        let computed = run(&dev, &mut reg, &c, Table::Computed);
        let ones = run(&dev, &mut reg, &c, Table::AllOnes);
        assert!(computed.blk.iter().any(|&b| b != 1), "{name}: the computed table is all ones");
        assert!(same_bits(&computed, &ones), "{name}: the computed table {:?} changes the output", computed.blk);
    }
}

#[test]
fn a_described_mask_equals_the_same_mask_given_explicitly() {
    let (_l, dev, mut reg) = setup();
    for (name, rows, kv, window, hd, with_peer) in [
        ("causal kv 200 rows 70 d256", 70, 200, 0, 256, false),
        ("window 40 kv 200 rows 70 d256", 70, 200, 40, 256, false),
        ("causal fresh 130 d512", 130, 130, 0, 512, false),
        ("window 1 kv 100 rows 33 d512", 33, 100, 1, 512, false),
        ("window 64 kv 333 rows 150 d256", 150, 333, 64, 256, false),
        // The diagonal ends a step exactly at a tile's first row (offsets 30 and 14), and a
        // window's edge starts a step left of the diagonal exactly at a tile's last row
        // (windows 95 and 79).
        ("causal kv 80 rows 50 d256", 50, 80, 0, 256, false),
        ("causal kv 74 rows 60 d512", 60, 74, 0, 512, false),
        ("window 95 fresh 230 d256", 230, 230, 95, 256, false),
        ("window 79 fresh 160 d512", 160, 160, 79, 512, false),
        ("causal + peer mask kv 150 rows 45 d256", 45, 150, 0, 256, true),
        ("window 30 + peer mask kv 150 rows 45 d512", 45, 150, 30, 512, true),
    ] {
        let mut desc = described(Prefill::fixed(91, 2, rows, kv, 4, 2, hd, 1), true, window).with_lse();
        if with_peer {
            desc.set_peer_mask(13, false);
        }
        let mut explicit = Prefill { causal: false, window: 0, ..desc.clone() };
        let d2 = desc.clone();
        explicit.set_mask(!with_peer, 0, |b, r, j| {
            if !d2.visible(b, r, j) {
                f32::NEG_INFINITY
            } else {
                d2.mask.as_ref().map_or(0.0, |m| f16::from_bits(m.data[d2.mask_at(b, r, j)]).to_f32())
            }
        });
        let a = run(&dev, &mut reg, &desc, Table::Computed);
        let b = run(&dev, &mut reg, &explicit, Table::Computed);
        check(name, &desc, &a);
        assert!(same_bits(&a, &b), "{name}: described and explicit differ");
    }
}

#[test]
fn leaving_out_unseen_cache_rows_changes_no_bit() {
    let (_l, dev, mut reg) = setup();
    let mut peer = described(Prefill::fixed(101, 2, 45, 150, 4, 2, 256, 1), true, 0).with_lse();
    peer.set_peer_mask(17, false);
    let cases = [
        ("window 40", described(Prefill::fixed(102, 2, 70, 200, 4, 2, 256, 0), true, 40).with_lse()),
        (
            "varlen causal d512",
            described(Prefill::varlen(103, &[(37, 37), (50, 130), (0, 20), (20, 25)], 2, 1, 512, 1), true, 0),
        ),
        ("causal + peer", peer),
    ];
    for (name, c) in cases {
        let skipping = run(&dev, &mut reg, &c, Table::Computed);
        flash_attn_prefill::set_column_skipping(false);
        assert!(!flash_attn_prefill::column_skipping(), "the switch did not turn column skipping off");
        let full = run(&dev, &mut reg, &c, Table::Computed);
        flash_attn_prefill::set_column_skipping(true);
        assert!(flash_attn_prefill::column_skipping(), "the switch did not turn column skipping back on");
        assert!(same_bits(&skipping, &full), "{name}: skipping unseen cache rows changes the output");
    }
}

#[test]
fn every_instruction_set_matches_the_reference() {
    let (_l, dev, mut reg) = setup();
    let mut peer = described(Prefill::fixed(111, 2, 45, 150, 4, 2, 512, 1), true, 0).with_lse();
    peer.set_peer_mask(19, true);
    let cases = [
        ("window 40 d256", described(Prefill::fixed(112, 2, 70, 200, 4, 2, 256, 1), true, 40).with_lse()),
        (
            "varlen causal d256",
            described(Prefill::varlen(113, &[(37, 37), (0, 9), (50, 130)], 4, 1, 256, 0), true, 0).with_lse(),
        ),
        ("causal + peer d512", peer),
        (
            "q bf16 out f16 d256",
            Prefill { out_dtype: DType::F16, ..Prefill::fixed(114, 1, 40, 90, 2, 2, 256, 1).with_q_dtype(DType::BF16) },
        ),
    ];
    for (name, c) in cases {
        let mut outs = Vec::new();
        for_each_isa(|isa| {
            let o = run(&dev, &mut reg, &c, Table::Computed);
            check(&format!("{name} [{isa}]"), &c, &o);
            outs.push((isa.to_string(), o));
        });
        let first: Vec<f64> = outs[0].1.out.clone();
        for (isa, o) in &outs[1..] {
            let out: Vec<f32> = o.out.iter().map(|&x| x as f32).collect();
            let e = nmse(&out, &first);
            // The AMX tiles add the products in another order, which moves the half rounding
            // of a few P.
            let bar = if outs[0].0 == simd::AMX { 1e-8 } else { 1e-9 };
            assert!(
                e < bar || (c.out_dtype != DType::F32 && e < 1e-6),
                "{name}: {isa} differs from {}: {e:e}",
                outs[0].0
            );
        }
    }
}

/// Q, K, V and the explicit mask in the caller's memory, each ending at its last element
/// right before a page that faults on any access: the kernel reads nothing past a tensor. The
/// last sequence's last step is partial with a cache length that is not a multiple of 4 (a
/// step's computed cache rows end at a multiple of 4), its last query tile partial, and the
/// mask's last row ends at the cache's end.
#[cfg(unix)]
#[test]
fn no_input_is_read_past_its_last_element() {
    let (_l, dev, mut reg) = setup();
    let mut peer = Prefill::fixed(151, 2, 45, 77, 4, 2, 256, 1).with_lse();
    peer.set_peer_mask(21, false);
    let mut shared = described(Prefill::fixed(152, 2, 20, 101, 2, 1, 512, 0), true, 0);
    shared.set_peer_mask(22, true);
    let cases = [
        ("causal kv 77 d256", described(Prefill::fixed(153, 2, 33, 77, 4, 2, 256, 1), true, 0).with_lse()),
        ("dense kv 130 d512", Prefill::fixed(154, 1, 20, 130, 2, 1, 512, 0)),
        (
            "varlen window 9 d256",
            described(Prefill::varlen(155, &[(20, 64), (37, 101)], 4, 2, 256, 1), true, 9).with_lse(),
        ),
        ("peer mask kv 77 d256", peer),
        ("shared mask + causal kv 101 d512", shared),
        (
            "q bf16 out f16 kv 93 d512",
            Prefill {
                out_dtype: DType::F16,
                ..described(Prefill::fixed(156, 1, 17, 93, 2, 2, 512, 2), true, 0).with_q_dtype(DType::BF16)
            },
        ),
    ];
    for (name, c) in cases {
        for_each_isa(|isa| {
            let o = run_placed(&dev, &mut reg, &c, Table::Computed, Placement::Guarded);
            check(&format!("{name} [{isa}], guarded"), &c, &o);
        });
    }
}

/// SPEC 1 for one tile, element by element: columns at or past `kv_len` are masked.
fn tile_class(vals: &[Option<u16>]) -> u8 {
    let masked = |v: &Option<u16>| match v {
        None => true,
        Some(h) => {
            let x = f16::from_bits(*h).to_f32();
            x <= -65504.0 // NaN compares false: not masked
        }
    };
    let zero = |v: &Option<u16>| matches!(v, Some(h) if f16::from_bits(*h).to_f32() == 0.0);
    if vals.iter().all(masked) {
        0
    } else if vals.iter().all(zero) {
        2
    } else {
        1
    }
}

#[test]
fn the_mask_classifier_follows_spec_1_over_a_batch_and_past_the_cache() {
    let (_l, dev, mut reg) = setup();
    let ninf = f32::NEG_INFINITY;
    for (hd, shared) in [(256, false), (512, false), (256, true)] {
        let mut c = Prefill::fixed(121, 3, 45, 150, 2, 1, hd, 0);
        let mut rng = common::Rng::new(23);
        let bq = if hd == 256 { 32 } else { 16 };
        // Per (batch, row tile, column tile) a kind: random, -inf, -65504, zero, -0, a
        // negative NaN in a -inf tile, a zero tile whose columns run past kv_len.
        c.set_mask(shared, 6, |b, r, j| {
            let kind = (b * 2 + (r / bq) * 3 + j / 64) % 7;
            match kind {
                0 => rng.uniform(-1.0, 1.0),
                1 => ninf,
                2 => -65504.0,
                3 => 0.0,
                4 => -0.0,
                5 => {
                    if r % 5 == 1 && j % 9 == 2 {
                        -f32::NAN
                    } else {
                        ninf
                    }
                }
                _ => {
                    if j % 64 == 63 {
                        0.5
                    } else {
                        0.0
                    }
                }
            }
        });
        let p = c.params();
        let m = c.mask.as_ref().unwrap();
        let mask = upload(&dev, DType::F16, &m.data);
        let tables = if shared { 1 } else { 3 };
        let (rows_t, steps) = (45usize.div_ceil(bq), 150usize.div_ceil(64));
        // One byte more than the tables: it must stay as it was.
        let blk = dev.alloc_buffer(DType::U8, &[tables * rows_t * steps + 1]).unwrap();
        blk.write_bytes(0, &vec![0xaa; tables * rows_t * steps + 1]).unwrap();
        let mut enc = dev.command_encoder();
        dispatch_flash_attn_prefill_mask_blk(&mut enc, &mut reg, &dev, &mask, &blk, &p).unwrap();
        enc.commit_and_wait().unwrap();
        let got = read_u8(&blk);
        assert_eq!(got[tables * rows_t * steps], 0xaa, "a byte past the tables was written");
        for b in 0..tables {
            for qt in 0..rows_t {
                for kt in 0..steps {
                    let vals: Vec<Option<u16>> = (qt * bq..(qt * bq + bq).min(45))
                        .flat_map(|r| (kt * 64..kt * 64 + 64).map(move |j| (r, j)))
                        .map(|(r, j)| (j < 150).then(|| m.data[c.mask_at(b, r, j)]))
                        .collect();
                    let at = (b * rows_t + qt) * steps + kt;
                    assert_eq!(got[at], tile_class(&vals), "d{hd} shared {shared}: table {b} tile ({qt}, {kt})");
                }
            }
        }
        for want in [0u8, 1, 2] {
            assert!(got[..tables * rows_t * steps].contains(&want), "no tile of class {want}: {got:?}");
        }
        // The last column tile runs past kv_len (150 = 2 * 64 + 22): never 2.
        assert!((0..tables * rows_t).all(|t| got[t * steps + steps - 1] != 2), "a tile past the cache's end is 2");
    }
}

/// A dispatch of a CPU kernel built by hand (as a backend that skips the op would): `block`
/// at 0, then the buffers at their indices (an absent one bound as Q), `swap` replacing some.
fn by_hand(name: &str, kernel: CpuKernelFn, block: &[u8], b: &Buffers, swap: &[(u64, BufferBinding)]) -> Dispatch {
    let q = b.q.binding();
    let or_q = |x: Option<&mlx_native::MlxBuffer>| x.map_or(q.clone(), |x| x.binding());
    let mut bound = vec![
        (1, q.clone()),
        (2, b.k.binding()),
        (3, b.v.binding()),
        (4, or_q(b.mask.as_ref())),
        (5, or_q(b.blk.as_ref())),
        (6, b.out.binding()),
        (7, or_q(b.lse.as_ref())),
        (8, or_q(b.cu.as_ref().map(|c| &c.0))),
        (9, or_q(b.cu.as_ref().map(|c| &c.1))),
    ];
    for (i, x) in swap {
        bound.iter_mut().find(|(j, _)| j == i).unwrap().1 = x.clone();
    }
    let mut args = vec![(0, BoundArg::Bytes(block.to_vec()))];
    args.extend(bound.into_iter().map(|(i, x)| (i, BoundArg::Buffer(x))));
    Dispatch {
        pipeline: Pipeline::new(name, 1024, Arc::new(CpuPipeline { kernel })),
        args,
        shared: vec![],
        grid: GridSize::new(1, 1, 1),
        threadgroup: GridSize::new(32, 8, 1),
        options: Default::default(),
    }
}

/// A binding of `b` one element shorter.
fn short(b: &mlx_native::MlxBuffer) -> BufferBinding {
    let x = b.binding();
    BufferBinding { byte_len: x.byte_len - b.dtype().size_of(), ..x }
}

/// The CPU kernels check what they rely on, for a dispatch the op did not make: a block no
/// op makes (a field out of range, inconsistent with the kernel or the flags) or a buffer
/// smaller than the block says is refused, and nothing is written; the op's own block runs
/// and gives the op's bits, and an empty batch or prompt writes nothing.
#[test]
fn the_cpu_kernels_refuse_blocks_and_buffers_no_op_makes() {
    let (_l, dev, mut reg) = setup();
    let mut c = described(Prefill::fixed(161, 2, 40, 100, 4, 2, 256, 1), true, 0).with_lse();
    c.set_peer_mask(23, false);
    let want = run(&dev, &mut reg, &c, Table::Computed);
    let bufs = c.buffers(&dev);
    let (mask, blk) = (bufs.mask.as_ref().unwrap(), bufs.blk.as_ref().unwrap());
    let mut enc = dev.command_encoder();
    dispatch_flash_attn_prefill_mask_blk(&mut enc, &mut reg, &dev, mask, blk, &c.params()).unwrap();
    enc.commit_and_wait().unwrap();
    let g = validate(&bufs.view(), &c.params()).unwrap().gpu;
    let kernel: CpuKernelFn = flash_attn_prefill::KERNELS.iter().find(|k| k.0 == "flash_attn_prefill_d256").unwrap().1;
    let go = |g: &FlashAttnPrefillParamsGpu, swap: &[(u64, BufferBinding)]| {
        let d = by_hand("flash_attn_prefill_d256", kernel, bytemuck::bytes_of(g), &bufs, swap);
        kernel(&d)
    };
    let sentinel = vec![0xffu8; bufs.out.data_byte_len()];
    let refuse = |what: &str, g: &FlashAttnPrefillParamsGpu, swap: &[(u64, BufferBinding)]| {
        bufs.out.write_bytes(0, &sentinel).unwrap();
        let err = go(g, swap).expect_err(what);
        assert!(
            matches!(&err, mlx_native::MlxError::Internal(m) if m.starts_with("flash_attn_prefill (cpu): ")),
            "{what}: {err:?}"
        );
        assert!(read_u8(&bufs.out) == sentinel, "{what}: out was written");
    };
    go(&g, &[]).unwrap();
    let out: Vec<u32> = bytemuck::cast_slice::<u8, f32>(&read_u8(&bufs.out)).iter().map(|x| x.to_bits()).collect();
    for (i, &bits) in want.out_bits.iter().enumerate() {
        let (row, rest) = (i / (4 * 256), i % (4 * 256));
        let (b, r) = (row / 40, row % 40);
        assert_eq!(out[c.out_at(b, r, rest / 256) + rest % 256], bits, "the block by hand differs from the op at {i}");
    }
    let f = |edit: fn(&mut FlashAttnPrefillParamsGpu)| {
        let mut x = g;
        edit(&mut x);
        x
    };
    let blocks: Vec<(&str, FlashAttnPrefillParamsGpu)> = vec![
        ("head dim 512 on the d256 kernel", f(|x| x.head_dim = 512)),
        // Each dim alone, smaller than the kernel's (the buffers still hold the block).
        ("Q/K head dim 128 on the d256 kernel", f(|x| x.head_dim = 128)),
        ("V head dim 128 on the d256 kernel", f(|x| x.head_dim_v = 128)),
        ("a negative softcap", f(|x| x.softcap = -1.0)),
        ("an infinite softcap", f(|x| x.softcap = f32::INFINITY)),
        ("a NaN softcap", f(|x| x.softcap = f32::NAN)),
        ("a negative max_bias", f(|x| x.max_bias = -1.0)),
        ("an infinite max_bias", f(|x| x.max_bias = f32::INFINITY)),
        (
            "ALiBi with neither a mask nor causal",
            f(|x| {
                x.max_bias = 1.0;
                x.flags &= !(mlx_native::params::PREFILL_MASK | mlx_native::params::PREFILL_CAUSAL);
            }),
        ),
        ("no heads", f(|x| x.n_heads = 0)),
        ("no KV heads", f(|x| x.n_kv_heads = 0)),
        ("heads that do not group", f(|x| x.n_heads = 3)),
        ("a negative window", f(|x| x.window = -1)),
        ("a Q dtype code 3", f(|x| x.q_dtype = 3)),
        ("an O dtype code -1", f(|x| x.o_dtype = -1)),
        ("a negative stride", f(|x| x.k_row_stride = -1)),
        ("a negative batch", f(|x| x.batch = -1)),
        ("a mask with variable length", f(|x| x.flags |= mlx_native::params::PREFILL_VARLEN)),
        ("a table of 0-row tiles", f(|x| x.blk_bq = 0)),
        ("a table narrower than the cache", f(|x| x.blk_steps = 1)),
        ("a table of another batch stride", f(|x| x.blk_batch_stride += 1)),
        ("a table of other tiles", f(|x| x.blk_bq = 16)),
        ("more sequences", f(|x| x.batch = 3)),
    ];
    for (what, bad) in &blocks {
        refuse(what, bad, &[]);
    }
    for (what, i, b) in [
        ("q", 1, short(&bufs.q)),
        ("k", 2, short(&bufs.k)),
        ("v", 3, short(&bufs.v)),
        ("mask", 4, short(mask)),
        ("blk", 5, short(blk)),
        ("out", 6, short(&bufs.out)),
        ("lse", 7, short(bufs.lse.as_ref().unwrap())),
    ] {
        refuse(&format!("{what} one element short"), &g, &[(i, b)]);
    }
    // Nothing to compute: no sequence, or no query row (the table's size is then 0).
    for (what, empty) in [("batch 0", f(|x| x.batch = 0)), ("rows 0", f(|x| x.rows = 0))] {
        bufs.out.write_bytes(0, &sentinel).unwrap();
        go(&empty, &[]).unwrap_or_else(|e| panic!("{what}: {e:?}"));
        assert!(read_u8(&bufs.out) == sentinel, "{what}: out was written");
    }

    // Variable length: cu_seqlens that do not lie inside the tensors.
    let mut v = described(Prefill::varlen(162, &[(20, 30), (0, 10), (17, 40)], 4, 2, 256, 1), true, 0).with_lse();
    v.lse_strides = None;
    let vb = v.buffers(&dev);
    let vg = validate(&vb.view(), &v.params()).unwrap().gpu;
    let vgo = |cq: &[i32], ck: &[i32]| {
        let (a, b) = (upload(&dev, DType::I32, cq), upload(&dev, DType::I32, ck));
        let d = by_hand(
            "flash_attn_prefill_d256",
            kernel,
            bytemuck::bytes_of(&vg),
            &vb,
            &[(8, a.binding()), (9, b.binding())],
        );
        kernel(&d)
    };
    let (cq, ck) = v.cu_seqlens();
    vgo(&cq, &ck).unwrap();
    for (what, q, k) in [
        ("cu_seqlens_q from 1", vec![1, 20, 20, 37], ck.clone()),
        ("cu_seqlens_k decreasing", cq.clone(), vec![0, 30, 29, 80]),
        ("cu_seqlens_q past the rows", vec![0, 20, 20, 38], ck.clone()),
        ("cu_seqlens_k past the cache", cq.clone(), vec![0, 30, 40, 81]),
        ("cu_seqlens_q of batch entries", cq[..3].to_vec(), ck.clone()),
        ("cu_seqlens_k of batch entries", cq.clone(), ck[..3].to_vec()),
    ] {
        let err = vgo(&q, &k).expect_err(what);
        assert!(
            matches!(&err, mlx_native::MlxError::Internal(m) if m.starts_with("flash_attn_prefill (cpu): ")),
            "{what}: {err:?}"
        );
        // A short cu_seqlens is refused for its size, before a value of it is read.
        if what.ends_with("of batch entries") {
            assert!(err.to_string().contains("smaller than its strides need"), "{what}: {err:?}");
        }
    }
    // A shorter total is fine (the tensors hold more rows than the sequences use).
    vgo(&[0, 20, 20, 36], &[0, 30, 40, 79]).unwrap();
}

/// The same for the mask classifier: a block no op makes, or a buffer smaller than it says,
/// is refused and no table byte written.
#[test]
fn the_cpu_mask_classifier_refuses_blocks_and_buffers_no_op_makes() {
    let (_l, dev, _reg) = setup();
    let mut c = Prefill::fixed(163, 2, 40, 100, 4, 2, 256, 1);
    c.set_peer_mask(29, false);
    let bufs = c.buffers(&dev);
    let (mask, blk) = (bufs.mask.as_ref().unwrap(), bufs.blk.as_ref().unwrap());
    let g = mask_blk_params(&c.params()).unwrap();
    let kernel: CpuKernelFn = flash_attn_prefill::run_mask_blk;
    let go = |g: &FlashAttnPrefillMaskBlkParamsGpu, swap: &[(u64, BufferBinding)]| {
        let mut d = by_hand("flash_attn_prefill_mask_blk", kernel, bytemuck::bytes_of(g), &bufs, &[]);
        d.args =
            vec![(0, d.args[0].1.clone()), (1, BoundArg::Buffer(mask.binding())), (2, BoundArg::Buffer(blk.binding()))];
        for (i, x) in swap {
            d.args[*i as usize] = (*i, BoundArg::Buffer(x.clone()));
        }
        kernel(&d)
    };
    let sentinel = vec![0xeeu8; blk.data_byte_len()];
    blk.write_bytes(0, &sentinel).unwrap();
    go(&g, &[]).unwrap();
    assert!(read_u8(blk).iter().all(|&x| x <= 2), "a table byte not written");
    let f = |edit: fn(&mut FlashAttnPrefillMaskBlkParamsGpu)| {
        let mut x = g;
        edit(&mut x);
        x
    };
    for (what, bad, swap) in [
        ("a negative batch", f(|x| x.batch = -1), vec![]),
        ("negative rows", f(|x| x.rows = -1), vec![]),
        ("a negative kv_len", f(|x| x.kv_len = -1), vec![]),
        ("negative steps", f(|x| x.steps = -1), vec![]),
        ("0-row tiles", f(|x| x.bq = 0), vec![]),
        ("0-column tiles", f(|x| x.bk = 0), vec![]),
        ("a negative batch stride", f(|x| x.mask_batch_stride = -1), vec![]),
        ("a negative row stride", f(|x| x.mask_row_stride = -1), vec![]),
        ("another row stride", f(|x| x.mask_row_stride += 1), vec![]),
        ("more masks", f(|x| x.batch = 3), vec![]),
        ("more steps", f(|x| x.steps = 3), vec![]),
        ("the mask one element short", g, vec![(1u64, short(mask))]),
        ("the table one byte short", g, vec![(2u64, short(blk))]),
    ] {
        blk.write_bytes(0, &sentinel).unwrap();
        let err = go(&bad, &swap).expect_err(what);
        assert!(
            matches!(&err, mlx_native::MlxError::Internal(m) if m.starts_with("flash_attn_prefill_mask_blk (cpu): ")),
            "{what}: {err:?}"
        );
        // A negative field is refused as such, before a size is computed from it.
        if what.starts_with("a negative") || what.starts_with("negative") {
            assert!(err.to_string().contains("params break the op's contract"), "{what}: {err:?}");
        }
        assert!(read_u8(blk) == sentinel, "{what}: the table was written");
    }
    // Nothing to classify (no mask, no row): nothing written; no column: every tile 0.
    for (what, empty) in [("batch 0", f(|x| x.batch = 0)), ("rows 0", f(|x| x.rows = 0))] {
        blk.write_bytes(0, &sentinel).unwrap();
        go(&empty, &[]).unwrap_or_else(|e| panic!("{what}: {e:?}"));
        assert!(read_u8(blk) == sentinel, "{what}: the table was written");
    }
    go(&f(|x| x.kv_len = 0), &[]).unwrap();
    assert!(read_u8(blk).iter().all(|&x| x == 0), "kv_len 0: a tile not 0");
}
