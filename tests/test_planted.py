"""Cases that kill planted kernel bugs (tests/planted_cases.py), on every backend (the CPU
once per instruction set, CUDA where present; the Metal emulator runs the same cases in
test_metal_emulator.py), and the sharper bars against float64: the exact softmax, and the
SPEC's own rounding (docs/reliability.md, "Mutation testing" and "Sharper bars")."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mlx_native as mx
from mlx_native.reference import nmse, peer_mask, reference_attention

from helpers import CASES, case_id, make_case, run_low_level, whole_walk_output
from planted_cases import (
    EXACT_BAR,
    NEGATIVE_NANS,
    PLANTED,
    SPEC_BAR,
    check_planted,
    FIELD_BASE,
    FIELD_PERTURBED,
    GPU_FIELDS,
    crafted_blk_mask,
    field_buffers,
    field_views,
    nmse_bulk,
    sensitivity,
    spec_blk,
    spec_reference,
)

#: View padding of make_case: odd strides (K/V rows not 16-byte aligned; on Hopper the
#: one-CTA form) and aligned ones (where the CTA-pair forms run).
LAYOUTS = {"odd": (4, 1, 2), "aligned": (0, 0, 0)}


def _build(p, rng, layout):
    c = p.build(rng)
    if layout == "odd":
        return c
    # The same values in views with aligned strides.
    rows, nh, hd = c.q.shape
    kvp, nkv, _ = c.k.shape
    a = make_case(np.random.default_rng(0), rows, nh, nkv, hd, c.kv_len, scale=c.scale, mask="zero", pad=(0, 0, 0))
    a.q[...] = c.q
    a.k[...] = c.k
    a.v[...] = c.v
    a.mask[...] = c.mask
    return a


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("planted", PLANTED, ids=[p.name for p in PLANTED])
def test_planted_case(device, rng, planted, layout):
    c = _build(planted, rng, layout)
    out, blk = run_low_level(device, c, extra_out_rows=2, sentinel=-7.5)
    assert (out[c.rows :] == np.float32(-7.5)).all(), "rows past `rows` were written"
    check_planted(out, blk, c, label=f"{planted.name} on {device.description}")


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_shared_cases_meet_the_sharper_bars(device, rng, case):
    rows, nh, nkv, hd, kv_len, scale, mask, window = case
    c = make_case(rng, rows, nh, nkv, hd, kv_len, scale=scale, mask=mask, window=window)
    out, blk = run_low_level(device, c)
    assert np.array_equal(blk, spec_blk(c.mask, rows, mx.queries_per_threadgroup(hd)))
    exact = reference_attention(c.q, c.k, c.v, c.mask, scale=scale)
    spec = spec_reference(c.q, c.k, c.v, c.mask, blk, scale)
    assert nmse(out, exact) <= EXACT_BAR
    assert nmse_bulk(out, spec) <= SPEC_BAR


@pytest.mark.parametrize("planted", PLANTED, ids=[p.name for p in PLANTED])
def test_the_cases_tell_the_spec_from_its_near_misses(rng, planted):
    """The bars can fail: on each case, the SPEC computed with P unrounded (and with the
    case's own near misses: `>=` at the threshold, Q rounded before the scale) is at least
    5x the bar away from the SPEC's result."""
    c = planted.build(rng)
    for kw, err in sensitivity(planted, c):
        assert err >= 5 * SPEC_BAR, f"{planted.name}: {kw} is only {err:.2e} away"


def test_the_ties_are_exact_ties(rng):
    # Q = 0 and mask values that are halves: every score is exactly a mask value, and each
    # row's step maxima are 0, 8, 16, 24, 16 (so 8 and 24 sit exactly at M + 8).
    for p in PLANTED:
        if not p.name.startswith("ties"):
            continue
        c = p.build(rng)
        assert not c.q.any()
        tops = c.mask[: c.rows].astype(np.float32).reshape(c.rows, -1, 64).max(axis=2)
        assert (tops == np.array([0, 8, 16, 24, 16], np.float32)).all()


# -- the tile classifier: negative NaN, -0, rows that differ inside a tile --------------------


@pytest.mark.parametrize("bq,bk", [(32, 64), (16, 64), (7, 48), (128, 128)])
def test_blk_negative_nan_minus_zero_and_single_rows(device, rng, bq, bk):
    """Every negative NaN pattern, at the first and last row and column of a tile of -inf,
    keeps the tile (1); -0 counts as zero; one row alone (the tile's last, or the prompt's
    last in a partial tile) decides a tile of -inf (1) and a tile of zeros (1)."""
    mask, want, rows = crafted_blk_mask(rng, bq, bk)
    assert np.array_equal(spec_blk(mask, rows, bq, bk), want), "the test's own table is wrong"
    got = mx.flash_attn_prefill_blk(mask, bq, bk, device=device)
    assert np.array_equal(got, want), f"\n{got}\n!=\n{want}"


def front_door_table(device, full: np.ndarray, kv: int, head_dim: int) -> np.ndarray:
    """The front door's classification of the masks full[:, :, :kv] (contiguous `full`, so
    a row stride past kv), dispatched through the C ABI as PrefillPlan does; returns the
    table as [n, table rows, steps]."""
    from mlx_native._lib import check, ffi, lib

    n, rows, stride = full.shape
    p = ffi.new("MlxnFlashAttnPrefillParams *")
    p.batch, p.rows, p.kv_len, p.n_heads, p.n_kv_heads, p.head_dim = n, rows, kv, 1, 1, head_dim
    p.scale = 1.0
    p.mask_strides = [rows * stride, stride]
    nbytes = ffi.new("uint64_t *")
    check(lib.mlxn_flash_attn_prefill_mask_table_bytes(p, nbytes))
    steps = -(-kv // 64)
    tiles = int(nbytes[0]) // (n * steps)
    assert tiles * n * steps == int(nbytes[0]), "the table is not [n, tile rows, steps]"
    mbuf = device.buffer(full)
    blk = device.buffer(np.full(int(nbytes[0]), 0xEE, np.uint8), copy=True)
    with device.encoder() as enc:
        check(lib.mlxn_dispatch_flash_attn_prefill_mask_blk(enc.handle, mbuf.handle, blk.handle, p))
    return blk.numpy().reshape(n, tiles, steps)


@pytest.mark.parametrize("rows,kv,hd", [(45, 130, 256), (33, 200, 512), (70, 100, 128)])
def test_front_door_mask_table_follows_spec_1(device, rng, rows, kv, hd):
    """The front door's table of an explicit mask (flash_attn_prefill_mask_blk) on every
    backend: SPEC 1 per tile of mask_tile_rows x 64, columns at or past kv_len counted as
    masked, so a tile of zeros cut by the cache's end is 1 and one of -inf is 0; -65504 and
    every negative NaN of a tile of -inf decide as SPEC 1 says."""
    n = 2
    full = np.full((n, rows, kv + 6), np.nan, np.float16)  # NaN columns past kv: never read
    m = full[:, :, :kv]
    for i in range(n):
        m[i] = peer_mask(rows, kv, rng)
    bq = 16 if hd == 512 else 32
    m[:, :bq, :64] = -65504.0
    m[0, bq : 2 * bq, :64] = np.where(rng.random((min(bq, rows - bq), 64)) < 0.5, 0.0, -0.0)
    tail = slice((kv // 64) * 64, kv)
    m[0, :, tail] = 0.0  # zeros in a cut tile: 1, never 2
    m[1, :, tail] = -np.inf  # -inf in a cut tile: 0
    m[1, -1, kv - 1] = np.frombuffer(np.uint16(0xFE00).tobytes(), np.float16)[0]  # negative NaN: kept
    got = front_door_table(device, full, kv, hd)
    assert got.shape[1] == -(-rows // bq), "the table's tile rows are not mask_tile_rows(head_dim)"
    pad = -(-kv // 64) * 64
    for i in range(n):
        padded = np.full((rows, pad), -np.inf, np.float16)
        padded[:, :kv] = m[i]
        want = spec_blk(padded, rows, bq)
        assert np.array_equal(got[i], want), f"mask {i}:\n{got[i]}\n!=\n{want}"
    assert (got[0, :, -1] == 1).all() and got[1, -2 if rows > bq else -1, -1] == 0
    assert got[1, -1, -1] == 1  # the negative NaN row


@pytest.mark.parametrize("hd", [128, 256, 512])
def test_a_long_walk_over_skipped_windows(device, rng, hd):
    """An explicit mask over 75 steps with two runs of all -inf steps (table byte 0 for
    every row), 3-39 and 45-69, so that the walk, which the GPU kernels do over the table
    32 steps at a time, must leave the first window (steps 0-31) with nothing left in it,
    compute steps 40-44 of the second and leave it again; a step of zeros (2), random
    steps (1), a last step cut by the cache's end and varying by row. Against the float64
    reference, and a fully masked row is +0."""
    from mlx_native.reference import reference_prefill

    rows, nh, nkv, steps = 40, 4, 2, 75
    kv = steps * 64 - 9
    q = rng.uniform(-1, 1, (rows, nh, hd)).astype(np.float32)
    k = rng.uniform(-1, 1, (kv, nkv, hd)).astype(np.float16)
    v = rng.uniform(-1, 1, (kv, nkv, hd)).astype(np.float16)
    m = rng.uniform(-1, 1, (rows, kv)).astype(np.float16)
    m[:, 3 * 64 : 40 * 64] = -np.inf
    m[:, 45 * 64 : 70 * 64] = -np.inf
    m[:, 64:128] = 0.0  # step 1: class 2
    m[5, :] = -np.inf  # a row that sees nothing
    m[17:, 72 * 64 :] = -np.inf  # the last steps vary by row
    ref, _ = reference_prefill(q, k, v, m, scale=0.125)
    outs = [np.asarray(mx.flash_attn_prefill(q, k, v, m, scale=0.125, device=device))]
    plan = mx.PrefillPlan(q, k, v, m, scale=0.125, device=device)
    if plan.workspace_bytes:  # CUDA splits this walk into parts: the whole walk too
        outs.append(whole_walk_output(plan))
    for out in outs:
        assert nmse(out.astype(np.float64), ref) < 1e-6
        assert (out[5] == 0).all() and not np.signbit(out[5]).any(), "a fully masked row must be +0"


# -- every field of the params block is honoured ----------------------------------------------


#: The op's fields: the GPU block's but mask_row_stride (always kv_pad through the op).
FIELDS = [f for f in GPU_FIELDS if f != "mask_row_stride"]


def run_fields(device, bufs, prm, hd=256):
    """Dispatch over the flat buffers with params `prm` (the mask as its rows of kv_pad
    values); returns (the whole output buffer, the output, the reference)."""
    q, k, v, _ = bufs
    rows, nh, kvp = prm["rows"], prm["n_heads"], prm["kv_pad"]
    qv, kv, vv, mv = field_views(bufs, {**prm, "mask_row_stride": kvp}, hd)
    m = np.ascontiguousarray(mv)
    qb, kb, vb, mb = device.buffer(q), device.buffer(k), device.buffer(v), device.buffer(m)
    bq = mx.queries_per_threadgroup(hd)
    blk = device.empty((-(-rows // bq), kvp // 64), np.uint8)
    out = device.buffer(np.full((40, 4, hd), -3.25, np.float32), copy=True)
    p = mx.FlashAttnPrefillTensorParams(head_dim=hd, **{f: prm[f] for f in FIELDS})
    with device.encoder() as enc:
        mx.dispatch_flash_attn_prefill_blk(enc, mb, blk, rows=rows, kv_pad=kvp, bq=bq, bk=64)
        mx.dispatch_flash_attn_prefill_tensor_f16(enc, qb, kb, vb, mb, blk, out, p)
    full = out.numpy()
    got = full.reshape(-1)[: rows * nh * hd].reshape(rows, nh, hd)
    return full, got, reference_attention(qv, kv, vv, m, scale=prm["scale"])


@pytest.mark.parametrize("field", FIELDS)
def test_every_params_field_is_honoured(device, rng, field):
    """Changing one field, over the same buffers, changes the output to the reference of
    what the changed params describe."""
    bufs = field_buffers(rng)
    full0, base, ref0 = run_fields(device, bufs, FIELD_BASE)
    assert nmse(base, ref0) < EXACT_BAR
    full1, got, ref1 = run_fields(device, bufs, {**FIELD_BASE, field: FIELD_PERTURBED[field]})
    assert nmse(got, ref1) < EXACT_BAR, f"{field}: nmse {nmse(got, ref1):.2e}"
    assert not np.array_equal(full0, full1), f"{field}: the output did not change"
    if field == "rows":
        # Rows past `rows` are not written; the rows before are the same bits.
        assert (full1[33:] == np.float32(-3.25)).all()
        assert np.array_equal(full1[:33], full0[:33])


# -- the CUDA source folder knob (MLX_NATIVE_CUDA_SOURCE_DIR) ------------------------------------


def test_cuda_source_dir_replaces_a_kernel_source(tmp_path):
    """`cuda_compile_check` compiles what a device would: a file of MLX_NATIVE_CUDA_SOURCE_DIR
    in place of the built-in source of that name (a broken one fails, naming it)."""
    (tmp_path / "flash_attn_prefill_tensor.cu").write_text('#error "planted by the test"\n')
    code = textwrap.dedent(
        """
        import mlx_native as mx
        try:
            mx.cuda_compile_check("sm_90a")
        except mx.BackendUnavailableError as e:
            print("UNAVAILABLE", e)
        except mx.MlxError as e:
            print("FAILED", type(e).__name__, e)
        else:
            print("COMPILED")
        """
    )
    env = {**os.environ, "MLX_NATIVE_CUDA_SOURCE_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    out = run.stdout
    if out.startswith("UNAVAILABLE"):
        if os.environ.get("MLX_NATIVE_REQUIRE_NVRTC") == "1":
            pytest.fail(f"NVRTC is required here: {out}")
        pytest.skip(out)
    assert out.startswith("FAILED ShaderCompilationError"), out + run.stderr
    assert "planted by the test" in out and "flash_attn_prefill_tensor.cu" in out, out
    assert "in place of the built-in flash_attn_prefill_tensor.cu" in run.stderr, run.stderr
    env["MLX_NATIVE_CUDA_SOURCE_DIR"] = str(tmp_path / "missing")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "is not a folder" in run.stdout, run.stdout + run.stderr
