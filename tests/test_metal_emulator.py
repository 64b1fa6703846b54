"""The Metal kernels in shaders/, run by the CPU emulator (tests/metal_emu, docs/metal.md)
over the grid the ops dispatch, against the CPU backend and the float64 reference.

No Apple GPU runs here: these tests show that the kernels compute SPEC sections 1 and 2
under the documented Metal execution model (barriers, simdgroup functions, cooperative
tensors of unknown layout, matmul2d that is not a barrier), not that they run on a Mac."""

from __future__ import annotations

import struct

import numpy as np
import pytest

import metal_emu
import mlx_native as mx
from mlx_native.reference import nmse, reference_attention

from helpers import CASES, _span, case_id, cpu_fma_kernels, make_case, run_low_level
from planted_cases import (
    EXACT_BAR,
    FIELD_BASE,
    FIELD_PERTURBED,
    GPU_FIELDS,
    PLANTED,
    SPEC_BAR,
    check_planted,
    crafted_blk_mask,
    field_buffers,
    field_views,
    nan_rows,
    nmse_bulk,
    spec_blk,
    spec_reference,
)

EXPECTED = 1e-5  # against the float64 reference (SPEC bar: 5e-4)
CPU_AGREEMENT = 1e-10  # against the CPU backend, which computes the same rounded steps (seen: <2e-13)

THREADS = (32, 8, 1)  # 8 simdgroups, as the op dispatches


# The fixtures build_dir and emu (one emulator build per session) are in conftest.py.


def mutated(build_dir, original: str, replacement: str, count: int = 1) -> metal_emu.Emulator:
    """The emulator built with one deliberate change to the attention kernel's source."""
    src = metal_emu.SHADER_FILES["flash_attn_prefill_tensor.metal"].read_text()
    assert src.count(original) == count, f"the mutation no longer applies: {original!r}"
    sources = {name: path.read_text() for name, path in metal_emu.SHADER_FILES.items()}
    sources["flash_attn_prefill_tensor.metal"] = src.replace(original, replacement)
    return metal_emu.Emulator(metal_emu.build(build_dir, sources))


# -- dispatching like the ops ---------------------------------------------------------------


def emu_blk(emu, mask: np.ndarray, rows: int, bq: int, bk: int = 64, **kw) -> np.ndarray:
    """flash_attn_prefill_blk as rust/src/ops/flash_attn_prefill_blk.rs dispatches it."""
    kv_pad = mask.shape[1]
    table = np.full((-(-rows // bq), kv_pad // bk), 0xEE, np.uint8)  # every byte must be written
    params = struct.pack("<4i", rows, kv_pad, bq, bk)
    res = emu.dispatch(
        "flash_attn_prefill_blk",
        (kv_pad // bk, -(-rows // bq), 1),
        (32, 1, 1),
        buffers={1: np.ascontiguousarray(mask[:rows]), 2: table},
        constants={0: params},
        **kw,
    )
    return res[2]


def emu_attention(emu, case, *, blk=None, extra_out_rows=0, sentinel=None, **kw):
    """flash_attn_prefill_tensor_f16 as rust/src/ops/flash_attn_prefill_tensor.rs dispatches
    it (bindings, threadgroup memory, grid), with blk from the emulated blk kernel unless
    given. Returns (out [rows + extra_out_rows, nh, hd], blk)."""
    rows, nh, hd = case.q.shape
    bq = mx.queries_per_threadgroup(hd)
    kvp = case.k.shape[0]
    if blk is None:
        blk = emu_blk(emu, case.mask, rows, bq)
    p = case.params()
    params = struct.pack(
        "<11if",
        p.rows, p.n_heads, p.n_kv_heads, p.kv_pad,
        p.q_row_stride, p.q_head_stride, p.k_row_stride, p.k_head_stride,
        p.v_row_stride, p.v_head_stride, kvp, p.scale,
    )  # fmt: skip
    out = np.full((rows + extra_out_rows, nh, hd), np.nan if sentinel is None else sentinel, np.float32)
    kernel = {256: mx.K_TENSOR_F16_D256, 512: mx.K_TENSOR_F16_D512}[hd]
    res = emu.dispatch(
        kernel,
        (-(-rows // bq), nh, 1),
        THREADS,
        buffers={1: _span(case.q), 2: _span(case.k), 3: _span(case.v), 4: case.mask, 5: blk, 6: out},
        constants={0: params},
        threadgroup_memory={0: mx.threadgroup_memory_bytes(hd)},
        **kw,
    )
    return res[6], blk


def reference(case):
    return reference_attention(case.q, case.k, case.v, case.mask, scale=case.scale)


def clearly_wrong(out, case) -> bool:
    """Not finite, or far off the reference (a mutation must not pass by a small margin)."""
    return not np.isfinite(out).all() or nmse(out, reference(case)) > 1e-3


# -- the tile-skip table --------------------------------------------------------------------


@pytest.mark.parametrize(
    "rows,kv_pad,bq,bk", [(45, 192, 32, 64), (33, 256, 16, 64), (300, 704, 32, 64), (20, 192, 7, 48), (5, 384, 128, 128)]
)
def test_blk_matches_the_cpu_backend(emu, rng, rows, kv_pad, bq, bk):
    from mlx_native.reference import peer_mask

    mask = np.full((rows, kv_pad), -np.inf, np.float16)
    mask[:, : kv_pad - 10] = peer_mask(rows, kv_pad - 10, rng)
    mask[: min(rows, bq), :bk] = -65504.0  # the most negative half also means masked
    mask[: min(rows, bq), bk : 2 * bk] = np.where(rng.random((min(rows, bq), bk)) < 0.5, 0.0, -0.0)
    got = emu_blk(emu, mask, rows, bq, bk)
    want = mx.flash_attn_prefill_blk(mask, bq, bk, device=mx.Device("cpu"))
    assert np.array_equal(got, want)
    assert 0 in got and 2 in got and 1 in got


def test_blk_classifies_crafted_tiles(emu):
    # One 1x1-row tile per column block of 64: each value decides its tile's class.
    values = [-np.inf, -65504.0, -65472.0, 0.0, -0.0, 6e-8, np.nan, np.inf, 1.0]
    want = [0, 0, 1, 2, 2, 1, 1, 1, 1]
    mask = np.zeros((1, 64 * len(values)), np.float16)
    for i, x in enumerate(values):
        mask[0, 64 * i : 64 * (i + 1)] = x
    assert emu_blk(emu, mask, 1, 32).ravel().tolist() == want


def test_blk_reads_no_row_past_rows(emu):
    # Rows past `rows` are not passed to the kernel at all (the buffer ends at row `rows`,
    # then a guard page): a read of row 21 would fault in the emulator.
    mask = np.zeros((21, 128), np.float16)
    mask[20, 70] = 1.0
    assert emu_blk(emu, mask, 21, 16).tolist() == [[2, 2], [2, 1]]


# -- attention against the reference and the CPU backend ----------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_strided_cases_match_the_reference_and_the_cpu(emu, rng, case):
    rows, nh, nkv, hd, kv_len, scale, mask, window = case
    c = make_case(rng, rows, nh, nkv, hd, kv_len, scale=scale, mask=mask, window=window)
    out, blk = emu_attention(emu, c)
    with cpu_fma_kernels():
        cpu_out, cpu_blk = run_low_level(mx.Device("cpu"), c)
    assert np.array_equal(blk, cpu_blk)
    assert np.isfinite(out).all()
    err = nmse(out, reference(c))
    assert err < EXPECTED, f"nmse {err:.3e}"
    assert nmse(out, cpu_out) < CPU_AGREEMENT


def test_all_three_tile_classes(emu, rng):
    c = make_case(rng, 300, 2, 1, 256, 700, mask="peer")
    out, blk = emu_attention(emu, c)
    assert set(np.unique(blk).tolist()) == {0, 1, 2}
    assert nmse(out, reference(c)) < EXPECTED


@pytest.mark.parametrize("hd", [256, 512])
def test_skip_table_changes_no_bit(emu, rng, hd):
    c = make_case(rng, 70, 4, 2, hd, 300, mask="peer")
    out, blk = emu_attention(emu, c)
    assert 0 in blk and 2 in blk, "the case must exercise skipping and mask-free tiles"
    ones, _ = emu_attention(emu, c, blk=np.ones_like(blk))
    assert np.array_equal(out.view(np.uint32), ones.view(np.uint32))
    assert nmse(out, reference(c)) < EXPECTED


@pytest.mark.parametrize("hd", [256, 512])
def test_fully_masked_rows_are_zero(emu, rng, hd):
    c = make_case(rng, 40, 4, 2, hd, 150, mask="peer")
    c.mask[[0, 7, 39]] = -np.inf
    out, _ = emu_attention(emu, c)
    assert np.isfinite(out).all()
    assert (out[[0, 7, 39]] == 0).all()
    assert nmse(out, reference(c)) < EXPECTED


def test_no_row_past_rows_is_written(emu, rng):
    c = make_case(rng, 21, 2, 2, 512, 90, mask="peer")
    sentinel = np.float32(-12345.5)
    out, _ = emu_attention(emu, c, extra_out_rows=5, sentinel=sentinel)
    assert (out[21:] == sentinel).all()
    assert not (out[:21] == sentinel).any()


def test_rescaling_is_exercised_and_correct(emu, rng):
    # Large scores (scale 4): running maxima move by more than 8 after the first step, so
    # the lazy rescale of O runs; the result still matches the reference.
    c = make_case(rng, 40, 2, 1, 256, 400, scale=4.0, mask="zero")
    out, _ = emu_attention(emu, c)
    assert nmse(out, reference(c)) < EXPECTED


@pytest.mark.parametrize("hd", [256, 512])
def test_schedules_and_cooperative_layouts_change_no_bit(emu, rng, hd):
    """Any order of the threads between synchronisation points, and any layout of the
    cooperative tensors, gives the same bits: the kernel has no data race the barriers do not
    order, and depends on no particular cooperative-tensor layout."""
    c = make_case(rng, 50, 2, 1, hd, 200, scale=2.0, mask="peer")
    base, blk = emu_attention(emu, c)
    for kw in (
        dict(schedule="reverse"),
        dict(schedule="random:1"),
        dict(schedule="random:2", layout_seed=7),
        dict(layout_seed=1),
        dict(layout_seed=2, schedule="reverse"),
    ):
        out, _ = emu_attention(emu, c, blk=blk, **kw)
        assert np.array_equal(out.view(np.uint32), base.view(np.uint32)), kw


def test_threadgroup_memory_is_exactly_what_the_op_binds(emu, rng):
    # The op binds threadgroup_memory_bytes(hd); the kernel's last use (the rescale flag)
    # lies in its final 16 bytes, so 16 bytes less ends in the emulator's guard page.
    c = make_case(rng, 8, 1, 1, 256, 64, mask="zero")
    blk = np.full((1, 1), 2, np.uint8)
    rows, nh, hd = c.q.shape
    p = c.params()
    params = struct.pack(
        "<11if", p.rows, p.n_heads, p.n_kv_heads, p.kv_pad, p.q_row_stride, p.q_head_stride,
        p.k_row_stride, p.k_head_stride, p.v_row_stride, p.v_head_stride, p.kv_pad, p.scale,
    )  # fmt: skip
    buffers = {1: _span(c.q), 2: _span(c.k), 3: _span(c.v), 4: c.mask, 5: blk, 6: np.zeros((rows, nh, hd), np.float32)}
    need = mx.threadgroup_memory_bytes(hd)
    ok = emu.dispatch(mx.K_TENSOR_F16_D256, (1, 1, 1), THREADS, buffers=buffers, constants={0: params},
                      threadgroup_memory={0: need})  # fmt: skip
    assert nmse(ok[6], reference(c)) < EXPECTED
    with pytest.raises(metal_emu.EmulatorError):
        emu.dispatch(mx.K_TENSOR_F16_D256, (1, 1, 1), THREADS, buffers=buffers, constants={0: params},
                     threadgroup_memory={0: need - 16})  # fmt: skip


# -- the planted-bug cases (tests/planted_cases.py), as every backend runs them ------------------


@pytest.mark.parametrize("planted", PLANTED, ids=[p.name for p in PLANTED])
def test_planted_case(emu, rng, planted):
    c = planted.build(rng)
    out, blk = emu_attention(emu, c, extra_out_rows=2, sentinel=-7.5)
    assert (out[c.rows :] == np.float32(-7.5)).all(), "rows past `rows` were written"
    check_planted(out, blk, c, label=f"{planted.name} (emulator)")
    with cpu_fma_kernels():
        cpu_out, _ = run_low_level(mx.Device("cpu"), c)
    good = np.setdiff1d(np.arange(c.rows), nan_rows(c))
    assert nmse(out[good], cpu_out[good]) < CPU_AGREEMENT


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_shared_cases_meet_the_sharper_bars(emu, rng, case):
    rows, nh, nkv, hd, kv_len, scale, mask, window = case
    c = make_case(rng, rows, nh, nkv, hd, kv_len, scale=scale, mask=mask, window=window)
    out, blk = emu_attention(emu, c)
    assert nmse(out, reference(c)) <= EXACT_BAR
    assert nmse_bulk(out, spec_reference(c.q, c.k, c.v, c.mask, blk, scale)) <= SPEC_BAR


@pytest.mark.parametrize("bq,bk", [(32, 64), (16, 64), (7, 48)])
def test_blk_negative_nan_minus_zero_and_single_rows(emu, rng, bq, bk):
    mask, want, rows = crafted_blk_mask(rng, bq, bk)
    assert np.array_equal(emu_blk(emu, mask, rows, bq, bk), want)


def emu_attention_params(emu, bufs, prm, hd=256, schedule="forward"):
    """The attention kernel over flat buffers with a params block built by hand (any
    mask_row_stride), an all-ones table; returns (the whole output buffer, the output)."""
    q, k, v, mask = bufs
    rows, nh, kvp = prm["rows"], prm["n_heads"], prm["kv_pad"]
    bq = mx.queries_per_threadgroup(hd)
    blk = np.ones((-(-rows // bq), kvp // 64), np.uint8)
    words = [prm[f] for f in GPU_FIELDS]
    params = struct.pack("<11if", *words)
    out = np.full((40, 4, hd), -3.25, np.float32)
    kernel = {256: mx.K_TENSOR_F16_D256, 512: mx.K_TENSOR_F16_D512}[hd]
    mrs = prm["mask_row_stride"]
    res = emu.dispatch(
        kernel, (-(-rows // bq), nh, 1), THREADS,
        buffers={1: q, 2: k, 3: v, 4: mask[: (rows - 1) * mrs + kvp], 5: blk, 6: out},
        constants={0: params}, threadgroup_memory={0: mx.threadgroup_memory_bytes(hd)}, schedule=schedule,
    )  # fmt: skip
    full = res[6]
    return full, full.reshape(-1)[: rows * nh * hd].reshape(rows, nh, hd)


@pytest.mark.parametrize("field", GPU_FIELDS)
def test_every_params_field_is_honoured_at_the_kernel_level(emu, rng, field):
    """Each field of the params block, mask_row_stride too (the op always sets it to kv_pad),
    changes the output to the reference of what the changed block describes."""
    assert GPU_FIELDS == [f.name for f in mx_fields()], "the params block changed: update FIELD_BASE"
    bufs = field_buffers(rng)
    full0, base = emu_attention_params(emu, bufs, FIELD_BASE)
    qv, kv, vv, mv = field_views(bufs, FIELD_BASE)
    assert nmse(base, reference_attention(qv, kv, vv, mv, scale=FIELD_BASE["scale"])) < EXACT_BAR
    prm = {**FIELD_BASE, field: FIELD_PERTURBED[field]}
    full1, got = emu_attention_params(emu, bufs, prm)
    qv, kv, vv, mv = field_views(bufs, prm)
    err = nmse(got, reference_attention(qv, kv, vv, mv, scale=prm["scale"]))
    assert err < EXACT_BAR, f"{field}: nmse {err:.2e}"
    assert not np.array_equal(full0, full1), f"{field}: the output did not change"


def mx_fields():
    """The params block's fields as the Metal source declares them, in order."""
    import re
    from collections import namedtuple

    src = metal_emu.SHADER_FILES["flash_attn_prefill_tensor.metal"].read_text()
    body = re.search(r"struct FlashAttnPrefillTensorParams \{(.*?)\};", src, re.S).group(1)
    F = namedtuple("F", "name")
    return [F(m) for m in re.findall(r"(?:int|float)\s+(\w+);", body)]


# -- deliberately wrong kernels must fail these checks -------------------------------------------


def test_a_dropped_rescale_is_caught(build_dir, rng):
    bad = mutated(build_dir, "co[i] *= srow[idx[1]];", "/* rescale dropped */")
    c = make_case(rng, 40, 2, 1, 256, 400, scale=4.0, mask="zero")
    out, _ = emu_attention(bad, c)
    assert clearly_wrong(out, c)


def test_a_misread_skip_table_is_caught(build_dir, rng):
    bad = mutated(build_dir, "if (t == 0) {", "if (t == 2) {")
    c = make_case(rng, 70, 4, 2, 256, 300, mask="peer")
    out, blk = emu_attention(bad, c)
    assert 0 in blk and 2 in blk
    assert clearly_wrong(out, c)


def test_a_p_not_rounded_to_half_is_caught_by_the_cpu_comparison(build_dir, rng):
    # SPEC: S sums the probabilities as rounded to half. Summing the unrounded ones is as
    # accurate against the exact reference, but not what every backend computes.
    bad = mutated(
        build_dir,
        "const half p0 = half(exp(s0 - m_run[i]));\n            const half p1 = half(exp(s1 - m_run[i]));",
        "const float p0 = exp(s0 - m_run[i]);\n            const float p1 = exp(s1 - m_run[i]);",
    )
    c = make_case(rng, 37, 4, 2, 256, 100, scale=0.6, mask="peer")
    out, _ = emu_attention(bad, c)
    with cpu_fma_kernels():
        cpu_out, _ = run_low_level(mx.Device("cpu"), c)
    assert nmse(out, reference(c)) < EXPECTED
    assert nmse(out, cpu_out) > CPU_AGREEMENT


def test_a_missing_barrier_is_caught(build_dir, rng):
    # Without the barrier between storing the scores and reading them back, a simdgroup
    # reads rows other simdgroups have not stored yet (matmul2d run() is no barrier either).
    bad = mutated(
        build_dir,
        "cs.store(ts);\n        }\n        threadgroup_barrier(mem_flags::mem_threadgroup);",
        "cs.store(ts);\n        }\n",
    )
    c = make_case(rng, 50, 2, 1, 256, 200, mask="peer")
    outs = [emu_attention(bad, c, schedule=s)[0] for s in ("forward", "reverse")]
    assert any(clearly_wrong(o, c) for o in outs)


def test_a_missing_barrier_after_the_softmax_is_caught_by_another_schedule(build_dir, rng):
    # Dropping the barrier between writing P (and the row scales) and P.V is invisible when
    # the threads run in index order, and wrong in other orders: the schedules differ.
    bad = mutated(
        build_dir,
        "*sflag = step;  // no reset needed: a later step writes its own number\n        }\n"
        "        threadgroup_barrier(mem_flags::mem_threadgroup);\n",
        "*sflag = step;  // no reset needed: a later step writes its own number\n        }\n",
    )
    c = make_case(rng, 50, 2, 1, 256, 200, mask="peer")
    forward, blk = emu_attention(bad, c)
    others = [emu_attention(bad, c, blk=blk, schedule=s)[0] for s in ("reverse", "random:1")]
    assert any(clearly_wrong(o, c) for o in others)


def test_a_layout_assumption_is_caught(build_dir, rng):
    # Storing the scores as if thread t held elements t*n .. t*n+n-1 in row-major order is
    # right for one layout (the emulator's seed 0) and wrong for others: Apple documents the
    # layout as implementation defined.
    bad = mutated(
        build_dir,
        "cs.store(ts);",
        "for (ushort i = 0; i < cs.get_capacity(); ++i) {"
        " if (cs.is_valid_element(i)) ss[tid * (Q * C / (SG * NW)) + i] = cs[i]; }",
    )
    c = make_case(rng, 50, 2, 1, 256, 200, mask="peer")
    good_layout, blk = emu_attention(bad, c, layout_seed=0)
    assert nmse(good_layout, reference(c)) < EXPECTED
    other_layout, _ = emu_attention(bad, c, blk=blk, layout_seed=3)
    assert clearly_wrong(other_layout, c)


def test_row_sums_left_unzeroed_are_caught(build_dir, rng):
    # The emulator starts thread-private variables as 0xfe bytes (a float of -1.69e38):
    # row sums never zeroed survive the first step (it multiplies them by exp(-FLT_MAX/2 -
    # m) = 0), but a fully masked row's sum stays -1.69e38 and its output 0 / -1.69e38 is
    # -0.0, which the planted checks refuse (+0.0 bit for bit).
    bad = mutated(build_dir, "s_run[i] = 0.0f;", "/* s_run left unzeroed */")
    p = next(p for p in PLANTED if p.name == "padding-d256")
    c = p.build(rng)
    out, blk = emu_attention(bad, c)
    with pytest.raises(AssertionError, match=r"not \+0\.0 bit for bit"):
        check_planted(out, blk, c)
    good, _ = emu_attention(metal_emu.Emulator(metal_emu.build(build_dir)), c)
    check_planted(good, blk, c)


# -- the emulator's own execution model ----------------------------------------------------------

SELF_TEST = r"""
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;
using namespace mpp::tensor_ops;

// Each thread writes its index, then reads its neighbour's: right only after a barrier.
kernel void neighbour(device uint * out [[buffer(0)]],
                      threadgroup uint * s [[threadgroup(0)]],
                      constant uint & use_barrier [[buffer(1)]],
                      uint tid [[thread_index_in_threadgroup]],
                      uint n [[threads_per_threadgroup]])
{
    s[tid] = tid;
    if (use_barrier != 0) {
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    out[tid] = s[(tid + 1) % n];
}

// A barrier only half of the threadgroup reaches.
kernel void divergent_barrier(device uint * out [[buffer(0)]],
                              uint tid [[thread_index_in_threadgroup]])
{
    if (tid < 32) {
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    out[tid] = tid;
}

// Reductions and shuffles across the 32 lanes.
kernel void simd_ops(device float * out [[buffer(0)]],
                     ushort lane [[thread_index_in_simdgroup]],
                     ushort sg [[simdgroup_index_in_threadgroup]])
{
    const float x = float(lane) + 100.0f * float(sg);
    out[(sg * 32 + lane) * 4 + 0] = simd_sum(x);
    out[(sg * 32 + lane) * 4 + 1] = simd_max(x);
    out[(sg * 32 + lane) * 4 + 2] = simd_shuffle(x, ushort(31 - lane));
    out[(sg * 32 + lane) * 4 + 3] = simd_shuffle_xor(x, ushort(1));
}

// C = A.A and C = A.A^T for a row-major 16x16 A (a tensor of extents (columns, rows)), by the
// 64 threads of two simdgroups, through a cooperative destination; with `partial`, only the
// first simdgroup enters run().
using dev_half = tensor<device half, dextents<int32_t, 2>, tensor_inline>;
using dev_float = tensor<device float, dextents<int32_t, 2>, tensor_inline>;
template <bool TransposeRight>
void square(device half * a, device float * c, uint tid, bool partial)
{
    dev_half ta(a, dextents<int32_t, 2>(16, 16), array<int32_t, 2>({1, 16}));
    dev_float tc(c, dextents<int32_t, 2>(16, 16), array<int32_t, 2>({1, 16}));
    constexpr auto desc = matmul2d_descriptor(16, 16, 16, false, TransposeRight, false,
                                              matmul2d_descriptor::mode::multiply);
    matmul2d<desc, execution_simdgroups<2>> op;
    auto cc = op.template get_destination_cooperative_tensor<dev_half, dev_half, float>();
    if (!partial || tid < 32) {
        op.run(ta, ta, cc);
    }
    cc.store(tc);
}
kernel void matmul_nn(device half * a [[buffer(0)]], device float * c [[buffer(1)]],
                      uint tid [[thread_index_in_threadgroup]])
{
    square<false>(a, c, tid, false);
}
kernel void matmul_nt(device half * a [[buffer(0)]], device float * c [[buffer(1)]],
                      uint tid [[thread_index_in_threadgroup]])
{
    square<true>(a, c, tid, false);
}
kernel void matmul_by_half_the_scope(device half * a [[buffer(0)]], device float * c [[buffer(1)]],
                                     uint tid [[thread_index_in_threadgroup]])
{
    square<false>(a, c, tid, true);
}
"""


@pytest.fixture(scope="session")
def self_test_emu(build_dir):
    return metal_emu.Emulator(metal_emu.build(build_dir, {"self_test.metal": SELF_TEST}))


def test_emulator_barriers_order_threadgroup_memory(self_test_emu):
    n = 64
    want = (np.arange(n) + 1) % n
    for schedule in ("forward", "reverse", "random:3"):
        res = self_test_emu.dispatch(
            "neighbour", (1, 1, 1), (n, 1, 1), buffers={0: np.zeros(n, np.uint32)},
            constants={1: struct.pack("<I", 1)}, threadgroup_memory={0: 4 * n}, schedule=schedule,
        )  # fmt: skip
        assert np.array_equal(res[0], want), schedule
    # Without the barrier the reverse order reads neighbours that have not written yet.
    res = self_test_emu.dispatch(
        "neighbour", (1, 1, 1), (n, 1, 1), buffers={0: np.zeros(n, np.uint32)},
        constants={1: struct.pack("<I", 0)}, threadgroup_memory={0: 4 * n}, schedule="reverse",
    )  # fmt: skip
    assert not np.array_equal(res[0], want)


def test_emulator_rejects_a_barrier_not_every_thread_reaches(self_test_emu):
    with pytest.raises(metal_emu.EmulatorError, match="barrier"):
        self_test_emu.dispatch("divergent_barrier", (1, 1, 1), (64, 1, 1), buffers={0: np.zeros(64, np.uint32)})


def test_emulator_simdgroup_functions(self_test_emu):
    res = self_test_emu.dispatch("simd_ops", (1, 1, 1), (64, 1, 1), buffers={0: np.zeros(64 * 4, np.float32)})
    got = res[0].reshape(2, 32, 4)
    lane = np.arange(32, dtype=np.float32)
    for sg in range(2):
        x = lane + 100 * sg
        assert (got[sg, :, 0] == x.sum()).all()
        assert (got[sg, :, 1] == x.max()).all()
        assert np.array_equal(got[sg, :, 2], x[::-1])
        assert np.array_equal(got[sg, :, 3], x[np.arange(32) ^ 1])


@pytest.mark.parametrize("layout_seed", [0, 5])
def test_emulator_matmul2d_follows_the_documented_operand_extents(self_test_emu, rng, layout_seed):
    # Apple's header: for C = A.B (m x n), A is a tensor of extents (k, m), B of (n, k), or
    # (k, n) with transpose_right; C of (n, m). A row-major matrix has extents (columns, rows).
    a = rng.uniform(-1, 1, (16, 16)).astype(np.float16)
    a64 = a.astype(np.float64)
    for kernel, want in (("matmul_nn", a64 @ a64), ("matmul_nt", a64 @ a64.T)):
        res = self_test_emu.dispatch(
            kernel, (1, 1, 1), (64, 1, 1), buffers={0: a, 1: np.full((16, 16), np.nan, np.float32)},
            layout_seed=layout_seed,
        )  # fmt: skip
        assert np.allclose(res[1], want, rtol=1e-5, atol=1e-5), kernel


def test_emulator_rejects_a_matmul2d_run_not_entered_by_its_whole_scope(self_test_emu):
    a = np.ones((16, 16), np.float16)
    with pytest.raises(metal_emu.EmulatorError, match="matmul2d"):
        self_test_emu.dispatch("matmul_by_half_the_scope", (1, 1, 1), (64, 1, 1),
                               buffers={0: a, 1: np.zeros((16, 16), np.float32)})  # fmt: skip
