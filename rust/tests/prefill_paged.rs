//! Paged K/V (SPEC 11) through the Rust plan on the CPU: the result equals the contiguous
//! layout's bit for bit on every instruction set (block sizes that steps align with and
//! ones they span), table entries past a sequence's end and unused blocks are never read
//! (garbage and NaN), and the plan refuses caches smaller than the block count it was
//! made for, as it refuses every bad table (the op's unit tests list those).

mod common;

use common::{read_u8, upload};
use half::f16;
use mlx_native::backend::cpu::simd;
use mlx_native::ops::flash_attn_prefill::{FlashAttnPrefillParams, PrefillOperands};
use mlx_native::ops::flash_attn_prefill_paged::PagedKv;
use mlx_native::ops::flash_attn_prefill_plan::{FlashAttnPrefillPlan, PrefillRunBuffers};
use mlx_native::{default_registry, DType, MlxBuffer, MlxDevice, MlxError};

const NH: usize = 4;
const NKV: usize = 2;
const D: usize = 64;

/// A deterministic stream of values in [-1, 1).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

fn operands(kv_dtype: DType) -> PrefillOperands {
    PrefillOperands {
        q_dtype: DType::F32,
        kv_dtype,
        out_dtype: DType::F32,
        mask: false,
        lse: true,
        sinks: false,
        alibi_slopes: false,
    }
}

fn params(batch: u32, rows: u32, kv_len: u32, k_strides: [u64; 3]) -> FlashAttnPrefillParams {
    FlashAttnPrefillParams {
        q_strides: [0, (NH * D) as u64, D as u64],
        k_strides,
        v_strides: k_strides,
        out_strides: [0, (NH * D) as u64, D as u64],
        lse_strides: [0, rows as u64],
        batch,
        rows,
        kv_len,
        n_heads: NH as u32,
        n_kv_heads: NKV as u32,
        head_dim: D as u32,
        causal: 1,
        scale: 0.125,
        ..Default::default()
    }
}

/// Run `plan` on these buffers; returns the output's and lse's bytes.
fn run(plan: &FlashAttnPrefillPlan, q: &MlxBuffer, k: &MlxBuffer, v: &MlxBuffer) -> Result<Vec<u8>, MlxError> {
    let dev = plan.device();
    let e = *plan.extents();
    let out = dev.alloc_buffer(DType::F32, &[e.out as usize]).unwrap();
    let lse = dev.alloc_buffer(DType::F32, &[e.lse as usize]).unwrap();
    let b = PrefillRunBuffers {
        q,
        k,
        v,
        out: &out,
        mask: None,
        lse: Some(&lse),
        sinks: None,
        alibi_slopes: None,
        workspace: None,
    };
    plan.run(&mut default_registry(), &b, None)?;
    Ok([read_u8(&out), read_u8(&lse)].concat())
}

#[test]
fn paged_kv_is_the_contiguous_layout_to_the_bit_on_every_instruction_set() {
    // BF16: the same bits read as bfloat16 (the AMX item then packs K/V once for all items,
    // through the shared packing's own staging rows).
    for kv in [DType::F16, DType::BF16] {
        same_bits(kv);
    }
}

fn same_bits(kv: DType) {
    let dev = MlxDevice::cpu();
    let mut rng = Lcg(7);
    let (lq, lk) = ([20usize, 0, 37], [100usize, 5, 37]);
    let cq: Vec<i32> = [0, 20, 20, 57].to_vec();
    let ck: Vec<i32> = [0, 100, 105, 142].to_vec();
    let row = NKV * D;
    // F16 bits (what the buffers hold).
    let k: Vec<u16> = (0..142 * row).map(|_| f16::from_f32(rng.next()).to_bits()).collect();
    let v: Vec<u16> = (0..142 * row).map(|_| f16::from_f32(rng.next()).to_bits()).collect();
    let q: Vec<f32> = (0..57 * NH * D).map(|_| rng.next()).collect();
    let qb = upload(&dev, DType::F32, &q);
    let (kb, vb) = (upload(&dev, kv, &k), upload(&dev, kv, &v));
    let flat = FlashAttnPrefillPlan::new(
        &dev,
        &params(3, 57, 142, [0, row as u64, D as u64]),
        &operands(kv),
        Some((&cq, &ck)),
    )
    .unwrap();
    assert_eq!(lq.iter().sum::<usize>(), 57);
    for bs in [16usize, 48, 64] {
        // Each sequence's blocks in a shuffled order, two blocks unused, garbage past each
        // sequence's last block, NaN in every row no sequence holds.
        let need: Vec<usize> = lk.iter().map(|n| n.div_ceil(bs)).collect();
        let num_blocks = need.iter().sum::<usize>() + 2;
        let mut order: Vec<usize> = (0..num_blocks).collect();
        for i in (1..num_blocks).rev() {
            order.swap(i, (rng.next().abs() * i as f32) as usize % (i + 1));
        }
        let max_blocks = need.iter().max().unwrap() + 1;
        let mut table = vec![i32::MIN; lk.len() * max_blocks];
        let nan = 0x7fc0u16; // NaN as F16 and as BF16
        let (mut kc, mut vc) = (vec![nan; num_blocks * bs * row], vec![nan; num_blocks * bs * row]);
        let (mut at, mut start) = (0, 0);
        for (b, &n) in lk.iter().enumerate() {
            for i in 0..need[b] {
                table[b * max_blocks + i] = order[at + i] as i32;
            }
            table[b * max_blocks + need[b]] = 1_000_000 + b as i32;
            for j in 0..n {
                let dst = (table[b * max_blocks + j / bs] as usize * bs + j % bs) * row;
                kc[dst..dst + row].copy_from_slice(&k[(start + j) * row..][..row]);
                vc[dst..dst + row].copy_from_slice(&v[(start + j) * row..][..row]);
            }
            at += need[b];
            start += n;
        }
        let used: Vec<i32> = lk.iter().map(|&n| n as i32).collect();
        let pg = PagedKv {
            block_table: &table,
            max_blocks: max_blocks as u32,
            seqused_k: &used,
            num_blocks: num_blocks as u32,
            block_size: bs as u32,
        };
        let strides = [(bs * row) as u64, row as u64, D as u64];
        let plan = FlashAttnPrefillPlan::new_paged(
            &dev,
            &params(3, 57, 0, strides),
            &operands(kv),
            Some(&cq),
            &pg,
            Default::default(),
        )
        .unwrap();
        let (kcb, vcb) = (upload(&dev, kv, &kc), upload(&dev, kv, &vc));
        for isa in simd::detected_isas().into_iter().chain(["amx-emulated"]) {
            simd::force_isa(Some(isa)).unwrap();
            let want = run(&flat, &qb, &kb, &vb).unwrap();
            let got = run(&plan, &qb, &kcb, &vcb).unwrap();
            assert!(got == want, "{kv} block size {bs}, {isa}: the paged result differs from the contiguous one");
        }
        simd::force_isa(None).unwrap();
        // Caches of fewer blocks than the plan's: refused before anything runs.
        let short = upload(&dev, kv, &kc[..(num_blocks - 1) * bs * row]);
        match run(&plan, &qb, &short, &vcb) {
            Err(MlxError::InvalidArgument(m)) => assert!(m.contains("k holds"), "{m}"),
            other => panic!("a short cache ran: {:?}", other.map(|_| ())),
        }
    }
}

#[test]
fn a_bad_table_makes_no_plan() {
    let dev = MlxDevice::cpu();
    let used = [40i32];
    for (table, want) in [([0, 3], "block_table[0, 1] is 3"), ([-1, 0], "block_table[0, 0] is -1")] {
        let pg = PagedKv { block_table: &table, max_blocks: 2, seqused_k: &used, num_blocks: 3, block_size: 32 };
        let p = params(1, 8, 0, [(32 * NKV * D) as u64, (NKV * D) as u64, D as u64]);
        match FlashAttnPrefillPlan::new_paged(&dev, &p, &operands(DType::F16), None, &pg, Default::default()) {
            Err(MlxError::InvalidArgument(m)) => assert!(m.contains(want), "{m}"),
            other => panic!("{want}: planned anyway ({:?})", other.map(|_| ())),
        }
    }
}
