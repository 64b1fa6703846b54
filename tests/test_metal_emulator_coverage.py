"""Issue 27's four kernel coverage gaps in the Metal kernels, run by the CPU emulator
(tests/metal_emu) and dispatched as the ops encode them (the harnesses of
test_metal_emulator_prefill.py and test_metal_emulator.py); the same classes on the other
backends are test_kernel_coverage.py's, whose references and cases these reuse:

1. ALiBi at 6 and 12 heads (two and four heads past n2), explicit and described masks,
   GQA and not, against the float64 reference with SPEC 10's slopes written out;
2. every entry point the emulator registers from `shaders/*.metal` (it lists them itself)
   dispatched against the float64 reference (a paged one, SPEC 11, also bit for bit against
   its contiguous twin), and a test that the parameters are that list:
   before, 6 of the 18 prefill kernels (d80, d112, d192 with F16 K/V; d96, d256, d576/512
   with BF16 K/V) ran in no test;
3. a NaN of full payload in an explicit mask at a visible pair stays NaN in its row's F16
   and BF16 output (the kernel rounds to BF16 by hand: bfloat_bits);
4. BF16 Q beyond F16's range (|q| ~ 2^17, scale 2^-17; |q| ~ 2^-20, scale 2^17).

scripts/mutate_kernels.py runs this file in its Metal family: the bugs planted for these
classes (metal-alibi-past-n2, metal-entry-*, metal-o-bf16-nan, metal-q-bf16-via-half) must
fail here."""

from __future__ import annotations

import re

import numpy as np
import pytest

import kernel_registry
import metal_emu
from mlx_native.reference import nmse, peer_mask, reference_attention, reference_prefill

from helpers import KERNEL_DIMS, make_case
from planted_cases import crafted_blk_mask, spec_blk
from test_kernel_coverage import FULL_NANS, _bf16_q_case, alibi_case, slope_reference, spec_slopes
from test_metal_emulator import emu_attention, emu_blk
from test_metal_emulator_paged import paginate, same_as_contiguous
from test_metal_emulator_quant import fp8_twins, q8_twins, same_run
from test_metal_emulator_prefill import (
    BF16,
    BQ,
    EXPECTED,
    F16,
    F32,
    Prefill,
    check,
    emu_mask_blk,
    emu_prefill,
    fixed_case,
    kernel_name,
    spec_tables,
    varlen_case,
)

DIMS = KERNEL_DIMS


def _emu_call(emu, **extra):
    """flash_attn_prefill's keyword call on [rows, H, D] arrays, run by the emulator as one
    sequence: (out, lse) of that sequence."""

    def call(q, k, v, mask=None, *, causal=False, window=0, scale=1.0, return_lse=True, max_bias=0.0, out_dtype=F32):
        c = Prefill(q[None], k[None], v[None], None if mask is None else mask[None], causal=causal, window=window or 0,
                    scale=scale, max_bias=max_bias, o_dtype=np.dtype(out_dtype), **extra)  # fmt: skip
        out, lse, _ = emu_prefill(emu, c)
        return out[0], lse[0]

    return call


# ---------------------------------------------------------------- 1. ALiBi past n2

ALIBI = [(nh, nkv, m) for nh in (6, 12) for nkv in (nh, nh // 3) for m in ("explicit", "described")]


@pytest.mark.parametrize("nh,nkv,mask", ALIBI, ids=[f"h{a}/{b}-{m}" for a, b, m in ALIBI])
def test_alibi_with_heads_past_the_largest_power_of_two(emu, rng, nh, nkv, mask):
    kv_dtype = F16 if nkv == nh else BF16
    max_bias, scale = 8.0, 0.5
    q, k, v, kw, bias, seen = alibi_case(rng, nh, nkv, 64, kv_dtype, mask)
    slopes = spec_slopes(nh, max_bias)
    ref, ref_lse = slope_reference(q, k, v, bias, seen, slopes, scale)
    out, lse = _emu_call(emu)(q, k, v, kw.pop("mask", None), max_bias=max_bias, scale=scale, **kw)
    assert np.isfinite(out).all()
    assert nmse(out, ref) < EXPECTED[F32]
    for h in range(nh):  # a slip in the heads past n2 alone must fail
        assert nmse(out[:, h], ref[:, h]) < 1e-4, f"head {h}"
    seen_rows = np.isfinite(ref_lse)
    assert np.array_equal(np.isneginf(lse), ~seen_rows)
    assert np.abs(lse[seen_rows] - ref_lse[seen_rows]).max() < 2e-3
    near, _ = slope_reference(q, k, v, bias, seen, spec_slopes(nh, max_bias, lambda h, n2: h - n2 + 1), scale)
    assert nmse(near, ref) > 100 * EXPECTED[F32], "the case cannot tell the slopes apart"


# ---------------------------------------------------------------- 2. every entry point


def _prefill_entry(emu, rng, dk, dv, kv_dtype):
    # GQA 2, a longer cache (offset), partial query tiles and last step, an explicit mask
    # with all three tile classes and the description; then variable length with the score
    # transforms and lse (every path of the shared body, from this entry point).
    c = fixed_case(rng, batch=2, rows=37, kv=150, nh=4, nkv=2, hd=dk, hdv=dv, kv_dtype=kv_dtype, mask="per-batch",
                   causal=True, scale=0.5)  # fmt: skip
    out, lse, blk = emu_prefill(emu, c)
    assert {0, 1, 2} <= set(np.unique(blk).tolist())
    check(c, out, lse)
    c = varlen_case(rng, lq=[9, 0, 20], lk=[40, 5, 70], nh=3, nkv=1, hd=dk, hdv=dv, kv_dtype=kv_dtype, causal=True,
                    window=25, scale=0.4, softcap=3.0, max_bias=4.0, sinks=rng.uniform(-2, 2, 3).astype(np.float32))  # fmt: skip
    out, lse, _ = emu_prefill(emu, c)
    check(c, out, lse)


def _paged_entry(emu, rng, dk, dv, kv_dtype, bs):
    # Paged K/V (SPEC 11) through the head dim's paged entry point: variable length, GQA 2,
    # causal with a window, sinks and lse; bit for bit the contiguous entry point's result.
    c = varlen_case(rng, lq=[9, 20], lk=[40, 70], nh=4, nkv=2, hd=dk, hdv=dv, kv_dtype=kv_dtype, causal=True,
                    window=50, scale=0.5, sinks=rng.uniform(-2, 2, 4).astype(np.float32))  # fmt: skip
    out, lse, _ = same_as_contiguous(emu, c, paginate(rng, c, bs))
    check(c, out, lse, cpu=False)


def _kvq_entry(emu, rng, dk, dv, fmt, bs):
    # Quantised K/V (SPEC 11) through the head dim's _kvq entry point (paged where ``bs``):
    # variable length, GQA 2, causal with a window and lse; bit for bit the F16 entry point's
    # result on the same values (test_metal_emulator_quant.py holds the rest).
    c = varlen_case(rng, lq=[9, 20], lk=[40, 70], nh=4, nkv=2, hd=dk, hdv=dv, causal=True, window=50, scale=0.5)
    cq = q8_twins(c) if fmt == "q8_0" else fp8_twins(c, fmt)
    out, lse = same_run(emu, c, cq, paginate(rng, cq, bs) if bs else None)
    check(c, out, lse, cpu=False)


def _origin_entry(emu, rng, hd):
    c = make_case(rng, 45, 4, 2, hd, 130, scale=0.7, mask="peer")
    out, blk = emu_attention(emu, c)
    assert {0, 1, 2} <= set(np.unique(blk).tolist())
    assert nmse(out, reference_attention(c.q, c.k, c.v, c.mask, scale=c.scale)) < EXPECTED[F32]


def _blk_entry(emu, rng):
    for bq, bk in ((32, 64), (16, 64)):
        mask, want, rows = crafted_blk_mask(rng, bq, bk)
        assert np.array_equal(emu_blk(emu, mask, rows, bq, bk), want)
        assert np.array_equal(want, spec_blk(mask, rows, bq, bk))


def _mask_blk_entry(emu, rng):
    m = np.stack([peer_mask(45, 130, rng) for _ in range(2)])
    m[:, :32, 128:] = 0  # a tile of zeros cut by the cache's end: 1
    for bq in (32, 16):
        assert np.array_equal(emu_mask_blk(emu, m, bq), spec_tables(m, bq))


def _entries():
    cases = {}
    for dk, dv in DIMS:
        for kvd in (F16, BF16):
            cases[kernel_name(dk, dv, kvd)] = lambda emu, rng, dk=dk, dv=dv, kvd=kvd: _prefill_entry(emu, rng, dk, dv, kvd)
            bs = (16, 48, 256)[len(cases) % 3]  # blocks of a quarter step, of a step and a half, of four steps
            cases[kernel_name(dk, dv, kvd, paged=True)] = (
                lambda emu, rng, dk=dk, dv=dv, kvd=kvd, bs=bs: _paged_entry(emu, rng, dk, dv, kvd, bs)
            )
    for i, (dk, dv) in enumerate(DIMS):
        # The formats in turn (Q8_0 at head dims of its 32-value blocks).
        fmt = ("float8_e4m3fn", "float8_e5m2", "q8_0")[i % 3]
        fmt = "float8_e4m3fn" if fmt == "q8_0" and (dk % 32 or dv % 32) else fmt
        for bs in (None, (16, 48, 256)[i % 3]):
            cases[kernel_name(dk, dv, None, paged=bs is not None, kv_format=fmt)] = (
                lambda emu, rng, dk=dk, dv=dv, fmt=fmt, bs=bs: _kvq_entry(emu, rng, dk, dv, fmt, bs)
            )
    for hd in (256, 512):
        cases[f"flash_attn_prefill_tensor_f16_d{hd}"] = lambda emu, rng, hd=hd: _origin_entry(emu, rng, hd)
    cases["flash_attn_prefill_blk"] = _blk_entry
    cases["flash_attn_prefill_mask_blk"] = _mask_blk_entry
    return cases


ENTRIES = _entries()


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_every_entry_point(emu, rng, entry):
    ENTRIES[entry](emu, rng)


def test_the_entry_point_cases_are_every_entry_the_emulator_registers(emu):
    # The emulator names its entry points when asked for one it lacks: those of the built
    # .metal sources. A kernel added there without a case above fails here.
    with pytest.raises(metal_emu.EmulatorError) as e:
        emu.dispatch("no_such_kernel", (1, 1, 1), (1, 1, 1), buffers={})
    registered = set(re.search(r"this build has:(.*)\)", str(e.value)).group(1).split())
    assert registered == set(ENTRIES), registered ^ set(ENTRIES)
    assert registered == kernel_registry.metal_entries()


# ---------------------------------------------------------------- 3. NaN through F16 / BF16 out


@pytest.mark.parametrize("out_dtype", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("hd", [80, 256])
def test_a_full_payload_nan_in_the_mask_stays_nan_in_every_output_dtype(emu, rng, hd, out_dtype):
    c = fixed_case(rng, batch=1, rows=40, kv=100, nh=2, nkv=1, hd=hd, mask="per-batch", causal=True, scale=0.5,
                   o_dtype=out_dtype)  # fmt: skip
    off = 100 - 40
    rows = (3, 33)  # one per query tile
    for r, bits in zip(rows, FULL_NANS):
        c.mask[0, r, r + off - 7] = np.frombuffer(np.uint16(bits).tobytes(), np.float16)[0]  # a visible pair
    out, _, _ = emu_prefill(emu, c)
    o = out[0].astype(np.float32)
    for r in rows:
        assert np.isnan(o[r]).all(), f"row {r}: {o[r][np.isfinite(o[r])][:4]} not NaN"
    clean = c.mask.copy()
    clean[0, list(rows)] = 0
    ref, _ = reference_prefill(c.q, c.k, c.v, clean, causal=True, scale=0.5)
    others = np.setdiff1d(np.arange(40), rows)
    want = ref[0, others] if out_dtype == F32 else ref[0, others].astype(out_dtype).astype(np.float64)
    assert np.isfinite(o[others]).all()
    assert nmse(o[others], want) < {F32: 1e-5, F16: 1.5e-6, BF16: 6.5e-5}[np.dtype(out_dtype)]


# ---------------------------------------------------------------- 4. BF16 Q beyond F16's range


@pytest.mark.parametrize("magnitude,scale", [(2.0**17, 2.0**-17), (2.0**-20, 2.0**17)], ids=["big", "tiny"])
@pytest.mark.parametrize("hd,kv_dtype", [(64, F16), (128, BF16), (256, F16)], ids=str)
def test_bf16_q_outside_f16s_range(emu, rng, magnitude, scale, hd, kv_dtype):
    out, lse, ref, ref_lse, near = _bf16_q_case(rng, magnitude, scale, hd, kv_dtype, _emu_call(emu))
    assert np.isfinite(out).all()
    assert nmse(out, ref) < EXPECTED[F32]
    seen = np.isfinite(ref_lse)
    assert np.abs(lse[seen] - ref_lse[seen]).max() < 2e-3
    # (Non-finite rows are as far as it gets: the reference keeps a NaN row NaN, and the
    # output is held to be finite above.)
    assert not np.isfinite(near).all() or nmse(near, ref) > 30 * EXPECTED[F32], "the case cannot tell Q widened through half"
