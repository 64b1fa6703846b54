//! Helpers of the `flash_attn_prefill` tests (SPEC 6-10): a strided case over a batch (fixed
//! or variable length), its float64 reference, and a harness that runs it through the op
//! and reads the outputs back into one logical layout, checking on the way that nothing
//! outside the outputs' rows was written.

use half::{bf16, f16};
use mlx_native::ops::flash_attn_prefill::{
    dispatch_flash_attn_prefill, dispatch_flash_attn_prefill_mask_blk, mask_table_bytes, FlashAttnPrefillBuffers,
    FlashAttnPrefillParams, PrefillOperands,
};
use mlx_native::{DType, KernelRegistry, MlxBuffer, MlxDevice};

use super::{read_u8, upload, Rng};

/// The operands the plan tests use: F32 Q and output, F16 K/V, an lse, no sinks; `mask`:
/// whether an explicit mask is given.
pub fn f32_lse_operands(mask: bool) -> PrefillOperands {
    PrefillOperands {
        q_dtype: DType::F32,
        kv_dtype: DType::F16,
        out_dtype: DType::F32,
        mask,
        lse: true,
        sinks: false,
        alibi_slopes: false,
    }
}

/// The byte every output buffer is filled with before a run: all-ones is a NaN in F32, F16
/// and BF16 that no kernel writes from finite inputs.
pub const SENTINEL: u8 = 0xff;

/// An explicit additive mask: `[batch or 1, rows, kv_len]` halves with batch stride (0: one
/// mask for every sequence) and row stride.
#[derive(Clone, Debug)]
pub struct Mask {
    pub strides: [usize; 2],
    pub data: Vec<u16>,
}

/// One prefill problem with its host data. Q holds values already representable in
/// `q_dtype`; K and V are the bits of `kv_dtype` (F16 or BF16).
#[derive(Clone, Debug)]
pub struct Prefill {
    /// (query rows, cache rows) of every sequence.
    pub lens: Vec<(usize, usize)>,
    pub varlen: bool,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    /// Columns of Q and K.
    pub head_dim: usize,
    /// Columns of V and O.
    pub head_dim_v: usize,
    pub kv_dtype: DType,
    /// V is a view of K's first `head_dim_v` columns (the same buffer, K's strides).
    pub v_in_k: bool,
    /// SPEC 10: softcap (0: none), ALiBi's max_bias (0: none), one sink logit per head.
    pub softcap: f32,
    pub max_bias: f32,
    pub sinks: Option<Vec<f32>>,
    pub causal: bool,
    pub window: usize,
    /// Where query row r of every sequence sits in its cache (`r + offset`); `None`: the
    /// prompt is the cache's end (`Lk - Lq`).
    pub offset: Option<i64>,
    pub scale: f32,
    pub q_dtype: DType,
    pub out_dtype: DType,
    /// Batch, row and head strides (batch strides 0 with variable length).
    pub q_strides: [usize; 3],
    pub k_strides: [usize; 3],
    pub v_strides: [usize; 3],
    pub out_strides: [usize; 3],
    /// lse `[batch, n_heads, rows]`: batch and head strides; `None`: no lse.
    pub lse_strides: Option<[usize; 2]>,
    pub q: Vec<f32>,
    pub k: Vec<u16>,
    pub v: Vec<u16>,
    pub mask: Option<Mask>,
}

/// A value of `dtype` nearest `x`, as f32.
pub fn round_to(dtype: DType, x: f32) -> f32 {
    match dtype {
        DType::F32 => x,
        DType::F16 => f16::from_f32(x).to_f32(),
        DType::BF16 => bf16::from_f32(x).to_f32(),
        d => panic!("no float dtype {d}"),
    }
}

fn encode(dtype: DType, xs: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F32 => bytemuck::cast_slice(xs).to_vec(),
        DType::F16 => xs.iter().flat_map(|&x| f16::from_f32(x).to_bits().to_ne_bytes()).collect(),
        DType::BF16 => xs.iter().flat_map(|&x| bf16::from_f32(x).to_bits().to_ne_bytes()).collect(),
        d => panic!("no float dtype {d}"),
    }
}

fn decode(dtype: DType, bytes: &[u8]) -> f64 {
    match dtype {
        DType::F32 => f32::from_ne_bytes(bytes[..4].try_into().unwrap()) as f64,
        DType::F16 => f16::from_bits(u16::from_ne_bytes([bytes[0], bytes[1]])).to_f64(),
        DType::BF16 => bf16::from_bits(u16::from_ne_bytes([bytes[0], bytes[1]])).to_f64(),
        d => panic!("no float dtype {d}"),
    }
}

/// Elements a `[n0, n1, n2, width]` view with strides `s` spans.
fn span(counts: [usize; 3], s: [usize; 3], width: usize) -> usize {
    if counts.contains(&0) {
        return 0;
    }
    (counts[0] - 1) * s[0] + (counts[1] - 1) * s[1] + (counts[2] - 1) * s[2] + width
}

/// Strides of a `[batch, rows, heads, dim]` view padded by `pad` elements per axis, with two
/// rows more per batch (the batch stride 0 when `batch_stride` is false).
fn strides(rows: usize, heads: usize, dim: usize, pad: usize, batch_stride: bool) -> [usize; 3] {
    let hs = dim + pad;
    let rs = heads * hs + 3 * pad;
    [if batch_stride { (rows + 2) * rs + 5 * pad } else { 0 }, rs, hs]
}

impl Prefill {
    /// A fixed-length batch of `batch` sequences of `rows` query rows and `kv_len` cache rows,
    /// strided views padded by `pad` (random data; no mask, no lse, F32 in and out).
    #[allow(clippy::too_many_arguments)]
    pub fn fixed(
        seed: u64,
        batch: usize,
        rows: usize,
        kv_len: usize,
        nh: usize,
        nkv: usize,
        hd: usize,
        pad: usize,
    ) -> Prefill {
        let mut c = Prefill::layout(vec![(rows, kv_len); batch], false, nh, nkv, hd, pad);
        c.fill(seed);
        c
    }

    /// A variable-length batch with these (query rows, cache rows) per sequence.
    pub fn varlen(seed: u64, lens: &[(usize, usize)], nh: usize, nkv: usize, hd: usize, pad: usize) -> Prefill {
        let mut c = Prefill::layout(lens.to_vec(), true, nh, nkv, hd, pad);
        c.fill(seed);
        c
    }

    /// The same shapes with other head dims, K/V dtype or V as a view of K (for Q/K columns
    /// `dims.0`, V/O columns `dims.1`), filled afresh from `seed`: strides for the new widths.
    pub fn with_kv(mut self, seed: u64, dims: (usize, usize), kv_dtype: DType, v_in_k: bool) -> Prefill {
        let pad = self.q_strides[2] - self.head_dim;
        let mut c = Prefill::layout(self.lens.clone(), self.varlen, self.n_heads, self.n_kv_heads, dims.0, pad);
        (c.head_dim_v, c.kv_dtype, c.v_in_k) = (dims.1, kv_dtype, v_in_k);
        let (_, rows, kv) = c.shape();
        c.v_strides = if v_in_k { c.k_strides } else { strides(kv, c.n_kv_heads, dims.1, pad, !c.varlen) };
        c.out_strides = strides(rows, c.n_heads, dims.1, pad * 3, !c.varlen);
        (c.causal, c.window, c.offset, c.scale) = (self.causal, self.window, self.offset, self.scale);
        (c.q_dtype, c.out_dtype) = (self.q_dtype, self.out_dtype);
        (c.softcap, c.max_bias, c.sinks) = (self.softcap, self.max_bias, self.sinks.take());
        let lse = self.lse_strides.is_some();
        c.fill(seed);
        if lse {
            c = c.with_lse();
        }
        c
    }

    /// SPEC 10's score transforms.
    pub fn with_transforms(mut self, softcap: f32, max_bias: f32, sinks: Option<Vec<f32>>) -> Prefill {
        (self.softcap, self.max_bias, self.sinks) = (softcap, max_bias, sinks);
        self
    }

    /// The value of K/V bits `x` in `kv_dtype`.
    pub fn kv_value(&self, x: u16) -> f64 {
        if self.kv_dtype == DType::BF16 {
            bf16::from_bits(x).to_f64()
        } else {
            f16::from_bits(x).to_f64()
        }
    }

    /// The bits of `kv_dtype` nearest `x`.
    pub fn kv_bits(&self, x: f32) -> u16 {
        if self.kv_dtype == DType::BF16 {
            bf16::from_f32(x).to_bits()
        } else {
            f16::from_f32(x).to_bits()
        }
    }

    fn layout(lens: Vec<(usize, usize)>, varlen: bool, nh: usize, nkv: usize, hd: usize, pad: usize) -> Prefill {
        let (rows, kv) =
            if varlen { (lens.iter().map(|l| l.0).sum(), lens.iter().map(|l| l.1).sum()) } else { lens[0] };
        Prefill {
            lens,
            varlen,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            head_dim_v: hd,
            kv_dtype: DType::F16,
            v_in_k: false,
            softcap: 0.0,
            max_bias: 0.0,
            sinks: None,
            causal: false,
            window: 0,
            offset: None,
            scale: 1.0,
            q_dtype: DType::F32,
            out_dtype: DType::F32,
            q_strides: strides(rows, nh, hd, pad, !varlen),
            k_strides: strides(kv, nkv, hd, pad * 2, !varlen),
            v_strides: strides(kv, nkv, hd, pad, !varlen),
            out_strides: strides(rows, nh, hd, pad * 3, !varlen),
            lse_strides: None,
            q: Vec::new(),
            k: Vec::new(),
            v: Vec::new(),
            mask: None,
        }
    }

    /// Random Q, K, V in [-1, 1] (Q in `q_dtype`); every element outside the tensors (the
    /// padding of the strides, two rows past each sequence's end) NaN, so that a kernel that
    /// reads one poisons its output.
    pub fn fill(&mut self, seed: u64) {
        let mut rng = Rng::new(seed);
        let (seqs, rows, kv) = self.shape();
        let (nh, nkv, hd, hdv) = (self.n_heads, self.n_kv_heads, self.head_dim, self.head_dim_v);
        let past = |s: [usize; 3]| 2 * s[1];
        let nan = self.kv_bits(f32::NAN);
        self.q = vec![f32::NAN; span([seqs, rows, nh], self.q_strides, hd) + past(self.q_strides)];
        self.k = vec![nan; span([seqs, kv, nkv], self.k_strides, hd) + past(self.k_strides)];
        self.v = vec![nan; span([seqs, kv, nkv], self.v_strides, hdv) + past(self.v_strides)];
        for (b, &(lq, lk)) in self.lens.clone().iter().enumerate() {
            for r in 0..lq {
                for h in 0..nh {
                    let at = self.q_at(b, r, h);
                    for x in &mut self.q[at..at + hd] {
                        *x = round_to(self.q_dtype, rng.uniform(-1.0, 1.0));
                    }
                }
            }
            for j in 0..lk {
                for g in 0..nkv {
                    let (ka, va) = (self.k_at(b, j, g), self.v_at(b, j, g));
                    for d in 0..hd {
                        self.k[ka + d] = self.kv_bits(rng.uniform(-1.0, 1.0));
                    }
                    for d in 0..hdv {
                        self.v[va + d] = self.kv_bits(rng.uniform(-1.0, 1.0));
                    }
                }
            }
        }
        if self.v_in_k {
            // One buffer: V reads K's first head_dim_v columns.
            self.v = self.k.clone();
        }
    }

    /// Q in another dtype: its values rounded to it.
    pub fn with_q_dtype(mut self, dtype: DType) -> Prefill {
        self.q_dtype = dtype;
        for x in &mut self.q {
            *x = round_to(dtype, *x);
        }
        self
    }

    /// lse requested, `[batch, n_heads, rows]` with padded strides (`[n_heads, total]` for
    /// variable length).
    pub fn with_lse(mut self) -> Prefill {
        let (_, rows, _) = self.shape();
        let hs = rows + 3;
        self.lse_strides = Some([if self.varlen { 0 } else { self.n_heads * hs + 7 }, hs]);
        self
    }

    /// The sequences the buffers hold (1 for variable length), the rows and the cache rows
    /// of each (the totals for variable length).
    pub fn shape(&self) -> (usize, usize, usize) {
        if self.varlen {
            (1, self.lens.iter().map(|l| l.0).sum(), self.lens.iter().map(|l| l.1).sum())
        } else {
            (self.lens.len(), self.lens[0].0, self.lens[0].1)
        }
    }

    /// Row offsets of sequence b in Q and in K/V (variable length), 0 otherwise.
    fn starts(&self, b: usize) -> (usize, usize) {
        if self.varlen {
            (self.lens[..b].iter().map(|l| l.0).sum(), self.lens[..b].iter().map(|l| l.1).sum())
        } else {
            (0, 0)
        }
    }

    pub fn q_at(&self, b: usize, r: usize, h: usize) -> usize {
        let (q0, _) = self.starts(b);
        b * self.q_strides[0] + (q0 + r) * self.q_strides[1] + h * self.q_strides[2]
    }
    pub fn k_at(&self, b: usize, j: usize, g: usize) -> usize {
        let (_, k0) = self.starts(b);
        b * self.k_strides[0] + (k0 + j) * self.k_strides[1] + g * self.k_strides[2]
    }
    pub fn v_at(&self, b: usize, j: usize, g: usize) -> usize {
        let (_, k0) = self.starts(b);
        b * self.v_strides[0] + (k0 + j) * self.v_strides[1] + g * self.v_strides[2]
    }
    pub fn out_at(&self, b: usize, r: usize, h: usize) -> usize {
        let (q0, _) = self.starts(b);
        b * self.out_strides[0] + (q0 + r) * self.out_strides[1] + h * self.out_strides[2]
    }
    pub fn lse_at(&self, b: usize, r: usize, h: usize) -> usize {
        let (q0, _) = self.starts(b);
        let s = self.lse_strides.expect("no lse");
        b * s[0] + h * s[1] + q0 + r
    }
    pub fn mask_at(&self, b: usize, r: usize, j: usize) -> usize {
        let m = self.mask.as_ref().expect("no mask");
        b * m.strides[0] + r * m.strides[1] + j
    }

    /// Index of (sequence b, row r) in the logical layouts: all rows of all sequences in order.
    pub fn logical_row(&self, b: usize, r: usize) -> usize {
        self.lens[..b].iter().map(|l| l.0).sum::<usize>() + r
    }

    pub fn logical_rows(&self) -> usize {
        self.lens.iter().map(|l| l.0).sum()
    }

    /// Where query row r of sequence b sits in its cache: `r + offset`.
    pub fn query_offset(&self, b: usize) -> i64 {
        let (lq, lk) = self.lens[b];
        self.offset.unwrap_or(lk as i64 - lq as i64)
    }

    /// SPEC 6: whether query row r of sequence b sees cache row j (the description only).
    pub fn visible(&self, b: usize, r: usize, j: usize) -> bool {
        let lk = self.lens[b].1;
        let (r, j, off, w) = (r as i64, j as i64, self.query_offset(b), self.window as i64);
        j < lk as i64 && (!self.causal || j <= r + off) && (w == 0 || j > r + off - w)
    }

    /// An explicit mask for every sequence (`shared`: one for all, batch stride 0), with row
    /// stride `kv_len + pad`, whose values come from `value(b, r, j)`.
    pub fn set_mask(&mut self, shared: bool, pad: usize, mut value: impl FnMut(usize, usize, usize) -> f32) {
        assert!(!self.varlen, "an explicit mask goes with fixed length only");
        let (seqs, rows, kv) = self.shape();
        let rs = kv + pad;
        let bs = if shared { 0 } else { rows * rs + 2 * pad };
        let n = span([if shared { 1 } else { seqs }, rows, 1], [bs, rs, 0], kv);
        let mut data = vec![f16::NAN.to_bits(); n];
        for b in 0..if shared { 1 } else { seqs } {
            for r in 0..rows {
                for j in 0..kv {
                    data[b * bs + r * rs + j] = f16::from_f32(value(b, r, j)).to_bits();
                }
            }
        }
        self.mask = Some(Mask { strides: [bs, rs], data });
    }

    /// The peer's random mask (SPEC 3) for every sequence: uniform [-1, 1], then about a fifth
    /// of 32x64 blocks set to -inf or to 0.
    pub fn set_peer_mask(&mut self, seed: u64, shared: bool) {
        let mut rng = Rng::new(seed);
        let (seqs, rows, kv) = self.shape();
        let mut blocks = std::collections::HashMap::new();
        for b in 0..seqs {
            for rb in 0..rows.div_ceil(32) {
                for cb in 0..kv.div_ceil(64) {
                    let roll = rng.below(10);
                    if roll < 2 {
                        blocks.insert((b, rb, cb), if roll == 0 { f32::NEG_INFINITY } else { 0.0 });
                    }
                }
            }
        }
        self.set_mask(shared, 5, |b, r, j| match blocks.get(&(b, r / 32, j / 64)) {
            Some(&v) => v,
            None => rng.uniform(-1.0, 1.0),
        });
    }

    /// The op's params.
    pub fn params(&self) -> FlashAttnPrefillParams {
        let (_, rows, kv) = self.shape();
        let u = |s: [usize; 3]| [s[0] as u64, s[1] as u64, s[2] as u64];
        let m = self.mask.as_ref().map_or([0, 0], |m| [m.strides[0] as u64, m.strides[1] as u64]);
        let l = self.lse_strides.map_or([0, 0], |s| [s[0] as u64, s[1] as u64]);
        FlashAttnPrefillParams {
            q_strides: u(self.q_strides),
            k_strides: u(self.k_strides),
            v_strides: u(self.v_strides),
            out_strides: u(self.out_strides),
            mask_strides: m,
            lse_strides: l,
            batch: self.lens.len() as u32,
            rows: rows as u32,
            kv_len: kv as u32,
            n_heads: self.n_heads as u32,
            n_kv_heads: self.n_kv_heads as u32,
            head_dim: self.head_dim as u32,
            causal: self.causal as u32,
            window: self.window as u32,
            scale: self.scale,
            offset: self.offset.unwrap_or(0) as i32,
            has_offset: self.offset.is_some() as u32,
            head_dim_v: self.head_dim_v as u32,
            softcap: self.softcap,
            max_bias: self.max_bias,
            ..Default::default()
        }
    }

    /// SPEC 10's ALiBi slope of head `h` in f64 (1 without ALiBi).
    pub fn slope(&self, h: usize) -> f64 {
        if self.max_bias <= 0.0 {
            return 1.0;
        }
        let n2 = 1usize << (usize::BITS - 1 - self.n_heads.leading_zeros());
        let (mb, n2f) = (self.max_bias as f64, n2 as f64);
        let (m0, m1) = (2f64.powf(-mb / n2f), 2f64.powf(-mb / 2.0 / n2f));
        if h < n2 {
            m0.powi(h as i32 + 1)
        } else {
            m1.powi(2 * (h - n2) as i32 + 1)
        }
    }

    /// The float64 reference of SPEC 6-10: `qh = half(scale * q)`, F16 or BF16 K/V, on the
    /// visible pairs `s = dot(qh, k)`, softcapped, plus the head's ALiBi slope times the
    /// explicit mask (or, ALiBi without one, times the described mask's `-(p - j)`), the exact
    /// softmax with the head's sink logit as one more score. Returns O
    /// `[logical row][head][dim_v]` and lse `[logical row][head]` (`ln(e^sigma + sum_j
    /// exp(s_j))`; without a sink -inf and O = 0 where a row sees nothing).
    pub fn reference(&self) -> (Vec<f64>, Vec<f64>) {
        let (nh, hd, hdv) = (self.n_heads, self.head_dim, self.head_dim_v);
        let group = nh / self.n_kv_heads;
        let n = self.logical_rows();
        let (mut out, mut lse) = (vec![0f64; n * nh * hdv], vec![f64::NEG_INFINITY; n * nh]);
        for (b, &(lq, lk)) in self.lens.iter().enumerate() {
            let mut s = vec![f64::NEG_INFINITY; lk];
            for r in 0..lq {
                for h in 0..nh {
                    let g = h / group;
                    let qa = self.q_at(b, r, h);
                    let qh: Vec<f64> = (0..hd).map(|d| f16::from_f32(self.scale * self.q[qa + d]).to_f64()).collect();
                    let sigma = self.sinks.as_ref().map_or(f64::NEG_INFINITY, |s| s[h] as f64);
                    let slope = self.slope(h);
                    let mut mx = sigma;
                    for (j, sj) in s.iter_mut().enumerate() {
                        *sj = f64::NEG_INFINITY;
                        if !self.visible(b, r, j) {
                            continue;
                        }
                        let ka = self.k_at(b, j, g);
                        let mut dot: f64 = (0..hd).map(|d| qh[d] * self.kv_value(self.k[ka + d])).sum();
                        if self.softcap > 0.0 {
                            let cap = self.softcap as f64;
                            dot = cap * (dot / cap).tanh();
                        }
                        if let Some(m) = &self.mask {
                            dot += slope * f16::from_bits(m.data[self.mask_at(b, r, j)]).to_f64();
                        } else if self.max_bias > 0.0 {
                            // ALiBi on the described mask: llama.cpp's mask value -(p - j).
                            dot += slope * (j as f64 - (r as i64 + self.query_offset(b)) as f64);
                        }
                        *sj = dot;
                        mx = mx.max(dot);
                    }
                    let row = self.logical_row(b, r);
                    if mx == f64::NEG_INFINITY {
                        continue;
                    }
                    let o = &mut out[(row * nh + h) * hdv..(row * nh + h + 1) * hdv];
                    let mut denom = if sigma == f64::NEG_INFINITY { 0.0 } else { (sigma - mx).exp() };
                    for (j, &sj) in s.iter().enumerate() {
                        if sj == f64::NEG_INFINITY {
                            continue;
                        }
                        let p = (sj - mx).exp();
                        denom += p;
                        let va = self.v_at(b, j, g);
                        for (d, x) in o.iter_mut().enumerate() {
                            *x += p * self.kv_value(self.v[va + d]);
                        }
                    }
                    for x in o.iter_mut() {
                        *x /= denom;
                    }
                    lse[row * nh + h] = mx + denom.ln();
                }
            }
        }
        (out, lse)
    }

    /// The same prefill over cache rows `j0..j1` of every sequence only (fixed length): a
    /// part of the cache, as context parallelism splits it; a description keeps each query
    /// row where it was (the part's offset is the whole's less `j0`).
    pub fn cache_part(&self, j0: usize, j1: usize) -> Prefill {
        assert!(!self.varlen);
        let (seqs, rows, _) = self.shape();
        let mut c =
            Prefill::layout(vec![(rows, j1 - j0); seqs], false, self.n_heads, self.n_kv_heads, self.head_dim, 1);
        (c.q_dtype, c.out_dtype, c.scale, c.q_strides, c.q) =
            (self.q_dtype, self.out_dtype, self.scale, self.q_strides, self.q.clone());
        (c.causal, c.window) = (self.causal, self.window);
        if self.causal {
            c.offset = Some(self.query_offset(0) - j0 as i64);
        }
        c.lse_strides = self.lse_strides;
        let (nkv, hd) = (self.n_kv_heads, self.head_dim);
        let kn = span([seqs, j1 - j0, nkv], c.k_strides, hd);
        let vn = span([seqs, j1 - j0, nkv], c.v_strides, hd);
        (c.k, c.v) = (vec![f16::NAN.to_bits(); kn], vec![f16::NAN.to_bits(); vn]);
        for b in 0..seqs {
            for j in 0..j1 - j0 {
                for g in 0..nkv {
                    let (kd, ks) = (c.k_at(b, j, g), self.k_at(b, j0 + j, g));
                    c.k[kd..kd + hd].copy_from_slice(&self.k[ks..ks + hd]);
                    let (vd, vs) = (c.v_at(b, j, g), self.v_at(b, j0 + j, g));
                    c.v[vd..vd + hd].copy_from_slice(&self.v[vs..vs + hd]);
                }
            }
        }
        if let Some(m) = &self.mask {
            c.set_mask(m.strides[0] == 0, 3, |b, r, j| f16::from_bits(m.data[self.mask_at(b, r, j0 + j)]).to_f32());
        }
        c
    }
}

/// What each buffer of a prefill must hold, counted here from the case's own layout (not
/// from the op): elements of Q, K, V, O, lse (0 without) and the mask (0 without), bytes of
/// the mask's tables (0 without).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Needs {
    pub q: usize,
    pub k: usize,
    pub v: usize,
    pub out: usize,
    pub lse: usize,
    pub mask: usize,
    pub blk: usize,
}

/// A case's buffers, each exactly as large as [`Prefill::needs`] says: Q, K, V and the mask
/// with the case's data, O and lse filled with [`SENTINEL`], the table zero.
pub struct Buffers {
    pub q: MlxBuffer,
    pub k: MlxBuffer,
    pub v: MlxBuffer,
    pub out: MlxBuffer,
    pub lse: Option<MlxBuffer>,
    pub mask: Option<MlxBuffer>,
    pub blk: Option<MlxBuffer>,
    pub cu: Option<(MlxBuffer, MlxBuffer)>,
    pub sinks: Option<MlxBuffer>,
}

impl Buffers {
    pub fn view(&self) -> FlashAttnPrefillBuffers<'_> {
        FlashAttnPrefillBuffers {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            out: &self.out,
            mask: self.mask.as_ref(),
            blk: self.blk.as_ref(),
            cu_seqlens_q: self.cu.as_ref().map(|c| &c.0),
            cu_seqlens_k: self.cu.as_ref().map(|c| &c.1),
            lse: self.lse.as_ref(),
            sinks: self.sinks.as_ref(),
            alibi_slopes: None,
            workspace: None,
        }
    }
}

impl Prefill {
    /// `cu_seqlens_q` and `cu_seqlens_k` of the sequences (variable length).
    pub fn cu_seqlens(&self) -> (Vec<i32>, Vec<i32>) {
        let (mut cq, mut ck) = (vec![0i32], vec![0i32]);
        for &(lq, lk) in &self.lens {
            cq.push(cq.last().unwrap() + lq as i32);
            ck.push(ck.last().unwrap() + lk as i32);
        }
        (cq, ck)
    }

    pub fn needs(&self) -> Needs {
        let (seqs, rows, kv) = self.shape();
        let (nh, nkv, hd, dv) = (self.n_heads, self.n_kv_heads, self.head_dim, self.head_dim_v);
        // The table's query rows per tile (docs/spec.md 10a).
        let bq = if hd <= 256 { 32 } else { 16 };
        let mask_seqs = |m: &Mask| if m.strides[0] == 0 { 1 } else { seqs };
        Needs {
            q: span([seqs, rows, nh], self.q_strides, hd),
            k: span([seqs, kv, nkv], self.k_strides, hd),
            v: if self.v_in_k { 0 } else { span([seqs, kv, nkv], self.v_strides, dv) },
            out: span([seqs, rows, nh], self.out_strides, dv),
            lse: self.lse_strides.map_or(0, |s| span([seqs, nh, 1], [s[0], s[1], 0], rows)),
            mask: self.mask.as_ref().map_or(0, |m| span([mask_seqs(m), rows, 1], [m.strides[0], m.strides[1], 0], kv)),
            blk: self.mask.as_ref().map_or(0, |m| mask_seqs(m) * rows.div_ceil(bq) * kv.div_ceil(64)),
        }
    }

    /// The case's buffers on `dev` ([`Buffers`]).
    pub fn buffers(&self, dev: &MlxDevice) -> Buffers {
        let n = self.needs();
        let q = dev.alloc_buffer(self.q_dtype, &[n.q]).unwrap();
        q.write_bytes(0, &encode(self.q_dtype, &self.q[..n.q])).unwrap();
        let cu = self.varlen.then(|| {
            let (cq, ck) = self.cu_seqlens();
            (upload(dev, DType::I32, &cq), upload(dev, DType::I32, &ck))
        });
        let k = upload(dev, self.kv_dtype, &self.k[..n.k]);
        Buffers {
            q,
            k: k.clone(),
            v: if self.v_in_k { k } else { upload(dev, self.kv_dtype, &self.v[..n.v]) },
            out: sentinel_buffer(dev, self.out_dtype, n.out),
            lse: self.lse_strides.map(|_| sentinel_buffer(dev, DType::F32, n.lse)),
            mask: self.mask.as_ref().map(|m| upload(dev, DType::F16, &m.data[..n.mask])),
            blk: self.mask.as_ref().map(|_| dev.alloc_buffer(DType::U8, &[n.blk]).unwrap()),
            cu,
            sinks: self.sinks.as_ref().map(|s| upload(dev, DType::F32, s)),
        }
    }
}

/// What a run gives back: O `[logical row][head][dim]` and lse `[logical row][head]` as read
/// from the buffers (f64), their raw bits, and the explicit mask's table.
pub struct Output {
    pub out: Vec<f64>,
    pub lse: Vec<f64>,
    pub out_bits: Vec<u32>,
    pub lse_bits: Vec<u32>,
    pub blk: Vec<u8>,
}

/// How a run builds the explicit mask's table.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Table {
    /// `dispatch_flash_attn_prefill_mask_blk`.
    Computed,
    /// Every byte 1 (compute every tile, add the mask everywhere).
    AllOnes,
}

fn sentinel_buffer(dev: &MlxDevice, dtype: DType, elems: usize) -> MlxBuffer {
    let b = dev.alloc_buffer(dtype, &[elems.max(1)]).unwrap();
    b.write_bytes(0, &vec![SENTINEL; b.data_byte_len()]).unwrap();
    b
}

/// Where a run's inputs (Q, K, V and the explicit mask) live.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Placement {
    /// Library buffers holding the case's data (NaN past each sequence and in the padding).
    Buffers,
    /// The caller's memory (wrapped in place), each tensor ending at its last element, right
    /// before a page that faults on any access: a read past a tensor kills the process.
    #[cfg(unix)]
    Guarded,
}

/// `len` bytes that end where an inaccessible page begins (mmap, then mprotect PROT_NONE).
#[cfg(unix)]
pub struct Guarded {
    base: *mut libc::c_void,
    total: usize,
    pub ptr: *mut u8,
    pub len: usize,
}

#[cfg(unix)]
impl Guarded {
    pub fn new(bytes: &[u8]) -> Guarded {
        // SAFETY: plain anonymous mappings, checked; `ptr..ptr + len` lies in the readable part.
        unsafe {
            let page = libc::sysconf(libc::_SC_PAGESIZE) as usize;
            let body = bytes.len().div_ceil(page).max(1) * page;
            let total = body + page;
            let prot = libc::PROT_READ | libc::PROT_WRITE;
            let base = libc::mmap(std::ptr::null_mut(), total, prot, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0);
            assert!(base != libc::MAP_FAILED, "mmap failed");
            assert_eq!(libc::mprotect((base as *mut u8).add(body) as *mut libc::c_void, page, libc::PROT_NONE), 0);
            let ptr = (base as *mut u8).add(body - bytes.len());
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr, bytes.len());
            Guarded { base, total, ptr, len: bytes.len() }
        }
    }
}

#[cfg(unix)]
impl Drop for Guarded {
    fn drop(&mut self) {
        // SAFETY: mapped in `new` with this length.
        unsafe { libc::munmap(self.base, self.total) };
    }
}

/// Elements of `data` up to the last one the tensor uses (`last(b)`: one past the last
/// element of sequence b's last row, None for an empty sequence).
fn used(data_len: usize, seqs: usize, last: impl Fn(usize) -> Option<usize>) -> usize {
    (0..seqs).filter_map(last).max().unwrap_or(0).min(data_len)
}

/// Run `c` through the op on `dev`. Asserts that no byte of the output buffers outside the
/// rows of O and lse was written.
pub fn run(dev: &MlxDevice, reg: &mut KernelRegistry, c: &Prefill, table: Table) -> Output {
    run_placed(dev, reg, c, table, Placement::Buffers)
}

/// [`run`] with the inputs placed as `placement` says.
pub fn run_placed(
    dev: &MlxDevice,
    reg: &mut KernelRegistry,
    c: &Prefill,
    table: Table,
    placement: Placement,
) -> Output {
    let (seqs, rows, _) = c.shape();
    let (nh, hd) = (c.n_heads, c.head_dim_v);
    let p = c.params();
    let nkv = c.n_kv_heads;
    let seq_len = |b: usize| c.lens[b];
    // One past the last element each tensor uses.
    let dk = c.head_dim;
    let q_end = used(c.q.len(), c.lens.len(), |b| (seq_len(b).0 > 0).then(|| c.q_at(b, seq_len(b).0 - 1, nh - 1) + dk));
    let k_end =
        used(c.k.len(), c.lens.len(), |b| (seq_len(b).1 > 0).then(|| c.k_at(b, seq_len(b).1 - 1, nkv - 1) + dk));
    let v_end =
        used(c.v.len(), c.lens.len(), |b| (seq_len(b).1 > 0).then(|| c.v_at(b, seq_len(b).1 - 1, nkv - 1) + hd));
    let m_end = c.mask.as_ref().map(|m| {
        let n = if m.strides[0] == 0 { 1 } else { c.lens.len() };
        used(m.data.len(), n, |b| (rows > 0 && c.lens[b].1 > 0).then(|| c.mask_at(b, rows - 1, c.lens[b].1 - 1) + 1))
    });
    let q_bytes = encode(c.q_dtype, &c.q);
    let k_bytes: &[u8] = bytemuck::cast_slice(&c.k);
    let v_bytes: &[u8] = bytemuck::cast_slice(&c.v);
    let m_bytes: Option<&[u8]> = c.mask.as_ref().map(|m| bytemuck::cast_slice(&m.data[..]));
    #[cfg(unix)]
    let mut guards: Vec<Guarded> = Vec::new();
    let mut place = |bytes: &[u8], end: usize, dtype: DType| -> MlxBuffer {
        match placement {
            Placement::Buffers => {
                let b = dev.alloc_buffer(dtype, &[bytes.len() / dtype.size_of()]).unwrap();
                b.write_bytes(0, bytes).unwrap();
                b
            }
            #[cfg(unix)]
            Placement::Guarded => {
                let g = Guarded::new(&bytes[..end * dtype.size_of()]);
                // SAFETY: the mapping outlives the run (`guards` is dropped after it).
                let b = unsafe { dev.wrap_host(g.ptr, g.len, dtype, &[end]) }.unwrap();
                guards.push(g);
                b
            }
        }
    };
    let q = place(&q_bytes, q_end, c.q_dtype);
    let k = place(k_bytes, k_end, c.kv_dtype);
    // V a view of K (576/512): the same buffer, read at K's rows.
    let v = if c.v_in_k { k.clone() } else { place(v_bytes, v_end, c.kv_dtype) };
    let sinks = c.sinks.as_ref().map(|s| upload(dev, DType::F32, s));
    let mask = m_bytes.map(|m| place(m, m_end.unwrap(), DType::F16));
    let out_elems = span([seqs, rows, nh], c.out_strides, hd) + 2 * c.out_strides[1] + 17;
    let out = sentinel_buffer(dev, c.out_dtype, out_elems);
    let lse_elems = c.lse_strides.map_or(0, |s| span([seqs, nh, 1], [s[0], s[1], 0], rows) + 2 * s[1] + 9);
    let lse = c.lse_strides.map(|_| sentinel_buffer(dev, DType::F32, lse_elems));
    let blk =
        mask.as_ref().map(|_| dev.alloc_buffer(DType::U8, &[mask_table_bytes(&p).unwrap().max(1) as usize]).unwrap());
    let cu = c.varlen.then(|| {
        let (mut cq, mut ck) = (vec![0i32], vec![0i32]);
        for &(lq, lk) in &c.lens {
            cq.push(cq.last().unwrap() + lq as i32);
            ck.push(ck.last().unwrap() + lk as i32);
        }
        (upload(dev, DType::I32, &cq), upload(dev, DType::I32, &ck))
    });
    let mut enc = dev.command_encoder();
    if let (Some(m), Some(t)) = (&mask, &blk) {
        match table {
            Table::Computed => dispatch_flash_attn_prefill_mask_blk(&mut enc, reg, dev, m, t, &p).unwrap(),
            Table::AllOnes => t.write_bytes(0, &vec![1u8; t.data_byte_len()]).unwrap(),
        }
    }
    let bufs = FlashAttnPrefillBuffers {
        q: &q,
        k: &k,
        v: &v,
        out: &out,
        mask: mask.as_ref(),
        blk: blk.as_ref(),
        cu_seqlens_q: cu.as_ref().map(|x| &x.0),
        cu_seqlens_k: cu.as_ref().map(|x| &x.1),
        lse: lse.as_ref(),
        sinks: sinks.as_ref(),
        alibi_slopes: None,
        workspace: None,
    };
    dispatch_flash_attn_prefill(&mut enc, reg, dev, &bufs, &p).unwrap();
    enc.commit_and_wait().unwrap();

    let esize = c.out_dtype.size_of();
    let out_bytes = read_u8(&out);
    let mut written = vec![false; out_bytes.len() / esize];
    let n = c.logical_rows();
    let (mut o, mut o_bits) = (vec![0f64; n * nh * hd], vec![0u32; n * nh * hd]);
    let (mut l, mut l_bits) = (vec![0f64; n * nh], vec![0u32; n * nh]);
    let lse_bytes = lse.as_ref().map(read_u8);
    let mut lse_written = vec![false; lse_bytes.as_ref().map_or(0, |x| x.len() / 4)];
    for (b, &(lq, _)) in c.lens.iter().enumerate() {
        for r in 0..lq {
            let row = c.logical_row(b, r);
            for h in 0..nh {
                let at = c.out_at(b, r, h);
                for d in 0..hd {
                    let e = &out_bytes[(at + d) * esize..(at + d + 1) * esize];
                    o[(row * nh + h) * hd + d] = decode(c.out_dtype, e);
                    o_bits[(row * nh + h) * hd + d] = if esize == 4 {
                        u32::from_ne_bytes(e.try_into().unwrap())
                    } else {
                        u16::from_ne_bytes([e[0], e[1]]) as u32
                    };
                    written[at + d] = true;
                }
                if let Some(lb) = &lse_bytes {
                    let at = c.lse_at(b, r, h);
                    let x = f32::from_ne_bytes(lb[at * 4..at * 4 + 4].try_into().unwrap());
                    (l[row * nh + h], l_bits[row * nh + h]) = (x as f64, x.to_bits());
                    lse_written[at] = true;
                }
            }
        }
    }
    for (i, w) in written.iter().enumerate() {
        let untouched = out_bytes[i * esize..(i + 1) * esize].iter().all(|&x| x == SENTINEL);
        assert!(*w || untouched, "out element {i} lies outside every output row and was written");
    }
    if let Some(lb) = &lse_bytes {
        for (i, w) in lse_written.iter().enumerate() {
            let untouched = lb[i * 4..i * 4 + 4].iter().all(|&x| x == SENTINEL);
            assert!(*w || untouched, "lse element {i} lies outside every output row and was written");
        }
    }
    Output { out: o, lse: l, out_bits: o_bits, lse_bits: l_bits, blk: blk.as_ref().map_or(Vec::new(), read_u8) }
}
