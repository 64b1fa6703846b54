"""GPU peers of the benchmark: PyTorch's scaled_dot_product_attention on CUDA, once per
SDPA backend that accepts the case (math, efficient, cuDNN, flash), with the same
additive mask, and with ``is_causal=True`` where the mask is plain causal.

Every peer gets fp16 Q/K/V in PyTorch's ``[batch, heads, rows, head_dim]`` layout, with
the KV heads repeated to the query heads (grouped-query attention expanded before timing,
so the expansion costs the peer nothing), ``scale=1.0`` as the kernel uses, and the mask
as an fp16 ``[1, 1, rows, kv_len]`` tensor. Times are CUDA events around each call: the
median of ``repeat`` calls after ``warmup`` calls. A backend that refuses the case is
reported with PyTorch's reason instead of a time.

    from mlx_native.bench_cuda_peers import sdpa_peers
    results = sdpa_peers(q, k, v, mask, causal=True)   # {"sdpa-cudnn+mask": {"ms": ...}, ...}
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, Optional

import numpy as np

#: SDPA backends, by the names used in results, and PyTorch's enum member names.
BACKENDS = {
    "math": "MATH",
    "efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "flash": "FLASH_ATTENTION",
}


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


def time_cuda(fn, *, warmup: int = 2, repeat: int = 10) -> float:
    """Median milliseconds of ``fn()`` over ``repeat`` calls, each between two CUDA events
    on the current stream, after ``warmup`` calls."""
    torch = _torch()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times))


def _one(backend: str, q, k, v, mask, is_causal: bool, warmup: int, repeat: int, gqa: bool = False) -> Dict[str, Any]:
    torch = _torch()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    member = getattr(SDPBackend, BACKENDS[backend])

    extra = {"enable_gqa": True} if gqa else {}

    def call():
        return sdpa(q, k, v, attn_mask=mask, is_causal=is_causal, scale=1.0, **extra)

    with sdpa_kernel([member]):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                out = call()
                torch.cuda.synchronize()
            except RuntimeError as e:
                return {"refused": _reason([str(w.message) for w in caught], str(e))}
        del out
        try:
            ms = time_cuda(call, warmup=warmup, repeat=repeat)
        except RuntimeError as e:  # out of memory at this size, for instance
            return {"refused": str(e).splitlines()[0]}
    torch.cuda.empty_cache()
    return {"ms": ms}


def _reason(warnings_text, error: str) -> str:
    """PyTorch's specific reasons for refusing a backend, without its boilerplate lines."""
    lines = []
    for text in warnings_text:
        for line in text.splitlines():
            line = line.split("(Triggered internally")[0].strip()
            if line and not line.endswith("because:"):
                lines.append(line)
    return "; ".join(dict.fromkeys(lines)) or error.splitlines()[0]


def sdpa_peers(
    q: Any,
    k: Any,
    v: Any,
    mask: Any = None,
    *,
    causal: bool = False,
    backends=tuple(BACKENDS),
    warmup: int = 2,
    repeat: int = 10,
) -> Dict[str, Dict[str, Any]]:
    """Time SDPA on one case with every backend in ``backends``: with ``mask`` (``"<name>+mask"``)
    and, when ``causal`` says the mask is exactly causal (rows == kv_len), with
    ``is_causal=True`` and no mask (``"<name>+is_causal"``). K/V heads are repeated to
    the query heads; for grouped-query cases each is also timed as PyTorch runs it
    natively, ``enable_gqa=True`` on the unrepeated K/V (``"...+gqa"``). Values are
    ``{"ms": t}`` or ``{"refused": reason}``."""
    variants = [("", True)]
    if _shape(q)[1] != _shape(k)[1]:
        variants.append(("+gqa", False))
    out: Dict[str, Dict[str, Any]] = {}
    for suffix, expand in variants:
        tq, tk, tv, tm = to_torch_inputs(q, k, v, mask, expand_kv=expand)
        gqa = not expand
        for b in backends:
            out[f"sdpa-{b}+mask{suffix}"] = _one(b, tq, tk, tv, tm, False, warmup, repeat, gqa)
        if causal and tq.shape[2] == tk.shape[2]:
            for b in backends:
                out[f"sdpa-{b}+is_causal{suffix}"] = _one(b, tq, tk, tv, None, True, warmup, repeat, gqa)
        del tq, tk, tv, tm
    return out


def _shape(x) -> tuple:
    return tuple(x.shape)


def best_with_mask(results: Dict[str, Dict[str, Any]]) -> Optional[tuple]:
    """``(name, ms)`` of the fastest peer that ran with the mask (either K/V form), or
    None."""
    timed = [(k, r["ms"]) for k, r in results.items() if "+mask" in k and "ms" in r]
    return min(timed, key=lambda x: x[1]) if timed else None
