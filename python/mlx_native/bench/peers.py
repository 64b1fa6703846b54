"""The other implementations the benchmark compares with: the problem a peer gets, the
timed variants it returns, and a registry of peers keyed by device kind (``cpu``, ``cuda``,
``metal``: the ``Device.backend`` of the run).

A peer is optional: :func:`Peer.missing` says why it cannot run here (not installed, no
such device), and the benchmark prints that instead of failing. Each peer turns one problem
into one or more timed variants (for PyTorch: the same additive mask, and ``is_causal``
where it applies), each built on prebuilt tensors so that only the attention is timed.

The peers themselves live in one module per device kind (:mod:`.cpu_peers`,
:mod:`.cuda_peers`), each of which calls :func:`register_peer` for its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import numpy as np


@dataclass
class Problem:
    """One benchmark problem, as the user's arrays: ``q`` float32 ``[rows, n_heads, dim]``,
    ``k``/``v`` float16 ``[kv_len, n_kv_heads, dim]`` (all three float16 or bfloat16 when
    ``dtype`` says so), ``mask`` the additive float16 mask
    ``[rows, kv_len]`` every implementation gets. ``causal``: the mask is exactly the causal
    one (no window), so a peer's built-in causal mode computes the same thing; ``dense``:
    the mask is all zeros, so a peer's no-mask mode does."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    mask: np.ndarray
    scale: float = 1.0
    causal: bool = False
    dense: bool = False
    #: ``w`` when the mask is exactly a window-``w`` causal one (the prompt at the end of its
    #: cache), so a peer's built-in sliding window computes the same thing.
    window: Optional[int] = None
    #: CPU threads the peer should use (as many as the library's backend uses).
    threads: Optional[int] = None
    #: The data type of the run (``cases.DTYPES``): float32 (K/V given as float16, which the
    #: peer takes in float32), or float16 / bfloat16 (Q, K, V in it; the peer computes in it).
    dtype: str = "float32"
    #: A paged case's cache (``cases.PagedCache``: ``k``/``v`` in blocks, ``block_table``,
    #: ``seqused_k``), holding the rows of ``k``/``v``; a peer with ``paged_ok`` gathers its
    #: K/V from it inside its timed run (as a user of a paged cache pays). None: not paged.
    paged: Optional[Any] = None


#: What a variant computes with, as far as the summary of a run compares peers: the same
#: additive mask as ours, a built-in causal mode with no mask, a built-in sliding window,
#: or no mask (a zero-mask case).
MODES = ("mask", "causal", "window", "none")


@dataclass
class Variant:
    """A timed way of running an implementation: ``run()`` computes and waits; ``output()``
    returns the last result as float32 ``[rows, n_heads, dim]`` numpy (None: not checked,
    the output is another variant's)."""

    label: str
    run: Callable[[], None]
    output: Optional[Callable[[], np.ndarray]]
    #: Only worth running at the smallest size of a benchmark (slow references).
    smallest_only: bool = False
    #: Attention calls one ``run()`` makes (device peers batch short calls before they
    #: wait); the time of a run is divided by it.
    calls: int = 1
    #: Untimed work before each run (ours on a device records its prefills here, so that
    #: only the commit that runs them is timed).
    prepare: Optional[Callable[[], None]] = None
    #: One of ``MODES``, for a peer that competes (None: ours, or a reference).
    mode: Optional[str] = None
    #: K/V repeated to the query heads before the call (outside the timing); False: the
    #: peer takes grouped-query K/V as they are (PyTorch's ``enable_gqa``, MLX).
    kv_repeated: bool = True


class Refused(Exception):
    """Raised by a variant's ``run`` when the peer refuses the case (the message says why)."""


class Peer:
    """Base of a peer runner."""

    #: Short name, as in the table.
    name = "peer"
    #: How to install it, for the "missing" line.
    install_hint = ""
    #: It runs paged cases (``Problem.paged``): gathers the K/V from the blocks inside its
    #: timed run, or is a reference on the same rows. A peer without it is left out of them.
    paged_ok = False

    def missing(self) -> Optional[str]:
        """``None`` if the peer can run here, else why not."""
        return None

    def version(self) -> Optional[str]:
        """The peer's version, for the report (None: not known); called only when
        :meth:`missing` says it can run."""
        return None

    def variants(self, problem: Problem) -> List[Variant]:
        raise NotImplementedError


_REGISTRY: Dict[str, List[Peer]] = {}


def register_peer(kind: str, peer: Peer) -> None:
    """Add ``peer`` to those compared on devices of kind ``kind``."""
    _REGISTRY.setdefault(kind, []).append(peer)


def peers_for(kind: str) -> List[Peer]:
    """The peers registered for device kind ``kind``."""
    return list(_REGISTRY.get(kind, []))


def group(problem: Problem) -> int:
    """Query heads per KV head."""
    return problem.q.shape[1] // problem.k.shape[1]
