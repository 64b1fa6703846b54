"""The CUDA peers of the benchmark: PyTorch's ``scaled_dot_product_attention`` on the GPU,
once per SDPA backend (math, efficient, cuDNN, flash), with the same additive mask and,
where the mask is plain causal, with ``is_causal=True`` and no mask; grouped-query cases
run twice, with K/V repeated to the query heads (PyTorch's fastest form) and with
``enable_gqa=True`` on the unrepeated K/V (PyTorch's own GQA form). A backend that refuses
a case is listed with PyTorch's reason.

Every variant gets fp16 Q/K/V in PyTorch's ``[batch, heads, rows, head_dim]`` layout,
prebuilt on the GPU (the conversion and the repetition cost the peer nothing), the
problem's scale, and the mask as an fp16 ``[1, 1, rows, kv_len]`` tensor. A timed run
repeats the call until about ``TARGET_S`` and synchronises once. PyTorch is imported only
when a variant is built.
"""

from __future__ import annotations

import warnings
from typing import Any, List, Optional

import numpy as np

from .peers import Peer, Problem, Refused, Variant, register_peer

#: SDPA backends, by the names used in labels, and PyTorch's ``SDPBackend`` member names.
BACKENDS = {
    "math": "MATH",
    "efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "flash": "FLASH_ATTENTION",
}
#: Each timed run repeats the call until about this long, then synchronises once.
TARGET_S = 0.02


def _torch():
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("PyTorch sees no CUDA device")
    return torch


def to_torch_inputs(q: Any, k: Any, v: Any, mask: Any = None, *, expand_kv: bool = True):
    """fp16 CUDA tensors for SDPA from the kernel's layouts: q ``[rows, heads, dim]``,
    k/v ``[kv_len, kv_heads, dim]`` (numpy or torch), mask ``[rows, kv_len]`` or None.
    Returns ``(q, k, v, mask)`` as ``[1, heads, rows|kv_len, dim]`` and ``[1, 1, rows,
    kv_len]``; with ``expand_kv`` the KV heads are repeated to the query heads, else K/V
    keep their own heads (for ``enable_gqa=True``)."""
    torch = _torch()

    def t(x):
        if isinstance(x, torch.Tensor):
            return x.detach().to("cuda", torch.float16)
        return torch.from_numpy(np.ascontiguousarray(x)).to("cuda").to(torch.float16)

    tq, tk, tv = t(q), t(k), t(v)
    n_heads, n_kv = tq.shape[1], tk.shape[1]
    if n_heads % n_kv:
        raise ValueError(f"n_heads {n_heads} is not a multiple of n_kv_heads {n_kv}")
    group = n_heads // n_kv if expand_kv else 1
    tq = tq.permute(1, 0, 2).unsqueeze(0).contiguous()
    tk = tk.permute(1, 0, 2).repeat_interleave(group, dim=0).unsqueeze(0).contiguous()
    tv = tv.permute(1, 0, 2).repeat_interleave(group, dim=0).unsqueeze(0).contiguous()
    tm = None if mask is None else t(mask)[None, None].contiguous()
    return tq, tk, tv, tm


def refusal_reason(warnings_text, error: str) -> str:
    """PyTorch's specific reasons for refusing a backend (from the warnings it raised), without
    its boilerplate lines; the error's first line when it gave none."""
    lines = []
    for text in warnings_text:
        for line in text.splitlines():
            line = line.split("(Triggered internally")[0].strip()
            if line and not line.endswith("because:"):
                lines.append(line)
    return "; ".join(dict.fromkeys(lines)) or error.splitlines()[0]


class TorchCudaSdpa(Peer):
    """``torch.nn.functional.scaled_dot_product_attention`` on the GPU, one variant per
    backend, mode (same mask; ``is_causal``) and K/V form (repeated; ``enable_gqa``)."""

    name = "torch"
    install_hint = "pip install torch (a CUDA build)"

    def missing(self) -> Optional[str]:
        try:
            import torch

            if not torch.cuda.is_available():
                return "PyTorch sees no CUDA device"
        except Exception as e:  # an ImportError, or a broken install's OSError
            return f"not importable ({type(e).__name__}: {e}); {self.install_hint}"
        return None

    def version(self) -> Optional[str]:
        import torch

        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        return f"{torch.__version__}, cuDNN {cudnn}" if cudnn else torch.__version__

    def variants(self, problem: Problem) -> List[Variant]:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        torch = _torch()
        forms = [("", True)]
        if problem.q.shape[1] != problem.k.shape[1]:
            forms.append((", enable_gqa", False))
        out: List[Variant] = []
        for suffix, expand in forms:
            q, k, v, m = to_torch_inputs(problem.q, problem.k, problem.v, problem.mask, expand_kv=expand)
            extra = {} if expand else {"enable_gqa": True}
            modes = [("same mask", "mask", dict(attn_mask=m))]
            if problem.causal:
                modes.append(("is_causal", "causal", dict(is_causal=True)))
            for backend, member_name in BACKENDS.items():
                member = getattr(SDPBackend, member_name)
                for words, mode, kw in modes:
                    vt = _variant(f"torch {backend}, {words}{suffix}", torch, sdpa_kernel, member, sdpa, q, k, v, dict(kw, scale=problem.scale, **extra))
                    vt.mode, vt.kv_repeated = mode, expand
                    out.append(vt)
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
        except RuntimeError as e:  # refused, or out of memory at this size
            reason = refusal_reason([str(w.message) for w in caught], str(e))
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
