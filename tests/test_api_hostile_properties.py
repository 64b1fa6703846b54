"""The whole public API under random wrong arguments (issue 27): a valid prefill is drawn,
then some of its arguments are replaced by hostile values (wrong kinds, out-of-range and
edge numbers, arrays of the wrong dtype, shape, byte order, device or library, views,
outputs of the wrong layout). Every outcome must be either a result that matches the
float64 reference on the arguments as given, or a typed error (an ``MlxError``, also a
builtin); never another exception; and on an error no output is written and no input
changes. The same for the plan's run with the caller's outputs, for the merge, and for the
layouts' and buffers' constructors.

Examples: ``MLXN_HOSTILE_CASES`` (default 150 per property); CI runs a fixed seed
(``MLXN_FUZZ_SEED=random`` explores, as in tests/test_fuzz.py)."""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlx_native as mn
from helpers import import_test_extra
from mlx_native.reference import merge_reference, nmse, reference_prefill

torch = import_test_extra("torch")


def _settings(default: int):
    seed = os.environ.get("MLXN_FUZZ_SEED")
    return settings(
        max_examples=int(os.environ.get("MLXN_HOSTILE_CASES", default)),
        deadline=None,
        database=None,
        derandomize=seed is None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


#: Values of the wrong kind or at the edges, for any scalar argument.
HOSTILE_SCALARS = [
    None, True, False, 0, 1, -1, 3, 2**31 - 1, 2**31, 2**63, -(2**31) - 1, 10**400, 0.0, -0.0, 0.5, 1.5, 1e-50,
    -1e-50, 1e-40, 2.0**200, float("nan"), float("inf"), -float("inf"), "1", "", b"1", [1], (1,), {}, object(),
    np.float32(0.5), np.float64(2.0), np.int64(4), np.int32(-2), np.bool_(True), np.array(1.0), np.array([1, 2]),
    complex(1, 1),
]  # fmt: skip
KEYWORDS = ("causal", "window", "offset", "scale", "return_lse", "out_dtype", "device", "check_finite", "softcap",
            "max_bias", "layout")  # fmt: skip
ARRAY_MUTATIONS = (
    "float64", "int32", "bool", "bfloat16", "float16", "float32", "byteswap", "transpose", "drop_axis", "add_axis",
    "slice_last", "reversed", "strided_last", "empty", "list", "scalar", "meta", "other_library", "unaligned",
)  # fmt: skip


def _mutate_array(x, how: str, rng):
    """``x`` (numpy) changed by ``how``."""
    import ml_dtypes

    if how in ("float64", "int32", "bool", "float16", "float32"):
        return x.astype(how)
    if how == "bfloat16":
        return x.astype(ml_dtypes.bfloat16)
    if how == "byteswap":
        return x.astype(x.dtype.newbyteorder("S")) if x.dtype.itemsize > 1 else x
    if how == "transpose":
        return np.swapaxes(x, 0, -2) if x.ndim >= 2 else x
    if how == "drop_axis":
        return x[0] if x.ndim else x
    if how == "add_axis":
        return x[None]
    if how == "slice_last":
        return x[..., : max(1, x.shape[-1] // 2)] if x.ndim else x
    if how == "reversed":
        return x[::-1]
    if how == "strided_last":
        big = np.repeat(x, 2, axis=-1) if x.ndim else x
        return big[..., ::2] if x.ndim else x
    if how == "empty":
        return x[:0]
    if how == "list":
        return x.tolist()
    if how == "scalar":
        return float(x.ravel()[0]) if x.size else 0.0
    if how == "meta":
        return torch.empty(x.shape, dtype=torch.float32, device="meta")
    if how == "other_library":
        return torch.from_numpy(np.ascontiguousarray(x)) if x.dtype.isnative and x.dtype.name != "bfloat16" else x
    if how == "unaligned":
        raw = np.zeros(x.nbytes + 1, np.uint8)
        u = raw[1:].view(x.dtype).reshape(x.shape) if x.dtype.itemsize > 1 else raw[1:].view(x.dtype)
        u[...] = x
        return u
    raise AssertionError(how)


@st.composite
def prefill_calls(draw):
    """A valid small prefill, then up to three arguments replaced by hostile values."""
    nkv = draw(st.integers(1, 2))
    nh = nkv * draw(st.integers(1, 3))
    d = draw(st.sampled_from([64, 80, 128]))
    rows, kv = draw(st.integers(1, 24)), draw(st.integers(1, 40))
    kv = max(kv, rows)
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    args = dict(
        q=rng.uniform(-1, 1, (rows, nh, d)).astype(draw(st.sampled_from(["float32", "float16"]))),
        k=rng.uniform(-1, 1, (kv, nkv, d)).astype(np.float16),
        v=rng.uniform(-1, 1, (kv, nkv, d)).astype(np.float16),
    )
    if draw(st.booleans()):
        m = rng.uniform(-1, 1, (rows, kv)).astype(np.float32)
        m[rng.random((rows, kv)) < 0.3] = -np.inf
        args["mask"] = m
    kw = dict(causal=draw(st.booleans()))
    if draw(st.booleans()):
        kw["window"] = draw(st.integers(1, 50))
    if draw(st.booleans()):
        kw["softcap"] = draw(st.sampled_from([0.0, 2.0, 30.0]))
    if draw(st.booleans()):
        kw["sinks"] = rng.uniform(-1, 1, nh).astype(np.float32)
    kw["return_lse"] = draw(st.booleans())
    hostile = []
    for _ in range(draw(st.integers(0, 3))):
        target = draw(st.sampled_from(["q", "k", "v", "mask", "sinks"] + list(KEYWORDS)))
        if target in ("q", "k", "v", "mask", "sinks"):
            base = args.get(target, kw.get(target))
            if not isinstance(base, np.ndarray):  # absent, or already replaced by a hostile value
                base = rng.uniform(-1, 1, (rows, kv)).astype(np.float16) if target == "mask" else np.zeros(nh, np.float32)
            how = draw(st.sampled_from(ARRAY_MUTATIONS))
            value = _mutate_array(base, how, rng)
            hostile.append((target, how))
        else:
            value = draw(st.sampled_from(HOSTILE_SCALARS + ["float16", "bfloat16", "int8", "cpu", "cuda:7", "gpu"]))
            hostile.append((target, repr(value)[:40]))
        (args if target in ("q", "k", "v", "mask") else kw)[target] = value
    lib = draw(st.sampled_from(["numpy", "torch"]))
    return args, kw, lib, hostile


def _to_lib(x, lib):
    if (lib == "torch" and isinstance(x, np.ndarray) and x.dtype.isnative and x.dtype.name != "bfloat16"
            and x.flags.aligned and min(x.strides, default=0) >= 0):  # what torch.from_numpy takes
        return torch.from_numpy(x)
    return x


def _as_reference_input(x):
    """The numbers the call was given, as numpy (None for anything that is not an array)."""
    if isinstance(x, torch.Tensor):
        return None if x.device.type == "meta" else x.float().numpy()
    if isinstance(x, np.ndarray):
        return x.astype(x.dtype.newbyteorder("=")) if not x.dtype.isnative else x
    return None


def _kernel_mask(m):
    if m is None:
        return None
    m = _as_reference_input(m)
    if m.dtype == np.bool_:
        return np.where(m, 0.0, -np.inf)
    m = m.astype(np.float64)
    return np.where(m <= -65504, -np.inf, m)


def _check_result(res, args, kw):
    """A call that returned: the result is what the reference gives on the arguments as
    given (they were all accepted, so they must mean what the API says)."""
    q, k, v = (_as_reference_input(args[n]) for n in ("q", "k", "v"))
    assert q is not None and k is not None and v is not None, "a non-array was accepted as q, k or v"
    out, lse = (res if kw.get("return_lse") else (res, None))
    out = out.float().numpy() if isinstance(out, torch.Tensor) else np.asarray(out, np.float64)
    causal = bool(kw.get("causal")) or kw.get("window") is not None
    scale = kw.get("scale")
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    sinks = kw.get("sinks")
    ref, ref_lse = reference_prefill(
        q, k, v, _kernel_mask(args.get("mask")), causal=causal, window=kw.get("window"), scale=scale,
        offset=kw.get("offset"), softcap=float(kw.get("softcap") or 0.0), max_bias=float(kw.get("max_bias") or 0.0),
        sinks=None if sinks is None else _as_reference_input(sinks),
    )  # fmt: skip
    assert out.shape == ref.shape
    finite = np.isfinite(ref)
    # half(scale * q) beyond half's range is inf (SPEC 9): those rows are not finite either way.
    assert np.array_equal(finite, np.isfinite(out)), "finite where the reference is not, or the other way"
    if finite.any():
        assert nmse(out[finite], ref[finite]) <= 5e-4, nmse(out[finite], ref[finite])
    if lse is not None:
        lse = lse.numpy() if isinstance(lse, torch.Tensor) else lse
        ok = np.isfinite(ref_lse)
        assert np.array_equal(ok, np.isfinite(lse)) and np.allclose(lse[ok], ref_lse[ok], atol=2e-3)


def _snapshot(args, kw):
    return {
        n: (x.clone() if isinstance(x, torch.Tensor) and x.device.type != "meta" else np.array(x, copy=True))
        for n, x in list(args.items()) + [("sinks", kw.get("sinks"))]
        if isinstance(x, (np.ndarray, torch.Tensor)) and not (isinstance(x, torch.Tensor) and x.device.type == "meta")
    }


def _unchanged(before, args, kw):
    now = dict(args, sinks=kw.get("sinks"))
    for n, x in before.items():
        y = now[n]
        same = torch.equal(x, y) if isinstance(x, torch.Tensor) else np.array_equal(x, y, equal_nan=x.dtype.kind == "f")
        assert same, f"{n} was written"


@_settings(150)
@given(prefill_calls())
def test_the_front_door_gives_a_right_result_or_a_typed_error(call):
    args, kw, lib, hostile = call
    args = {n: _to_lib(x, lib) for n, x in args.items()}
    kw = {n: _to_lib(x, lib) if n == "sinks" else x for n, x in kw.items()}
    before = _snapshot(args, kw)
    try:
        res = mn.flash_attn_prefill(**args, **kw)
    except mn.MlxError as e:
        assert isinstance(e, (ValueError, TypeError, RuntimeError, MemoryError, LookupError, NotImplementedError)), e
        _unchanged(before, args, kw)
        return
    except Exception as e:  # pragma: no cover - the failure this test exists for
        pytest.fail(f"untyped {type(e).__name__}: {e} (hostile: {hostile})")
    _unchanged(before, args, kw)
    _check_result(res, args, kw)


@st.composite
def plan_runs(draw):
    """A valid plan, then a run with hostile outputs (wrong shape, dtype, layout, library,
    read-only, byte order, alignment) or hostile arrays."""
    args, kw, _, _ = draw(prefill_calls().filter(lambda c: not c[3]))
    q = args["q"]
    out_shape = q.shape[:-1] + (args["v"].shape[-1],)
    out = np.full(out_shape, 7.0, q.dtype)
    how = draw(st.sampled_from(["good", "float64", "float16", "transpose", "slice_last", "readonly", "byteswap",
                                "unaligned", "torch", "list", "short"]))  # fmt: skip
    if how == "readonly":
        out.flags.writeable = False
    elif how == "short":
        out = out[:-1] if out.shape[0] > 1 else out[..., :-1]
    elif how == "torch":
        out = torch.from_numpy(out)
    elif how != "good":
        out = _mutate_array(out, how, np.random.default_rng(0))
        if isinstance(out, np.ndarray):
            out[...] = 7.0
            fits = out.dtype == q.dtype and out.shape == out_shape and out.flags.c_contiguous and out.flags.aligned
            how = "good" if fits else how  # a change that changed nothing (q's own dtype)
    return args, kw, out, how


@_settings(80)
@given(plan_runs())
def test_a_plan_s_run_writes_a_right_result_or_nothing(case):
    args, kw, out, how = case
    kw = dict(kw, return_lse=False)
    plan = mn.PrefillPlan(**args, **{n: x for n, x in kw.items() if n != "sinks"}, sinks=kw.get("sinks"))
    before = np.array(out, copy=True) if isinstance(out, np.ndarray) else (out.clone() if isinstance(out, torch.Tensor) else out)
    try:
        res = plan.run(args["q"], args["k"], args["v"], args.get("mask"), sinks=kw.get("sinks"), out=out)
    except mn.MlxError:
        if isinstance(out, np.ndarray):
            assert np.array_equal(out, before), "the output was written by a failed run"
        elif isinstance(out, torch.Tensor):
            assert torch.equal(out, before)
        return
    except Exception as e:  # pragma: no cover
        pytest.fail(f"untyped {type(e).__name__}: {e} (out: {how})")
    assert how in ("good", "torch"), f"an output {how} was taken"  # a host tensor of the right layout is one
    assert res is out
    _check_result(res, args, kw)


@_settings(120)
@given(
    st.integers(1, 4), st.integers(1, 3), st.integers(1, 5), st.integers(0, 2**32 - 1),
    st.sampled_from(["none", "nan", "inf", "-inf", "shape", "dtype", "library", "list", "rank", "bf16"]),
)  # fmt: skip
def test_merge_gives_the_reference_or_a_typed_error(rows, heads, dim, seed, how):
    rng = np.random.default_rng(seed)
    o1, o2 = (rng.uniform(-1, 1, (rows, heads, dim)).astype(np.float32) for _ in range(2))
    l1, l2 = (rng.uniform(-3, 3, (heads, rows)).astype(np.float32) for _ in range(2))
    args = [o1, l1, o2, l2]
    i = int(rng.integers(0, 4))
    if how in ("nan", "inf", "-inf"):
        args[1 + 2 * (i % 2)][0, 0] = float(how)
    elif how == "shape":
        args[i] = args[i][..., :-1] if args[i].shape[-1] > 1 else args[i][None]
    elif how == "dtype":
        args[i] = args[i].astype(np.int32)
    elif how == "library":
        args[i] = torch.from_numpy(args[i])
    elif how == "list":
        args[i] = args[i].tolist()
    elif how == "rank":
        args[i] = args[i][0]
    elif how == "bf16":
        import ml_dtypes

        args[i] = args[i].astype(ml_dtypes.bfloat16)
    try:
        out, lse = mn.merge_attention_states(*args)
    except mn.MlxError:
        assert how in ("shape", "dtype", "library", "list", "rank"), f"refused a {how} merge"
        return
    except Exception as e:  # pragma: no cover
        pytest.fail(f"untyped {type(e).__name__}: {e} ({how})")
    ref, ref_lse = merge_reference(*(np.asarray(a, np.float64) for a in args))
    if how == "nan":
        bad = np.isnan(np.asarray(args[1], np.float64)) | np.isnan(np.asarray(args[3], np.float64))
        assert np.isnan(lse[bad]).all() and np.isnan(out.swapaxes(0, 1)[bad]).all()
        ok = ~bad
        assert np.allclose(lse[ok], ref_lse[ok], atol=1e-5, equal_nan=False)
        return
    # (+inf in an lse, which no kernel gives, makes NaN in both: there is no right answer.)
    assert np.array_equal(np.isnan(lse), np.isnan(ref_lse)) and np.array_equal(np.isfinite(lse), np.isfinite(ref_lse))
    fin = np.isfinite(ref_lse)
    assert np.allclose(lse[fin], ref_lse[fin], atol=1e-5)
    # The output has o1's dtype: bfloat16 holds 8 bits of it.
    assert np.allclose(np.asarray(out, np.float64), ref, atol=1e-2 if how == "bf16" else 1e-5, equal_nan=True)


@_settings(150)
@given(st.data())
def test_layouts_buffers_and_params_take_what_they_say_or_a_typed_error(data):
    """The constructors of the low level: a value is taken as exactly what it is, or refused."""
    what = data.draw(st.sampled_from(["spec", "empty", "write", "params", "qpt", "kv_pad", "isa", "threads", "blk"]))
    value = data.draw(st.sampled_from(HOSTILE_SCALARS + [(8, 2, 64), (2.0, 3), (-1,), (2**40, 2**40), [3, 4]]))
    dev = mn.Device("cpu")
    try:
        if what == "spec":
            r = mn.ArraySpec(value, "float16")
            assert isinstance(value, (tuple, list, int, np.integer)) and list(r.shape) == list(np.atleast_1d(value))
        elif what == "empty":
            r = dev.empty(value)
            assert r.numpy().size == int(np.prod(np.atleast_1d(value))) and not r.numpy().any()
        elif what == "write":
            b = dev.empty((4,))
            b.write(value)
            assert isinstance(value, np.ndarray) and value.size == 4
        elif what == "params":
            p = mn.FlashAttnPrefillTensorParams(value, 1, 1, 256, 64, 256, 256, 256, 256, 256, 256)
            assert p._to_c().rows == value
        elif what == "qpt":
            assert mn.queries_per_threadgroup(value) in (16, 32) and value in (256, 512)
        elif what == "kv_pad":
            assert mn.kv_pad(value) % 64 == 0 and 0 <= mn.kv_pad(value) - value < 64
        elif what == "isa":
            mn.force_cpu_isa(value)
            assert value in (None, "", "auto") or value in mn.cpu_info()["detected"]
        elif what == "threads":
            mn.set_num_threads(value)
            assert mn.get_num_threads() == (int(value) if value else mn.get_num_threads())
        elif what == "blk":
            mask = np.zeros((4, 64), np.float16)
            r = mn.flash_attn_prefill_blk(mask, bq=value)
            assert isinstance(value, (int, np.integer))
    except mn.MlxError:
        pass
    except Exception as e:  # pragma: no cover
        pytest.fail(f"untyped {type(e).__name__} from {what}({value!r}): {e}")
    finally:
        mn.force_cpu_isa(None)
        mn.set_num_threads(None)
