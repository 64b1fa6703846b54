"""A plan's run options (issue 30, "options, not knobs"): ``kv_splits``, ``cta_pairs``,
``cuda_form`` and ``cpu_isa`` choose code paths per plan, where environment variables and
process-wide switches did; ``plan.choices`` reports what the backend chose, and a value
not understood is a typed error naming the option and what it takes.

The CPU's option is checked by what runs: a plan with ``cpu_isa`` gives the bits the
process-wide switch (``force_cpu_isa``) gives for that instruction set. The CUDA options
need a GPU to run; here they are checked where they are parsed and planned (the Rust
unit tests ``the_cuda_form_option_picks_the_target``, ``the_cta_pairs_option_beats_the_switch``
and ``forced_parts_override_the_shape`` check what each chooses), and on a CUDA device by
``plan.choices``."""

from __future__ import annotations

import numpy as np
import pytest

import mlx_native as mn
from mlx_native.reference import reference_prefill


def _case(rng, rows=40, kv=72, heads=4, kv_heads=2, d=64):
    q = rng.standard_normal((rows, heads, d)).astype(np.float32)
    k = rng.standard_normal((kv, kv_heads, d)).astype(np.float16)
    v = rng.standard_normal((kv, kv_heads, d)).astype(np.float16)
    return q, k, v


def _forced(isa, fn):
    """``fn()`` with the CPU kernels switched to ``isa`` process-wide."""
    mn.force_cpu_isa(isa)
    try:
        return fn()
    finally:
        mn.force_cpu_isa(None)


def _isas():
    return list(mn.cpu_info()["detected"]) + ["amx-emulated"]


def test_a_cpu_plan_reports_its_form_and_instruction_set(rng):
    q, k, v = _case(rng)
    plan = mn.PrefillPlan(q, k, v, causal=True, device="cpu")
    assert plan.choices == {"form": "cpu", "isa": mn.cpu_info()["isa"]}
    for isa in _isas():
        assert mn.PrefillPlan(q, k, v, causal=True, device="cpu", cpu_isa=isa).choices["isa"] == isa


@pytest.mark.parametrize("isa", _isas())
def test_cpu_isa_runs_that_instruction_set(rng, isa):
    q, k, v = _case(rng)
    want = _forced(isa, lambda: mn.PrefillPlan(q, k, v, causal=True, device="cpu").run())
    # Another instruction set switched on process-wide: the plan's option wins.
    other = next(i for i in _isas() if i != isa)
    got = _forced(other, lambda: mn.PrefillPlan(q, k, v, causal=True, device="cpu", cpu_isa=isa).run())
    assert np.array_equal(got, want), isa
    ref = reference_prefill(q, k, v, None, causal=True, scale=1 / 8)[0]
    np.testing.assert_allclose(got, ref, atol=2e-3, rtol=2e-3)


def test_the_option_reaches_the_kernels_where_instruction_sets_differ(rng):
    """Where two instruction sets give different bits on this case, the plans that choose
    them do too (an option that never reached the kernels would give one answer)."""
    q, k, v = _case(rng, rows=64, kv=200, d=128)
    forced = {isa: _forced(isa, lambda: mn.PrefillPlan(q, k, v, device="cpu").run()) for isa in _isas()}
    planned = {isa: mn.PrefillPlan(q, k, v, device="cpu", cpu_isa=isa).run() for isa in _isas()}
    for a in _isas():
        for b in _isas():
            assert np.array_equal(planned[a], planned[b]) == np.array_equal(forced[a], forced[b]), (a, b)


def test_the_array_call_and_the_encoder_carry_the_options(rng):
    q, k, v = _case(rng)
    isa = mn.cpu_info()["detected"][-1]  # the portable loops, never the default where SIMD is
    want = _forced(isa, lambda: mn.flash_attn_prefill(q, k, v, causal=True, device="cpu"))
    got = mn.flash_attn_prefill(q, k, v, causal=True, device="cpu", cpu_isa=isa)
    assert np.array_equal(got, want)
    device = mn.Device("cpu")
    plan = mn.PrefillPlan(q, k, v, causal=True, device=device, cpu_isa=isa)
    with device.encoder() as enc:
        plan.encode(enc)
    assert np.array_equal(plan.encoded_result(), want)


def test_cuda_options_are_taken_on_any_device(rng):
    """The CUDA options are parsed wherever a plan is made (a CPU plan has no use for them:
    it runs unsplit, with no workspace)."""
    q, k, v = _case(rng)
    for kw in (dict(kv_splits=4), dict(kv_splits=0), dict(cta_pairs="off"), dict(cta_pairs="queries"),
               dict(cta_pairs="auto"), dict(cuda_form="portable"), dict(cuda_form="auto")):  # fmt: skip
        plan = mn.PrefillPlan(q, k, v, causal=True, device="cpu", **kw)
        assert plan.workspace_bytes == 0 and plan.choices["form"] == "cpu", kw


@pytest.mark.parametrize(
    "kw,error,says",
    [
        (dict(kv_splits=3), mn.InvalidArgumentError, "kv_splits=3 is not 0, 1, 2, 4, 8 or 16"),
        (dict(kv_splits=-1), mn.InvalidArgumentError, "kv_splits=-1"),
        (dict(kv_splits=32), mn.InvalidArgumentError, "kv_splits=32"),
        (dict(kv_splits=2**70), mn.InvalidArgumentError, "kv_splits="),
        (dict(kv_splits="4"), mn.ArgumentTypeError, "kv_splits must be an integer"),
        (dict(kv_splits=True), mn.ArgumentTypeError, "kv_splits must be an integer"),
        (dict(cta_pairs="heads"), mn.InvalidArgumentError, "cta_pairs=\"heads\" is not 'auto', 'off' or 'queries'"),
        (dict(cta_pairs=0), mn.ArgumentTypeError, "cta_pairs must be a name"),
        (dict(cuda_form="sm_90"), mn.InvalidArgumentError, "cuda_form=\"sm_90\" is not 'auto' or 'portable'"),
        (dict(cpu_isa="avx513"), mn.InvalidArgumentError, "cpu_isa=\"avx513\" is not an instruction set of this CPU"),
        (dict(cpu_isa=["portable"]), mn.ArgumentTypeError, "cpu_isa must be a name"),
    ],
)
def test_a_bad_option_is_a_typed_error_naming_it(rng, kw, error, says):
    q, k, v = _case(rng)
    with pytest.raises(error, match=says.replace("(", r"\(").replace(")", r"\)")):
        mn.PrefillPlan(q, k, v, causal=True, device="cpu", **kw)
    with pytest.raises(error, match=says.replace("(", r"\(").replace(")", r"\)")):
        mn.flash_attn_prefill(q, k, v, causal=True, device="cpu", **kw)


_TRACED = r"""
import sys, numpy as np, mlx_native as mn
rng = np.random.default_rng(0)
q = rng.standard_normal((256, 8, 128)).astype(np.float32)
k = rng.standard_normal((8192, 8, 128)).astype(np.float16)
v = rng.standard_normal((8192, 8, 128)).astype(np.float16)
import torch
q, k, v = (torch.from_numpy(x).cuda() for x in (q, k, v))
kw = eval(sys.argv[1])
plan = mn.PrefillPlan(q, k, v, causal=True, device="cuda", **kw)
print("CHOICES", plan.choices, plan.workspace_bytes, flush=True)
plan.run()
torch.cuda.synchronize()
"""


@pytest.mark.skipif("cuda" not in mn.backends(), reason="the CUDA options run on a CUDA device")
@pytest.mark.parametrize(
    "kw",
    [{}, dict(kv_splits=4), dict(kv_splits=0), dict(cta_pairs="off"), dict(cta_pairs="queries"), dict(cuda_form="portable")],
)
def test_cuda_options_change_what_launches(kw):
    """Each CUDA option, in a process of its own with the launch trace on: the plan's report
    and the launches agree (a split launches the merge; no pairs, no pair variant; the
    portable form, its architecture), and the output matches the reference."""
    import subprocess
    import sys

    pytest.importorskip("torch")
    env = dict(__import__("os").environ, MLX_NATIVE_CUDA_TRACE="1")
    for knob in ("MLX_NATIVE_CUDA_PAIR", "MLX_NATIVE_CUDA_KV_SPLITS", "MLX_NATIVE_CUDA_ARCH"):
        env.pop(knob, None)  # the defaults, so that the option is what changes
    r = subprocess.run([sys.executable, "-c", _TRACED, repr(kw)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    choices = eval(r.stdout.split("CHOICES", 1)[1].rsplit("}", 1)[0] + "}")
    launches = [line for line in r.stderr.splitlines() if line.startswith("mlx_native cuda: flash_attn_prefill_d128 ")]
    assert launches, r.stderr[-3000:]
    merged = any(" merge entry " in line for line in launches)
    paired = any("variant Some(Pair" in line for line in launches)
    assert merged == (choices["splits"] > 1), (choices, launches)
    if kw.get("kv_splits") == 4:
        assert choices["splits"] == 4 and merged
    if kw.get("kv_splits") == 0:
        assert choices["splits"] == 1 and not merged
    if kw.get("cta_pairs") == "off" or choices["form"] == "portable":
        assert not paired, launches
    if kw.get("cta_pairs") == "queries":
        assert "variant Some(PairHeads)" not in r.stderr
    if kw.get("cuda_form") == "portable":
        assert choices["form"] == "portable" and choices["arch"] != "sm_90a"
        assert all(f"arch {choices['arch']}" in line for line in launches), launches
