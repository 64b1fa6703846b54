"""Issue 28 in the Metal kernel, run by the CPU emulator (tests/metal_emu) and dispatched as
the op encodes it (tests/test_metal_emulator_prefill.py's harness): two-sided windows
(causal or not, left/right each -1, 0 or positive, a cache shorter than the prompt) and
ALiBi slopes given as data (``[H]`` and ``[B, H]``), fixed and variable length, GQA,
partial tiles, rows that see nothing; each against the float64 reference and the CPU
backend (test_metal_emulator_prefill.check)."""

from __future__ import annotations

import numpy as np
import pytest

from test_metal_emulator_prefill import BF16, F16, check, emu_prefill, fixed_case, varlen_case

# (window, window_right, causal): the harness's form, window = left + 1 (0: unbounded left).
WINDOWS = [
    (6, 3, False),  # (5, 3)
    (1, 0, False),  # (0, 0): only the query's own position
    (0, 2, False),  # (-1, 2)
    (8, None, False),  # (7, -1): no right bound
    (41, 70, False),  # wider than a tile on both sides
    (4, 9, True),  # causal caps the right side at 0
]


@pytest.mark.parametrize("window,right,causal", WINDOWS)
@pytest.mark.parametrize("kv_dtype", [F16, BF16])
def test_two_sided_windows(emu, rng, window, right, causal, kv_dtype):
    c = fixed_case(rng, batch=1, rows=40, kv=100, nh=4, nkv=2, hd=64, kv_dtype=kv_dtype, causal=causal, window=window,
                   window_right=right, scale=0.125)  # fmt: skip
    out, lse, _ = emu_prefill(emu, c)
    check(c, out, lse)


def test_a_cache_shorter_than_the_prompt_leaves_rows_seeing_nothing(emu, rng):
    c = fixed_case(rng, batch=2, rows=70, kv=30, nh=2, nkv=1, hd=128, window=3, window_right=2, scale=0.1)
    out, lse, _ = emu_prefill(emu, c)
    check(c, out, lse)
    assert np.isneginf(lse).any()


@pytest.mark.parametrize("shape", ["h", "bh"])
@pytest.mark.parametrize("causal,window,right", [(False, 0, None), (True, 0, None), (False, 10, 5), (True, 12, None)])
def test_alibi_slopes(emu, rng, shape, causal, window, right):
    b, nh = 2, 4
    slopes = rng.uniform(0.01, 0.5, (nh,) if shape == "h" else (b, nh)).astype(np.float32)
    c = fixed_case(rng, batch=b, rows=33, kv=90, nh=nh, nkv=2, hd=64, causal=causal, window=window, window_right=right,
                   alibi=slopes, scale=0.125)  # fmt: skip
    out, lse, _ = emu_prefill(emu, c)
    check(c, out, lse)


def test_variable_length_windows_and_slopes(emu, rng):
    slopes = rng.uniform(0.05, 0.6, (3, 2)).astype(np.float32)
    c = varlen_case(rng, lq=[9, 0, 40], lk=[40, 5, 17], nh=2, nkv=1, hd=64, kv_dtype=BF16, window=5, window_right=4,
                    alibi=slopes, scale=0.2)  # fmt: skip
    out, lse, _ = emu_prefill(emu, c)
    check(c, out, lse)


def test_slopes_equal_to_max_bias_s_give_the_same_bits(emu, rng):
    from mlx_native.reference import alibi_slopes

    c = fixed_case(rng, batch=1, rows=20, kv=70, nh=8, nkv=2, hd=64, causal=True, max_bias=8.0, scale=0.125)
    a, _, _ = emu_prefill(emu, c)
    b, _, _ = emu_prefill(emu, c.with_(max_bias=0.0, alibi=alibi_slopes(8, 8.0).astype(np.float32)))
    assert np.array_equal(a, b)
