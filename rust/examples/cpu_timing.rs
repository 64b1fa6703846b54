//! Times the CPU kernel on one dense shape per instruction set:
//! `cargo run --release --example cpu_timing -- [rows] [head_dim] [n_heads] [n_kv_heads]`.
//! A quick look for developers; the benchmark users read is `python -m mlx_native bench`.

use std::time::Instant;

use mlx_native::backend::cpu::simd;
use mlx_native::ops::flash_attn_prefill_tensor::*;
use mlx_native::{default_registry, DType, MlxDevice};

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().expect("a number")).collect();
    let rows = *args.first().unwrap_or(&1024);
    let hd = *args.get(1).unwrap_or(&256);
    let nh = *args.get(2).unwrap_or(&16);
    let nkv = *args.get(3).unwrap_or(&8);
    let kvp = kv_pad(rows as u32) as usize;
    let dev = MlxDevice::cpu();
    let mut reg = default_registry();
    let fill = |dtype: DType, n: usize, val: u8| {
        let b = dev.alloc_buffer(dtype, &[n]).unwrap();
        let bytes: Vec<u8> = (0..n * dtype.size_of()).map(|i| if dtype == DType::F16 && i % 2 == 1 { 0x38 } else { val.wrapping_add(i as u8) }).collect();
        b.write_bytes(0, &bytes).unwrap();
        b
    };
    let q = dev.alloc_buffer(DType::F32, &[rows * nh * hd]).unwrap();
    let qv: Vec<f32> = (0..rows * nh * hd).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
    q.write_bytes(0, bytemuck::cast_slice(&qv)).unwrap();
    let k = fill(DType::F16, kvp * nkv * hd, 3);
    let v = fill(DType::F16, kvp * nkv * hd, 5);
    let mask = dev.alloc_buffer(DType::F16, &[rows * kvp]).unwrap();
    let bq = queries_per_threadgroup(hd as u32).unwrap() as usize;
    let blk = dev.alloc_buffer(DType::U8, &[rows.div_ceil(bq) * kvp / 64]).unwrap();
    blk.write_bytes(0, &vec![2u8; blk.data_byte_len()]).unwrap();
    let out = dev.alloc_buffer(DType::F32, &[rows * nh * hd]).unwrap();
    let p = FlashAttnPrefillTensorParams {
        rows: rows as u32,
        n_heads: nh as u32,
        n_kv_heads: nkv as u32,
        head_dim: hd as u32,
        kv_pad: kvp as u32,
        q_row_stride: (nh * hd) as u32,
        q_head_stride: hd as u32,
        k_row_stride: (nkv * hd) as u32,
        k_head_stride: hd as u32,
        v_row_stride: (nkv * hd) as u32,
        v_head_stride: hd as u32,
        scale: 1.0,
    };
    let flops = 4.0 * hd as f64 * nh as f64 * rows as f64 * kvp as f64;
    for isa in simd::detected_isas() {
        simd::force_isa(Some(isa)).unwrap();
        let mut best = f64::MAX;
        for _ in 0..3 {
            let mut enc = dev.command_encoder();
            dispatch_flash_attn_prefill_tensor_f16(&mut enc, &mut reg, &dev, &q, &k, &v, &mask, &blk, &out, &p).unwrap();
            let t = Instant::now();
            enc.commit_and_wait().unwrap();
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!("{isa:14} rows {rows} hd {hd} heads {nh}/{nkv} dense: {:.1} ms, {:.1} GFLOP/s", best * 1e3, flops / best / 1e9);
    }
}
