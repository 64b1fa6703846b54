"""A catalogue of hostile and careless calls of the public API (issue 27), each with what it
must do: give the float64 reference's result, or raise a typed error (an ``MlxError``). Run
``python tests/hostile_probes.py`` for the counts by outcome; ``tests/test_hostile_probes.py``
runs every probe in the suite.

Outcomes: ``result`` (a result that matches the reference), ``typed`` (an ``MlxError``),
and the failures: ``wrong`` (a result where an error was due, or a result that does not
match), ``untyped`` (another exception), ``refused`` (a typed error where a result was due).
Crashes and hangs (fork, signals, environment writes) are probed in subprocesses by
``tests/test_hostile_input.py``."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import numpy as np

import mlx_native as mn
from mlx_native.reference import nmse, reference_prefill


@dataclass
class Probe:
    name: str
    call: Callable[[], Any]
    #: None: a typed error is due; else a function of the result that says whether it is right.
    check: Optional[Callable[[Any], bool]] = None


def _rng():
    return np.random.default_rng(27)


def _qkv(rows=24, nh=4, nkv=2, d=64, kv=32, qdt=np.float32, kvdt=np.float16):
    r = _rng()
    return (r.uniform(-1, 1, (rows, nh, d)).astype(qdt), r.uniform(-1, 1, (kv, nkv, d)).astype(kvdt),
            r.uniform(-1, 1, (kv, nkv, d)).astype(kvdt))  # fmt: skip


def _matches(q, k, v, mask=None, **kw) -> Callable[[Any], bool]:
    """The result (out, or (out, lse) with return_lse) matches the reference on these arrays."""
    lse_wanted = kw.pop("return_lse", False)

    def host(x):
        if type(x).__module__.startswith("torch"):
            return x.detach().float().cpu().numpy()
        return np.asarray(x)

    def check(res):
        out, lse = res if lse_wanted else (res, None)
        m = None if mask is None else host(mask)
        if m is not None and m.dtype == np.bool_:
            m = np.where(m, 0.0, -np.inf)
        scale = kw.pop("scale", None)
        qh, kh, vh = host(q), host(k), host(v)
        ref, ref_lse = reference_prefill(qh, kh, vh, m, scale=1 / math.sqrt(qh.shape[-1]) if scale is None else scale,
                                         **kw)  # fmt: skip
        out = host(out).astype(np.float64)
        ok = out.shape == ref.shape and np.array_equal(np.isfinite(out), np.isfinite(ref))
        fin = np.isfinite(ref)
        ok = ok and (not fin.any() or nmse(out[fin], ref[fin]) <= 5e-4)
        if lse is not None:
            lse = host(lse)
            ok = ok and np.allclose(lse[np.isfinite(ref_lse)], ref_lse[np.isfinite(ref_lse)], atol=2e-3)
        return bool(ok)

    return check


def _torch():
    import torch

    return torch


def probes() -> List[Probe]:
    q, k, v = _qkv()
    rows, kv = q.shape[0], k.shape[0]
    mask = _rng().uniform(-1, 1, (rows, kv)).astype(np.float16)
    out: List[Probe] = []
    P = out.append
    fa = mn.flash_attn_prefill

    # -- the front door, numpy: arguments of the wrong kind or range
    for name, value in [("causal", 1), ("causal", "yes"), ("causal", None), ("window", 0), ("window", -3),
                        ("window", 2.0), ("window", "8"), ("window", 2**31), ("offset", 1.5), ("offset", 2**31),
                        ("scale", float("nan")), ("scale", "1"), ("scale", 1e39), ("scale", 10**400), ("scale", 1e-46),
                        ("softcap", -1.0), ("softcap", float("inf")), ("softcap", 1e-45), ("softcap", True),
                        ("max_bias", -0.5), ("max_bias", 127.0), ("max_bias", 1e-45), ("max_bias", [8]),
                        ("return_lse", 1), ("check_finite", "no"), ("out_dtype", "float64"), ("out_dtype", np.int8),
                        ("out_dtype", "half"), ("device", "gpu"), ("device", 0), ("device", "cuda:x"),
                        ("device", "metal:0")]:  # fmt: skip
        kw = dict(causal=True) if name == "offset" else {}
        kw[name] = value
        P(Probe(f"numpy {name}={value!r}", lambda kw=kw: fa(q, k, v, **kw)))
    # ... and edges that are valid
    P(Probe("numpy window=2**31-1", lambda: fa(q, k, v, window=2**31 - 1), _matches(q, k, v, causal=True, window=2**31 - 1)))
    P(Probe("numpy offset=-2**31", lambda: fa(q, k, v, causal=True, offset=-(2**31)),
            _matches(q, k, v, causal=True, offset=-(2**31))))  # fmt: skip
    P(Probe("numpy scale=0", lambda: fa(q, k, v, scale=0), _matches(q, k, v, scale=0.0)))
    P(Probe("numpy scale=-1", lambda: fa(q, k, v, scale=-1), _matches(q, k, v, scale=-1.0)))
    P(Probe("numpy scale=np.float32", lambda: fa(q, k, v, scale=np.float32(0.5)), _matches(q, k, v, scale=0.5)))
    P(Probe("numpy max_bias=126", lambda: fa(q, k, v, causal=True, max_bias=126), _matches(q, k, v, causal=True, max_bias=126.0)))
    P(Probe("numpy softcap tiny normal", lambda: fa(q, k, v, softcap=1.2e-38), _matches(q, k, v, softcap=1.2e-38)))
    P(Probe("numpy window=np.int64", lambda: fa(q, k, v, window=np.int64(5)), _matches(q, k, v, causal=True, window=5)))

    # -- arrays: dtypes, ranks, shapes, byte order, alignment, views
    be = lambda a: a.astype(a.dtype.newbyteorder("S"))  # noqa: E731
    P(Probe("q big-endian", lambda: fa(be(q), k, v), _matches(q, k, v)))
    P(Probe("k, v big-endian", lambda: fa(q, be(k), be(v)), _matches(q, k, v)))
    P(Probe("mask big-endian", lambda: fa(q, k, v, be(mask)), _matches(q, k, v, mask)))
    P(Probe("q float64", lambda: fa(q.astype(np.float64), k, v)))
    P(Probe("q int32", lambda: fa(q.astype(np.int32), k, v)))
    P(Probe("q complex", lambda: fa(q.astype(np.complex64), k, v)))
    # float32 K/V are read as they are (issue 28); float64 ones are refused.
    k32, v32 = k.astype(np.float32), v.astype(np.float32)
    P(Probe("k float32", lambda: fa(q, k32, v32), _matches(q, k32, v32)))
    P(Probe("k float64", lambda: fa(q, k.astype(np.float64), v.astype(np.float64))))
    P(Probe("k f16 v bf16", lambda: fa(q, k, v.astype(_bf16()))))
    P(Probe("q 2-D", lambda: fa(q[0], k[0], v[0])))
    P(Probe("q 5-D", lambda: fa(q[None, None], k[None, None], v[None, None])))
    P(Probe("q 4-D, k 3-D", lambda: fa(q[None], k, v)))
    # A head dim without a kernel runs zero-padded on the next one (issue 28); none beyond 512.
    P(Probe("head dim 63", lambda: fa(q[..., :63], k[..., :63], v[..., :63]), _matches(q[..., :63], k[..., :63], v[..., :63])))
    P(Probe("head dim 600", lambda: fa(*(np.zeros(x.shape[:-1] + (600,), x.dtype) for x in (q, k, v)))))
    P(Probe("head dim 0", lambda: fa(q[..., :0], k[..., :0], v[..., :0])))
    P(Probe("heads 3 over 2", lambda: fa(q[:, :3], k, v)))
    P(Probe("kv heads 0", lambda: fa(q, k[:, :0], v[:, :0])))
    P(Probe("v rows != k rows", lambda: fa(q, k, v[:-1])))
    P(Probe("q a list", lambda: fa(q.tolist(), k, v)))
    P(Probe("q a scalar", lambda: fa(1.0, k, v)))
    P(Probe("q None", lambda: fa(None, k, v)))
    P(Probe("q a string", lambda: fa("q", k, v)))
    P(Probe("q object array", lambda: fa(np.array([object()]), k, v)))
    P(Probe("rows 0", lambda: fa(q[:0], k, v), lambda r: r.shape == (0, 4, 64)))
    P(Probe("kv 0 (no description)", lambda: fa(q, k[:0], v[:0]), lambda r: r.shape == q.shape and not r.any()))
    P(Probe("kv 0 causal", lambda: fa(q, k[:0], v[:0], causal=True)))
    P(Probe("q reversed rows", lambda: fa(q[::-1], k, v), _matches(q[::-1].copy(), k, v)))
    P(Probe("q last axis strided", lambda: fa(np.repeat(q, 2, -1)[..., ::2], k, v), _matches(q, k, v)))
    P(Probe("q unaligned", lambda: fa(_unaligned(q), k, v), _matches(q, k, v)))
    P(Probe("k unaligned", lambda: fa(q, _unaligned(k), v), _matches(q, k, v)))
    P(Probe("q read-only", lambda: fa(_readonly(q), k, v), _matches(q, k, v)))
    P(Probe("v = k[..., :512] at 576", lambda: fa(*_mla()), None if False else _mla_check()))

    # -- masks
    P(Probe("mask int32", lambda: fa(q, k, v, mask.astype(np.int32))))
    P(Probe("mask wrong rows", lambda: fa(q, k, v, mask[:-1])))
    P(Probe("mask wrong kv", lambda: fa(q, k, v, mask[:, :-1])))
    P(Probe("mask 5-D", lambda: fa(q, k, v, mask[None, None, None])))
    P(Probe("mask per head", lambda: fa(q[None], k[None], v[None], np.repeat(mask[None, None], 4, 1))))
    P(Probe("mask bool", lambda: fa(q, k, v, mask > 0), _matches(q, k, v, mask > 0)))
    P(Probe("mask float64 finfo.min", lambda: fa(q, k, v, np.where(mask > 0, 0, np.finfo(np.float64).min)),
            _matches(q, k, v, np.where(mask > 0, 0, -np.inf))))  # fmt: skip
    P(Probe("mask with cu_seqlens", lambda: fa(q, k, v, mask, cu_seqlens_q=np.array([0, rows], np.int32),
                                              cu_seqlens_k=np.array([0, kv], np.int32))))  # fmt: skip
    P(Probe("mask a list", lambda: fa(q, k, v, mask.tolist())))

    # -- variable length
    cq, ck = np.array([0, 10, rows], np.int32), np.array([0, 12, kv], np.int32)
    P(Probe("cu_seqlens valid", lambda: fa(q, k, v, causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck),
            _matches(q, k, v, causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck)))  # fmt: skip
    for name, a, b in [("q only", cq, None), ("float", cq.astype(np.float32), ck), ("decreasing", cq[::-1].copy(), ck),
                       ("not from 0", cq + 1, ck), ("not to total", cq[:-1], ck[:-1]), ("lengths differ", cq, ck[[0, 2]]),
                       ("2-D", cq[None], ck[None]), ("empty", cq[:0], ck[:0]), ("a list", list(cq), list(ck)),
                       ("cache shorter", cq, np.array([0, 5, kv], np.int32))]:  # fmt: skip
        P(Probe(f"cu_seqlens {name}", lambda a=a, b=b: fa(q, k, v, causal=True, cu_seqlens_q=a, cu_seqlens_k=b)))
    P(Probe("cu_seqlens 4-D q", lambda: fa(q[None], k[None], v[None], cu_seqlens_q=cq, cu_seqlens_k=ck)))
    P(Probe("cu_seqlens int64", lambda: fa(q, k, v, causal=True, cu_seqlens_q=cq.astype(np.int64), cu_seqlens_k=ck.astype(np.int64)),
            _matches(q, k, v, causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck)))  # fmt: skip

    # -- score transforms
    s = _rng().uniform(-1, 1, 4).astype(np.float32)
    P(Probe("sinks valid", lambda: fa(q, k, v, sinks=s), _matches(q, k, v, sinks=s)))
    P(Probe("sinks float64", lambda: fa(q, k, v, sinks=s.astype(np.float64))))
    P(Probe("sinks short", lambda: fa(q, k, v, sinks=s[:3])))
    P(Probe("sinks 2-D", lambda: fa(q, k, v, sinks=s[None])))
    P(Probe("sinks a list", lambda: fa(q, k, v, sinks=list(s))))
    P(Probe("sinks big-endian", lambda: fa(q, k, v, sinks=be(s)), _matches(q, k, v, sinks=s)))
    P(Probe("ALiBi without positions", lambda: fa(q, k, v, max_bias=8)))
    P(Probe("ALiBi 6 heads", lambda: fa(*_qkv(nh=6, nkv=2), causal=True, max_bias=8),
            _matches(*_qkv(nh=6, nkv=2), causal=True, max_bias=8.0)))  # fmt: skip

    # -- plans and specs
    plan = mn.PrefillPlan(q, k, v, causal=True)
    P(Probe("plan run wrong shape", lambda: plan.run(q[:-1], k, v)))
    P(Probe("plan run wrong dtype", lambda: plan.run(q.astype(np.float16), k, v)))
    P(Probe("plan run only q", lambda: plan.run(q)))
    P(Probe("plan run with a mask", lambda: plan.run(q, k, v, mask)))
    P(Probe("plan run with sinks", lambda: plan.run(q, k, v, sinks=s)))
    P(Probe("plan run out wrong dtype", lambda: plan.run(q, k, v, out=np.empty(q.shape, np.float16))))
    P(Probe("plan run out read-only", lambda: plan.run(q, k, v, out=_readonly(np.empty(q.shape, np.float32)))))
    P(Probe("plan run out strided", lambda: plan.run(q, k, v, out=np.empty(q.shape[:-1] + (128,), np.float32)[..., ::2])))
    P(Probe("plan run out big-endian", lambda: plan.run(q, k, v, out=np.empty(q.shape, ">f4"))))
    P(Probe("plan run out unaligned", lambda: plan.run(q, k, v, out=_unaligned(np.empty(q.shape, np.float32)))))
    P(Probe("plan run out aliasing q", lambda: plan.run(q.copy(), k, v, out=q.copy()), _matches(q, k, v, causal=True)))
    P(Probe("plan run lse without lse", lambda: plan.run(q, k, v, lse=np.empty((4, rows), np.float32))))
    P(Probe("plan pickled", lambda: __import__("pickle").dumps(plan)))
    spec_plan = mn.PrefillPlan(mn.ArraySpec(q.shape, "float32"), mn.ArraySpec(k.shape, "float16"), mn.ArraySpec(v.shape, "float16"))
    P(Probe("spec plan run()", lambda: spec_plan.run()))
    P(Probe("spec plan run(q, k, v)", lambda: spec_plan.run(q, k, v), _matches(q, k, v)))
    for shape in [(8.7, 2, 64), (-1, 2, 64), (2**64, 2, 64), "8,2,64", None, (True, 2, 64)]:
        P(Probe(f"ArraySpec {shape!r}", lambda shape=shape: mn.ArraySpec(shape, "float32")))
    P(Probe("ArraySpec dtype 'float128'", lambda: mn.ArraySpec((8, 2, 64), "float128")))
    P(Probe("ArraySpec strides 1.0", lambda: mn.ArraySpec((8, 2, 64), "float32", (128, 64, 1.0))))
    P(Probe("ArraySpec device 'gpu'", lambda: mn.ArraySpec((8, 2, 64), "float32", device="gpu")))
    P(Probe("PrefillPlan of ArraySpec and mask spec 3-D", lambda: mn.PrefillPlan(mn.ArraySpec(q.shape, "float32"), k, v,
                                                                             mn.ArraySpec((1, rows, kv), "bool")),
            lambda p: p.has_mask))  # fmt: skip

    # -- merge
    o1, l1 = fa(q, k, v, return_lse=True)
    P(Probe("merge valid", lambda: mn.merge_attention_states(o1, l1, o1, l1),
            lambda r: np.allclose(r[0], o1, atol=1e-6) and np.allclose(r[1], l1 + np.log(2), atol=1e-5)))  # fmt: skip
    P(Probe("merge lse shape", lambda: mn.merge_attention_states(o1, l1.T, o1, l1.T)))
    P(Probe("merge mixed libraries", lambda: mn.merge_attention_states(o1, l1, _torch().from_numpy(o1), l1)))
    P(Probe("merge int", lambda: mn.merge_attention_states(o1.astype(np.int32), l1, o1, l1)))
    P(Probe("merge NaN lse", lambda: mn.merge_attention_states(o1, _nan_at(l1), o1, l1),
            lambda r: np.isnan(r[1][0, 0]) and np.isnan(r[0][0, 0]).all()))  # fmt: skip

    # -- devices, buffers, params, process-wide settings
    dev = mn.Device("cpu")
    P(Probe("Device(0)", lambda: mn.Device(0)))
    P(Probe("Device('tpu')", lambda: mn.Device("tpu")))
    P(Probe("Device.empty((2.5,))", lambda: dev.empty((2.5,))))
    P(Probe("Device.empty(-1)", lambda: dev.empty(-1)))
    P(Probe("Device.empty(float64)", lambda: dev.empty((4,), np.float64)))
    P(Probe("Buffer.write short", lambda: dev.empty((8,)).write(np.ones(4, np.float32))))
    P(Probe("Buffer.write wrong dtype", lambda: dev.empty((8,)).write(np.ones(8, np.float16))))
    P(Probe("Buffer.view past the end", lambda: dev.empty((8,)).view(16, (8,))))
    P(Probe("Buffer.view 1.0", lambda: dev.empty((8,)).view(1.0, (2,))))
    P(Probe("params rows=1.9", lambda: mn.FlashAttnPrefillTensorParams(1.9, 1, 1, 256, 64, 256, 256, 256, 256, 256, 256)._to_c()))
    P(Probe("params scale nan", lambda: mn.FlashAttnPrefillTensorParams(32, 1, 1, 256, 64, 256, 256, 256, 256, 256, 256,
                                                                       float("nan"))._to_c()))  # fmt: skip
    P(Probe("queries_per_threadgroup(256.0)", lambda: mn.queries_per_threadgroup(256.0)))
    P(Probe("kv_pad(-1)", lambda: mn.kv_pad(-1)))
    P(Probe("force_cpu_isa(5)", lambda: mn.force_cpu_isa(5)))
    P(Probe("force_cpu_isa('sse')", lambda: mn.force_cpu_isa("sse")))
    P(Probe("set_num_threads(-1)", lambda: mn.set_num_threads(-1)))
    P(Probe("set_num_threads(2.0)", lambda: mn.set_num_threads(2.0)))
    P(Probe("cpu_fma_peak(1.5)", lambda: mn.cpu_fma_peak(1.5)))
    P(Probe("cuda_compile_check(90)", lambda: mn.cuda_compile_check(90)))
    P(Probe("flash_attn_prefill_blk bq='1'", lambda: mn.flash_attn_prefill_blk(np.zeros((4, 64), np.float16), bq="1")))
    P(Probe("causal_mask(4, 4, window=0)", lambda: mn.causal_mask(4, 4, window=0)))

    # -- torch: meta, mixed, grad, devices
    torch = _torch()
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    P(Probe("torch valid", lambda: fa(tq, tk, tv, causal=True), _matches(q, k, v, causal=True)))
    P(Probe("torch meta mask", lambda: fa(tq, tk, tv, torch.zeros(rows, kv, device="meta"))))
    P(Probe("torch meta k", lambda: fa(tq, tk.to("meta"), tv)))
    P(Probe("torch meta sinks", lambda: fa(tq, tk, tv, sinks=torch.zeros(4, device="meta"))))
    P(Probe("torch meta cu_seqlens", lambda: fa(tq, tk, tv, causal=True, cu_seqlens_q=torch.from_numpy(cq),
                                                cu_seqlens_k=torch.from_numpy(ck).to("meta"))))  # fmt: skip
    P(Probe("torch all meta, bad head dims", lambda: fa(tq.to("meta"), tk[..., :32].to("meta"), tv.to("meta"))))
    P(Probe("torch all meta", lambda: fa(tq.to("meta"), tk.to("meta"), tv.to("meta")), lambda r: r.shape == tq.shape))
    P(Probe("torch q, numpy f16 mask", lambda: fa(tq, tk, tv, mask), _matches(q, k, v, mask)))
    P(Probe("numpy q, torch k/v", lambda: fa(q, tk, tv), _matches(q, k, v)))
    P(Probe("torch q requires grad", lambda: fa(tq.clone().requires_grad_(), tk, tv).detach(), _matches(q, k, v)))
    P(Probe("torch q requires grad, backward", lambda: fa(tq.clone().requires_grad_(), tk, tv).sum().backward()))
    P(Probe("torch q int64", lambda: fa(tq.long(), tk, tv)))
    P(Probe("torch q complex", lambda: fa(tq.to(torch.complex64), tk, tv)))
    P(Probe("torch sinks float16", lambda: fa(tq, tk, tv, sinks=torch.from_numpy(s).half())))
    P(Probe("torch op direct, bad window", lambda: torch.ops.mlx_native.flash_attn_prefill(tq, tk, tv, None, True, 0)))
    P(Probe("torch op direct, head dim 63", lambda: torch.ops.mlx_native.flash_attn_prefill(tq[..., :63], tk[..., :63],
                                                                                           tv[..., :63])))  # fmt: skip
    P(Probe("torch huge output", lambda: fa(torch.zeros(1, 1, 64).expand(2**22, 4096, 64),
                                           torch.zeros(1, 1, 64, dtype=torch.float16).expand(64, 1, 64),
                                           torch.zeros(1, 1, 64, dtype=torch.float16).expand(64, 1, 64))))  # fmt: skip
    P(Probe("torch out_dtype torch.float64", lambda: fa(tq, tk, tv, out_dtype=torch.float64)))
    P(Probe("torch softcap tiny", lambda: fa(tq, tk, tv, softcap=1e-50)))
    P(Probe("torch out_dtype bfloat16", lambda: fa(tq, tk, tv, out_dtype=torch.bfloat16),
            lambda r: r.dtype == torch.bfloat16 and _matches(q, k, v)(r.float())))  # fmt: skip
    return out


def _bf16():
    import ml_dtypes

    return ml_dtypes.bfloat16


def _unaligned(a: np.ndarray) -> np.ndarray:
    raw = np.zeros(a.nbytes + 1, np.uint8)
    u = raw[1:].view(a.dtype).reshape(a.shape)
    u[...] = a
    return u


def _readonly(a: np.ndarray) -> np.ndarray:
    a = a.copy()
    a.flags.writeable = False
    return a


def _nan_at(a: np.ndarray) -> np.ndarray:
    a = a.copy()
    a[0, 0] = np.nan
    return a


def _mla():
    q, k, _ = _qkv(rows=8, nh=2, nkv=1, d=576, kv=16)
    return q, k, k[..., :512]


def _mla_check():
    q, k, v = _mla()
    return _matches(q, k, v)


def run(probe: Probe) -> str:
    try:
        res = probe.call()
    except mn.MlxError:
        return "typed" if probe.check is None else "refused"
    except Exception:  # noqa: BLE001 - the outcome this catalogue exists to catch
        return "untyped"
    if probe.check is None:
        return "wrong"
    try:
        return "result" if probe.check(res) else "wrong"
    except Exception:  # noqa: BLE001
        return "wrong"


def run_all() -> Dict[str, List[str]]:
    """Every probe's outcome: the names of the probes by outcome."""
    outcomes: Dict[str, List[str]] = {}
    try:
        for p in probes():
            outcomes.setdefault(run(p), []).append(p.name)
    finally:
        mn.force_cpu_isa(None)
        mn.set_num_threads(None)
    return outcomes


if __name__ == "__main__":
    res = run_all()
    total = sum(len(v) for v in res.values())
    print(f"{total} probes: " + ", ".join(f"{k} {len(v)}" for k, v in sorted(res.items())))
    for bad in ("wrong", "untyped", "refused"):
        for name in res.get(bad, []):
            print(f"  {bad}: {name}")
    sys.exit(1 if any(res.get(b) for b in ("wrong", "untyped", "refused")) else 0)
