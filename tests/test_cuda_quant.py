"""Quantised K/V (SPEC 11) on CUDA: FP8 E4M3 / E5M2 (with ``k_descale`` / ``v_descale``) and
ggml's Q8_0, contiguous and paged, in the one-CTA forms (the Hopper form's plain entry on
sm_90a, and the portable mma.sync form, ``cuda_form="portable"``): each kernel's quant
module (``_kvq``, ``_paged_kvq``; ``_xf_*`` with the score transforms in the portable form),
whose loaders widen the bytes to F16 in shared memory (docs/spec.md 11b).

- Against the float64 reference on the exactly dequantised values (``reference.dequantise``):
  every format x contiguous / paged x head dims x GQA x causal / explicit mask / window x
  descale given or not, both forms; paged results bit-identical to the contiguous quantised
  call on the same form (SPEC 11).
- FP8 with descale 1 is the F16 K/V result of the same (exactly representable) values to the
  bit, both forms, contiguous and paged, and every finite FP8 byte widens to its half
  (``test_every_fp8_byte_is_its_half``); the integer widening that sm_80 runs is checked on
  this GPU too (``MLXN_FP8_CVT_INT`` in a process of its own).
- Split walks; the score transforms; every quant entry point of the form the GPU runs is
  launched (the launch trace). The CTA-pair forms on FP8 K/V (which plans take them, their
  results) are test_cuda_quant_pairs.py's.

Shapes are small. Without a CUDA device every test is skipped (the CPU suite,
``test_quant_kv.py``, holds the same formats on the CPU backend)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import mlx_native as mn
from mlx_native.reference import gather_pages, nmse, reference_paged, reference_prefill

import kernel_registry
from helpers import KERNEL_DIMS
from test_quant_kv import FP8, kw_of, make_pages, quantise, values

HAS_CUDA = "cuda" in mn.backends()
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
LSE_TOL = 2e-3  # SPEC 8
#: Each form a quantised plan runs: the library's choice (the Hopper form on sm_90a) and the
#: portable one on any GPU.
FORMS = ["auto", "portable"]
#: Against the float64 reference on the dequantised values: the F16 K/V bar on CUDA (FP8
#: values are halves exactly; Q8_0's are rounded once to F16, far below it). SPEC 11's bar is
#: 5e-4.
BAR = 1e-5
FORMATS = ["float8_e4m3fn", "float8_e5m2", "q8_0"]
#: Head dims of the forms: the Hopper form's (64, 128, 256, 512), portable ones (80, 96), MLA.
DIMS = [(64, 64), (80, 80), (96, 96), (128, 128), (256, 256), (512, 512), (576, 512)]


def _bits(a, b):
    for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), f"max diff {np.abs(x.astype(float) - y).max()}"


def _cuda(q, k, v, mask=None, form="auto", splits=0, pairs="off", **kw):
    """One call on CUDA through a plan of host arrays, in the given form, the walk split as
    asked (0: never); returns the run's result and the plan."""
    plan = mn.PrefillPlan(q, k, v, mask, device="cuda", cuda_form=form, kv_splits=splits, cta_pairs=pairs, **kw)
    return plan.run(), plan


def _descales(rng, given, nkv):
    if not given:
        return None, None
    return rng.uniform(0.3, 2.5, nkv).astype(np.float32), float(rng.uniform(0.3, 2.5))


def _cases():
    """(format, paged, dims, mask kind, descale given) with Q8_0 at head dims multiples of 32
    only and without descale (its blocks carry their scales)."""
    out = []
    for fmt in FORMATS:
        for dims in DIMS:
            if fmt == "q8_0" and (dims[0] % 32 or dims[1] % 32):
                continue
            for paged in (False, True):
                for masking in ("causal", "mask", "window"):
                    for desc in (False, True) if fmt != "q8_0" else (False,):
                        out.append((fmt, paged, dims, masking, desc))
    return out


def _id(c):
    fmt, paged, (dk, dv), masking, desc = c
    return f"{fmt}-{'paged' if paged else 'contig'}-d{dk}_{dv}-{masking}-{'descale' if desc else 'plain'}"


@needs_gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", _cases(), ids=_id)
def test_quantised_kv_on_cuda_against_the_reference(rng, form, case):
    """GQA 3 (6 heads on 2 KV heads), varlen queries with a partial last tile and an empty
    sequence (paged: shuffled blocks of 48 rows, NaN bytes in unused blocks and past each
    cache's end), lse; the described mask (causal, a two-sided window) or, at fixed length, an
    explicit one with a fully masked row. Paged: the contiguous quantised call's bits."""
    fmt, paged, (dk, dv), masking, desc = case
    nh, nkv = 6, 2
    kd, vd = _descales(rng, desc, nkv)
    kw = dict(return_lse=True, form=form, scale=1 / np.sqrt(dk), **kw_of(fmt, kd, vd))
    if masking == "mask":
        # Fixed length: 2 sequences of 21 rows against caches of 70 and 45 (paged) or 70.
        lq, lk = 21, [70, 45] if paged else [70, 70]
        q = rng.uniform(-1, 1, (2, lq, nh, dk)).astype(np.float32)
        mask = rng.uniform(-2, 1, (2, lq, max(lk))).astype(np.float16)
        mask[:, 4] = -np.inf  # a fully masked row: zeros, lse -inf
        mask[:, :, :3] = -np.inf
        rkw = dict(mask=mask)
    else:
        lq, lk = [20, 0, 33], [90, 10, 33]
        cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
        q = rng.uniform(-1, 1, (int(cq[-1]), nh, dk)).astype(np.float32)
        kw["cu_seqlens_q"] = cq
        rkw = dict(causal=True) if masking == "causal" else dict(window=(25, 4))
        mask = None
        kw.update(rkw)
    k, v, table, used = make_pages(rng, lk, 48, nkv, dk, fmt) if dk == dv else _mla_pages(rng, lk, 48, nkv, fmt)
    described = {x: y for x, y in rkw.items() if x != "mask"}
    if paged:
        (out, lse), plan = _cuda(q, k, v, mask, block_table=table, seqused_k=used, **kw)
        ref, ref_lse = reference_paged(q, values(k, fmt, kd), values(v, fmt, vd), mask, block_table=table,
                                       seqused_k=used, cu_seqlens_q=kw.get("cu_seqlens_q"), scale=kw["scale"],
                                       **described)  # fmt: skip
        # SPEC 11: the contiguous layout's result on the same device and form, to the bit.
        if masking == "mask":
            for b, n in enumerate(lk):
                kb, vb = gather_pages(k, table, used, b), gather_pages(v, table, used, b)
                one, _ = _cuda(q[b], kb, vb, np.ascontiguousarray(mask[b, :, :n]), **kw)
                _bits((out[b], lse[b]), one)
        else:
            kc = np.concatenate([gather_pages(k, table, used, b) for b in range(len(lk))])
            vc = np.concatenate([gather_pages(v, table, used, b) for b in range(len(lk))])
            ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
            _bits((out, lse), _cuda(q, kc, vc, cu_seqlens_k=ck, **kw)[0])
    elif masking == "mask":
        kc = np.stack([gather_pages(k, table, used, b) for b in range(2)])
        vc = np.stack([gather_pages(v, table, used, b) for b in range(2)])
        (out, lse), plan = _cuda(q, kc, vc, mask, **kw)
        ref, ref_lse = reference_prefill(q, values(kc, fmt, kd), values(vc, fmt, vd), mask, scale=kw["scale"])
    else:
        kc = np.concatenate([gather_pages(k, table, used, b) for b in range(len(lk))])
        vc = np.concatenate([gather_pages(v, table, used, b) for b in range(len(lk))])
        ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
        (out, lse), plan = _cuda(q, kc, vc, cu_seqlens_k=ck, **kw)
        ref, ref_lse = reference_prefill(q, values(kc, fmt, kd), values(vc, fmt, vd), cu_seqlens_q=kw["cu_seqlens_q"],
                                         cu_seqlens_k=ck, scale=kw["scale"], **described)  # fmt: skip
    assert plan.choices["pairs"] == "off", plan.choices
    seen = np.isfinite(ref_lse)
    assert np.isfinite(out).all()
    e = nmse(out, ref)
    assert e < BAR, f"NMSE {e:.3e}"
    assert np.array_equal(np.isfinite(lse), seen)
    assert np.abs(lse[seen] - ref_lse[seen]).max() < LSE_TOL


def _mla_pages(rng, lk, bs, nkv, fmt):
    """Head dims (576, 512): K pages of 576 values, V pages of 512 (separate caches), laid out
    by the same table."""
    k, _, table, used = make_pages(rng, lk, bs, nkv, 576, fmt)
    v = _resized_pages(rng, k, table, used, bs, nkv, 512, fmt)
    return k, v, table, used


def _resized_pages(rng, like, table, used, bs, nkv, d, fmt):
    width = d // 32 * 34 if fmt == "q8_0" else d
    v = np.full(like.shape[:-1] + (width,), 0x7F, np.uint8)
    for b, n in enumerate(used):
        j = np.arange(n)
        v[table[b, j // bs], j % bs] = quantise(rng, (int(n), nkv, d), fmt).view(np.uint8).reshape(int(n), nkv, width)
    return v if fmt == "q8_0" else v.view(FP8[fmt])


@needs_gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("dims", [(64, 64), (80, 80), (128, 128), (256, 256), (512, 512), (576, 512)],
                         ids=lambda d: f"d{d[0]}_{d[1]}")  # fmt: skip
@pytest.mark.parametrize("paged", [False, True], ids=["contig", "paged"])
def test_fp8_with_descale_one_is_the_f16_result_to_the_bit(rng, form, fmt, dims, paged):
    """FP8 values are halves exactly and the quant module's loaders store those halves where
    the F16 loaders do; K's factor multiplies the scores and V's the output, by 1 here: the
    F16 K/V call on the same values (the one-CTA form: no pairs) gives the same bits, out and
    lse, with descale 1 given or not."""
    dk, dv = dims
    lk, nh, nkv = [70, 33], 4, 2
    if dk == dv:
        k, v, table, used = make_pages(rng, lk, 32, nkv, dk, fmt)
    else:
        k, v, table, used = _mla_pages(rng, lk, 32, nkv, fmt)
    cq = np.array([0, 25, 58], np.int32)
    q = rng.uniform(-1, 1, (58, nh, dk)).astype(np.float32)
    sinks = rng.uniform(-1, 1, nh).astype(np.float32)
    kw = dict(causal=True, cu_seqlens_q=cq, return_lse=True, sinks=sinks, form=form)
    half = lambda x: x.astype(np.float16)  # noqa: E731 (exact: every FP8 value is a half)
    if paged:
        f16 = _cuda(q, half(k), half(v), block_table=table, seqused_k=used, **kw)[0]
        for extra in ({}, dict(k_descale=1.0, v_descale=np.ones(nkv, np.float32))):
            _bits(_cuda(q, k, v, block_table=table, seqused_k=used, **kw, **extra)[0], f16)
    else:
        kc = np.concatenate([gather_pages(k, table, used, b) for b in range(2)])
        vc = np.concatenate([gather_pages(v, table, used, b) for b in range(2)])
        ck = np.array([0, 70, 103], np.int32)
        f16 = _cuda(q, half(kc), half(vc), cu_seqlens_k=ck, **kw)[0]
        for extra in ({}, dict(k_descale=1.0, v_descale=np.ones(nkv, np.float32))):
            _bits(_cuda(q, kc, vc, cu_seqlens_k=ck, **kw, **extra)[0], f16)


def _every_byte(fmt):
    """Every finite FP8 byte of `fmt` (E4M3: all but 0x7f / 0xff; E5M2: all but the
    infinities and NaNs 0x7c-0x7f, 0xfc-0xff)."""
    b = np.arange(256, dtype=np.uint8)
    if fmt == "float8_e4m3fn":
        keep = (b & 0x7F) != 0x7F
    else:
        keep = (b & 0x7F) < 0x7C
    return b[keep]


@needs_gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("d", [64, 128])
def test_every_fp8_byte_is_its_half(rng, form, fmt, d):
    """K and V rows holding every finite byte of the format (subnormals, both zeros, the
    largest values), shuffled: the result is the F16 call's on ml_dtypes' values of them, to
    the bit (a byte widened to another half would change it). The scale keeps the scores
    finite and the softmax spread."""
    finite = _every_byte(fmt)
    kv, nkv, nh = 128, 2, 4
    n = kv * nkv * d
    raw_k = rng.choice(finite, n).astype(np.uint8)
    raw_k[: finite.size] = finite  # every byte at least once
    raw_v = rng.permutation(raw_k)
    k, v = raw_k.reshape(kv, nkv, d).view(FP8[fmt]), raw_v.reshape(kv, nkv, d).view(FP8[fmt])
    q = rng.uniform(-1, 1, (40, nh, d)).astype(np.float32)
    scale = 1e-6 if fmt == "float8_e5m2" else 1e-3
    kw = dict(causal=True, return_lse=True, scale=scale, form=form)
    got = _cuda(q, k, v, **kw)[0]
    want = _cuda(q, k.astype(np.float32).astype(np.float16), v.astype(np.float32).astype(np.float16), **kw)[0]
    _bits(got, want)
    got_bytes = _cuda(q, raw_k.reshape(kv, nkv, d), raw_v.reshape(kv, nkv, d), kv_dtype=fmt, **kw)[0]
    _bits(got_bytes, want)


@needs_gpu
def test_the_integer_fp8_widening_in_a_process_of_its_own():
    """The widening sm_80 runs (integer operations; sm_89 and later take the hardware's
    conversion) on this GPU: MLXN_FP8_CVT_INT=1 (MLX_NATIVE_CUDA_DEFINES, read once per
    process) and the bit-identity tests above again."""
    env = {**os.environ, "MLX_NATIVE_CUDA_DEFINES": "-DMLXN_FP8_CVT_INT=1"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
         "test_every_fp8_byte_is_its_half or (test_fp8_with_descale_one and d128)"],
        env=env, cwd=kernel_registry.ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = re.findall(r"^.*\d+ passed.*$", run.stdout, re.M)
    assert summary and "skipped" not in summary[-1] and "deselected" in summary[-1], run.stdout[-1000:]


@needs_gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("splits", [2, 8])
def test_quantised_split_walks_on_cuda(rng, form, fmt, splits):
    """A chunk against long quantised caches with the walk split (the merge after; V's factor
    in each part's O): paged equals contiguous to the bit under the same split, and both the
    reference."""
    bs, lq, lk, nh, nkv, d = 16, [40, 8], [1500, 900], 8, 2, 128
    k, v, table, used = make_pages(rng, lk, bs, nkv, d, fmt)
    kd, vd = _descales(rng, fmt != "q8_0", nkv)
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    q = rng.uniform(-1, 1, (int(cq[-1]), nh, d)).astype(np.float32)
    kw = dict(causal=True, cu_seqlens_q=cq, return_lse=True, form=form, splits=splits, **kw_of(fmt, kd, vd))
    paged, plan = _cuda(q, k, v, block_table=table, seqused_k=used, **kw)
    assert plan.workspace_bytes > 0 and plan.choices["splits"] == splits, plan.choices
    kc = np.concatenate([gather_pages(k, table, used, b) for b in range(2)])
    vc = np.concatenate([gather_pages(v, table, used, b) for b in range(2)])
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    _bits(paged, _cuda(q, kc, vc, cu_seqlens_k=ck, **kw)[0])
    ref, ref_lse = reference_paged(q, values(k, fmt, kd), values(v, fmt, vd), block_table=table, seqused_k=used,
                                   cu_seqlens_q=cq, causal=True, scale=1 / np.sqrt(d))  # fmt: skip
    assert nmse(paged[0], ref) < BAR
    assert np.abs(paged[1] - ref_lse).max() < LSE_TOL


@needs_gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("paged", [False, True], ids=["contig", "paged"])
def test_quantised_score_transforms_on_cuda(rng, form, fmt, paged):
    """Softcap (after K's factor: on the true score) and ALiBi slopes, sinks, F16 output (the
    portable form's ``_xf_kvq`` / ``_xf_paged_kvq``; branches in the Hopper form)."""
    lk, bs, nh, nkv, d = [70, 130], 32, 4, 2, 64
    k, v, table, used = make_pages(rng, lk, bs, nkv, d, fmt)
    kd, vd = _descales(rng, fmt != "q8_0", nkv)
    q = rng.uniform(-1, 1, (2, 24, nh, d)).astype(np.float32)
    slopes = rng.uniform(0, 0.2, (2, nh)).astype(np.float32)
    sinks = rng.uniform(-1, 1, nh).astype(np.float32)
    kw = dict(window=(30, 5), softcap=5.0, alibi_slopes=slopes, sinks=sinks, form=form, **kw_of(fmt, kd, vd))
    rkw = dict(window=(30, 5), softcap=5.0, alibi_slopes=slopes, sinks=sinks, scale=1 / 8)
    if paged:
        out, _ = _cuda(q, k, v, block_table=table, seqused_k=used, **kw)
        ref, _ = reference_paged(q, values(k, fmt, kd), values(v, fmt, vd), block_table=table, seqused_k=used, **rkw)
    else:
        kc, vc = quantise(rng, (2, 130, nkv, d), fmt), quantise(rng, (2, 130, nkv, d), fmt)
        out, _ = _cuda(q, kc, vc, **kw)
        ref, _ = reference_prefill(q, values(kc, fmt, kd), values(vc, fmt, vd), **rkw)
    assert nmse(out, ref) < BAR


@needs_gpu
def test_fp8_torch_cuda_tensors(rng):
    """torch's float8 CUDA tensors (and a CUDA descale tensor) through the array call: a CUDA
    tensor, the host arrays' bits."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA build of torch")
    q = rng.uniform(-1, 1, (33, 4, 64)).astype(np.float32)
    k, v = quantise(rng, (90, 2, 64), "float8_e4m3fn"), quantise(rng, (90, 2, 64), "float8_e4m3fn")
    kd = np.array([0.5, 2.0], np.float32)
    host = mn.flash_attn_prefill(q, k, v, causal=True, k_descale=kd, v_descale=3.0, device="cuda", cta_pairs="off")
    t8 = lambda x: torch.from_numpy(x.view(np.uint8)).cuda().view(torch.float8_e4m3fn)  # noqa: E731
    out = mn.flash_attn_prefill(torch.from_numpy(q).cuda(), t8(k), t8(v), causal=True,
                                k_descale=torch.from_numpy(kd).cuda(), v_descale=3.0, cta_pairs="off")  # fmt: skip
    assert isinstance(out, torch.Tensor) and out.is_cuda
    _bits(out.cpu().numpy(), host)


def _quant_entries(hopper: bool):
    """The quant modules' entry points of one form: each F16 attention kernel's (its entry
    point: the origin's at 256 and 512) `_kvq` and `_paged_kvq`, and in the portable form
    `_xf_kvq` and `_xf_paged_kvq` too; the Hopper form where the kernel has one (head dims 64,
    128, 256, 512)."""
    want = set()
    for dk, dv in KERNEL_DIMS:
        base = f"flash_attn_prefill_tensor_f16_d{dk}" if dk == dv and dk in (256, 512) else (
            f"flash_attn_prefill_d{dk}" + (f"_{dv}" if dv != dk else ""))  # fmt: skip
        h = hopper and dk == dv and dk in (64, 128, 256, 512)
        for suffix in ("_kvq", "_paged_kvq") if h else ("_kvq", "_xf_kvq", "_paged_kvq", "_xf_paged_kvq"):
            want.add(base + suffix)
    return want


_TRACE = re.compile(r"^mlx_native cuda: (\w+) (?:variant .* )?(?:merge )?entry (\w+) arch (\w+)$", re.M)


@needs_gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dims", KERNEL_DIMS, ids=[f"d{a}_{b}" for a, b in KERNEL_DIMS])
def test_every_quant_kernel(rng, form, dims):
    """Each head dim's quantised kernel in each module and entry (contiguous, paged; with and
    without softcap): E4M3 with descale, against the reference (the launch trace test below
    reads which entry points these calls launch)."""
    dk, dv = dims
    fmt = "float8_e4m3fn"
    lk, nh, nkv = [75, 40], 4, 2
    k, v, table, used = make_pages(rng, lk, 32, nkv, dk, fmt) if dk == dv else _mla_pages(rng, lk, 32, nkv, fmt)
    kd, vd = _descales(rng, True, nkv)
    cq = np.array([0, 20, 27], np.int32)
    q = rng.uniform(-1, 1, (27, nh, dk)).astype(np.float32)
    for softcap in (0.0, 8.0):
        kw = dict(causal=True, cu_seqlens_q=cq, softcap=softcap, form=form, k_descale=kd, v_descale=vd)
        paged, _ = _cuda(q, k, v, block_table=table, seqused_k=used, **kw)
        kc = np.concatenate([gather_pages(k, table, used, b) for b in range(2)])
        vc = np.concatenate([gather_pages(v, table, used, b) for b in range(2)])
        ck = np.array([0, 75, 115], np.int32)
        _bits(paged, _cuda(q, kc, vc, cu_seqlens_k=ck, **kw)[0])
        ref, _ = reference_paged(q, values(k, fmt, kd), values(v, fmt, vd), block_table=table, seqused_k=used,
                                 cu_seqlens_q=cq, causal=True, softcap=softcap, scale=1 / np.sqrt(dk))  # fmt: skip
        assert nmse(paged, ref) < BAR


@needs_gpu
@pytest.mark.parametrize("form", FORMS)
def test_every_quant_entry_point_is_launched(form):
    """test_every_quant_kernel again in a process of its own with the launch trace on: every
    quant entry point of the form (the Hopper form's on sm_90a, else the portable ones) is
    launched, and no launch of a quantised kernel runs another module's entry point."""
    env = {**os.environ, "MLX_NATIVE_CUDA_TRACE": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", __file__, "-k",
         f"test_every_quant_kernel and {form}"],
        env=env, cwd=kernel_registry.ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    launched = [(k, e, a) for k, e, a in _TRACE.findall(run.stderr) if k.endswith("_kvq")]
    assert launched, "no quantised launch was traced:\n" + run.stderr[-2000:]
    archs = {a for _, _, a in launched}
    assert len(archs) == 1, archs
    arch = archs.pop()
    want = _quant_entries(hopper=arch == "sm_90a")
    got = {e for _, e, _ in launched if e != "flash_attn_prefill_split_merge"}
    assert got == want, f"{arch}: missing {sorted(want - got)}, unexpected {sorted(got - want)}"
    assert {k for k, _, _ in launched} == {k for k in kernel_registry.cuda_kernels() if k.endswith("_kvq")}
