"""Shared fixtures: every test that computes runs on every backend present, and on the
CPU once per instruction set this machine has."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import mlx_native as mx


def _targets():
    out = []
    for backend in mx.backends():
        if backend == "cpu":
            for isa in mx.cpu_info()["detected"]:
                out.append(("cpu", isa))
        else:
            out.append((backend, None))
    return out


TARGETS = _targets()


@contextlib.contextmanager
def target_device(target):
    """The device of one target ``(backend, isa)``, the CPU's instruction set forced while
    it is in use."""
    backend, isa = target
    if isa is not None:
        mx.force_cpu_isa(isa)
    try:
        yield mx.Device(backend)
    finally:
        if isa is not None:
            mx.force_cpu_isa(None)


@pytest.fixture(params=TARGETS, ids=[f"{b}-{i}" if i else b for b, i in TARGETS])
def device(request):
    """A device of each backend present (the CPU once per instruction set)."""
    with target_device(request.param) as d:
        yield d


@pytest.fixture
def cpu():
    return mx.Device("cpu")


@pytest.fixture
def rng(request):
    # A reproducible stream per test (crc32: str hashes differ between processes).
    import zlib

    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def build_dir(tmp_path_factory):
    """Where the Metal emulator (tests/metal_emu) is built, once per session for every module
    that runs it (deliberately changed kernels are built there too)."""
    import metal_emu

    if metal_emu.compiler() is None:
        pytest.fail("the Metal emulator needs a C++20 compiler (g++ or $CXX); none was found")
    return tmp_path_factory.mktemp("metal_emu")


@pytest.fixture(scope="session")
def emu(build_dir):
    """The Metal emulator built from the kernels in shaders/."""
    import metal_emu

    return metal_emu.Emulator(metal_emu.build(build_dir))
