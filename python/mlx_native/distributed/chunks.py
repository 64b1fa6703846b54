"""How a sequence is cut between the ranks of a context-parallel group (no torch here).

The sequence of ``seq_len`` rows is cut into ``n`` chunks, ``n = 2P`` for ``"zigzag"`` and
``n = P`` for ``"contiguous"`` (P ranks): chunk ``c`` holds rows ``[start(c), start(c+1))``
with ``start(c) = c * (seq_len // n) + min(c, seq_len % n)``, i.e. every chunk has
``seq_len // n`` rows and the first ``seq_len % n`` chunks one more. Under ``"zigzag"`` rank
``i`` holds chunks ``i`` and ``2P - 1 - i``, one after the other (so under a causal mask
every rank has the same work, within a row or two); under ``"contiguous"`` rank ``i`` holds
chunk ``i``. Queries and keys/values are cut alike (a prefill: the prompt is the cache)."""

from __future__ import annotations

import numbers
from typing import Any, List, Tuple

import numpy as np

from ..errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["LAYOUTS", "check_layout", "chunk_bounds", "rank_chunks", "local_rows", "local_positions", "shard_sequence"]

#: The sequence layouts :func:`~mlx_native.distributed.context_parallel_prefill` takes.
LAYOUTS = ("zigzag", "contiguous")

Range = Tuple[int, int]


def check_layout(layout: Any) -> str:
    if not isinstance(layout, str):
        raise ArgumentTypeError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r} ({type(layout).__name__})")
    if layout not in LAYOUTS:
        raise InvalidArgumentError(
            f"layout {layout!r} is not a sequence layout: pass 'zigzag' (rank i holds chunks i and 2P-1-i of 2P, "
            f"balanced under a causal mask) or 'contiguous' (rank i holds chunk i of P)"
        )
    return layout


def _count(x: Any, name: str, least: int) -> int:
    if isinstance(x, bool) or not isinstance(x, (numbers.Integral, np.integer)):
        raise ArgumentTypeError(f"{name} must be an integer, got {x!r} ({type(x).__name__})")
    if int(x) < least:
        raise InvalidArgumentError(f"{name} must be at least {least}, got {int(x)}")
    return int(x)


def chunk_bounds(seq_len: int, n_chunks: int) -> List[Range]:
    """The ``[start, stop)`` rows of each of ``n_chunks`` chunks of a sequence: ``seq_len //
    n_chunks`` rows each, the first ``seq_len % n_chunks`` one more."""
    seq_len, n_chunks = _count(seq_len, "seq_len", 0), _count(n_chunks, "n_chunks", 1)
    base, extra = divmod(seq_len, n_chunks)
    starts = [c * base + min(c, extra) for c in range(n_chunks + 1)]
    return list(zip(starts[:-1], starts[1:]))


def rank_chunks(seq_len: int, world_size: int, layout: str = "zigzag") -> List[List[Range]]:
    """For each rank, the ``[start, stop)`` sequence rows of the chunks it holds, in the order
    its local rows hold them."""
    world_size = _count(world_size, "world_size", 1)
    layout = check_layout(layout)
    if layout == "contiguous":
        return [[c] for c in chunk_bounds(seq_len, world_size)]
    bounds = chunk_bounds(seq_len, 2 * world_size)
    return [[bounds[i], bounds[2 * world_size - 1 - i]] for i in range(world_size)]


def local_rows(seq_len: int, world_size: int, rank: int, layout: str = "zigzag") -> int:
    """The number of rows rank ``rank`` holds."""
    chunks = rank_chunks(seq_len, world_size, layout)
    if not 0 <= rank < world_size:
        raise InvalidArgumentError(f"rank {rank} is not in a group of {world_size} ranks")
    return sum(b - a for a, b in chunks[rank])


def local_positions(seq_len: int, world_size: int, rank: int, layout: str = "zigzag") -> np.ndarray:
    """int64 ``[local_rows]``: the sequence position of each of rank ``rank``'s rows (for
    rotary embeddings, say)."""
    local_rows(seq_len, world_size, rank, layout)  # checks rank
    chunks = rank_chunks(seq_len, world_size, layout)[rank]
    return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in chunks])


def shard_sequence(x: Any, world_size: int, rank: int, layout: str = "zigzag") -> Any:
    """Rank ``rank``'s rows of a whole sequence ``x`` (its first axis; numpy or torch): the
    local q, k or v that :func:`~mlx_native.distributed.context_parallel_prefill` takes.
    A new array (a view for the contiguous layout)."""
    seq_len = int(x.shape[0])
    local_rows(seq_len, world_size, rank, layout)  # checks rank
    parts = [x[a:b] for a, b in rank_chunks(seq_len, world_size, layout)[rank]]
    if len(parts) == 1:
        return parts[0]
    if isinstance(x, np.ndarray):
        return np.concatenate(parts)
    import torch

    return torch.cat(parts)
