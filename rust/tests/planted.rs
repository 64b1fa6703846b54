//! Cases that kill planted bugs in the CPU kernels, on every instruction set and the AMX
//! kernels on emulated tiles (the Rust side
//! of tests/planted_cases.py; docs/reliability.md, "Mutation testing"): exact ties at the
//! rescale threshold, negative NaN and -0 in masks, masks that vary row by row inside a tile,
//! inexact scales, GQA ratios 1 to 16, fully masked rows as +0.0 bit for bit, and every field
//! of the params block through a dispatch built by hand (mask_row_stride too, which the op
//! always sets to kv_pad). Each output is held to two float64 references: the exact softmax
//! (NMSE <= 1e-7) and the SPEC's own steps with P rounded to half (bulk NMSE <= 2e-11).

mod common;

use std::sync::Arc;

use common::*;
use half::f16;
use mlx_native::backend::cpu::{self, flash_attn_prefill_tensor, simd, CpuPipeline, HostMemory};
use mlx_native::interface::{BoundArg, BufferBinding, Dispatch, GridSize, Memory, Pipeline};
use mlx_native::ops::flash_attn_prefill_tensor::{queries_per_threadgroup, FlashAttnPrefillTensorParamsGpu};
use mlx_native::{default_registry, DType, MlxDevice};

const EXACT_BAR: f64 = 1e-7;
const SPEC_BAR: f64 = 2e-11;
const BULK_TRIM: f64 = 0.1;
const NEG_INF: u16 = 0xfc00;
const NEGATIVE_NANS: [u16; 3] = [0xfe00, 0xfc01, 0xffff];

/// Every instruction set this CPU has, and the AMX kernels on the emulated tiles (the same
/// arithmetic as the hardware's, on any CPU).
fn for_each_isa(mut f: impl FnMut(&str)) {
    // One test turns the switch at a time: a test that compares two runs bit for bit must
    // see one set for both (the AMX tiles add in another order than the FMA kernels).
    static ISA_SWITCH: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _switch = ISA_SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    for isa in simd::detected_isas().into_iter().chain([simd::AMX_EMULATED]) {
        simd::force_isa(Some(isa)).unwrap();
        f(isa);
    }
    simd::force_isa(None).unwrap();
}

fn h(x: f32) -> u16 {
    f16::from_f32(x).to_bits()
}

/// SPEC section 1 from the bit patterns (rows < rows only).
fn spec_blk(mask: &[u16], rows: usize, kvp: usize, mask_rs: usize, bq: usize, bk: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for qt in 0..rows.div_ceil(bq) {
        for kt in 0..kvp / bk {
            let (mut masked, mut zero) = (true, true);
            for r in qt * bq..((qt + 1) * bq).min(rows) {
                for j in kt * bk..(kt + 1) * bk {
                    let b = mask[r * mask_rs + j];
                    let mag = b & 0x7fff;
                    masked &= b & 0x8000 != 0 && (0x7bff..=0x7c00).contains(&mag);
                    zero &= mag == 0;
                }
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

/// SPEC section 2 in float64, step by step: the table byte of each step, the lazy rescale
/// (`m > M + 8`), `p = half(exp(s - M))`, `O / S` or 0 where S == 0.
fn spec_reference(c: &Case, mask_rs: usize, blk: &[u8]) -> Vec<f64> {
    let (hd, nh) = (c.head_dim, c.n_heads);
    let group = nh / c.n_kv_heads;
    let kvp = c.kv_pad();
    let steps = kvp / 64;
    let bq = queries_per_threadgroup(hd as u32).unwrap() as usize;
    let mut out = vec![0f64; c.rows * nh * hd];
    for r in 0..c.rows {
        for hh in 0..nh {
            let g = hh / group;
            let qh: Vec<f64> = (0..hd)
                .map(|d| f16::from_f32(c.scale * c.q[r * c.q_row_stride + hh * c.q_head_stride + d]).to_f64())
                .collect();
            let (mut big_m, mut big_s) = (-(f32::MAX as f64) / 2.0, 0f64);
            let mut o = vec![0f64; hd];
            for step in 0..steps {
                let t = blk[(r / bq) * steps + step];
                if t == 0 {
                    continue;
                }
                let mut s = [0f64; 64];
                for (jj, sj) in s.iter_mut().enumerate() {
                    let j = step * 64 + jj;
                    let kr = &c.k[j * c.k_row_stride + g * c.k_head_stride..];
                    *sj = (0..hd).map(|d| qh[d] * f16::from_bits(kr[d]).to_f64()).sum::<f64>();
                    if t == 1 {
                        *sj += f16::from_bits(c.mask[r * mask_rs + j]).to_f64();
                    }
                }
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let mut ms = 1.0;
                if m > big_m + 8.0 {
                    ms = (big_m - m).exp();
                    big_m = m;
                }
                big_s *= ms;
                for x in o.iter_mut() {
                    *x *= ms;
                }
                for (jj, sj) in s.iter().enumerate() {
                    let p = f16::from_f64((sj - big_m).exp()).to_f64();
                    big_s += p;
                    let vr = &c.v[(step * 64 + jj) * c.v_row_stride + g * c.v_head_stride..];
                    for d in 0..hd {
                        o[d] += p * f16::from_bits(vr[d]).to_f64();
                    }
                }
            }
            if big_s != 0.0 {
                let dst = &mut out[(r * nh + hh) * hd..(r * nh + hh + 1) * hd];
                for d in 0..hd {
                    dst[d] = o[d] / big_s;
                }
            }
        }
    }
    out
}

/// NMSE over all but the worst BULK_TRIM of the (row, head) pairs in `keep`.
fn nmse_bulk(out: &[f32], reference: &[f64], hd: usize, keep: &[bool]) -> f64 {
    let mut errs = Vec::new();
    let mut den = 0.0;
    for (i, (o, r)) in out.chunks(hd).zip(reference.chunks(hd)).enumerate() {
        if !keep[i] {
            continue;
        }
        errs.push(o.iter().zip(r).map(|(&a, &b)| (a as f64 - b).powi(2)).sum::<f64>());
        den += r.iter().map(|x| x * x).sum::<f64>();
    }
    errs.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = errs.len() - (BULK_TRIM * errs.len() as f64).ceil() as usize;
    let num: f64 = errs[..n].iter().sum();
    if den == 0.0 {
        num
    } else {
        num / den
    }
}

fn row_has_nan(c: &Case, r: usize) -> bool {
    let kvp = c.kv_pad();
    c.mask[r * kvp..(r + 1) * kvp].iter().any(|&b| b & 0x7fff > 0x7c00)
}

fn row_fully_masked(c: &Case, r: usize) -> bool {
    let kvp = c.kv_pad();
    c.mask[r * kvp..(r + 1) * kvp].iter().all(|&b| b == NEG_INF)
}

/// Everything a planted case demands of the CPU kernels, on every ISA.
fn check(name: &str, c: &Case) {
    let dev = MlxDevice::cpu();
    let mut reg = default_registry();
    let (rows, nh, hd, kvp) = (c.rows, c.n_heads, c.head_dim, c.kv_pad());
    let bq = queries_per_threadgroup(hd as u32).unwrap() as usize;
    let want_blk = spec_blk(&c.mask, rows, kvp, kvp, bq, 64);
    let spec = spec_reference(c, kvp, &want_blk);
    let exact = c.reference();
    let nan_rows: Vec<usize> = (0..rows).filter(|&r| row_has_nan(c, r)).collect();
    let keep: Vec<bool> = (0..rows * nh).map(|i| !nan_rows.contains(&(i / nh))).collect();
    for_each_isa(|isa| {
        let b = bind(&dev, c, 2);
        let full = run(&dev, &mut reg, c, &b, false);
        assert_eq!(read_u8(&b.blk), want_blk, "{name} [{isa}]: blk");
        assert!(full[rows * nh * hd..].iter().all(|x| x.to_bits() == 0), "{name} [{isa}]: rows past `rows` written");
        let out = &full[..rows * nh * hd];
        for r in 0..rows {
            let row = &out[r * nh * hd..(r + 1) * nh * hd];
            if nan_rows.contains(&r) {
                assert!(row.iter().all(|x| x.is_nan()), "{name} [{isa}]: row {r} must be NaN (a NaN in its mask)");
            } else {
                assert!(row.iter().all(|x| x.is_finite()), "{name} [{isa}]: row {r} not finite");
            }
            if row_fully_masked(c, r) {
                assert!(row.iter().all(|x| x.to_bits() == 0), "{name} [{isa}]: fully masked row {r} is not +0.0");
            }
        }
        let kept = |v: &[f32]| -> Vec<f32> {
            v.chunks(hd).zip(&keep).filter(|(_, k)| **k).flat_map(|(x, _)| x.to_vec()).collect()
        };
        let kept64 = |v: &[f64]| -> Vec<f64> {
            v.chunks(hd).zip(&keep).filter(|(_, k)| **k).flat_map(|(x, _)| x.to_vec()).collect()
        };
        let e = nmse(&kept(out), &kept64(&exact));
        let es = nmse_bulk(out, &spec, hd, &keep);
        eprintln!("{name:22} [{isa:14}] exact {e:.2e} spec {es:.2e}");
        assert!(e <= EXACT_BAR, "{name} [{isa}]: nmse {e:e} against the exact softmax");
        assert!(es <= SPEC_BAR, "{name} [{isa}]: bulk nmse {es:e} against the SPEC's rounding");
    });
}

fn set_mask(c: &mut Case, r: usize, j: usize, bits: u16) {
    let kvp = c.kv_pad();
    c.mask[r * kvp + j] = bits;
}

/// Q = 0: scores are the mask. Step maxima 0, 8 (= M + 8), 16, 24 (= M + 8), 16.
fn ties(seed: u64, hd: usize) -> Case {
    let rows = if hd == 256 { 37 } else { 21 };
    let mut c = Case::new(seed, rows, 2, 1, hd, 320, 1, MaskKind::Zero);
    c.q.iter_mut().for_each(|x| *x = 0.0);
    let mut rng = Rng::new(seed ^ 0x55);
    for r in 0..rows {
        for (i, top) in [0.0f32, 8.0, 16.0, 24.0, 16.0].into_iter().enumerate() {
            let at = rng.below(64);
            for jj in 0..64 {
                let u = (1 + rng.below(96)) as f32 / 16.0;
                set_mask(&mut c, r, i * 64 + jj, h(if jj == at { top } else { top - u }));
            }
        }
    }
    c
}

/// Tiles of -inf with one negative NaN (first row, the tile's last row, the last column, the
/// partial tile's last row), tiles of -0, of +-0, of -inf and -65504.
fn negative_nan(seed: u64, hd: usize) -> Case {
    let bq = queries_per_threadgroup(hd as u32).unwrap() as usize;
    let rows = 2 * bq + 5;
    let mut c = Case::new(seed, rows, 2, 1, hd, 512, 1, MaskKind::Peer);
    let mut rng = Rng::new(seed ^ 0x77);
    for r in 0..rows {
        for j in 0..512 {
            let tile0 = r < bq && j < 192;
            let tile_last = r >= 2 * bq && (384..448).contains(&j);
            if tile0 || tile_last {
                set_mask(&mut c, r, j, NEG_INF);
            }
            if (bq..2 * bq).contains(&r) {
                if (192..256).contains(&j) {
                    set_mask(&mut c, r, j, 0x8000);
                } else if (256..320).contains(&j) {
                    set_mask(&mut c, r, j, if rng.below(2) == 0 { 0 } else { 0x8000 });
                } else if (320..384).contains(&j) {
                    set_mask(&mut c, r, j, if rng.below(2) == 0 { NEG_INF } else { 0xfbff });
                }
            }
        }
    }
    set_mask(&mut c, 0, 3, NEGATIVE_NANS[0]);
    set_mask(&mut c, bq - 1, 64 + 17, NEGATIVE_NANS[1]);
    set_mask(&mut c, 5, 191, NEGATIVE_NANS[2]);
    set_mask(&mut c, rows - 1, 400, NEGATIVE_NANS[0]);
    c
}

/// Row r sees cache rows [0, len_r): lengths vary inside tiles; some rows and one whole query
/// tile see nothing; in tile 0 only the last row sees past 64.
fn padding(seed: u64, hd: usize) -> Case {
    let bq = queries_per_threadgroup(hd as u32).unwrap() as usize;
    let (rows, kv) = (4 * bq - 3, 200);
    let mut c = Case::new(seed, rows, 4, 2, hd, kv, 1, MaskKind::Zero);
    let mut rng = Rng::new(seed ^ 0x99);
    let kvp = c.kv_pad();
    for r in 0..rows {
        let len = if r < bq {
            if r == bq - 1 {
                150
            } else {
                1 + rng.below(63)
            }
        } else if (2 * bq..3 * bq).contains(&r) || r == bq + 3 || r == 2 {
            0
        } else if r == rows - 1 {
            kv
        } else {
            1 + rng.below(kv)
        };
        let len = if r == 2 { 0 } else { len };
        for j in 0..kvp {
            set_mask(&mut c, r, j, if j < len { 0 } else { NEG_INF });
        }
    }
    c
}

/// Packed sequences: a block-diagonal causal mask, random values where visible.
fn packed(seed: u64, hd: usize) -> Case {
    let rows = if hd == 256 { 150 } else { 70 };
    let mut c = Case::new(seed, rows, 2, 1, hd, rows, 1, MaskKind::Zero);
    let mut rng = Rng::new(seed ^ 0x33);
    let mut starts: Vec<usize> = (0..6).map(|_| 1 + rng.below(rows - 1)).collect();
    starts.sort();
    let seq = |r: usize| starts.iter().filter(|&&s| s <= r).count();
    let kvp = c.kv_pad();
    for r in 0..rows {
        for j in 0..kvp {
            let vis = j < rows && j <= r && seq(j) == seq(r);
            set_mask(&mut c, r, j, if vis { h(rng.uniform(-1.0, 1.0)) } else { NEG_INF });
        }
    }
    c
}

/// Tiles decided by their last row alone (the tile's, and the partial tile's rows - 1).
fn last_row(seed: u64, hd: usize) -> Case {
    let bq = queries_per_threadgroup(hd as u32).unwrap() as usize;
    let rows = 2 * bq + 7;
    let mut c = Case::new(seed, rows, 2, 2, hd, 256, 1, MaskKind::Zero);
    let mut rng = Rng::new(seed ^ 0x11);
    for r in 0..rows {
        for j in 0..256 {
            let v = if j < 64 {
                h(rng.uniform(-1.0, 1.0))
            } else if r < bq {
                match (j / 64, r == bq - 1) {
                    (1, false) => NEG_INF,
                    (1, true) => h(rng.uniform(-1.0, 1.0)),
                    (2, false) => 0,
                    (2, true) => h(rng.uniform(0.5, 2.0)),
                    _ => 0,
                }
            } else if r == rows - 1 && j / 64 == 2 {
                h(rng.uniform(-1.0, 1.0))
            } else if r >= 2 * bq && j / 64 == 3 {
                if r == rows - 1 {
                    h(rng.uniform(0.5, 2.0))
                } else {
                    0
                }
            } else {
                NEG_INF
            };
            set_mask(&mut c, r, j, v);
        }
    }
    c
}

#[test]
fn ties_at_the_rescale_threshold() {
    check("ties d256", &ties(1, 256));
    check("ties d512", &ties(2, 512));
}

#[test]
fn negative_nan_and_minus_zero_in_masks() {
    check("negative nan d256", &negative_nan(3, 256));
    check("negative nan d512", &negative_nan(4, 512));
}

#[test]
fn masks_that_vary_row_by_row_inside_a_tile() {
    check("padding d256", &padding(5, 256));
    check("padding d512", &padding(6, 512));
    check("packed d256", &packed(7, 256));
    check("packed d512", &packed(8, 512));
    check("last row d256", &last_row(9, 256));
    check("last row d512", &last_row(10, 512));
}

#[test]
fn inexact_scales() {
    for (i, (hd, scale)) in
        [(256, 0.1f32), (512, 0.3), (256, std::f32::consts::FRAC_1_SQRT_2), (512, 1.7)].into_iter().enumerate()
    {
        let mut c = Case::new(20 + i as u64, 40, 2, 1, hd, 150, 1, MaskKind::Peer);
        c.scale = scale;
        check(&format!("scale {scale} d{hd}"), &c);
    }
}

#[test]
fn gqa_ratios_1_to_16() {
    for (i, (nh, nkv, hd)) in
        [(3, 3, 512), (6, 3, 256), (6, 2, 512), (8, 2, 256), (16, 2, 512), (32, 2, 256)].into_iter().enumerate()
    {
        check(&format!("gqa {nh}/{nkv} d{hd}"), &Case::new(30 + i as u64, 19, nh, nkv, hd, 90, 1, MaskKind::Peer));
    }
}

#[test]
fn spec_reference_tells_the_spec_from_its_near_misses() {
    // The bar can fail: the exact softmax (which P unrounded approaches) is far from the
    // SPEC's rounded result in bulk, on the ties and on random data.
    for c in [ties(1, 256), Case::new(40, 40, 2, 1, 256, 150, 1, MaskKind::Peer)] {
        let kvp = c.kv_pad();
        let blk = spec_blk(&c.mask, c.rows, kvp, kvp, 32, 64);
        let spec = spec_reference(&c, kvp, &blk);
        let exact: Vec<f32> = c.reference().iter().map(|&x| x as f32).collect();
        let keep = vec![true; c.rows * c.n_heads];
        let e = nmse_bulk(&exact, &spec, c.head_dim, &keep);
        assert!(e > 5.0 * SPEC_BAR, "the exact softmax is only {e:e} from the SPEC's rounding");
    }
}

// -- every field of the params block, through a dispatch built by hand --------------------------

const FIELDS: [&str; 12] = [
    "rows",
    "n_heads",
    "n_kv_heads",
    "kv_pad",
    "q_row_stride",
    "q_head_stride",
    "k_row_stride",
    "k_head_stride",
    "v_row_stride",
    "v_head_stride",
    "mask_row_stride",
    "scale",
];

fn base_params() -> FlashAttnPrefillTensorParamsGpu {
    FlashAttnPrefillTensorParamsGpu {
        rows: 40,
        n_heads: 4,
        n_kv_heads: 2,
        kv_pad: 192,
        q_row_stride: 1152,
        q_head_stride: 264,
        k_row_stride: 560,
        k_head_stride: 272,
        v_row_stride: 600,
        v_head_stride: 280,
        mask_row_stride: 192,
        scale: 1.0,
    }
}

fn perturbed(field: &str) -> FlashAttnPrefillTensorParamsGpu {
    let mut p = base_params();
    match field {
        "rows" => p.rows = 33,
        "n_heads" => p.n_heads = 2,
        "n_kv_heads" => p.n_kv_heads = 1,
        "kv_pad" => p.kv_pad = 128,
        "q_row_stride" => p.q_row_stride = 1156,
        "q_head_stride" => p.q_head_stride = 260,
        "k_row_stride" => p.k_row_stride = 544,
        "k_head_stride" => p.k_head_stride = 262,
        "v_row_stride" => p.v_row_stride = 576,
        "v_head_stride" => p.v_head_stride = 288,
        "mask_row_stride" => p.mask_row_stride = 256,
        "scale" => p.scale = 0.7,
        _ => unreachable!("{field}"),
    }
    p
}

fn host_buffer<T: bytemuck::Pod>(dtype: DType, data: &[T]) -> BufferBinding {
    let bytes: &[u8] = bytemuck::cast_slice(data);
    let mem: Arc<dyn Memory> = Arc::new(HostMemory::zeroed(bytes.len()).unwrap());
    mem.write(0, bytes).unwrap();
    BufferBinding { memory: mem, dtype, byte_offset: 0, byte_len: bytes.len() }
}

/// Flat buffers for every perturbation, every element random.
struct Flat {
    q: Vec<f32>,
    k: Vec<u16>,
    v: Vec<u16>,
    mask: Vec<u16>,
}

fn flat(seed: u64) -> Flat {
    let mut rng = Rng::new(seed);
    let need = |rs: usize, hs: usize, n_rows: usize, n_heads: usize| (n_rows - 1) * rs + (n_heads - 1) * hs + 256 + 64;
    Flat {
        q: (0..need(1156, 264, 40, 4)).map(|_| rng.uniform(-1.0, 1.0)).collect(),
        k: (0..need(560, 272, 192, 2)).map(|_| h(rng.uniform(-1.0, 1.0))).collect(),
        v: (0..need(600, 288, 192, 2)).map(|_| h(rng.uniform(-1.0, 1.0))).collect(),
        mask: (0..40 * 256).map(|_| h(rng.uniform(-2.0, 1.0))).collect(),
    }
}

/// The CPU kernel on a dispatch built by hand; all-ones table. Returns the whole output.
fn run_kernel(f: &Flat, p: &FlashAttnPrefillTensorParamsGpu) -> Vec<f32> {
    let name = "flash_attn_prefill_tensor_f16_d256";
    let kernel = cpu::kernel(name).unwrap();
    let steps = p.kv_pad as usize / 64;
    let blk = vec![1u8; (p.rows as usize).div_ceil(32) * steps];
    let out = host_buffer(DType::F32, &vec![-3.25f32; 40 * 4 * 256]);
    let mask_len = (p.rows as usize - 1) * p.mask_row_stride as usize + p.kv_pad as usize;
    let d = Dispatch {
        pipeline: Pipeline::new(name, 1024, Arc::new(CpuPipeline { kernel })),
        args: vec![
            (0, BoundArg::Bytes(bytemuck::bytes_of(p).to_vec())),
            (1, BoundArg::Buffer(host_buffer(DType::F32, &f.q))),
            (2, BoundArg::Buffer(host_buffer(DType::F16, &f.k))),
            (3, BoundArg::Buffer(host_buffer(DType::F16, &f.v))),
            (4, BoundArg::Buffer(host_buffer(DType::F16, &f.mask[..mask_len]))),
            (5, BoundArg::Buffer(host_buffer(DType::U8, &blk))),
            (6, BoundArg::Buffer(out.clone())),
        ],
        shared: vec![],
        grid: GridSize::new((p.rows as u64).div_ceil(32), p.n_heads as u64, 1),
        threadgroup: GridSize::new(32, 8, 1),
        options: Default::default(),
    };
    kernel(&d).unwrap();
    let mut bytes = vec![0u8; out.byte_len];
    out.memory.read(0, &mut bytes).unwrap();
    bytemuck::cast_slice(&bytes).to_vec()
}

/// The exact float64 reference of what `p` describes over the flat buffers.
fn field_reference(f: &Flat, p: &FlashAttnPrefillTensorParamsGpu) -> Vec<f64> {
    let u = |x: i32| x as usize;
    let (rows, kvp, mrs) = (u(p.rows), u(p.kv_pad), u(p.mask_row_stride));
    let mut mask = vec![0u16; rows * kvp];
    for r in 0..rows {
        mask[r * kvp..(r + 1) * kvp].copy_from_slice(&f.mask[r * mrs..r * mrs + kvp]);
    }
    let c = Case {
        rows,
        n_heads: u(p.n_heads),
        n_kv_heads: u(p.n_kv_heads),
        head_dim: 256,
        kv_len: kvp,
        scale: p.scale,
        q_row_stride: u(p.q_row_stride),
        q_head_stride: u(p.q_head_stride),
        k_row_stride: u(p.k_row_stride),
        k_head_stride: u(p.k_head_stride),
        v_row_stride: u(p.v_row_stride),
        v_head_stride: u(p.v_head_stride),
        q: f.q.clone(),
        k: f.k.clone(),
        v: f.v.clone(),
        mask,
    };
    c.reference()
}

#[test]
fn every_params_field_is_honoured_by_the_cpu_kernel() {
    let names: Vec<&str> = mlx_native::params::ATTENTION_FIELDS.iter().map(|f| f.name).collect();
    assert_eq!(names, FIELDS, "the params block changed: update this test");
    let f = flat(50);
    for_each_isa(|isa| {
        let base = run_kernel(&f, &base_params());
        for field in FIELDS {
            let p = perturbed(field);
            let got = run_kernel(&f, &p);
            let n = (p.rows * p.n_heads * 256) as usize;
            let e = nmse(&got[..n], &field_reference(&f, &p));
            assert!(e < EXACT_BAR, "{field} [{isa}]: nmse {e:e}");
            assert!(got.iter().zip(&base).any(|(a, b)| a.to_bits() != b.to_bits()), "{field} [{isa}]: no change");
        }
        let e = nmse(&base[..40 * 4 * 256], &field_reference(&f, &base_params()));
        assert!(e < EXACT_BAR, "base [{isa}]: nmse {e:e}");
    });
}

#[test]
fn column_skipping_changes_no_bit_on_the_planted_masks() {
    let dev = MlxDevice::cpu();
    let mut reg = default_registry();
    for c in [padding(5, 256), packed(8, 512), last_row(9, 256), negative_nan(3, 256)] {
        let b = bind(&dev, &c, 0);
        for_each_isa(|isa| {
            let with = run(&dev, &mut reg, &c, &b, false);
            flash_attn_prefill_tensor::set_column_skipping(false);
            let without = run(&dev, &mut reg, &c, &b, false);
            flash_attn_prefill_tensor::set_column_skipping(true);
            assert!(with.iter().zip(&without).all(|(a, b)| a.to_bits() == b.to_bits()), "[{isa}]");
        });
    }
}

#[test]
fn state_left_by_nan_inputs_does_not_reach_the_next_dispatch() {
    // The kernel keeps its working memory per thread between dispatches: the running max,
    // the row sums and O must start afresh for every work item. A dispatch whose every row
    // ends in NaN (a NaN in every K) leaves NaN behind; the clean dispatch after it, of the
    // same shape so the same memory is reused, must match its reference.
    let dev = MlxDevice::cpu();
    let mut reg = default_registry();
    let clean = Case::new(60, 256, 4, 2, 256, 200, 0, MaskKind::Peer);
    let mut poisoned = Case::new(61, 256, 4, 2, 256, 200, 0, MaskKind::Zero);
    for j in 0..poisoned.kv_len {
        for g in 0..2 {
            poisoned.k[j * poisoned.k_row_stride + g * poisoned.k_head_stride] = 0x7e00;
        }
    }
    let reference = clean.reference();
    for_each_isa(|isa| {
        for _ in 0..3 {
            let bp = bind(&dev, &poisoned, 0);
            let out = run(&dev, &mut reg, &poisoned, &bp, false);
            assert!(out.iter().all(|x| x.is_nan()), "[{isa}]: the poisoned dispatch is all NaN");
            let bc = bind(&dev, &clean, 0);
            let out = run(&dev, &mut reg, &clean, &bc, false);
            let e = nmse(&out, &reference);
            assert!(out.iter().all(|x| x.is_finite()) && e < EXACT_BAR, "[{isa}]: after NaN inputs, nmse {e:e}");
        }
    });
}

#[test]
fn crafted_tiles_classify_as_the_spec_says() {
    // One value planted in a tile of -inf and in a tile of zeros, at the tile's last row and
    // last column (the partial tile's last row too): each special half must give the SPEC's
    // class, on every ISA.
    use mlx_native::ops::flash_attn_prefill_blk::{dispatch_flash_attn_prefill_blk, FlashAttnPrefillBlkParams};
    let specials: [u16; 10] = [0x7c00, 0x7e00, 0xfe00, 0xfc01, 0xffff, 0x8000, 0xfbff, 0xfbfe, 0x0001, 0x3c00];
    let (bq, bk) = (16usize, 64usize);
    let rows = 2 * bq + 5;
    let kvp = 2 * specials.len() * bk;
    let dev = MlxDevice::cpu();
    let mut reg = default_registry();
    for last_tile in [false, true] {
        let mut mask = vec![0u16; rows * kvp];
        let (r0, r1) = if last_tile { (2 * bq, rows) } else { (bq, 2 * bq) };
        for (i, &s) in specials.iter().enumerate() {
            for r in 0..rows {
                for j in 0..bk {
                    mask[r * kvp + 2 * i * bk + j] = NEG_INF;
                }
            }
            mask[(r1 - 1) * kvp + 2 * i * bk + bk - 1] = s;
            mask[(r1 - 1) * kvp + (2 * i + 1) * bk + bk - 1] = s;
        }
        let want = spec_blk(&mask, rows, kvp, kvp, bq, bk);
        let m = upload(&dev, DType::F16, &mask);
        let blk = dev.alloc_buffer(DType::U8, &[want.len()]).unwrap();
        for_each_isa(|isa| {
            let mut enc = dev.command_encoder();
            let p = FlashAttnPrefillBlkParams { rows: rows as u32, kv_pad: kvp as u32, bq: bq as u32, bk: bk as u32 };
            dispatch_flash_attn_prefill_blk(&mut enc, &mut reg, &dev, &m, &blk, &p).unwrap();
            enc.commit_and_wait().unwrap();
            let got = read_u8(&blk);
            assert_eq!(got, want, "[{isa}] last tile {last_tile}");
            let k_tiles = kvp / bk;
            let qt = r0 / bq;
            for (i, &s) in specials.iter().enumerate() {
                let in_masked = got[qt * k_tiles + 2 * i];
                let expect = if s == 0xfbff || s == 0xfc00 { 0 } else { 1 };
                assert_eq!(in_masked, expect, "[{isa}] {s:#06x} in a tile of -inf");
            }
        });
    }
}
