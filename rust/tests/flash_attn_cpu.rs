//! The CPU kernel against a naive float64 reference, on every instruction set this CPU has.

mod common;

use common::*;
use mlx_native::backend::cpu::{flash_attn_prefill_tensor, simd};
use mlx_native::ops::flash_attn_prefill_tensor::queries_per_threadgroup;
use mlx_native::{default_registry, MlxDevice};

/// Held by the test that owns the instruction-set switch while it turns it, and by a test
/// that compares two runs bit for bit: those must run on one set (the AMX tiles add in
/// another order than the FMA kernels, so a switch between the two runs changes bits).
static ISA_SWITCH: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs `f` once per instruction set, with that set forced. One test owns the switch, so
/// tests that run in parallel see every set at some point, and each must be correct anyway.
fn for_each_isa(mut f: impl FnMut(&str)) {
    let _switch = ISA_SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    for isa in simd::detected_isas() {
        simd::force_isa(Some(isa)).unwrap();
        f(isa);
    }
    simd::force_isa(None).unwrap();
}

fn cases() -> Vec<(&'static str, Case)> {
    let mut scaled = Case::new(5, 40, 4, 1, 256, 160, 0, MaskKind::Peer);
    scaled.scale = 0.37;
    vec![
        ("d256 gqa2 peer strided partial", Case::new(1, 45, 4, 2, 256, 130, 1, MaskKind::Peer)),
        ("d512 mha causal partial", Case::new(2, 33, 2, 2, 512, 77, 0, MaskKind::Causal)),
        ("d256 gqa8 window strided", Case::new(3, 20, 8, 1, 256, 200, 2, MaskKind::Window(64))),
        ("d512 zero mask kv=64", Case::new(4, 17, 4, 4, 512, 64, 1, MaskKind::Zero)),
        ("d256 gqa4 peer scale", scaled),
        ("d512 gqa2 peer longer cache", Case::new(6, 24, 4, 2, 512, 300, 0, MaskKind::Peer)),
        // One head per KV head: 4 query tiles per work item, the last item with one of 5.
        ("d256 mha window, items of 4 tiles", Case::new(7, 150, 3, 3, 256, 150, 1, MaskKind::Window(40))),
        ("d256 gqa2 peer, one item of 4 tiles", Case::new(8, 100, 4, 2, 256, 100, 0, MaskKind::Peer)),
    ]
}

#[test]
fn matches_the_float64_reference_on_every_isa() {
    let dev = MlxDevice::cpu();
    let mut reg = default_registry();
    for (name, c) in cases() {
        let reference = c.reference();
        let b = bind(&dev, &c, 0);
        for_each_isa(|isa| {
            let out = run(&dev, &mut reg, &c, &b, false);
            assert!(out.iter().all(|x| x.is_finite()), "{name} [{isa}]: non-finite output");
            let e = nmse(&out, &reference);
            eprintln!("{name:32} [{isa:14}] nmse {e:.3e}");
            assert!(e < 1e-5, "{name} [{isa}]: nmse {e:e}");
            // Leaving out the -inf cache rows of partly masked tiles changes no bit.
            flash_attn_prefill_tensor::set_column_skipping(false);
            let full = run(&dev, &mut reg, &c, &b, false);
            flash_attn_prefill_tensor::set_column_skipping(true);
            let same = out.iter().zip(&full).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{name} [{isa}]: skipping -inf cache rows changes the output");
        });
    }
}

#[test]
fn the_skip_table_changes_no_bit() {
    let _one_isa = ISA_SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let dev = MlxDevice::cpu();
    let mut reg = default_registry();
    for (name, c) in cases() {
        let b = bind(&dev, &c, 0);
        let with_blk = run(&dev, &mut reg, &c, &b, false);
        let blk = read_u8(&b.blk);
        let all_ones = run(&dev, &mut reg, &c, &b, true);
        let same = with_blk.iter().zip(&all_ones).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{name}: computed blk {blk:?} changes the output");
    }
}

#[test]
fn the_peer_mask_produces_all_three_tile_classes() {
    let dev = MlxDevice::cpu();
    let mut reg = default_registry();
    let c = Case::new(11, 300, 2, 1, 256, 700, 0, MaskKind::Peer);
    let b = bind(&dev, &c, 0);
    run(&dev, &mut reg, &c, &b, false);
    let blk = read_u8(&b.blk);
    for want in 0..=2u8 {
        assert!(blk.contains(&want), "no tile of class {want} in {blk:?}");
    }
    // Check each tile against its definition.
    let bq = queries_per_threadgroup(256).unwrap() as usize;
    let kvp = c.kv_pad();
    for (t, &got) in blk.iter().enumerate() {
        let (qt, kt) = (t / (kvp / 64), t % (kvp / 64));
        let vals: Vec<f32> = (qt * bq..((qt + 1) * bq).min(c.rows))
            .flat_map(|r| (kt * 64..kt * 64 + 64).map(move |j| (r, j)))
            .map(|(r, j)| half::f16::from_bits(c.mask[r * kvp + j]).to_f32())
            .collect();
        let want = if vals.iter().all(|&x| x <= -65504.0) {
            0
        } else if vals.iter().all(|&x| x == 0.0) {
            2
        } else {
            1
        };
        assert_eq!(got, want, "tile ({qt}, {kt})");
    }
}

#[test]
fn fully_masked_rows_are_zero_and_past_rows_untouched() {
    let dev = MlxDevice::cpu();
    let mut reg = default_registry();
    for hd in [256usize, 512] {
        let mut c = Case::new(21, 37, 4, 2, hd, 150, 0, MaskKind::Peer);
        let kvp = c.kv_pad();
        let ninf = half::f16::NEG_INFINITY.to_bits();
        // Rows 3 and 36 see nothing.
        for j in 0..kvp {
            c.mask[3 * kvp + j] = ninf;
            c.mask[36 * kvp + j] = ninf;
        }
        let b = bind(&dev, &c, 3);
        let sentinel = f32::from_bits(0x7fc0_dead);
        let fill: Vec<f32> = vec![sentinel; b.out.data_byte_len() / 4];
        b.out.write_bytes(0, bytemuck::cast_slice(&fill)).unwrap();
        let out = run(&dev, &mut reg, &c, &b, false);
        let row = c.n_heads * hd;
        for r in [3usize, 36] {
            assert!(out[r * row..(r + 1) * row].iter().all(|&x| x == 0.0), "row {r} not zero");
        }
        assert!(out[..c.rows * row].iter().all(|x| x.is_finite()), "NaN or inf written");
        assert!(out[c.rows * row..].iter().all(|x| x.to_bits() == sentinel.to_bits()), "a row >= rows was written");
        let reference = c.reference();
        let e = nmse(&out[..c.rows * row], &reference);
        assert!(e < 1e-5, "hd {hd}: nmse {e:e}");
    }
}

#[test]
fn instruction_sets_agree_closely() {
    let dev = MlxDevice::cpu();
    let mut reg = default_registry();
    let c = Case::new(31, 64, 4, 2, 256, 256, 0, MaskKind::Peer);
    let b = bind(&dev, &c, 0);
    let mut outs = Vec::new();
    for_each_isa(|isa| outs.push((isa.to_string(), run(&dev, &mut reg, &c, &b, false))));
    let reference: Vec<f64> = outs[0].1.iter().map(|&x| x as f64).collect();
    for (isa, o) in &outs[1..] {
        let e = nmse(o, &reference);
        assert!(e < 1e-9, "{isa} differs from {}: {e:e}", outs[0].0);
    }
}

/// The CPU classifier's own guard, under the op's validation: a dispatch built by hand
/// whose mask or table buffer is short of what its params say is an internal error (the
/// op's contract broken), and nothing is written; either buffer alone short is refused.
#[test]
fn a_hand_built_classifier_dispatch_with_short_buffers_is_refused() {
    use mlx_native::ops::flash_attn_prefill_blk::K_BLK_F16;
    use mlx_native::params::FlashAttnPrefillBlkParamsGpu;
    use mlx_native::{as_bytes, DType, GridSize, KernelArg, MlxError};
    let dev = MlxDevice::cpu();
    let mut reg = default_registry();
    let pipeline = reg.get_pipeline(K_BLK_F16, &dev).unwrap().clone();
    let p = FlashAttnPrefillBlkParamsGpu { rows: 64, kv_pad: 128, bq: 32, bk: 64 };
    let full_mask = dev.alloc_buffer(DType::F16, &[64 * 128]).unwrap();
    let short_mask = dev.alloc_buffer(DType::F16, &[64 * 128 - 1]).unwrap();
    let full_blk = dev.alloc_buffer(DType::U8, &[4]).unwrap();
    let short_blk = dev.alloc_buffer(DType::U8, &[3]).unwrap();
    for (what, mask, blk, refused) in [
        ("both whole", &full_mask, &full_blk, false),
        ("mask short", &short_mask, &full_blk, true),
        ("table short", &full_mask, &short_blk, true),
    ] {
        blk.write_bytes(0, &[0xEE; 3]).unwrap();
        let args = [(0, KernelArg::Bytes(as_bytes(&p))), (1, KernelArg::Buffer(mask)), (2, KernelArg::Buffer(blk))];
        let mut enc = dev.command_encoder();
        enc.encode_threadgroups_with_args_and_shared(
            &pipeline,
            &args,
            &[],
            GridSize::new(1, 1, 1),
            GridSize::new(32, 1, 1),
        )
        .unwrap();
        match (enc.commit_and_wait(), refused) {
            (Err(MlxError::Internal(m)), true) => assert!(m.contains("buffers smaller than validated"), "{what}: {m}"),
            (Ok(()), false) => {}
            (other, _) => panic!("{what}: got {other:?}"),
        }
        let mut got = [0u8; 3];
        blk.read_bytes(0, &mut got).unwrap();
        assert_eq!(got == [0xEE; 3], refused, "{what}: the table was {}written", if refused { "" } else { "not " });
    }
}
