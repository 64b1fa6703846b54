"""Property tests of the Python API on every backend (and CPU instruction set) present.

Arbitrary parameter structs, buffer dtypes and sizes, views, strides and values, valid and
invalid: every call either matches the float64 reference or raises exactly the error that
SPEC section 2's validation list names (``expected_error``, written from SPEC, says which);
the process never dies; no byte around the output (nor any input) is ever written.

Examples per property and target: ``MLXN_FUZZ_CASES`` (defaults below, a few thousand in all
per run). CI runs a fixed seed; set ``MLXN_FUZZ_SEED=random`` (or a number) to explore.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlx_native as mx
from mlx_native.dtypes import numpy_dtype_of_name
from mlx_native.head_dims import kernel_head_dim
from mlx_native.reference import nmse, reference_attention, reference_prefill

from helpers import KERNEL_DIMS

I32_MAX = 2**31 - 1
U32_MAX = 2**32 - 1
WANT = dict(q="float32", k="float16", v="float16", mask="float16", blk="uint8", out="float32")
SPEC_NAME = dict(float32="F32", float16="F16", uint8="U8")
NAMES = ("q", "k", "v", "mask", "blk", "out")
DTYPES = ["float32", "float16", "uint8", "uint16", "uint32", "int32"]
#: Elements above which a buffer is not made at its drawn size (it gets a small one).
CAP = 1 << 20


def _examples(default: int) -> int:
    return int(os.environ.get("MLXN_FUZZ_CASES", default))


def _fuzz_settings(default: int):
    seed = os.environ.get("MLXN_FUZZ_SEED")
    kw = dict(
        max_examples=_examples(default),
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
        derandomize=seed is None,
    )
    return settings(**kw)


def _seeded(fn):
    seed = os.environ.get("MLXN_FUZZ_SEED")
    if seed is not None and seed != "random":
        from hypothesis import seed as hseed

        return hseed(int(seed))(fn)
    return fn


# ---------------------------------------------------------------------- drawing a dispatch


def _odd_u32():
    return st.sampled_from([0, I32_MAX, I32_MAX + 1, U32_MAX, U32_MAX - 63, 2**31 - 64]) | st.integers(1, 100_000)


def _odd():
    """A value that breaks a rule somewhere: zero, at or past the i32 limit, out of u32,
    or merely large."""
    return _odd_u32() | st.sampled_from([-1, 2**32, 2**40])


ODD = _odd()
ODD_Q = ODD | st.integers(1, 10**5).map(lambda x: 4 * x + 2)
STRIDE_KIND = st.sampled_from(["pad", "pad", "pad", "zero", "overlap"])
PAD = st.integers(0, 2)


def _stride(draw, base: int, unit: int) -> int:
    """A stride a caller may legitimately pass: padded, zero (broadcast), overlapping."""
    kind = draw(STRIDE_KIND)
    if kind == "zero":
        return 0
    if kind == "overlap":
        return max(base - unit, 0)
    return base + draw(PAD) * unit


#: What a draw may break (each is drawn from values that usually break it).
CORRUPTIBLE = (
    ["head_dim", "rows", "n_kv_heads", "group", "kv_pad", "q_row_stride", "q_head_stride", "k_row_stride",
     "k_head_stride", "v_row_stride", "v_head_stride", "overlap", "not_a_buffer", "read_only_out"]
    + [f"dtype:{n}" for n in NAMES]
    + [f"size:{n}" for n in NAMES]
)


HEAD_DIMS = st.sampled_from([256, 512])
ROWS = st.integers(1, 40)
KV_HEADS = st.integers(1, 3)
KV_PADS = st.sampled_from([64, 128, 192])
SCALES = st.sampled_from([1.0, 0.5, 0.0625, 2.0])
ANY_DTYPE = st.sampled_from(DTYPES)
SIZES = st.just("exact") | st.integers(1, 8)
INPUT_NAMES = st.sampled_from(NAMES[:5])
ALL_NAMES = st.sampled_from(NAMES)
GUARDS = st.sampled_from([0, 4, 64])
SEEDS = st.integers(0, 2**32 - 1)


@dataclass
class Draw:
    p: mx.FlashAttnPrefillTensorParams
    dtypes: dict
    sizes: dict  # name -> "exact" | "short" | int extra elements
    arena: bool
    overlap: Optional[str]
    guard: int
    not_a_buffer: Optional[str]
    read_only_out: bool
    seed: int


def _corruptions(draw, names) -> set:
    """Nothing (about half the time), one thing, or a few things to break."""
    mode = draw(MODES)
    if mode == "none":
        return set()
    if mode == "one":
        return {draw(st.sampled_from(names))}
    return draw(st.sets(st.sampled_from(names), min_size=2, max_size=3))


MODES = st.sampled_from(["none", "one", "none", "one", "few"])


@st.composite
def draws(draw):
    """Half the draws break nothing on purpose (they may still break a rule by chance);
    the others break one to three things. The predicate, not this, decides validity."""
    bad = _corruptions(draw, CORRUPTIBLE)
    pick = lambda name, normal: draw(ODD if name in bad else normal)  # noqa: E731
    hd = pick("head_dim", HEAD_DIMS)
    if "head_dim" in bad and hd in (256, 512):
        hd = 128
    rows = pick("rows", ROWS)
    nkv = pick("n_kv_heads", KV_HEADS)
    group = draw(KV_HEADS)
    nh = max(nkv, 0) * group + (1 if "group" in bad else 0)
    kv_pad = pick("kv_pad", KV_PADS)
    scale = draw(SCALES)
    sat = lambda x: min(max(x, 0), U32_MAX)  # noqa: E731
    stride = lambda name, base, unit, odd=ODD: draw(odd) if name in bad else _stride(draw, base, unit)  # noqa: E731
    qhs = stride("q_head_stride", sat(hd), 4, ODD_Q)
    khs = stride("k_head_stride", sat(hd), 1)
    vhs = stride("v_head_stride", sat(hd), 2)
    qrs = stride("q_row_stride", sat(sat(nh) * sat(qhs)), 4, ODD_Q)
    krs = stride("k_row_stride", sat(sat(nkv) * sat(khs)), 3)
    vrs = stride("v_row_stride", sat(sat(nkv) * sat(vhs)), 1)
    p = mx.FlashAttnPrefillTensorParams(
        rows=rows, n_heads=nh, n_kv_heads=nkv, head_dim=hd, kv_pad=kv_pad,
        q_row_stride=qrs, q_head_stride=qhs, k_row_stride=krs, k_head_stride=khs,
        v_row_stride=vrs, v_head_stride=vhs, scale=scale,
    )
    dtypes = {n: draw(ANY_DTYPE) if f"dtype:{n}" in bad else WANT[n] for n in NAMES}
    sizes = {n: "short" if f"size:{n}" in bad else draw(SIZES) for n in NAMES}
    overlap = draw(INPUT_NAMES) if "overlap" in bad else None
    arena = draw(st.booleans()) or overlap is not None
    guard = draw(GUARDS)
    not_a_buffer = draw(ALL_NAMES) if "not_a_buffer" in bad else None
    seed = draw(SEEDS)
    return Draw(p, dtypes, sizes, arena, overlap, guard, not_a_buffer, "read_only_out" in bad, seed)


def _bq(hd):
    return 32 if hd == 256 else 16


def needs(p) -> Optional[dict]:
    """Elements each buffer needs (SPEC section 2), exactly; None where undefined."""
    if p.head_dim not in (256, 512) or min(p.rows, p.n_heads, p.n_kv_heads, p.kv_pad) <= 0:
        return None
    rows, nh, nkv, hd, kvp = p.rows, p.n_heads, p.n_kv_heads, p.head_dim, p.kv_pad
    return dict(
        q=(rows - 1) * p.q_row_stride + (nh - 1) * p.q_head_stride + hd,
        k=(kvp - 1) * p.k_row_stride + (nkv - 1) * p.k_head_stride + hd,
        v=(kvp - 1) * p.v_row_stride + (nkv - 1) * p.v_head_stride + hd,
        mask=rows * kvp,
        blk=-(-rows // _bq(hd)) * (kvp // 64),
        out=rows * nh * hd,
    )


def expected_error(d: Draw, elems: dict, place: dict) -> Optional[tuple]:
    """(exception class, message fragment) that the dispatch must raise, or None if valid.

    The Python layer's own checks come first (a Buffer for each argument, a writable
    output, every parameter in 32 unsigned bits), then SPEC section 2's list in its order,
    then the overlap rule the op adds."""
    p = d.p
    if d.not_a_buffer is not None:
        return mx.InvalidArgumentError, f"{d.not_a_buffer} must be a Buffer"
    if d.read_only_out:
        return mx.InvalidArgumentError, "out wraps a read-only array"
    ints = [p.rows, p.n_heads, p.n_kv_heads, p.head_dim, p.kv_pad, p.q_row_stride, p.q_head_stride,
            p.k_row_stride, p.k_head_stride, p.v_row_stride, p.v_head_stride]
    if any(not 0 <= x <= U32_MAX for x in ints):
        return mx.InvalidArgumentError, "does not fit in 32 unsigned bits"
    if p.head_dim not in (256, 512):
        return mx.InvalidArgumentError, f"unsupported head_dim {p.head_dim}"
    if 0 in (p.rows, p.n_heads, p.n_kv_heads, p.kv_pad):
        return mx.InvalidArgumentError, "empty shape"
    if p.n_heads % p.n_kv_heads:
        return mx.InvalidArgumentError, f"n_heads {p.n_heads} is not a multiple of n_kv_heads {p.n_kv_heads}"
    if p.kv_pad % 64:
        return mx.InvalidArgumentError, f"kv_pad {p.kv_pad} is not a multiple of 64"
    if any(x > I32_MAX for i, x in enumerate(ints) if i != 3):  # every field but head_dim
        return mx.InvalidArgumentError, "exceeds i32"
    if p.q_row_stride % 4 or p.q_head_stride % 4:
        return mx.InvalidArgumentError, "multiples of 4"
    need = needs(p)
    for n in ("q", "k", "v", "mask", "out"):
        if d.dtypes[n] != WANT[n]:
            return mx.InvalidArgumentError, f"{n} must be {SPEC_NAME[WANT[n]]}"
        if elems[n] < need[n]:
            return mx.InvalidArgumentError, f"{n} holds"
    if d.dtypes["blk"] != "uint8" or elems["blk"] < need["blk"]:
        return mx.InvalidArgumentError, "blk must be U8"
    oo, ol = place["out"]
    for n in NAMES[:5]:
        o, ln = place[n]
        if d.arena and ln and ol and o < oo + ol and oo < o + ln:
            return mx.InvalidArgumentError, f"out overlaps {n}"
    return None


# ---------------------------------------------------------------------- building it


def _classify(mask: np.ndarray, rows: int, kvp: int, bq: int, bk: int = 64) -> np.ndarray:
    """SPEC section 1, independently of the library: 0 where every value of the tile is
    <= -65504 (NaN is not), 2 where every value is +-0, else 1. The last query tile holds
    only the rows that exist (padding rows count as both)."""
    m = np.asarray(mask).reshape(rows, kvp).astype(np.float32)
    qt = -(-rows // bq)
    bq = min(bq, rows)  # a single tile taller than the mask holds only the rows there are
    masked = np.ones((qt * bq, kvp), bool)
    zero = np.ones((qt * bq, kvp), bool)
    masked[:rows] = m <= -65504
    zero[:rows] = m == 0
    masked = masked.reshape(qt, bq, kvp // bk, bk).all(axis=(1, 3))
    zero = zero.reshape(qt, bq, kvp // bk, bk).all(axis=(1, 3))
    return np.where(masked, 0, np.where(zero, 2, 1)).astype(np.uint8).ravel()


def _mask(rows: int, kvp: int, rng) -> np.ndarray:
    m = rng.uniform(-1, 1, (rows, kvp)).astype(np.float16)
    for r0 in range(0, rows, 16):
        for c0 in range(0, kvp, 64):
            kind = rng.integers(5)
            blk = m[r0 : r0 + 16, c0 : c0 + 64]
            if kind == 0:
                blk[:] = 0
            elif kind == 1:
                blk[:] = -np.inf
            elif kind == 2:
                blk[rng.random(blk.shape) < 0.3] = -np.inf
    m[rng.random(rows) < 0.12] = -np.inf
    return m


def _fill(name: str, dtype: str, n: int, rng) -> np.ndarray:
    if name == "q" and dtype == "float32":
        return rng.uniform(-1, 1, n).astype(np.float32)
    if name in ("k", "v") and dtype == "float16":
        return rng.uniform(-1, 1, n).astype(np.float16)
    return rng.integers(0, 256, n * np.dtype(dtype).itemsize, dtype=np.uint8).view(dtype)


def _bytes(b: mx.Buffer) -> np.ndarray:
    """A buffer's contents as bytes (NaN patterns compare equal byte by byte)."""
    return b.numpy().reshape(-1).view(np.uint8)


def _round_up(x: int, a: int) -> int:
    return -(-x // a) * a


def run_draw(dev: mx.Device, d: Draw) -> str:
    """Build the buffers of ``d`` on ``dev``, dispatch, and check; returns the rule that
    refused it, or "valid"."""
    p, rng = d.p, np.random.default_rng(d.seed)
    need = needs(p)
    elems = {}
    for n in NAMES:
        e = need[n] if need else 1024
        s = d.sizes[n]
        e = e if s == "exact" else max(e - 1, 0) if s == "short" else e + 7 * s
        elems[n] = e if 0 <= e <= CAP else 1024
    data = {n: _fill(n, d.dtypes[n], elems[n], rng) for n in NAMES[:5]}
    shaped = need is not None and p.kv_pad % 64 == 0
    mask_vals = None
    if shaped and d.dtypes["mask"] == "float16" and elems["mask"] >= p.rows * p.kv_pad:
        mask_vals = _mask(p.rows, p.kv_pad, rng)
        data["mask"][: p.rows * p.kv_pad] = mask_vals.ravel()
        table = _classify(mask_vals, p.rows, p.kv_pad, _bq(p.head_dim))
        if d.dtypes["blk"] == "uint8" and elems["blk"] >= table.size:
            data["blk"][: table.size] = table
    nbytes = {n: elems[n] * np.dtype(d.dtypes[n]).itemsize for n in NAMES}
    row_guard = min(max(p.n_heads, 0) * max(p.head_dim, 0), 1 << 14) * 4
    place = {}
    if d.arena:
        off = 0
        for n in NAMES[:5]:
            place[n] = (off, nbytes[n])
            off = _round_up(off + nbytes[n] + 64, 64)
        if d.overlap is not None:
            o, ln = place[d.overlap]
            out_off = _round_up(o + ln // 2, 4)
        else:
            out_off = off + d.guard
        place["out"] = (out_off, nbytes["out"])
        total = max(out_off + nbytes["out"] + row_guard, off) + 64
        arena = np.frombuffer(rng.bytes(total), np.uint8).copy()
        for n in NAMES[:5]:
            o, ln = place[n]
            arena[o : o + ln] = data[n].view(np.uint8)
        base = dev.buffer(arena, copy=True)
        allocs = [base]
        bufs = {n: base.view(place[n][0], (elems[n],), d.dtypes[n]) for n in NAMES}
        out_alloc = 0
    else:
        bufs = {n: dev.buffer(data[n], copy=True) for n in NAMES[:5]}
        for n in NAMES[:5]:
            place[n] = (0, nbytes[n])
        total = d.guard + nbytes["out"] + row_guard + 64
        guarded = np.frombuffer(rng.bytes(total), np.uint8).copy()
        base = dev.buffer(guarded, copy=True)
        bufs["out"] = base.view(d.guard, (elems["out"],), d.dtypes["out"])
        place["out"] = (d.guard, nbytes["out"])
        allocs = [bufs[n] for n in NAMES[:5]] + [base]
        out_alloc = 5
    before = [_bytes(a) for a in allocs]

    args = dict(bufs)
    if d.read_only_out:
        ro = np.zeros(max(elems["out"], 1), np.float32)
        ro.flags.writeable = False
        args["out"] = dev.buffer(ro) if dev.backend == "cpu" else args["out"]
        if dev.backend != "cpu":
            d.read_only_out = False  # only host arrays can be read-only buffers
    if d.not_a_buffer is not None:
        args[d.not_a_buffer] = data.get(d.not_a_buffer, np.zeros(4, np.float32))
    expect = expected_error(d, elems, place)

    enc = dev.encoder()
    try:
        mx.dispatch_flash_attn_prefill_tensor_f16(
            enc, args["q"], args["k"], args["v"], args["mask"], args["blk"], args["out"], p
        )
    except mx.MlxError as e:
        assert expect is not None, f"a valid dispatch was refused: {e}"
        cls, needle = expect
        assert type(e) is cls, f"{type(e).__name__}: {e}; expected {cls.__name__} {needle!r}"
        assert needle in str(e), f"{e!r} lacks {needle!r}"
        assert enc.pending == 0
        enc.commit()
        enc.close()
        for a, b in zip(allocs, before):
            assert np.array_equal(_bytes(a), b), "a refused dispatch changed memory"
        return needle.split(" ")[0] if needle.startswith(("out overlaps", "unsupported")) else needle
    assert expect is None, f"expected {expect}, the dispatch was accepted"
    enc.commit()
    enc.close()
    after = [_bytes(a) for a in allocs]
    for i, (a, b) in enumerate(zip(after, before)):
        if i == out_alloc:
            oo, ol = place["out"]
            if not d.arena:
                oo, ol = place["out"]
            assert np.array_equal(a[:oo], b[:oo]), "bytes before the output were written"
            written = need["out"] * 4
            assert np.array_equal(a[oo + written :], b[oo + written :]), "bytes after the output were written"
            got = a[oo : oo + written].view(np.float32).reshape(p.rows, p.n_heads, p.head_dim)
        else:
            assert np.array_equal(a, b), "an input was written"
    raw = {}
    for n in ("q", "k", "v"):
        o, ln = place[n]
        src = after[0][o : o + ln] if d.arena else after[NAMES.index(n)]
        raw[n] = src.view(WANT[n])
    g = lambda x, rs, hs, shape: np.lib.stride_tricks.as_strided(  # noqa: E731
        x, shape=shape, strides=(rs * x.itemsize, hs * x.itemsize, x.itemsize)
    )
    q = g(raw["q"], p.q_row_stride, p.q_head_stride, (p.rows, p.n_heads, p.head_dim))
    k = g(raw["k"], p.k_row_stride, p.k_head_stride, (p.kv_pad, p.n_kv_heads, p.head_dim))
    v = g(raw["v"], p.v_row_stride, p.v_head_stride, (p.kv_pad, p.n_kv_heads, p.head_dim))
    assert np.isfinite(got).all()
    # Rows are independent: a large draw is checked on 48 of its rows (first and last kept).
    sel = np.arange(p.rows)
    if p.rows > 48:
        sel = np.unique(np.concatenate([[0, p.rows - 1], rng.choice(p.rows, 46, replace=False)]))
    ref = reference_attention(q[sel], k, v, mask_vals[sel], scale=p.scale)
    err = nmse(got[sel], ref)
    assert err <= 5e-4, f"nmse {err:.3e}"
    return "valid"


# ---------------------------------------------------------------------- the properties


class Tally:
    """Counts outcomes per rule, to check that the draws reach both sides."""

    def __init__(self):
        self.counts: dict = {}

    def add(self, rule: str):
        self.counts[rule] = self.counts.get(rule, 0) + 1


def test_dispatch_matches_reference_or_raises_the_named_error(device):
    _n = _examples(500)
    tally = Tally()

    @_fuzz_settings(500)
    @given(draws())
    @_seeded
    def prop(d):
        tally.add(run_draw(device, d))

    prop()
    n = sum(tally.counts.values())
    print(f"\n{device.description}: {n} dispatches: {dict(sorted(tally.counts.items()))}")
    # Both sides reached (checked on runs long enough for the proportions to mean something): a fair share valid, and many of the rules (the Rust property test
    # checks that every rule is reached).
    if _n >= 200:
        assert tally.counts.get("valid", 0) * 6 >= n, tally.counts
    if _n >= 500:
        assert len(tally.counts) >= 16, tally.counts


@st.composite
def blk_draws(draw):
    bad = _corruptions(draw, ["rows", "kv_pad", "bq", "bk", "mask_dtype", "blk_dtype", "mask_size", "blk_size", "same"])
    pick = lambda name, normal: draw(ODD if name in bad else normal)  # noqa: E731
    rows = pick("rows", st.integers(1, 70))
    kv_pad = pick("kv_pad", st.sampled_from([64, 128, 256, 96]))
    bq = pick("bq", st.sampled_from([32, 16, 1, 7]))
    bk = pick("bk", st.sampled_from([64, 32, 1]))
    mask_dtype = draw(st.sampled_from(DTYPES)) if "mask_dtype" in bad else "float16"
    blk_dtype = draw(st.sampled_from(DTYPES)) if "blk_dtype" in bad else "uint8"
    msize = draw(st.sampled_from([-1, -5])) if "mask_size" in bad else draw(st.sampled_from([0, 3]))
    bsize = draw(st.sampled_from([-1, -2])) if "blk_size" in bad else draw(st.sampled_from([0, 3]))
    seed = draw(st.integers(0, 2**32 - 1))
    return rows, kv_pad, bq, bk, mask_dtype, blk_dtype, msize, bsize, "same" in bad, seed


def run_blk(dev, args) -> str:
    rows, kv_pad, bq, bk, mdt, bdt, msize, bsize, same, seed = args
    rng = np.random.default_rng(seed)
    ok_u32 = all(0 <= x <= U32_MAX for x in (rows, kv_pad, bq, bk))
    mneed = rows * kv_pad if ok_u32 else 0
    bneed = -(-rows // bq) * (kv_pad // bk) if ok_u32 and bq > 0 and bk > 0 else 0
    me = mneed + msize if 0 <= mneed + msize <= CAP else 64
    be = bneed + bsize if 0 <= bneed + bsize <= CAP else 64
    mb, bb = me * np.dtype(mdt).itemsize, be * np.dtype(bdt).itemsize
    g = 16
    m_off = g
    b_off = m_off + mb - 1 if same and mb and bb else m_off + mb + g
    b_off = _round_up(b_off, 4)
    m_off_aligned = m_off
    total = b_off + bb + 2 * g
    arena = np.frombuffer(rng.bytes(total), np.uint8).copy()
    kinds = np.array([0.0, -np.inf, -65504.0, 0.5, -0.0, np.nan], np.float16)
    vals = None
    if mdt == "float16":
        tile_kind = rng.integers(len(kinds), size=-(-me // 37) or 1)
        vals = kinds[np.repeat(tile_kind, 37)[:me]]
        sprinkle = rng.random(me) < 0.03
        vals[sprinkle] = kinds[rng.integers(len(kinds), size=int(sprinkle.sum()))]
        arena[m_off : m_off + mb] = vals.view(np.uint8)
    base = dev.buffer(arena, copy=True)
    mask = base.view(m_off_aligned, (me,), mdt)
    blk = base.view(b_off, (be,), bdt)
    before = _bytes(base)
    overlap = mb and bb and b_off < m_off + mb and m_off < b_off + bb
    if not ok_u32:
        expect = "is not an integer in [0, 2^32)"
    elif 0 in (rows, kv_pad, bq, bk):
        expect = "empty shape"
    elif kv_pad % bk:
        expect = "is not a multiple of bk"
    elif max(rows, kv_pad, bq, bk) > I32_MAX:
        expect = "exceeds i32"
    elif mdt != "float16":
        expect = "mask must be F16"
    elif me < mneed:
        expect = "mask holds"
    elif bdt != "uint8" or be < bneed:
        expect = "blk must be U8"
    elif overlap:
        expect = "blk overlaps the mask"
    else:
        expect = None
    enc = dev.encoder()
    try:
        mx.dispatch_flash_attn_prefill_blk(enc, mask, blk, rows=rows, kv_pad=kv_pad, bq=bq, bk=bk)
    except mx.InvalidArgumentError as e:
        assert expect is not None and expect in str(e), f"{e}; expected {expect}"
        assert enc.pending == 0
        enc.close()
        assert np.array_equal(_bytes(base), before)
        return expect
    assert expect is None, f"expected {expect!r}, accepted"
    enc.commit()
    enc.close()
    after = _bytes(base)
    assert np.array_equal(after[:b_off], before[:b_off]), "bytes before the table were written"
    assert np.array_equal(after[b_off + bneed :], before[b_off + bneed :]), "bytes after the table were written"
    want = _classify(vals[: rows * kv_pad], rows, kv_pad, bq, bk)
    assert np.array_equal(after[b_off : b_off + bneed], want), "table differs from SPEC section 1"
    return "valid"


def test_blk_matches_spec_or_raises_the_named_error(device):
    _n = _examples(300)
    tally = Tally()

    @_fuzz_settings(300)
    @given(blk_draws())
    @_seeded
    def prop(args):
        tally.add(run_blk(device, args))

    prop()
    n = sum(tally.counts.values())
    print(f"\n{device.description}: {n} classifications: {dict(sorted(tally.counts.items()))}")
    if _n >= 200:
        assert tally.counts.get("valid", 0) * 5 >= n, tally.counts


# ---------------------------------------------------------------------- the high-level API


#: (Q/K, V) head dims of SPEC 10, and pairs the kernels do not take.
PREFILL_DIMS = KERNEL_DIMS
BAD_DIMS = [(100, 100), (0, 0), (255, 255), (576, 256), (576, 576), (256, 512), (600, 600)]


@st.composite
def prefill_draws(draw):
    bad = _corruptions(
        draw, ["q_dtype", "kv_dtype", "kv_mismatch", "heads", "head_dim", "mask", "softcap", "max_bias", "sinks"]
    )
    rows = draw(st.integers(0, 40))
    hd, hdv = draw(st.sampled_from(BAD_DIMS if "head_dim" in bad else PREFILL_DIMS))
    nkv = draw(st.integers(0, 3)) if "heads" in bad else draw(st.integers(1, 3))
    nh = draw(st.integers(1, 5)) if "heads" in bad else nkv * draw(st.integers(1, 3))
    kv_len = draw(st.integers(0, 150))
    qdt = draw(st.sampled_from(["float64", "int8"])) if "q_dtype" in bad else draw(st.sampled_from(["float32", "float16", "bfloat16"]))
    kdt = draw(st.sampled_from(["float32", "int8"])) if "kv_dtype" in bad else draw(st.sampled_from(["float16", "bfloat16"]))
    vdt = ({"float16": "bfloat16", "bfloat16": "float16"}.get(kdt, "float16")) if "kv_mismatch" in bad else kdt
    layout = draw(st.sampled_from(["contiguous", "sliced", "transposed", "reversed", "padded"]))
    mask = draw(st.sampled_from(["wrong_shape", "int"])) if "mask" in bad else draw(st.sampled_from(["none", "float", "bool"]))
    causal = draw(st.booleans())
    window = draw(st.one_of(st.none(), st.integers(1, 64)))
    scale = draw(st.sampled_from([1.0, 0.5, 1.5]))
    softcap = draw(st.sampled_from([float("nan"), -1.0, float("inf")])) if "softcap" in bad else draw(st.sampled_from([0.0, 0.0, 2.5]))
    max_bias = draw(st.sampled_from([float("inf"), -0.5])) if "max_bias" in bad else draw(st.sampled_from([0.0, 0.0, 4.0]))
    sinks = draw(st.sampled_from(["short", "float16"])) if "sinks" in bad else draw(st.sampled_from(["none", "none", "valid"]))
    seed = draw(st.integers(0, 2**32 - 1))
    return rows, nh, nkv, (hd, hdv), kv_len, qdt, (kdt, vdt), layout, mask, causal, window, scale, (softcap, max_bias, sinks), seed


def _arrange(x: np.ndarray, layout: str, rng) -> np.ndarray:
    """The same values in another memory layout (a view where numpy gives one)."""
    if layout == "sliced":
        big = np.zeros((x.shape[0], x.shape[1] + 1, x.shape[2] + 8), x.dtype)
        big[:, 1:, 4:-4] = x
        return big[:, 1:, 4:-4]
    if layout == "transposed":
        return np.ascontiguousarray(x.transpose(1, 0, 2)).transpose(1, 0, 2)
    if layout == "reversed":
        return np.ascontiguousarray(x[::-1])[::-1]
    if layout == "padded":
        big = np.zeros((x.shape[0] * 2, x.shape[1], x.shape[2]), x.dtype)
        big[::2] = x
        return big[::2]
    return x


def run_prefill(dev, args) -> str:
    rows, nh, nkv, (hd, hdv), kv_len, qdt, (kdt, vdt), layout, mask_kind, causal, window, scale, tr, seed = args
    softcap, max_bias, sinks_kind = tr
    rng = np.random.default_rng(seed)
    q = _arrange(rng.uniform(-1, 1, (rows, nh, hd)).astype(numpy_dtype_of_name(qdt)), layout, rng)
    k = _arrange(rng.uniform(-1, 1, (kv_len, nkv, hd)).astype(numpy_dtype_of_name(kdt)), layout, rng)
    v = _arrange(rng.uniform(-1, 1, (kv_len, nkv, hdv)).astype(numpy_dtype_of_name(vdt)), layout, rng)
    mask = None
    if mask_kind == "float":
        mask = rng.uniform(-2, 1, (rows, kv_len)).astype(np.float32)
        mask[rng.random((rows, kv_len)) < 0.3] = -np.inf
    elif mask_kind == "bool":
        mask = rng.random((rows, kv_len)) < 0.7
    elif mask_kind == "wrong_shape":
        mask = np.zeros((rows + 2, kv_len), np.float16)
    elif mask_kind == "int":
        mask = np.zeros((rows, kv_len), np.int32)
    sinks = None
    if sinks_kind == "valid":
        sinks = rng.uniform(-2, 2, nh).astype(np.float32)
    elif sinks_kind == "short":
        sinks = np.zeros(nh + 1, np.float32)
    elif sinks_kind == "float16":
        sinks = np.zeros(nh, np.float16)
    # What the API documents, in its order.
    if not (softcap >= 0 and np.isfinite(softcap)):
        expect = (mx.InvalidArgumentError, "softcap must be a finite number >= 0")
    elif not (max_bias >= 0 and np.isfinite(max_bias)):
        expect = (mx.InvalidArgumentError, "max_bias must be a finite number >= 0")
    elif qdt not in ("float32", "float16", "bfloat16"):
        expect = (mx.UnsupportedDtypeError, "q must be float32, float16 or bfloat16")
    elif kdt not in ("float16", "bfloat16", "float32"):
        expect = (mx.UnsupportedDtypeError, "k must be float16, bfloat16 or float32")
    elif vdt != kdt:
        expect = (mx.UnsupportedDtypeError, f"k is {kdt} and v is {vdt}")
    elif nkv == 0 or nh % nkv:
        expect = (mx.InvalidArgumentError, "is not a multiple of n_kv_heads")
    elif (hd, hdv) not in PREFILL_DIMS and kernel_head_dim(hd, hdv, kdt) is None:
        # Dims under the largest kernel's run zero-padded (issue 28): checked like the others.
        expect = (mx.InvalidArgumentError, f"unsupported head_dim {hd}")
    elif sinks_kind == "float16":
        expect = (mx.UnsupportedDtypeError, "sinks must be float32")
    elif sinks_kind == "short":
        expect = (mx.InvalidArgumentError, f"sinks must have shape ({nh},)")
    elif max_bias > 0 and mask_kind == "none" and not causal and window is None:
        expect = (mx.InvalidArgumentError, "ALiBi needs positions")
    elif (causal or window is not None) and kv_len < rows:
        expect = (mx.InvalidArgumentError, "cannot be shorter")
    elif mask_kind == "wrong_shape":
        expect = (mx.InvalidArgumentError, "mask must have shape")
    elif mask_kind == "int":
        expect = (mx.UnsupportedDtypeError, "floating point (additive) or bool")
    else:
        expect = None
    try:
        out = mx.flash_attn_prefill(q, k, v, mask, causal=causal, window=window, scale=scale, device=dev,
                                    softcap=softcap, max_bias=max_bias, sinks=sinks)  # fmt: skip
    except mx.MlxError as e:
        assert expect is not None, f"refused: {e!r}"
        assert type(e) is expect[0] and expect[1] in str(e), f"{e!r}; expected {expect}"
        return expect[1]
    assert expect is None, f"expected {expect}, got a result"
    assert out.shape == (rows, nh, hdv) and out.dtype == q.dtype  # out_dtype defaults to q's
    if rows == 0 or kv_len == 0:
        assert not out.any()
        return "valid"
    full = None
    if mask is not None:
        full = np.where(mask, 0, -np.inf).astype(np.float16) if mask.dtype == bool else mask.astype(np.float16)
    ref, _ = reference_prefill(q, k, v, full, causal=causal or window is not None, window=window, scale=scale,
                               softcap=softcap, max_bias=max_bias, sinks=sinks)  # fmt: skip
    assert np.isfinite(out).all()
    assert nmse(out, ref) <= 5e-4
    return "valid"


def test_prefill_matches_reference_or_raises_the_documented_error(device):
    _n = _examples(250)
    tally = Tally()

    @_fuzz_settings(250)
    @given(prefill_draws())
    @_seeded
    def prop(args):
        tally.add(run_prefill(device, args))

    prop()
    n = sum(tally.counts.values())
    print(f"\n{device.description}: {n} prefills: {dict(sorted(tally.counts.items()))}")
    if _n >= 200:
        # At least a quarter valid: the draws aim at about a third, and the exact share
        # moves with hypothesis's version (28% was seen with another version).
        assert tally.counts.get("valid", 0) * 4 >= n, tally.counts
