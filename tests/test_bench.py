"""The machine's measured FMA peak and the benchmark command."""

from __future__ import annotations

import pytest

import mlx_native as mx


def test_fma_peak_is_positive_for_every_instruction_set():
    for isa in mx.cpu_info()["detected"]:
        mx.force_cpu_isa(isa)
        try:
            one = mx.cpu_fma_peak(1)
            every = mx.cpu_fma_peak()
        finally:
            mx.force_cpu_isa(None)
        assert one > 0.1 and every > 0.1, (isa, one, every)


def test_fma_peak_rejects_bad_thread_counts():
    with pytest.raises(mx.InvalidArgumentError):
        mx.cpu_fma_peak(-1)
    with pytest.raises(mx.InvalidArgumentError, match="at most"):
        mx.cpu_fma_peak(100000)
