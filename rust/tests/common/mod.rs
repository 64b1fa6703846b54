//! Shared helpers of the integration tests: a seeded generator, the peer's random mask,
//! a naive float64 reference, and a dispatch harness.
#![allow(dead_code)]

pub mod prefill;

use half::f16;
use mlx_native::ops::flash_attn_prefill_blk::{dispatch_flash_attn_prefill_blk, FlashAttnPrefillBlkParams};
use mlx_native::ops::flash_attn_prefill_tensor::{
    dispatch_flash_attn_prefill_tensor_f16, kv_pad, queries_per_threadgroup, FlashAttnPrefillTensorParams,
};
use mlx_native::{DType, KernelRegistry, MlxBuffer, MlxDevice};

/// xorshift64*: small, seeded, good enough for test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// How the mask of a case is made.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MaskKind {
    /// Uniform [-1, 1], then about a fifth of 128x64 blocks set to -inf or to 0.
    Peer,
    /// Causal (cache row j visible to query row r when j <= r + kv_len - rows).
    Causal,
    /// Causal with a window of `w` rows.
    Window(usize),
    /// All zero.
    Zero,
}

/// One attention problem with its host data.
pub struct Case {
    pub rows: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub kv_len: usize,
    pub scale: f32,
    pub q_row_stride: usize,
    pub q_head_stride: usize,
    pub k_row_stride: usize,
    pub k_head_stride: usize,
    pub v_row_stride: usize,
    pub v_head_stride: usize,
    pub q: Vec<f32>,
    pub k: Vec<u16>,
    pub v: Vec<u16>,
    /// `[rows, kv_pad]` halves; columns past kv_len are -inf.
    pub mask: Vec<u16>,
}

impl Case {
    pub fn kv_pad(&self) -> usize {
        kv_pad(self.kv_len as u32) as usize
    }

    /// Random data; `pad` extra elements in every stride (a strided view of a larger buffer).
    #[allow(clippy::too_many_arguments)] // a case's extents, each named where a test builds one
    pub fn new(
        seed: u64,
        rows: usize,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        kv_len: usize,
        pad: usize,
        mask_kind: MaskKind,
    ) -> Case {
        let mut rng = Rng::new(seed);
        let kvp = kv_pad(kv_len as u32) as usize;
        let q_head_stride = head_dim + 4 * pad;
        let q_row_stride = n_heads * q_head_stride + 4 * pad;
        let k_head_stride = head_dim + pad;
        let k_row_stride = n_kv_heads * k_head_stride + 3 * pad;
        let v_head_stride = head_dim + 2 * pad;
        let v_row_stride = n_kv_heads * v_head_stride + pad;
        let q: Vec<f32> = (0..rows * q_row_stride).map(|_| rng.uniform(-1.0, 1.0)).collect();
        // K/V rows at and past kv_len up to kv_pad: zero (the host contract).
        let mut k = vec![0u16; kvp * k_row_stride];
        let mut v = vec![0u16; kvp * v_row_stride];
        for j in 0..kv_len {
            for x in &mut k[j * k_row_stride..(j + 1) * k_row_stride] {
                *x = f16::from_f32(rng.uniform(-1.0, 1.0)).to_bits();
            }
            for x in &mut v[j * v_row_stride..(j + 1) * v_row_stride] {
                *x = f16::from_f32(rng.uniform(-1.0, 1.0)).to_bits();
            }
        }
        let ninf = f16::NEG_INFINITY.to_bits();
        let mut mask = vec![0u16; rows * kvp];
        let shift = kv_len as isize - rows as isize;
        for r in 0..rows {
            for j in 0..kvp {
                let jj = j as isize;
                let rr = r as isize + shift;
                mask[r * kvp + j] = if j >= kv_len {
                    ninf
                } else {
                    match mask_kind {
                        MaskKind::Peer => f16::from_f32(rng.uniform(-1.0, 1.0)).to_bits(),
                        MaskKind::Zero => 0,
                        MaskKind::Causal => {
                            if jj <= rr {
                                0
                            } else {
                                ninf
                            }
                        }
                        MaskKind::Window(w) => {
                            if jj <= rr && jj > rr - w as isize {
                                0
                            } else {
                                ninf
                            }
                        }
                    }
                };
            }
        }
        if mask_kind == MaskKind::Peer {
            for rb in 0..rows.div_ceil(128) {
                for cb in 0..kvp / 64 {
                    let roll = rng.below(10);
                    if roll >= 2 {
                        continue;
                    }
                    let val = if roll == 0 { ninf } else { 0 };
                    for r in rb * 128..((rb + 1) * 128).min(rows) {
                        for j in cb * 64..(cb + 1) * 64 {
                            if j < kv_len {
                                mask[r * kvp + j] = val;
                            }
                        }
                    }
                }
            }
        }
        Case {
            rows,
            n_heads,
            n_kv_heads,
            head_dim,
            kv_len,
            scale: 1.0,
            q_row_stride,
            q_head_stride,
            k_row_stride,
            k_head_stride,
            v_row_stride,
            v_head_stride,
            q,
            k,
            v,
            mask,
        }
    }

    pub fn params(&self) -> FlashAttnPrefillTensorParams {
        FlashAttnPrefillTensorParams {
            rows: self.rows as u32,
            n_heads: self.n_heads as u32,
            n_kv_heads: self.n_kv_heads as u32,
            head_dim: self.head_dim as u32,
            kv_pad: self.kv_pad() as u32,
            q_row_stride: self.q_row_stride as u32,
            q_head_stride: self.q_head_stride as u32,
            k_row_stride: self.k_row_stride as u32,
            k_head_stride: self.k_head_stride as u32,
            v_row_stride: self.v_row_stride as u32,
            v_head_stride: self.v_head_stride as u32,
            scale: self.scale,
        }
    }

    /// The float64 reference of SPEC section 3: same rounded inputs, exact softmax.
    pub fn reference(&self) -> Vec<f64> {
        let (hd, nh) = (self.head_dim, self.n_heads);
        let group = nh / self.n_kv_heads;
        let kvp = self.kv_pad();
        let mut out = vec![0f64; self.rows * nh * hd];
        let mut s = vec![0f64; kvp];
        for r in 0..self.rows {
            for h in 0..nh {
                let g = h / group;
                let qh: Vec<f64> = (0..hd)
                    .map(|d| {
                        let x = self.scale * self.q[r * self.q_row_stride + h * self.q_head_stride + d];
                        f16::from_f32(x).to_f64()
                    })
                    .collect();
                let mut mx = f64::NEG_INFINITY;
                for (j, sj) in s.iter_mut().enumerate() {
                    let kr = &self.k[j * self.k_row_stride + g * self.k_head_stride..];
                    let dot: f64 = (0..hd).map(|d| qh[d] * f16::from_bits(kr[d]).to_f64()).sum();
                    *sj = dot + f16::from_bits(self.mask[r * kvp + j]).to_f64();
                    mx = mx.max(*sj);
                }
                if mx == f64::NEG_INFINITY {
                    continue; // fully masked row: zeros
                }
                let mut denom = 0.0;
                let o = &mut out[(r * nh + h) * hd..(r * nh + h + 1) * hd];
                for (j, sj) in s.iter().enumerate() {
                    let p = (sj - mx).exp();
                    denom += p;
                    let vr = &self.v[j * self.v_row_stride + g * self.v_head_stride..];
                    for d in 0..hd {
                        o[d] += p * f16::from_bits(vr[d]).to_f64();
                    }
                }
                for x in o.iter_mut() {
                    *x /= denom;
                }
            }
        }
        out
    }
}

/// Buffers of a case on a device.
pub struct Bound {
    pub q: MlxBuffer,
    pub k: MlxBuffer,
    pub v: MlxBuffer,
    pub mask: MlxBuffer,
    pub blk: MlxBuffer,
    pub out: MlxBuffer,
}

pub fn upload<T: bytemuck::Pod>(dev: &MlxDevice, dtype: DType, data: &[T]) -> MlxBuffer {
    let b = dev.alloc_buffer(dtype, &[data.len()]).unwrap();
    b.write_bytes(0, bytemuck::cast_slice(data)).unwrap();
    b
}

pub fn bind(dev: &MlxDevice, c: &Case, extra_out_rows: usize) -> Bound {
    let bq = queries_per_threadgroup(c.head_dim as u32).unwrap() as usize;
    let blk_len = c.rows.div_ceil(bq) * (c.kv_pad() / 64);
    let out = dev.alloc_buffer(DType::F32, &[(c.rows + extra_out_rows) * c.n_heads * c.head_dim]).unwrap();
    Bound {
        q: upload(dev, DType::F32, &c.q),
        k: upload(dev, DType::F16, &c.k),
        v: upload(dev, DType::F16, &c.v),
        mask: upload(dev, DType::F16, &c.mask),
        blk: dev.alloc_buffer(DType::U8, &[blk_len]).unwrap(),
        out,
    }
}

/// Classify the mask into `b.blk` and run the attention; returns the output as f32.
pub fn run(dev: &MlxDevice, reg: &mut KernelRegistry, c: &Case, b: &Bound, all_ones_blk: bool) -> Vec<f32> {
    let bq = queries_per_threadgroup(c.head_dim as u32).unwrap();
    let mut enc = dev.command_encoder();
    if all_ones_blk {
        let ones = vec![1u8; b.blk.data_byte_len()];
        b.blk.write_bytes(0, &ones).unwrap();
    } else {
        let bp = FlashAttnPrefillBlkParams { rows: c.rows as u32, kv_pad: c.kv_pad() as u32, bq, bk: 64 };
        dispatch_flash_attn_prefill_blk(&mut enc, reg, dev, &b.mask, &b.blk, &bp).unwrap();
    }
    dispatch_flash_attn_prefill_tensor_f16(&mut enc, reg, dev, &b.q, &b.k, &b.v, &b.mask, &b.blk, &b.out, &c.params())
        .unwrap();
    enc.commit_and_wait().unwrap();
    read_f32(&b.out)
}

pub fn read_f32(b: &MlxBuffer) -> Vec<f32> {
    let mut bytes = vec![0u8; b.data_byte_len()];
    b.read_bytes(0, &mut bytes).unwrap();
    bytemuck::cast_slice(&bytes).to_vec()
}

pub fn read_u8(b: &MlxBuffer) -> Vec<u8> {
    let mut bytes = vec![0u8; b.data_byte_len()];
    b.read_bytes(0, &mut bytes).unwrap();
    bytes
}

/// sum((o - ref)^2) / sum(ref^2).
pub fn nmse(out: &[f32], reference: &[f64]) -> f64 {
    let (mut num, mut den) = (0.0, 0.0);
    for (&o, &r) in out.iter().zip(reference) {
        num += (o as f64 - r).powi(2);
        den += r * r;
    }
    if den == 0.0 {
        num
    } else {
        num / den
    }
}
