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
