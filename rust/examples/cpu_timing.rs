//! Times the CPU kernel on one shape per instruction set:
//! `cargo run --release --example cpu_timing -- [rows] [head_dim] [n_heads] [n_kv_heads] [window] [repeats]`,
//! window 0 = dense (zero mask, the default), -1 = causal, w > 0 = causal with a window of w.
//! `MLX_NATIVE_CPU_ISA=avx512` times one instruction set only.
//! A quick look for developers; the benchmark users read is `python -m mlx_native bench`.

use std::time::Instant;

use mlx_native::backend::cpu::simd;
use mlx_native::ops::flash_attn_prefill_blk::*;
use mlx_native::ops::flash_attn_prefill_tensor::*;
use mlx_native::{default_registry, DType, MlxDevice};

/// CPU seconds this process has used (all threads): on a busy machine, time the kernel
/// spent preempted does not count, so one-thread runs compare well across a noisy session.
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
    let window = arg(4, 0);
    let repeats = arg(5, 3) as usize;
    // MLX_NATIVE_TIMING_LAYOUT=head: K/V as [kv head][row][dim] instead of [row][kv head][dim].
    let head_major = std::env::var("MLX_NATIVE_TIMING_LAYOUT").is_ok_and(|v| v == "head");
    let kvp = kv_pad(rows as u32) as usize;
    let dev = MlxDevice::cpu();
    let mut reg = default_registry();
    let fill = |dtype: DType, n: usize, val: u8| {
        let b = dev.alloc_buffer(dtype, &[n]).unwrap();
        let bytes: Vec<u8> = (0..n * dtype.size_of())
            .map(|i| if dtype == DType::F16 && i % 2 == 1 { 0x38 } else { val.wrapping_add(i as u8) })
            .collect();
        b.write_bytes(0, &bytes).unwrap();
        b
    };
    let q = dev.alloc_buffer(DType::F32, &[rows * nh * hd]).unwrap();
    let qv: Vec<f32> = (0..rows * nh * hd).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
    q.write_bytes(0, bytemuck::cast_slice(&qv)).unwrap();
    let k = fill(DType::F16, kvp * nkv * hd, 3);
    let v = fill(DType::F16, kvp * nkv * hd, 5);
    let mask = dev.alloc_buffer(DType::F16, &[rows * kvp]).unwrap();
    // Fresh prefill: query row r sees cache rows j <= r (and j > r - window).
    let mut pairs = 0usize;
    let mvals: Vec<u16> = (0..rows * kvp)
        .map(|i| {
            let (r, j) = (i / kvp, i % kvp);
            let ok = j < rows && (window == 0 || (j <= r && (window < 0 || j as i64 > r as i64 - window)));
            pairs += ok as usize;
            if ok {
                0
            } else {
                0xfc00
            }
        })
        .collect();
    mask.write_bytes(0, bytemuck::cast_slice(&mvals)).unwrap();
    let bq = queries_per_threadgroup(hd as u32).unwrap() as usize;
    let blk = dev.alloc_buffer(DType::U8, &[rows.div_ceil(bq) * kvp / 64]).unwrap();
    let bp = FlashAttnPrefillBlkParams { rows: rows as u32, kv_pad: kvp as u32, bq: bq as u32, bk: 64 };
    let mut enc = dev.command_encoder();
    dispatch_flash_attn_prefill_blk(&mut enc, &mut reg, &dev, &mask, &blk, &bp).unwrap();
    enc.commit_and_wait().unwrap();
    let out = dev.alloc_buffer(DType::F32, &[rows * nh * hd]).unwrap();
    let p = FlashAttnPrefillTensorParams {
        rows: rows as u32,
        n_heads: nh as u32,
        n_kv_heads: nkv as u32,
        head_dim: hd as u32,
        kv_pad: kvp as u32,
        q_row_stride: (nh * hd) as u32,
        q_head_stride: hd as u32,
        k_row_stride: (if head_major { hd } else { nkv * hd }) as u32,
        k_head_stride: (if head_major { kvp * hd } else { hd }) as u32,
        v_row_stride: (if head_major { hd } else { nkv * hd }) as u32,
        v_head_stride: (if head_major { kvp * hd } else { hd }) as u32,
        scale: 1.0,
    };
    let flops = 4.0 * hd as f64 * nh as f64 * pairs as f64;
    let only = std::env::var("MLX_NATIVE_CPU_ISA").ok();
    for isa in simd::detected_isas().into_iter().filter(|i| only.as_deref().is_none_or(|o| o == *i)) {
        simd::force_isa(Some(isa)).unwrap();
        let mut best = f64::MAX;
        let mut best_cpu = f64::MAX;
        for _ in 0..repeats {
            let mut enc = dev.command_encoder();
            dispatch_flash_attn_prefill_tensor_f16(&mut enc, &mut reg, &dev, &q, &k, &v, &mask, &blk, &out, &p)
                .unwrap();
            let (t, c) = (Instant::now(), cpu_seconds());
            enc.commit_and_wait().unwrap();
            best = best.min(t.elapsed().as_secs_f64());
            best_cpu = best_cpu.min(cpu_seconds() - c);
        }
        let kind = match window {
            0 => "dense".to_string(),
            w if w < 0 => "causal".to_string(),
            w => format!("window {w}"),
        };
        println!("{isa:14} rows {rows} hd {hd} heads {nh}/{nkv} {kind}: {:.1} ms, {:.1} useful GFLOP/s; per CPU second {:.1} GFLOP/s per thread",
            best * 1e3, flops / best / 1e9, flops / best_cpu / 1e9);
    }
}
