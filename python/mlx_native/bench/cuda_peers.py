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
            # is_causal aligns the prompt to the cache's start: the same mask only without
            # a longer cache.
            if problem.causal and problem.q.shape[0] == problem.k.shape[0]:
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


def _timed_variant(label: str, call, output, torch) -> Variant:
    """A variant around `call()` (which returns the output tensor): refused with the
    exception's first line if the first call fails, else repeated to about TARGET_S."""
    state = {}
    try:
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        state["out"] = call()  # compile / warm up
        a.record()
        state["out"] = call()
        b.record()
        b.synchronize()
        calls = int(np.clip(round(TARGET_S / max(a.elapsed_time(b) / 1e3, 1e-6)), 1, 50))
    except Exception as e:  # refused (a head dim, shared memory), or out of memory
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        torch.cuda.empty_cache()

        def refused():
            raise Refused(reason)

        return Variant(label, refused, lambda: None)

    def run():
        for _ in range(calls):
            state["out"] = call()
        torch.cuda.synchronize()

    return Variant(label, run, lambda: output(state["out"]), calls=calls)


def _bshd(x: Any, torch):
    """fp16 CUDA ``[1, rows, heads, dim]`` from the kernel's ``[rows, heads, dim]``."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cuda", torch.float16)[None].contiguous()
    return torch.from_numpy(np.ascontiguousarray(x)).to("cuda").to(torch.float16)[None].contiguous()


class FlashAttention4(Peer):
    """FlashAttention-4 (``flash_attn.cute.flash_attn_func``, the CuTe-DSL kernels) on fp16
    ``[1, rows, heads, dim]`` Q/K/V with grouped-query K/V as they are, with its built-in
    causal mask and sliding window (``window_size=(w - 1, 0)``: both align the prompt to the
    end of its cache, as ours do) or no mask. It takes no additive mask, so it runs only on
    cases one of those describes. Head dims up to 256 on Hopper."""

    name = "fa4"
    install_hint = "pip install flash-attn-4 (on a machine without network: its wheels, downloaded elsewhere)"

    def missing(self) -> Optional[str]:
        try:
            import torch
            from flash_attn.cute import flash_attn_func  # noqa: F401

            if not torch.cuda.is_available():
                return "PyTorch sees no CUDA device"
        except Exception as e:
            return f"not importable ({type(e).__name__}: {e}); {self.install_hint}"
        return None

    def version(self) -> Optional[str]:
        try:
            from importlib.metadata import version

            return version("flash-attn-4")
        except Exception:
            return None

    def variants(self, problem: Problem) -> List[Variant]:
        from flash_attn.cute import flash_attn_func

        torch = _torch()
        if problem.window is not None:
            label, mode, kw = "fa4, sliding window", "window", dict(causal=True, window_size=(problem.window - 1, 0))
        elif problem.causal:
            label, mode, kw = "fa4, causal", "causal", dict(causal=True)
        elif problem.dense:
            label, mode, kw = "fa4, no mask", "none", {}
        else:
            return []
        q, k, v = (_bshd(x, torch) for x in (problem.q, problem.k, problem.v))

        def call():
            o = flash_attn_func(q, k, v, softmax_scale=problem.scale, **kw)
            return o[0] if isinstance(o, tuple) else o

        vt = _timed_variant(label, call, lambda o: o[0].float().cpu().numpy(), torch)
        vt.mode, vt.kv_repeated = mode, False
        return [vt]


class FlexAttention(Peer):
    """PyTorch's FlexAttention (``torch.nn.attention.flex_attention``, compiled) with a block
    mask made from the case's description (causal, window, none; the prompt at the end of
    its cache) and ``enable_gqa`` on the unrepeated K/V. At head dim 512 its default tiles do
    not fit in shared memory: it runs with 32 x 32 tiles there."""

    name = "flex"
    install_hint = "pip install torch (2.5 or later, a CUDA build)"

    def missing(self) -> Optional[str]:
        try:
            import torch
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401

            if not torch.cuda.is_available():
                return "PyTorch sees no CUDA device"
        except Exception as e:
            return f"not importable ({type(e).__name__}: {e}); {self.install_hint}"
        return None

    def variants(self, problem: Problem) -> List[Variant]:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        torch = _torch()
        rows, kv_len = problem.q.shape[0], problem.k.shape[0]
        off, w = kv_len - rows, problem.window
        if w is not None:
            label, mode = "flex, sliding window", "window"

            def mask_mod(b, h, qi, kj):
                return (kj <= qi + off) & (kj > qi + off - w)
        elif problem.causal:
            label, mode = "flex, causal", "causal"

            def mask_mod(b, h, qi, kj):
                return kj <= qi + off
        elif problem.dense:
            label, mode, mask_mod = "flex, no mask", "none", None
        else:
            return []
        q, k, v = (_bshd(x, torch).transpose(1, 2) for x in (problem.q, problem.k, problem.v))
        block = None if mask_mod is None else create_block_mask(mask_mod, None, None, rows, kv_len, device="cuda")
        opts = {"BLOCK_M": 32, "BLOCK_N": 32} if problem.q.shape[2] > 256 else None
        compiled = torch.compile(flex_attention, dynamic=False)
        gqa = problem.q.shape[1] != problem.k.shape[1]

        def call():
            return compiled(q, k, v, block_mask=block, scale=problem.scale, enable_gqa=gqa, kernel_options=opts)

        vt = _timed_variant(label, call, lambda o: o[0].transpose(0, 1).float().cpu().numpy(), torch)
        vt.mode, vt.kv_repeated = mode, False
        return [vt]


register_peer("cuda", TorchCudaSdpa())
register_peer("cuda", FlashAttention4())
register_peer("cuda", FlexAttention())
