"""FP8 K/V (SPEC 11) in the Hopper CTA-pair forms: the quant module's ``_pair_heads_kvq`` and
``_pair_queries_kvq`` at head dims 64, 128 and 256 (``shaders/flash_attn_prefill/quant_pipe.cuh``:
the TMA copies each tile's bytes into a raw slot, the producer's converter warps widen them
to F16 in the stage), which a quantised plan takes on sm_90a for FP8 K/V at fixed length
without an explicit mask, where the host launches them (``QUANT_PAIRS_LAUNCHED``,
``rust/src/backend/cuda/attention_geometry.rs``).

- FP8 with descale 1 at head dims 64 and 128 is the F16 K/V call on the same (exactly
  representable) values in the same pair form, to the bit: the stages hold the same halves,
  and the consumers are the same code (head dim 256's F16 pair form is another loop,
  ``mainloop_sm90_ws.cuh``, so there the bar is the reference's).
- With descale factors, every format and head dim against the float64 reference.
- Which plans report pairs: FP8 without a mask (where launched); never Q8_0 or an explicit
  mask; and the launch trace names every quant pair entry point where a plan reports them.

Without a CUDA device every test is skipped; on a GPU without sm_90a (or before the host
launches them) the plans report ``off`` and the same assertions hold of the one-CTA forms."""

from __future__ import annotations

import numpy as np
import pytest

import mlx_native as mn
from mlx_native.reference import nmse, reference_prefill

from helpers import traced_pair_run
from test_quant_kv import FP8, kw_of, quantise, values

HAS_CUDA = "cuda" in mn.backends()
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
BAR = 1e-5  # the F16 K/V bar on CUDA (test_cuda_quant.py)
FP8_FORMATS = ["float8_e4m3fn", "float8_e5m2"]


def _cuda(q, k, v, mask=None, pairs="auto", **kw):
    plan = mn.PrefillPlan(q, k, v, mask, device="cuda", cta_pairs=pairs, **kw)
    return plan.run(), plan


def _bits(a, b):
    for x, y in zip(a, b):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), f"max diff {np.abs(x.astype(float) - y).max()}"


@needs_gpu
@pytest.mark.parametrize("pairs", ["auto", "queries"])
@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("masking", ["causal", "window", "none"])
def test_fp8_pair_forms_are_the_f16_pair_forms_of_the_same_values(rng, pairs, fmt, d, masking):
    """A fixed-length batch (GQA 4, a cache longer than the prompt and not a whole number of
    tiles, partial last query tiles), lse, sinks, descale 1 given: the plan's form (pairs on
    sm_90a where launched) gives the F16 call's bits in that same form at head dims 64 and
    128, and the reference's accuracy at every head dim."""
    b, lq, lk, nh, nkv = 2, 150, 300, 8, 2
    q = rng.uniform(-1, 1, (b, lq, nh, d)).astype(np.float32)
    k, v = quantise(rng, (b, lk, nkv, d), fmt), quantise(rng, (b, lk, nkv, d), fmt)
    sinks = rng.uniform(-1, 1, nh).astype(np.float32)
    kw = dict(return_lse=True, sinks=sinks)
    kw.update({"causal": dict(causal=True), "window": dict(window=(40, 30)), "none": {}}[masking])
    ones = dict(k_descale=1.0, v_descale=np.ones(nkv, np.float32))
    (out, lse), plan = _cuda(q, k, v, pairs=pairs, **kw, **ones)
    form = plan.choices["pairs"]
    assert form in (pairs, "off"), plan.choices
    assert np.isfinite(out).all()
    half = lambda x: x.astype(np.float16)  # noqa: E731 (exact: every FP8 value is a half)
    if d != 256:
        f16, f16_plan = _cuda(q, half(k), half(v), pairs=form, **kw)
        assert f16_plan.choices["pairs"] == form, (plan.choices, f16_plan.choices)
        _bits((out, lse), f16)
    ref, _ = reference_prefill(q, values(k, fmt), values(v, fmt), scale=1 / np.sqrt(d), **kw_ref(kw))
    assert nmse(out, ref) < BAR


def kw_ref(kw):
    """The reference's keywords of a call's (no lse)."""
    return {key: val for key, val in kw.items() if key != "return_lse"}


@needs_gpu
@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_fp8_pair_forms_with_descale_factors(rng, fmt, d):
    """K's factors per KV head and V's one for all, causal, one sequence (heads pairs and
    query pairs alike): against the reference on the descaled values."""
    lq, lk, nh, nkv = 200, 200, 6, 3
    q = rng.uniform(-1, 1, (1, lq, nh, d)).astype(np.float32)
    k, v = quantise(rng, (1, lk, nkv, d), fmt), quantise(rng, (1, lk, nkv, d), fmt)
    kd, vd = rng.uniform(0.3, 2.5, nkv).astype(np.float32), float(rng.uniform(0.3, 2.5))
    out, plan = _cuda(q, k, v, causal=True, k_descale=kd, v_descale=vd)
    assert plan.choices["pairs"] in ("auto", "off"), plan.choices
    ref, _ = reference_prefill(q, values(k, fmt, kd), values(v, fmt, np.full(nkv, vd, np.float32)), causal=True,
                               scale=1 / np.sqrt(d))  # fmt: skip
    assert nmse(out, ref) < BAR


@needs_gpu
@pytest.mark.parametrize("fmt", FP8_FORMATS + ["q8_0"])
def test_which_quantised_plans_take_the_pair_forms(rng, fmt):
    """With CTA pairs allowed, fixed length and aligned K/V: FP8 without an explicit mask
    reports the pairs exactly where an F16 plan of the same shape does on this GPU, if the
    host launches them (else off, as Q8_0 and an explicit mask always do); every result
    matches the reference."""
    q = rng.uniform(-1, 1, (2, 256, 8, 128)).astype(np.float32)
    k, v = quantise(rng, (2, 256, 2, 128), fmt), quantise(rng, (2, 256, 2, 128), fmt)
    mask = rng.uniform(-1, 1, (2, 256, 256)).astype(np.float16)
    f16 = mn.PrefillPlan(q, values(k, fmt).astype(np.float16), values(v, fmt).astype(np.float16), device="cuda",
                         causal=True, cta_pairs="auto")  # fmt: skip
    for m in (None, mask):
        out, plan = _cuda(q, k, v, m, causal=True, **kw_of(fmt))
        got = plan.choices["pairs"]
        if fmt == "q8_0" or m is not None:
            assert got == "off", plan.choices
        else:
            assert got in ("off", f16.choices["pairs"]), (plan.choices, f16.choices)
        ref, _ = reference_prefill(q, values(k, fmt), values(v, fmt), m, causal=True, scale=1 / np.sqrt(128))
        assert nmse(out, ref) < BAR


_FP8_PLAN = """
from test_quant_kv import quantise
q = np.zeros((1, 64, 8, 128), np.float32)
k = quantise(np.random.default_rng(0), (1, 64, 2, 128), "float8_e4m3fn")
plan = mn.PrefillPlan(q, k, k, device="cuda", causal=True, cta_pairs="auto")
"""


@needs_gpu
def test_traced_quant_pairs_launch_what_the_plans_report():
    """The first test again in a process of its own with the launch trace on: where an FP8
    plan reports CTA pairs, every quant pair entry point (head dims 64, 128 and 256, heads
    and queries) is launched; where it reports ``off``, none is."""
    reported, entries = traced_pair_run(__file__, _FP8_PLAN, "are_the_f16_pair_forms")
    launched = {e for e in entries if e.endswith("_kvq") and "_pair_" in e}
    want = {
        f"{e}_pair_{m}_kvq"
        for e in ("flash_attn_prefill_d64", "flash_attn_prefill_d128", "flash_attn_prefill_tensor_f16_d256")
        for m in ("heads", "queries")
    }
    assert launched == (want if reported != "off" else set()), (reported, sorted(launched ^ want))
