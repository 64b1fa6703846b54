"""``flash_attn_prefill``: the one call. It keeps a :class:`~mlx_native.PrefillPlan` per
(layouts, description, device) and runs it, so that a call costs little more than a plan's
run: a key built from the arrays' layouts, one dictionary look-up, the run's one C call."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Optional, Union

from .arrays import layout_key
from .checks import (
    check_bool,
    check_device,
    check_max_bias,
    check_offset,
    check_scale,
    check_softcap,
    check_tensor_layout,
    check_window_sides,
)
from .device import Device
from .plan import PrefillPlan

__all__ = ["flash_attn_prefill", "clear_plan_cache", "PLAN_CACHE_SIZE"]

#: Plans the one call keeps (the least recently used goes first).
PLAN_CACHE_SIZE = 64

_cache: "OrderedDict[tuple, PrefillPlan]" = OrderedDict()
_cache_lock = threading.Lock()


def clear_plan_cache() -> None:
    """Drop the plans :func:`flash_attn_prefill` keeps (and the C ABI handles they hold)."""
    with _cache_lock:
        _cache.clear()


def flash_attn_prefill(
    q: Any,
    k: Any,
    v: Any,
    mask: Any = None,
    *,
    causal: bool = False,
    window: Any = None,
    offset: Optional[int] = None,
    scale: Optional[float] = None,
    cu_seqlens_q: Any = None,
    cu_seqlens_k: Any = None,
    return_lse: bool = False,
    out_dtype: Any = None,
    device: Union[None, str, Device] = None,
    check_finite: bool = False,
    softcap: float = 0.0,
    max_bias: float = 0.0,
    sinks: Any = None,
    layout: str = "NHD",
    alibi_slopes: Any = None,
) -> Any:
    """Flash attention for a prefill (SPEC 6-10, ``ggml_flash_attn_ext``'s parameters), on
    numpy arrays and torch tensors (CPU and CUDA) alike; the result is an array of q's
    library on q's device.

    Layouts: ``layout="NHD"`` (the default, FlashAttention's: the head axis is the second to
    last, **not** the second)::

        q     [rows, heads, head_dim]        or [batch, rows, heads, head_dim]
        k, v  [kv_len, kv_heads, head_dim]   or [batch, kv_len, kv_heads, head_dim]

    ``layout="HND"`` (PyTorch SDPA's, transformers'): q ``[heads, rows, head_dim]`` or
    ``[batch, heads, rows, head_dim]``, k/v ``[batch, kv_heads, kv_len, head_dim]``, and the
    output in that layout too. **An SDPA-layout tensor needs** ``layout="HND"``: read as
    ``"NHD"`` its heads would be taken for rows. Any strides with a contiguous last axis
    are used in place, in either layout, without a copy; an array whose last axis is not contiguous is
    copied first (by its own library, on its device). ``heads`` must be a multiple of
    ``kv_heads`` (query head ``h`` reads KV head ``h // (heads // kv_heads)``); head_dim
    16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256 or 512, or q/k 576 with v 512
    (DeepSeek's MLA; v may be a view of k's first 512 columns, ``k[..., :512]``); any other
    head dim up to 512 runs zero-padded on the next of these (docs/spec.md).

    - ``q``: float32, float16 or bfloat16; ``k``, ``v``: float16, bfloat16 or float32 (one
      dtype; numpy's bfloat16 is ml_dtypes'). The CPU reads float32 K/V as they are; on CUDA
      and Metal each call first converts them to float16 (round to nearest even, on their
      device: one read and one half-size write of K and V; docs/spec.md).
    - ``causal``: query row ``r`` sees cache row ``j`` iff ``j <= r + kv_len - rows`` (the
      prompt is the end of its cache; a cache shorter than the prompt is an error);
      ``window=w`` (an integer >= 1, implies causal) also needs ``j > r + kv_len - rows - w``.
      ``window=(left, right)`` is FlashAttention's ``window_size``, causal or not: row r (at
      cache position ``p = r + kv_len - rows``) sees ``p - left <= j <= p + right``, -1
      unbounded on that side (``causal`` caps right at 0; ``window=w`` is ``(w - 1, 0)``
      with causal). Both go to the kernel as a description: no ``[rows, kv]`` array exists
      anywhere.
    - ``offset``: an integer (any sign, int32) placing query row ``r`` at position ``r +
      offset`` of the cache for ``causal``/``window`` instead (``r + offset - w < j <= r +
      offset``), with or without cu_seqlens (one offset for every sequence): a chunk of
      queries against a chunk of the cache, as context parallelism computes them. The cache
      may then be shorter than the prompt; rows that see nothing are zeros with lse -inf.
      None: the prompt is the end of its cache (``offset = kv_len - rows``). Needs causal.
    - ``mask``: an explicit mask ``[rows, kv]``, ``[B or 1, rows, kv]`` or ``[B or 1, 1,
      rows, kv]`` (one for every head), additive float or bool (True = may attend); with
      ``causal``/``window`` it is added on the visible pairs. Float16 with a contiguous last
      axis is used in place; other dtypes are converted on the mask's device by its own
      library, values at or below -65504 (``finfo(dtype).min``) becoming -inf.
    - ``scale``: folded into Q before Q is rounded to half; None: ``1/sqrt(head_dim)``.
    - ``cu_seqlens_q``, ``cu_seqlens_k``: variable length (FlashAttention's convention):
      3-D q/k/v holding the sequences one after the other, int32 (or int64) offsets
      ``[B + 1]`` from 0 to the totals; a CUDA tensor is read on the host (a
      synchronisation). No explicit mask with them.
    - ``return_lse``: also return the log-sum-exp, float32 ``[heads, rows]`` (``[batch,
      heads, rows]`` batched, ``[heads, total_q]`` variable length): ``(out, lse)``; see
      :func:`merge_attention_states`.
    - ``out_dtype``: float32, float16 or bfloat16 (default: q's), written by the kernel.
    - ``device``: None lets the data decide (host arrays run on the CPU backend, CUDA
      arrays on their CUDA device); ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"metal"`` or a
      :class:`Device`. Host arrays on a CUDA device are uploaded, computed and downloaded.
    - ``check_finite``: first raise if ``half(scale * q)``, ``k`` or ``v`` holds a NaN or
      an infinity, or the mask or sinks a NaN or +inf (a pass over the inputs).
    - ``softcap``: above 0, each score becomes ``softcap * tanh(score / softcap)`` before the
      mask is added (Gemma 2: 50).
    - ``max_bias``: above 0, ALiBi: each head's slope (``2^(-max_bias (h + 1) / n2)``, SPEC
      10) scales the explicit mask; with a described mask and no explicit one, the slope
      times ``-(p - j)`` is added (``p`` the query's position in the cache, as llama.cpp's
      ALiBi mask holds it). Needs ``causal``, a window or a mask.
    - ``alibi_slopes``: float32 ``[heads]`` or ``[batch, heads]`` (flash-attn's; numpy or
      torch on q's device; ``batch`` the sequences, the ``cu_seqlens``' too): each score
      gains ``-slope_h * |p - j|`` (with causal, ``-slope_h * (p - j)``), ``p`` the query's
      cache position. Not with ``max_bias``.
    - ``sinks``: float32 ``[heads]`` (numpy or torch, on q's device): each head's sink logit,
      one more softmax score with no value (gpt-oss); a row that sees nothing is then zeros
      with lse = its sink, and lse includes the sink.

    Returns ``out`` shaped like q (contiguous, ``out_dtype``), or ``(out, lse)``. A row
    that sees nothing is zeros (lse -inf). On CUDA the work is enqueued on the caller's
    current stream (PyTorch's for tensors) and the call returns without waiting. Every
    argument is checked before anything runs; a mistake is an ``MlxError`` that is also a
    ``ValueError`` or a ``TypeError``."""
    layout = check_tensor_layout(layout)
    causal = check_bool(causal, "causal")
    causal, window = check_window_sides(window, causal)
    offset = check_offset(offset, causal or window is not None)
    scale = check_scale(scale)
    return_lse = check_bool(return_lse, "return_lse")
    check_finite = check_bool(check_finite, "check_finite")
    device = check_device(device)
    softcap, max_bias = check_softcap(softcap), check_max_bias(max_bias)
    described = (causal, window, offset, scale)
    transforms = (softcap, max_bias, sinks is not None, _alibi_form(alibi_slopes))
    rest = described + (return_lse, out_dtype, device, check_finite, transforms, layout)
    key = _key(q, k, v, mask, cu_seqlens_q, cu_seqlens_k, rest)
    plan = None
    if key is not None:
        with _cache_lock:
            plan = _cache.get(key)
            if plan is not None:
                _cache.move_to_end(key)
    if plan is None:
        plan = PrefillPlan(
            q, k, v, mask, causal=causal, window=window, offset=offset, scale=scale, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k, return_lse=return_lse, out_dtype=out_dtype, device=device,
            check_finite=check_finite, softcap=softcap, max_bias=max_bias, sinks=sinks, layout=layout,
            alibi_slopes=alibi_slopes,
        )  # fmt: skip
        plan._planned = None  # the cache keeps no arrays alive
        plan._planned_sinks = None
        plan._planned_alibi = None
        if key is not None:
            with _cache_lock:
                _cache[key] = plan
                while len(_cache) > PLAN_CACHE_SIZE:
                    _cache.popitem(last=False)
    return plan._run_call(q, k, v, mask, sinks, alibi_slopes)


def _alibi_form(slopes: Any) -> Optional[tuple]:
    """The part of the plan cache's key the slopes decide: their rank (``[H]`` or ``[B, H]``)."""
    if slopes is None:
        return None
    return (len(getattr(slopes, "shape", ())),)


def _key(q, k, v, mask, cu_q, cu_k, rest) -> Optional[tuple]:
    """The plan cache's key: the arrays' layouts, the sequence offsets' values and the
    checked arguments; None (no caching) for arrays of another kind or an out_dtype that
    is not hashable."""
    lq, lk, lv = layout_key(q), layout_key(k), layout_key(v)
    if lq is None or lk is None or lv is None:
        return None
    lm = None
    if mask is not None:
        lm = layout_key(mask)
        if lm is None:
            return None
    cu = None
    if cu_q is not None or cu_k is not None:
        cu = (_values(cu_q), _values(cu_k))
        if None in cu:
            return None
    try:
        return _hashable((lq, lk, lv, lm, cu, rest))
    except TypeError:
        return None


def _values(x) -> Optional[tuple]:
    # The offsets are part of the plan: the key holds their values (a CUDA tensor's are
    # read on the host, as the plan must).
    lay = layout_key(x)
    if lay is None:
        return None
    return lay + (tuple(x.tolist()),)


def _hashable(key: tuple) -> tuple:
    hash(key)
    return key
