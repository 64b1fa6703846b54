"""SPEC 10 through the front door (``flash_attn_prefill`` and ``PrefillPlan``) on the CPU:
every head dim of the table (q/k 576 with v 512, v a view of k too), float16 and bfloat16
k/v (numpy through ml_dtypes, torch in place), softcap, ALiBi, sinks (numpy or torch, given
to each run), against the float64 reference; and the typed errors of bad values."""

from __future__ import annotations

import numpy as np
import pytest

import mlx_native as mn
from mlx_native.dtypes import bfloat16_dtype
from mlx_native.reference import alibi_slopes, nmse, reference_prefill
from helpers import KERNEL_DIMS, import_test_extra, random_qkv_dims as _qkv

BF16 = bfloat16_dtype()
DIMS = KERNEL_DIMS


def _close(out, lse, ref, ref_lse):
    assert nmse(out, ref) < 1e-5
    assert np.abs(np.asarray(lse) - ref_lse).max() < 2e-3


@pytest.mark.parametrize("dk,dv", DIMS)
def test_every_head_dim_with_f16_and_bf16_kv(rng, dk, dv):
    for kv_dtype in (np.float16, BF16):
        q, k, v = _qkv(rng, 21, 45, 4, 2, dk, dv, kv_dtype)
        sinks = rng.uniform(-2, 2, 4).astype(np.float32)
        kw = dict(causal=True, scale=0.4, softcap=3.0, max_bias=6.0)
        out, lse = mn.flash_attn_prefill(q, k, v, return_lse=True, sinks=sinks, **kw)
        assert out.shape == (21, 4, dv) and out.dtype == np.float32
        _close(out, lse, *reference_prefill(q, k, v, sinks=sinks, **kw))


def test_v_a_view_of_k_at_576_512_is_read_in_place(rng):
    q, k, _ = _qkv(rng, 17, 40, 8, 1, 576, 512)
    v = k[..., :512]  # a strided view: rows of 576, 512 read
    out, lse = mn.flash_attn_prefill(q, k, v, causal=True, return_lse=True)
    _close(out, lse, *reference_prefill(q, k, v, causal=True, scale=1 / np.sqrt(576)))
    plan = mn.PrefillPlan(q, k, v, causal=True)
    assert plan._layouts[2][1] == plan._layouts[1][1]  # v's strides are k's: no copy


def test_alibi_on_a_described_mask_is_llama_cpps_mask_made_explicit(rng):
    # max_bias with a window and no mask: slope_h * -(p - j) on the visible pairs. The same
    # values as an explicit mask (with ALiBi scaling it by the slopes) give the same output.
    rows, kv, nh = 30, 50, 6
    q, k, v = _qkv(rng, rows, kv, nh, 2, 64, 64)
    described = mn.flash_attn_prefill(q, k, v, window=12, max_bias=8.0)
    p = np.arange(rows)[:, None] + kv - rows
    j = np.arange(kv)[None, :]
    explicit = np.where((j <= p) & (j > p - 12), -(p - j), -np.inf).astype(np.float16)
    assert nmse(mn.flash_attn_prefill(q, k, v, explicit, max_bias=8.0), described) < 1e-12
    ref, _ = reference_prefill(q, k, v, window=12, causal=True, max_bias=8.0, scale=1 / 8)
    assert nmse(described, ref) < 1e-5
    assert np.allclose(alibi_slopes(8, 8.0), 0.5 ** np.arange(1, 9))


def test_sinks_rows_that_see_nothing_and_variable_length(rng):
    q, k, v = _qkv(rng, 40, 64, 4, 2, 128, 128)
    mask = np.zeros((40, 64), np.float16)
    mask[[3, 17]] = -np.inf
    sinks = np.array([0.5, -1.0, 2.0, 4.0], np.float32)
    out, lse = mn.flash_attn_prefill(q, k, v, mask, return_lse=True, sinks=sinks)
    _close(out, lse, *reference_prefill(q, k, v, mask, sinks=sinks, scale=1 / np.sqrt(128)))
    assert (out[[3, 17]].view(np.uint32) == 0).all()
    assert (lse[:, [3, 17]] == sinks[:, None]).all()
    cu_q, cu_k = np.array([0, 9, 9, 40], np.int32), np.array([0, 20, 25, 64], np.int32)
    kw = dict(causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, softcap=5.0, max_bias=1.0)
    out, lse = mn.flash_attn_prefill(q, k, v, return_lse=True, sinks=sinks, **kw)
    _close(out, lse, *reference_prefill(q, k, v, sinks=sinks, scale=1 / np.sqrt(128), **kw))


def test_a_plan_takes_its_sinks_at_each_run(rng):
    q, k, v = _qkv(rng, 20, 30, 2, 1, 96, 96, BF16, batch=2)
    s1, s2 = np.array([0.0, 1.0], np.float32), np.array([3.0, -3.0], np.float32)
    plan = mn.PrefillPlan(mn.ArraySpec.like(q), mn.ArraySpec.like(k), mn.ArraySpec.like(v), causal=True,
                          sinks=mn.ArraySpec((2,), "float32"), return_lse=True)  # fmt: skip
    assert "sinks" in repr(plan)
    for s in (s1, s2):
        out, lse = plan.run(q, k, v, sinks=s)
        _close(out, lse, *reference_prefill(q, k, v, causal=True, sinks=s, scale=1 / np.sqrt(96)))
    with pytest.raises(mn.InvalidArgumentError, match="this plan has attention sinks: pass sinks"):
        plan.run(q, k, v)
    with pytest.raises(mn.InvalidArgumentError, match="this plan has no attention sinks"):
        mn.PrefillPlan(q, k, v).run(q, k, v, sinks=s1)
    # Strided sinks are copied; the result is the same.
    wide = np.repeat(s2, 2)[::2]
    assert np.array_equal(plan.run(q, k, v, sinks=wide)[0], plan.run(q, k, v, sinks=s2)[0])


def test_torch_bf16_kv_and_torch_sinks_in_place(rng):
    torch = import_test_extra("torch")
    q, k, v = _qkv(rng, 25, 33, 4, 4, 112, 112)
    qt, kt, vt = torch.from_numpy(q), torch.from_numpy(k.astype(np.float32)).bfloat16(), torch.from_numpy(v).bfloat16()
    st = torch.tensor([1.0, 0.0, -1.0, 2.0])
    out, lse = mn.flash_attn_prefill(qt, kt, vt, causal=True, return_lse=True, sinks=st, softcap=2.0)
    assert isinstance(out, torch.Tensor) and out.shape == (25, 4, 112)
    kb, vb = kt.float().numpy().astype(BF16), vt.float().numpy().astype(BF16)
    ref = reference_prefill(q, kb, vb, causal=True, sinks=st.numpy(), softcap=2.0, scale=1 / np.sqrt(112))
    _close(out.numpy(), lse.numpy(), *ref)


def test_bad_transforms_head_dims_and_dtypes_are_typed_errors(rng):
    q, k, v = _qkv(rng, 8, 16, 4, 2, 64, 64)
    call = mn.flash_attn_prefill
    cases = [
        (mn.InvalidArgumentError, "softcap must be a finite number >= 0", dict(softcap=float("nan"))),
        (mn.InvalidArgumentError, "softcap must be a finite number >= 0", dict(softcap=-1.0)),
        (mn.ArgumentTypeError, "softcap must be a real number", dict(softcap="50")),
        (mn.InvalidArgumentError, "max_bias must be a finite number >= 0", dict(max_bias=float("inf"))),
        (mn.InvalidArgumentError, "ALiBi needs positions: pass causal=True, a window, or an explicit mask",
         dict(max_bias=8.0)),
        (mn.InvalidArgumentError, r"sinks must have shape \(4,\)", dict(sinks=np.zeros(3, np.float32))),
        (mn.InvalidArgumentError, r"sinks must have shape \(4,\)", dict(sinks=np.zeros((4, 1), np.float32))),
        (mn.UnsupportedDtypeError, "sinks must be float32", dict(sinks=np.zeros(4, np.float64))),
    ]
    for cls, match, kw in cases:
        with pytest.raises(cls, match=match):
            call(q, k, v, **kw)
    with pytest.raises(mn.InvalidArgumentError, match=r"sinks\[2\] = nan is not finite"):
        call(q, k, v, sinks=np.array([0, 1, np.nan, 2], np.float32), check_finite=True)
    with pytest.raises(mn.UnsupportedDtypeError, match="k is float16 and v is bfloat16"):
        call(q, k, v.astype(BF16))
    q5, k5, v5 = _qkv(rng, 8, 16, 4, 2, 576, 256)
    with pytest.raises(mn.InvalidArgumentError, match=r"unsupported head_dim 576 \(v head dim 256\)"):
        call(q5, k5, v5)
    with pytest.raises(mn.InvalidArgumentError, match=r"unsupported head_dim 576 \(v head dim 576\)"):
        call(q5, k5, k5)
    with pytest.raises(mn.InvalidArgumentError, match="must match but for the head dim"):
        call(q, k, v[:8])


def test_a_sink_given_to_one_part_of_the_cache_merges_to_the_whole(rng):
    # SPEC 8 with SPEC 10: lse includes the sink, so the part that carries it and the part
    # that does not merge to the whole cache with the sink.
    q, k, v = _qkv(rng, 24, 90, 4, 2, 64, 64)
    sinks = np.array([1.0, -2.0, 0.5, 3.0], np.float32)
    whole, whole_lse = mn.flash_attn_prefill(q, k, v, return_lse=True, sinks=sinks)
    a = mn.flash_attn_prefill(q, k[:50], v[:50], return_lse=True, sinks=sinks)
    b = mn.flash_attn_prefill(q, k[50:], v[50:], return_lse=True)
    out, lse = mn.merge_attention_states(*a, *b)
    # Each part rounds P to half against its own running max: the same to the reference's
    # bar, not to the bit.
    ref, ref_lse = reference_prefill(q, k, v, sinks=sinks, scale=1 / 8)
    _close(whole, whole_lse, ref, ref_lse)
    _close(out, lse, ref, ref_lse)


def test_a_plan_made_on_arrays_runs_and_encodes_with_its_planned_sinks(rng):
    q, k, v = _qkv(rng, 20, 30, 4, 2, 64, 64)
    s = np.array([1.0, 2.0, -1.0, 0.0], np.float32)
    plan = mn.PrefillPlan(q, k, v, causal=True, sinks=s, softcap=2.0)
    ref, _ = reference_prefill(q, k, v, causal=True, sinks=s, softcap=2.0, scale=1 / 8)
    assert nmse(plan.run(), ref) < 1e-5
    with plan.device.encoder() as enc:
        plan.encode(enc)
    assert np.array_equal(plan.encoded_result(), plan.run())


@pytest.mark.parametrize("offset", [-5, 7, 30])
def test_alibi_distance_and_sinks_with_an_explicit_offset(rng, offset):
    # The described mask's ALiBi distance is to the query's position r + offset.
    q, k, v = _qkv(rng, 20, 60, 4, 2, 64, 64)
    s = np.array([1.0, 2.0, -1.0, 0.0], np.float32)
    kw = dict(causal=True, offset=offset, max_bias=8.0)
    out, lse = mn.flash_attn_prefill(q, k, v, return_lse=True, sinks=s, **kw)
    _close(out, lse, *reference_prefill(q, k, v, sinks=s, scale=1 / 8, **kw))
