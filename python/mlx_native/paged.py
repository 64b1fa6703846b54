"""Paged K/V (SPEC 11) for :class:`~mlx_native.PrefillPlan`: ``k`` and ``v`` are caches
``[num_blocks, block_size, kv_heads, head_dim]`` read through ``block_table`` (int32
``[batch, max_blocks]``) and ``seqused_k`` (int32 ``[batch]``, each sequence's cache length).

Here: what the plan needs to know on the Python side (the arguments' kinds, ranks and dtypes,
each refused by name, and the table and lengths as host arrays, which belong to the plan as
``cu_seqlens`` do). The values themselves (a table entry outside the caches, a length
beyond its table row or below 0, a causal cache shorter than its prompt, the block size)
are checked once, by the library's op (``rust/src/ops/flash_attn_prefill_paged.rs``), which
raises before anything runs."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import numpy as np

from .arrays import Operand
from .errors import InvalidArgumentError, UnsupportedDtypeError

__all__ = ["PagedKv", "cache_views", "check_paged", "refuse_unpaged_arguments", "table_key"]

_LAYOUT = "[num_blocks, block_size, kv_heads, head_dim]"


class PagedKv(NamedTuple):
    """The paged caches of a plan: the table and the lengths on the host, and the caches'
    sizes."""

    block_table: np.ndarray  # int32 [batch, max_blocks], C-contiguous
    seqused_k: np.ndarray  # int32 [batch]
    num_blocks: int
    block_size: int

    def cu_seqlens_k(self) -> np.ndarray:
        """The lengths as offsets (``[0, Lk_0, Lk_0 + Lk_1, ...]``), for what counts pairs."""
        return np.concatenate([[0], np.cumsum(self.seqused_k, dtype=np.int64)])


def refuse_unpaged_arguments(block_table: Any, cu_seqlens_k: Any) -> None:
    """What cannot go with paged K/V, refused by name before anything is planned: no table
    (``seqused_k`` alone) and ``cu_seqlens_k`` (the lengths are ``seqused_k``'s). Every backend
    reads paged K/V (the CPU, CUDA and Metal). The plan and the torch operators' fake kernel
    (which has q's device but no data) call it."""
    if block_table is None:
        raise InvalidArgumentError("seqused_k goes with block_table (paged K/V): pass both, or neither")
    if cu_seqlens_k is not None:
        raise InvalidArgumentError(
            "cu_seqlens_k goes with contiguous k/v; with block_table each sequence's cache length is seqused_k "
            "(pass cu_seqlens_q alone for variable-length queries)"
        )


def _int32(x: Any, name: str, ndim: int, shape: str) -> np.ndarray:
    if x is None:
        raise InvalidArgumentError(f"{name} is needed with block_table: int32 {shape}")
    op = Operand.of(x, name)
    if op.dtype != np.int32:
        raise UnsupportedDtypeError(f"{name} must be int32 {shape}, got {op.dtype.name}: convert it (x.to(torch.int32))")
    if op.ndim != ndim:
        raise InvalidArgumentError(f"{name} must be {ndim}-D {shape}, got shape {op.shape}")
    return np.ascontiguousarray(np.asarray(op.to_host()), dtype=np.int32)


def check_paged(block_table: Any, seqused_k: Any, ko: Operand, vo: Operand, batch: int) -> PagedKv:
    """The paged K/V of a plan with ``batch`` sequences (after :func:`cache_views`'
    checks): ``k``/``v`` caches of one shape but the head dim, the table ``[batch,
    max_blocks]`` and the lengths ``[batch]``, int32, as host arrays."""
    if vo.shape[:-1] != ko.shape[:-1]:
        raise InvalidArgumentError(f"v_cache has shape {vo.shape}, k_cache {ko.shape}: they must match but for the head dim")
    table = _int32(block_table, "block_table", 2, "[batch, max_blocks]")
    used = _int32(seqused_k, "seqused_k", 1, "[batch]")
    if table.shape[0] != batch or used.shape[0] != batch:
        raise InvalidArgumentError(
            f"block_table has {table.shape[0]} rows and seqused_k {used.shape[0]} entries for {batch} sequences "
            f"(q's batch, or len(cu_seqlens_q) - 1): give one of each per sequence"
        )
    return PagedKv(table, used, int(ko.shape[0]), int(ko.shape[1]))


def cache_views(qo: Operand, ko: Operand, vo: Operand) -> tuple:
    """``k`` and ``v`` as operands of the contiguous layout's ranks, for the checks of q, k
    and v against each other (dtypes, heads, head dims): a block's rows for 3-D q, and a
    block per sequence for 4-D q. Only their shapes and dtypes are read."""

    for name, op in (("k", ko), ("v", vo)):
        if op.ndim != 4:
            raise InvalidArgumentError(f"with block_table, {name} is the paged cache {_LAYOUT}, got shape {op.shape}")

    def view(op: Operand) -> Operand:
        if qo.ndim == 3:
            return dataclasses.replace(op, shape=op.shape[1:], strides=op.strides[1:])
        return dataclasses.replace(op, shape=(qo.shape[0],) + op.shape[1:])

    return view(ko), view(vo)


def table_key(block_table: Any, seqused_k: Any) -> Optional[tuple]:
    """The values of the table and the lengths for the plan cache's key (they belong to the
    plan), or None where they are not arrays of int32."""
    try:
        t, u = Operand.of(block_table, "block_table"), Operand.of(seqused_k, "seqused_k")
    except Exception:
        return None
    if t.dtype != np.int32 or u.dtype != np.int32:
        return None
    th, uh = np.asarray(t.to_host()), np.asarray(u.to_host())
    return (th.shape, th.tobytes(), uh.shape, uh.tobytes())
