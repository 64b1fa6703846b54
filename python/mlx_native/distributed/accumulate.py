"""The partial results of a rank's queries, merged in place as they come (SPEC 8) in float32.

``merge_attention_states`` returns new arrays; a ring step merges one partial into a slice
of the rank's running result, so this does the same arithmetic in place, on the tensors'
device (no host synchronisation): with ``L = ln(e^l1 + e^l2)`` computed from the larger
lse, ``o = e^(l1 - L) o1 + e^(l2 - L) o2``. A row whose lse is -inf on both sides stays
``o = 0``, ``lse = -inf`` exactly; a row seen by one side only takes that side's values
(its weight is exactly 1, the other's exactly 0)."""

from __future__ import annotations

import torch

__all__ = ["Accumulator"]


class Accumulator:
    """The running output ``out`` (float32 ``[rows, heads, dim]``) and ``lse`` (float32
    ``[heads, rows]``) of a rank's local queries; rows no partial has reached yet are taken,
    not merged (a copy), so a row range's first partial costs no arithmetic."""

    def __init__(self, rows: int, n_heads: int, head_dim: int, device: torch.device):
        self.out = torch.zeros((rows, n_heads, head_dim), dtype=torch.float32, device=device)
        self.lse = torch.full((n_heads, rows), float("-inf"), dtype=torch.float32, device=device)
        self._reached = torch.zeros(rows, dtype=torch.bool)  # on the host: decided without a sync

    def add(self, q0: int, q1: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Merge a partial result of local rows ``[q0, q1)``: ``out`` ``[q1-q0, heads,
        dim]`` (any float dtype, read as float32) and ``lse`` float32 ``[heads, q1-q0]``."""
        if q1 <= q0:
            return
        reached = self._reached[q0:q1]
        if not bool(reached.any()):
            self.out[q0:q1].copy_(out)
            self.lse[:, q0:q1].copy_(lse)
        else:
            merge_into(self.out[q0:q1], self.lse[:, q0:q1], out, lse)
        reached.fill_(True)


def merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """``(acc_out, acc_lse) <- merge((acc_out, acc_lse), (out, lse))`` in place (SPEC 8), in
    float32: ``acc_out`` float32 ``[rows, heads, dim]``, ``acc_lse`` float32 ``[heads,
    rows]`` (views are fine), ``out`` / ``lse`` of the same shapes."""
    lse = lse.to(torch.float32)
    top = torch.maximum(acc_lse, lse)
    seen = top > float("-inf")
    base = torch.where(seen, top, torch.zeros_like(top))  # keeps exp() finite where nothing is seen
    w_acc = torch.exp(acc_lse - base)  # exactly 0 for an lse of -inf
    w_new = torch.exp(lse - base)
    total = torch.where(seen, w_acc + w_new, torch.ones_like(top))  # >= 1 where seen
    acc_lse.copy_(torch.where(seen, base + torch.log(total), top))
    # The two weights add up to 1 where a row is seen (and the new one is 0 where it is
    # not): o = o_acc + c (o_new - o_acc), one pass over the output (read both, write one).
    # lerp gives o_new exactly at c = 1 (a row only the new part sees) and o_acc at c = 0.
    c_new = (w_new / total).transpose(0, 1).unsqueeze(-1)
    acc_out.lerp_(out.to(torch.float32), c_new)
