"""Quantised K/V (SPEC 11) in the Metal kernels, run by the CPU emulator (tests/metal_emu) and
dispatched as rust/src/ops/flash_attn_prefill.rs encodes a quantised plan on Metal: the
``flash_attn_prefill[_paged]_d*_kvq`` entry points with K and V as bytes (FP8 E4M3 / E5M2 or
ggml's Q8_0 blocks, the params block's kv_dtype; strides in bytes), FP8's descale factors at
16 with PREFILL_DESCALE, and the op's quant_threadgroup_memory_bytes
(test_metal_emulator_prefill.emu_prefill with ``kv_format``).

- Every FP8 value is a half, so the _kvq kernel on FP8 bytes is the F16 kernel on the same
  values, to the bit (out and lse): contiguous and paged, at head dims of both K sub-tile
  heights (16 rows; 8 at 512 and 576/512, whose sub-tiles reach past the scores' memory),
  and with bytes that cover every finite FP8 value.
- Q8_0: the F16 kernel on float(d) * q rounded once to half, to the bit.
- Descale factors per KV head: against the float64 reference on descale * value; factors of
  1 change no bit.
- The threads' order and the cooperative layout change no bit (the sub-tiles' hand-overs of
  threadgroup memory are fenced).

Bytes outside the views are 0x7f, a NaN in both FP8 formats and in a Q8_0 block's scale, so a
kernel that read one would turn the output non-finite."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from mlx_native.reference import dequantise, quantise_q8_0

from test_metal_emulator_paged import paginate
from test_metal_emulator_prefill import check, emu_prefill, fixed_case, same_bits, varlen_case

FP8 = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}


def _byte_view(x8: np.ndarray) -> np.ndarray:
    """Bytes ``[..., kv, Hkv, B]`` as a view into a 0x7f buffer with a spare head and bytes
    around each row (so the row and head strides are not the view's widths)."""
    base = np.full((*x8.shape[:-1][:-1], x8.shape[-2] + 1, x8.shape[-1] + 5), 0x7F, np.uint8)
    view = base[..., 1:, 3 : 3 + x8.shape[-1]]
    view[...] = x8
    return view


def fp8_twins(c, fmt, k8=None, v8=None):
    """``c`` (an F16 case) with its K/V values rounded to ``fmt`` (in place, so ``c`` is the
    F16 run of the same values), and the quantised case of those bytes. ``k8`` / ``v8``:
    given FP8 values instead."""
    f8 = FP8[fmt]
    k8 = np.asarray(c.k, np.float32).astype(f8) if k8 is None else k8
    v8 = np.asarray(c.v, np.float32).astype(f8) if v8 is None else v8
    c.k[...] = k8.astype(np.float32).astype(np.float16)
    c.v[...] = v8.astype(np.float32).astype(np.float16)
    return c.with_(k=_byte_view(k8.view(np.uint8)), v=_byte_view(v8.view(np.uint8)), kv_format=fmt)


def q8_twins(c):
    """``c`` with its K/V values Q8_0's (float(d) * q rounded once to half, in place) and the
    quantised case of the blocks."""
    kq = quantise_q8_0(np.asarray(c.k, np.float32))
    vq = quantise_q8_0(np.asarray(c.v, np.float32))
    c.k[...] = dequantise(kq, "q8_0").astype(np.float16)
    c.v[...] = dequantise(vq, "q8_0").astype(np.float16)
    return c.with_(k=_byte_view(kq), v=_byte_view(vq), kv_format="q8_0")


def same_run(emu, c16, cq, pages=None, **kw):
    """The quantised run (paged where ``pages`` holds cq's rows) is the F16 run of ``c16``,
    to the bit; returns it."""
    out, lse, blk = emu_prefill(emu, c16, **kw)
    q_out, q_lse, _ = emu_prefill(emu, cq, blk=blk, pages=pages, **kw)
    assert np.isfinite(q_out).all()
    assert same_bits(q_out, out), f"{cq.kv_format}: out is not the F16 kernel's on the same values"
    if c16.lse:
        assert same_bits(q_lse, lse), f"{cq.kv_format}: lse is not the F16 kernel's"
    return q_out, q_lse


def _descaled(c16, kd=None, vd=None):
    """c16 with its K/V values times the descale factors per KV head (float64), the case
    whose reference a descaled quantised run must match (check, without the CPU backend)."""
    def scaled(x, d):
        x = np.asarray(x, np.float64)
        return x if d is None else x * np.asarray(d, np.float64)[:, None]

    return c16.with_(k=scaled(c16.k, kd), v=scaled(c16.v, vd))


# (head dim, layout): each threadgroup shape and sub-tile height, fixed and variable length,
# an explicit mask, paged block sizes inside and across steps.
SHAPES = {
    "d64-fixed-mask": (64, None),
    "d128-varlen-paged16": (128, 16),
    "d256-fixed-paged48": (256, 48),
    "d512-varlen-paged256": (512, 256),
    "d576_512-varlen": (576, None),
}


def _case(rng, name):
    hd, _ = SHAPES[name]
    hdv = 512 if hd == 576 else hd
    if "fixed" in name:
        mask = "per-batch" if "mask" in name else None
        return fixed_case(rng, batch=2, rows=37, kv=150, nh=4, nkv=2, hd=hd, hdv=hdv, mask=mask, causal=True, scale=0.3)
    return varlen_case(rng, lq=[9, 0, 20], lk=[40, 5, 150], nh=4, nkv=2, hd=hd, hdv=hdv, causal=True, scale=0.3)


@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fp8_is_the_f16_kernel_on_the_same_values(emu, rng, fmt, shape):
    c16 = _case(rng, shape)
    cq = fp8_twins(c16, fmt)
    bs = SHAPES[shape][1]
    pages = paginate(rng, cq, bs) if bs else None
    out, lse = same_run(emu, c16, cq, pages)
    check(c16, out, lse, cpu=False)


def _finite_bytes(fmt):
    b = np.arange(256, dtype=np.uint8)
    return b[np.isfinite(b.view(FP8[fmt]).astype(np.float32))]


@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("paged", [False, True], ids=["contig", "paged"])
def test_every_finite_fp8_byte_is_its_half(emu, rng, fmt, paged):
    # K and V each a shuffled tiling of every finite byte of the format (subnormals, the
    # largest values, both zeros); Q scaled down so that the scores stay finite.
    c16 = varlen_case(rng, lq=[7, 12], lk=[70, 60], nh=2, nkv=2, hd=64, causal=False,
                      scale=1.0 / (512 if fmt == "float8_e4m3fn" else 65536))  # fmt: skip
    fin = _finite_bytes(fmt)
    draw = lambda x: rng.permutation(np.resize(fin, x.size)).reshape(x.shape).view(FP8[fmt])  # noqa: E731
    k8, v8 = draw(c16.k), draw(c16.v)
    assert set(np.unique(k8.view(np.uint8)).tolist()) == set(fin.tolist())
    cq = fp8_twins(c16, fmt, k8, v8)
    same_run(emu, c16, cq, paginate(rng, cq, 32) if paged else None)


@pytest.mark.parametrize("shape", ["d64-fixed-mask", "d128-varlen-paged16", "d512-varlen-paged256", "d576_512-varlen"])
def test_q8_0_is_the_f16_kernel_on_its_rounded_values(emu, rng, shape):
    c16 = _case(rng, shape)
    cq = q8_twins(c16)
    bs = SHAPES[shape][1]
    out, lse = same_run(emu, c16, cq, paginate(rng, cq, bs) if bs else None)
    check(c16, out, lse, cpu=False)


@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("paged", [False, True], ids=["contig", "paged"])
def test_descale_factors_per_kv_head(emu, rng, fmt, paged):
    # GQA 4 heads on 2, factors of their own per KV head for K and for V.
    c16 = fixed_case(rng, batch=2, rows=37, kv=150, nh=4, nkv=2, hd=128, causal=True, window=90, scale=0.3)
    cq = fp8_twins(c16, fmt)
    pages = paginate(rng, cq, 64) if paged else None
    kd, vd = rng.uniform(0.2, 3.0, 2).astype(np.float32), rng.uniform(0.2, 3.0, 2).astype(np.float32)
    out, lse, _ = emu_prefill(emu, cq.with_(descale=np.stack([kd, vd])), pages=pages)
    check(_descaled(c16, kd, vd), out, lse, cpu=False)
    # Factors of 1 are no factors, to the bit.
    ones, ones_lse, _ = emu_prefill(emu, cq.with_(descale=np.ones((2, 2), np.float32)), pages=pages)
    plain, plain_lse, _ = emu_prefill(emu, cq, pages=pages)
    assert same_bits(ones, plain) and same_bits(ones_lse, plain_lse)


@pytest.mark.parametrize("hd", [128, 576])
def test_schedules_and_layouts_change_no_bit(emu, rng, hd):
    hdv = 512 if hd == 576 else hd
    c16 = varlen_case(rng, lq=[5, 18], lk=[70, 18], nh=2, nkv=1, hd=hd, hdv=hdv, causal=True, window=9)
    cq = fp8_twins(c16, "float8_e4m3fn")
    pages = paginate(rng, cq, 16)
    base, base_lse, _ = emu_prefill(emu, cq, pages=pages)
    for kw in (dict(schedule="reverse"), dict(schedule="random:3", layout_seed=5)):
        out, lse, _ = emu_prefill(emu, cq, pages=pages, **kw)
        assert same_bits(out, base) and same_bits(lse, base_lse), kw
