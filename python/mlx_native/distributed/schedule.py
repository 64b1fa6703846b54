"""The work of a ring-attention prefill, decided before anything runs (no torch here): for
every rank, which partial attentions to compute on which K/V, at which ring step, and which
K/V to pass on.

A *block* is one call of ``flash_attn_prefill``: local query rows against rows of the K/V
in hand (the holder's local rows), with no mask when every pair is visible, or with the
causal/window mask described by an offset (SPEC 6) when only some are. Pairs of chunks that
see nothing are no block at all. Neighbouring blocks that one call computes exactly (both
fully visible, or adjacent in the sequence on both axes) are joined, so a step is one or two
calls, not one per pair of chunks.

The ring: at step ``t`` rank ``j`` computes on the K/V of rank ``j - t`` (the *forward*
ring) and, where the mask makes it cheaper, of rank ``j + t`` (a *backward* ring); K/V
travel one hop per step, and a hop is made only if its K/V are needed there or further on,
so the ring stops where no rank needs more (a window) and skips what nobody needs (the
contiguous layout's wrap-around under a causal mask)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, List, Optional, Tuple

from ..masks import described_pairs
from .chunks import Range, rank_chunks

__all__ = ["Block", "Work", "Transfer", "RankStep", "RingSchedule", "ring_schedule", "plan_blocks", "pair_kind"]

FORWARD, BACKWARD, OWN = 1, -1, 0


@dataclass(frozen=True)
class Block:
    """Local query rows ``[q0, q1)`` against rows ``[k0, k1)`` of the K/V in hand.
    ``offset`` None: every pair is visible (no mask); else the causal (window) mask with
    query row ``r`` of the block at position ``r + offset`` of its K/V rows. ``pairs``: the
    visible (query, key) pairs, SPEC 5's useful work."""

    q0: int
    q1: int
    k0: int
    k1: int
    offset: Optional[int]
    pairs: int


@dataclass(frozen=True)
class Work:
    """The blocks computed on one K/V in hand: ``direction`` OWN (the rank's own K/V),
    FORWARD or BACKWARD (the K/V of ``source`` that arrived by that ring)."""

    direction: int
    source: int
    blocks: Tuple[Block, ...]


@dataclass(frozen=True)
class Transfer:
    """One hop: ``rows`` K/V rows to or from ``peer`` (a rank of the group) on one ring."""

    direction: int
    peer: int
    rows: int


@dataclass(frozen=True)
class RankStep:
    """What one rank does at one step: start the hops (sends of the K/V it holds, receives
    of those it holds next), compute ``work`` meanwhile, then wait for the hops."""

    work: Tuple[Work, ...]
    sends: Tuple[Transfer, ...]
    recvs: Tuple[Transfer, ...]


@dataclass(frozen=True)
class RingSchedule:
    """Everything every rank does: ``steps[rank][t]`` for ``t`` in ``0..n_steps-1``.
    ``rows[rank]``: its local rows; ``forward_steps`` / ``backward_steps``: how far K/V
    travel on each ring."""

    world_size: int
    rows: Tuple[int, ...]
    forward_steps: int
    backward_steps: int
    steps: Tuple[Tuple[RankStep, ...], ...]

    @property
    def n_steps(self) -> int:
        return 1 + max(self.forward_steps, self.backward_steps)

    def transfers(self) -> int:
        """Hops over all ranks and steps (each moves one rank's K/V)."""
        return sum(len(s.recvs) for rank in self.steps for s in rank)

    def pairs(self, rank: int) -> int:
        return sum(b.pairs for s in self.steps[rank] for w in s.work for b in w.blocks)


# ------------------------------------------------------------------ blocks


def pair_kind(q: Range, k: Range, causal: bool, window: Optional[int]) -> str:
    """How sequence rows ``q`` see sequence rows ``k`` (both non-empty ``[start, stop)``):
    ``"none"``, ``"full"`` (every pair) or ``"part"``. Causal: ``j <= r``; window ``w``:
    also ``j > r - w``."""
    (r0, r1), (j0, j1) = q, k
    if not causal:
        return "full"
    if j0 > r1 - 1 or (window is not None and j1 - 1 <= r0 - window):
        return "none"
    if j1 - 1 <= r0 and (window is None or j0 > r1 - 1 - window):
        return "full"
    return "part"


@dataclass(frozen=True)
class _Cell:
    q: Range  # local query rows
    k: Range  # rows of the K/V in hand
    qpos: Optional[int]  # sequence position of q[0] if q's rows are consecutive there, else None
    kpos: Optional[int]
    full: bool
    none: bool = False  # no pair visible: kept only to be absorbed into a described block


def _join(a: _Cell, b: _Cell, axis: str) -> Optional[_Cell]:
    """``a`` and ``b`` (``b`` right after ``a`` along ``axis``, "k" or "q", and equal
    along the other) as one call, or None when no single call computes both exactly."""
    if axis == "k":
        if a.q != b.q or a.k[1] != b.k[0]:
            return None
        pos = a.kpos if None not in (a.kpos, b.kpos) and a.kpos + (a.k[1] - a.k[0]) == b.kpos else None
        joined = _Cell(a.q, (a.k[0], b.k[1]), a.qpos, pos, a.full and b.full, a.none and b.none)
    else:
        if a.k != b.k or a.q[1] != b.q[0]:
            return None
        pos = a.qpos if None not in (a.qpos, b.qpos) and a.qpos + (a.q[1] - a.q[0]) == b.qpos else None
        joined = _Cell((a.q[0], b.q[1]), a.k, pos, a.kpos, a.full and b.full, a.none and b.none)
    # No mask for pairs all visible; a described mask needs both ranges consecutive in the
    # sequence (its offset places every row of both), and then takes in pairs that see
    # nothing at no cost (the kernel skips their tiles by the description).
    if joined.full or (joined.qpos is not None and joined.kpos is not None):
        return joined
    return None


def _runs(cells: List[_Cell], axis: str) -> List[_Cell]:
    out: List[_Cell] = []
    for c in cells:
        j = _join(out[-1], c, axis) if out else None
        if j is None:
            out.append(c)
        else:
            out[-1] = j
    return out


def plan_blocks(q_chunks: List[Range], kv_chunks: List[Range], causal: bool, window: Optional[int]) -> Tuple[Block, ...]:
    """The calls that compute local queries (sequence chunks ``q_chunks``, in local order)
    against K/V in hand (chunks ``kv_chunks``): each visible pair once, nothing else."""

    def local(chunks):
        out, at = [], 0
        for a, b in chunks:
            out.append(((at, at + b - a), (a, b)))
            at += b - a
        return out

    per_q: List[List[_Cell]] = []
    for ql, qs in local(q_chunks):
        row = []
        for kl, ks in local(kv_chunks):
            if ql[0] == ql[1] or kl[0] == kl[1]:
                continue
            kind = pair_kind(qs, ks, causal, window)
            row.append(_Cell(ql, kl, qs[0], ks[0], kind == "full", kind == "none"))
        per_q.append(_runs(row, "k"))
    # Join along q the cells of neighbouring query chunks over the same K/V rows.
    cells: List[_Cell] = []
    for row in per_q:
        for c in row:
            for i, d in enumerate(cells):
                j = _join(d, c, "q")
                if j is not None:
                    cells[i] = j
                    break
            else:
                cells.append(c)
    blocks = []
    for c in cells:
        if c.none:
            continue
        lq, lk = c.q[1] - c.q[0], c.k[1] - c.k[0]
        if c.full:
            blocks.append(Block(c.q[0], c.q[1], c.k[0], c.k[1], None, lq * lk))
        else:
            off = c.qpos - c.kpos
            blocks.append(Block(c.q[0], c.q[1], c.k[0], c.k[1], off, described_pairs(lq, lk, True, window, off)))
    return tuple(blocks)


# ------------------------------------------------------------------ the ring


def _hops_needed(world: int, d: int, steps: int, computes: Dict[Tuple[int, int], bool]) -> Dict[Tuple[int, int], bool]:
    """``needed[(j, t)]``: rank ``j`` must hold, at step ``t`` of ring ``d``, the K/V of rank
    ``j - d t``: it computes on them, or a rank further on needs them from it."""
    needed: Dict[Tuple[int, int], bool] = {}
    for t in range(steps, 0, -1):
        for j in range(world):
            later = needed.get(((j + d) % world, t + 1), False)
            needed[(j, t)] = computes.get((j, t), False) or later
    return needed


def _candidate(world: int, needs: List[Dict[int, Tuple[Block, ...]]], fwd: int):
    """The cheapest backward reach given a forward reach ``fwd``, and its hops."""
    bwd = 0
    for j in range(world):
        for src in needs[j]:
            if (j - src) % world > fwd:
                bwd = max(bwd, (src - j) % world)
    comp = {FORWARD: {}, BACKWARD: {}}
    for j in range(world):
        for src in needs[j]:
            df = (j - src) % world
            if df <= fwd:
                comp[FORWARD][(j, df)] = True
            else:
                comp[BACKWARD][(j, (src - j) % world)] = True
    # The reach actually used: the farthest step at which a rank computes.
    fwd = max((t for _, t in comp[FORWARD]), default=0)
    bwd = max((t for _, t in comp[BACKWARD]), default=0)
    hops = {d: _hops_needed(world, d, reach, comp[d]) for d, reach in ((FORWARD, fwd), (BACKWARD, bwd))}
    total = sum(v for h in hops.values() for v in h.values())
    return total, fwd, bwd, comp, hops


@lru_cache(maxsize=256)
def ring_schedule(seq_len: int, world_size: int, layout: str, causal: bool, window: Optional[int]) -> RingSchedule:
    """The schedule of a prefill of ``seq_len`` rows over ``world_size`` ranks in
    ``layout`` (see :mod:`.chunks`). Of the rings that give every rank the K/V it needs,
    the one with the fewest hops (then with no backward ring, then the shortest)."""
    chunks = rank_chunks(seq_len, world_size, layout)
    rows = tuple(sum(b - a for a, b in c) for c in chunks)
    P = world_size
    needs: List[Dict[int, Tuple[Block, ...]]] = []
    for j in range(P):
        by_src = {}
        for src in range(P):
            blocks = plan_blocks(chunks[j], chunks[src], causal, window)
            if blocks:
                by_src[src] = blocks
        needs.append(by_src)
    best = None
    others = [{s: b for s, b in n.items() if s != j} for j, n in enumerate(needs)]
    for reach in range(P):
        total, fwd, bwd, comp, hops = _candidate(P, others, reach)
        key = (total, bwd > 0, max(fwd, bwd))
        if best is None or key < best[0]:
            best = (key, fwd, bwd, comp, hops)
    _, fwd, bwd, comp, hops = best
    reach = {FORWARD: fwd, BACKWARD: bwd}
    steps = []
    for j in range(P):
        mine = []
        for t in range(1 + max(fwd, bwd)):
            work = []
            if t == 0 and j in needs[j]:
                work.append(Work(OWN, j, needs[j][j]))
            sends, recvs = [], []
            for d in (FORWARD, BACKWARD):
                src = (j - d * t) % P
                if t > 0 and comp[d].get((j, t)):
                    work.append(Work(d, src, needs[j][src]))
                if t < reach[d]:
                    nxt, prv = (j + d) % P, (j - d) % P
                    if hops[d].get((nxt, t + 1)):
                        sends.append(Transfer(d, nxt, rows[src]))
                    if hops[d].get((j, t + 1)):
                        recvs.append(Transfer(d, prv, rows[(j - d * (t + 1)) % P]))
            mine.append(RankStep(tuple(work), tuple(sends), tuple(recvs)))
        steps.append(tuple(mine))
    return RingSchedule(P, rows, fwd, bwd, tuple(steps))
