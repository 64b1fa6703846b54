//! Every rejection of SPEC's validation list, one by one: the right error, a message that
//! names the problem, nothing dispatched, no buffer touched.

mod common;

use common::*;
use mlx_native::ops::flash_attn_prefill_blk::{dispatch_flash_attn_prefill_blk, FlashAttnPrefillBlkParams};
use mlx_native::ops::flash_attn_prefill_tensor::{
    dispatch_flash_attn_prefill_tensor_f16, flash_attn_prefill_tensor_available, FlashAttnPrefillTensorParams,
};
use mlx_native::{default_registry, DType, MlxDevice, MlxError};

fn expect_invalid(what: &str, dev: &MlxDevice, b: &Bound, p: &FlashAttnPrefillTensorParams, needle: &str) {
    let mut reg = default_registry();
    let mut enc = dev.command_encoder();
    let before = read_u8(&b.out);
    let err =
        dispatch_flash_attn_prefill_tensor_f16(&mut enc, &mut reg, dev, &b.q, &b.k, &b.v, &b.mask, &b.blk, &b.out, p)
            .expect_err(what);
    match &err {
        MlxError::InvalidArgument(m) => {
            assert!(m.starts_with("flash_attn_prefill_tensor: "), "{what}: {m}");
            assert!(m.contains(needle), "{what}: message {m:?} lacks {needle:?}");
        }
        other => panic!("{what}: expected InvalidArgument, got {other:?}"),
    }
    assert!(enc.pending().is_empty(), "{what}: something was encoded");
    enc.commit_and_wait().unwrap();
    assert_eq!(read_u8(&b.out), before, "{what}: out was written");
}

#[test]
fn each_bad_parameter_is_refused_with_its_reason() {
    let dev = MlxDevice::cpu();
    let c = Case::new(1, 40, 4, 2, 256, 100, 0, MaskKind::Peer);
    let b = bind(&dev, &c, 0);
    let ok = c.params();
    let cases: Vec<(&str, FlashAttnPrefillTensorParams, &str)> = vec![
        ("head_dim 128", FlashAttnPrefillTensorParams { head_dim: 128, ..ok }, "unsupported head_dim 128"),
        ("rows 0", FlashAttnPrefillTensorParams { rows: 0, ..ok }, "empty shape"),
        ("n_heads 0", FlashAttnPrefillTensorParams { n_heads: 0, ..ok }, "empty shape"),
        ("n_kv_heads 0", FlashAttnPrefillTensorParams { n_kv_heads: 0, ..ok }, "empty shape"),
        ("kv_pad 0", FlashAttnPrefillTensorParams { kv_pad: 0, ..ok }, "empty shape"),
        ("gqa 4/3", FlashAttnPrefillTensorParams { n_kv_heads: 3, ..ok }, "not a multiple of n_kv_heads 3"),
        ("kv_pad 100", FlashAttnPrefillTensorParams { kv_pad: 100, ..ok }, "kv_pad 100 is not a multiple of 64"),
        ("stride > i32", FlashAttnPrefillTensorParams { k_row_stride: 1 << 31, ..ok }, "exceeds i32"),
        ("rows > i32", FlashAttnPrefillTensorParams { rows: u32::MAX, ..ok }, "exceeds i32"),
        ("q row stride 1030", FlashAttnPrefillTensorParams { q_row_stride: 1030, ..ok }, "multiples of 4"),
        ("q head stride 258", FlashAttnPrefillTensorParams { q_head_stride: 258, ..ok }, "multiples of 4"),
        ("q too small", FlashAttnPrefillTensorParams { q_row_stride: ok.q_row_stride + 4, ..ok }, "q holds"),
        ("k too small", FlashAttnPrefillTensorParams { k_head_stride: ok.k_head_stride + 1, ..ok }, "k holds"),
        ("v too small", FlashAttnPrefillTensorParams { v_row_stride: ok.v_row_stride * 2, ..ok }, "v holds"),
        ("kv_pad beyond k", FlashAttnPrefillTensorParams { kv_pad: 192, ..ok }, "k holds"),
        ("huge stride", FlashAttnPrefillTensorParams { k_row_stride: i32::MAX as u32, ..ok }, "k holds"),
    ];
    for (what, p, needle) in cases {
        expect_invalid(what, &dev, &b, &p, needle);
    }
}

#[test]
fn wrong_dtypes_and_short_buffers_are_refused() {
    let dev = MlxDevice::cpu();
    let c = Case::new(2, 40, 4, 2, 256, 100, 0, MaskKind::Peer);
    let p = c.params();
    let mut b = bind(&dev, &c, 0);
    let q_f16 = dev.alloc_buffer(DType::F16, &[c.q.len() * 2]).unwrap();
    let orig_q = std::mem::replace(&mut b.q, q_f16);
    expect_invalid("q f16", &dev, &b, &p, "q must be F32, got F16");
    b.q = orig_q;
    let k_f32 = dev.alloc_buffer(DType::F32, &[c.k.len()]).unwrap();
    let orig_k = std::mem::replace(&mut b.k, k_f32);
    expect_invalid("k f32", &dev, &b, &p, "k must be F16, got F32");
    b.k = orig_k;
    let v_bf16 = dev.alloc_buffer(DType::BF16, &[c.v.len()]).unwrap();
    let orig_v = std::mem::replace(&mut b.v, v_bf16);
    expect_invalid("v bf16", &dev, &b, &p, "v must be F16, got BF16");
    b.v = orig_v;
    let mask_f32 = dev.alloc_buffer(DType::F32, &[c.mask.len()]).unwrap();
    let orig_mask = std::mem::replace(&mut b.mask, mask_f32);
    expect_invalid("mask f32", &dev, &b, &p, "mask must be F16");
    b.mask = orig_mask;
    let blk_i32 = dev.alloc_buffer(DType::I32, &[64]).unwrap();
    let orig_blk = std::mem::replace(&mut b.blk, blk_i32);
    expect_invalid("blk i32", &dev, &b, &p, "blk must be U8");
    b.blk = dev.alloc_buffer(DType::U8, &[3]).unwrap(); // needs ceil(40/32) * 2 = 4
    expect_invalid("blk short", &dev, &b, &p, "at least 4 bytes");
    b.blk = orig_blk;
    let mask_short = dev.alloc_buffer(DType::F16, &[c.mask.len() - 1]).unwrap();
    let orig_mask = std::mem::replace(&mut b.mask, mask_short);
    expect_invalid("mask short", &dev, &b, &p, "mask holds");
    b.mask = orig_mask;
    let out_short = dev.alloc_buffer(DType::F32, &[40 * 4 * 256 - 1]).unwrap();
    let orig_out = std::mem::replace(&mut b.out, out_short);
    expect_invalid("out short", &dev, &b, &p, "out holds");
    b.out = orig_out;
    // An output that aliases an input.
    let alias = b.q.clone();
    let orig_out = std::mem::replace(&mut b.out, alias);
    expect_invalid("out aliases q", &dev, &b, &FlashAttnPrefillTensorParams { ..p }, "out overlaps q");
    b.out = orig_out;
}

#[test]
fn a_buffer_of_another_device_is_refused() {
    let dev = MlxDevice::cpu();
    let other = MlxDevice::cpu();
    let c = Case::new(3, 8, 2, 2, 512, 64, 0, MaskKind::Zero);
    let b = bind(&dev, &c, 0);
    let b_other = bind(&other, &c, 0);
    let mut reg = default_registry();
    let mut enc = dev.command_encoder();
    let err = dispatch_flash_attn_prefill_tensor_f16(
        &mut enc,
        &mut reg,
        &dev,
        &b.q,
        &b.k,
        &b.v,
        &b.mask,
        &b.blk,
        &b_other.out,
        &c.params(),
    )
    .unwrap_err();
    assert!(matches!(&err, MlxError::InvalidArgument(m) if m.contains("buffer of device")), "{err:?}");
    assert!(enc.pending().is_empty());
}

#[test]
fn blk_validation() {
    let dev = MlxDevice::cpu();
    let mut reg = default_registry();
    let mask = dev.alloc_buffer(DType::F16, &[40 * 128]).unwrap();
    let blk = dev.alloc_buffer(DType::U8, &[4]).unwrap();
    let ok = FlashAttnPrefillBlkParams { rows: 40, kv_pad: 128, bq: 32, bk: 64 };
    let bad: Vec<(FlashAttnPrefillBlkParams, &str)> = vec![
        (FlashAttnPrefillBlkParams { rows: 0, ..ok }, "empty shape"),
        (FlashAttnPrefillBlkParams { bq: 0, ..ok }, "empty shape"),
        (FlashAttnPrefillBlkParams { kv_pad: 96, ..ok }, "not a multiple of bk"),
        (FlashAttnPrefillBlkParams { rows: 41, ..ok }, "mask holds"),
        (FlashAttnPrefillBlkParams { bq: 16, ..ok }, "at least 6 bytes"),
        (FlashAttnPrefillBlkParams { rows: u32::MAX, ..ok }, "exceeds i32"),
    ];
    for (p, needle) in bad {
        let mut enc = dev.command_encoder();
        let err = dispatch_flash_attn_prefill_blk(&mut enc, &mut reg, &dev, &mask, &blk, &p).unwrap_err();
        assert!(matches!(&err, MlxError::InvalidArgument(m) if m.contains(needle)), "{p:?}: {err:?}");
        assert!(enc.pending().is_empty());
    }
    let mut enc = dev.command_encoder();
    let wrong = dev.alloc_buffer(DType::F32, &[40 * 128]).unwrap();
    let err = dispatch_flash_attn_prefill_blk(&mut enc, &mut reg, &dev, &wrong, &blk, &ok).unwrap_err();
    assert!(matches!(&err, MlxError::InvalidArgument(m) if m.contains("mask must be F16")), "{err:?}");
    dispatch_flash_attn_prefill_blk(&mut enc, &mut reg, &dev, &mask, &blk, &ok).unwrap();
    enc.commit_and_wait().unwrap();
    assert_eq!(read_u8(&blk), vec![2, 2, 2, 2], "an all-zero mask is class 2 everywhere");
}

#[test]
fn the_cpu_always_offers_both_head_dims() {
    let dev = MlxDevice::cpu();
    let mut reg = default_registry();
    assert!(flash_attn_prefill_tensor_available(&mut reg, &dev, 256).unwrap());
    assert!(flash_attn_prefill_tensor_available(&mut reg, &dev, 512).unwrap());
    assert!(flash_attn_prefill_tensor_available(&mut reg, &dev, 64).is_err());
}

// -- flash_attn_prefill (SPEC 6-9): the front door's op -------------------------------------

mod front_door {
    use super::common::prefill::{f32_lse_operands, Buffers, Prefill};
    use super::common::{read_u8, upload};
    use mlx_native::ops::flash_attn_prefill::{
        dispatch_flash_attn_prefill, dispatch_flash_attn_prefill_mask_blk, mask_table_bytes, sequence_lengths,
        validate_buffers, validate_shapes, FlashAttnPrefillBuffers, FlashAttnPrefillParams, PrefillOperands,
    };
    use mlx_native::ops::flash_attn_prefill_plan::{FlashAttnPrefillPlan, PrefillRunBuffers};
    use mlx_native::{default_registry, DType, MlxBuffer, MlxDevice, MlxError};

    /// A fixed-length batch: causal, lse, a peer mask per sequence, strided views.
    fn fixed() -> Prefill {
        let mut c = Prefill::fixed(201, 2, 40, 100, 4, 2, 256, 1).with_lse();
        c.causal = true;
        c.set_peer_mask(5, false);
        c
    }

    /// A variable-length batch: causal, lse, an empty prompt.
    fn varlen() -> Prefill {
        let mut c = Prefill::varlen(202, &[(20, 30), (0, 10), (17, 40)], 4, 2, 256, 1).with_lse();
        c.causal = true;
        c
    }

    /// The dispatch must fail with `InvalidArgument` (`dtype`: `UnsupportedDtype`) whose
    /// message starts with the op's name and contains `needle`; nothing is encoded and no
    /// output byte changes.
    fn refused(
        what: &str,
        dev: &MlxDevice,
        b: &FlashAttnPrefillBuffers<'_>,
        p: &FlashAttnPrefillParams,
        dtype: bool,
        needle: &str,
    ) {
        let mut reg = default_registry();
        let mut enc = dev.command_encoder();
        let (out, lse) = (read_u8(b.out), b.lse.map(read_u8));
        let err = dispatch_flash_attn_prefill(&mut enc, &mut reg, dev, b, p).expect_err(what);
        check_error(what, &err, dtype, needle);
        assert!(enc.pending().is_empty(), "{what}: something was encoded");
        enc.commit_and_wait().unwrap();
        assert_eq!(read_u8(b.out), out, "{what}: out was written");
        assert_eq!(b.lse.map(read_u8), lse, "{what}: lse was written");
    }

    fn check_error(what: &str, err: &MlxError, dtype: bool, needle: &str) {
        let m = match (err, dtype) {
            (MlxError::InvalidArgument(m), false) | (MlxError::UnsupportedDtype(m), true) => m,
            _ => panic!("{what}: expected {}, got {err:?}", if dtype { "UnsupportedDtype" } else { "InvalidArgument" }),
        };
        assert!(m.starts_with("flash_attn_prefill: "), "{what}: {m}");
        assert!(m.contains(needle), "{what}: message {m:?} lacks {needle:?}");
    }

    /// The dispatch succeeds (the table computed first when there is a mask) and writes out
    /// (filled with 0xff bytes first); returns out's bytes.
    fn accepted(what: &str, dev: &MlxDevice, b: &FlashAttnPrefillBuffers<'_>, p: &FlashAttnPrefillParams) -> Vec<u8> {
        let mut reg = default_registry();
        let mut enc = dev.command_encoder();
        if let (Some(m), Some(t)) = (b.mask, b.blk) {
            dispatch_flash_attn_prefill_mask_blk(&mut enc, &mut reg, dev, m, t, p)
                .unwrap_or_else(|e| panic!("{what}: {e:?}"));
        }
        b.out.write_bytes(0, &vec![0xff; b.out.data_byte_len()]).unwrap();
        dispatch_flash_attn_prefill(&mut enc, &mut reg, dev, b, p).unwrap_or_else(|e| panic!("{what}: {e:?}"));
        assert!(!enc.pending().is_empty(), "{what}: nothing encoded");
        enc.commit_and_wait().unwrap();
        let out = read_u8(b.out);
        assert!(out.iter().any(|&x| x != 0xff), "{what}: out not written");
        out
    }

    fn shorter(dev: &MlxDevice, b: &MlxBuffer) -> MlxBuffer {
        dev.alloc_buffer(b.dtype(), &[b.element_count() - 1]).unwrap()
    }

    #[test]
    fn each_bad_prefill_parameter_is_refused_with_its_reason() {
        let dev = MlxDevice::cpu();
        let c = fixed();
        let bufs = c.buffers(&dev);
        let b = bufs.view();
        let p = c.params();
        let causal = accepted("the case itself", &dev, &b, &p);
        let big = 1u32 << 31;
        let huge = 1u64 << 63;
        let cases: Vec<(&str, FlashAttnPrefillParams, &str)> = vec![
            ("head_dim 100", FlashAttnPrefillParams { head_dim: 100, head_dim_v: 100, ..p }, "unsupported head_dim 100 (v head dim 100); this build's kernels take 16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512, 576 with v 512"),
            ("no heads", FlashAttnPrefillParams { n_heads: 0, ..p }, "n_heads 0 and n_kv_heads 2 must be at least 1"),
            ("no kv heads", FlashAttnPrefillParams { n_kv_heads: 0, ..p }, "must be at least 1"),
            (
                "heads do not group",
                FlashAttnPrefillParams { n_heads: 3, ..p },
                "n_heads 3 is not a multiple of n_kv_heads 2",
            ),
            ("causal 2", FlashAttnPrefillParams { causal: 2, ..p }, "causal must be 0 or 1, got 2"),
            ("has_offset 2", FlashAttnPrefillParams { has_offset: 2, ..p }, "has_offset must be 0 or 1, got 2"),
            (
                "offset without causal",
                FlashAttnPrefillParams { causal: 0, has_offset: 1, offset: 3, ..p },
                "an offset (3) places",
            ),
            ("scale NaN", FlashAttnPrefillParams { scale: f32::NAN, ..p }, "scale NaN is not a finite number"),
            ("scale inf", FlashAttnPrefillParams { scale: f32::INFINITY, ..p }, "is not a finite number"),
            ("batch past i32", FlashAttnPrefillParams { batch: big, ..p }, "a dimension exceeds i32"),
            ("rows past i32", FlashAttnPrefillParams { rows: big, ..p }, "a dimension exceeds i32"),
            ("kv_len past i32", FlashAttnPrefillParams { kv_len: big, ..p }, "a dimension exceeds i32"),
            (
                "n_heads past i32",
                FlashAttnPrefillParams { n_heads: big, n_kv_heads: big, ..p },
                "a dimension exceeds i32",
            ),
            ("window past i32", FlashAttnPrefillParams { window: big, ..p }, "a dimension exceeds i32"),
            ("q stride past i64", FlashAttnPrefillParams { q_strides: [0, huge, 0], ..p }, "a stride exceeds i64"),
            ("k stride past i64", FlashAttnPrefillParams { k_strides: [huge, 0, 0], ..p }, "a stride exceeds i64"),
            ("v stride past i64", FlashAttnPrefillParams { v_strides: [0, 0, huge], ..p }, "a stride exceeds i64"),
            ("out stride past i64", FlashAttnPrefillParams { out_strides: [0, huge, 0], ..p }, "a stride exceeds i64"),
            ("mask stride past i64", FlashAttnPrefillParams { mask_strides: [0, huge], ..p }, "a stride exceeds i64"),
            ("lse stride past i64", FlashAttnPrefillParams { lse_strides: [huge, 0], ..p }, "a stride exceeds i64"),
            (
                "causal, cache shorter than the prompt",
                FlashAttnPrefillParams { kv_len: 39, ..p },
                "causal with 40 query rows and a cache of 39 rows",
            ),
            // Strides the buffers (exactly as large as the case needs) cannot hold.
            (
                "q row stride + 1",
                FlashAttnPrefillParams { q_strides: [p.q_strides[0], p.q_strides[1] + 1, p.q_strides[2]], ..p },
                "q holds",
            ),
            (
                "k batch stride + 1",
                FlashAttnPrefillParams { k_strides: [p.k_strides[0] + 1, p.k_strides[1], p.k_strides[2]], ..p },
                "k holds",
            ),
            (
                "v head stride + 1",
                FlashAttnPrefillParams { v_strides: [p.v_strides[0], p.v_strides[1], p.v_strides[2] + 1], ..p },
                "v holds",
            ),
            (
                "out row stride + 1",
                FlashAttnPrefillParams { out_strides: [p.out_strides[0], p.out_strides[1] + 1, p.out_strides[2]], ..p },
                "out holds",
            ),
            (
                "lse head stride + 1",
                FlashAttnPrefillParams { lse_strides: [p.lse_strides[0], p.lse_strides[1] + 1], ..p },
                "lse holds",
            ),
            (
                "mask row stride + 1",
                FlashAttnPrefillParams { mask_strides: [p.mask_strides[0], p.mask_strides[1] + 1], ..p },
                "mask holds",
            ),
            ("one sequence more", FlashAttnPrefillParams { batch: 3, ..p }, "holds"),
            ("one query row more", FlashAttnPrefillParams { rows: 41, kv_len: 101, ..p }, "holds"),
        ];
        for (what, bad, needle) in &cases {
            refused(what, &dev, &b, bad, false, needle);
        }
        // The limits themselves pass those checks: a window of i32::MAX rows is a causal
        // mask; a batch of i32::MAX sequences and a stride of i64::MAX are refused by the
        // buffers' sizes, not by the limits.
        let widest = accepted("window i32::MAX", &dev, &b, &FlashAttnPrefillParams { window: i32::MAX as u32, ..p });
        assert!(widest == causal, "a window of i32::MAX rows is not the causal mask");
        refused("batch i32::MAX", &dev, &b, &FlashAttnPrefillParams { batch: i32::MAX as u32, ..p }, false, "q holds");
        let top = i64::MAX as u64;
        refused(
            "q batch stride i64::MAX",
            &dev,
            &b,
            &FlashAttnPrefillParams { q_strides: [top, p.q_strides[1], p.q_strides[2]], ..p },
            false,
            "q holds",
        );
        // Nothing to compute (no sequence, or no query row): accepted, nothing encoded (a
        // grid with no threadgroup is an error on a GPU).
        for (what, empty) in [
            ("batch 0", FlashAttnPrefillParams { batch: 0, ..p }),
            ("rows 0", FlashAttnPrefillParams { rows: 0, ..p }),
            ("batch 0, rows 0", FlashAttnPrefillParams { batch: 0, rows: 0, ..p }),
        ] {
            let mut reg = default_registry();
            let mut enc = dev.command_encoder();
            dispatch_flash_attn_prefill(&mut enc, &mut reg, &dev, &b, &empty)
                .unwrap_or_else(|e| panic!("{what}: {e:?}"));
            assert!(enc.pending().is_empty(), "{what}: a dispatch was encoded");
        }
        // A cache shorter than the prompt is fine with an explicit offset, and so is a
        // smaller problem than the buffers hold.
        accepted(
            "offset, short cache",
            &dev,
            &b,
            &FlashAttnPrefillParams { kv_len: 39, has_offset: 1, offset: -5, ..p },
        );
        accepted("window 7", &dev, &b, &FlashAttnPrefillParams { window: 7, ..p });
        accepted("not causal", &dev, &b, &FlashAttnPrefillParams { causal: 0, ..p });
    }

    #[test]
    fn wrong_dtypes_short_and_missing_prefill_buffers_are_refused() {
        let dev = MlxDevice::cpu();
        let c = fixed();
        let bufs = c.buffers(&dev);
        let p = c.params();
        let n = c.needs();
        let mask_bytes = mask_table_bytes(&p).unwrap() as usize;
        assert_eq!(n.blk, mask_bytes, "the op's table size");
        let b = bufs.view();
        accepted("exact sizes", &dev, &b, &p);
        let q_i32 = dev.alloc_buffer(DType::I32, &[n.q]).unwrap();
        refused(
            "q i32",
            &dev,
            &FlashAttnPrefillBuffers { q: &q_i32, ..b },
            &p,
            true,
            "q must be F32 or F16 or BF16, got I32",
        );
        // F32 K/V are read on the CPU (a window without causal is a two-sided window now too);
        // other element types are refused.
        let k_i32 = dev.alloc_buffer(DType::I32, &[n.k]).unwrap();
        let v_i32 = dev.alloc_buffer(DType::I32, &[n.v]).unwrap();
        let v_f32 = dev.alloc_buffer(DType::F32, &[n.v]).unwrap();
        refused(
            "k and v i32",
            &dev,
            &FlashAttnPrefillBuffers { k: &k_i32, v: &v_i32, ..b },
            &p,
            true,
            "k and v must be F16, BF16, F32 or quantised (F8E4M3, F8E5M2, Q8_0), got I32",
        );
        refused("v f32", &dev, &FlashAttnPrefillBuffers { v: &v_f32, ..b }, &p, true, "k is F16 and v is F32");
        let out_i32 = dev.alloc_buffer(DType::I32, &[n.out]).unwrap();
        refused(
            "out i32",
            &dev,
            &FlashAttnPrefillBuffers { out: &out_i32, ..b },
            &p,
            true,
            "out must be F32 or F16 or BF16, got I32",
        );
        let lse_f16 = dev.alloc_buffer(DType::F16, &[n.lse]).unwrap();
        refused(
            "lse f16",
            &dev,
            &FlashAttnPrefillBuffers { lse: Some(&lse_f16), ..b },
            &p,
            true,
            "lse must be F32, got F16",
        );
        let mask_f32 = dev.alloc_buffer(DType::F32, &[n.mask]).unwrap();
        refused(
            "mask f32",
            &dev,
            &FlashAttnPrefillBuffers { mask: Some(&mask_f32), ..b },
            &p,
            true,
            "mask must be F16, got F32",
        );
        let blk_i32 = dev.alloc_buffer(DType::I32, &[n.blk]).unwrap();
        refused(
            "blk i32",
            &dev,
            &FlashAttnPrefillBuffers { blk: Some(&blk_i32), ..b },
            &p,
            true,
            "blk must be U8, got I32",
        );
        for (name, short) in [
            ("q", FlashAttnPrefillBuffers { q: &shorter(&dev, &bufs.q), ..b }),
            ("k", FlashAttnPrefillBuffers { k: &shorter(&dev, &bufs.k), ..b }),
            ("v", FlashAttnPrefillBuffers { v: &shorter(&dev, &bufs.v), ..b }),
            ("out", FlashAttnPrefillBuffers { out: &shorter(&dev, &bufs.out), ..b }),
            ("lse", FlashAttnPrefillBuffers { lse: Some(&shorter(&dev, bufs.lse.as_ref().unwrap())), ..b }),
            ("mask", FlashAttnPrefillBuffers { mask: Some(&shorter(&dev, bufs.mask.as_ref().unwrap())), ..b }),
            ("blk", FlashAttnPrefillBuffers { blk: Some(&shorter(&dev, bufs.blk.as_ref().unwrap())), ..b }),
        ] {
            refused(&format!("{name} short"), &dev, &short, &p, false, &format!("{name} holds"));
        }
        refused(
            "a mask without its table",
            &dev,
            &FlashAttnPrefillBuffers { blk: None, ..b },
            &p,
            false,
            "an explicit mask needs its tile table",
        );
        refused(
            "a table without its mask",
            &dev,
            &FlashAttnPrefillBuffers { mask: None, ..b },
            &p,
            false,
            "an explicit mask needs its tile table",
        );
        let cu = upload(&dev, DType::I32, &[0i32, 40, 80]);
        refused(
            "one cu_seqlens",
            &dev,
            &FlashAttnPrefillBuffers { cu_seqlens_q: Some(&cu), ..b },
            &p,
            false,
            "give both or neither",
        );
        refused(
            "the other cu_seqlens",
            &dev,
            &FlashAttnPrefillBuffers { cu_seqlens_k: Some(&cu), ..b },
            &p,
            false,
            "give both or neither",
        );
        // Outputs that overlap an input or each other: views of one allocation.
        let overlap = |base: &MlxBuffer, dtype: DType, elems: usize| {
            base.view(0, elems * dtype.size_of(), dtype, vec![elems]).unwrap()
        };
        let big = dev.alloc_buffer(DType::U8, &[16 * (n.q + n.k + n.v + n.out + n.lse + n.mask + n.blk)]).unwrap();
        let out_big = overlap(&big, DType::F32, n.out);
        let lse_big = overlap(&big, DType::F32, n.lse);
        for (name, input) in [
            ("q", FlashAttnPrefillBuffers { q: &overlap(&big, DType::F32, n.q), ..b }),
            ("k", FlashAttnPrefillBuffers { k: &overlap(&big, DType::F16, n.k), ..b }),
            ("v", FlashAttnPrefillBuffers { v: &overlap(&big, DType::F16, n.v), ..b }),
            ("mask", FlashAttnPrefillBuffers { mask: Some(&overlap(&big, DType::F16, n.mask)), ..b }),
            ("blk", FlashAttnPrefillBuffers { blk: Some(&overlap(&big, DType::U8, n.blk)), ..b }),
        ] {
            refused(
                &format!("out overlaps {name}"),
                &dev,
                &FlashAttnPrefillBuffers { out: &out_big, ..input },
                &p,
                false,
                &format!("out overlaps {name}"),
            );
            refused(
                &format!("lse overlaps {name}"),
                &dev,
                &FlashAttnPrefillBuffers { lse: Some(&lse_big), ..input },
                &p,
                false,
                &format!("lse overlaps {name}"),
            );
        }
        refused(
            "lse overlaps out",
            &dev,
            &FlashAttnPrefillBuffers { out: &out_big, lse: Some(&lse_big), ..b },
            &p,
            false,
            "lse overlaps out",
        );
        // A workspace (the backend's scratch) overlapping any other buffer, inputs and
        // outputs alike.
        let ws_big = overlap(&big, DType::U8, 64);
        for (name, other) in [
            ("q", FlashAttnPrefillBuffers { q: &overlap(&big, DType::F32, n.q), ..b }),
            ("v", FlashAttnPrefillBuffers { v: &overlap(&big, DType::F16, n.v), ..b }),
            ("mask", FlashAttnPrefillBuffers { mask: Some(&overlap(&big, DType::F16, n.mask)), ..b }),
            ("sinks", FlashAttnPrefillBuffers { sinks: Some(&overlap(&big, DType::F32, 4)), ..b }),
            ("out", FlashAttnPrefillBuffers { out: &out_big, ..b }),
            ("lse", FlashAttnPrefillBuffers { lse: Some(&lse_big), ..b }),
        ] {
            if other.sinks.is_some() != b.sinks.is_some() {
                continue; // this prefill has no sinks to overlap
            }
            refused(
                &format!("the workspace overlaps {name}"),
                &dev,
                &FlashAttnPrefillBuffers { workspace: Some(&ws_big), ..other },
                &p,
                false,
                &format!("the workspace overlaps {name}"),
            );
        }
        // Side by side in one allocation is no overlap.
        let (ob, lb) = (n.out * 4, n.lse * 4);
        let out_side = big.view(0, ob, DType::F32, vec![n.out]).unwrap();
        let lse_side = big.view(ob, lb, DType::F32, vec![n.lse]).unwrap();
        accepted(
            "out and lse side by side",
            &dev,
            &FlashAttnPrefillBuffers { out: &out_side, lse: Some(&lse_side), ..b },
            &p,
        );
        // A workspace of its own: the CPU has no use for one (no bytes asked), and the same
        // output comes.
        let ws_own = dev.alloc_buffer(DType::U8, &[64]).unwrap();
        let with_ws = accepted("a workspace", &dev, &FlashAttnPrefillBuffers { workspace: Some(&ws_own), ..b }, &p);
        assert_eq!(with_ws, accepted("no workspace", &dev, &b, &p));
        // No lse, no mask: the op without them.
        let p0 = FlashAttnPrefillParams { lse_strides: [0, 0], mask_strides: [0, 0], ..p };
        accepted("no lse, no mask", &dev, &FlashAttnPrefillBuffers { lse: None, mask: None, blk: None, ..b }, &p0);
    }

    #[test]
    fn bad_variable_length_batches_are_refused() {
        let dev = MlxDevice::cpu();
        let c = varlen();
        let bufs = c.buffers(&dev);
        let b = bufs.view();
        let p = c.params();
        accepted("the case itself", &dev, &b, &p);
        let (cq, ck) = c.cu_seqlens();
        let mask = dev.alloc_buffer(DType::F16, &[64 * 64]).unwrap();
        let blk = dev.alloc_buffer(DType::U8, &[64]).unwrap();
        refused(
            "a mask with cu_seqlens",
            &dev,
            &FlashAttnPrefillBuffers { mask: Some(&mask), blk: Some(&blk), ..b },
            &p,
            false,
            "an explicit mask cannot go with cu_seqlens",
        );
        for (what, bad) in [
            ("q batch stride", FlashAttnPrefillParams { q_strides: [5, p.q_strides[1], p.q_strides[2]], ..p }),
            ("k batch stride", FlashAttnPrefillParams { k_strides: [5, p.k_strides[1], p.k_strides[2]], ..p }),
            ("v batch stride", FlashAttnPrefillParams { v_strides: [5, p.v_strides[1], p.v_strides[2]], ..p }),
            ("out batch stride", FlashAttnPrefillParams { out_strides: [5, p.out_strides[1], p.out_strides[2]], ..p }),
            ("lse batch stride", FlashAttnPrefillParams { lse_strides: [5, p.lse_strides[1]], ..p }),
        ] {
            refused(what, &dev, &b, &bad, false, "the batch strides (of q, k, v, out, lse) must be 0");
        }
        let with_cu = |q: &[i32], k: &[i32]| (upload(&dev, DType::I32, q), upload(&dev, DType::I32, k));
        let total_q = *cq.last().unwrap();
        let total_k = *ck.last().unwrap();
        let cases: Vec<(&str, Vec<i32>, Vec<i32>, &str)> = vec![
            ("cu_seqlens_q short", cq[..3].to_vec(), ck.clone(), "cu_seqlens_q has 3 entries, a batch of 3 needs 4"),
            ("cu_seqlens_k short", cq.clone(), ck[..3].to_vec(), "cu_seqlens_k has 3 entries, a batch of 3 needs 4"),
            ("cu_seqlens_q from 1", vec![1, 20, 20, total_q], ck.clone(), "cu_seqlens_q[0] is 1, it must be 0"),
            ("cu_seqlens_k from 2", cq.clone(), vec![2, 30, 40, total_k], "cu_seqlens_k[0] is 2, it must be 0"),
            (
                "cu_seqlens_q decreasing",
                vec![0, 20, 19, total_q],
                ck.clone(),
                "cu_seqlens_q decreases at entry 2: 20 then 19",
            ),
            (
                "cu_seqlens_k decreasing",
                cq.clone(),
                vec![0, 30, 29, total_k],
                "cu_seqlens_k decreases at entry 2: 30 then 29",
            ),
            (
                "cu_seqlens_q short of the total",
                vec![0, 20, 20, total_q - 1],
                ck.clone(),
                "cu_seqlens_q ends at 36, not at the total of 37",
            ),
            (
                "cu_seqlens_k past the total",
                cq.clone(),
                vec![0, 30, 40, total_k + 1],
                "cu_seqlens_k ends at 81, not at the total of 80",
            ),
            (
                "a causal prompt longer than its cache",
                vec![0, 20, 31, total_q],
                ck.clone(),
                "sequence 1 has 11 query rows but 10 cache rows",
            ),
        ];
        for (what, q, k, needle) in cases {
            let (bq, bk) = with_cu(&q, &k);
            refused(
                what,
                &dev,
                &FlashAttnPrefillBuffers { cu_seqlens_q: Some(&bq), cu_seqlens_k: Some(&bk), ..b },
                &p,
                false,
                needle,
            );
        }
        let f32_cu = upload(&dev, DType::F32, &[0f32, 20.0, 20.0, 37.0]);
        refused(
            "cu_seqlens_q f32",
            &dev,
            &FlashAttnPrefillBuffers { cu_seqlens_q: Some(&f32_cu), ..b },
            &p,
            true,
            "cu_seqlens_q must be I32, got F32",
        );
        refused(
            "cu_seqlens_k f32",
            &dev,
            &FlashAttnPrefillBuffers { cu_seqlens_k: Some(&f32_cu), ..b },
            &p,
            true,
            "cu_seqlens_k must be I32, got F32",
        );
        // A prompt longer than its cache is fine with an explicit offset, or without causal.
        let (bq, bk) = with_cu(&[0, 20, 31, total_q], &ck);
        let longer = FlashAttnPrefillBuffers { cu_seqlens_q: Some(&bq), cu_seqlens_k: Some(&bk), ..b };
        accepted("offset", &dev, &longer, &FlashAttnPrefillParams { has_offset: 1, offset: 0, ..p });
        accepted("not causal", &dev, &longer, &FlashAttnPrefillParams { causal: 0, ..p });
        // The checks without buffers: lengths of another batch, and cu_seqlens values.
        let o = f32_lse_operands(false);
        let lens = sequence_lengths(&p, &cq, &ck).unwrap();
        assert_eq!(lens, vec![(20, 30), (0, 10), (17, 40)]);
        let v = validate_shapes(&p, &o, Some(&lens)).unwrap();
        assert_eq!((v.extents.q, v.extents.lse), (c.needs().q as u64, c.needs().lse as u64));
        let err = validate_shapes(&p, &o, Some(&lens[..2])).unwrap_err();
        check_error("two lengths", &err, false, "2 sequence lengths for a batch of 3");
        let err = sequence_lengths(&p, &cq[..3], &ck).unwrap_err();
        check_error("three cu_seqlens_q", &err, false, "cu_seqlens_q has 3 entries, a batch of 3 needs 4");
        // Buffers of a fixed-length prefill given to a variable-length one, and the reverse.
        let fixed_v = validate_shapes(&FlashAttnPrefillParams { batch: 1, ..p }, &o, None).unwrap();
        let err = validate_buffers(&b, &fixed_v).unwrap_err();
        check_error("cu_seqlens for a fixed length", &err, false, "this one is fixed length");
        for (what, bad) in [
            ("no cu_seqlens", FlashAttnPrefillBuffers { cu_seqlens_q: None, cu_seqlens_k: None, ..b }),
            ("no cu_seqlens_k", FlashAttnPrefillBuffers { cu_seqlens_k: None, ..b }),
            ("no cu_seqlens_q", FlashAttnPrefillBuffers { cu_seqlens_q: None, ..b }),
        ] {
            check_error(what, &validate_buffers(&bad, &v).unwrap_err(), false, "give cu_seqlens_q and cu_seqlens_k");
        }
        // The buffers' own check of cu_seqlens (a plan's run reads them on the device): batch + 1.
        let three = upload(&dev, DType::I32, &cq[..3]);
        for (what, bad) in [
            ("cu_seqlens_q", FlashAttnPrefillBuffers { cu_seqlens_q: Some(&three), ..b }),
            ("cu_seqlens_k", FlashAttnPrefillBuffers { cu_seqlens_k: Some(&three), ..b }),
        ] {
            let err = validate_buffers(&bad, &v).unwrap_err();
            check_error(what, &err, false, &format!("{what} holds 12 bytes, its shape and strides need 16"));
        }
        validate_buffers(&b, &v).unwrap();
    }

    #[test]
    fn a_plan_refuses_other_operands_and_runs_as_the_dispatch_does() {
        let dev = MlxDevice::cpu();
        let mut reg = default_registry();
        let c = fixed();
        let p = c.params();
        let o = f32_lse_operands(true);
        let plan = FlashAttnPrefillPlan::new(&dev, &p, &o, None).unwrap();
        assert_eq!(plan.params(), &p);
        assert_eq!(plan.operands(), &o);
        assert_eq!(plan.device().registry_id(), dev.registry_id());
        let n = c.needs();
        assert_eq!(
            (plan.extents().q, plan.extents().out, plan.extents().mask),
            (n.q as u64, n.out as u64, n.mask as u64)
        );
        // The dispatch's result, then the plan's on the same data: the same bits.
        let direct = c.buffers(&dev);
        accepted("dispatch", &dev, &direct.view(), &p);
        let planned: Buffers = c.buffers(&dev);
        let run = PrefillRunBuffers {
            q: &planned.q,
            k: &planned.k,
            v: &planned.v,
            out: &planned.out,
            mask: planned.mask.as_ref(),
            lse: planned.lse.as_ref(),
            sinks: None,
            alibi_slopes: None,
            workspace: None,
        };
        plan.run(&mut reg, &run, None).unwrap();
        assert_eq!(read_u8(&planned.out), read_u8(&direct.out), "the plan's output differs from the dispatch's");
        assert_eq!(read_u8(planned.lse.as_ref().unwrap()), read_u8(direct.lse.as_ref().unwrap()));
        let mut enc = dev.command_encoder();
        for (what, bad, needle) in [
            (
                "no mask",
                PrefillRunBuffers { mask: None, ..run },
                "this prefill has an explicit mask: give the mask and its tile table",
            ),
            ("no lse", PrefillRunBuffers { lse: None, ..run }, "this prefill returns lse: give its buffer"),
            ("q short", PrefillRunBuffers { q: &shorter(&dev, &planned.q), ..run }, "q holds"),
        ] {
            let err = plan.encode(&mut enc, &mut reg, &bad).expect_err(what);
            check_error(what, &err, false, needle);
            assert!(enc.pending().is_empty(), "{what}: something was encoded");
        }
        let bare = FlashAttnPrefillPlan::new(
            &dev,
            &FlashAttnPrefillParams { mask_strides: [0, 0], lse_strides: [0, 0], ..p },
            &PrefillOperands { mask: false, lse: false, ..o },
            None,
        )
        .unwrap();
        for (what, bad, needle) in [
            (
                "a mask",
                PrefillRunBuffers { lse: None, ..run },
                "this prefill has no explicit mask: give neither a mask nor a table",
            ),
            ("an lse", PrefillRunBuffers { mask: None, ..run }, "this prefill returns no lse"),
        ] {
            let err = bare.encode(&mut enc, &mut reg, &bad).expect_err(what);
            check_error(what, &err, false, needle);
        }
        // A plan's checks are the dispatch's: a bad shape, bad cu_seqlens.
        let err =
            FlashAttnPrefillPlan::new(&dev, &FlashAttnPrefillParams { head_dim: 64, ..p }, &o, None).err().unwrap();
        check_error("plan head_dim 64", &err, false, "unsupported head_dim 64");
        let vc = varlen();
        let (cq, ck) = vc.cu_seqlens();
        let vo = PrefillOperands { mask: false, ..o };
        let err = FlashAttnPrefillPlan::new(&dev, &vc.params(), &vo, Some((&cq[..3], &ck))).err().unwrap();
        check_error("plan cu_seqlens", &err, false, "cu_seqlens_q has 3 entries");
        // A variable-length plan runs as the dispatch does.
        let vplan = FlashAttnPrefillPlan::new(&dev, &vc.params(), &vo, Some((&cq, &ck))).unwrap();
        let (d, e) = (vc.buffers(&dev), vc.buffers(&dev));
        accepted("varlen dispatch", &dev, &d.view(), &vc.params());
        vplan
            .run(
                &mut reg,
                &PrefillRunBuffers {
                    q: &e.q,
                    k: &e.k,
                    v: &e.v,
                    out: &e.out,
                    mask: None,
                    lse: e.lse.as_ref(),
                    sinks: None,
                    alibi_slopes: None,
                    workspace: None,
                },
                None,
            )
            .unwrap();
        assert_eq!(read_u8(&e.out), read_u8(&d.out), "the variable-length plan's output differs");
        // wrap: a null address is refused (before any memory is used).
        // SAFETY: refused, nothing is wrapped.
        let err = unsafe { plan.wrap("q", 0, 16, DType::F32) }.unwrap_err();
        check_error("null", &err, false, "q is a null address");
    }

    #[test]
    fn the_mask_classifier_refuses_bad_buffers() {
        let dev = MlxDevice::cpu();
        let mut reg = default_registry();
        let c = fixed();
        let bufs = c.buffers(&dev);
        let p = c.params();
        let (mask, blk) = (bufs.mask.as_ref().unwrap(), bufs.blk.as_ref().unwrap());
        let go = |m: &MlxBuffer, t: &MlxBuffer, p: &FlashAttnPrefillParams| {
            let mut reg = default_registry();
            let mut enc = dev.command_encoder();
            let r = dispatch_flash_attn_prefill_mask_blk(&mut enc, &mut reg, &dev, m, t, p);
            if r.is_err() {
                assert!(enc.pending().is_empty(), "encoded though refused");
            }
            enc.commit_and_wait().unwrap();
            r
        };
        let big = 1u32 << 31;
        for (what, m, t, bad, needle) in [
            ("mask short", &shorter(&dev, mask), blk, p, "mask holds"),
            ("mask f32", &dev.alloc_buffer(DType::F32, &[mask.element_count()]).unwrap(), blk, p, "mask must be F16"),
            ("blk short", mask, &shorter(&dev, blk), p, "blk must be U8 with at least 8 bytes, got U8 7 bytes"),
            ("blk i32", mask, &dev.alloc_buffer(DType::I32, &[blk.element_count()]).unwrap(), p, "blk must be U8"),
            ("rows past i32", mask, blk, FlashAttnPrefillParams { rows: big, ..p }, "a dimension exceeds i32"),
            ("kv_len past i32", mask, blk, FlashAttnPrefillParams { kv_len: big, ..p }, "a dimension exceeds i32"),
            ("batch past i32", mask, blk, FlashAttnPrefillParams { batch: big, ..p }, "a dimension exceeds i32"),
            (
                "mask stride past i64",
                mask,
                blk,
                FlashAttnPrefillParams { mask_strides: [1 << 63, p.mask_strides[1]], ..p },
                "a mask stride exceeds i64",
            ),
            (
                "head_dim 100",
                mask,
                blk,
                FlashAttnPrefillParams { head_dim: 100, head_dim_v: 100, ..p },
                "unsupported head_dim 100",
            ),
            // The limits themselves pass those checks, and the mask's size refuses them.
            ("rows i32::MAX", mask, blk, FlashAttnPrefillParams { rows: i32::MAX as u32, ..p }, "mask holds"),
            ("kv_len i32::MAX", mask, blk, FlashAttnPrefillParams { kv_len: i32::MAX as u32, ..p }, "mask holds"),
            ("batch i32::MAX", mask, blk, FlashAttnPrefillParams { batch: i32::MAX as u32, ..p }, "mask holds"),
            (
                "mask stride i64::MAX",
                mask,
                blk,
                FlashAttnPrefillParams { mask_strides: [i64::MAX as u64, p.mask_strides[1]], ..p },
                "mask holds",
            ),
        ] {
            let err = go(m, t, &bad).expect_err(what);
            let dtype = matches!(err, MlxError::UnsupportedDtype(_));
            check_error(what, &err, dtype, needle);
        }
        let whole = dev.alloc_buffer(DType::U8, &[2 * (mask.data_byte_len() + blk.data_byte_len())]).unwrap();
        let m = whole.view(0, mask.data_byte_len(), DType::F16, vec![mask.element_count()]).unwrap();
        let t =
            whole.view(mask.data_byte_len() - 2, blk.data_byte_len(), DType::U8, vec![blk.element_count()]).unwrap();
        check_error("overlap", &go(&m, &t, &p).unwrap_err(), false, "blk overlaps the mask");
        let t = whole.view(mask.data_byte_len(), blk.data_byte_len(), DType::U8, vec![blk.element_count()]).unwrap();
        go(&m, &t, &p).unwrap();
        // A shared mask (batch stride 0): one table, of 2 x 2 tiles.
        let shared = FlashAttnPrefillParams { mask_strides: [0, p.mask_strides[1]], ..p };
        assert_eq!(mask_table_bytes(&shared).unwrap(), 4);
        let small = dev.alloc_buffer(DType::U8, &[4]).unwrap();
        go(mask, &small, &shared).unwrap();
        let mut enc = dev.command_encoder();
        dispatch_flash_attn_prefill_mask_blk(&mut enc, &mut reg, &dev, mask, blk, &p).unwrap();
        enc.commit_and_wait().unwrap();
        assert_eq!(read_u8(&small), read_u8(blk)[..4].to_vec(), "the shared table is the first sequence's");
    }
}

/// A backend that asks for a workspace: the CPU's, with `workspace_bytes` answering 1000,
/// so that the op's handling of a workspace (the plan's extents, a given buffer's size) is
/// tried on a machine without the GPU whose attention uses one.
mod workspace {
    use std::sync::Arc;

    use super::common::prefill::{f32_lse_operands, Prefill};
    use super::common::read_u8;
    use mlx_native::interface::{Backend, BackendKind, Dispatch, KernelSource, Memory, Pipeline};
    use mlx_native::ops::flash_attn_prefill::{dispatch_flash_attn_prefill, FlashAttnPrefillBuffers};
    use mlx_native::ops::flash_attn_prefill_plan::{FlashAttnPrefillPlan, PrefillRunBuffers};
    use mlx_native::{default_registry, DType, MlxDevice, MlxError, Result};

    const ASKED: u64 = 1000;

    struct AsksForWorkspace(Arc<dyn Backend>);

    impl Backend for AsksForWorkspace {
        fn kind(&self) -> BackendKind {
            self.0.kind()
        }
        fn description(&self) -> String {
            self.0.description()
        }
        fn alloc(&self, bytes: usize) -> Result<Arc<dyn Memory>> {
            self.0.alloc(bytes)
        }
        unsafe fn wrap_host(&self, ptr: *mut u8, bytes: usize) -> Result<Arc<dyn Memory>> {
            // SAFETY: the caller's promise, passed on.
            unsafe { self.0.wrap_host(ptr, bytes) }
        }
        fn compile(&self, name: &str, source: &KernelSource) -> Result<Pipeline> {
            self.0.compile(name, source)
        }
        fn execute(&self, dispatches: &[Dispatch]) -> Result<()> {
            self.0.execute(dispatches)
        }
        fn workspace_bytes(&self, kernel_name: &str, params: &[u8]) -> u64 {
            assert!(kernel_name.starts_with("flash_attn_prefill_d"), "{kernel_name}");
            assert!(!params.is_empty());
            ASKED
        }
    }

    #[test]
    fn a_workspace_smaller_than_the_backend_asks_is_refused_and_the_plan_reports_its_size() {
        let dev = MlxDevice::from_backend(Arc::new(AsksForWorkspace(MlxDevice::cpu().backend().clone())));
        let mut reg = default_registry();
        let mut c = Prefill::fixed(301, 1, 20, 60, 4, 2, 128, 1).with_lse();
        c.causal = true;
        let p = c.params();
        let bufs = c.buffers(&dev);
        let b = bufs.view();
        let ws = |n: usize| dev.alloc_buffer(DType::U8, &[n]).unwrap();
        let run = |b: &FlashAttnPrefillBuffers<'_>| {
            let mut enc = dev.command_encoder();
            let r = dispatch_flash_attn_prefill(&mut enc, &mut default_registry(), &dev, b, &p);
            if r.is_ok() {
                enc.commit_and_wait().unwrap();
            } else {
                assert!(enc.pending().is_empty(), "nothing is encoded on a refusal");
            }
            r
        };
        // Without one, or with enough, it runs (the CPU kernels do not read it), alike.
        run(&b).unwrap();
        let plain = read_u8(b.out);
        let enough = ws(ASKED as usize);
        run(&FlashAttnPrefillBuffers { workspace: Some(&enough), ..b }).unwrap();
        assert_eq!(read_u8(b.out), plain);
        // One byte short, or far short: a typed error that names both sizes.
        for n in [ASKED as usize - 1, 64] {
            let small = ws(n);
            let before = read_u8(b.out);
            match run(&FlashAttnPrefillBuffers { workspace: Some(&small), ..b }) {
                Err(MlxError::InvalidArgument(m)) => {
                    assert!(m.contains(&format!("the workspace holds {n} bytes; this prefill needs {ASKED}")), "{m}")
                }
                other => panic!("a workspace of {n} bytes: {other:?}"),
            }
            assert_eq!(read_u8(b.out), before, "out was written");
        }
        // The plan reports what the backend asks, and checks each run's workspace.
        let o = f32_lse_operands(false);
        let plan = FlashAttnPrefillPlan::new(&dev, &p, &o, None).unwrap();
        assert_eq!(plan.workspace_bytes(), ASKED);
        let rb = PrefillRunBuffers {
            q: b.q,
            k: b.k,
            v: b.v,
            out: b.out,
            mask: None,
            lse: b.lse,
            sinks: None,
            alibi_slopes: None,
            workspace: Some(&enough),
        };
        plan.run(&mut reg, &rb, None).unwrap();
        assert_eq!(read_u8(b.out), plain);
        let small = ws(10);
        let err = plan.run(&mut reg, &PrefillRunBuffers { workspace: Some(&small), ..rb }, None).unwrap_err();
        assert!(err.to_string().contains("this prefill needs 1000"), "{err}");
        // The CPU itself asks for none.
        assert_eq!(FlashAttnPrefillPlan::new(&MlxDevice::cpu(), &p, &o, None).unwrap().workspace_bytes(), 0);
    }
}
