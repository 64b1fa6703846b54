"""``layout="HND"`` (``[..., heads, seq, head_dim]``, PyTorch SDPA's) on the front door, the
plan and the torch operators: the same kernels read it in place through its strides and
write the output in q's layout, so every result equals the ``"NHD"`` one bit for bit; no
copy is made (the operand copies are made to fail); a mistaken layout gets an error that
names ``layout="HND"``."""

from __future__ import annotations

import numpy as np
import pytest

import mlx_native as mn
from helpers import import_test_extra
from mlx_native.arrays import Operand
from mlx_native.reference import nmse, reference_prefill

torch = import_test_extra("torch")


def _nhd(rng, b, s, h, hk, d, kv_len=None):
    kv_len = s if kv_len is None else kv_len
    shape = (b,) if b else ()
    q = rng.uniform(-1, 1, shape + (s, h, d)).astype(np.float32)
    k = rng.uniform(-1, 1, shape + (kv_len, hk, d)).astype(np.float16)
    v = rng.uniform(-1, 1, shape + (kv_len, hk, d)).astype(np.float16)
    return q, k, v


def _to_hnd(x):
    """The same values in ``[..., heads, seq, head_dim]``, contiguous (as SDPA's tensors are)."""
    return np.ascontiguousarray(np.swapaxes(x, -3, -2))


@pytest.fixture
def no_copies(monkeypatch):
    """Fail the test if the library copies an operand (a layout change in Python would)."""

    def refuse(self, *a, **k):
        raise AssertionError(f"an operand {self.shape} with strides {self.strides} was copied")

    monkeypatch.setattr(Operand, "made_contiguous", refuse)
    monkeypatch.setattr(Operand, "copied", refuse)


CASES = [
    # (batch or 0 for 3-D, rows, kv_len, heads, kv_heads, head_dim, description)
    (2, 70, 70, 8, 2, 64, dict(causal=True)),
    (1, 33, 97, 4, 1, 128, dict(causal=True, window=20)),
    (0, 50, 50, 6, 3, 96, dict()),
    (3, 17, 40, 4, 4, 256, dict(causal=True, offset=5)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}-r{c[1]}-kv{c[2]}-h{c[3]}/{c[4]}-d{c[5]}-{sorted(c[6])}")
def test_numpy_hnd_equals_nhd_bit_for_bit(rng, no_copies, case):
    b, s, kv, h, hk, d, desc = case
    q, k, v = _nhd(rng, b, s, h, hk, d, kv)
    out, lse = mn.flash_attn_prefill(q, k, v, return_lse=True, **desc)
    oh, lh = mn.flash_attn_prefill(_to_hnd(q), _to_hnd(k), _to_hnd(v), return_lse=True, layout="HND", **desc)
    assert oh.shape == _to_hnd(out).shape and oh.flags.c_contiguous, "the output is in q's layout, contiguous"
    assert np.array_equal(np.swapaxes(oh, -3, -2), out)
    assert np.array_equal(lh, lse), "lse is [batch, heads, rows] in either layout"
    # A strided HND view of NHD memory (the kernels take any strides with a contiguous last axis).
    ov = mn.flash_attn_prefill(*(np.swapaxes(x, -3, -2) for x in (q, k, v)), layout="HND", **desc)
    assert np.array_equal(ov, oh)


def test_hnd_matches_sdpa_in_float64(rng):
    # The meaning, not only the agreement: HND in, SDPA's own layout out.
    q, k, v = (torch.from_numpy(_to_hnd(x)) for x in _nhd(rng, 2, 45, 8, 2, 64))
    out = mn.flash_attn_prefill(q, k, v, causal=True, layout="HND")
    kk, vv = (x.double().repeat_interleave(4, dim=1) for x in (k, v))
    qh = (q * 0.125).half().double() / 0.125  # SPEC 2: half(scale * q)
    ref = torch.nn.functional.scaled_dot_product_attention(qh, kk, vv, is_causal=True)
    assert nmse(out.numpy(), ref.numpy()) < 1e-5


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_torch_hnd_equals_nhd_bit_for_bit(rng, no_copies, dtype):
    q, k, v = (torch.from_numpy(x) for x in _nhd(rng, 2, 64, 8, 2, 128, 80))
    q = q.to(getattr(torch, dtype))
    if dtype == "bfloat16":
        k, v = k.bfloat16(), v.bfloat16()
    out, lse = mn.flash_attn_prefill(q, k, v, causal=True, return_lse=True)
    qh, kh, vh = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    oh, lh = mn.flash_attn_prefill(qh, kh, vh, causal=True, return_lse=True, layout="HND")
    assert oh.shape == (2, 8, 64, 128) and oh.is_contiguous() and oh.dtype == q.dtype
    assert torch.equal(oh.transpose(1, 2), out) and torch.equal(lh, lse)
    # The operator itself, called directly, takes the keyword too.
    direct = torch.ops.mlx_native.flash_attn_prefill(qh, kh, vh, causal=True, layout="HND")
    assert torch.equal(direct, oh)


def test_torch_compile_hnd_fullgraph(rng):
    q, k, v = (torch.from_numpy(_to_hnd(x)) for x in _nhd(rng, 1, 40, 4, 2, 64))

    def f(q, k, v):
        out, lse = mn.flash_attn_prefill(q, k, v, causal=True, return_lse=True, layout="HND")
        return out * 2, lse

    out, lse = torch.compile(f, fullgraph=True, backend="eager")(q, k, v)
    eo, el = mn.flash_attn_prefill(q, k, v, causal=True, return_lse=True, layout="HND")
    assert out.shape == (1, 4, 40, 64) and lse.shape == (1, 4, 40)
    assert torch.equal(out, eo * 2) and torch.equal(lse, el)


def test_plan_hnd_from_specs_runs_on_arrays(rng, no_copies):
    q, k, v = (_to_hnd(x) for x in _nhd(rng, 2, 30, 4, 2, 64, 50))
    specs = [mn.ArraySpec.like(x) for x in (q, k, v)]
    plan = mn.PrefillPlan(*specs, causal=True, return_lse=True, layout="HND")
    assert "layout HND" in repr(plan)
    out = np.empty((2, 4, 30, 64), np.float32)
    lse = np.empty((2, 4, 30), np.float32)
    plan.run(q, k, v, out=out, lse=lse)
    eo, el = mn.flash_attn_prefill(q, k, v, causal=True, return_lse=True, layout="HND")
    assert np.array_equal(out, eo) and np.array_equal(lse, el)
    # An NHD array of the same shape is another layout: the plan says so.
    with pytest.raises(mn.InvalidArgumentError, match="this plan was made for"):
        plan.run(np.ascontiguousarray(np.swapaxes(q, 1, 2)), k, v)


def test_varlen_hnd(rng, no_copies):
    q, k, v = _nhd(rng, 0, 60, 4, 2, 64)
    cu = np.array([0, 25, 60], np.int32)
    out, lse = mn.flash_attn_prefill(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, return_lse=True)
    oh, lh = mn.flash_attn_prefill(
        _to_hnd(q), _to_hnd(k), _to_hnd(v), causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, return_lse=True, layout="HND"
    )
    assert oh.shape == (4, 60, 64)
    assert np.array_equal(np.swapaxes(oh, 0, 1), out) and np.array_equal(lh, lse)
    ref = reference_prefill(q, k, v, None, causal=True, scale=0.125, cu_seqlens_q=cu, cu_seqlens_k=cu)[0]
    assert nmse(np.swapaxes(oh, 0, 1), ref) < 1e-5


def test_a_noncontiguous_last_axis_is_copied_in_the_callers_layout(rng):
    # Not the no-copy case: the last axis is strided, so the array is copied first (as in
    # "NHD") and then read as HND: still the same result.
    q, k, v = (_to_hnd(x) for x in _nhd(rng, 1, 20, 2, 2, 64))
    wide = np.zeros(q.shape[:-1] + (128,), np.float32)
    wide[..., ::2] = q
    out = mn.flash_attn_prefill(wide[..., ::2], k, v, layout="HND")
    assert np.array_equal(out, mn.flash_attn_prefill(q, k, v, layout="HND"))


def test_sdpa_layout_read_as_nhd_points_to_hnd(rng):
    # SDPA's [B, H, S, D] with GQA passed without layout=: the causal cache looks shorter.
    q, k, v = (torch.from_numpy(_to_hnd(x)) for x in _nhd(rng, 2, 128, 8, 2, 64))
    with pytest.raises(mn.InvalidArgumentError, match='layout="HND"'):
        mn.flash_attn_prefill(q, k, v, causal=True)
    # Sequence lengths read as head counts that do not divide: the same pointer.
    q, k, v = _nhd(rng, 1, 7, 4, 2, 64, kv_len=9)
    with pytest.raises(mn.InvalidArgumentError, match='not a multiple.*layout="HND"'):
        mn.flash_attn_prefill(_to_hnd(q), _to_hnd(k), _to_hnd(v))


@pytest.mark.parametrize(
    "bad, error", [("BSHD", mn.InvalidArgumentError), ("hnd", mn.InvalidArgumentError), (1, mn.ArgumentTypeError)]
)
def test_layout_values_are_checked(rng, bad, error):
    q, k, v = _nhd(rng, 1, 8, 2, 2, 64)
    for call in (
        lambda: mn.flash_attn_prefill(q, k, v, layout=bad),
        lambda: mn.PrefillPlan(q, k, v, layout=bad),
        lambda: mn.flash_attn_prefill(*(torch.from_numpy(x) for x in (q, k, v)), layout=bad),
    ):
        with pytest.raises(error, match="layout"):
            call()
