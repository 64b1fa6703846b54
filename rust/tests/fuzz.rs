//! Property tests of the op layer on every backend present: arbitrary params, buffer dtypes,
//! sizes, views and strides, valid and invalid. Every dispatch either matches the float64
//! reference or returns the `InvalidArgument` that SPEC section 2's validation list names
//! (an independent predicate, [`expected_error`], says which); nothing panics; no byte of any
//! allocation changes except the output's own range (the guard bytes around it included).
//!
//! Cases per property (and per CPU instruction set): `MLXN_FUZZ_CASES` (default 600 for the
//! attention op, 300 for the blk op and the handle model); fixed seeds unless
//! `MLXN_FUZZ_SEED` is a number or `random`.

mod common;

use std::cell::{Cell, RefCell};

use common::Rng;
use half::f16;
use mlx_native::backend::available_backends;
use mlx_native::ops::flash_attn_prefill_blk::{dispatch_flash_attn_prefill_blk, FlashAttnPrefillBlkParams};
use mlx_native::ops::flash_attn_prefill_tensor::{
    dispatch_flash_attn_prefill_tensor_f16, FlashAttnPrefillTensorParams,
};
use mlx_native::{default_registry, DType, KernelRegistry, MlxBuffer, MlxDevice, MlxError};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestRunner};

const I32_MAX: u64 = i32::MAX as u64;

fn cases(default: u32) -> u32 {
    std::env::var("MLXN_FUZZ_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

fn runner(default_cases: u32, salt: u64) -> TestRunner {
    let seed = match std::env::var("MLXN_FUZZ_SEED").ok().as_deref() {
        None => RngSeed::Fixed(0x5eed_0000 + salt),
        Some("random") => RngSeed::Random,
        Some(s) => RngSeed::Fixed(s.parse::<u64>().expect("MLXN_FUZZ_SEED: a number or `random`") + salt),
    };
    TestRunner::new(Config {
        cases: cases(default_cases),
        failure_persistence: None,
        rng_seed: seed,
        max_shrink_iters: 2000,
        ..Config::default()
    })
}

fn devices() -> Vec<MlxDevice> {
    available_backends()
        .into_iter()
        .map(|name| MlxDevice::new(name).unwrap_or_else(|e| panic!("{name} is listed but does not open: {e}")))
        .collect()
}

// ------------------------------------------------------------------ the drawn problem

/// How a buffer's element count relates to what its strides need.
#[derive(Debug, Clone, Copy)]
enum Size {
    Exact,
    OneShort,
    Extra(u8),
}

/// One dispatch as drawn: shape, strides, per-buffer dtype and size, layout in memory.
#[derive(Debug, Clone)]
struct Draw {
    p: FlashAttnPrefillTensorParams,
    dtypes: [DType; 6], // q k v mask blk out
    sizes: [Size; 6],
    /// Every buffer carved out of one allocation (with gaps) instead of one each.
    arena: bool,
    /// Place `out` over this input (0..5 = q k v mask blk) inside the arena.
    overlap: Option<usize>,
    /// Guard bytes before the output (a multiple of 4).
    guard: usize,
    mask_seed: u64,
    data_seed: u64,
}

const NAMES: [&str; 6] = ["q", "k", "v", "mask", "blk", "out"];
const WANT: [DType; 6] = [DType::F32, DType::F16, DType::F16, DType::F16, DType::U8, DType::F32];
/// Elements above which a buffer is not allocated at its drawn size (it gets a small one).
const CAP_ELEMS: u128 = 1 << 20;

fn odd_u32() -> impl Strategy<Value = u32> {
    prop_oneof![
        Just(0u32),
        Just(i32::MAX as u32),
        Just(1u32 << 31),
        Just(u32::MAX),
        Just(u32::MAX - 63),
        Just((1u32 << 31) - 64),
        1u32..100_000,
    ]
}

fn maybe_odd(normal: impl Strategy<Value = u32> + 'static) -> BoxedStrategy<u32> {
    prop_oneof![30 => normal, 1 => odd_u32()].boxed()
}

fn dtype_draw(want: DType) -> BoxedStrategy<DType> {
    prop_oneof![40 => Just(want), 1 => proptest::sample::select(DType::ALL.to_vec())].boxed()
}

fn size_draw() -> BoxedStrategy<Size> {
    prop_oneof![20 => Just(Size::Exact), 2 => Just(Size::OneShort), 4 => (1u8..9).prop_map(Size::Extra)].boxed()
}

/// A stride of `base` elements plus padding, or (rarely) something odd: 0, overlapping,
/// unaligned, at or past the i32 limit.
fn stride_draw(base: u32, unit: u32) -> BoxedStrategy<u32> {
    prop_oneof![
        30 => (0u32..3).prop_map(move |pad| base.saturating_add(pad * unit)),
        2 => Just(0u32),
        2 => Just(base.saturating_sub(unit)),
        1 => Just(base.saturating_add(1)),
        1 => odd_u32(),
    ]
    .boxed()
}

fn draw() -> impl Strategy<Value = Draw> {
    let shape = (
        prop_oneof![12 => Just(256u32), 6 => Just(512u32), 1 => prop_oneof![Just(0u32), Just(128), Just(255), Just(1024), Just(u32::MAX)]],
        maybe_odd(1u32..=40),
        maybe_odd(1u32..=3),
        prop_oneof![20 => (1u32..=3).prop_map(Some), 1 => Just(None)],
        maybe_odd(prop_oneof![Just(64u32), Just(128), Just(192)].boxed()),
        prop_oneof![Just(1.0f32), Just(0.5), Just(0.0625), Just(2.0)],
    );
    shape.prop_flat_map(|(hd, rows, nkv, group, kv_pad, scale)| {
        let nh = match group {
            Some(g) => nkv.saturating_mul(g),
            None => nkv.wrapping_add(1),
        };
        let qh = stride_draw(hd, 4);
        let kh = stride_draw(hd, 1);
        let vh = stride_draw(hd, 2);
        (qh, kh, vh).prop_flat_map(move |(qhs, khs, vhs)| {
            let qr = stride_draw(nh.saturating_mul(qhs), 4);
            let kr = stride_draw(nkv.saturating_mul(khs), 3);
            let vr = stride_draw(nkv.saturating_mul(vhs), 1);
            let rest = (
                [
                    dtype_draw(WANT[0]),
                    dtype_draw(WANT[1]),
                    dtype_draw(WANT[2]),
                    dtype_draw(WANT[3]),
                    dtype_draw(WANT[4]),
                    dtype_draw(WANT[5]),
                ],
                [size_draw(), size_draw(), size_draw(), size_draw(), size_draw(), size_draw()],
                any::<bool>(),
                prop_oneof![12 => Just(None), 1 => (0usize..5).prop_map(Some)],
                prop_oneof![Just(0usize), Just(4), Just(64)],
                any::<u64>(),
                any::<u64>(),
            );
            (qr, kr, vr, rest).prop_map(
                move |(qrs, krs, vrs, (dtypes, sizes, arena, overlap, guard, mask_seed, data_seed))| Draw {
                    p: FlashAttnPrefillTensorParams {
                        rows,
                        n_heads: nh,
                        n_kv_heads: nkv,
                        head_dim: hd,
                        kv_pad,
                        q_row_stride: qrs,
                        q_head_stride: qhs,
                        k_row_stride: krs,
                        k_head_stride: khs,
                        v_row_stride: vrs,
                        v_head_stride: vhs,
                        scale,
                    },
                    dtypes,
                    sizes,
                    arena: arena || overlap.is_some(),
                    overlap,
                    guard,
                    mask_seed,
                    data_seed,
                },
            )
        })
    })
}

fn bq_of(hd: u32) -> u128 {
    if hd == 256 {
        32
    } else {
        16
    }
}

/// Elements each buffer needs (SPEC section 2), in exact arithmetic; `None` where the shape
/// does not define it (zero sizes, a head dim other than 256/512).
fn needs(p: &FlashAttnPrefillTensorParams) -> Option<[u128; 6]> {
    if !matches!(p.head_dim, 256 | 512) || p.rows == 0 || p.n_heads == 0 || p.n_kv_heads == 0 || p.kv_pad == 0 {
        return None;
    }
    let u = |x: u32| x as u128;
    let (rows, nh, nkv, hd, kvp) = (u(p.rows), u(p.n_heads), u(p.n_kv_heads), u(p.head_dim), u(p.kv_pad));
    Some([
        (rows - 1) * u(p.q_row_stride) + (nh - 1) * u(p.q_head_stride) + hd,
        (kvp - 1) * u(p.k_row_stride) + (nkv - 1) * u(p.k_head_stride) + hd,
        (kvp - 1) * u(p.v_row_stride) + (nkv - 1) * u(p.v_head_stride) + hd,
        rows * kvp,
        rows.div_ceil(bq_of(p.head_dim)) * (kvp / 64),
        rows * nh * hd,
    ])
}

/// Where each buffer lies: (allocation index, byte offset, byte length).
type Placement = [(usize, usize, usize); 6];

/// The error SPEC's validation list names for this dispatch, in its order, as a message
/// fragment; `None` if the dispatch is valid. Written from SPEC, not from the op.
fn expected_error(d: &Draw, elems: &[u128; 6], place: &Placement) -> Option<String> {
    let p = &d.p;
    if !matches!(p.head_dim, 256 | 512) {
        return Some(format!("unsupported head_dim {}", p.head_dim));
    }
    if p.rows == 0 || p.n_heads == 0 || p.n_kv_heads == 0 || p.kv_pad == 0 {
        return Some("empty shape".into());
    }
    if !p.n_heads.is_multiple_of(p.n_kv_heads) {
        return Some(format!("n_heads {} is not a multiple of n_kv_heads {}", p.n_heads, p.n_kv_heads));
    }
    if !p.kv_pad.is_multiple_of(64) {
        return Some(format!("kv_pad {} is not a multiple of 64", p.kv_pad));
    }
    let dims = [
        p.rows,
        p.n_heads,
        p.n_kv_heads,
        p.kv_pad,
        p.q_row_stride,
        p.q_head_stride,
        p.k_row_stride,
        p.k_head_stride,
        p.v_row_stride,
        p.v_head_stride,
    ];
    if dims.iter().any(|&x| x as u64 > I32_MAX) {
        return Some("exceeds i32".into());
    }
    if !p.q_row_stride.is_multiple_of(4) || !p.q_head_stride.is_multiple_of(4) {
        return Some("multiples of 4".into());
    }
    let need = needs(p).unwrap();
    for i in [0usize, 1, 2, 3, 5] {
        if d.dtypes[i] != WANT[i] {
            return Some(format!("{} must be {}", NAMES[i], WANT[i]));
        }
        if elems[i] < need[i] {
            return Some(format!("{} holds", NAMES[i]));
        }
    }
    if d.dtypes[4] != DType::U8 || elems[4] < need[4] {
        return Some("blk must be U8".into());
    }
    let (oa, oo, ol) = place[5];
    for i in 0..5 {
        let (a, o, l) = place[i];
        if a == oa && l > 0 && ol > 0 && o < oo + ol && oo < o + l {
            return Some(format!("out overlaps {}", NAMES[i]));
        }
    }
    None
}

// ------------------------------------------------------------------ building it

struct Built {
    allocs: Vec<MlxBuffer>,
    bufs: Vec<MlxBuffer>, // q k v mask blk out
    place: Placement,
    elems: [u128; 6],
}

fn round_up(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

fn build(dev: &MlxDevice, d: &Draw) -> Built {
    let need = needs(&d.p);
    let mut elems = [0u128; 6];
    for i in 0..6 {
        let n = need.map_or(1024, |n| n[i]);
        let n = match d.sizes[i] {
            Size::Exact => n,
            Size::OneShort => n.saturating_sub(1),
            Size::Extra(k) => n + k as u128 * 7,
        };
        // Too big to allocate: a small buffer (the op must refuse it for its size).
        elems[i] = if n > CAP_ELEMS { 1024 } else { n };
    }
    let bytes: Vec<usize> = (0..6).map(|i| elems[i] as usize * d.dtypes[i].size_of()).collect();
    let mut place: Placement = [(0, 0, 0); 6];
    let mut allocs = Vec::new();
    // After the output: a whole output row of guard, so a row too many is seen, not a crash.
    let row = (d.p.n_heads as usize).saturating_mul(d.p.head_dim as usize).min(1 << 14) * 4;
    if d.arena {
        // One allocation, buffers in order with a 64-byte gap; `out` last, after its guard,
        // or over the input named by `overlap`.
        let mut off = 0usize;
        for i in 0..5 {
            place[i] = (0, off, bytes[i]);
            off = round_up(off + bytes[i] + 64, 64);
        }
        let out_off = match d.overlap {
            Some(v) => round_up(place[v].1 + place[v].2 / 2, 4),
            None => off + d.guard,
        };
        place[5] = (0, out_off, bytes[5]);
        let total = (out_off + bytes[5] + row).max(off) + 64;
        allocs.push(dev.alloc_buffer(DType::U8, &[total]).unwrap());
    } else {
        for i in 0..5 {
            // Inputs get allocations of exactly their size (a checker sees any over-read).
            allocs.push(dev.alloc_buffer(DType::U8, &[bytes[i]]).unwrap());
            place[i] = (i, 0, bytes[i]);
        }
        allocs.push(dev.alloc_buffer(DType::U8, &[d.guard + bytes[5] + row + 64]).unwrap());
        place[5] = (5, d.guard, bytes[5]);
    }
    let bufs = (0..6)
        .map(|i| {
            let (a, o, l) = place[i];
            allocs[a].view(o, l, d.dtypes[i], vec![elems[i] as usize]).unwrap()
        })
        .collect();
    Built { allocs, bufs, place, elems }
}

fn f16_bits(x: f32) -> u16 {
    f16::from_f32(x).to_bits()
}

/// The mask as SPEC's tests want it: 16x64 blocks of uniform values, zeros, -inf, or values
/// with scattered -inf; some rows wholly -inf.
fn fill_mask(rows: usize, kvp: usize, seed: u64) -> Vec<u16> {
    let mut rng = Rng::new(seed);
    let ninf = f16::NEG_INFINITY.to_bits();
    let mut m = vec![0u16; rows * kvp];
    for rb in (0..rows).step_by(16) {
        for cb in (0..kvp).step_by(64) {
            let kind = rng.below(5);
            for r in rb..(rb + 16).min(rows) {
                for j in cb..cb + 64 {
                    m[r * kvp + j] = match kind {
                        0 => 0,
                        1 => ninf,
                        2 if rng.below(3) == 0 => ninf,
                        _ => f16_bits(rng.uniform(-1.0, 1.0)),
                    };
                }
            }
        }
    }
    for r in 0..rows {
        if rng.below(8) == 0 {
            m[r * kvp..(r + 1) * kvp].fill(ninf);
        }
    }
    m
}

/// SPEC section 1, independently of the op: 0 all <= -65504 (not NaN), 2 all +-0, else 1.
fn classify(mask: &[u16], rows: usize, kvp: usize, bq: usize, bk: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for qt in 0..rows.div_ceil(bq) {
        for kt in 0..kvp / bk {
            let vals = (qt * bq..((qt + 1) * bq).min(rows))
                .flat_map(|r| (kt * bk..(kt + 1) * bk).map(move |j| f16::from_bits(mask[r * kvp + j])));
            let (mut masked, mut zero) = (true, true);
            for x in vals {
                masked &= x.to_f32() <= -65504.0;
                zero &= x.to_f32() == 0.0;
            }
            out.push(if masked {
                0
            } else if zero {
                2
            } else {
                1
            });
        }
    }
    out
}

/// The float64 reference of SPEC section 3 on the drawn strides.
#[allow(clippy::too_many_arguments)]
fn reference(p: &FlashAttnPrefillTensorParams, q: &[f32], k: &[u16], v: &[u16], mask: &[u16]) -> Vec<f64> {
    let (rows, nh, hd, kvp) = (p.rows as usize, p.n_heads as usize, p.head_dim as usize, p.kv_pad as usize);
    let group = nh / p.n_kv_heads as usize;
    let (qrs, qhs) = (p.q_row_stride as usize, p.q_head_stride as usize);
    let (krs, khs, vrs, vhs) =
        (p.k_row_stride as usize, p.k_head_stride as usize, p.v_row_stride as usize, p.v_head_stride as usize);
    let kf: Vec<f64> = k.iter().map(|&b| f16::from_bits(b).to_f64()).collect();
    let vf: Vec<f64> = v.iter().map(|&b| f16::from_bits(b).to_f64()).collect();
    let mut out = vec![0f64; rows * nh * hd];
    let mut s = vec![0f64; kvp];
    for r in 0..rows {
        for h in 0..nh {
            let g = h / group;
            let qh: Vec<f64> = (0..hd).map(|d| f16::from_f32(p.scale * q[r * qrs + h * qhs + d]).to_f64()).collect();
            let mut mx = f64::NEG_INFINITY;
            for (j, sj) in s.iter_mut().enumerate() {
                let kr = &kf[j * krs + g * khs..][..hd];
                *sj = qh.iter().zip(kr).map(|(a, b)| a * b).sum::<f64>() + f16::from_bits(mask[r * kvp + j]).to_f64();
                mx = mx.max(*sj);
            }
            if mx == f64::NEG_INFINITY {
                continue;
            }
            let o = &mut out[(r * nh + h) * hd..][..hd];
            let mut den = 0.0;
            for (j, &sj) in s.iter().enumerate() {
                let pj = (sj - mx).exp();
                if pj == 0.0 {
                    continue;
                }
                den += pj;
                let vr = &vf[j * vrs + g * vhs..][..hd];
                for (od, vd) in o.iter_mut().zip(vr) {
                    *od += pj * vd;
                }
            }
            o.iter_mut().for_each(|x| *x /= den);
        }
    }
    out
}

fn cast_vec<T: bytemuck::Pod>(bytes: &[u8]) -> Vec<T> {
    bytes.chunks_exact(std::mem::size_of::<T>()).map(bytemuck::pod_read_unaligned).collect()
}

fn snapshot(allocs: &[MlxBuffer]) -> Vec<Vec<u8>> {
    allocs.iter().map(common::read_u8).collect()
}

/// Run one drawn dispatch on `dev` and check it against the predicate and the reference.
/// Returns the rule that refused the dispatch, or `None` when it ran and matched.
fn check_dispatch(dev: &MlxDevice, reg: &mut KernelRegistry, d: &Draw) -> Result<Option<String>, TestCaseError> {
    let b = build(dev, d);
    let p = &d.p;
    let mut rng = Rng::new(d.data_seed);
    // Fill inputs where their dtypes let the reference read them; anything else gets bytes.
    for i in 0..5 {
        let buf = &b.bufs[i];
        let n = b.elems[i] as usize;
        let bytes: Vec<u8> = match (i, d.dtypes[i]) {
            (0, DType::F32) => {
                bytemuck::cast_slice(&(0..n).map(|_| rng.uniform(-1.0, 1.0)).collect::<Vec<f32>>()).to_vec()
            }
            (1 | 2, DType::F16) => {
                bytemuck::cast_slice(&(0..n).map(|_| f16_bits(rng.uniform(-1.0, 1.0))).collect::<Vec<u16>>()).to_vec()
            }
            _ => (0..buf.data_byte_len()).map(|_| rng.next_u64() as u8).collect(),
        };
        buf.write_bytes(0, &bytes).unwrap();
    }
    // Mask and blk: meaningful when the shape is valid and they are big enough.
    let (rows, kvp) = (p.rows as usize, p.kv_pad as usize);
    let shaped = needs(p).is_some() && p.kv_pad.is_multiple_of(64);
    let mut mask_bits = Vec::new();
    if shaped && d.dtypes[3] == DType::F16 && b.elems[3] >= (rows * kvp) as u128 {
        mask_bits = fill_mask(rows, kvp, d.mask_seed);
        b.bufs[3].write_bytes(0, bytemuck::cast_slice(&mask_bits)).unwrap();
        let blk = classify(&mask_bits, rows, kvp, bq_of(p.head_dim) as usize, 64);
        if b.elems[4] >= blk.len() as u128 && d.dtypes[4] == DType::U8 {
            b.bufs[4].write_bytes(0, &blk).unwrap();
        }
    }
    // Output and guards: a sentinel pattern in every byte not yet written.
    let (oa, oo, ol) = b.place[5];
    let sentinel: Vec<u8> = (0..ol).map(|i| 0xA5 ^ (i as u8)).collect();
    if d.overlap.is_none() {
        let alloc = &b.allocs[oa];
        let guard: Vec<u8> = (0..alloc.data_byte_len() - oo).map(|i| 0x5A ^ (i as u8)).collect();
        alloc.write_bytes(oo, &guard).unwrap();
        if oo > 0 && !d.arena {
            alloc.write_bytes(0, &vec![0xC3u8; oo]).unwrap();
        }
        alloc.write_bytes(oo, &sentinel).unwrap();
    }
    let before = snapshot(&b.allocs);

    let expect = expected_error(d, &b.elems, &b.place);
    let mut enc = dev.command_encoder();
    let (q, k, v, m, blk, out) = (&b.bufs[0], &b.bufs[1], &b.bufs[2], &b.bufs[3], &b.bufs[4], &b.bufs[5]);
    let got = dispatch_flash_attn_prefill_tensor_f16(&mut enc, reg, dev, q, k, v, m, blk, out, p);
    match (&expect, got) {
        (Some(needle), Err(MlxError::InvalidArgument(msg))) => {
            prop_assert!(msg.starts_with("flash_attn_prefill_tensor: "), "{msg}");
            prop_assert!(msg.contains(needle.as_str()), "expected {needle:?}, got {msg:?}");
            prop_assert!(enc.pending().is_empty());
            enc.commit_and_wait().unwrap();
            prop_assert!(snapshot(&b.allocs) == before, "a refused dispatch changed memory");
            Ok(Some(rule_name(needle)))
        }
        (Some(needle), other) => Err(TestCaseError::fail(format!("expected {needle:?}, got {other:?}"))),
        (None, Err(e)) => Err(TestCaseError::fail(format!("a valid dispatch was refused: {e}"))),
        (None, Ok(())) => {
            enc.commit_and_wait().map_err(|e| TestCaseError::fail(format!("commit: {e}")))?;
            let after = snapshot(&b.allocs);
            for (i, (x, y)) in after.iter().zip(&before).enumerate() {
                if i == oa {
                    prop_assert!(x[..oo] == y[..oo], "bytes before the output were written");
                    prop_assert!(x[oo + ol..] == y[oo + ol..], "bytes after the output were written");
                } else {
                    prop_assert!(x == y, "an input allocation was written");
                }
            }
            let written = needs(p).unwrap()[5] as usize * 4;
            prop_assert!(
                after[oa][oo + written..oo + ol] == before[oa][oo + written..oo + ol],
                "output rows >= rows were written"
            );
            let got: Vec<f32> = cast_vec(&after[oa][oo..oo + written]);
            let read = |i: usize| after[b.place[i].0][b.place[i].1..][..b.place[i].2].to_vec();
            let qv: Vec<f32> = cast_vec(&read(0));
            let kv: Vec<u16> = cast_vec(&read(1));
            let vv: Vec<u16> = cast_vec(&read(2));
            let reference = reference(p, &qv, &kv, &vv, &mask_bits);
            let err = common::nmse(&got, &reference);
            prop_assert!(got.iter().all(|x| x.is_finite()), "non-finite output");
            prop_assert!(err <= 5e-4, "nmse {err:e} against the float64 reference");
            Ok(None)
        }
    }
}

/// A refusal's rule without its numbers, to count them.
fn rule_name(msg: &str) -> String {
    msg.split(' ').filter(|w| !w.chars().any(|c| c.is_ascii_digit())).collect::<Vec<_>>().join(" ")
}

/// The instruction sets to run the CPU kernels under (all this machine has).
fn isas(dev: &MlxDevice) -> Vec<Option<&'static str>> {
    if dev.backend_kind() == mlx_native::backend::BackendKind::Cpu {
        mlx_native::backend::cpu::simd::detected_isas().into_iter().map(Some).collect()
    } else {
        vec![None]
    }
}

#[test]
fn attention_dispatch_matches_reference_or_names_its_error() {
    let n = cases(600);
    for dev in devices() {
        for isa in isas(&dev) {
            if let Some(isa) = isa {
                mlx_native::backend::cpu::simd::force_isa(Some(isa)).unwrap();
            }
            let reg = RefCell::new(default_registry());
            let counts = RefCell::new(std::collections::BTreeMap::<String, u32>::new());
            let result = runner(n, 1).run(&draw(), |d| {
                let rule = check_dispatch(&dev, &mut reg.borrow_mut(), &d)?;
                *counts
                    .borrow_mut()
                    .entry(rule.unwrap_or_else(|| "valid: matched the reference".into()))
                    .or_default() += 1;
                Ok(())
            });
            mlx_native::backend::cpu::simd::force_isa(None).unwrap();
            if let Err(e) = result {
                panic!("{dev:?} {isa:?}: {e}");
            }
            let counts = counts.into_inner();
            eprintln!("{dev:?} {isa:?}: {n} dispatches: {counts:#?}");
            // Both sides must be exercised: at least a fifth valid, and every rule hit.
            let valid = counts.get("valid: matched the reference").copied().unwrap_or(0);
            assert!(valid * 5 >= n, "only {valid} of {n} dispatches were valid");
            if n >= 600 {
                for rule in [
                    "unsupported head_dim",
                    "empty shape",
                    "is not a multiple of n_kv_heads",
                    "kv_pad is not a multiple of",
                    "exceeds",
                    "multiples of",
                    "q holds",
                    "k holds",
                    "v holds",
                    "mask holds",
                    "out holds",
                    "q must be",
                    "k must be",
                    "v must be",
                    "mask must be",
                    "out must be",
                    "blk must be",
                    "out overlaps",
                ] {
                    assert!(counts.keys().any(|k| k.contains(rule)), "no draw hit {rule:?}: {counts:?}");
                }
            }
        }
    }
}

// ------------------------------------------------------------------ the blk op

#[derive(Debug, Clone)]
struct BlkDraw {
    p: FlashAttnPrefillBlkParams,
    mask_dtype: DType,
    blk_dtype: DType,
    mask_size: Size,
    blk_size: Size,
    same_alloc: bool,
    seed: u64,
}

fn blk_draw() -> impl Strategy<Value = BlkDraw> {
    (
        maybe_odd(1u32..=70),
        maybe_odd(prop_oneof![Just(64u32), Just(128), Just(256), Just(96)].boxed()),
        maybe_odd(prop_oneof![Just(32u32), Just(16), Just(1), Just(7)].boxed()),
        maybe_odd(prop_oneof![Just(64u32), Just(32), Just(1)].boxed()),
        dtype_draw(DType::F16),
        dtype_draw(DType::U8),
        size_draw(),
        size_draw(),
        prop_oneof![8 => Just(false), 1 => Just(true)],
        any::<u64>(),
    )
        .prop_map(|(rows, kv_pad, bq, bk, mask_dtype, blk_dtype, mask_size, blk_size, same_alloc, seed)| BlkDraw {
            p: FlashAttnPrefillBlkParams { rows, kv_pad, bq, bk },
            mask_dtype,
            blk_dtype,
            mask_size,
            blk_size,
            same_alloc,
            seed,
        })
}

fn check_blk(dev: &MlxDevice, reg: &mut KernelRegistry, d: &BlkDraw) -> Result<bool, TestCaseError> {
    let p = &d.p;
    let u = |x: u32| x as u128;
    let mask_need = u(p.rows) * u(p.kv_pad);
    let blk_need = if p.bq == 0 || p.bk == 0 { 0 } else { u(p.rows).div_ceil(u(p.bq)) * (u(p.kv_pad) / u(p.bk)) };
    let sized = |n: u128, s: Size| {
        let n = match s {
            Size::Exact => n,
            Size::OneShort => n.saturating_sub(1),
            Size::Extra(k) => n + k as u128,
        };
        if n > CAP_ELEMS {
            64
        } else {
            n as usize
        }
    };
    let (me, be) = (sized(mask_need, d.mask_size), sized(blk_need, d.blk_size));
    let (mb, bb) = (me * d.mask_dtype.size_of(), be * d.blk_dtype.size_of());
    // blk inside a guarded allocation; with `same_alloc` it sits over the mask's last bytes.
    let guard = 16usize;
    let alloc = dev.alloc_buffer(DType::U8, &[guard + mb + bb + 2 * guard]).unwrap();
    let mask_off = guard;
    let blk_off = if d.same_alloc && mb > 0 && bb > 0 { mask_off + mb - 1 } else { mask_off + mb + guard };
    let blk_off = if d.blk_dtype.size_of() > 1 { round_up(blk_off, 4) } else { blk_off };
    let mask = alloc.view(mask_off, mb, d.mask_dtype, vec![me]).unwrap();
    let blk = alloc.view(blk_off, bb, d.blk_dtype, vec![be]).unwrap();
    let mut rng = Rng::new(d.seed);
    let kinds = [0u16, f16::NEG_INFINITY.to_bits(), f16_bits(-65504.0), f16_bits(0.5), 0x8000, 0x7e00];
    let mut bits: Vec<u16> = Vec::with_capacity(me);
    let mut tile_kind = 0;
    for i in 0..me {
        if i % 37 == 0 {
            tile_kind = rng.below(kinds.len());
        }
        bits.push(if rng.below(40) == 0 { kinds[rng.below(kinds.len())] } else { kinds[tile_kind] });
    }
    let mut init: Vec<u8> = (0..alloc.data_byte_len()).map(|i| (i as u8) ^ 0x3c).collect();
    if d.mask_dtype.size_of() == 2 {
        init[mask_off..mask_off + mb].copy_from_slice(bytemuck::cast_slice(&bits));
    }
    alloc.write_bytes(0, &init).unwrap();
    let before = common::read_u8(&alloc);

    let overlap = mb > 0 && bb > 0 && blk_off < mask_off + mb && mask_off < blk_off + bb;
    let expect: Option<&str> = if p.rows == 0 || p.kv_pad == 0 || p.bq == 0 || p.bk == 0 {
        Some("empty shape")
    } else if !p.kv_pad.is_multiple_of(p.bk) {
        Some("is not a multiple of bk")
    } else if [p.rows, p.kv_pad, p.bq, p.bk].iter().any(|&x| x as u64 > I32_MAX) {
        Some("exceeds i32")
    } else if d.mask_dtype != DType::F16 {
        Some("mask must be F16")
    } else if (me as u128) < mask_need {
        Some("mask holds")
    } else if d.blk_dtype != DType::U8 || (be as u128) < blk_need {
        Some("blk must be U8")
    } else if overlap {
        Some("blk overlaps the mask")
    } else {
        None
    };
    let mut enc = dev.command_encoder();
    let got = dispatch_flash_attn_prefill_blk(&mut enc, reg, dev, &mask, &blk, p);
    match (expect, got) {
        (Some(needle), Err(MlxError::InvalidArgument(m))) => {
            prop_assert!(m.contains(needle), "expected {needle:?}, got {m:?}");
            prop_assert!(enc.pending().is_empty());
            prop_assert!(common::read_u8(&alloc) == before);
            Ok(false)
        }
        (Some(needle), other) => Err(TestCaseError::fail(format!("expected {needle:?}, got {other:?}"))),
        (None, Err(e)) => Err(TestCaseError::fail(format!("a valid classification was refused: {e}"))),
        (None, Ok(())) => {
            enc.commit_and_wait().unwrap();
            let after = common::read_u8(&alloc);
            let n = blk_need as usize;
            prop_assert!(after[..blk_off] == before[..blk_off], "bytes before blk were written");
            prop_assert!(after[blk_off + n..] == before[blk_off + n..], "bytes after the table were written");
            let want = classify(&bits, p.rows as usize, p.kv_pad as usize, p.bq as usize, p.bk as usize);
            prop_assert!(after[blk_off..blk_off + n] == want[..], "table differs from SPEC section 1");
            Ok(true)
        }
    }
}

#[test]
fn blk_dispatch_matches_spec_or_names_its_error() {
    for dev in devices() {
        let reg = RefCell::new(default_registry());
        let (valid, invalid) = (Cell::new(0u32), Cell::new(0u32));
        let result = runner(300, 2).run(&blk_draw(), |d| {
            let ok = check_blk(&dev, &mut reg.borrow_mut(), &d)?;
            let c = if ok { &valid } else { &invalid };
            c.set(c.get() + 1);
            Ok(())
        });
        if let Err(e) = result {
            panic!("{dev:?}: {e}");
        }
        let (valid, invalid) = (valid.get(), invalid.get());
        eprintln!("{dev:?}: {valid} valid and {invalid} invalid classifications checked");
        assert!(valid * 5 >= cases(300) && invalid * 10 >= cases(300), "{valid} valid, {invalid} invalid");
    }
}

// ------------------------------------------------------------------ handles through the C ABI

mod handles {
    //! A random sequence of C ABI calls on live, freed, never-issued, null and wrong-kind
    //! handles, checked call by call against a model: a handle that is not a live object of
    //! the right kind is `MLXN_INVALID_HANDLE`, never a crash; a buffer of another device is
    //! `MLXN_INVALID_ARGUMENT`; the count of open handles always equals the model's, and
    //! returns to where it started.

    use super::*;
    use mlx_native::ffi::*;
    use std::collections::HashMap;
    use std::ffi::CString;

    const OK: i32 = 0;
    const INVALID_ARGUMENT: i32 = 6;
    const INVALID_HANDLE: i32 = 9;

    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Kind {
        Device,
        /// A buffer of `[32, 64]` F16 (a mask) or `[1]` U8 (a table), of a device.
        Mask(u64),
        Blk(u64),
        Encoder(u64),
    }

    #[derive(Debug, Clone)]
    enum Call {
        OpenDevice,
        CloseDevice(usize),
        NewBuffer(usize, bool),
        View(usize),
        FreeBuffer(usize),
        NewEncoder(usize),
        FreeEncoder(usize),
        Dispatch(usize, usize, usize),
        Commit(usize),
        Pending(usize),
        Read(usize),
        Write(usize),
        Info(usize),
        DeviceInfo(usize),
    }

    fn call() -> impl Strategy<Value = Call> {
        let i = || 0usize..64;
        prop_oneof![
            2 => Just(Call::OpenDevice),
            1 => i().prop_map(Call::CloseDevice),
            4 => (i(), any::<bool>()).prop_map(|(d, m)| Call::NewBuffer(d, m)),
            1 => i().prop_map(Call::View),
            2 => i().prop_map(Call::FreeBuffer),
            2 => i().prop_map(Call::NewEncoder),
            1 => i().prop_map(Call::FreeEncoder),
            4 => (i(), i(), i()).prop_map(|(e, m, b)| Call::Dispatch(e, m, b)),
            2 => i().prop_map(Call::Commit),
            1 => i().prop_map(Call::Pending),
            1 => i().prop_map(Call::Read),
            1 => i().prop_map(Call::Write),
            1 => i().prop_map(Call::Info),
            1 => i().prop_map(Call::DeviceInfo),
        ]
    }

    /// Every handle ever issued (live or not) plus junk; `pick(i)` maps a drawn index.
    struct Model {
        issued: Vec<u64>,
        live: HashMap<u64, Kind>,
    }

    impl Model {
        fn pick(&self, i: usize) -> u64 {
            const JUNK: [u64; 4] = [0, u64::MAX, 1 << 40, 0xdead_beef];
            let n = self.issued.len() + JUNK.len();
            let i = i % n;
            if i < self.issued.len() {
                self.issued[i]
            } else {
                JUNK[i - self.issued.len()]
            }
        }
        fn is(&self, h: u64, want: fn(&Kind) -> bool) -> bool {
            self.live.get(&h).is_some_and(want)
        }
        fn add(&mut self, h: u64, k: Kind) {
            assert!(!self.issued.contains(&h), "handle {h} was issued twice");
            self.issued.push(h);
            self.live.insert(h, k);
        }
        fn device_of(&self, h: u64) -> Option<u64> {
            match self.live.get(&h) {
                Some(Kind::Mask(d) | Kind::Blk(d) | Kind::Encoder(d)) => Some(*d),
                _ => None,
            }
        }
    }

    fn handle_count() -> u64 {
        let mut n = 0u64;
        assert_eq!(unsafe { mlxn_handle_count(&mut n) }, OK);
        n
    }

    fn status(ok: bool) -> i32 {
        if ok {
            OK
        } else {
            INVALID_HANDLE
        }
    }

    fn apply(m: &mut Model, c: &Call) -> Result<(), TestCaseError> {
        let cpu = CString::new("cpu").unwrap();
        let is_dev = |k: &Kind| matches!(k, Kind::Device);
        let is_buf = |k: &Kind| matches!(k, Kind::Mask(_) | Kind::Blk(_));
        let is_enc = |k: &Kind| matches!(k, Kind::Encoder(_));
        let mut out = 0u64;
        match *c {
            Call::OpenDevice => {
                prop_assert_eq!(unsafe { mlxn_device_open(cpu.as_ptr(), &mut out) }, OK);
                m.add(out, Kind::Device);
            }
            Call::CloseDevice(i) => {
                let h = m.pick(i);
                let want = status(m.is(h, is_dev));
                prop_assert_eq!(mlxn_device_close(h), want);
                if want == OK {
                    m.live.remove(&h);
                }
            }
            Call::NewBuffer(i, mask) => {
                let h = m.pick(i);
                let (dtype, shape): (u32, &[u64]) = if mask { (1, &[32, 64]) } else { (3, &[1]) };
                let got = unsafe { mlxn_buffer_new(h, dtype, shape.as_ptr(), shape.len(), &mut out) };
                prop_assert_eq!(got, status(m.is(h, is_dev)));
                if got == OK {
                    m.add(out, if mask { Kind::Mask(h) } else { Kind::Blk(h) });
                }
            }
            Call::View(i) => {
                let h = m.pick(i);
                let kind = m.live.get(&h).copied();
                let (dtype, shape, bytes): (u32, &[u64], usize) = match kind {
                    Some(Kind::Mask(_)) => (1, &[32, 64], 4096),
                    _ => (3, &[1], 1),
                };
                let got = unsafe { mlxn_buffer_view(h, 0, bytes, dtype, shape.as_ptr(), shape.len(), &mut out) };
                prop_assert_eq!(got, status(m.is(h, is_buf)));
                if got == OK {
                    m.add(out, kind.unwrap());
                }
            }
            Call::FreeBuffer(i) => {
                let h = m.pick(i);
                let want = status(m.is(h, is_buf));
                prop_assert_eq!(mlxn_buffer_free(h), want);
                if want == OK {
                    m.live.remove(&h);
                }
            }
            Call::NewEncoder(i) => {
                let h = m.pick(i);
                let got = unsafe { mlxn_encoder_new(h, &mut out) };
                prop_assert_eq!(got, status(m.is(h, is_dev)));
                if got == OK {
                    m.add(out, Kind::Encoder(h));
                }
            }
            Call::FreeEncoder(i) => {
                let h = m.pick(i);
                let want = status(m.is(h, is_enc));
                prop_assert_eq!(mlxn_encoder_free(h), want);
                if want == OK {
                    m.live.remove(&h);
                }
            }
            Call::Dispatch(e, mk, b) => {
                let (e, mk, b) = (m.pick(e), m.pick(mk), m.pick(b));
                let handles_ok = m.is(e, is_enc) && m.is(mk, is_buf) && m.is(b, is_buf);
                // A wrong dtype or size, or a buffer of another device: an invalid argument
                // (asked only of live handles).
                let wrong_buffer = || {
                    !matches!(m.live[&mk], Kind::Mask(_))
                        || !matches!(m.live[&b], Kind::Blk(_))
                        || m.device_of(mk) != m.device_of(e)
                        || m.device_of(b) != m.device_of(e)
                };
                let want = if !handles_ok {
                    INVALID_HANDLE
                } else if wrong_buffer() {
                    INVALID_ARGUMENT
                } else {
                    OK
                };
                prop_assert_eq!(mlxn_dispatch_flash_attn_prefill_blk(e, mk, b, 32, 64, 32, 64), want);
            }
            Call::Commit(i) => {
                let h = m.pick(i);
                prop_assert_eq!(mlxn_encoder_commit_and_wait(h), status(m.is(h, is_enc)));
            }
            Call::Pending(i) => {
                let h = m.pick(i);
                prop_assert_eq!(unsafe { mlxn_encoder_pending(h, &mut out) }, status(m.is(h, is_enc)));
            }
            Call::Read(i) => {
                let h = m.pick(i);
                let mut byte = [0u8; 1];
                prop_assert_eq!(
                    unsafe { mlxn_buffer_read(h, 0, byte.as_mut_ptr().cast(), 1) },
                    status(m.is(h, is_buf))
                );
            }
            Call::Write(i) => {
                let h = m.pick(i);
                // A zero byte: a mask stays all-zero, a table byte gets rewritten on commit.
                let byte = [0u8; 1];
                prop_assert_eq!(unsafe { mlxn_buffer_write(h, 0, byte.as_ptr().cast(), 1) }, status(m.is(h, is_buf)));
            }
            Call::Info(i) => {
                let h = m.pick(i);
                let mut info = std::mem::MaybeUninit::<MlxnBufferInfo>::uninit();
                prop_assert_eq!(unsafe { mlxn_buffer_info(h, info.as_mut_ptr()) }, status(m.is(h, is_buf)));
            }
            Call::DeviceInfo(i) => {
                let h = m.pick(i);
                let mut needed = 0usize;
                let got = unsafe { mlxn_device_info(h, std::ptr::null_mut(), std::ptr::null_mut(), 0, &mut needed) };
                prop_assert_eq!(got, status(m.is(h, is_dev)));
            }
        }
        Ok(())
    }

    #[test]
    fn any_sequence_of_calls_matches_the_handle_model() {
        // The only test of this binary that opens handles: the count is ours alone.
        let start = handle_count();
        let total = Cell::new(0usize);
        let result = runner(300, 3).run(&proptest::collection::vec(call(), 1..60), |calls| {
            total.set(total.get() + calls.len());
            let mut m = Model { issued: Vec::new(), live: HashMap::new() };
            let base = handle_count();
            let mut outcome = Ok(());
            for c in &calls {
                outcome = apply(&mut m, c);
                if outcome.is_err() {
                    break;
                }
                if handle_count() != base + m.live.len() as u64 {
                    outcome = Err(TestCaseError::fail(format!(
                        "after {c:?}: {} handles open, the model has {}",
                        handle_count() - base,
                        m.live.len()
                    )));
                    break;
                }
            }
            // Free what is left, whatever happened (encoders first: any order is allowed).
            for (&h, k) in &m.live {
                let s = match k {
                    Kind::Device => mlxn_device_close(h),
                    Kind::Mask(_) | Kind::Blk(_) => mlxn_buffer_free(h),
                    Kind::Encoder(_) => mlxn_encoder_free(h),
                };
                assert_eq!(s, OK);
            }
            outcome?;
            prop_assert_eq!(handle_count(), base, "handles left open");
            Ok(())
        });
        if let Err(e) = result {
            panic!("{e}");
        }
        eprintln!("{} C ABI calls in {} sequences matched the handle model", total.get(), cases(300));
        assert_eq!(handle_count(), start);
    }
}

// ------------------------------------------------------------------ SPEC 10 through the prefill op

mod transforms {
    //! The front door's op (`dispatch_flash_attn_prefill`) with SPEC 10's parameters drawn
    //! good and bad: head dim pairs of the table and others, K and V dtypes (F16, BF16, F32,
    //! mismatched), softcap and max_bias (NaN, negative, infinite), ALiBi with and without
    //! positions, sinks (none, F32, F16, one short), with and without an explicit mask. Each
    //! dispatch matches the float64 reference or returns the typed error the predicate names,
    //! with nothing encoded and the output untouched.

    use super::common::prefill::{Prefill, SENTINEL};
    use super::common::{nmse, read_u8, upload};
    use super::*;
    use mlx_native::ops::flash_attn_prefill::{
        dispatch_flash_attn_prefill, dispatch_flash_attn_prefill_mask_blk, mask_table_bytes, FlashAttnPrefillBuffers,
        HEAD_DIMS,
    };

    const BAD_DIMS: [(usize, usize); 5] = [(100, 100), (576, 256), (576, 576), (256, 512), (48, 48)];

    #[derive(Debug, Clone)]
    struct TDraw {
        dims: (usize, usize),
        k_dtype: DType,
        v_dtype: DType,
        softcap: f32,
        max_bias: f32,
        causal: bool,
        mask: bool,
        /// None: no sinks; else (dtype, elements).
        sinks: Option<(DType, usize)>,
        rows: usize,
        kv: usize,
        seed: u64,
    }

    fn tdraw() -> impl Strategy<Value = TDraw> {
        let good_dims: Vec<(usize, usize)> =
            HEAD_DIMS.iter().map(|((k, v), _, _)| (*k as usize, *v as usize)).collect();
        let dims =
            prop_oneof![4 => proptest::sample::select(good_dims), 1 => proptest::sample::select(BAD_DIMS.to_vec())];
        let kv_dtypes = prop_oneof![
            8 => prop_oneof![Just((DType::F16, DType::F16)), Just((DType::BF16, DType::BF16))],
            1 => Just((DType::F32, DType::F32)),
            1 => prop_oneof![Just((DType::F16, DType::BF16)), Just((DType::BF16, DType::F16))],
        ];
        let softcap = prop_oneof![6 => Just(0.0f32), 3 => Just(3.0f32), 1 => prop_oneof![Just(f32::NAN), Just(-1.0f32), Just(f32::INFINITY)]];
        let max_bias =
            prop_oneof![6 => Just(0.0f32), 3 => Just(4.0f32), 1 => prop_oneof![Just(f32::INFINITY), Just(-0.5f32)]];
        let sinks = prop_oneof![
            4 => Just(None),
            4 => Just(Some((DType::F32, 0))),
            1 => Just(Some((DType::F16, 0))),
            1 => Just(Some((DType::F32, 1))),
        ];
        (dims, kv_dtypes, softcap, max_bias, any::<bool>(), any::<bool>(), sinks, 1usize..24, 1usize..80, any::<u64>())
            .prop_map(|(dims, (k_dtype, v_dtype), softcap, max_bias, causal, mask, sinks, rows, kv, seed)| TDraw {
                dims,
                k_dtype,
                v_dtype,
                softcap,
                max_bias,
                causal,
                mask,
                sinks,
                rows,
                kv,
                seed,
            })
    }

    /// The error the op must give (kind, message fragment), in its order, or None.
    fn expected(d: &TDraw) -> Option<(&'static str, String)> {
        let table = HEAD_DIMS.iter().any(|((k, v), _, _)| (*k as usize, *v as usize) == d.dims);
        if d.k_dtype != d.v_dtype {
            return Some(("dtype", format!("k is {} and v is {}", d.k_dtype, d.v_dtype)));
        }
        if !table {
            return Some(("invalid", format!("unsupported head_dim {} (v head dim {})", d.dims.0, d.dims.1)));
        }
        if !(d.softcap >= 0.0 && d.softcap.is_finite()) {
            return Some(("invalid", "softcap".into()));
        }
        if !(d.max_bias >= 0.0 && d.max_bias.is_finite()) {
            return Some(("invalid", "max_bias".into()));
        }
        if d.max_bias > 0.0 && !d.mask && !d.causal {
            return Some(("invalid", "ALiBi needs positions".into()));
        }
        if d.causal && d.kv < d.rows {
            return Some(("invalid", "cannot be shorter".into()));
        }
        match d.sinks {
            Some((DType::F16, _)) => Some(("dtype", "sinks must be F32".into())),
            Some((_, 1)) => Some(("invalid", "sinks holds".into())),
            _ => None,
        }
    }

    fn check(dev: &MlxDevice, reg: &mut KernelRegistry, d: &TDraw) -> Result<String, TestCaseError> {
        let (nh, nkv) = (4, 2);
        let base = Prefill::fixed(d.seed, 1, d.rows, d.kv, nh, nkv, 64, 1).with_lse();
        let kv = if d.k_dtype == DType::F32 { DType::F16 } else { d.k_dtype };
        let mut c = base.with_kv(d.seed, d.dims, kv, false);
        (c.causal, c.softcap, c.max_bias) = (d.causal, d.softcap, d.max_bias);
        let mut rng = Rng::new(d.seed);
        if d.sinks.is_some() {
            c.sinks = Some((0..nh).map(|_| rng.uniform(-2.0, 2.0)).collect());
        }
        if d.mask {
            c.set_peer_mask(d.seed, false);
        }
        let p = c.params();
        let q = upload(dev, DType::F32, &c.q);
        // F32 K/V (the CPU reads them as they are) hold the halves' values, widened exactly;
        // a mismatched pair is the same bits reinterpreted.
        let kv_buf = |dtype: DType, bits: &[u16]| -> MlxBuffer {
            if dtype == DType::F32 {
                upload(dev, DType::F32, &bits.iter().map(|&b| f16::from_bits(b).to_f32()).collect::<Vec<f32>>())
            } else {
                upload(dev, dtype, bits)
            }
        };
        let (k, v) = (kv_buf(d.k_dtype, &c.k), kv_buf(d.v_dtype, &c.v));
        let out = dev.alloc_buffer(DType::F32, &[c.out_strides[1] * (d.rows + 2) + 64]).unwrap();
        out.write_bytes(0, &vec![SENTINEL; out.data_byte_len()]).unwrap();
        let lse = upload(dev, DType::F32, &vec![f32::NAN; 4 * (d.rows + 8) * 2]);
        let sinks = d.sinks.map(|(dtype, short)| {
            let s = c.sinks.clone().unwrap();
            let n = nh - short;
            if dtype == DType::F16 {
                upload(dev, DType::F16, &s[..n].iter().map(|&x| f16::from_f32(x).to_bits()).collect::<Vec<u16>>())
            } else {
                upload(dev, DType::F32, &s[..n])
            }
        });
        let mask = c.mask.as_ref().map(|m| upload(dev, DType::F16, &m.data));
        // A head dim without tiles has no table either (the attention refuses it first).
        let table = mask_table_bytes(&p).ok();
        let blk = mask.as_ref().map(|_| dev.alloc_buffer(DType::U8, &[table.unwrap_or(1).max(1) as usize]).unwrap());
        let mut enc = dev.command_encoder();
        if let (Some(m), Some(t), Some(_)) = (&mask, &blk, table) {
            dispatch_flash_attn_prefill_mask_blk(&mut enc, reg, dev, m, t, &p).unwrap();
            enc.commit_and_wait().unwrap();
        }
        let before = read_u8(&out);
        let bufs = FlashAttnPrefillBuffers {
            q: &q,
            k: &k,
            v: &v,
            out: &out,
            mask: mask.as_ref(),
            blk: blk.as_ref(),
            cu_seqlens_q: None,
            cu_seqlens_k: None,
            lse: Some(&lse),
            sinks: sinks.as_ref(),
            alibi_slopes: None,
            workspace: None,
        };
        let mut enc = dev.command_encoder();
        let got = dispatch_flash_attn_prefill(&mut enc, reg, dev, &bufs, &p);
        match (got, expected(d)) {
            (Err(e), Some((kind, needle))) => {
                let (k, m) = match &e {
                    MlxError::InvalidArgument(m) => ("invalid", m),
                    MlxError::UnsupportedDtype(m) => ("dtype", m),
                    other => return Err(TestCaseError::fail(format!("{d:?}: an error of another kind: {other:?}"))),
                };
                prop_assert!(k == kind && m.contains(&needle), "{d:?}: {e:?}, expected {kind} {needle:?}");
                prop_assert!(enc.pending().is_empty(), "{d:?}: encoded on failure");
                enc.commit_and_wait().unwrap();
                prop_assert!(read_u8(&out) == before, "{d:?}: out written on failure");
                Ok(needle.split(' ').take(2).collect::<Vec<_>>().join(" "))
            }
            (Ok(()), None) => {
                enc.commit_and_wait().unwrap();
                let (reference, _) = c.reference();
                let bytes = read_u8(&out);
                let mut got = Vec::with_capacity(reference.len());
                for r in 0..d.rows {
                    for h in 0..nh {
                        let at = c.out_at(0, r, h);
                        for x in 0..d.dims.1 {
                            let i = (at + x) * 4;
                            got.push(f32::from_ne_bytes(bytes[i..i + 4].try_into().unwrap()));
                        }
                    }
                }
                let e = nmse(&got, &reference);
                prop_assert!(e < 1e-5, "{d:?}: nmse {e:e}");
                Ok("valid".into())
            }
            (got, want) => Err(TestCaseError::fail(format!("{d:?}: got {got:?}, expected {want:?}"))),
        }
    }

    #[test]
    fn prefill_with_score_transforms_matches_reference_or_names_its_error() {
        let n = cases(150);
        let dev = MlxDevice::cpu();
        let reg = RefCell::new(default_registry());
        let counts = RefCell::new(std::collections::BTreeMap::<String, u32>::new());
        let result = runner(n, 7).run(&tdraw(), |d| {
            let rule = check(&dev, &mut reg.borrow_mut(), &d)?;
            *counts.borrow_mut().entry(rule).or_default() += 1;
            Ok(())
        });
        if let Err(e) = result {
            panic!("{e}");
        }
        let counts = counts.into_inner();
        eprintln!("{n} prefills with SPEC 10's parameters: {counts:#?}");
        let valid = counts.get("valid").copied().unwrap_or(0);
        assert!(valid * 4 >= n, "only {valid} of {n} prefills were valid");
    }
}
