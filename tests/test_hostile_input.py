"""Hostile and careless input (issue 27): each class of failure the probes found, one test
each, on the CPU (and CUDA where the class can arise there): a correct result or a typed
error (an ``MlxError`` that is also a builtin), never a silent wrong result, a crash, a hang
or another exception; and no output written on an error."""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mlx_native as mn
from helpers import import_test_extra

torch = import_test_extra("torch")

HAS_CUDA = "cuda" in mn.backends()
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU")


def _qkv(rng, rows=40, nh=4, nkv=2, d=64, kv=48):
    q = rng.uniform(-1, 1, (rows, nh, d)).astype(np.float32)
    k = rng.uniform(-1, 1, (kv, nkv, d)).astype(np.float16)
    v = rng.uniform(-1, 1, (kv, nkv, d)).astype(np.float16)
    return q, k, v


def _run_python(code: str, env=None, timeout=120) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (a fork, a crash or a hang stays there)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout,
        env=dict(os.environ, **(env or {})),
    )  # fmt: skip


# ------------------------------------------------------------------ fork, environment, settings


def test_a_forked_child_runs_the_cpu_kernels_after_its_parent_did():
    # The parent's call starts the worker threads; fork copies none of them. Before the
    # pool remembered its process, the child waited for ever on them.
    r = _run_python(
        """
        import os, numpy as np, mlx_native as mn
        rng = np.random.default_rng(0)
        q = rng.uniform(-1, 1, (1024, 8, 128)).astype(np.float32)
        k = rng.uniform(-1, 1, (1024, 2, 128)).astype(np.float16)
        v = rng.uniform(-1, 1, (1024, 2, 128)).astype(np.float16)
        want = mn.flash_attn_prefill(q, k, v, causal=True)
        pid = os.fork()
        if pid == 0:
            got = mn.flash_attn_prefill(q, k, v, causal=True)
            os._exit(0 if np.array_equal(got, want) else 3)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
        """,
        timeout=60,
    )
    assert r.returncode == 0 and "child 0" in r.stdout, (r.stdout, r.stderr)


def test_a_forked_child_of_a_torch_program_runs_the_kernels():
    # The parent's torch calls ran on PyTorch's OpenMP threads; the child has none of them
    # (nor of the pool): its calls run on a pool of its own. (PyTorch's own parallel
    # operators hang in such a child unless torch.set_num_threads(1), as DataLoader workers
    # do: the comparison is made with numpy.)
    r = _run_python(
        """
        import os, numpy as np, torch, mlx_native as mn
        q, k = torch.rand(512, 8, 128), torch.rand(512, 2, 128).half()
        want = mn.flash_attn_prefill(q, k, k, causal=True).numpy().copy()
        assert mn.cpu_info()["runtime"].startswith("openmp"), mn.cpu_info()
        pid = os.fork()
        if pid == 0:
            a = mn.flash_attn_prefill(q, k, k, causal=True).numpy()
            b = mn.flash_attn_prefill(q.numpy(), k.numpy(), k.numpy(), causal=True)
            os._exit(0 if np.array_equal(a, want) and np.array_equal(b, want) else 3)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
        """,
        timeout=60,
    )
    assert r.returncode == 0 and "child 0" in r.stdout, (r.stdout, r.stderr)


def test_the_torch_operator_runs_on_torch_s_openmp_threads(rng):
    # A job above the serial threshold, on the library's pool and on PyTorch's OpenMP
    # threads: the same bits (each work item is computed whole by one thread either way).
    from mlx_native._lib import ffi, lib

    q = torch.from_numpy(rng.uniform(-1, 1, (512, 8, 128)).astype(np.float32))
    k = torch.from_numpy(rng.uniform(-1, 1, (512, 2, 128)).astype(np.float16))
    got = mn.flash_attn_prefill(q, k, k, causal=True)
    assert mn.cpu_info()["runtime"].startswith("openmp"), mn.cpu_info()
    found = ffi.new("int32_t *")
    try:
        lib.mlxn_cpu_use_openmp(0, found)
        assert mn.cpu_info()["runtime"] == "rayon"
        want = mn.flash_attn_prefill(q.numpy(), k.numpy(), k.numpy(), causal=True)
    finally:
        lib.mlxn_cpu_use_openmp(1, found)
    assert found[0] == 1
    assert np.array_equal(got.numpy(), want)


def test_calls_under_environment_writes_of_other_threads_do_not_crash():
    # Two threads call while a third writes and deletes environment variables: the
    # library reads its settings once, so no call reads the environment under a writer.
    r = _run_python(
        """
        import os, threading, time, numpy as np, mlx_native as mn
        rng = np.random.default_rng(0)
        q = rng.uniform(-1, 1, (128, 4, 128)).astype(np.float32)
        k = rng.uniform(-1, 1, (128, 2, 128)).astype(np.float16)
        want = mn.flash_attn_prefill(q, k, k)
        stop, bad = False, []
        def write():
            i = 0
            while not stop:
                os.environ[f"MLXN_PROBE_{i % 64}"] = "x" * (i % 200)
                os.environ.pop(f"MLXN_PROBE_{(i + 32) % 64}", None)
                i += 1
        def call():
            t0 = time.time()
            while time.time() - t0 < 3:
                if not np.array_equal(mn.flash_attn_prefill(q, k, k), want):
                    bad.append(1)
        ts = [threading.Thread(target=write)] + [threading.Thread(target=call) for _ in range(2)]
        [t.start() for t in ts]
        [t.join() for t in ts[1:]]
        stop = True
        ts[0].join()
        print("done", len(bad))
        """,
        timeout=90,
    )
    assert r.returncode == 0 and "done 0" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])


def test_a_setting_not_understood_is_a_warning_that_names_it():
    r = _run_python(
        """
        import warnings
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            import mlx_native as mn
        print([str(x.message) for x in w if x.category is RuntimeWarning])
        print(mn.cpu_info()["isa"] == mn.cpu_info()["detected"][0])
        """,
        env={"MLX_NATIVE_CPU_ISA": "avx513", "MLX_NATIVE_CUDA_KV_SPLITS": "three"},
    )
    assert r.returncode == 0, r.stderr
    assert 'MLX_NATIVE_CPU_ISA="avx513" is not an instruction set of this CPU' in r.stdout, r.stdout
    assert 'MLX_NATIVE_CUDA_KV_SPLITS="three"' in r.stdout, r.stdout
    assert r.stdout.strip().endswith("True")  # the best instruction set is used instead


def test_the_instruction_set_setting_is_read_once():
    # Set at start: taken. Changed afterwards in the process: not read again.
    isa = mn.cpu_info()["detected"][-1]  # portable: on every CPU
    r = _run_python(
        """
        import os, mlx_native as mn
        first = mn.cpu_info()["isa"]
        os.environ["MLX_NATIVE_CPU_ISA"] = mn.cpu_info()["detected"][0]
        print(first, mn.cpu_info()["isa"])
        """,
        env={"MLX_NATIVE_CPU_ISA": isa},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [isa, isa]


def test_set_num_threads_sets_the_kernels_threads(rng):
    q, k, v = _qkv(rng)
    want = mn.flash_attn_prefill(q, k, v, causal=True)
    try:
        mn.set_num_threads(1)
        assert mn.get_num_threads() == 1
        assert np.array_equal(mn.flash_attn_prefill(q, k, v, causal=True), want)
        mn.set_num_threads(3)
        assert mn.get_num_threads() == 3
        assert np.array_equal(mn.flash_attn_prefill(q, k, v, causal=True), want)
        for bad, cls in ((-1, mn.InvalidArgumentError), (5000, mn.InvalidArgumentError), (1.5, mn.ArgumentTypeError),
                         ("2", mn.ArgumentTypeError), (True, mn.ArgumentTypeError)):  # fmt: skip
            with pytest.raises(cls):
                mn.set_num_threads(bad)
        assert mn.get_num_threads() == 3
    finally:
        mn.set_num_threads(None)
    assert mn.get_num_threads() >= 1


def test_the_torch_operator_follows_torch_s_threads_unless_set(rng):
    from mlx_native import device as device_module

    q, k, v = (torch.from_numpy(x) for x in _qkv(rng))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        mn.flash_attn_prefill(q, k, v)
        assert mn.get_num_threads() == 1
        torch.set_num_threads(2)
        mn.flash_attn_prefill(q, k, v)
        assert mn.get_num_threads() == 2
        mn.set_num_threads(3)  # the caller's choice wins from now on
        mn.flash_attn_prefill(q, k, v)
        assert mn.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
        mn.set_num_threads(None)
        device_module._threads_applied = 0


@needs_gpu
def test_a_forked_child_of_a_cuda_parent_gets_a_typed_error():
    r = _run_python(
        """
        import os, mlx_native as mn
        mn.Device("cuda")
        pid = os.fork()
        if pid == 0:
            try:
                mn.Device("cuda")
                os._exit(2)
            except mn.BackendUnavailableError as e:
                os._exit(0 if "spawn" in str(e) else 3)
            except BaseException:
                os._exit(4)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
        """
    )
    assert "child 0" in r.stdout, (r.stdout, r.stderr)


# ------------------------------------------------------------------ meta tensors and the fake


def test_a_meta_operand_among_real_ones_is_refused(rng):
    q, k, v = (torch.from_numpy(x) for x in _qkv(rng))
    meta_mask = torch.zeros(40, 48, device="meta")
    for args, kw, name in [
        ((q, k, v, meta_mask), {}, "mask"),
        ((q, k.to("meta"), v), {}, "k"),
        ((q, k, v.to("meta")), dict(causal=True), "v"),
        ((q, k, v), dict(sinks=torch.zeros(4, device="meta")), "sinks"),
    ]:
        with pytest.raises(mn.InvalidArgumentError, match=f"{name} (is|are) on the meta device"):
            mn.flash_attn_prefill(*args, **kw)
    cq = torch.tensor([0, 40], dtype=torch.int32)
    with pytest.raises(mn.InvalidArgumentError, match="meta device"):
        mn.flash_attn_prefill(q, k, v, causal=True, cu_seqlens_q=cq, cu_seqlens_k=torch.tensor([0, 48], dtype=torch.int32,
                              device="meta"))  # fmt: skip


def test_all_meta_calls_are_checked_as_the_real_call_is(rng):
    q, k, v = (torch.from_numpy(x).to("meta") for x in _qkv(rng))
    out = mn.flash_attn_prefill(q, k, v, causal=True)
    assert out.device.type == "meta" and out.shape == (40, 4, 64)
    for args, kw, match in [
        ((q, k[..., :32], v), {}, "head_dim"),
        ((q, k[:, :1].expand(48, 3, 64), v[:, :1].expand(48, 3, 64)), {}, "multiple of n_kv_heads"),
        ((q, k, v), dict(window=0), "window"),
        ((q, k[:10], v[:10]), dict(causal=True), "cannot be shorter"),
        ((q, k, v, torch.zeros(40, 47, device="meta")), {}, "mask must have shape"),
        ((q, k, v), dict(sinks=torch.zeros(3, device="meta")), "sinks must have shape"),
        ((q, k.double(), v.double()), {}, "float16, bfloat16 or float32"),
    ]:
        with pytest.raises(mn.MlxError, match=match):
            mn.flash_attn_prefill(*args, **kw)


# ------------------------------------------------------------------ byte order, alignment, mixed libraries


def test_other_byte_order_arrays_are_read_as_their_values(rng):
    q, k, v = _qkv(rng)
    mask = rng.uniform(-1, 1, (40, 48)).astype(np.float16)
    want = mn.flash_attn_prefill(q, k, v, mask)
    swapped = [x.astype(x.dtype.newbyteorder(">" if sys.byteorder == "little" else "<")) for x in (q, k, v, mask)]
    assert all(not x.dtype.isnative for x in swapped)
    assert np.array_equal(mn.flash_attn_prefill(*swapped), want)
    assert np.array_equal(mn.PrefillPlan(*swapped).run(), want)
    out = np.zeros(want.shape, want.dtype.newbyteorder("S"))
    with pytest.raises(mn.InvalidArgumentError, match="out cannot be written in place: its byte order"):
        mn.PrefillPlan(q, k, v, mask).run(q, k, v, mask, out=out)
    assert not out.any()


def _unaligned(a: np.ndarray) -> np.ndarray:
    raw = np.zeros(a.nbytes + 1, np.uint8)
    u = raw[1:].view(a.dtype).reshape(a.shape)
    u[...] = a
    assert not u.flags.aligned
    return u


def test_unaligned_arrays_are_read_through_a_copy_and_refused_as_outputs(rng):
    q, k, v = _qkv(rng)
    want = mn.flash_attn_prefill(q, k, v, causal=True)
    got = mn.flash_attn_prefill(_unaligned(q), _unaligned(k), _unaligned(v), causal=True)
    assert np.array_equal(got, want)
    # A plan made on aligned arrays and called with unaligned ones of the same layout too.
    assert np.array_equal(mn.flash_attn_prefill(_unaligned(q), k, v, causal=True), want)
    out = _unaligned(np.zeros_like(want))
    with pytest.raises(mn.InvalidArgumentError, match="not aligned"):
        mn.PrefillPlan(q, k, v, causal=True).run(q, k, v, out=out)
    assert not out.any()


@pytest.mark.parametrize("mask_dtype", [np.float16, np.float32])  # float16: used in place, as q/k/v are
def test_numpy_and_torch_operands_mix_as_the_readme_says(rng, mask_dtype):
    q, k, v = _qkv(rng)
    mask = rng.uniform(-1, 1, (40, 48)).astype(mask_dtype)
    tq, tk, tv, tm = (torch.from_numpy(x) for x in (q, k, v, mask))
    for m, tmask in ((None, None), (mask, tm)):
        want = mn.flash_attn_prefill(q, k, v, m)
        for args in ((tq, tk, tv, m), (q, tk, tv, tmask), (tq, k, tv, m), (q, k, tv, tmask), (tq, tk, v, tmask)):
            for _ in range(2):  # the first call makes the plan, the second takes the one-call path
                got = mn.flash_attn_prefill(*args)
                assert type(got) is type(args[0])  # q's library
                assert np.array_equal(np.asarray(got), want)


# ------------------------------------------------------------------ scalars


@pytest.mark.parametrize("name", ["softcap", "max_bias", "scale"])
@pytest.mark.parametrize("value", [1e-50, 1e-42, -1e-50])
def test_a_scalar_that_float32_flushes_to_zero_is_refused(rng, name, value):
    q, k, v = _qkv(rng)
    with pytest.raises(mn.InvalidArgumentError, match=f"{name}"):
        mn.flash_attn_prefill(q, k, v, causal=True, **{name: value})
    with pytest.raises(mn.InvalidArgumentError, match=f"{name}"):
        mn.flash_attn_prefill(*(torch.from_numpy(x) for x in (q, k, v)), causal=True, **{name: value})


@pytest.mark.parametrize("name", ["softcap", "max_bias", "scale", "window", "offset"])
def test_huge_integers_are_typed_errors(rng, name):
    q, k, v = _qkv(rng)
    for value in (10**400, -(10**400), 2**200):  # beyond float, beyond float32
        with pytest.raises(mn.MlxError):
            mn.flash_attn_prefill(q, k, v, causal=True, **{name: value})


def test_a_smallest_normal_scalar_is_taken(rng):
    q, k, v = _qkv(rng)
    tiny = float(np.finfo(np.float32).tiny)
    for name in ("softcap", "max_bias", "scale"):
        assert np.isfinite(mn.flash_attn_prefill(q, k, v, causal=True, **{name: tiny})).all()


# ------------------------------------------------------------------ merge


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_merge_propagates_nan(rng, lib):
    o = rng.uniform(-1, 1, (5, 2, 8)).astype(np.float32)
    l1 = rng.uniform(-1, 1, (2, 5)).astype(np.float32)
    l2 = l1.copy()
    l1[1, 3] = np.nan
    l2[0, 0] = np.nan
    l1[0, 4] = l2[0, 4] = -np.inf
    args = (o, l1, o, l2) if lib == "numpy" else tuple(torch.from_numpy(x) for x in (o, l1, o, l2))
    out, lse = (np.asarray(x) for x in mn.merge_attention_states(*args))
    assert np.isnan(lse[1, 3]) and np.isnan(lse[0, 0])
    assert np.isnan(out[3, 1]).all() and np.isnan(out[0, 0]).all()
    assert lse[0, 4] == -np.inf and (out[4, 0] == 0).all()  # saw nothing: still exact
    finite = np.isfinite(lse)
    assert finite.sum() == 10 - 3


# ------------------------------------------------------------------ specs, buffers, params


@pytest.mark.parametrize("shape", [(8.7, 2, 64), (-8, 2, 64), (2**70, 2, 64), (True, 2, 64), ("8", 2, 64), 8.0])
def test_array_spec_takes_integer_shapes_only(shape):
    with pytest.raises(mn.MlxError):
        mn.ArraySpec(shape, "float32")


def test_array_spec_takes_integer_strides_and_device_names():
    for strides in ((128.0, 64, 1), (1, 2), "128,64,1", (2**64, 1, 1)):
        with pytest.raises(mn.MlxError):
            mn.ArraySpec((8, 2, 64), "float32", strides)
    for device in ("cuda:x", "gpu", "cpu:0", 0):
        with pytest.raises(mn.InvalidArgumentError):
            mn.ArraySpec((8, 2, 64), "float32", device=device)
    assert mn.ArraySpec((np.int64(8), 2, 64), "float32").shape == (8, 2, 64)


def test_device_buffers_take_integer_sizes_and_exact_writes():
    dev = mn.Device("cpu")
    for shape in ((2.5,), 2.5, (-1,), (2**63,), (True,)):
        with pytest.raises(mn.MlxError):
            dev.empty(shape)
    b = dev.empty((8,))
    b.write(np.arange(8, dtype=np.float32))
    for short in (np.ones(4, np.float32), np.ones(9, np.float32)):
        with pytest.raises(mn.InvalidArgumentError, match="holds 8 elements"):
            b.write(short)
    assert np.array_equal(b.numpy(), np.arange(8, dtype=np.float32))
    with pytest.raises(mn.MlxError):
        b.view(2.0, (2,))


def test_params_take_integers_only():
    base = dict(rows=32, n_heads=1, n_kv_heads=1, head_dim=256, kv_pad=64, q_row_stride=256, q_head_stride=256,
                k_row_stride=256, k_head_stride=256, v_row_stride=256, v_head_stride=256)  # fmt: skip
    mn.FlashAttnPrefillTensorParams(**base)._to_c()
    for name, bad in (("rows", 1.9), ("rows", True), ("kv_pad", -64), ("head_dim", 2**32), ("n_heads", "1")):
        with pytest.raises(mn.MlxError, match=name):
            mn.FlashAttnPrefillTensorParams(**dict(base, **{name: bad}))._to_c()
    for scale in (float("nan"), 1e300, 10**400, 1e-50):
        with pytest.raises(mn.MlxError, match="scale"):
            mn.FlashAttnPrefillTensorParams(**base, scale=scale)._to_c()
    for f in (mn.queries_per_threadgroup, mn.kv_pad):
        with pytest.raises(mn.MlxError):
            f(256.0)


# ------------------------------------------------------------------ pickling, untyped errors


def test_native_objects_refuse_pickling_with_the_reason(rng):
    q, k, v = _qkv(rng)
    dev = mn.Device("cpu")
    objects = [dev, dev.empty((4,)), dev.encoder(), mn.PrefillPlan(q, k, v)]
    for obj in objects:
        for f in (pickle.dumps, copy.copy, copy.deepcopy):
            with pytest.raises(mn.ArgumentTypeError, match="cannot be pickled or copied"):
                f(obj)
    # What a plan is made of pickles.
    spec = pickle.loads(pickle.dumps(mn.ArraySpec((8, 2, 64), "float16")))
    assert spec.shape == (8, 2, 64)


def test_an_output_too_large_to_allocate_is_a_buffer_allocation_error():
    # 4 TiB of output. Refused before allocation where the host's memory is known (Linux):
    # a host that overcommits memory hands out the pages, and the process dies writing them.
    # Twice each: the second call takes the one-call path of the cached plan.
    q = torch.zeros(1, 1, 64).expand(2**22, 4096, 64)
    k = torch.zeros(1, 1, 64, dtype=torch.float16).expand(64, 1, 64)
    why = "one buffer may take here" if mn.cpu_info()["memory"] else "cannot allocate an output"
    for _ in range(2):
        with pytest.raises(mn.BufferAllocationError, match=why):
            mn.flash_attn_prefill(q, k, k)
        with pytest.raises(mn.BufferAllocationError, match=why):
            mn.flash_attn_prefill(q.numpy(), k.numpy(), k.numpy())


def test_force_cpu_isa_and_force_cuda_pair_take_names_only():
    for bad in (5, b"avx2", ["portable"]):
        with pytest.raises(mn.ArgumentTypeError):
            mn.force_cpu_isa(bad)
        with pytest.raises(mn.ArgumentTypeError):
            mn.force_cuda_pair(bad)
    with pytest.raises(mn.InvalidArgumentError, match="not available here"):
        mn.force_cpu_isa("avx513")
    with pytest.raises(mn.InvalidArgumentError, match="CTA-pair mode"):
        mn.force_cuda_pair("2")
    assert mn.cpu_info()["isa"] == mn.cpu_info()["detected"][0]
