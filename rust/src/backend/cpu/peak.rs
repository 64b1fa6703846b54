//! The machine's own limit: the measured rate of fused multiply-adds on registers, with the
//! instruction set the kernels use. Independent accumulator chains (more than the FMA
//! latency times the FMA ports) run a calibrated number of iterations on each of `threads`
//! threads; the best of a few runs is the peak. Reported in GFLOP/s (an FMA is 2 FLOP, per
//! f32 lane), the unit of the kernels' useful FLOP/s, so "% of peak" is a plain ratio.
//!
//! Where the CPU has AMX, the same measurement of TDPBF16PS ([`amx_peak_gflops`]): four
//! independent accumulator tiles (more than the instruction's latency over its issue
//! interval), each product 16 x 16 x 32 multiply-adds, 2 FLOP each.

use std::hint::black_box;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use super::simd::{Portable, Simd, W};
use crate::error::{MlxError, Result};

/// Independent accumulators: 12 vectors (24 ymm for AVX2 is too many for 16 registers, so
/// that path uses 6 pairs = 12 ymm); enough to cover a 4-cycle latency on 2 ports.
const CHAINS: usize = 12;
/// The AVX2 loop's chains: each of its vectors is a pair of ymm registers.
const AVX2_CHAINS: usize = CHAINS / 2;

/// FLOP of one iteration of a loop of `chains` vectors: an FMA (2 FLOP) per f32 lane.
fn iteration_flop(chains: usize) -> f64 {
    (chains * W * 2) as f64
}

/// Inner iterations per timed call, each `CHAINS` FMAs of `W` lanes.
#[inline(always)]
unsafe fn chains<S: Simd, const N: usize>(iters: u64, seed: f32) -> f32 {
    let a = S::splat(black_box(0.999_999));
    let b = S::splat(black_box(1e-7));
    let mut acc = [S::splat(seed); N];
    for (i, x) in acc.iter_mut().enumerate() {
        *x = S::add(*x, S::splat(i as f32));
    }
    for _ in 0..iters {
        // Unrolled by the fixed-size array: N independent dependency chains.
        for x in acc.iter_mut() {
            *x = S::fma(*x, a, b);
        }
    }
    let mut sum = S::splat(0.0);
    for x in acc {
        sum = S::add(sum, x);
    }
    let mut out = [0f32; W];
    S::store(out.as_mut_ptr(), sum);
    out.iter().sum()
}

unsafe fn run_portable(iters: u64, seed: f32) -> f32 {
    chains::<Portable, CHAINS>(iters, seed)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn run_avx512(iters: u64, seed: f32) -> f32 {
    chains::<super::simd::Avx512, CHAINS>(iters, seed)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_avx2(iters: u64, seed: f32) -> f32 {
    chains::<super::simd::Avx2, AVX2_CHAINS>(iters, seed)
}

/// The loop for the instruction set in use, and the FLOP of one iteration. The AMX
/// kernels' vector work is AVX-512's (the emulated tiles': the best set here), so theirs is
/// the FMA peak that applies to it.
fn pick() -> (unsafe fn(u64, f32) -> f32, f64) {
    #[cfg(target_arch = "x86_64")]
    {
        use super::simd::{has_avx2, has_avx512, AMX, AMX_EMULATED};
        match super::simd::selected_isa() {
            "avx512" | AMX => return (run_avx512, iteration_flop(CHAINS)),
            AMX_EMULATED if has_avx512() => return (run_avx512, iteration_flop(CHAINS)),
            "avx2+fma+f16c" => return (run_avx2, iteration_flop(AVX2_CHAINS)),
            AMX_EMULATED if has_avx2() => return (run_avx2, iteration_flop(AVX2_CHAINS)),
            _ => {}
        }
    }
    (run_portable, iteration_flop(CHAINS))
}

/// FLOP of one iteration of the AMX loop: four TDPBF16PS of 16 x 16 x 32 multiply-adds.
pub const AMX_ITERATION_FLOP: f64 = (4 * 16 * 16 * 32 * 2) as f64;

/// `iters` iterations of four independent tile products on the hardware tiles.
///
/// # Safety
/// Only where `amx::available()`.
#[cfg(target_arch = "x86_64")]
unsafe fn run_amx(iters: u64, seed: f32) -> f32 {
    use super::amx::{HwTiles, TileUnit};
    // Small values: a billion products of 1e-3 * 1e-3 stay far from overflow, none denormal.
    let a = [half::bf16::from_f32(1e-3).to_bits(); 512];
    let mut c = [0f32; 256];
    let mut t = HwTiles;
    t.configure();
    t.zero::<0>();
    t.zero::<1>();
    t.zero::<2>();
    t.zero::<3>();
    let (p, stride) = (a.as_ptr() as *const u8, 64);
    t.load::<4>(p, stride);
    t.load::<5>(p, stride);
    t.load::<6>(p, stride);
    t.load::<7>(p, stride);
    for _ in 0..iters {
        t.dot_bf16::<0, 4, 6>();
        t.dot_bf16::<1, 4, 7>();
        t.dot_bf16::<2, 5, 6>();
        t.dot_bf16::<3, 5, 7>();
    }
    t.store::<0>(c.as_mut_ptr() as *mut u8, 64);
    t.release();
    c[0] + seed
}

/// Wall time of `iters` iterations on each of `threads` threads started together.
fn timed(f: unsafe fn(u64, f32) -> f32, threads: usize, iters: u64) -> Duration {
    let barrier = Barrier::new(threads + 1);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let barrier = &barrier;
                s.spawn(move || {
                    barrier.wait();
                    // SAFETY: `pick` chose an instruction set this CPU has.
                    black_box(unsafe { f(iters, t as f32) });
                    barrier.wait();
                })
            })
            .collect();
        barrier.wait();
        let t0 = Instant::now();
        barrier.wait();
        let dt = t0.elapsed();
        for h in handles {
            let _ = h.join();
        }
        dt
    })
}

/// Most threads [`fma_peak_gflops`] accepts.
pub const MAX_THREADS: usize = 1024;

/// Measured FMA peak of `threads` threads (0: the kernels' thread count), GFLOP/s, with
/// the instruction set the kernels use now. Takes about a quarter of a second.
pub fn fma_peak_gflops(threads: usize) -> Result<f64> {
    let threads = if threads == 0 { super::threads() } else { threads };
    if threads > MAX_THREADS {
        return Err(MlxError::InvalidArgument(format!("threads must be at most {MAX_THREADS}, got {threads}")));
    }
    let (f, flop_per_iter) = pick();
    measure(f, flop_per_iter, threads)
}

/// Measured AMX-BF16 peak of `threads` threads (0: the kernels' thread count), GFLOP/s:
/// TDPBF16PS on registers, 2 FLOP per multiply-add. `BackendUnavailable` where the CPU or
/// the OS offers no AMX tiles (`amx::available`).
pub fn amx_peak_gflops(threads: usize) -> Result<f64> {
    let threads = if threads == 0 { super::threads() } else { threads };
    if threads > MAX_THREADS {
        return Err(MlxError::InvalidArgument(format!("threads must be at most {MAX_THREADS}, got {threads}")));
    }
    if !super::amx::available() {
        return Err(MlxError::BackendUnavailable("this CPU (or its OS) offers no AMX tiles".into()));
    }
    #[cfg(target_arch = "x86_64")]
    {
        measure(run_amx, AMX_ITERATION_FLOP, threads)
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("AMX is only available on x86-64")
}

/// The peak rate of loop `f` (`flop_per_iter` per iteration) on `threads` threads, GFLOP/s.
fn measure(f: unsafe fn(u64, f32) -> f32, flop_per_iter: f64, threads: usize) -> Result<f64> {
    // Calibrate: grow the count until one run takes at least 20 ms (clock ramp-up included).
    let mut iters: u64 = 1 << 14;
    loop {
        let dt = timed(f, threads, iters);
        if dt >= Duration::from_millis(20) || iters >= 1 << 40 {
            break;
        }
        let grow = (0.03 / dt.as_secs_f64().max(1e-6)).clamp(2.0, 64.0);
        iters = (iters as f64 * grow) as u64;
    }
    let best = (0..5).map(|_| timed(f, threads, iters)).min().unwrap_or(Duration::MAX);
    Ok(threads as f64 * iters as f64 * flop_per_iter / best.as_secs_f64() / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_is_positive_and_threads_are_checked() {
        let one = fma_peak_gflops(1).unwrap();
        assert!(one.is_finite() && one > 0.1, "one-core peak {one}");
        assert!(fma_peak_gflops(MAX_THREADS + 1).is_err());
        // The limit itself is accepted (1024 short-lived threads; about a second here).
        let most = fma_peak_gflops(MAX_THREADS).unwrap();
        assert!(most.is_finite() && most > 0.1, "peak of {MAX_THREADS} threads {most}");
        // They share the cores: together they run at least as fast as a quarter of one
        // thread alone (a rate not multiplied by the threads is about 1000x below).
        assert!(most > one / 4.0, "{MAX_THREADS} threads {most} GFLOP/s, one thread {one}");
    }

    /// The peak runs the loop of the instruction set the kernels use, and counts its FLOP
    /// from its own number of chains (a chain is one vector of W f32 lanes).
    #[test]
    fn the_peak_loop_is_the_kernels_instruction_set_and_counts_its_flop() {
        type Loop = unsafe fn(u64, f32) -> f32;
        let (f, flop) = pick();
        let (want, chains): (Loop, usize) = match super::super::simd::selected_isa() {
            #[cfg(target_arch = "x86_64")]
            "avx512" | "amx" => (run_avx512, 12),
            #[cfg(target_arch = "x86_64")]
            "avx2+fma+f16c" => (run_avx2, 6),
            _ => (run_portable, 12),
        };
        assert_eq!(f as usize, want as usize, "the loop of another instruction set");
        assert_eq!(flop, (chains * W) as f64 * 2.0);
        assert_eq!(iteration_flop(1), 2.0 * W as f64);
    }

    /// The reported rate is the loop's FLOP over its time, in GFLOP/s: timed here
    /// independently on one thread, the two agree within a factor of 3 (a wrong unit or
    /// count is off by orders of magnitude).
    #[test]
    fn the_peak_is_the_loops_flop_over_its_time() {
        let (f, flop) = pick();
        let iters: u64 = 1 << 20;
        let best = (0..3)
            .map(|_| {
                let t0 = Instant::now();
                // SAFETY: `pick` chose an instruction set this CPU has.
                black_box(unsafe { f(iters, 1.0) });
                t0.elapsed()
            })
            .min()
            .unwrap();
        let direct = iters as f64 * flop / best.as_secs_f64() / 1e9;
        let peak = fma_peak_gflops(1).unwrap();
        assert!(peak > direct / 3.0 && peak < direct * 3.0, "peak {peak} GFLOP/s, the loop timed here {direct}");
    }

    /// Without AMX the AMX peak is an error that says so; with it, a rate above the FMA
    /// peak of the same threads (AMX-BF16 does several times the FMA units' work).
    #[test]
    fn the_amx_peak_needs_amx_and_exceeds_the_fma_peak() {
        assert!(amx_peak_gflops(MAX_THREADS + 1).is_err());
        match amx_peak_gflops(1) {
            Err(MlxError::BackendUnavailable(m)) => {
                assert!(!super::super::amx::available(), "AMX available, yet: {m}");
                assert!(m.contains("AMX"), "{m}");
            }
            Err(e) => panic!("unexpected error {e}"),
            Ok(g) => {
                assert!(super::super::amx::available());
                let fma = fma_peak_gflops(1).unwrap();
                assert!(g > fma, "AMX peak {g} GFLOP/s, FMA peak {fma}");
            }
        }
        assert_eq!(AMX_ITERATION_FLOP, 65536.0);
    }

    #[test]
    fn the_loop_computes_what_it_says() {
        // x <- x * a + b with a = 0.999999, b = 1e-7 stays finite and near its start.
        let r = unsafe { run_portable(1000, 1.0) };
        assert!(r.is_finite() && r > 0.0);
    }
}
