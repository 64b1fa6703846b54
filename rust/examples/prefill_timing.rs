//! Times `flash_attn_prefill` on the CPU, a described mask against the same mask given
//! explicitly: `cargo run --release --example prefill_timing -- [rows] [head_dim] [n_heads]
//! [n_kv_heads] [window] [repeats] [kv_len]`, window -1 = causal (the default), 0 = dense,
//! w > 0 = causal with a window of w; kv_len defaults to rows. `MLX_NATIVE_CPU_ISA=avx512`
//! times one instruction set only. The explicit mask's table is built once, outside the
//! timing. A quick look for developers, as `cpu_timing`.

use std::time::Instant;

use mlx_native::backend::cpu::simd;
use mlx_native::ops::flash_attn_prefill::*;
use mlx_native::{default_registry, DType, MlxBuffer, MlxDevice};

/// CPU seconds this process has used (all threads), as in `cpu_timing`.
#[cfg(target_os = "linux")]
fn cpu_seconds() -> f64 {
    extern "C" {
        fn clock_gettime(clock: i32, ts: *mut [i64; 2]) -> i32;
    }
    let mut ts = [0i64; 2];
    // SAFETY: CLOCK_PROCESS_CPUTIME_ID (2) and a timespec-sized buffer.
    unsafe { clock_gettime(2, &mut ts) };
    ts[0] as f64 + ts[1] as f64 * 1e-9
}

#[cfg(not(target_os = "linux"))]
fn cpu_seconds() -> f64 {
    f64::NAN
}

fn main() {
    let args: Vec<i64> = std::env::args().skip(1).map(|a| a.parse().expect("a number")).collect();
    let arg = |i: usize, d: i64| *args.get(i).unwrap_or(&d);
    let (rows, hd, nh, nkv) = (arg(0, 1024) as usize, arg(1, 256) as usize, arg(2, 16) as usize, arg(3, 8) as usize);
    let window = arg(4, -1);
    let repeats = arg(5, 3) as usize;
    let kv = arg(6, rows as i64) as usize;
    let dev = MlxDevice::cpu();
    let mut reg = default_registry();
    let buffer = |dtype: DType, n: usize, f: &dyn Fn(usize) -> u16| -> MlxBuffer {
        let b = dev.alloc_buffer(dtype, &[n]).unwrap();
        let v: Vec<u16> = (0..n).map(f).collect();
        b.write_bytes(0, bytemuck::cast_slice(&v)).unwrap();
        b
    };
    let q = dev.alloc_buffer(DType::F32, &[rows * nh * hd]).unwrap();
    let qv: Vec<f32> = (0..rows * nh * hd).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
    q.write_bytes(0, bytemuck::cast_slice(&qv)).unwrap();
    // Halves in [0.5, 1) and their negatives.
    let k = buffer(DType::F16, kv * nkv * hd, &|i| 0x3800 | ((i * 37) % 1024) as u16 | (((i / 3) % 2) << 15) as u16);
    let v = buffer(DType::F16, kv * nkv * hd, &|i| 0x3800 | ((i * 53) % 1024) as u16 | (((i / 5) % 2) << 15) as u16);
    let off = kv as i64 - rows as i64;
    let mut pairs = 0usize;
    let visible = |r: usize, j: usize| {
        let (r, j) = (r as i64 + off, j as i64);
        window == 0 || (j <= r && (window < 0 || j > r - window))
    };
    for r in 0..rows {
        pairs += (0..kv).filter(|&j| visible(r, j)).count();
    }
    let mask = buffer(DType::F16, rows * kv, &|i| {
        if visible(i / kv, i % kv) {
            0
        } else {
            0xfc00
        }
    });
    let out = dev.alloc_buffer(DType::F32, &[rows * nh * hd]).unwrap();
    let described = FlashAttnPrefillParams {
        q_strides: [0, (nh * hd) as u64, hd as u64],
        k_strides: [0, (nkv * hd) as u64, hd as u64],
        v_strides: [0, (nkv * hd) as u64, hd as u64],
        out_strides: [0, (nh * hd) as u64, hd as u64],
        mask_strides: [0, 0],
        lse_strides: [0, 0],
        batch: 1,
        rows: rows as u32,
        kv_len: kv as u32,
        n_heads: nh as u32,
        n_kv_heads: nkv as u32,
        head_dim: hd as u32,
        causal: (window != 0) as u32,
        window: window.max(0) as u32,
        scale: 1.0,
        offset: 0,
        has_offset: 0,
        ..Default::default()
    };
    let explicit = FlashAttnPrefillParams { mask_strides: [0, kv as u64], causal: 0, window: 0, ..described };
    let blk = dev.alloc_buffer(DType::U8, &[mask_table_bytes(&explicit).unwrap() as usize]).unwrap();
    let mut enc = dev.command_encoder();
    dispatch_flash_attn_prefill_mask_blk(&mut enc, &mut reg, &dev, &mask, &blk, &explicit).unwrap();
    enc.commit_and_wait().unwrap();
    let plain = FlashAttnPrefillBuffers {
        q: &q,
        k: &k,
        v: &v,
        out: &out,
        mask: None,
        blk: None,
        cu_seqlens_q: None,
        cu_seqlens_k: None,
        lse: None,
        sinks: None,
        alibi_slopes: None,
        workspace: None,
    };
    let with_mask = FlashAttnPrefillBuffers { mask: Some(&mask), blk: Some(&blk), ..plain };
    let flops = 4.0 * hd as f64 * nh as f64 * pairs as f64;
    let kind = match window {
        0 => "dense".to_string(),
        w if w < 0 => "causal".to_string(),
        w => format!("window {w}"),
    };
    let only = std::env::var("MLX_NATIVE_CPU_ISA").ok();
    for isa in simd::detected_isas().into_iter().filter(|i| only.as_deref().is_none_or(|o| o == *i)) {
        simd::force_isa(Some(isa)).unwrap();
        for (how, b, p) in [("described", &plain, &described), ("explicit", &with_mask, &explicit)] {
            let (mut best, mut best_cpu) = (f64::MAX, f64::MAX);
            for _ in 0..repeats {
                let mut enc = dev.command_encoder();
                dispatch_flash_attn_prefill(&mut enc, &mut reg, &dev, b, p).unwrap();
                let (t, c) = (Instant::now(), cpu_seconds());
                enc.commit_and_wait().unwrap();
                best = best.min(t.elapsed().as_secs_f64());
                best_cpu = best_cpu.min(cpu_seconds() - c);
            }
            println!(
                "{isa:14} rows {rows} kv {kv} hd {hd} heads {nh}/{nkv} {kind} {how:9}: {:.1} ms, {:.1} useful GFLOP/s; per CPU second {:.1} GFLOP/s per thread",
                best * 1e3,
                flops / best / 1e9,
                flops / best_cpu / 1e9
            );
        }
    }
}
