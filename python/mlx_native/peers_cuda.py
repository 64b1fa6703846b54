"""Peers of ``bench`` on CUDA devices: PyTorch's ``scaled_dot_product_attention`` on the
GPU, once per SDPA backend (math, efficient, cuDNN, flash) with the same additive mask,
with ``enable_gqa=True`` on the unrepeated K/V for grouped-query cases, and with
``is_causal=True`` where the mask is plain causal. A backend that refuses a case is listed
with PyTorch's reason. Imported by :func:`mlx_native.peers.peers_for` for ``cuda``."""

from __future__ import annotations

import warnings
from typing import List, Optional

import numpy as np

from .bench_cuda_peers import BACKENDS, _reason, to_torch_inputs
from .peers import Peer, Problem, Refused, Variant, register_peer

#: Each timed run repeats the call until about this long, then synchronises once.
TARGET_S = 0.02


class TorchCudaSdpa(Peer):
    name = "torch"
    install_hint = "pip install torch (a CUDA build)"

    def missing(self) -> Optional[str]:
        try:
            import torch

            if not torch.cuda.is_available():
                return "PyTorch sees no CUDA device"
        except Exception as e:
            return f"not importable ({type(e).__name__}: {e}); {self.install_hint}"
        return None

    def variants(self, problem: Problem) -> List[Variant]:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        forms = [("", True)]
        if problem.q.shape[1] != problem.k.shape[1]:
            forms.append((", enable_gqa", False))
        out: List[Variant] = []
        for suffix, expand in forms:
            q, k, v, m = to_torch_inputs(problem.q, problem.k, problem.v, problem.mask, expand_kv=expand)
            extra = {} if expand else {"enable_gqa": True}
            modes = [("same mask", dict(attn_mask=m))]
            if problem.causal:
                modes.append(("is_causal", dict(is_causal=True)))
            for backend in BACKENDS:
                member = getattr(SDPBackend, BACKENDS[backend])
                for mode, kw in modes:
                    label = f"torch {backend}, {mode}{suffix}"
                    out.append(_variant(label, torch, sdpa_kernel, member, sdpa, q, k, v, dict(kw, scale=problem.scale, **extra)))
        return out


def _variant(label, torch, sdpa_kernel, member, sdpa, q, k, v, kw) -> Variant:
    state = {}

    def call():
        with sdpa_kernel([member]):
            return sdpa(q, k, v, **kw)

    # One call decides: refused (with PyTorch's reason), or how many calls a timed run makes.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            state["out"] = call()
            b.record()
            b.synchronize()
            calls = int(np.clip(round(TARGET_S / max(a.elapsed_time(b) / 1e3, 1e-6)), 1, 50))
        except RuntimeError as e:
            reason = _reason([str(w.message) for w in caught], str(e))
            torch.cuda.empty_cache()

            def refused():
                raise Refused(reason)

            return Variant(label, refused, lambda: None)

    def run():
        for _ in range(calls):
            state["out"] = call()
        torch.cuda.synchronize()

    def output():
        return state["out"][0].permute(1, 0, 2).float().cpu().numpy()

    return Variant(label, run, output, calls=calls)


register_peer("cuda", TorchCudaSdpa())
