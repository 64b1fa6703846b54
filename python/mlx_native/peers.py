"""The other implementations ``bench`` compares with, as a registry of peer runners keyed by
device kind (``cpu``, ``cuda``, ``metal``: the ``Device.backend`` of the run).

A peer is optional: :func:`Peer.missing` says why it cannot run here (not installed, no
such device), and the benchmark prints that instead of failing. Each peer turns one problem
into one or more timed variants (for PyTorch: the same additive mask, and ``is_causal``
where it applies), each built on prebuilt tensors so that only the attention is timed.

Peers of another device kind live in a module of their own, ``mlx_native.peers_<kind>``
(e.g. ``peers_cuda`` for PyTorch's CUDA attention backends), which calls
:func:`register_peer` when :func:`peers_for` imports it; nothing here needs to change.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import numpy as np

from .reference import reference_attention


@dataclass
class Problem:
    """One benchmark problem, as the user's arrays: ``q`` float32 ``[rows, n_heads, dim]``,
    ``k``/``v`` float16 ``[kv_len, n_kv_heads, dim]``, ``mask`` the additive float16 mask
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
    #: CPU threads the peer should use (as many as the library's backend uses).
    threads: Optional[int] = None


@dataclass
class Variant:
    """A timed way of running a peer: ``run()`` computes and waits; ``output()`` returns the
    last result as float32 ``[rows, n_heads, dim]`` numpy."""

    label: str
    run: Callable[[], None]
    output: Callable[[], np.ndarray]
    #: Only worth running at the smallest size of a benchmark (slow references).
    smallest_only: bool = False
    #: Attention calls one ``run()`` makes (device peers batch short calls before they
    #: wait); the time of a run is divided by it.
    calls: int = 1


class Refused(Exception):
    """Raised by a variant's ``run`` when the peer refuses the case (the message says why)."""


class Peer:
    """Base of a peer runner."""

    #: Short name, as in the table.
    name = "peer"
    #: How to install it, for the "missing" line.
    install_hint = ""

    def missing(self) -> Optional[str]:
        """``None`` if the peer can run here, else why not."""
        return None

    def variants(self, problem: Problem) -> List[Variant]:
        raise NotImplementedError


_REGISTRY: Dict[str, List[Peer]] = {}


def register_peer(kind: str, peer: Peer) -> None:
    """Add ``peer`` to those compared on devices of kind ``kind``."""
    _REGISTRY.setdefault(kind, []).append(peer)


def peers_for(kind: str) -> List[Peer]:
    """The peers registered for device kind ``kind`` (importing ``mlx_native.peers_<kind>``
    first when such a module exists)."""
    if kind not in _LOADED:
        _LOADED.add(kind)
        try:
            importlib.import_module(f"{__package__}.peers_{kind}")
        except ModuleNotFoundError as e:
            if e.name != f"{__package__}.peers_{kind}":
                raise
    return list(_REGISTRY.get(kind, []))


_LOADED = {"cpu"}


def _group(problem: Problem) -> int:
    return problem.q.shape[1] // problem.k.shape[1]


# ---------------------------------------------------------------- PyTorch on the CPU


class TorchCpuSdpa(Peer):
    """``torch.nn.functional.scaled_dot_product_attention`` on CPU float32 tensors
    ``[1, heads, rows, dim]``; the KV heads are repeated to the query heads beforehand
    (outside the timing), which measured at least as fast as ``enable_gqa``."""

    name = "torch"
    install_hint = "pip install torch"

    def missing(self) -> Optional[str]:
        try:
            import torch  # noqa: F401
            import torch.nn.functional as F

            if not hasattr(F, "scaled_dot_product_attention"):
                return f"torch {torch.__version__} has no scaled_dot_product_attention"
        except Exception as e:  # an ImportError, or a broken install's OSError
            return f"not importable ({type(e).__name__}: {e}); {self.install_hint}"
        return None

    def variants(self, problem: Problem) -> List[Variant]:
        import torch
        import torch.nn.functional as F

        if problem.threads:
            torch.set_num_threads(problem.threads)
        g = _group(problem)
        q = torch.from_numpy(np.ascontiguousarray(problem.q.transpose(1, 0, 2)))[None]
        k = torch.from_numpy(problem.k.astype(np.float32).transpose(1, 0, 2))
        v = torch.from_numpy(problem.v.astype(np.float32).transpose(1, 0, 2))
        k = k.repeat_interleave(g, dim=0).contiguous()[None]
        v = v.repeat_interleave(g, dim=0).contiguous()[None]
        mask = torch.from_numpy(problem.mask.astype(np.float32))
        state = {}

        def make(label, **kw):
            def run():
                with torch.inference_mode():
                    state[label] = F.scaled_dot_product_attention(q, k, v, scale=problem.scale, **kw)

            def output():
                return state[label][0].permute(1, 0, 2).numpy()

            return Variant(label, run, output)

        out = [make("torch sdpa, same mask", attn_mask=mask)]
        if problem.causal:
            out.append(make("torch sdpa, is_causal", is_causal=True))
        if problem.dense:
            out.append(make("torch sdpa, no mask"))
        return out


# ---------------------------------------------------------------- MLX on the CPU


class MlxFastSdpa(Peer):
    """MLX's ``mx.fast.scaled_dot_product_attention`` on float32 arrays ``[1, heads, rows,
    dim]`` (MLX handles GQA itself) on the CPU stream."""

    name = "mlx"
    install_hint = "pip install 'mlx[cpu]' (Linux) or mlx (macOS)"

    def __init__(self, stream: str = "cpu"):
        self.stream = stream

    def missing(self) -> Optional[str]:
        try:
            import mlx.core as mc

            q = mc.zeros((1, 1, 2, 4))
            mc.eval(mc.fast.scaled_dot_product_attention(q, q, q, scale=1.0, stream=getattr(mc, self.stream)))
        except Exception as e:
            return f"cannot run ({type(e).__name__}: {e}); {self.install_hint}"
        return None

    def variants(self, problem: Problem) -> List[Variant]:
        import mlx.core as mc

        dev = getattr(mc, self.stream)
        q = mc.array(np.ascontiguousarray(problem.q.transpose(1, 0, 2))[None])
        k = mc.array(problem.k.astype(np.float32).transpose(1, 0, 2)[None])
        v = mc.array(problem.v.astype(np.float32).transpose(1, 0, 2)[None])
        mask = mc.array(problem.mask.astype(np.float32))
        mc.eval(q, k, v, mask)
        state = {}

        def make(label, m):
            def run():
                o = mc.fast.scaled_dot_product_attention(q, k, v, scale=problem.scale, mask=m, stream=dev)
                mc.eval(o)
                state[label] = o

            def output():
                return np.array(state[label])[0].transpose(1, 0, 2)

            return Variant(label, run, output)

        out = [make("mlx fast sdpa, same mask", mask)]
        if problem.causal:
            out.append(make("mlx fast sdpa, causal", "causal"))
        return out


# ---------------------------------------------------------------- the float64 reference


class NumpyReference(Peer):
    """``mlx_native.reference.reference_attention``: exact float64 numpy, every head (run
    at the smallest size only)."""

    name = "reference"

    def variants(self, problem: Problem) -> List[Variant]:
        state = {}

        def run():
            state["o"] = reference_attention(problem.q, problem.k, problem.v, problem.mask, scale=problem.scale)

        return [Variant("numpy float64 reference", run, lambda: state["o"].astype(np.float32), smallest_only=True)]


register_peer("cpu", TorchCpuSdpa())
register_peer("cpu", MlxFastSdpa("cpu"))
register_peer("cpu", NumpyReference())
