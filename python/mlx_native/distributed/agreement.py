"""The arguments of a context-parallel prefill: each rank's own checks, and the group's
agreement on what must be the same everywhere.

A rank that refused its arguments alone would leave the others waiting in the ring for
ever, so (unless the caller gives ``seq_len``) every rank shares a small descriptor of its
arguments with one ``all_gather``, and every rank raises the same error when one rank's
arguments are wrong or the ranks disagree."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from .. import errors
from ..checks import check_bool, check_out_dtype, check_scale, check_window
from ..scalars import is_integer
from ..errors import ArgumentTypeError, InvalidArgumentError, MlxError
from ..layouts import check_qkv, operand
from .chunks import LAYOUTS, check_layout, local_rows

__all__ = ["GroupInfo", "LocalArgs", "group_info", "check_local", "agree"]


@dataclass(frozen=True)
class GroupInfo:
    """The process group as the ring sees it: this rank's place, every member's global rank
    (point-to-point calls take global ranks), the backend."""

    group: Any
    rank: int
    size: int
    global_ranks: tuple
    backend: str


@dataclass(frozen=True)
class LocalArgs:
    rows: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    causal: bool
    window: Optional[int]
    scale: Optional[float]
    layout: str
    seq_len: Optional[int]
    return_lse: bool
    out_dtype: torch.dtype


def group_info(group: Any) -> GroupInfo:
    """Where this process stands in ``group`` (None: the default group). Raised here, on this
    rank alone, when it cannot take part at all."""
    if not dist.is_available() or not dist.is_initialized():
        raise InvalidArgumentError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group(...) on every rank "
            "first (backend 'nccl' for CUDA tensors, 'gloo' for CPU tensors)"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise InvalidArgumentError(
            f"this process (global rank {dist.get_rank()}) is not a member of the group it passed: call "
            f"context_parallel_prefill only on the group's ranks, with the group they share"
        )
    size = dist.get_world_size(group)
    members = tuple(range(size)) if group is None else tuple(dist.get_global_rank(group, r) for r in range(size))
    return GroupInfo(group, rank, size, members, str(dist.get_backend(group)))


def check_local(q, k, v, *, causal, window, scale, layout, seq_len, return_lse, out_dtype, info: GroupInfo) -> LocalArgs:
    """Every check one rank can make on its own arguments."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise ArgumentTypeError(
                f"{name} must be a torch tensor (the ring passes K/V with torch.distributed), got {type(x).__name__}"
            )
    if not (q.device == k.device == v.device):
        raise InvalidArgumentError(f"q, k and v must be on one device, got {q.device}, {k.device} and {v.device}")
    if q.dim() != 3:
        raise InvalidArgumentError(
            f"q must be 3-D [rows_local, heads, head_dim] (one sequence: this rank's chunks of it), got shape "
            f"{tuple(q.shape)}"
        )
    check_qkv(operand(q, "q"), operand(k, "k"), operand(v, "v"))
    if k.shape[0] != q.shape[0]:
        raise InvalidArgumentError(
            f"q has {q.shape[0]} rows and k/v {k.shape[0]}: in a context-parallel prefill each rank holds the same "
            f"chunks of the sequence for queries and keys/values (the prompt is the whole cache)"
        )
    backend = info.backend.lower()
    if backend == "nccl" and q.device.type != "cuda":
        raise InvalidArgumentError(
            f"the group's backend is NCCL, which moves CUDA tensors only, and q is on {q.device}: pass CUDA tensors "
            "(this rank's GPU) or use a gloo group for CPU tensors"
        )
    if backend == "gloo" and q.device.type != "cpu":
        raise InvalidArgumentError(
            f"the group's backend is gloo, whose point-to-point calls move CPU tensors, and q is on {q.device}: "
            "use an NCCL group for CUDA tensors"
        )
    causal = check_bool(causal, "causal")
    window = check_window(window)
    scale = check_scale(scale)
    layout = check_layout(layout)
    if seq_len is not None:
        if not is_integer(seq_len):
            raise ArgumentTypeError(f"seq_len must be an integer or None, got {seq_len!r} ({type(seq_len).__name__})")
        if int(seq_len) < 0:
            raise InvalidArgumentError(f"seq_len must be at least 0, got {int(seq_len)}")
        seq_len = int(seq_len)
    return_lse = check_bool(return_lse, "return_lse")
    from ..arrays import _torch_dtype
    from ..dtypes import numpy_dtype_of_name

    out = _torch_dtype(numpy_dtype_of_name(check_out_dtype(out_dtype, operand(q, "q").dtype)))
    args = LocalArgs(
        int(q.shape[0]), int(q.shape[1]), int(k.shape[1]), int(q.shape[2]), causal or window is not None, window,
        scale, layout, seq_len, return_lse, out,
    )  # fmt: skip
    if seq_len is not None:
        _check_rows(args.layout, seq_len, info.size, [args.rows], only=info.rank)
    return args


# The descriptor's fields: what every rank must agree on, then what differs by rank.
_AGREED = ("n_heads", "n_kv_heads", "head_dim", "causal", "window", "layout", "scale")
_FIELDS = ("ok", "rows") + _AGREED


def _describe(args: Optional[LocalArgs]) -> List[int]:
    if args is None:
        return [0] + [-1] * (len(_FIELDS) - 1)
    scale = -1 if args.scale is None else struct.unpack("<q", struct.pack("<d", args.scale))[0]
    return [1, args.rows, args.n_heads, args.n_kv_heads, args.head_dim, int(args.causal), args.window or 0,
            LAYOUTS.index(args.layout), scale]  # fmt: skip


def _shown(field: str, value: int) -> str:
    if field == "scale":
        return "None" if value == -1 else repr(struct.unpack("<d", struct.pack("<q", value))[0])
    if field == "layout":
        return repr(LAYOUTS[value])
    if field == "window":
        return "None" if value == 0 else str(value)
    if field == "causal":
        return str(bool(value))
    return str(value)


def agree(args: Optional[LocalArgs], problem: Optional[MlxError], info: GroupInfo, device: torch.device) -> int:
    """The sequence length (the sum of every rank's rows), once every rank's rows are those
    the layout gives it; or the same error on every rank when one of them refused its
    arguments (``problem``, re-raised as it is on its own rank) or the ranks disagree. One ``all_gather`` of a few integers (on ``device``), and one of the
    messages when something is wrong."""
    mine = torch.tensor(_describe(args), dtype=torch.int64, device=device)
    table = [torch.empty_like(mine) for _ in range(info.size)]
    dist.all_gather(table, mine, group=info.group)
    rows = torch.stack(table).cpu().tolist()
    failed = [r for r, row in enumerate(rows) if row[0] == 0]
    if failed:
        notes: List[Any] = [None] * info.size
        dist.all_gather_object(notes, None if problem is None else (type(problem).__name__, str(problem)), group=info.group)
        if problem is not None:
            raise problem
        r = failed[0]
        kind, message = notes[r]
        cls = getattr(errors, kind, InvalidArgumentError)
        cls = cls if isinstance(cls, type) and issubclass(cls, MlxError) else InvalidArgumentError
        raise cls(f"rank {r} of the group refused its arguments, so no rank runs: {message}")
    for i, field in enumerate(_FIELDS[2:], start=2):
        values = [row[i] for row in rows]
        if len(set(values)) > 1:
            shown = ", ".join(f"rank {r}: {_shown(field, x)}" for r, x in enumerate(values))
            raise InvalidArgumentError(f"the ranks of the group must pass the same {field}, got {shown}")
    held = [row[1] for row in rows]
    seq_len = sum(held)
    _check_rows(args.layout, seq_len, info.size, held)
    return seq_len


def _check_rows(layout: str, seq_len: int, size: int, held: List[int], only: Optional[int] = None) -> None:
    """Each rank's rows against the layout's (``only``: the one rank whose rows ``held``
    lists)."""
    ranks = range(size) if only is None else [only]
    want = [local_rows(seq_len, size, r, layout) for r in ranks]
    if want != held:
        which = ", ".join(f"rank {r} holds {h} (wants {w})" for r, h, w in zip(ranks, held, want) if h != w)
        cut = "chunks i and 2P-1-i of 2P" if layout == "zigzag" else "chunk i of P"
        raise InvalidArgumentError(
            f"the {layout!r} layout of a sequence of {seq_len} rows over {size} ranks gives rank i {cut} (every chunk "
            f"seq_len // n rows, the first seq_len % n one more): {which}. Cut each rank's q, k, v with "
            f"mlx_native.distributed.shard_sequence(x, world_size, rank, layout)"
        )

