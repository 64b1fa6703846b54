"""The K/V a rank holds on each ring, and the hops between steps, over torch.distributed's
point-to-point calls (``batch_isend_irecv``: NCCL groups them into one launch, gloo runs
them on its own threads). Nothing else communicates.

Each ring keeps two receive buffers and alternates: at step ``t`` the K/V in hand (the
rank's own at step 0, else the buffer filled at step ``t - 1``) are computed on and sent on
while the other buffer receives the next ones; the hops are waited for after the compute.
On CUDA, ``wait()`` orders the caller's stream after the transfer without blocking the
host, and NCCL's stream waits for the work already enqueued on the caller's stream before a
transfer starts, so a buffer is never overwritten while a kernel still reads it."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .agreement import GroupInfo
from .schedule import BACKWARD, FORWARD, RankStep

__all__ = ["KVRing", "pack_kv"]

# gloo tells apart two messages between the same pair by their tag (NCCL matches in order).
_TAGS = {FORWARD: 11, BACKWARD: 12}


def pack_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V as one contiguous ``[rows, 2, kv_heads, dim]`` tensor: one message a hop, and
    any leading rows of it are contiguous (a sender's rows may be fewer than the buffer's)."""
    return torch.stack((k, v), dim=1)


class KVRing:
    """The hops of one rank's schedule. ``held(d)`` is the packed K/V in hand on ring
    ``d`` (FORWARD or BACKWARD) at the current step."""

    def __init__(self, own: torch.Tensor, info: GroupInfo, max_rows: int):
        self._info = info
        self._held: Dict[int, Optional[torch.Tensor]] = {FORWARD: own, BACKWARD: own}
        self._buffers: Dict[int, List[torch.Tensor]] = {}
        self._shape = (max_rows,) + tuple(own.shape[1:])
        self._own = own
        self._pending: list = []
        self._incoming: Dict[int, torch.Tensor] = {}
        self._step = 0

    def held(self, direction: int) -> torch.Tensor:
        if direction == 0:
            return self._own
        kv = self._held[direction]
        assert kv is not None, "the schedule computes on K/V that never arrived"
        return kv

    def start(self, step: RankStep) -> None:
        """Post the hops of ``step`` (asynchronous)."""
        ops = []
        self._incoming = {}
        for tr in step.recvs:
            buf = self._buffer(tr.direction)[: tr.rows]
            self._incoming[tr.direction] = buf
            ops.append(dist.P2POp(dist.irecv, buf, self._info.global_ranks[tr.peer], self._info.group, _TAGS[tr.direction]))
        for tr in step.sends:
            kv = self.held(tr.direction)
            assert kv.shape[0] == tr.rows, "the schedule sends other rows than those in hand"
            ops.append(dist.P2POp(dist.isend, kv, self._info.global_ranks[tr.peer], self._info.group, _TAGS[tr.direction]))
        self._pending = dist.batch_isend_irecv(ops) if ops else []

    def finish(self) -> None:
        """Wait for the hops started (on CUDA: order the caller's stream after them) and
        hold what arrived for the next step."""
        for work in self._pending:
            work.wait()
        self._pending = []
        for d in (FORWARD, BACKWARD):
            self._held[d] = self._incoming.get(d)
        self._step += 1

    def _buffer(self, direction: int) -> torch.Tensor:
        # Step t receives into buffer t % 2; the K/V in hand are in the other one (or are
        # the rank's own), which this step only reads and sends.
        pair = self._buffers.get(direction)
        if pair is None:
            pair = self._buffers[direction] = [
                torch.empty(self._shape, dtype=self._own.dtype, device=self._own.device) for _ in range(2)
            ]
        return pair[self._step % 2]
