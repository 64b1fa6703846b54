"""SPEC 10 in the Metal kernels, run by the CPU emulator (tests/metal_emu) and dispatched as
the op encodes them (tests/test_metal_emulator_prefill.py's harness): every head dim of the
table (576/512 with V a view of K's first 512 columns too), F16 and BF16 K/V, softcap, ALiBi
on described and explicit masks, attention sinks with rows that see nothing, lse with the
sink, variable length; each against the float64 reference (NMSE <= 1e-5) and the CPU
backend (1e-10), and a deliberately wrong kernel that these checks catch."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_native.reference import nmse

from helpers import KERNEL_DIMS
from test_metal_emulator_prefill import BF16, F16, check, emu_prefill, fixed_case, mutated, reference, varlen_case

HEAD_DIMS = KERNEL_DIMS



def _sinks(rng, n):
    return rng.uniform(-3, 3, n).astype(np.float32)


@pytest.mark.parametrize("hd,hdv", HEAD_DIMS)
def test_every_head_dim_with_the_transforms(emu, rng, hd, hdv):
    # BF16 K/V at every other dim; causal with a longer cache, a partial last step, GQA 2;
    # softcap, ALiBi on the description and sinks all at once.
    kv = BF16 if HEAD_DIMS.index((hd, hdv)) % 2 else F16
    c = fixed_case(rng, batch=1, rows=19, kv=70, nh=4, nkv=2, hd=hd, hdv=hdv, kv_dtype=kv, causal=True, scale=0.5,
                   softcap=3.0, max_bias=4.0, sinks=_sinks(rng, 4))  # fmt: skip
    out, lse, _ = emu_prefill(emu, c)
    check(c, out, lse)


@pytest.mark.parametrize("kv", [F16, BF16])
def test_each_transform_alone_on_described_masks(emu, rng, kv):
    for kw in (dict(softcap=2.5), dict(max_bias=8.0, window=30), dict(sinks=_sinks(rng, 3))):
        c = fixed_case(rng, batch=2, rows=33, kv=90, nh=3, nkv=1, hd=128, kv_dtype=kv, causal=True, **kw)
        out, lse, _ = emu_prefill(emu, c)
        check(c, out, lse)


def test_explicit_mask_alibi_and_sinks_with_rows_that_see_nothing_576_512_v_in_k(emu, rng):
    # ALiBi scales the explicit mask (with the causal description adding nothing); rows whose
    # mask is -inf throughout see nothing: +0 with lse = their head's sink.
    c = fixed_case(rng, batch=2, rows=20, kv=100, nh=4, nkv=1, hd=576, hdv=512, v_in_k=True, mask="per-batch",
                   causal=True, max_bias=5.0, softcap=4.0, sinks=_sinks(rng, 4))  # fmt: skip
    assert np.shares_memory(c.k, c.v)
    c.mask[0, [0, 11]] = -np.inf
    c.mask[1, 19] = -np.inf
    out, lse, _ = emu_prefill(emu, c)
    check(c, out, lse)
    for b, r in [(0, 0), (0, 11), (1, 19)]:
        assert (out[b, r].view(np.uint32) == 0).all()
        assert (lse[b, :, r] == c.sinks).all()


def test_variable_length_with_the_transforms(emu, rng):
    c = varlen_case(rng, lq=[9, 0, 17], lk=[40, 5, 17], nh=2, nkv=1, hd=64, kv_dtype=BF16, causal=True, window=12,
                    softcap=6.0, max_bias=2.0, sinks=_sinks(rng, 2))  # fmt: skip
    out, lse, _ = emu_prefill(emu, c)
    check(c, out, lse)


# -- deliberately wrong kernels must fail these checks ----------------------------------------------


def test_a_sink_left_out_of_the_sum_is_caught(build_dir, rng):
    # The sink raises the running max but adds nothing to the sum: every row's weights are
    # then normalised without it, too large where the sink matters.
    bad = mutated(build_dir, "const float sum = s_run[i] * f + exp(sigma - mf);", "const float sum = s_run[i] * f;")
    c = fixed_case(rng, batch=1, rows=20, kv=64, nh=2, nkv=1, hd=128, causal=True, scale=0.05,
                   sinks=np.array([1.0, 2.0], np.float32))  # fmt: skip
    out, lse, _ = emu_prefill(bad, c)
    assert nmse(out, reference(c)[0]) > 1e-3
    with pytest.raises(AssertionError):
        check(c, out, lse, cpu=False)
