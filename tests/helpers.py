"""The test suite's low-level cases: the builders live in :mod:`mlx_native.testing` (the GPU
scripts use them too); the case table shared by every backend's tests is here."""

from __future__ import annotations

import contextlib

from mlx_native.testing import LowLevelCase, _span, make_case, run_low_level

__all__ = [
    "CASES",
    "KERNEL_DIMS",
    "LowLevelCase",
    "cpu_fma_kernels",
    "_span",
    "case_id",
    "import_test_extra",
    "lse_tolerance",
    "make_case",
    "run_low_level",
    "traced_pair_run",
]

#: The (Q/K, V) head dims with kernels of their own (the op's HEAD_DIMS, docs/spec.md "Head
#: dims"), which the per-head-dim tests run; any other head dim runs zero-padded on the next.
KERNEL_DIMS = [(d, d) for d in (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)] + [(576, 512)]

#: SPEC 8's bar on lse against the float64 reference.
LSE_TOL = 2e-3


def lse_tolerance(cuda_bf16: bool, d: int = 128) -> float:
    """The lse bar: SPEC 8's 2e-3; with BF16 data on CUDA, whose tensor cores take Q and P in
    bfloat16 (docs/spec.md, "BF16 K/V on CUDA"; each score moves by a random sum of d terms
    of 2^-9 of their size, so its spread grows as sqrt(d); at scale 1 and d 512 lse moved by
    1.4e-2 to 1.5e-2 on the H200, 2026-12-03), 1e-2 at head dim 128 and below, times
    sqrt(d / 128) above."""
    return 1e-2 * max(1.0, (d / 128) ** 0.5) if cuda_bf16 else LSE_TOL


@contextlib.contextmanager
def cpu_fma_kernels():
    """The CPU backend on its FMA kernels (the best instruction set but AMX) while in use:
    the backend that computes the same rounded steps as the Metal kernels. Where the CPU has
    AMX its tiles are the default, and they add each product's f32 terms in their own order
    (about 1e-9 NMSE apart, past the emulator's agreement bar)."""
    import mlx_native as mx

    detected = mx.cpu_info()["detected"]
    if "amx" not in detected:
        yield
        return
    mx.force_cpu_isa(next(i for i in detected if i != "amx"))
    try:
        yield
    finally:
        mx.force_cpu_isa(None)


# The correctness suite's strided low-level cases, shared by every backend's tests:
# (rows, n_heads, n_kv_heads, head_dim, kv_len, scale, mask, window)
CASES = [
    (45, 4, 4, 256, 130, 1.0, "peer", None),  # GQA 1, partial tiles, kv not a multiple of 64
    (37, 4, 2, 256, 100, 0.6, "peer", None),  # GQA 2, scale != 1
    (20, 8, 1, 256, 200, 1.0, "causal", 64),  # GQA 8, window, longer cache
    (33, 2, 1, 512, 77, 1.0, "causal", None),  # d512, GQA 2, causal, partial
    (17, 8, 1, 512, 64, 1.3, "peer", None),  # d512, GQA 8
    (64, 4, 2, 512, 192, 1.0, "zero", None),  # d512 full tiles, zero mask
]


def case_id(c):
    rows, nh, nkv, hd, kv, scale, mask, w = c
    return f"r{rows}-h{nh}/{nkv}-d{hd}-kv{kv}-s{scale}-{mask}{'' if w is None else w}"


#: The Python each test extra's pinned version needs (pyproject.toml, [test]).
_EXTRA_PYTHON = {"torch": (3, 10), "transformers": (3, 11)}


def import_test_extra(name: str):
    """Import a module of the test extras (torch, transformers). A missing one fails: the
    test command installs them (``pip install ".[test]"``), so in CI a test that needs one
    runs or fails, never skips. Only on a Python older than the pinned version supports,
    where pip cannot install it, is it a skip that says so."""
    import importlib
    import sys

    import pytest

    try:
        return importlib.import_module(name)
    except ImportError as e:
        need = _EXTRA_PYTHON.get(name)
        if need is not None and sys.version_info[:2] < need:
            pytest.skip(f"the test extra {name} needs Python {need[0]}.{need[1]}+", allow_module_level=True)
        raise ImportError(f"{e}: the tests need the test extras, pip install '.[test]'") from e




def planned_run(plan, split=True):
    """``plan`` (a plan of host arrays on a device) run on its planned arrays through an
    encoder, with its workspace (``split``: on CUDA a shape that splits its walk over the
    cache does) or without (CUDA walks each tile's cache whole): ``(out, lse)``, out as
    float32 of the output's shape, lse None when the plan returns none."""
    import numpy as np

    b = plan._buffers
    b = b if split else dict(b, workspace=None)
    with plan.device.encoder() as enc:
        plan._record(enc, b, True)
    out = b["out"].numpy().astype(np.float32).reshape(plan.shape)
    return out, None if b["lse"] is None else b["lse"].numpy().reshape(plan.lse_shape)


def whole_walk_output(plan):
    """The output of ``plan`` run without a workspace (:func:`planned_run`)."""
    return planned_run(plan, split=False)[0]


def random_qkv_dims(rng, rows, kv, nh, nkv, dk, dv, kv_dtype=None, batch=None):
    """Uniform random q (float32 ``[rows, nh, dk]``), k (``[kv, nkv, dk]``) and v (``[kv,
    nkv, dv]``) of ``kv_dtype`` (float16 by default), with a leading batch axis when
    ``batch`` is given."""
    import numpy as np

    kv_dtype = np.float16 if kv_dtype is None else kv_dtype
    lead = () if batch is None else (batch,)
    q = rng.uniform(-1, 1, (*lead, rows, nh, dk)).astype(np.float32)
    k = rng.uniform(-1, 1, (*lead, kv, nkv, dk)).astype(kv_dtype)
    v = rng.uniform(-1, 1, (*lead, kv, nkv, dv)).astype(kv_dtype)
    return q, k, v


def ops_seen():
    """A torch dispatch mode that records every operator reaching the dispatcher (in
    ``.seen``, as strings): ``with ops_seen() as mode: ...``. torch is imported here, so
    this module stays importable without it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpsSeen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    return OpsSeen()


def traced_pair_run(test_file: str, plan_setup: str, select: str):
    """In a process of its own with the CUDA launch trace on (and no forced CTA-pair choice):
    ``plan_setup`` (Python with numpy as ``np`` and mlx_native as ``mn``, which defines
    ``plan``), then the tests of ``test_file`` that ``-k select`` picks. Returns the pairs
    ``plan`` reports (``choices["pairs"]``) and the set of entry points launched. The inner
    pytest runs with ``-s``: its capture of stderr would swallow the trace."""
    import os
    import re
    import subprocess
    import sys

    script = (
        "import sys, numpy as np, pytest\nimport mlx_native as mn\n" + plan_setup + '\nprint("PAIRS", plan.choices["pairs"])\n'
        f'sys.exit(pytest.main(["-q", "-s", "-p", "no:cacheprovider", sys.argv[1], "-k", {select!r}]))\n'
    )
    env = {**os.environ, "MLX_NATIVE_CUDA_TRACE": "1"}
    env.pop("MLX_NATIVE_CUDA_PAIR", None)
    run = subprocess.run([sys.executable, "-c", script, test_file], env=env, capture_output=True, text=True,
                         cwd=os.path.dirname(test_file), timeout=1200)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    reported = run.stdout.split("PAIRS ", 1)[1].split()[0]
    return reported, set(re.findall(r" entry (\w+) arch \w+$", run.stderr, re.M))
