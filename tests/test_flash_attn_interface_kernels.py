"""The interface's cases that need the kernels' new features (issue 28, built beside this in
another branch): two-sided ``window_size`` without causal, ``alibi_slopes`` ``[H]`` and
``[B, H]``, float32 K/V read natively. On a build without them these fail (the front door
refuses the tuple window and has no ``alibi_slopes``); they pass once both are merged. The
rule is FlashAttention's test rule (``fa_reference.within_rule``)."""

from __future__ import annotations

import pytest

import mlx_native as mn
from fa_reference import attention, within_rule
from helpers import import_test_extra

torch = import_test_extra("torch")
from mlx_native import flash_attn_interface as fai  # noqa: E402

MHA = {"mha": 6, "gqa": 2, "mqa": 1}


def _qkv(b, sq, sk, h, hk, d, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, sq, h, d, generator=g).to(dtype), torch.randn(b, sk, hk, d, generator=g).to(dtype),
            torch.randn(b, sk, hk, d, generator=g).to(dtype))  # fmt: skip


def _check(q, k, v, out, **kw):
    ref, _ = attention(q, k, v, upcast=True, **kw)
    pt, _ = attention(q, k, v, upcast=False, **kw)
    ok, ours, theirs = within_rule(out, ref, pt)
    assert ok, f"our max error {ours:.3g} > 2 x PyTorch's {theirs:.3g} + 1e-5"


@pytest.mark.parametrize("mha_type", list(MHA))
@pytest.mark.parametrize("d", [40, 64, 128, 256])
@pytest.mark.parametrize("seqlens", [(113, 203), (203, 113), (1, 64), (128, 128)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("window", [(10, 5), (0, 0), (-1, 7), (30, -1)])
def test_two_sided_windows(window, seqlens, d, mha_type):
    sq, sk = seqlens
    q, k, v = _qkv(2, sq, sk, 6, MHA[mha_type], d, seed=d + sq)
    out = fai.flash_attn_func(q, k, v, causal=False, window_size=window)
    _check(q, k, v, out, causal=False, window_size=window)


def test_two_sided_window_on_the_front_door_is_fas():
    q, k, v = _qkv(1, 50, 80, 4, 2, 64)
    out = mn.flash_attn_prefill(q, k, v, window=(6, 3))
    _check(q, k, v, out, causal=False, window_size=(6, 3))
    # window=w stays FlashAttention's (w - 1, 0).
    assert torch.equal(mn.flash_attn_prefill(q, k, v, window=7), mn.flash_attn_prefill(q, k, v, window=(6, 0), causal=True))


@pytest.mark.parametrize("shape", ["H", "BH"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [59, 64, 128])
def test_alibi_slopes(d, causal, shape):
    q, k, v = _qkv(2, 90, 120, 6, 2, d, seed=d)
    g = torch.Generator().manual_seed(1)
    slopes = torch.rand(6 if shape == "H" else (2, 6), generator=g, dtype=torch.float32) * 0.3
    out = fai.flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes)
    _check(q, k, v, out, causal=causal, alibi_slopes=slopes)


@pytest.mark.parametrize("causal", [False, True])
def test_float32_kv_are_read_natively(causal):
    q, k, v = _qkv(2, 64, 96, 4, 2, 64, dtype=torch.float32)
    out = fai.flash_attn_func(q, k, v, causal=causal)
    ref, _ = attention(q, k, v, causal=causal)
    # float32 K/V kept as they are: closer than the float16 conversion would be.
    conv = fai.flash_attn_func(q, k.half(), v.half(), causal=causal)
    assert (out.double() - ref).abs().max() <= (conv.double() - ref).abs().max()
