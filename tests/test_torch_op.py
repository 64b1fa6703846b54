"""The front door as PyTorch operators (``torch.ops.mlx_native.flash_attn_prefill`` and
``flash_attn_prefill_lse``): the same results as the array call, bit for bit; the shapes
of the fake implementation under FakeTensorMode and opcheck; ``torch.compile(fullgraph=True)``
of a function that calls ``mn.flash_attn_prefill``; no backward; torch stays optional.
torch is a test extra: without it this module fails, not skips. The CUDA tests need a GPU
(the lead runs them on an H200: ``python -m pytest tests/test_torch_op.py``)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import mlx_native as mn
from helpers import import_test_extra, ops_seen
from mlx_native import attention
from mlx_native.reference import nmse, reference_prefill

torch = import_test_extra("torch")
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

HAS_CUDA = "cuda" in mn.backends() and torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU, its driver and a CUDA build of torch")
DEVICES = ["cpu", pytest.param("cuda", marks=cuda_only)]


def _qkv(rng, q_shape, kv_shape, dtype=torch.float32, device="cpu"):
    def t(shape, dt):
        return torch.from_numpy(rng.uniform(-1, 1, shape).astype(np.float32)).to(device=device, dtype=dt)

    return t(q_shape, dtype), t(kv_shape, torch.float16), t(kv_shape, torch.float16)


def _op():
    import mlx_native.torch_ops  # noqa: F401  (registers the operators)

    return torch.ops.mlx_native


# ------------------------------------------------------------------ the operators on the CPU (and CUDA)


@pytest.mark.parametrize("device", DEVICES)
def test_the_operators_give_the_array_calls_bits(rng, device):
    ops = _op()
    q, k, v = _qkv(rng, (2, 37, 4, 256), (2, 50, 2, 256), device=device)
    m = torch.rand(2, 1, 37, 50, device=device) < 0.8
    cases = [
        dict(causal=True, window=7),
        dict(mask=m, scale=0.3, out_dtype=torch.bfloat16),
        dict(causal=True, out_dtype=torch.float16),
    ]
    for kw in cases:
        mask = kw.pop("mask", None)
        want = attention.flash_attn_prefill(q, k, v, mask, **kw)
        got = ops.flash_attn_prefill(q, k, v, mask, **kw)
        assert got.dtype == want.dtype and got.device == q.device and torch.equal(got, want)
        o, lse = ops.flash_attn_prefill_lse(q, k, v, mask, **kw)
        wo, wl = attention.flash_attn_prefill(q, k, v, mask, return_lse=True, **kw)
        assert torch.equal(o, wo) and torch.equal(lse, wl) and lse.shape == (2, 4, 37)


def test_variable_length_through_the_operator(rng):
    ops = _op()
    q, k, v = _qkv(rng, (30, 4, 512), (45, 1, 512))
    cq = torch.tensor([0, 10, 10, 30], dtype=torch.int32)
    ck = torch.tensor([0, 20, 25, 45], dtype=torch.int32)
    o, lse = ops.flash_attn_prefill_lse(q, k, v, None, causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck)
    ref, _ = reference_prefill(q.numpy(), k.numpy(), v.numpy(), None, causal=True, cu_seqlens_q=cq.numpy(),
                               cu_seqlens_k=ck.numpy(), scale=512**-0.5)  # fmt: skip
    assert o.shape == (30, 4, 512) and lse.shape == (4, 30)
    assert nmse(o.numpy(), ref) < 1e-5


def test_flash_attn_prefill_on_tensors_goes_through_the_operator(rng):
    q, k, v = _qkv(rng, (20, 2, 256), (20, 1, 256))
    with ops_seen() as mode:
        out, lse = mn.flash_attn_prefill(q, k, v, causal=True, return_lse=True)
    assert "mlx_native.flash_attn_prefill_lse.default" in mode.seen
    with ops_seen() as mode:
        mn.flash_attn_prefill(q, k, v, causal=True)
    assert mode.seen[0] == "mlx_native.flash_attn_prefill.default"
    # Other arrays never meet torch: numpy in, the array call, numpy out.
    assert isinstance(mn.flash_attn_prefill(q.numpy(), k.numpy(), v.numpy(), causal=True), np.ndarray)


def test_a_mix_of_torch_and_numpy_takes_the_array_call(rng):
    q, k, v = _qkv(rng, (20, 2, 256), (30, 1, 256))
    host_mask = np.zeros((20, 30), np.float32)
    with ops_seen() as mode:
        out = mn.flash_attn_prefill(q, k, v, host_mask)
    assert not any(s.startswith("mlx_native.") for s in mode.seen)
    assert torch.equal(out, attention.flash_attn_prefill(q, k, v, torch.zeros(20, 30)))


# ------------------------------------------------------------------ fake tensors, opcheck, compile


@pytest.mark.parametrize(
    "q_shape, kv_shape, kw, shapes",
    [
        ((2, 7, 4, 256), (2, 9, 2, 256), dict(return_lse=True, out_dtype=torch.bfloat16),
         [((2, 7, 4, 256), torch.bfloat16), ((2, 4, 7), torch.float32)]),
        ((7, 4, 512), (9, 1, 512), dict(causal=True), [((7, 4, 512), torch.float32)]),
        ((7, 4, 256), (9, 2, 256), dict(return_lse=True, out_dtype="float16"),
         [((7, 4, 256), torch.float16), ((4, 7), torch.float32)]),
    ],
)  # fmt: skip
def test_fake_tensors_get_the_output_shapes(q_shape, kv_shape, kw, shapes):
    with FakeTensorMode():
        q = torch.empty(q_shape)
        k = torch.empty(kv_shape, dtype=torch.float16)
        res = mn.flash_attn_prefill(q, k, k, **kw)
        res = res if isinstance(res, tuple) else (res,)
        assert [(tuple(r.shape), r.dtype) for r in res] == shapes
        assert all(r.is_contiguous() for r in res)


def test_fake_tensors_get_v_s_head_dim():
    # MLA: q/k 576, v 512 (a view of k's first 512 columns); the output has v's head dim.
    with FakeTensorMode():
        q = torch.empty(7, 4, 576)
        k = torch.empty(9, 1, 576, dtype=torch.float16)
        out, lse = mn.flash_attn_prefill(q, k, k[..., :512], causal=True, return_lse=True)
        assert (tuple(out.shape), tuple(lse.shape)) == ((7, 4, 512), (4, 7))


def test_the_fake_refuses_a_rank_it_cannot_shape():
    with FakeTensorMode():
        q = torch.empty(7, 4, 4, 4, 256)
        with pytest.raises(mn.InvalidArgumentError, match="q must be 3-D"):
            mn.flash_attn_prefill(q, q.half(), q.half())


def test_opcheck(rng):
    ops = _op()
    q, k, v = _qkv(rng, (2, 9, 4, 256), (2, 11, 2, 256))
    m = torch.rand(2, 1, 9, 11) < 0.7
    cq, ck = torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([0, 5, 11], dtype=torch.int32)
    q576, k576, _ = _qkv(rng, (9, 4, 576), (11, 1, 576))
    for op, args, kw in [
        (ops.flash_attn_prefill.default, (q, k, v), dict(causal=True, window=4)),
        (ops.flash_attn_prefill_lse.default, (q, k, v, m), dict(out_dtype=torch.bfloat16)),
        (ops.flash_attn_prefill.default, (q[0], k[0], v[0]), dict(causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck)),
        (ops.flash_attn_prefill_lse.default, (q576, k576, k576[..., :512]), dict(causal=True)),
    ]:
        result = torch.library.opcheck(op, args, kw)
        assert set(result.values()) == {"SUCCESS"}, result


def _attention_block(q4, k4, v4, m):
    # [B, H, S, D] in, as a model holds them: views into the front door's layout.
    out, lse = mn.flash_attn_prefill(q4.transpose(1, 2) * 2, k4.transpose(1, 2), v4.transpose(1, 2), m, causal=True,
                                     window=5, scale=0.5, return_lse=True, out_dtype=torch.float16)  # fmt: skip
    return out.float().sum(-1) + 1, lse


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_traces_the_front_door(rng, backend):
    q4, k4, v4 = _qkv(rng, (2, 4, 19, 256), (2, 2, 23, 256))
    m = torch.rand(2, 1, 19, 23) < 0.9
    torch._dynamo.reset()
    compiled = torch.compile(_attention_block, fullgraph=True, backend=backend)
    got, got_lse = compiled(q4, k4, v4, m)
    want, want_lse = _attention_block(q4, k4, v4, m)
    assert torch.allclose(got, want, rtol=0, atol=1e-4) and torch.equal(got_lse, want_lse)
    explain = torch._dynamo.explain(_attention_block)(q4, k4, v4, m)
    assert explain.graph_break_count == 0 and explain.graph_count == 1


def test_a_compiled_call_runs_under_grad_and_refuses_a_backward(rng):
    q, k, v = _qkv(rng, (10, 2, 256), (10, 1, 256))
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: mn.flash_attn_prefill(q, k, v, causal=True), fullgraph=True,
                             backend="aot_eager")  # fmt: skip
    out = compiled(q.requires_grad_(True), k, v)
    assert torch.equal(out.detach(), mn.flash_attn_prefill(q.detach(), k, v, causal=True))
    with pytest.raises(mn.UnsupportedFeatureError, match="backward pass"):
        out.sum().backward()


# ------------------------------------------------------------------ refusals


def test_requires_grad_runs_forward_and_refuses_backward(rng):
    ops = _op()
    q, k, v = _qkv(rng, (10, 2, 256), (10, 1, 256))
    k.requires_grad_(True)
    want = mn.flash_attn_prefill(q, k.detach(), v)
    out = mn.flash_attn_prefill(q, k, v)  # the operator with the autograd formula
    assert out.requires_grad and torch.equal(out.detach(), want)
    with pytest.raises(mn.UnsupportedFeatureError, match="backward pass"):
        out.sum().backward()
    # The plain operator has no formula: called directly under grad mode it refuses by name.
    with pytest.raises(mn.InvalidArgumentError, match="requires grad.*no backward"):
        ops.flash_attn_prefill(q, k, v)
    with torch.no_grad():  # nothing records a graph: the leaf is read as it is
        assert torch.equal(mn.flash_attn_prefill(q, k, v), want)
        assert torch.equal(ops.flash_attn_prefill(q, k, v), want)


def test_bad_arguments_give_the_librarys_errors_not_the_schemas(rng):
    q, k, v = _qkv(rng, (10, 2, 256), (10, 1, 256))
    with pytest.raises(mn.ArgumentTypeError, match="window must be an integer"):
        mn.flash_attn_prefill(q, k, v, window=2.0)
    with pytest.raises(mn.ArgumentTypeError, match="causal must be True or False"):
        mn.flash_attn_prefill(q, k, v, causal=1)
    with pytest.raises(mn.ArgumentTypeError, match="scale must be a real number"):
        mn.flash_attn_prefill(q, k, v, scale="1")
    with pytest.raises(mn.UnsupportedDtypeError, match="out_dtype must be one of"):
        mn.flash_attn_prefill(q, k, v, out_dtype=torch.int32)
    with pytest.raises(mn.ArgumentTypeError, match="softcap must be a real number"):
        mn.flash_attn_prefill(q, k, v, softcap="50")
    with pytest.raises(mn.InvalidArgumentError, match="device 'gpu' is not a device name"):
        mn.flash_attn_prefill(q, k, v, device="gpu")
    # Numbers of numpy's types are taken, as by the array call.
    out = mn.flash_attn_prefill(q, k, v, causal=np.bool_(True), window=np.int64(3), scale=np.float32(0.5))
    assert torch.equal(out, attention.flash_attn_prefill(q, k, v, causal=True, window=3, scale=0.5))


@pytest.mark.parametrize("name", ["softcap", "max_bias", "sinks", "offset"])
def test_score_transforms_and_offset_are_passed_on(rng, name):
    """SPEC 10's keywords and the query offset: the operator gives the array call's result
    with them, which differs from the result without (each one is applied, not dropped)."""
    q, k, v = _qkv(rng, (10, 2, 256), (14, 1, 256))
    value = {"softcap": 5.0, "max_bias": 8.0, "sinks": torch.tensor([0.5, 2.0]), "offset": 1}[name]
    want = attention.flash_attn_prefill(q, k, v, causal=True, **{name: value})
    assert torch.equal(mn.flash_attn_prefill(q, k, v, causal=True, **{name: value}), want)
    assert torch.equal(torch.ops.mlx_native.flash_attn_prefill(q, k, v, causal=True, **{name: value}), want)
    assert not torch.equal(want, attention.flash_attn_prefill(q, k, v, causal=True))
    # At their defaults they change nothing.
    assert torch.equal(mn.flash_attn_prefill(q, k, v, causal=True, softcap=0.0, max_bias=0.0, sinks=None, offset=None),
                       attention.flash_attn_prefill(q, k, v, causal=True))  # fmt: skip


# ------------------------------------------------------------------ torch stays optional


def _python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_mlx_native_imports_and_runs_without_torch():
    out = _python(
        "import sys; sys.modules['torch'] = None\n"  # import torch now fails
        "import numpy as np, mlx_native as mn\n"
        "q = np.ones((4, 2, 256), np.float32); k = np.ones((4, 1, 256), np.float16)\n"
        "print(mn.flash_attn_prefill(q, k, k, causal=True).shape)"
    )
    assert out == "(4, 2, 256)"


def test_numpy_calls_import_neither_torch_nor_the_operators():
    out = _python(
        "import sys, numpy as np, mlx_native as mn\n"
        "q = np.ones((4, 2, 256), np.float32); k = np.ones((4, 1, 256), np.float16)\n"
        "mn.flash_attn_prefill(q, k, k, causal=True)\n"
        "print('torch' in sys.modules, 'mlx_native.torch_ops' in sys.modules)"
    )
    assert out == "False False"


# ------------------------------------------------------------------ CUDA (GPU only)


@cuda_only
def test_cuda_operator_runs_on_the_callers_stream(rng):
    q, k, v = _qkv(rng, (512, 8, 256), (512, 8, 256), device="cuda")
    q_new, k_new, v_new = _qkv(rng, (512, 8, 256), (512, 8, 256), device="cuda")
    mn.flash_attn_prefill(q, k, v, causal=True)  # warm
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)
        q.copy_(q_new), k.copy_(k_new), v.copy_(v_new)
        out = _op().flash_attn_prefill(q, k, v, None, causal=True)
        assert not s.query(), "the operator waited for its stream"
    s.synchronize()
    want = attention.flash_attn_prefill(q_new, k_new, v_new, causal=True)
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@cuda_only
def test_cuda_compile_with_inductor(rng):
    q4, k4, v4 = _qkv(rng, (2, 16, 1024, 256), (2, 8, 1024, 256), device="cuda")
    m = torch.rand(2, 1, 1024, 1024, device="cuda") < 0.9
    torch._dynamo.reset()
    compiled = torch.compile(_attention_block, fullgraph=True)
    got, got_lse = compiled(q4, k4, v4, m)
    want, want_lse = _attention_block(q4, k4, v4, m)
    torch.cuda.synchronize()
    assert torch.allclose(got, want, rtol=0, atol=1e-3) and torch.equal(got_lse, want_lse)


@cuda_only
def test_cuda_fake_tensors_keep_the_device():
    with FakeTensorMode():
        q = torch.empty(2, 64, 4, 512, device="cuda", dtype=torch.bfloat16)
        k = torch.empty(2, 80, 1, 512, device="cuda", dtype=torch.float16)
        out, lse = mn.flash_attn_prefill(q, k, k, causal=True, return_lse=True)
        assert out.device.type == "cuda" and out.dtype == torch.bfloat16 and lse.shape == (2, 4, 64)
