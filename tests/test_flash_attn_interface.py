"""``mlx_native.flash_attn_interface``: FlashAttention 2's forward functions on our kernels,
tested the way FlashAttention's own forward tests test its kernels (our code, the same kinds
of cases): batch sizes, seqlen pairs with seqlen_q != seqlen_k and 1, head dims 32 to 256
(those without a kernel run zero-padded), MHA/GQA/MQA, causal (bottom-right aligned),
causal local windows, softcap, varlen with random lengths, the packed forms, lse. The rule
is FlashAttention's: our output's largest distance from a float64 reference is at most
twice PyTorch's in the same low precision, plus 1e-5 (``fa_reference.within_rule``).

Out of this file's scope, in ``test_flash_attn_interface_kernels.py`` (they need the
kernels' two-sided windows, ALiBi slopes and float32 K/V): two-sided ``window_size``
without causal, ``alibi_slopes``. Dropout is not computed (inference only): asserted to be
refused, not skipped."""

from __future__ import annotations

import math

import numpy as np
import pytest

import mlx_native as mn
from fa_reference import attention, within_rule
from helpers import import_test_extra, lse_tolerance
from mlx_native.arrays import Operand
from mlx_native.head_dims import KERNEL_HEAD_DIMS

torch = import_test_extra("torch")
from mlx_native import flash_attn_interface as fai  # noqa: E402

HEAD_DIMS = [32, 40, 59, 64, 96, 111, 128, 160, 192, 224, 256]
SEQLENS = [(1, 147), (113, 203), (128, 217), (108, 256), (256, 128), (239, 1), (64, 64), (113, 113)]
DTYPES = [torch.float16, torch.bfloat16]
MHA = {"mha": 6, "gqa": 2, "mqa": 1}  # kv heads of 6 query heads
#: Where the output tests run: the CPU, and the GPU where there is one (the reference is
#: computed on the CPU from the same values either way).
DEVICES = ["cpu"] + (["cuda"] if "cuda" in mn.backends() and torch.cuda.is_available() else [])


def _on(dev, *xs):
    return tuple(x.to(dev) for x in xs)


def _lse_tol(dev, dtype, d) -> float:
    return lse_tolerance(dev == "cuda" and dtype == torch.bfloat16, d)


def _qkv(b, sq, sk, h, hk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g).to(dtype)
    k = torch.randn(b, sk, hk, d, generator=g).to(dtype)
    v = torch.randn(b, sk, hk, d, generator=g).to(dtype)
    return q, k, v


def _check(q, k, v, out, **kw):
    ref, _ = attention(q, k, v, upcast=True, **kw)
    pt, _ = attention(q, k, v, upcast=False, **kw)
    ok, ours, theirs = within_rule(out, ref, pt)
    assert ok, f"our max error {ours:.3g} > 2 x PyTorch's {theirs:.3g} + 1e-5"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dev", DEVICES)
def test_flash_attn_output(seqlens, d, causal, dtype, dev):
    sq, sk = seqlens
    q, k, v = _qkv(2, sq, sk, 6, 2, d, dtype, seed=sq * 1000 + d)
    out = fai.flash_attn_func(*_on(dev, q, k, v), causal=causal)
    assert out.shape == q.shape and out.dtype == dtype and out.device.type == dev
    out = out.cpu()
    _check(q, k, v, out, causal=causal)


@pytest.mark.parametrize("mha_type", list(MHA))
@pytest.mark.parametrize("local", [False, True])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("d", [40, 64, 128])
@pytest.mark.parametrize("seqlens", [(113, 203), (203, 113), (1, 64), (128, 128)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dev", DEVICES)
def test_flash_attn_mha_local_softcap(seqlens, d, softcap, local, mha_type, dev):
    sq, sk = seqlens
    q, k, v = _qkv(3, sq, sk, 6, MHA[mha_type], d, torch.float16, seed=d + sq)
    # FlashAttention's local test draws a window at random; with causal the right side is 0,
    # which is the causal windows our kernels compute today (two-sided: the kernels file).
    g = torch.Generator().manual_seed(sk + d)
    window = tuple(int(x) for x in torch.randint(0, sk, (2,), generator=g)) if local else (-1, -1)
    causal = local or sq == sk
    out = fai.flash_attn_func(*_on(dev, q, k, v), causal=causal, window_size=window, softcap=softcap).cpu()
    _check(q, k, v, out, causal=causal, window_size=window, softcap=softcap)


@pytest.mark.parametrize("mha_type", list(MHA))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [59, 64, 128])
def test_packed_forms_equal_the_unpacked_bit_for_bit(monkeypatch, d, causal, mha_type):
    hk = MHA[mha_type]
    g = torch.Generator().manual_seed(d)
    kv = torch.randn(2, 90, 2, hk, d, generator=g).half()
    q = torch.randn(2, 70, 6, d, generator=g).half()
    want = fai.flash_attn_func(q, kv[:, :, 0].contiguous(), kv[:, :, 1].contiguous(), causal=causal)

    def refuse(self, *a, **k):
        raise AssertionError("an operand was copied")

    if d in KERNEL_HEAD_DIMS.get("float16", ()):  # padded dims copy by design
        monkeypatch.setattr(Operand, "made_contiguous", refuse)
        monkeypatch.setattr(Operand, "copied", refuse)
    assert torch.equal(fai.flash_attn_kvpacked_func(q, kv, causal=causal), want)
    if hk == 6:
        qkv = torch.randn(2, 90, 3, 6, d, generator=g).half()
        want = fai.flash_attn_func(*(qkv[:, :, i].contiguous() for i in range(3)), causal=causal)
        assert torch.equal(fai.flash_attn_qkvpacked_func(qkv, causal=causal), want)


def test_causal_is_bottom_right_aligned_as_flash_attn():
    # Query i sees keys j <= i + seqlen_k - seqlen_q: with seqlen_k < seqlen_q the first
    # rows see nothing (zeros, lse +inf as in FlashAttention).
    q, k, v = _qkv(1, 10, 4, 2, 2, 64, torch.float16)
    out, lse, probs = fai.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert probs is None
    assert torch.all(out[:, :6] == 0) and torch.all(lse[:, :, :6] == math.inf)
    assert torch.all(out[:, 6:].abs().sum(-1) > 0)
    _check(q, k, v, out, causal=True)
    # seqlen_q = 1 against a cache: the one query is the cache's last position and sees all.
    q1 = q[:, :1]
    out1 = fai.flash_attn_func(q1, k, v, causal=True)
    assert torch.equal(out1, fai.flash_attn_func(q1, k, v, causal=False))


@pytest.mark.parametrize("d", [32, 64, 111, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_return_attn_probs_gives_lse(d, causal):
    q, k, v = _qkv(2, 77, 130, 4, 2, d, torch.float16, seed=d)
    out, lse, none = fai.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, deterministic=True)
    assert none is None and lse.shape == (2, 4, 77) and lse.dtype == torch.float32
    _, ref_lse = attention(q, k, v, causal=causal, upcast=True)
    assert (lse.double() - ref_lse).abs().max().item() < 2e-3
    assert torch.equal(out, fai.flash_attn_func(q, k, v, causal=causal))


def test_softmax_scale_is_the_callers_also_when_padded():
    for d in (59, 64):  # padded and not: the scale stays 1/sqrt(59), or the given one
        q, k, v = _qkv(1, 50, 50, 2, 2, d, torch.float16)
        _check(q, k, v, fai.flash_attn_func(q, k, v), scale=None)
        _check(q, k, v, fai.flash_attn_func(q, k, v, softmax_scale=0.3), scale=0.3)


def _random_lengths(n, seqlen, g):
    # FlashAttention's "random" padding: each length from max(1, seqlen - 20) to seqlen.
    return [int(x) for x in torch.randint(max(1, seqlen - 20), seqlen + 1, (n,), generator=g)]


def _cu(lengths):
    return torch.tensor([0] + list(np.cumsum(lengths)), dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mha_type", list(MHA))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [32, 59, 128, 256])
@pytest.mark.parametrize("seqlens", [(1, 147), (113, 203), (256, 128), (108, 108)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dev", DEVICES)
def test_flash_attn_varlen_output(seqlens, d, causal, mha_type, dtype, dev):
    sq, sk = seqlens
    g = torch.Generator().manual_seed(sq + sk + d)
    lq, lk = _random_lengths(4, sq, g), _random_lengths(4, sk, g)
    h, hk = 6, MHA[mha_type]
    q = torch.randn(sum(lq), h, d, generator=g).to(dtype)
    k = torch.randn(sum(lk), hk, d, generator=g).to(dtype)
    v = torch.randn(sum(lk), hk, d, generator=g).to(dtype)
    cq, ck = _cu(lq), _cu(lk)
    out, lse, _ = fai.flash_attn_varlen_func(
        *_on(dev, q, k, v, cq, ck), max(lq), max(lk), causal=causal, return_attn_probs=True
    )
    assert out.shape == q.shape and lse.shape == (h, sum(lq)) and out.device.type == dev
    out, lse = out.cpu(), lse.cpu()
    for b in range(4):
        a, e, ka, ke = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        qs, ks, vs = q[a:e][None], k[ka:ke][None], v[ka:ke][None]
        _check(qs, ks, vs, out[a:e][None], causal=causal)
        _, ref_lse = attention(qs, ks, vs, causal=causal)
        fin = torch.isfinite(ref_lse[0])
        assert torch.equal(torch.isinf(lse[:, a:e]), ~fin)
        if fin.any():
            off = (lse[:, a:e][fin].double() - ref_lse[0][fin]).abs().max().item()
            assert off < _lse_tol(dev, dtype, d), f"lse off by {off:.3e}"


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_packed_forms(causal):
    g = torch.Generator().manual_seed(5)
    lens = [30, 1, 57]
    cu = _cu(lens)
    qkv = torch.randn(sum(lens), 3, 4, 64, generator=g).half()
    want = fai.flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, 57, 57, causal=causal)
    assert torch.equal(fai.flash_attn_varlen_qkvpacked_func(qkv, cu, 57, causal=causal), want)
    q = torch.randn(sum(lens), 4, 64, generator=g).half()
    kv = torch.randn(sum(lens), 2, 2, 64, generator=g).half()
    want = fai.flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu, cu, 57, 57, causal=causal)
    assert torch.equal(fai.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 57, 57, causal=causal), want)


# ------------------------------------------------------------------ what is refused


@pytest.mark.parametrize("dropout_p", [0.17, 1.0])
def test_dropout_is_refused_inference_only(dropout_p):
    q, k, v = _qkv(1, 8, 8, 2, 2, 64, torch.float16)
    with pytest.raises(mn.UnsupportedFeatureError, match="inference only"):
        fai.flash_attn_func(q, k, v, dropout_p=dropout_p)
    assert torch.equal(fai.flash_attn_func(q, k, v, dropout_p=0.0), fai.flash_attn_func(q, k, v))


def test_bad_window_sizes_and_packs_are_typed_errors():
    q, k, v = _qkv(1, 8, 8, 2, 2, 64, torch.float16)
    with pytest.raises(mn.ArgumentTypeError, match="window_size"):
        fai.flash_attn_func(q, k, v, window_size=4)
    with pytest.raises(mn.InvalidArgumentError, match="window_size"):
        fai.flash_attn_func(q, k, v, window_size=(-2, 0))
    with pytest.raises(mn.InvalidArgumentError, match=r"qkv must be \[batch, seqlen, 3"):
        fai.flash_attn_qkvpacked_func(q)
    # block_table takes paged caches [num_blocks, block_size, kv_heads, head_dim] (tests/test_paged.py).
    with pytest.raises(mn.InvalidArgumentError, match="paged cache"):
        fai.flash_attn_varlen_func(q[0], k[0], v[0], _cu([8]), _cu([8]), 8, 8, block_table=torch.zeros(1, 1))


def test_forward_under_grad_mode_and_no_backward():
    q, k, v = _qkv(1, 16, 16, 2, 2, 64, torch.float16)
    q.requires_grad_(True)
    out = fai.flash_attn_func(q, k, v, causal=True)
    assert out.requires_grad
    with pytest.raises(mn.UnsupportedFeatureError, match="backward"):
        out.float().sum().backward()


def test_float32_kv_follow_the_stated_rule():
    # float32 K/V are taken (module docstring; read as they are on the CPU: the kernels' test).
    q, k, v = _qkv(1, 20, 20, 2, 2, 64, torch.float32)
    out = fai.flash_attn_func(q, k, v, causal=True)
    ref, _ = attention(q, k, v, causal=True)
    assert (out.double() - ref).abs().max().item() < 2e-3


def test_numpy_arrays_go_through_too():
    # Not FlashAttention's (torch only), but the front door's: numpy in, numpy out, the same values.
    q, k, v = _qkv(1, 10, 4, 2, 2, 59, torch.float16)
    out, lse, _ = fai.flash_attn_func(q.numpy(), k.numpy(), v.numpy(), causal=True, return_attn_probs=True)
    want, want_lse, _ = fai.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert isinstance(out, np.ndarray) and np.array_equal(out, want.numpy()) and np.array_equal(lse, want_lse.numpy())
