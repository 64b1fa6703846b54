"""Cases built to kill planted kernel bugs, shared by every backend's tests
(`tests/test_planted.py`, through the `device` fixture) and by the Metal emulator's
(`tests/test_metal_emulator.py`), with the checks they share.

Each case aims at a class of bug that random data cannot show (docs/reliability.md,
"Mutation testing"):

- exact ties at the rescale threshold: Q = 0, so every score is its mask value, and step
  maxima of exactly M + 8 (a `>=` for `>` rescales there, and P rounds differently);
- negative NaN (0xfe00, 0xfc01, 0xffff) and -0 in masks: a NaN in a tile of -inf must
  keep the tile (class 1) and poison its row;
- masks that vary row by row inside a tile (padding, packed sequences, a tile decided by
  its last row alone), where a classifier that misses a row skips or ignores a tile;
- several inexact scales (scale folded into Q before the rounding to half);
- GQA ratios 1, 2, 3, 4, 8, 16 with head counts where `h / ratio` differs from
  `h % n_kv_heads` and from `h / n_kv_heads`;
- fully masked rows, which must be +0.0 bit for bit (not -0, not garbage / garbage).

Two float64 references judge the output: the exact softmax of SPEC section 3
(`reference_attention`), and `spec_reference`, which follows SPEC section 2 step by step
(the skip table, the lazy rescale with threshold 8, P rounded to half; only the products
and sums are exact). Against the second, a correct kernel differs only where its f32
score or exp lands a p on the other side of a half rounding boundary; a kernel that
rounds, rescales or scales differently from the SPEC differs everywhere. Bars and what
was measured: docs/reliability.md, "Sharper bars".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

import mlx_native as mx
from mlx_native.reference import nmse, peer_mask, reference_attention

from helpers import LowLevelCase, make_case

#: Against the exact float64 softmax (SPEC section 3), NMSE over every (row, head). The half
#: rounding of P alone costs 1e-9 to 6e-8 on these inputs (`spec_reference` against the
#: exact one: the ties cases, whose p reach e^8, are the largest); every backend shares that
#: error, so the bar is 1.5x the largest of it.
EXACT_BAR = 1e-7
#: Against `spec_reference` (the SPEC's own rounding), NMSE over the best 90% of (row, head)
#: pairs (`nmse_bulk`). A correct kernel differs from it only where its f32 score or exp puts
#: a p on the other side of a half rounding boundary: a few p of a few rows (one flip moves a
#: row whose softmax has few keys by up to 1e-9 of the whole). A bug of precision (P kept in
#: float, Q rounded before the scale, a rescale at the wrong threshold) moves every row: at
#: least 1.9e-10 over these cases and 8 seeds each. Seen for correct kernels over the same:
#: at most 1.3e-12 (CPU); docs/reliability.md, "Sharper bars".
SPEC_BAR = 2e-11
#: The share of (row, head) pairs `nmse_bulk` leaves out (the worst ones).
BULK_TRIM = 0.1

NEG_INF = np.float16(-np.inf)
#: Negative NaN bit patterns (quiet, signalling, all ones) and -0.
NEGATIVE_NANS = (0xFE00, 0xFC01, 0xFFFF)
MINUS_ZERO = 0x8000


# -- the SPEC, independently -----------------------------------------------------------------


def nmse_bulk(out: np.ndarray, ref: np.ndarray, trim: float = BULK_TRIM) -> float:
    """NMSE over all but the worst `trim` share of (row, head) pairs (last axis: head dim)."""
    e = ((np.asarray(out, np.float64) - ref) ** 2).sum(axis=-1).ravel()
    keep = np.sort(e)[: len(e) - int(np.ceil(trim * len(e)))]
    den = float((np.asarray(ref, np.float64) ** 2).sum())
    return float(keep.sum()) / den if den else float(keep.sum())


def spec_blk(mask: np.ndarray, rows: int, bq: int, bk: int = 64) -> np.ndarray:
    """SPEC section 1 from the bit patterns: 0 = every value -inf or <= -65504 (not NaN),
    2 = every value +0 or -0, 1 = anything else; only rows < rows."""
    bits = np.ascontiguousarray(mask[:rows]).view(np.uint16)
    kvp = bits.shape[1]
    mag = bits & 0x7FFF
    masked = ((bits & 0x8000) != 0) & (mag >= 0x7BFF) & (mag <= 0x7C00)
    zero = mag == 0
    out = np.empty((-(-rows // bq), kvp // bk), np.uint8)
    for qt in range(out.shape[0]):
        for kt in range(out.shape[1]):
            tile = np.s_[qt * bq : (qt + 1) * bq, kt * bk : (kt + 1) * bk]
            out[qt, kt] = 0 if masked[tile].all() else (2 if zero[tile].all() else 1)
    return out


def spec_reference(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray,
    blk: np.ndarray,
    scale: float,
    *,
    threshold_ge: bool = False,
    round_p: bool = True,
    round_q_first: bool = False,
) -> np.ndarray:
    """SPEC section 2 in float64, step by step: `qh = half(scale * q)`; per 64-row step the
    table byte (0 skips, 2 adds no mask); the lazy rescale (`m > M + 8`); `p = half(exp(s -
    M))`; `S = S*ms + sum p`, `O = O*ms + p.V`; `O / S`, or 0 where S == 0. The keyword
    arguments give the SPEC's near misses (`>=` at the threshold, unrounded P, Q rounded to
    half before the scale), so a test
    can show that its case tells them apart."""
    rows, nh, hd = q.shape
    kvp, nkv, _ = k.shape
    bq = mx.queries_per_threadgroup(hd)
    group = nh // nkv
    q32 = q.astype(np.float32)
    if round_q_first:
        q32 = q32.astype(np.float16).astype(np.float32)
    qh = (np.float32(scale) * q32).astype(np.float16).astype(np.float64)
    kh = k.astype(np.float64)[:, np.arange(nh) // group, :]  # [kvp, nh, hd]
    vh = v.astype(np.float64)[:, np.arange(nh) // group, :]
    m64 = mask[:rows].astype(np.float64)
    tile_of_row = np.arange(rows) // bq
    big_m = np.full((rows, nh), -np.float64(np.finfo(np.float32).max) / 2)
    big_s = np.zeros((rows, nh))
    big_o = np.zeros((rows, nh, hd))
    with np.errstate(invalid="ignore", over="ignore"):
        for step in range(kvp // 64):
            cols = slice(step * 64, (step + 1) * 64)
            t = blk[tile_of_row, step]  # [rows]
            live = t != 0
            if not live.any():
                continue
            s = np.einsum("rhd,jhd->rhj", qh[live], kh[cols])
            add = (t[live] == 1)[:, None, None]
            s = s + np.where(add, m64[live, cols][:, None, :], 0.0)
            m = s.max(axis=2)
            mo = big_m[live]
            up = (m >= mo + 8) if threshold_ge else (m > mo + 8)
            ms = np.where(up, np.exp(mo - m), 1.0)
            mn = np.where(up, m, mo)
            p = np.exp(s - mn[:, :, None])
            if round_p:
                p = p.astype(np.float16).astype(np.float64)
            big_m[live] = mn
            big_s[live] = big_s[live] * ms + p.sum(axis=2)
            big_o[live] = big_o[live] * ms[:, :, None] + np.einsum("rhj,jhd->rhd", p, vh[cols])
    out = np.zeros_like(big_o)
    seen = big_s != 0
    out[seen] = big_o[seen] / big_s[seen][:, None]
    return out


# -- the cases --------------------------------------------------------------------------------


@dataclass
class Planted:
    """A case and what it is for; `build(rng)` gives a fresh LowLevelCase."""

    name: str
    build: Callable[[np.random.Generator], LowLevelCase]
    why: str
    #: Near misses of the SPEC (spec_reference keywords) this case must tell apart, each by
    #: a bulk NMSE of at least 5 x SPEC_BAR against the SPEC's own result.
    tells_apart: Sequence[dict] = field(default_factory=tuple)


def _zero_q(c: LowLevelCase) -> LowLevelCase:
    c.q[...] = 0
    return c


def _ties(hd: int) -> Callable[[np.random.Generator], LowLevelCase]:
    """Q = 0: scores are the mask. Per row: step 0 has max exactly 0; step 1 max exactly 8
    (= M + 8: no rescale), the other values 8 - u; step 2 max exactly 16 (> M + 8: a
    rescale), step 3 max exactly 24 (= M + 8 again), step 4 exactly 24 - 8 = 16 (below).
    Every value is a half, so the scores are exact in any precision."""

    def build(rng):
        rows = 37 if hd == 256 else 21
        c = make_case(rng, rows, 2, 1, hd, 5 * 64, mask="zero")
        _zero_q(c)
        steps = [0.0, 8.0, 16.0, 24.0, 16.0]
        for i, top in enumerate(steps):
            u = rng.choice(np.arange(1, 97) / 16.0, size=(rows, 64))  # 1/16 .. 6, halves
            vals = (top - u).astype(np.float16)
            vals[np.arange(rows), rng.integers(0, 64, rows)] = top  # the max, exactly
            c.mask[:, i * 64 : (i + 1) * 64] = vals
        return c

    return build


def _negative_nan(hd: int) -> Callable[[np.random.Generator], LowLevelCase]:
    """Tiles of -inf with one negative NaN each (first row, the tile's last row, the last
    column), a tile of -0 and +0, a tile of -0 alone, a tile of -inf and -65504."""

    def build(rng):
        bq = mx.queries_per_threadgroup(hd)
        rows = 2 * bq + 5
        c = make_case(rng, rows, 2, 1, hd, 8 * 64, mask="peer")
        m = c.mask.view(np.uint16)
        ninf = np.float16(-np.inf).view(np.uint16)
        # Query tile 0: step 0 -inf with 0xfe00 at (0, 3); step 1 -inf with 0xfc01 in the
        # tile's last row; step 2 -inf with 0xffff in the last column.
        m[:bq, 0:64] = ninf
        m[0, 3] = NEGATIVE_NANS[0]
        m[:bq, 64:128] = ninf
        m[bq - 1, 64 + 17] = NEGATIVE_NANS[1]
        m[:bq, 128:192] = ninf
        m[5, 191] = NEGATIVE_NANS[2]
        # Query tile 1: step 3 all -0; step 4 a mix of +0 and -0; step 5 -inf and -65504.
        m[bq : 2 * bq, 192:256] = MINUS_ZERO
        m[bq : 2 * bq, 256:320] = np.where(rng.random((bq, 64)) < 0.5, 0, MINUS_ZERO)
        m[bq : 2 * bq, 320:384] = np.where(rng.random((bq, 64)) < 0.5, ninf, np.float16(-65504).view(np.uint16))
        # The last (partial) tile: -inf with a negative NaN in its last row, rows - 1.
        m[2 * bq :, 384:448] = ninf
        m[rows - 1, 400] = NEGATIVE_NANS[0]
        return c

    return build


def nan_rows(c: LowLevelCase) -> np.ndarray:
    """Rows whose mask holds a NaN: every head of them is NaN (docs/reliability.md, 4)."""
    return np.nonzero(np.isnan(c.mask[: c.rows].astype(np.float32)).any(axis=1))[0]


def _padding(hd: int) -> Callable[[np.random.Generator], LowLevelCase]:
    """A padding mask: row r sees cache rows [0, len_r), lengths varying row by row inside
    each tile; some rows see nothing (one whole query tile: all its steps are skipped), and
    in one tile only its last row sees past 64."""

    def build(rng):
        bq = mx.queries_per_threadgroup(hd)
        rows, kv = 4 * bq - 3, 200
        c = make_case(rng, rows, 4, 2, hd, kv, mask="zero")
        lens = rng.integers(1, kv + 1, rows)
        lens[:bq] = rng.integers(1, 64, bq)
        lens[bq - 1] = 150  # tile 0, steps 1 and 2: only the last row sees anything
        lens[[2, bq + 3]] = 0  # fully masked rows in computed tiles
        lens[2 * bq : 3 * bq] = 0  # a query tile whose every step is skipped
        lens[rows - 1] = kv  # the last (partial) tile's last row sees everything
        j = np.arange(c.mask.shape[1])
        c.mask[:] = np.where(j[None, :] < lens[:, None], np.float16(0), NEG_INF)
        return c

    return build


def _packed(hd: int) -> Callable[[np.random.Generator], LowLevelCase]:
    """Packed sequences: a block-diagonal causal mask (each row sees the earlier rows of its
    own sequence), sequence boundaries inside tiles; random values where visible."""

    def build(rng):
        rows = 150 if hd == 256 else 70
        c = make_case(rng, rows, 2, 1, hd, rows, mask="zero")
        bounds = np.sort(rng.choice(np.arange(1, rows), size=6, replace=False))
        seq = np.searchsorted(bounds, np.arange(rows), side="right")
        r = np.arange(rows)[:, None]
        j = np.arange(c.mask.shape[1])[None, :]
        jj = np.minimum(j, rows - 1)
        visible = (j < rows) & (j <= r) & (seq[jj] == seq[r])
        vals = rng.uniform(-1, 1, (rows, c.mask.shape[1])).astype(np.float16)
        c.mask[:] = np.where(visible, vals, NEG_INF)
        return c

    return build


def _last_row_decides(hd: int) -> Callable[[np.random.Generator], LowLevelCase]:
    """Tiles decided by their last row alone: -inf everywhere but the last row (class 1, not
    0); zeros everywhere but a non-zero last row (class 1, not 2); the same for the last,
    partial tile, whose last row is rows - 1."""

    def build(rng):
        bq = mx.queries_per_threadgroup(hd)
        rows = 2 * bq + 7
        c = make_case(rng, rows, 2, 2, hd, 4 * 64, mask="zero")
        c.mask[:, 0:64] = rng.uniform(-1, 1, (rows, 64)).astype(np.float16)  # every row sees step 0
        c.mask[:bq, 64:128] = NEG_INF
        c.mask[bq - 1, 64:128] = rng.uniform(-1, 1, 64).astype(np.float16)
        c.mask[:bq, 128:192] = 0
        c.mask[bq - 1, 128:192] = rng.uniform(0.5, 2, 64).astype(np.float16)
        c.mask[bq:, 64:256] = NEG_INF
        c.mask[rows - 1, 128:192] = rng.uniform(-1, 1, 64).astype(np.float16)
        c.mask[2 * bq :, 192:256] = 0
        c.mask[rows - 1, 192:256] = rng.uniform(0.5, 2, 64).astype(np.float16)
        return c

    return build


def _scaled(hd: int, scale: float) -> Callable[[np.random.Generator], LowLevelCase]:
    def build(rng):
        return make_case(rng, 40, 2, 1, hd, 150, scale=scale, mask="peer")

    return build


def _gqa(nh: int, nkv: int, hd: int) -> Callable[[np.random.Generator], LowLevelCase]:
    def build(rng):
        return make_case(rng, 19, nh, nkv, hd, 90, mask="peer")

    return build


PLANTED = [
    Planted("ties-d256", _ties(256), "step maxima of exactly M + 8 (Q = 0)", [dict(threshold_ge=True)]),
    Planted("ties-d512", _ties(512), "step maxima of exactly M + 8 (Q = 0)", [dict(threshold_ge=True)]),
    Planted("negative-nan-d256", _negative_nan(256), "negative NaN and -0 in the mask"),
    Planted("negative-nan-d512", _negative_nan(512), "negative NaN and -0 in the mask"),
    Planted("padding-d256", _padding(256), "padding lengths varying inside tiles"),
    Planted("padding-d512", _padding(512), "padding lengths varying inside tiles"),
    Planted("packed-d256", _packed(256), "packed sequences (block-diagonal causal)"),
    Planted("packed-d512", _packed(512), "packed sequences (block-diagonal causal)"),
    Planted("last-row-d256", _last_row_decides(256), "tiles decided by their last row alone"),
    Planted("last-row-d512", _last_row_decides(512), "tiles decided by their last row alone"),
    Planted("scale-0.1-d256", _scaled(256, 0.1), "an inexact scale", [dict(round_q_first=True)]),
    Planted("scale-0.3-d512", _scaled(512, 0.3), "an inexact scale", [dict(round_q_first=True)]),
    Planted("scale-0.7071-d256", _scaled(256, 0.70710678), "an inexact scale", [dict(round_q_first=True)]),
    Planted("scale-1.7-d512", _scaled(512, 1.7), "an inexact scale", [dict(round_q_first=True)]),
    Planted("gqa-1-3/3-d512", _gqa(3, 3, 512), "GQA ratio 1"),
    Planted("gqa-2-6/3-d256", _gqa(6, 3, 256), "GQA ratio 2 (h/2 != h%3 != h/3)"),
    Planted("gqa-3-6/2-d512", _gqa(6, 2, 512), "GQA ratio 3"),
    Planted("gqa-4-8/2-d256", _gqa(8, 2, 256), "GQA ratio 4"),
    Planted("gqa-8-16/2-d512", _gqa(16, 2, 512), "GQA ratio 8"),
    Planted("gqa-16-32/2-d256", _gqa(32, 2, 256), "GQA ratio 16"),
]


def crafted_blk_mask(rng, bq: int, bk: int):
    """A mask of crafted tiles and the table SPEC section 1 gives it: in every query tile
    (the last one partial), each negative NaN pattern at the first and last row and column
    of a tile of -inf (1); a tile of -0 (2), of -0 and +0 (2), of -65504 and -inf (0); a
    tile of -inf whose last row alone has a 0 (1), a tile of zeros whose last row alone has
    a 1 (1); a tile of -inf (0). Returns (mask float16 [rows, kv_pad], table, rows)."""
    rows = 2 * bq + max(1, bq // 3)
    ninf = np.float16(-np.inf).view(np.uint16)

    def tiles(qt):
        """(tile content setter, class) per column tile of query tile qt."""
        r0, r1 = qt * bq, min(rows, (qt + 1) * bq)
        out = []
        for nan in NEGATIVE_NANS:
            for r, j in ((r0, 0), (r1 - 1, bk - 1), (r1 - 1, 0), (r0, bk - 1)):
                out.append((lambda t, r=r - r0, j=j, nan=nan: (t.fill(ninf), t.__setitem__((r, j), nan)), 1))
        out += [
            (lambda t: t.fill(0x8000), 2),  # -0 alone
            (lambda t: t.__setitem__(Ellipsis, np.where(rng.random(t.shape) < 0.5, 0, 0x8000)), 2),
            (lambda t: t.__setitem__(Ellipsis, np.where(rng.random(t.shape) < 0.5, ninf, 0xFBFF)), 0),  # -65504
            (lambda t: (t.fill(ninf), t.__setitem__((-1, bk // 2), 0)), 1),  # the last row alone sees
            (lambda t: (t.fill(0), t.__setitem__((-1, bk // 2), 0x3C00)), 1),  # the last row alone adds 1
            (lambda t: t.fill(ninf), 0),
        ]
        return out

    n = len(tiles(0))
    kvp = n * bk
    m = np.zeros((rows, kvp), np.uint16)
    want = np.zeros((-(-rows // bq), n), np.uint8)
    for qt in range(want.shape[0]):
        for kt, (fill, cls) in enumerate(tiles(qt)):
            fill(m[qt * bq : (qt + 1) * bq, kt * bk : (kt + 1) * bk])
            want[qt, kt] = cls
    return m.view(np.float16), want, rows


# -- every field of the params block ------------------------------------------------------

#: The fields of the GPU params block (rust/src/params.rs), a value of each, and another
#: over the same buffers. `mask_row_stride` is always kv_pad through the op; the kernels are
#: held to it by a hand-built dispatch (the Metal emulator, rust/tests/planted.rs).
FIELD_BASE = dict(rows=40, n_heads=4, n_kv_heads=2, kv_pad=192, q_row_stride=1152, q_head_stride=264,
                  k_row_stride=560, k_head_stride=272, v_row_stride=600, v_head_stride=280,
                  mask_row_stride=192, scale=1.0)  # fmt: skip
FIELD_PERTURBED = dict(rows=33, n_heads=2, n_kv_heads=1, kv_pad=128, q_row_stride=1156, q_head_stride=260,
                       k_row_stride=544, k_head_stride=262, v_row_stride=576, v_head_stride=288,
                       mask_row_stride=256, scale=0.7)  # fmt: skip
GPU_FIELDS = list(FIELD_BASE)


def field_buffers(rng, hd: int = 256):
    """Flat Q, K, V and mask buffers large enough for FIELD_BASE and every perturbed field,
    every element random (a view that reads other elements computes something else)."""
    need = lambda rs, hs, n_rows, n_heads: (n_rows - 1) * rs + (n_heads - 1) * hs + hd  # noqa: E731
    q = rng.uniform(-1, 1, need(1156, 264, 40, 4) + 64).astype(np.float32)
    k = rng.uniform(-1, 1, need(560, 272, 192, 2) + 64).astype(np.float16)
    v = rng.uniform(-1, 1, need(600, 288, 192, 2) + 64).astype(np.float16)
    mask = rng.uniform(-2, 1, 40 * 256).astype(np.float16)
    return q, k, v, mask


def _view(flat, shape, strides_elems):
    item = flat.itemsize
    return np.lib.stride_tricks.as_strided(flat, shape=shape, strides=[s * item for s in strides_elems], writeable=False)


def field_views(bufs, prm: dict, hd: int = 256):
    """(q, k, v, mask) as the params `prm` describe them over the flat buffers."""
    q, k, v, mask = bufs
    rows, nh, nkv, kvp = prm["rows"], prm["n_heads"], prm["n_kv_heads"], prm["kv_pad"]
    mrs = prm.get("mask_row_stride", kvp)
    return (
        _view(q, (rows, nh, hd), (prm["q_row_stride"], prm["q_head_stride"], 1)),
        _view(k, (kvp, nkv, hd), (prm["k_row_stride"], prm["k_head_stride"], 1)),
        _view(v, (kvp, nkv, hd), (prm["v_row_stride"], prm["v_head_stride"], 1)),
        _view(mask, (rows, kvp), (mrs, 1)),
    )


# -- the checks -------------------------------------------------------------------------------


def fully_masked_rows(c: LowLevelCase) -> np.ndarray:
    """Rows whose every mask value is -inf (or <= -65504 over whole skipped tiles: not used
    here); their output must be +0.0."""
    m = c.mask[: c.rows].astype(np.float32)
    return np.nonzero((m == -np.inf).all(axis=1))[0]


def check_planted(out: np.ndarray, blk: np.ndarray, c: LowLevelCase, *, label: str = "") -> dict:
    """Everything a planted case demands of one backend's output and table; returns the
    errors seen (for reports)."""
    rows, nh, hd = c.q.shape
    bq = mx.queries_per_threadgroup(hd)
    want_blk = spec_blk(c.mask, rows, bq)
    assert np.array_equal(blk, want_blk), f"{label}: blk\n{blk}\n!= SPEC\n{want_blk}"
    out = out[:rows]
    bad = nan_rows(c)
    if len(bad):
        # A NaN in the mask keeps its tile and poisons its row in every head.
        assert np.isnan(out[bad]).all(), f"{label}: rows {bad} must be NaN (a NaN in their mask)"
    good = np.setdiff1d(np.arange(rows), bad)
    assert np.isfinite(out[good]).all(), f"{label}: non-finite output"
    zero = fully_masked_rows(c)
    if len(zero):
        bits = out[zero].view(np.uint32)
        assert (bits == 0).all(), f"{label}: fully masked rows {zero} are not +0.0 bit for bit"
    exact = reference_attention(c.q[good], c.k, c.v, c.mask[good], scale=c.scale)
    spec = spec_reference(c.q, c.k, c.v, c.mask, want_blk, c.scale)[good]
    e_exact = nmse(out[good], exact)
    e_spec = nmse_bulk(out[good], spec)
    assert e_exact <= EXACT_BAR, f"{label}: nmse {e_exact:.3e} against the exact float64 softmax"
    assert e_spec <= SPEC_BAR, f"{label}: bulk nmse {e_spec:.3e} against the SPEC's rounding (spec_reference)"
    return {"exact": e_exact, "spec": e_spec}


def planted_id(p: Planted) -> str:
    return p.name


#: What every case must tell from the SPEC: P not rounded to half.
ALWAYS_TELLS_APART = (dict(round_p=False),)


def sensitivity(p: Planted, c: LowLevelCase) -> list:
    """(near miss, bulk NMSE between the SPEC's result and it) for each near miss the case
    must tell apart (its own and ALWAYS_TELLS_APART), over the rows without a NaN."""
    rows, nh, hd = c.q.shape
    blk = spec_blk(c.mask, rows, mx.queries_per_threadgroup(hd))
    good = np.setdiff1d(np.arange(rows), nan_rows(c))
    base = spec_reference(c.q, c.k, c.v, c.mask, blk, c.scale)[good]
    return [
        (kw, nmse_bulk(spec_reference(c.q, c.k, c.v, c.mask, blk, c.scale, **kw)[good], base))
        for kw in (*ALWAYS_TELLS_APART, *p.tells_apart)
    ]
