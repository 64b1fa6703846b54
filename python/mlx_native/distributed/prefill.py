"""``context_parallel_prefill``: one prefill's attention over the ranks of a process group,
each holding chunks of the sequence (ring attention)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..attention import flash_attn_prefill
from ..errors import MlxError
from .accumulate import Accumulator
from .agreement import agree, check_local, group_info
from .ring import KVRing, pack_kv
from .schedule import Block, ring_schedule

__all__ = ["context_parallel_prefill"]

# Groups whose communicators a first collective has set up (see _set_up).
_SET_UP: dict = {}


def context_parallel_prefill(
    q: Any,
    k: Any,
    v: Any,
    *,
    group: Any = None,
    causal: bool = True,
    window: Optional[int] = None,
    scale: Optional[float] = None,
    layout: str = "zigzag",
    seq_len: Optional[int] = None,
    return_lse: bool = False,
    out_dtype: Any = None,
) -> Any:
    """The attention of a prefill whose sequence is cut between the ranks of ``group``
    (None: the default group), each rank calling with its own chunks; returns this rank's
    rows of the result of :func:`~mlx_native.flash_attn_prefill` on the whole sequence.

    - ``q`` ``[rows_local, heads, head_dim]``, ``k``, ``v`` ``[rows_local, kv_heads,
      head_dim]``: torch tensors, CUDA (an NCCL group) or CPU (a gloo group); dtypes and
      head dims as :func:`~mlx_native.flash_attn_prefill` takes them. Queries and
      keys/values are cut alike: the rows of the chunks the ``layout`` gives this rank.
    - ``layout``: ``"zigzag"`` (default): the sequence of ``N`` rows is cut into ``2P``
      chunks and rank ``i`` holds chunks ``i`` and ``2P - 1 - i`` (the same causal work on
      every rank); ``"contiguous"``: ``P`` chunks, rank ``i`` holds chunk ``i``. Chunk
      ``c`` of ``n`` starts at row ``c * (N // n) + min(c, N % n)``: the first ``N % n``
      chunks are one row longer. :func:`shard_sequence` cuts a whole tensor so.
    - ``causal`` (default True): query row ``r`` sees rows ``j <= r``; ``window=w`` also
      needs ``j > r - w`` (implies causal); ``causal=False``: every row sees every row.
    - ``scale``: None is ``1/sqrt(head_dim)``.
    - ``seq_len``: ``N``. None: found by one ``all_gather`` of a few integers per rank,
      which also checks that every rank passed the same heads, head dim, mask, scale and
      layout and holds the rows the layout gives it, so that a mistake is the same error
      on every rank (on an NCCL group, a host synchronisation). Given (by every rank
      alike): nothing is
      communicated but the ring; each rank checks its own arguments only, and a rank that
      raises leaves the others waiting in the ring (until the group's timeout).
    - ``return_lse``: also return the float32 ``[heads, rows_local]`` log-sum-exp.
    - ``out_dtype``: float32, float16 or bfloat16 (default q's).

    Each rank keeps its queries and passes K/V around a ring with ``batch_isend_irecv``,
    the next K/V's transfer overlapping the partial attention on those in hand; a partial
    attention is one ``flash_attn_prefill`` call with no mask (pairs all visible) or the
    causal/window mask described with its chunk's ``offset``, and chunks that see nothing
    are neither computed nor sent where nobody needs them (a window stops the ring early).
    Partials merge exactly through their lse, in float32. On CUDA everything is enqueued on
    the caller's current stream. The ranks must call it together, with the same arguments
    but for the tensors."""
    info = group_info(group)
    args, problem = None, None
    try:
        args = check_local(q, k, v, causal=causal, window=window, scale=scale, layout=layout, seq_len=seq_len,
                           return_lse=return_lse, out_dtype=out_dtype, info=info)  # fmt: skip
    except MlxError as e:
        if seq_len is not None:
            raise
        problem = e
    _set_up(info, q)
    if seq_len is None:
        n = agree(args, problem, info, _descriptor_device(info, q))
    else:
        n = args.seq_len
    schedule = ring_schedule(n, info.size, args.layout, args.causal, args.window)
    acc = Accumulator(args.rows, args.n_heads, args.head_dim, q.device)
    ring = KVRing(pack_kv(k, v), info, max(schedule.rows))
    for step in schedule.steps[info.rank]:
        ring.start(step)
        for work in step.work:
            kv = ring.held(work.direction)
            for block in work.blocks:
                _compute(block, q, kv, args, acc)
        ring.finish()
    out = acc.out if args.out_dtype == torch.float32 else acc.out.to(args.out_dtype)
    return (out, acc.lse) if args.return_lse else out


def _compute(block: Block, q: torch.Tensor, kv: torch.Tensor, args, acc: Accumulator) -> None:
    """One partial attention, merged into the rank's result."""
    described = block.offset is not None
    out, lse = flash_attn_prefill(
        q[block.q0 : block.q1],
        kv[block.k0 : block.k1, 0],
        kv[block.k0 : block.k1, 1],
        causal=described,
        window=args.window if described else None,
        offset=block.offset,
        scale=args.scale,
        return_lse=True,
        out_dtype=torch.float32,
    )
    acc.add(block.q0, block.q1, out, lse)


def _descriptor_device(info, q) -> torch.device:
    # The arguments' descriptor goes where the backend takes it: the CPU for gloo (also in
    # a mixed "cpu:gloo,cuda:nccl" group: no GPU synchronisation), else this rank's GPU.
    if "gloo" in info.backend.lower() or not torch.cuda.is_available():
        return torch.device("cpu")
    if isinstance(q, torch.Tensor) and q.device.type == "cuda":
        return q.device
    return torch.device("cuda", torch.cuda.current_device())


def _set_up(info, q) -> None:
    """A first collective on a group the ring has not used yet: NCCL sets up a group's
    communicator on its first call, and a first call that is point-to-point must have every
    rank in it, which a pruned step need not have."""
    group = torch.distributed.group.WORLD if info.group is None else info.group
    if _SET_UP.get(id(group)) is group:
        return
    torch.distributed.all_reduce(torch.zeros(1, device=_descriptor_device(info, q)), group=info.group)
    _SET_UP[id(group)] = group  # kept alive, so that its id is not reused
