"""Quantised K/V (SPEC 11) on the CPU backend: FP8 E4M3 / E5M2 with descale factors (one
per KV head or one for all) and ggml's Q8_0 blocks, contiguous and paged.

- Against the float64 reference on the exactly dequantised values (``reference.dequantise``):
  NMSE <= 5e-4 (SPEC 3's bar) asserted, the measured figure printed (``-s``); lse within
  SPEC 8's 2e-3.
- Every instruction set of this CPU and the emulated AMX tiles; GQA, partial tiles, fully
  masked rows, strided views, and every SPEC feature at least once (causal, window, explicit
  mask, lse, sinks, softcap, ALiBi both ways, varlen, batches, HND, offset, Q and O dtypes).
- Paged caches with fuzzed block tables (unused blocks and rows past each cache hold NaN
  bytes): bit-identical to the contiguous quantised call.
- The same bytes as uint8 with ``kv_dtype=`` and as float8 arrays (numpy's ml_dtypes and
  torch's) give the same result, to the bit; torch tensors go through the operators
  (``torch.compile(fullgraph=True)`` traces them as one graph; the fake kernel shapes them).
- Every mistake refused by name before anything runs (CUDA runs them: test_cuda_quant.py;
  Metal: test_metal_emulator_quant.py)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import mlx_native as mn
from mlx_native.reference import dequantise, gather_pages, nmse, quantise_q8_0, reference_paged, reference_prefill

BAR = 5e-4  # SPEC 3 / SPEC 11
LSE_TOL = 2e-3  # SPEC 8
ISAS = list(dict.fromkeys(mn.cpu_info()["detected"] + ["amx-emulated"]))
FP8 = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}
FORMATS = ["float8_e4m3fn", "float8_e5m2", "q8_0"]
#: The NMSE each case measured, printed at the end of the module (``pytest -s``).
MEASURED: dict = {}


@pytest.fixture(params=ISAS)
def isa(request):
    mn.force_cpu_isa(request.param)
    try:
        yield request.param
    finally:
        mn.force_cpu_isa(None)


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    if MEASURED:
        worst = {}
        for (fmt, _), e in MEASURED.items():
            worst[fmt] = max(worst.get(fmt, 0.0), e)
        print("\nquantised K/V, worst NMSE per format:", {k: f"{v:.2e}" for k, v in sorted(worst.items())})


def quantise(rng, shape, fmt, spread=1.0):
    """Random K/V of ``shape`` (the values' shape) in ``fmt``: float8 arrays, or Q8_0 bytes."""
    x = rng.uniform(-spread, spread, shape).astype(np.float32)
    if fmt == "q8_0":
        return quantise_q8_0(x)
    return x.astype(FP8[fmt])


def values(x, fmt, descale=None):
    return dequantise(x, fmt, descale)


def kw_of(fmt, k_descale=None, v_descale=None):
    kw = {} if fmt != "q8_0" else {"kv_dtype": "q8_0"}
    if k_descale is not None:
        kw["k_descale"] = k_descale
    if v_descale is not None:
        kw["v_descale"] = v_descale
    return kw


def record(case, fmt, e):
    MEASURED[(fmt, case)] = e
    assert e <= BAR, f"{case} {fmt}: NMSE {e:.3e} above {BAR}"


def descales(rng, form, nkv):
    if form == "none":
        return None, None
    if form == "scalar":
        return 0.37, np.array([1.9], np.float32)
    return rng.uniform(0.2, 3.0, nkv).astype(np.float32), rng.uniform(0.2, 3.0, nkv).astype(np.float32)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("form", ["none", "scalar", "per-head"])
def test_quantised_kv_against_the_float64_reference(rng, isa, fmt, form):
    """GQA (8 heads on 2 KV heads), partial tiles (37 rows, 150 cache rows), causal, lse."""
    if fmt == "q8_0" and form != "none":
        pytest.skip("Q8_0 blocks carry their own scales")
    rows, kv, nh, nkv, d = 37, 150, 8, 2, 128
    q = rng.uniform(-1, 1, (rows, nh, d)).astype(np.float32)
    k, v = quantise(rng, (kv, nkv, d), fmt), quantise(rng, (kv, nkv, d), fmt)
    kd, vd = descales(rng, form, nkv)
    out, lse = mn.flash_attn_prefill(q, k, v, causal=True, return_lse=True, **kw_of(fmt, kd, vd))
    ref, ref_lse = reference_prefill(q, values(k, fmt, kd), values(v, fmt, vd), causal=True, scale=1 / np.sqrt(d))
    record(f"gqa-{form}-{isa}", fmt, nmse(out, ref))
    assert np.allclose(lse, ref_lse, atol=LSE_TOL)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dims", [(64, 64), (96, 96), (256, 256), (576, 512)], ids=lambda x: f"d{x[0]}")
def test_head_dims_and_strided_views(rng, fmt, dims):
    """Head dims of Q8_0's 32-value blocks (and FP8 at them), K and V as views: every other
    KV head of a wider cache, V a view of K's first 512 columns (MLA) at (576, 512)."""
    dk, dv = dims
    rows, kv, nh, nkv = 20, 70, 4, 2
    q = rng.uniform(-1, 1, (rows, nh, dk)).astype(np.float32)
    wide = quantise(rng, (kv, 2 * nkv, dk), fmt)
    k = wide[:, ::2]  # a head stride of two heads
    if dk == 576:
        cols = dv // 32 * 34 if fmt == "q8_0" else dv
        v = k[..., :cols]
    else:
        v = quantise(rng, (kv, 2 * nkv, dv), fmt)[:, 1::2]
    out = mn.flash_attn_prefill(q, k, v, **kw_of(fmt))
    ref, _ = reference_prefill(q, values(k, fmt), values(v, fmt), scale=1 / np.sqrt(dk))
    record(f"d{dk}-strided", fmt, nmse(out, ref))


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_spec_feature_with_quantised_kv(rng, fmt):
    """Each SPEC 6-10 feature at least once on quantised K/V: explicit mask with fully masked
    rows, window, offset, sinks, softcap, ALiBi (max_bias and slopes), varlen, a batch,
    HND, Q and O dtypes."""
    nh, nkv, d = 4, 2, 64
    kd = vd = None
    if fmt != "q8_0":
        kd, vd = rng.uniform(0.5, 2, nkv).astype(np.float32), 1.5
    kw = kw_of(fmt, kd, vd)
    kvf = lambda x, s: values(x, fmt, s)  # noqa: E731
    scale = 1 / np.sqrt(d)

    # An explicit mask with two fully masked rows (zeros, lse -inf), lse, sinks, softcap.
    rows, kv = 40, 100
    q = rng.uniform(-1, 1, (rows, nh, d)).astype(np.float32)
    k, v = quantise(rng, (kv, nkv, d), fmt), quantise(rng, (kv, nkv, d), fmt)
    mask = rng.uniform(-1, 1, (rows, kv)).astype(np.float16)
    mask[[3, 30]] = -np.inf
    sinks = rng.uniform(-1, 1, nh).astype(np.float32)
    out, lse = mn.flash_attn_prefill(q, k, v, mask, return_lse=True, softcap=5.0, **kw)
    ref, ref_lse = reference_prefill(q, kvf(k, kd), kvf(v, vd), mask, scale=scale, softcap=5.0)
    record("mask-softcap", fmt, nmse(out, ref))
    assert (out[[3, 30]] == 0).all() and np.isneginf(lse[:, [3, 30]]).all()
    seen = np.isfinite(ref_lse)
    assert np.allclose(lse[seen], ref_lse[seen], atol=LSE_TOL)
    out = mn.flash_attn_prefill(q, k, v, sinks=sinks, window=17, **kw)
    ref, _ = reference_prefill(q, kvf(k, kd), kvf(v, vd), scale=scale, window=17, sinks=sinks)
    record("window-sinks", fmt, nmse(out, ref))
    out = mn.flash_attn_prefill(q, k, v, causal=True, offset=-10, max_bias=8.0, **kw)
    ref, _ = reference_prefill(q, kvf(k, kd), kvf(v, vd), scale=scale, causal=True, offset=-10, max_bias=8.0)
    record("offset-alibi", fmt, nmse(out, ref[...]))
    slopes = rng.uniform(0, 0.2, nh).astype(np.float32)
    out = mn.flash_attn_prefill(q.astype(np.float16), k, v, causal=True, alibi_slopes=slopes, out_dtype="bfloat16",
                                **kw)  # fmt: skip
    ref, _ = reference_prefill(q.astype(np.float16), kvf(k, kd), kvf(v, vd), scale=scale, causal=True,
                               alibi_slopes=slopes)  # fmt: skip
    assert out.dtype == ml_dtypes.bfloat16
    record("slopes-f16q-bf16o", fmt, nmse(out.astype(np.float64), ref))

    # Variable length.
    cq = np.array([0, 5, 5, 33], np.int32)
    ck = np.array([0, 9, 30, 100], np.int32)
    q3 = rng.uniform(-1, 1, (33, nh, d)).astype(np.float32)
    out = mn.flash_attn_prefill(q3, k, v, causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck, **kw)
    ref, _ = reference_prefill(q3, kvf(k, kd), kvf(v, vd), scale=scale, causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck)
    record("varlen", fmt, nmse(out, ref))

    # A batch in the HND layout, float16 out.
    qb = rng.uniform(-1, 1, (2, nh, 24, d)).astype(np.float32)
    kb, vb = quantise(rng, (2, nkv, 50, d), fmt), quantise(rng, (2, nkv, 50, d), fmt)
    out = mn.flash_attn_prefill(qb, kb, vb, causal=True, layout="HND", out_dtype="float16", **kw)
    # The reference's layout is NHD: heads second to last; the descale is per KV head.
    tr = lambda x: np.swapaxes(x, 1, 2)  # noqa: E731
    ref, _ = reference_prefill(tr(qb), kvf(np.ascontiguousarray(tr(kb)), kd), kvf(np.ascontiguousarray(tr(vb)), vd),
                               scale=scale, causal=True)  # fmt: skip
    assert out.dtype == np.float16
    record("batch-hnd-f16o", fmt, nmse(tr(out).astype(np.float64), ref))


def make_pages(rng, lens, bs, nkv, d, fmt):
    """Quantised caches holding sequences of ``lens`` rows in shuffled blocks, with NaN bytes
    (FP8 0x7f, a Q8_0 scale of NaN) in unused blocks, past each cache's end, and garbage
    table entries past each sequence's last block."""
    need = [-(-n // bs) for n in lens]
    num_blocks = sum(need) + 3
    width = d // 32 * 34 if fmt == "q8_0" else d
    k = np.full((num_blocks, bs, nkv, width), 0x7F, np.uint8)
    v = np.full((num_blocks, bs, nkv, width), 0x7F, np.uint8)
    if fmt == "q8_0":  # every block's scale NaN (0x7e00)
        for a in (k, v):
            a.reshape(num_blocks, bs, nkv, d // 32, 34)[..., 0] = 0x00
            a.reshape(num_blocks, bs, nkv, d // 32, 34)[..., 1] = 0x7E
    order = rng.permutation(num_blocks)
    table = np.full((len(lens), max(need) + 1), -5, np.int32)
    at = 0
    for b, (n, m) in enumerate(zip(lens, need)):
        table[b, :m] = order[at : at + m]
        at += m
        j = np.arange(n)
        raw = lambda: quantise(rng, (n, nkv, d), fmt).view(np.uint8).reshape(n, nkv, width)  # noqa: E731
        k[table[b, j // bs], j % bs] = raw()
        v[table[b, j // bs], j % bs] = raw()
    if fmt != "q8_0":
        k, v = k.view(FP8[fmt]), v.view(FP8[fmt])
    return k, v, table, np.asarray(lens, np.int32)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bs", [16, 48, 256])
def test_paged_quantised_kv_is_the_contiguous_result_to_the_bit(rng, isa, fmt, bs):
    """Paged caches with a fuzzed (shuffled) block table, varlen queries, causal, lse, per-head
    descale (FP8): the contiguous call's result bit for bit, and the reference's."""
    lq, lk, nh, nkv, d = [30, 1, 0, 50], [100, 1, 20, 50], 4, 2, 64
    k, v, table, used = make_pages(rng, lk, bs, nkv, d, fmt)
    kd = vd = None
    if fmt != "q8_0":
        kd, vd = rng.uniform(0.5, 2, nkv).astype(np.float32), 0.75
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    q = rng.uniform(-1, 1, (int(cq[-1]), nh, d)).astype(np.float32)
    kw = dict(causal=True, cu_seqlens_q=cq, return_lse=True, **kw_of(fmt, kd, vd))
    out, lse = mn.flash_attn_prefill(q, k, v, block_table=table, seqused_k=used, **kw)
    kc = np.concatenate([gather_pages(k, table, used, b) for b in range(len(lk))])
    vc = np.concatenate([gather_pages(v, table, used, b) for b in range(len(lk))])
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    o2, l2 = mn.flash_attn_prefill(q, kc, vc, cu_seqlens_k=ck, **kw)
    assert np.array_equal(out.view(np.uint8), o2.view(np.uint8)) and np.array_equal(lse.view(np.uint8), l2.view(np.uint8))
    ref, ref_lse = reference_paged(q, values(k, fmt, kd), values(v, fmt, vd), block_table=table, seqused_k=used,
                                   cu_seqlens_q=cq, causal=True, scale=1 / 8)  # fmt: skip
    record(f"paged-bs{bs}-{isa}", fmt, nmse(out, ref))
    seen = np.isfinite(ref_lse)
    assert np.allclose(lse[seen], ref_lse[seen], atol=LSE_TOL)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_as_bytes_as_ml_dtypes_and_as_torch_are_one_result(rng, fmt):
    torch = pytest.importorskip("torch")
    q = rng.uniform(-1, 1, (33, 4, 64)).astype(np.float32)
    k, v = quantise(rng, (90, 2, 64), fmt), quantise(rng, (90, 2, 64), fmt)
    kd = np.array([0.5, 2.0], np.float32)
    a = mn.flash_attn_prefill(q, k, v, causal=True, k_descale=kd, v_descale=3.0)
    b = mn.flash_attn_prefill(q, k.view(np.uint8), v.view(np.uint8), causal=True, kv_dtype=fmt, k_descale=kd,
                              v_descale=3.0)  # fmt: skip
    tdt = getattr(torch, fmt)
    kt, vt = torch.from_numpy(k.view(np.uint8)).view(tdt), torch.from_numpy(v.view(np.uint8)).view(tdt)
    c = mn.flash_attn_prefill(torch.from_numpy(q), kt, vt, causal=True, k_descale=torch.from_numpy(kd), v_descale=3.0)
    assert isinstance(c, torch.Tensor)
    assert np.array_equal(a, b) and np.array_equal(a, c.numpy())


def _fp8_block(q, k, v, kd):
    out, lse = mn.flash_attn_prefill(q * 0.5, k, v, causal=True, k_descale=kd, v_descale=2.0, return_lse=True)
    return out.float().sum(-1) + 1, lse


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_traces_a_quantised_call(rng, backend):
    """Quantised K/V go through the operators (their schema has kv_dtype, k_descale and
    v_descale): a compiled function that calls with FP8 tensors, a descale tensor and a
    number, or with Q8_0 bytes and kv_dtype, is one graph, and computes the eager result."""
    torch = pytest.importorskip("torch")
    t = torch.from_numpy
    q = t(rng.uniform(-1, 1, (40, 4, 64)).astype(np.float32))
    k8 = t(quantise(rng, (70, 2, 64), "float8_e4m3fn").view(np.uint8)).view(torch.float8_e4m3fn)
    v8 = t(quantise(rng, (70, 2, 64), "float8_e4m3fn").view(np.uint8)).view(torch.float8_e4m3fn)
    kd = torch.tensor([0.5, 1.5])
    torch._dynamo.reset()
    got, got_lse = torch.compile(_fp8_block, fullgraph=True, backend=backend)(q, k8, v8, kd)
    want, want_lse = _fp8_block(q, k8, v8, kd)
    assert torch.allclose(got, want, rtol=0, atol=1e-4) and torch.equal(got_lse, want_lse)
    explain = torch._dynamo.explain(_fp8_block)(q, k8, v8, kd)
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    # Q8_0 bytes with kv_dtype, through the operator by keyword (the schema names them).
    kq, vq = t(quantise(rng, (70, 2, 64), "q8_0")), t(quantise(rng, (70, 2, 64), "q8_0"))
    direct = torch.ops.mlx_native.flash_attn_prefill(q, kq, vq, causal=True, kv_dtype="q8_0")
    assert np.array_equal(direct.numpy(), mn.flash_attn_prefill(q.numpy(), kq.numpy(), vq.numpy(), causal=True, kv_dtype="q8_0"))


def test_the_fake_kernel_shapes_quantised_calls_and_refuses_what_the_real_one_does():
    """Under FakeTensorMode the quantised call's output has the real one's shape (v's head
    dim; a Q8_0 row of n blocks holds 32 n values), and what needs no data is refused by
    name: a descale of the wrong length, a descale with Q8_0, an unknown kv_dtype."""
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(50, 8, 128)
        k8 = torch.empty(90, 2, 128, dtype=torch.float8_e5m2)
        out = mn.flash_attn_prefill(q, k8, k8, causal=True, k_descale=torch.empty(2), v_descale=0.5)
        assert (out.shape, out.dtype) == ((50, 8, 128), torch.float32)
        kq = torch.empty(90, 2, 128 // 32 * 34, dtype=torch.uint8)
        out = mn.flash_attn_prefill(q, kq, kq, kv_dtype="q8_0", out_dtype=torch.float16)
        assert (out.shape, out.dtype) == ((50, 8, 128), torch.float16)
        with pytest.raises(mn.InvalidArgumentError, match="k_descale has 3 values"):
            mn.flash_attn_prefill(q, k8, k8, k_descale=torch.empty(3))
        with pytest.raises(mn.InvalidArgumentError, match="Q8_0 blocks carry their own scales"):
            mn.flash_attn_prefill(q, kq, kq, kv_dtype="q8_0", v_descale=torch.empty(1))
        with pytest.raises(mn.UnsupportedDtypeError, match="kv_dtype 'int4'"):
            mn.flash_attn_prefill(q, kq, kq, kv_dtype="int4")


def test_a_plan_on_quantised_kv_runs_again_and_writes_nothing_when_refused(rng):
    q = rng.uniform(-1, 1, (16, 2, 64)).astype(np.float32)
    k, v = quantise(rng, (40, 1, 64), "q8_0"), quantise(rng, (40, 1, 64), "q8_0")
    plan = mn.PrefillPlan(q, k, v, kv_dtype="q8_0", causal=True)
    assert "q8_0 K/V" in repr(plan)
    first = plan.run()
    assert np.array_equal(first, plan.run(q, k, v))
    out = np.full_like(first, 7.0)
    with pytest.raises(mn.InvalidArgumentError, match="k is"):
        plan.run(q, np.zeros((40, 1, 64), np.float16), v, out=out)
    assert (out == 7.0).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("paged", [False, True], ids=["contig", "paged"])
def test_an_encoded_quantised_plan_is_its_run(rng, fmt, paged):
    """A plan's encoder record carries what only the plan holds (the format, the descale
    factors, the table): a Q8_0 plan's uint8 bytes are bound as Q8_0, and FP8 K/V with
    descale factors (contiguous: every other row of a bigger cache, float8_e5m2 among
    them) give the run's result to the bit."""
    nh, nkv, d = 4, 2, 64
    kw = kw_of(fmt, *((None, None) if fmt == "q8_0" else (np.array([0.5, 2.0], np.float32), 1.5)))
    if paged:
        k, v, table, used = make_pages(rng, [90, 33], 16, nkv, d, fmt)
        q = rng.uniform(-1, 1, (70, nh, d)).astype(np.float32)
        kw.update(block_table=table, seqused_k=used, cu_seqlens_q=np.array([0, 40, 70], np.int32))
    else:
        q = rng.uniform(-1, 1, (1, 40, nh, d)).astype(np.float32)
        k = quantise(rng, (1, 192, nkv, d), fmt)[:, ::2]
        v = quantise(rng, (1, 192, nkv, d), fmt)[:, ::2]
    plan = mn.PrefillPlan(q, k, v, None, causal=True, **kw)
    want = plan.run()
    with plan.device.encoder() as enc:
        plan.encode(enc)
    assert np.array_equal(plan.encoded_result(), want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_upload_span_of_quantised_kv_is_its_bytes(rng, fmt):
    """What a run of host arrays on a CUDA device uploads (layouts.span: the elements from
    the first to the last, a strided view kept as it is) for every format, float8_e5m2
    among them (numpy cannot rebuild that dtype from its array interface)."""
    from mlx_native.arrays import Operand
    from mlx_native.layouts import span

    k = quantise(rng, (2, 24, 3, 64), fmt)[:, ::3]
    flat = span(Operand.of(k, "k"))
    assert flat.dtype == k.dtype
    whole = np.ascontiguousarray(quantise(rng, (2, 24, 3, 64), fmt))
    assert np.array_equal(span(Operand.of(whole, "k")).view(np.uint8), whole.reshape(-1).view(np.uint8))
    assert np.array_equal(flat.view(np.uint8)[: k[0, 0].size], k[0, 0].reshape(-1).view(np.uint8))


def _call(rng, fmt="float8_e4m3fn", d=64, nkv=2, **kw):
    q = rng.uniform(-1, 1, (8, 4, d)).astype(np.float32)
    k, v = quantise(rng, (16, nkv, d), fmt), quantise(rng, (16, nkv, d), fmt)
    extra = kw.pop("kv", {})
    return mn.flash_attn_prefill(q, extra.get("k", k), extra.get("v", v), **kw)


@pytest.mark.parametrize(
    "kw, error, words",
    [
        (dict(k_descale=np.ones(3, np.float32)), mn.InvalidArgumentError, ["k_descale has 3 values", "kv_heads = 2"]),
        (dict(v_descale=np.ones((2, 2), np.float32)), mn.InvalidArgumentError, ["v_descale", "shape"]),
        (dict(k_descale=np.ones(2, np.float64)), mn.UnsupportedDtypeError, ["k_descale must be float32"]),
        (dict(k_descale=float("nan")), mn.InvalidArgumentError, ["k_descale", "finite"]),
        (dict(k_descale="1"), mn.ArgumentTypeError, ["k_descale"]),
        (dict(fmt="q8_0", kv_dtype="q8_0", k_descale=1.0), mn.InvalidArgumentError, ["Q8_0 blocks carry their own"]),
        (dict(kv_dtype="q4_0"), mn.UnsupportedDtypeError, ["kv_dtype 'q4_0'"]),
        (dict(kv_dtype="float8_e5m2"), mn.UnsupportedDtypeError, ["kv_dtype='float8_e5m2'", "float8_e4m3fn"]),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_mistakes_are_refused_by_name(rng, kw, error, words):
    with pytest.raises(error) as e:
        _call(rng, **kw)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_mismatched_and_misshapen_kv_are_refused(rng):
    q = rng.uniform(-1, 1, (8, 4, 64)).astype(np.float32)
    k8 = quantise(rng, (16, 2, 64), "float8_e4m3fn")
    with pytest.raises(mn.UnsupportedDtypeError, match="k is float8_e4m3fn and v is float8_e5m2"):
        mn.flash_attn_prefill(q, k8, k8.astype(np.float32).astype(ml_dtypes.float8_e5m2))
    with pytest.raises(mn.UnsupportedDtypeError, match="k is float8_e4m3fn and v is float16"):
        mn.flash_attn_prefill(q, k8, np.zeros((16, 2, 64), np.float16))
    with pytest.raises(mn.UnsupportedDtypeError, match="kv_dtype='q8_0' with k and v of dtype float16"):
        mn.flash_attn_prefill(q, np.zeros((16, 2, 64), np.float16), np.zeros((16, 2, 64), np.float16), kv_dtype="q8_0")
    bad = np.zeros((16, 2, 70), np.uint8)
    with pytest.raises(mn.InvalidArgumentError, match="last axis of 70"):
        mn.flash_attn_prefill(q, bad, bad, kv_dtype="q8_0")
    with pytest.raises(mn.InvalidArgumentError, match="k_descale goes with FP8"):
        mn.flash_attn_prefill(q, np.zeros((16, 2, 64), np.float16), np.zeros((16, 2, 64), np.float16), k_descale=1.0)


def test_the_c_abi_refuses_bad_descale_pointers_and_takes_cuda():
    """Through the library's own checks (not the Python layer's): a descale of the wrong
    length; quantised K/V are planned on CUDA (its quant modules read them)."""
    from mlx_native._lib import ffi, lib

    p = ffi.new("MlxnFlashAttnPrefillParams *")
    p.q_strides, p.k_strides, p.v_strides, p.out_strides = (0, 256, 64), (0, 64, 64), (0, 64, 64), (0, 256, 64)
    p.batch, p.rows, p.kv_len, p.n_heads, p.n_kv_heads, p.head_dim, p.scale = 1, 8, 16, 4, 1, 64, 0.125
    dev = mn.Device("cpu")
    out = ffi.new("uint64_t *")
    d = ffi.new("MlxnKvDescale *")
    vals = ffi.new("float[]", [1.0, 2.0, 3.0])
    d.k, d.k_len = vals, 3
    rc = lib.mlxn_prefill_plan_new(dev.handle, p, 0, 7, 0, 0, 0, 0, ffi.NULL, ffi.NULL, d, ffi.NULL, out)
    assert rc != 0 and "k_descale has 3 values" in ffi.string(lib.mlxn_last_error()).decode()
    d.k_len = 1
    assert lib.mlxn_prefill_plan_new(dev.handle, p, 0, 7, 0, 0, 0, 0, ffi.NULL, ffi.NULL, d, ffi.NULL, out) == 0
    lib.mlxn_prefill_plan_free(out[0])
    # Q8_0 at a head dim that is not a multiple of 32 (Python's row-width check comes first there).
    p.head_dim = 80
    rc = lib.mlxn_prefill_plan_new(dev.handle, p, 0, 9, 0, 0, 0, 0, ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL, out)
    assert rc != 0 and "head_dim 80" in ffi.string(lib.mlxn_last_error()).decode()
    p.head_dim = 64
    # Descale with F16 K/V is refused by the op.
    rc = lib.mlxn_prefill_plan_new(dev.handle, p, 0, 1, 0, 0, 0, 0, ffi.NULL, ffi.NULL, d, ffi.NULL, out)
    assert rc != 0 and "go with FP8" in ffi.string(lib.mlxn_last_error()).decode()
    if "cuda" in mn.backends():
        cuda = mn.Device("cuda")
        rc = lib.mlxn_prefill_plan_new(cuda.handle, p, 0, 7, 0, 0, 0, 0, ffi.NULL, ffi.NULL, d, ffi.NULL, out)
        assert rc == 0, ffi.string(lib.mlxn_last_error()).decode()
        lib.mlxn_prefill_plan_free(out[0])
