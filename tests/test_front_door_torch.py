"""The front door with PyTorch: torch in, torch out, on the CPU and on CUDA (tensors used in
place, masks converted on their device, the caller's stream, CUDA graphs). The CPU tests
need torch (a test extra: without it they fail, not skip); the CUDA ones a GPU, its driver
and a CUDA build of torch (the lead runs them on an H200: ``python -m pytest
tests/test_front_door_torch.py``)."""

from __future__ import annotations

import numpy as np
import pytest

import mlx_native as mn
from helpers import import_test_extra
from mlx_native.arrays import Operand
from mlx_native.reference import nmse, reference_prefill

torch = import_test_extra("torch")  # a test extra: missing, the module fails rather than skips

BAR = 1e-5
HAS_CUDA = "cuda" in mn.backends() and torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU, its driver and a CUDA build of torch")


def _qkv(rng, q_shape, kv_shape, dtype=torch.float32, device="cpu"):
    def t(shape, dt):
        return torch.from_numpy(rng.uniform(-1, 1, shape).astype(np.float32)).to(device=device, dtype=dt)

    return t(q_shape, dtype), t(kv_shape, torch.float16), t(kv_shape, torch.float16)


def _np(t):
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _ref(q, k, v, mask=None, **kw):
    m = None if mask is None else _np(mask.float() if mask.dtype == torch.bfloat16 else mask)
    if m is not None and m.dtype == np.bool_:
        m = np.where(m, 0.0, -np.inf)
    kw.setdefault("scale", 1 / np.sqrt(q.shape[-1]))
    return reference_prefill(_np(q), _np(k), _np(v), m, **kw)


# ------------------------------------------------------------------ the CPU


def test_torch_cpu_in_torch_cpu_out(rng):
    q, k, v = _qkv(rng, (40, 4, 256), (60, 2, 256))
    out, lse = mn.flash_attn_prefill(q, k, v, causal=True, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.device.type == "cpu" and out.dtype == torch.float32
    assert isinstance(lse, torch.Tensor) and lse.shape == (4, 40)
    ref, ref_lse = _ref(q, k, v, causal=True)
    assert nmse(_np(out), ref) < BAR
    fin = np.isfinite(ref_lse)
    assert np.abs(_np(lse)[fin] - ref_lse[fin]).max() < 2e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_torch_half_inputs_give_their_dtype(rng, dtype):
    q, k, v = _qkv(rng, (30, 2, 512), (30, 1, 512), dtype)
    out = mn.flash_attn_prefill(q, k, v, causal=True)
    assert out.dtype == dtype
    assert mn.flash_attn_prefill(q, k, v, causal=True, out_dtype=torch.float32).dtype == torch.float32


def test_bhsd_tensors_pass_as_transpose_without_a_copy(rng, monkeypatch):
    q4, k4, v4 = _qkv(rng, (2, 4, 30, 256), (2, 2, 50, 256))  # [B, H, S, D]
    q, k, v = q4.transpose(1, 2), k4.transpose(1, 2), v4.transpose(1, 2)
    monkeypatch.setattr(Operand, "made_contiguous", lambda self: pytest.fail("an input was copied"))
    out = mn.flash_attn_prefill(q, k, v, causal=True, window=9)
    monkeypatch.undo()
    assert out.shape == (2, 30, 4, 256) and out.is_contiguous()
    assert nmse(_np(out), _ref(q.contiguous(), k.contiguous(), v.contiguous(), causal=True, window=9)[0]) < BAR


@pytest.mark.parametrize("form", ["bool", "finfo.min float32", "finfo.min bfloat16", "float16 per batch", "expanded"])
def test_torch_masks(rng, form):
    q, k, v = _qkv(rng, (2, 30, 4, 256), (2, 70, 2, 256))
    allowed = torch.from_numpy(rng.random((2, 1, 30, 70)) < 0.7)
    allowed[..., 69] = True
    mask = {
        "bool": allowed,
        "finfo.min float32": torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min),
        "finfo.min bfloat16": torch.zeros(allowed.shape, dtype=torch.bfloat16).masked_fill(~allowed, torch.finfo(torch.bfloat16).min),
        "float16 per batch": torch.from_numpy(rng.uniform(-1, 1, (2, 1, 30, 70)).astype(np.float16)),
        "expanded": allowed[:1].expand(2, 4, 30, 70),
    }[form]
    out = mn.flash_attn_prefill(q, k, v, mask, causal=True)
    ref_mask = mask.float().masked_fill(~allowed, float("-inf")) if "finfo" in form else mask
    assert nmse(_np(out), _ref(q, k, v, ref_mask, causal=True)[0]) < BAR


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_torch_cu_seqlens(rng, dtype):
    cq, ck = torch.tensor([0, 10, 10, 40], dtype=dtype), torch.tensor([0, 30, 35, 75], dtype=dtype)
    q, k, v = _qkv(rng, (40, 4, 256), (75, 2, 256))
    out, lse = mn.flash_attn_prefill(q, k, v, causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck, return_lse=True)
    ref, _ = _ref(q, k, v, causal=True, cu_seqlens_q=cq.numpy(), cu_seqlens_k=ck.numpy())
    assert nmse(_np(out), ref) < BAR and lse.shape == (4, 40)


def test_torch_merge_of_two_halves(rng):
    q, k, v = _qkv(rng, (30, 4, 256), (100, 2, 256))
    o1, l1 = mn.flash_attn_prefill(q, k[:50], v[:50], return_lse=True)
    o2, l2 = mn.flash_attn_prefill(q, k[50:], v[50:], return_lse=True)
    out, lse = mn.merge_attention_states(o1, l1, o2, l2)
    assert isinstance(out, torch.Tensor) and lse.dtype == torch.float32
    assert nmse(_np(out), _ref(q, k, v)[0]) < BAR


def test_a_plan_of_torch_tensors_runs_on_new_ones(rng):
    q, k, v = _qkv(rng, (2, 30, 4, 256), (2, 40, 2, 256))
    plan = mn.PrefillPlan(q, k, v, causal=True)
    q2, k2, v2 = _qkv(rng, (2, 30, 4, 256), (2, 40, 2, 256))
    out = torch.empty(2, 30, 4, 256)
    assert plan.run(q2, k2, v2, out=out) is out
    assert nmse(_np(out), _ref(q2, k2, v2, causal=True)[0]) < BAR
    assert plan.visible_pairs == 2 * sum(min(r + 10 + 1, 40) for r in range(30))


# ------------------------------------------------------------------ CUDA (GPU only)


@cuda_only
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_cuda_tensors_in_cuda_tensors_out(rng, q_dtype):
    q, k, v = _qkv(rng, (2, 300, 8, 256), (2, 400, 2, 256), q_dtype, "cuda")
    m = torch.rand(2, 1, 300, 400, device="cuda") < 0.8
    out, lse = mn.flash_attn_prefill(q, k, v, m, causal=True, window=128, out_dtype=torch.float32, return_lse=True)
    assert out.is_cuda and lse.is_cuda and out.device == q.device
    ref, _ = _ref(q, k, v, m, causal=True, window=128)
    assert nmse(_np(out), ref) < BAR


@cuda_only
def test_a_cuda_mask_is_converted_on_the_device(rng, monkeypatch):
    q, k, v = _qkv(rng, (200, 4, 512), (300, 2, 512), device="cuda")
    m = torch.zeros(200, 300, device="cuda").masked_fill(torch.rand(200, 300, device="cuda") < 0.3, torch.finfo(torch.float32).min)
    original = Operand.to_host

    def no_device_to_host(self):
        if self.on_cuda:
            pytest.fail("a CUDA array was copied to the host")
        return original(self)

    monkeypatch.setattr(Operand, "to_host", no_device_to_host)
    out = mn.flash_attn_prefill(q, k, v, m)
    monkeypatch.undo()
    assert nmse(_np(out), _ref(q, k, v, m.masked_fill(m <= -65504, float("-inf")))[0]) < BAR


@cuda_only
def test_a_cuda_graph_captures_and_replays(rng):
    """A plan's run on the capturing stream: no host synchronisation (which capture would
    refuse), no allocation by the library; replays read the static inputs' new values."""
    q, k, v = _qkv(rng, (1024, 16, 256), (1024, 8, 256), device="cuda")
    plan = mn.PrefillPlan(q, k, v, causal=True, window=256, return_lse=True)
    out = torch.empty(1024, 16, 256, device="cuda")
    lse = torch.empty(16, 1024, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        plan.run(q, k, v, out=out, lse=lse)  # warm: kernels compiled, tables made
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(q, k, v, out=out, lse=lse)
    for _ in range(2):
        q2, k2, v2 = _qkv(rng, (1024, 16, 256), (1024, 8, 256), device="cuda")
        q.copy_(q2), k.copy_(k2), v.copy_(v2)
        graph.replay()
        torch.cuda.synchronize()
        assert nmse(_np(out), _ref(q2, k2, v2, causal=True, window=256)[0]) < BAR
    # The one call under capture too (its plan cached by a first call).
    mn.flash_attn_prefill(q, k, v, causal=True)
    torch.cuda.synchronize()
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2):
        static_out = mn.flash_attn_prefill(q, k, v, causal=True)
    q.copy_(q2.flip(0))
    g2.replay()
    torch.cuda.synchronize()
    assert nmse(_np(static_out), _ref(q, k, v, causal=True)[0]) < BAR


@cuda_only
def test_runs_are_ordered_on_the_callers_stream(rng):
    """On a non-default stream, a kernel that writes the inputs just before (after a long
    sleep, so that work on any other stream would run first) is seen by the run."""
    q, k, v = _qkv(rng, (512, 8, 256), (512, 8, 256), device="cuda")
    q_new, k_new, v_new = _qkv(rng, (512, 8, 256), (512, 8, 256), device="cuda")
    mn.flash_attn_prefill(q, k, v, causal=True)  # warm
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on s
        q.copy_(q_new), k.copy_(k_new), v.copy_(v_new)
        out = mn.flash_attn_prefill(q, k, v, causal=True)
        assert not s.query(), "the call waited for its stream"
    s.synchronize()
    assert nmse(_np(out), _ref(q_new, k_new, v_new, causal=True)[0]) < BAR


@cuda_only
def test_host_tensors_on_a_cuda_device_come_back_on_the_host(rng):
    q, k, v = _qkv(rng, (100, 4, 256), (100, 2, 256))
    out = mn.flash_attn_prefill(q, k, v, causal=True, device="cuda")
    assert isinstance(out, torch.Tensor) and out.device.type == "cpu"
    assert nmse(_np(out), _ref(q, k, v, causal=True)[0]) < BAR
    qn = _np(q)
    out_np = mn.flash_attn_prefill(qn, _np(k), _np(v), causal=True, device="cuda")
    assert isinstance(out_np, np.ndarray) and nmse(out_np, _np(out)) < 1e-12


@cuda_only
def test_cuda_cu_seqlens_merge_and_a_host_mask(rng):
    cq = torch.tensor([0, 100, 100, 300], dtype=torch.int32, device="cuda")
    ck = torch.tensor([0, 150, 200, 500], dtype=torch.int32, device="cuda")
    q, k, v = _qkv(rng, (300, 8, 256), (500, 4, 256), device="cuda")
    out = mn.flash_attn_prefill(q, k, v, causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck)
    assert nmse(_np(out), _ref(q, k, v, causal=True, cu_seqlens_q=_np(cq), cu_seqlens_k=_np(ck))[0]) < BAR
    o1, l1 = mn.flash_attn_prefill(q[:100], k[:300], v[:300], return_lse=True)
    o2, l2 = mn.flash_attn_prefill(q[:100], k[300:], v[300:], return_lse=True)
    merged, _ = mn.merge_attention_states(o1, l1, o2, l2)
    assert merged.is_cuda and nmse(_np(merged), _ref(q[:100], k, v)[0]) < BAR
    host_mask = np.zeros((300, 500), np.float32)
    out = mn.flash_attn_prefill(q, k, v, host_mask)  # copied to q's device
    assert out.is_cuda and nmse(_np(out), _ref(q, k, v)[0]) < BAR


@cuda_only
def test_a_described_mask_call_allocates_only_its_output_on_the_device(rng):
    q, k, v = _qkv(rng, (4096, 2, 256), (4096, 1, 256), device="cuda")
    mn.flash_attn_prefill(q, k, v, causal=True, window=64)  # warm: plan cached, kernels built
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = mn.flash_attn_prefill(q, k, v, causal=True, window=64)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base == out.numel() * out.element_size()  # no [rows, kv] mask


@cuda_only
def test_the_overhead_bench_on_cuda(capsys):
    from mlx_native.bench.overhead import run_overhead

    res = run_overhead(rows=[512], device="cuda", repeats=1)
    assert all(d["kernels_s"] > 0 and d["run_s"] > 0 and d["call_s"] > 0 for d in res)
    assert "device" in capsys.readouterr().out
