"""The four kernel coverage gaps of issue 27, on every backend present (the CPU once per
instruction set, CUDA where a GPU is: the `device` fixture); the Metal kernels run the same
classes in the emulator (test_metal_emulator_coverage.py). Each class is input that no test
gave before, so a one-line slip in a kernel that only it reaches passed the whole suite:

1. ALiBi (SPEC 10) at 6 and 12 heads: two and four heads past the largest power of two
   n2, where `m1^(2 (h - n2) + 1)` differs from near misses such as `m1^(h - n2 + 1)` (at 3
   heads, the only count tested before, they agree); explicit and described masks, GQA
   and not, against a float64 reference whose slopes are written here from SPEC 10.
2. Every registered kernel of every backend dispatched against the float64 reference
   (`test_every_registered_kernel`), with a test that its parameters are the kernels the
   backends register (`kernel_registry.py` reads them from the Rust tables), so a kernel
   added without a test fails. On CUDA one kernel has several entry points (the Hopper form,
   its CTA-pair forms, the portable form and its `_xf` with the score transforms, the
   split-KV merge): each kernel's calls are chosen to reach every one of them, and
   `test_cuda_every_entry_point_is_launched` runs them again with the launch trace and
   requires every entry point of the form the GPU runs.
3. A NaN of full payload (F16 0x7fff, 0xffff) in an explicit mask at a visible pair stays
   NaN in its row's F16 and BF16 output (a rounding that adds to the bits without a NaN
   test carries such a payload into the sign bit: -0 or +0); the other rows are right.
4. BF16 Q beyond F16's range: |q| ~ 2^17 with scale 2^-17, and |q| ~ 2^-20 with scale 2^17
   (SPEC 9: `half(scale * q)` from q read as float; Q widened through half first gives inf,
   or loses its bits to half's subnormals).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

import mlx_native as mn
from mlx_native.dtypes import bfloat16_dtype
from mlx_native.reference import alibi_slopes, nmse, peer_mask, reference_attention, reference_prefill

import kernel_registry
from helpers import KERNEL_DIMS, lse_tolerance, make_case, random_qkv_dims as _qkv, run_low_level
from planted_cases import crafted_blk_mask, spec_blk
from test_planted import front_door_table

BF16 = bfloat16_dtype()
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
HAS_CUDA = "cuda" in mn.backends()
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU")

DIMS = KERNEL_DIMS


def _bar(device, kv_dtype) -> float:
    """NMSE bar of an F32 output against the float64 reference: 1e-5; with BF16 K/V on CUDA,
    whose tensor cores take Q and P in bfloat16 (docs/spec.md, "BF16 K/V on CUDA"), 5e-5."""
    return 5e-5 if device.backend == "cuda" and np.dtype(kv_dtype) == BF16 else 1e-5


def _lse_tol(device, kv_dtype, d: int = 128) -> float:
    return lse_tolerance(device.backend == "cuda" and np.dtype(kv_dtype) == BF16, d)


def _close(device, kv_dtype, out, lse, ref, ref_lse, what=""):
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all(), what
    err = nmse(out, ref)
    assert err < _bar(device, kv_dtype), f"{what}: nmse {err:.3e}"
    if lse is not None:
        lse = np.asarray(lse)
        assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)), f"{what}: rows that see nothing"
        seen = np.isfinite(ref_lse)
        off = np.abs(lse[seen] - ref_lse[seen]).max(initial=0)
        assert off < _lse_tol(device, kv_dtype, ref.shape[-1]), f"{what}: lse off by {off:.3e}"


# ---------------------------------------------------------------- 1. ALiBi past n2


def spec_slopes(n_heads: int, max_bias: float, past=lambda h, n2: 2 * (h - n2) + 1) -> np.ndarray:
    """SPEC 10's slopes, written out here (not mlx_native.reference's): n2 = 2^floor(log2(H)),
    m0^(h + 1) below n2, m1^past(h, n2) from n2 on (SPEC: 2 (h - n2) + 1)."""
    n2 = 1
    while n2 * 2 <= n_heads:
        n2 *= 2
    m0, m1 = 2.0 ** (-max_bias / n2), 2.0 ** (-max_bias / 2 / n2)
    return np.array([m0 ** (h + 1) if h < n2 else m1 ** past(h, n2) for h in range(n_heads)])


def slope_reference(q, k, v, bias, seen, slopes, scale):
    """Float64 attention of q [rows, H, D] over k, v [kv, Hkv, D] with score
    `dot(half(scale q), k) + slopes[h] * bias` on the pairs `seen` [rows, kv] (rows that see
    nothing: zeros, lse -inf); returns (out, lse [H, rows])."""
    rows, nh, _ = q.shape
    group = nh // k.shape[1]
    qh = (np.float32(scale) * q.astype(np.float32)).astype(np.float16).astype(np.float64)
    out = np.zeros((rows, nh, v.shape[2]))
    lse = np.full((nh, rows), -np.inf)
    any_seen = seen.any(axis=1)
    for h in range(nh):
        g = h // group
        s = qh[:, h] @ k[:, g].astype(np.float64).T + slopes[h] * bias
        s = np.where(seen, s, -np.inf)[any_seen]
        m = s.max(axis=1, keepdims=True)
        p = np.exp(s - m)
        out[any_seen, h] = p @ v[:, g].astype(np.float64) / p.sum(axis=1, keepdims=True)
        lse[h, any_seen] = m[:, 0] + np.log(p.sum(axis=1))
    return out, lse


def alibi_case(rng, nh, nkv, hd, kv_dtype, mask):
    """q, k, v, the call's keywords and (bias, seen) for :func:`slope_reference`: an explicit
    mask (values in [-8, 8], so the slopes weigh, a fifth of them -inf, a skipped tile, a
    tile of zeros and a row that sees nothing; added on the causal pairs), or a described
    causal window (ALiBi's distance j - p on its pairs)."""
    rows, kv, window = 40, 100, 50
    q, k, v = _qkv(rng, rows, kv, nh, nkv, hd, hd, kv_dtype)
    p = np.arange(rows)[:, None] + kv - rows  # each query's position in the cache
    j = np.arange(kv)[None, :]
    if mask == "explicit":
        m = rng.uniform(-8, 8, (rows, kv)).astype(np.float16)
        m[rng.random((rows, kv)) < 0.2] = -np.inf
        m[:32, :64] = -np.inf  # a skipped tile (table byte 0)
        m[32:, :64] = 0  # one without the mask (2)
        m[5, :] = -np.inf  # a row that sees nothing
        seen = (j <= p) & np.isfinite(m)
        kw = dict(mask=m, causal=True)
        bias = np.where(np.isfinite(m), m.astype(np.float64), 0.0)
    else:
        seen = (j <= p) & (j > p - window)
        kw = dict(causal=True, window=window)
        bias = (j - p).astype(np.float64)
    return q, k, v, kw, bias, seen


ALIBI = [(nh, nkv, m, hd) for nh in (6, 12) for nkv in (nh, nh // 3) for m in ("explicit", "described") for hd in (64, 80)]


@pytest.mark.parametrize("nh,nkv,mask,hd", ALIBI, ids=[f"h{a}/{b}-{m}-d{d}" for a, b, m, d in ALIBI])
def test_alibi_with_heads_past_the_largest_power_of_two(device, rng, nh, nkv, mask, hd):
    # Head dims 64 and 80: on CUDA (Hopper) the wgmma form and the portable form's `_xf`,
    # each with its own ALiBi code; K/V BF16 at 80 (the other element type).
    kv_dtype = F16 if hd == 64 else BF16
    max_bias, scale = 8.0, 0.5
    q, k, v, kw, bias, seen = alibi_case(rng, nh, nkv, hd, kv_dtype, mask)
    slopes = spec_slopes(nh, max_bias)
    assert np.allclose(slopes, alibi_slopes(nh, max_bias), rtol=1e-15, atol=0), "the reference's slopes are SPEC 10's"
    ref, ref_lse = slope_reference(q, k, v, bias, seen, slopes, scale)
    m = kw.pop("mask", None)
    out, lse = mn.flash_attn_prefill(q, k, v, m, max_bias=max_bias, scale=scale, return_lse=True, device=device, **kw)
    _close(device, kv_dtype, out, lse, ref, ref_lse, f"{nh} heads")
    # The heads past n2 are where the case has its power: slopes of a plausible slip there
    # (m1^(h - n2 + 1), the odd exponents' count forgotten) are far from SPEC's, and every
    # head's output is held to the bar on its own (a slip in two of twelve heads must fail).
    near, _ = slope_reference(q, k, v, bias, seen, spec_slopes(nh, max_bias, lambda h, n2: h - n2 + 1), scale)
    assert nmse(near, ref) > 100 * _bar(device, kv_dtype), "the case cannot tell the slopes apart"
    for h in range(nh):
        assert nmse(out[:, h], ref[:, h]) < 1e-4, f"head {h}"


# ---------------------------------------------------------------- 2. every registered kernel


def _prefill_calls(rng, dk, dv, kv_dtype, cuda):
    """The calls that reach every entry point of one prefill kernel (keyword arguments of
    flash_attn_prefill, plus q, k, v): on CUDA (Hopper) at 256 and 512 a fixed-length batch
    whose query-head group splits in two (the CTA-pair form over heads), a group of 3 (over
    query tiles), variable length (the one-CTA form); in the portable form the score
    transforms (`_xf`); on CUDA a few rows against a long cache (the split-KV merge; the
    other backends have no such form). Every shape has a partial query tile and a partial
    last step."""
    q, k, v = _qkv(rng, 21, 70, 4, 2, dk, dv, kv_dtype, batch=2)
    yield "batch, GQA 2, causal", dict(q=q, k=k, v=v, causal=True, scale=0.5)
    q, k, v = _qkv(rng, 37, 90, 3, 1, dk, dv, kv_dtype)
    mask = peer_mask(37, 90, rng)
    mask[3] = -np.inf
    sinks = rng.uniform(-2, 2, 3).astype(np.float32)
    yield "GQA 3, mask, softcap, ALiBi, sinks", dict(q=q, k=k, v=v, mask=mask, causal=True, scale=0.4, softcap=3.0,
                                                      max_bias=6.0, sinks=sinks)  # fmt: skip
    q, k, v = _qkv(rng, 30, 100, 4, 2, dk, dv, kv_dtype)
    cu_q, cu_k = np.array([0, 9, 9, 30], np.int32), np.array([0, 40, 52, 100], np.int32)
    yield "variable length", dict(q=q, k=k, v=v, causal=True, window=20, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, scale=0.5)
    if cuda:
        q, k, v = _qkv(rng, 16, 2100, 2, 1, dk, dv, kv_dtype)
        yield "16 rows, 2100 cache rows", dict(q=q, k=k, v=v, causal=True, scale=0.3)


def _run_prefill_kernel(device, rng, dk, dv, kv_dtype):
    for what, kw in _prefill_calls(rng, dk, dv, kv_dtype, device.backend == "cuda"):
        q, k, v, mask = kw.pop("q"), kw.pop("k"), kw.pop("v"), kw.pop("mask", None)
        out, lse = mn.flash_attn_prefill(q, k, v, mask, return_lse=True, device=device, **kw)
        assert out.shape == q.shape[:-1] + (dv,)
        _close(device, kv_dtype, out, lse, *reference_prefill(q, k, v, mask, **kw), what)


def _run_kvq_kernel(device, rng, dk, dv):
    # The quantised K/V kernel (every backend: docs/spec.md 11b): the calls above with K/V
    # in E4M3 (descale per KV head), E5M2 and, at multiples of 32, Q8_0, against the reference
    # on the dequantised values (test_quant_kv.py, test_cuda_quant.py and
    # test_metal_emulator_quant.py hold the rest; on CUDA the split walk's call too, and
    # test_cuda_quant.py launches every quant entry point).
    import ml_dtypes

    from mlx_native.reference import dequantise, quantise_q8_0

    formats = ["float8_e4m3fn", "float8_e5m2"] + (["q8_0"] if dk % 32 == 0 and dv % 32 == 0 else [])
    for fmt in formats:
        for what, kw in _prefill_calls(rng, dk, dv, F32, device.backend == "cuda"):
            q, k, v, mask = kw.pop("q"), kw.pop("k"), kw.pop("v"), kw.pop("mask", None)
            if fmt == "q8_0":
                k8, v8, extra = quantise_q8_0(k), quantise_q8_0(v), dict(kv_dtype="q8_0")
                kd, vd = dequantise(k8, "q8_0"), dequantise(v8, "q8_0")
            else:
                f8 = getattr(ml_dtypes, fmt)
                k8, v8 = k.astype(f8), v.astype(f8)
                ks = (0.5 + rng.uniform(0, 1, k.shape[-2])).astype(np.float32)
                extra = dict(k_descale=ks, v_descale=np.float32(1.5)) if fmt == "float8_e4m3fn" else {}
                kd, vd = dequantise(k8, None, extra.get("k_descale")), dequantise(v8, None, extra.get("v_descale"))
            out, lse = mn.flash_attn_prefill(q, k8, v8, mask, return_lse=True, device=device, **kw, **extra)
            _close(device, F32, out, lse, *reference_prefill(q, kd, vd, mask, **kw), f"{fmt}, {what}")


def _run_origin_kernel(device, rng, hd):
    # Odd strides (on Hopper the one-CTA form: no tensor map), then aligned views with a
    # query-head group of 2 and of 3 (the pair forms over heads and over query tiles).
    for nh, nkv, pad in ((4, 2, (4, 1, 2)), (4, 2, (0, 0, 0)), (3, 1, (0, 0, 0))):
        c = make_case(rng, 45, nh, nkv, hd, 130, scale=0.7, mask="peer", pad=pad)
        out, _ = run_low_level(device, c)
        err = nmse(out, reference_attention(c.q, c.k, c.v, c.mask, scale=c.scale))
        assert err < 1e-5, f"{nh}/{nkv} {pad}: nmse {err:.3e}"


def _run_blk(device, rng):
    for bq, bk in ((32, 64), (16, 64)):
        mask, want, _ = crafted_blk_mask(rng, bq, bk)
        assert np.array_equal(mn.flash_attn_prefill_blk(mask, bq, bk, device=device), want)


def _run_mask_blk(device, rng):
    rows, kv = 45, 130
    full = np.full((2, rows, kv + 6), np.nan, np.float16)
    for i in range(2):
        full[i, :, :kv] = peer_mask(rows, kv, rng)
    for hd, bq in ((256, 32), (512, 16)):
        got = front_door_table(device, full, kv, hd)
        for i in range(2):
            padded = np.full((rows, 192), -np.inf, np.float16)
            padded[:, :kv] = full[i, :, :kv]
            assert np.array_equal(got[i], spec_blk(padded, rows, bq)), (hd, i)


def _kernel_cases():
    cases = {}
    for dk, dv in DIMS:
        base = f"flash_attn_prefill_d{dk}" + (f"_{dv}" if dv != dk else "")
        for name, kvd in ((base, F16), (base + "_bf16", BF16), (base + "_f32", F32)):
            cases[name] = lambda device, rng, dk=dk, dv=dv, kvd=kvd: _run_prefill_kernel(device, rng, dk, dv, kvd)
        cases[base + "_kvq"] = lambda device, rng, dk=dk, dv=dv: _run_kvq_kernel(device, rng, dk, dv)
    for hd in (256, 512):
        cases[f"flash_attn_prefill_tensor_f16_d{hd}"] = lambda device, rng, hd=hd: _run_origin_kernel(device, rng, hd)
    cases["flash_attn_prefill_blk"] = _run_blk
    cases["flash_attn_prefill_mask_blk"] = _run_mask_blk
    return cases


KERNEL_CASES = _kernel_cases()


@pytest.mark.parametrize("kernel", sorted(KERNEL_CASES))
def test_every_registered_kernel(device, rng, kernel):
    KERNEL_CASES[kernel](device, rng)


def test_the_kernel_cases_are_every_registered_kernel():
    # Each backend's kernels as its own source registers them; a kernel added anywhere
    # without a case above fails here.
    cases = set(KERNEL_CASES)
    # float32 K/V kernels are the CPU's alone (CUDA and Metal get float16 copies: docs/spec.md);
    # the quantised K/V ones (`_kvq`: docs/spec.md 11b) every backend's.
    cpu_only = {n for n in cases if n.endswith("_f32")}
    kvq = {n for n in cases if n.endswith("_kvq")}
    assert len(cpu_only) == len(kvq) == len(DIMS)
    assert kernel_registry.cpu_kernels() == cases, "CPU: " + str(kernel_registry.cpu_kernels() ^ cases)
    shared = cases - cpu_only
    assert kernel_registry.cuda_kernels() == shared, "CUDA: " + str(kernel_registry.cuda_kernels() ^ shared)
    # Metal has a paged entry point (SPEC 11) of each prefill kernel besides: the op's
    # PAGED_KERNELS, run in the emulator by test_metal_emulator_coverage.py's every-entry test.
    metal = kernel_registry.metal_entries()
    metal_paged = {n for n in metal if n.startswith("flash_attn_prefill_paged_")}
    assert metal - metal_paged == shared, "Metal: " + str((metal - metal_paged) ^ shared)
    prefill = {n for n in shared - kvq if re.fullmatch(r"flash_attn_prefill_d\w+", n)}
    assert kernel_registry.op_registered_kernels() == prefill
    paged_of = {n.replace("flash_attn_prefill_", "flash_attn_prefill_paged_", 1) for n in prefill | kvq}
    assert metal_paged == paged_of, "Metal paged: " + str(metal_paged ^ paged_of)
    # The CUDA entry points the calls must reach, by form (the Hopper list is what NVRTC
    # reports for sm_90a: test_cuda.py's compile test names them).
    hopper, portable = kernel_registry.cuda_entries(True), kernel_registry.cuda_entries(False)
    assert {"flash_attn_prefill_d256_bf16_pair_heads", "flash_attn_prefill_split_merge"} <= hopper
    assert "flash_attn_prefill_d80_xf" in hopper and "flash_attn_prefill_d64_xf" not in hopper
    assert {"flash_attn_prefill_d64_xf", "flash_attn_prefill_tensor_f16_d256_xf"} <= portable
    assert not any("_pair_" in e for e in portable)


_TRACE = re.compile(r"^mlx_native cuda: (\w+) (?:variant .* )?(?:merge )?entry (\w+) arch (\w+)$", re.M)


@needs_gpu
def test_cuda_every_entry_point_is_launched():
    # The kernel tests above again, in a process of their own with the launch trace on
    # (MLX_NATIVE_CUDA_TRACE, read once per process): every entry point of the form this GPU
    # runs (sm_90a: the Hopper forms and pairs; MLX_NATIVE_CUDA_ARCH=sm_90 or another GPU:
    # the portable forms and `_xf`) must be launched, and every registered kernel dispatched.
    env = {**os.environ, "MLX_NATIVE_CUDA_TRACE": "1"}
    for knob in ("MLX_NATIVE_CUDA_PAIR", "MLX_NATIVE_CUDA_KV_SPLITS"):  # the defaults choose every form
        env.pop(knob, None)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", __file__, "-k",
         "test_every_registered_kernel and cuda"],
        env=env, cwd=kernel_registry.ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    launched = _TRACE.findall(run.stderr)
    assert launched, "no launch was traced:\n" + run.stderr[-2000:]
    archs = {a for _, _, a in launched}
    assert len(archs) == 1, archs
    arch = archs.pop()
    want = kernel_registry.cuda_entries(hopper=arch == "sm_90a")
    missing = want - {e for _, e, _ in launched}
    assert not missing, f"{arch}: entry points no test launches: {sorted(missing)}"
    kernels = {k for k, _, _ in launched}
    assert kernels == kernel_registry.cuda_kernels(), kernels ^ kernel_registry.cuda_kernels()


# ---------------------------------------------------------------- 3. NaN through F16 / BF16 out


#: A NaN with every payload bit set, positive and negative (F16 bits). Widened to F32 its
#: payload fills the top mantissa bits, so rounding to BF16 by adding 0x7fff carries it into
#: the exponent and sign: 0x7fffe000 + 0x7fff + 1 = 0x80006000 -> -0.0.
FULL_NANS = (0x7FFF, 0xFFFF)
OUT_BARS = {F32: 1e-5, F16: 1.5e-6, BF16: 6.5e-5}  # tests/test_front_door.py's, per dtype


@pytest.mark.parametrize("out_dtype", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("hd", [80, 256])
def test_a_full_payload_nan_in_the_mask_stays_nan_in_every_output_dtype(device, rng, hd, out_dtype):
    rows, kv, nh, nkv = 40, 100, 4, 2
    q, k, v = _qkv(rng, rows, kv, nh, nkv, hd, hd)
    mask = peer_mask(rows, kv, rng)
    off = kv - rows  # causal: row r sees j <= r + off
    poisoned = {}
    for r, bits in zip((3, 33), FULL_NANS):  # one per query tile (bq 32), each payload
        j = r + off - 7  # visible
        mask[r, j] = np.frombuffer(np.uint16(bits).tobytes(), np.float16)[0]
        poisoned[r] = bits
    out = mn.flash_attn_prefill(q, k, v, mask, causal=True, scale=0.5, out_dtype=out_dtype, device=device)
    assert out.dtype == out_dtype
    o = np.asarray(out, np.float32)
    for r in poisoned:
        assert np.isnan(o[r]).all(), f"row {r} (mask NaN {poisoned[r]:#06x}): {o[r][np.isfinite(o[r])][:4]} not NaN"
    clean = mask.copy()
    clean[list(poisoned)] = 0
    ref, _ = reference_prefill(q, k, v, clean, causal=True, scale=0.5)
    others = np.setdiff1d(np.arange(rows), list(poisoned))
    want = ref[others] if out_dtype == F32 else ref[others].astype(out_dtype)
    assert np.isfinite(o[others]).all()
    assert nmse(o[others], want) < OUT_BARS[out_dtype]


# ---------------------------------------------------------------- 4. BF16 Q beyond F16's range


@pytest.mark.parametrize("magnitude,scale", [(2.0**17, 2.0**-17), (2.0**-20, 2.0**17)], ids=["big", "tiny"])
@pytest.mark.parametrize("hd,kv_dtype", [(64, F16), (80, F16), (256, F16), (128, BF16)], ids=str)
def test_bf16_q_outside_f16s_range(device, rng, magnitude, scale, hd, kv_dtype):
    out, lse, ref, ref_lse, near = _bf16_q_case(rng, magnitude, scale, hd, kv_dtype,
                                                lambda *a, **kw: mn.flash_attn_prefill(*a, device=device, **kw))  # fmt: skip
    _close(device, kv_dtype, out, lse, ref, ref_lse, "bf16 q")
    # Q widened through half before the scale gives inf (big: that row's output is lost) or
    # keeps a few bits of each element (tiny; zeros where half flushes subnormals).
    # (Non-finite rows are as far as it gets: the reference keeps a NaN row NaN, and the
    # output is held to be finite above.)
    assert not np.isfinite(near).all() or nmse(near, ref) > 30 * _bar(device, kv_dtype), "the case cannot tell Q widened through half"


def _bf16_q_case(rng, magnitude, scale, hd, kv_dtype, call):
    """BF16 Q of |q| ~ ``magnitude`` (up to 2^18, half of it past F16's 65504; or 2^-23 to
    2^-19, below F16's normals, some below its smallest subnormal 2^-24) with ``scale * q``
    within [-2, 2] or [-1/4, 1/4]; K uniform in [-1, 1], or [-16, 16] for the small Q, so that
    the scores span several units and Q's low bits matter. Returns the call's (out, lse),
    the reference's, and the reference's output with Q widened through half first."""
    rows, kv, nh, nkv = 37, 90, 4, 2
    _, k, v = _qkv(rng, rows, kv, nh, nkv, hd, hd, kv_dtype)
    if magnitude > 1:
        q = rng.uniform(-2, 2, (rows, nh, hd)) * magnitude
    else:
        k = (k.astype(np.float32) * 16).astype(kv_dtype)
        q = rng.choice([-1.0, 1.0], (rows, nh, hd)) * 2.0 ** rng.uniform(-23, -19, (rows, nh, hd))
    q = q.astype(np.float32).astype(BF16)
    qf = np.abs(q.astype(np.float32))
    assert (qf > 65504).mean() > 0.4 if magnitude > 1 else (qf < 2.0**-14).all()
    out, lse = call(q, k, v, causal=True, scale=scale, return_lse=True)
    ref, ref_lse = reference_prefill(q, k, v, causal=True, scale=scale)
    with np.errstate(invalid="ignore", over="ignore"):
        through_half = q.astype(np.float32).astype(np.float16).astype(np.float32)
        near, _ = reference_prefill(through_half, k, v, causal=True, scale=scale)
    return out, lse, ref, ref_lse, near
