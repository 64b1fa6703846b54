"""FlashAttention 2's forward functions over :func:`mlx_native.flash_attn_prefill`, with its
signatures, defaults and return conventions, so that code written for ``flash_attn``
(``from flash_attn import flash_attn_func``) runs on these kernels by changing the import::

    from mlx_native.flash_attn_interface import flash_attn_func, flash_attn_varlen_func

What maps how (FlashAttention's name -> ours):

- q ``[batch, seqlen_q, heads, head_dim]``, k/v ``[batch, seqlen_k, kv_heads, head_dim]``
  (varlen: ``[total, heads, head_dim]`` with ``cu_seqlens_q/k``): our ``"NHD"`` layout, read
  in place; the packed forms are views of their packs (no copy).
- ``softmax_scale`` -> ``scale`` (None: ``1/sqrt(head_dim)``).
- ``causal``: bottom-right aligned when ``seqlen_q != seqlen_k`` (query ``i`` sees key ``j``
  iff ``j <= i + seqlen_k - seqlen_q``), which is our default (the prompt is the end of its
  cache); where ``seqlen_k < seqlen_q`` the first rows see nothing and are zeros, as in
  FlashAttention (their lse is ``+inf``, FlashAttention's value for them).
- ``window_size=(left, right)``, -1 unbounded: query at cache position ``p`` sees ``j`` with
  ``p - left <= j <= p + right``. ``(left, 0)`` (or any with ``causal``) is our
  ``window=left + 1`` (``(-1, 0)``: causal); a two-sided window is passed on as
  ``window=(left, right)`` (the CPU, CUDA and Metal kernels).
- ``softcap`` -> ``softcap``; ``alibi_slopes`` (float32 ``[heads]`` or ``[batch, heads]``)
  -> ``alibi_slopes`` (likewise every kernel).
- ``return_attn_probs=True`` -> ``(out, softmax_lse, None)``: lse float32 ``[batch, heads,
  seqlen_q]`` (varlen ``[heads, total_q]``); the probabilities themselves are not returned
  (FlashAttention returns them only with dropout, for its tests).
- ``block_table`` (``flash_attn_varlen_func``, ``flash_attn_with_kvcache``): paged caches
  ``[num_blocks, block_size, kv_heads, head_dim]`` (SPEC 11; the CPU, CUDA and Metal backends), the
  cache lengths from ``cu_seqlens_k`` / ``cache_seqlens``.
- ``dropout_p > 0`` is refused (inference only); ``deterministic`` is accepted: every run
  is deterministic.
- Head dims: any (FlashAttention: multiples of 8 up to 256); a head dim without a kernel
  runs zero-padded on the next kernel size (the front door does this, ``head_dims.py``).
- dtypes: q float16, bfloat16 (or float32); k and v float16, bfloat16 or float32 (the CPU
  reads float32 K/V as they are; CUDA and Metal get float16 copies: docs/spec.md).

The output is in q's dtype. Under grad mode the forward runs (a backward raises
:class:`~mlx_native.UnsupportedFeatureError`)."""

from __future__ import annotations

import inspect
import numbers
from typing import Any, Callable, NamedTuple, Tuple

import numpy as np

from .errors import ArgumentTypeError, InvalidArgumentError, UnsupportedFeatureError
from .front_door import flash_attn_prefill

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]


class FlashAttnArgs(NamedTuple):
    """The arguments every FlashAttention 2 forward function takes after its arrays, in its
    order and with its defaults (by position or by name); ``block_table`` is
    ``flash_attn_varlen_func``'s alone."""

    dropout_p: float = 0.0
    softmax_scale: Any = None
    causal: bool = False
    window_size: Any = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: Any = None
    deterministic: bool = False
    return_attn_probs: bool = False
    block_table: Any = None


def _fa_args(caller: str, args: tuple, keywords: dict) -> FlashAttnArgs:
    """The :class:`FlashAttnArgs` of ``caller(*arrays, *args, **keywords)``, refusing what
    FlashAttention's own function would (Python's ``TypeError``, naming it)."""
    fields = len(FlashAttnArgs._fields) - (caller != "flash_attn_varlen_func")
    if len(args) > fields:
        raise TypeError(f"{caller}() got {len(args)} arguments after its arrays, at most {fields}")
    for name in keywords:
        if name not in FlashAttnArgs._fields[:fields]:
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}")
    try:
        return FlashAttnArgs(*args, **keywords)
    except TypeError as e:  # an argument given twice
        raise TypeError(f"{caller}(): {e}") from None


def _signature(arrays: str, varlen: bool = False) -> Callable:
    """Gives a forward function FlashAttention's signature (what ``help`` and editors show):
    ``arrays`` then :class:`FlashAttnArgs`' fields."""

    def give(fn: Callable) -> Callable:
        named = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in arrays.split()]
        fields = FlashAttnArgs._fields if varlen else FlashAttnArgs._fields[:-1]
        named += [
            inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=FlashAttnArgs._field_defaults[n])
            for n in fields
        ]
        fn.__signature__ = inspect.Signature(named)  # type: ignore[attr-defined]
        return fn

    return give


@_signature("q k v")
def flash_attn_func(q, k, v, *args, **keywords):
    """FlashAttention 2's ``flash_attn_func``: q ``[batch, seqlen_q, heads, head_dim]``,
    k/v ``[batch, seqlen_k, kv_heads, head_dim]``; returns out ``[batch, seqlen_q, heads,
    head_dim]`` or, with ``return_attn_probs``, ``(out, softmax_lse [batch, heads,
    seqlen_q], None)``."""
    return _fixed(q, k, v, _fa_args("flash_attn_func", args, keywords))


@_signature("qkv")
def flash_attn_qkvpacked_func(qkv, *args, **keywords):
    """``flash_attn_func`` on ``qkv [batch, seqlen, 3, heads, head_dim]`` (views of it, no
    copy)."""
    fa = _fa_args("flash_attn_qkvpacked_func", args, keywords)
    _check_pack(qkv, "qkv", 5, 3, 2)
    return _fixed(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], fa)


@_signature("q kv")
def flash_attn_kvpacked_func(q, kv, *args, **keywords):
    """``flash_attn_func`` with ``kv [batch, seqlen_k, 2, kv_heads, head_dim]`` (views of
    it, no copy)."""
    fa = _fa_args("flash_attn_kvpacked_func", args, keywords)
    _check_pack(kv, "kv", 5, 2, 2)
    return _fixed(q, kv[:, :, 0], kv[:, :, 1], fa)


@_signature("q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k", varlen=True)
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *args, **keywords):
    """FlashAttention 2's ``flash_attn_varlen_func``: q ``[total_q, heads, head_dim]``, k/v
    ``[total_k, kv_heads, head_dim]``, ``cu_seqlens_q/k`` int32 ``[batch + 1]``;
    ``max_seqlen_q/k`` are accepted (the plan reads the lengths from the offsets). Returns
    out ``[total_q, heads, head_dim]`` or ``(out, softmax_lse [heads, total_q], None)``.
    ``block_table`` int32 ``[batch, max_blocks]``: k/v are paged caches ``[num_blocks,
    block_size, kv_heads, head_dim]`` and ``cu_seqlens_k`` the sequences' cache lengths as
    offsets (FlashAttention's convention; SPEC 11, the CPU, CUDA and Metal backends)."""
    fa = _fa_args("flash_attn_varlen_func", args, keywords)
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, fa)


@_signature("qkv cu_seqlens max_seqlen")
def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, *args, **keywords):
    """``flash_attn_varlen_func`` on ``qkv [total, 3, heads, head_dim]`` (views of it)."""
    fa = _fa_args("flash_attn_varlen_qkvpacked_func", args, keywords)
    _check_pack(qkv, "qkv", 4, 3, 1)
    return _varlen(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, fa)


@_signature("q kv cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k")
def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *args, **keywords):
    """``flash_attn_varlen_func`` with ``kv [total_k, 2, kv_heads, head_dim]`` (views)."""
    fa = _fa_args("flash_attn_varlen_kvpacked_func", args, keywords)
    _check_pack(kv, "kv", 4, 2, 1)
    return _varlen(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, fa)


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """FlashAttention 2's ``flash_attn_with_kvcache`` for attention against a cache that is
    already written: q ``[batch, seqlen_q, heads, head_dim]``; k_cache/v_cache ``[batch,
    seqlen_cache, kv_heads, head_dim]``, or paged ``[num_blocks, block_size, kv_heads,
    head_dim]`` with ``block_table`` int32 ``[batch, max_blocks]`` (SPEC 11, the CPU, CUDA
    and Metal backends); ``cache_seqlens`` (an int or int32 ``[batch]``; None: the whole cache) the cache
    lengths, to whose ends the queries are aligned (causal, window). Returns out, or ``(out,
    softmax_lse [batch, heads, seqlen_q])`` with ``return_softmax_lse``. Appending ``k``/``v``
    to the cache, rotary embeddings, ``cache_batch_idx`` and ``cache_leftpad`` are refused
    (write the cache first); ``num_splits`` is accepted (the library decides)."""
    unsupported = dict(k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_batch_idx=cache_batch_idx,
                       cache_leftpad=cache_leftpad)  # fmt: skip
    given = [name for name, x in unsupported.items() if x is not None]
    if given:
        raise UnsupportedFeatureError(
            f"flash_attn_with_kvcache: {', '.join(given)} (appending to the cache, rotary embeddings, batch indices, "
            "left padding) are not computed here: write the new rows into the cache first, then call with "
            "cache_seqlens covering them"
        )
    fa = FlashAttnArgs(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                       alibi_slopes=alibi_slopes, return_attn_probs=return_softmax_lse)  # fmt: skip
    kw = _common(fa)
    batch, seqlen_q = int(q.shape[0]), int(q.shape[1])
    paged = block_table is not None
    full = int(block_table.shape[1]) * int(k_cache.shape[1]) if paged else int(k_cache.shape[1])
    lengths = _cache_lengths(cache_seqlens, batch, full)
    described = kw["causal"] or kw["window"] is not None
    if paged:
        used = np.asarray(lengths, np.int32)
        if hasattr(block_table, "new_tensor"):  # torch: the lengths as its tensors
            used = block_table.new_tensor(used)
        kw.update(block_table=block_table, seqused_k=used)
        if not (described and min(lengths) < seqlen_q):
            return _with_lse(flash_attn_prefill(q, k_cache, v_cache, **kw))
    elif len(set(lengths)) == 1 and not (described and lengths[0] < seqlen_q):
        n = lengths[0]
        return _with_lse(flash_attn_prefill(q, k_cache[:batch, :n], v_cache[:batch, :n], **kw))
    # Caches of different lengths (contiguous), or shorter than the queries (causal): each
    # sequence on its own, placed at its cache's end.
    outs, lses = [], []
    for b, n in enumerate(lengths):
        one = dict(kw)
        if paged:
            one.update(block_table=block_table[b : b + 1], seqused_k=kw["seqused_k"][b : b + 1])
            kb, vb = k_cache, v_cache
        else:
            kb, vb = k_cache[b : b + 1, :n], v_cache[b : b + 1, :n]
        if described:
            one["offset"] = n - seqlen_q
        r = flash_attn_prefill(q[b : b + 1], kb, vb, **one)
        outs.append(r[0] if kw["return_lse"] else r)
        if kw["return_lse"]:
            lses.append(r[1])
    cat = _concat(outs)
    return _with_lse((cat, _concat(lses)) if kw["return_lse"] else cat)


def _cache_lengths(cache_seqlens, batch: int, full: int) -> list:
    if cache_seqlens is None:
        return [full] * batch
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        return [int(cache_seqlens)] * batch
    vals = [int(x) for x in (cache_seqlens.tolist() if hasattr(cache_seqlens, "tolist") else cache_seqlens)]
    if len(vals) != batch:
        raise InvalidArgumentError(f"cache_seqlens has {len(vals)} entries for a batch of {batch}: one per sequence")
    return vals


def _concat(parts):
    if hasattr(parts[0], "new_zeros"):
        import torch

        return torch.cat(parts)
    return np.concatenate(parts)


def _with_lse(result):
    """``flash_attn_with_kvcache``'s return: out, or ``(out, softmax_lse)``."""
    return _finish(result)[:2] if isinstance(result, tuple) else result


# ---------------------------------------------------------------------- the mapping


def _fixed(q, k, v, fa: FlashAttnArgs):
    kw = _common(fa)
    if (kw["causal"] or kw["window"] is not None) and len(q.shape) == 4 == len(k.shape) and k.shape[1] < q.shape[1]:
        # Bottom-right aligned with a cache shorter than the queries: the first rows see
        # nothing (our default refuses this shape as a mistake; FlashAttention allows it).
        kw["offset"] = int(k.shape[1]) - int(q.shape[1])
    return _finish(flash_attn_prefill(q, k, v, **kw))


def _varlen(q, k, v, cu_q, cu_k, fa: FlashAttnArgs):
    kw = _common(fa)
    if fa.block_table is not None:  # paged: the offsets of cu_seqlens_k are the caches' lengths
        kw.update(block_table=fa.block_table, seqused_k=_seqused(cu_k))
        if (kw["causal"] or kw["window"] is not None) and _some_cache_shorter(cu_q, cu_k):
            return _finish(_paged_by_sequence(q, k, v, cu_q, kw))
        return _finish(flash_attn_prefill(q, k, v, cu_seqlens_q=cu_q, **kw))
    if (kw["causal"] or kw["window"] is not None) and _some_cache_shorter(cu_q, cu_k):
        return _finish(_by_sequence(q, k, v, cu_q, cu_k, kw))
    return _finish(flash_attn_prefill(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw))


def _seqused(cu_k):
    """Each sequence's cache length from offsets, int32 of the offsets' library."""
    lengths = cu_k[1:] - cu_k[:-1]
    if hasattr(lengths, "to"):  # torch
        import torch

        return lengths.to(torch.int32)
    return np.asarray(lengths, np.int32)


def _paged_by_sequence(q, k_cache, v_cache, cu_q, kw):
    """:func:`_by_sequence` on paged caches: each sequence with its own table row, length and
    offset (its first rows see nothing)."""
    lse = kw["return_lse"]
    table, used = kw.pop("block_table"), kw.pop("seqused_k")
    starts_q = [int(x) for x in (cu_q.tolist() if hasattr(cu_q, "tolist") else cu_q)]
    out = q.new_zeros(q.shape[:-1] + v_cache.shape[-1:]) if hasattr(q, "new_zeros") else None
    if out is None:
        out = np.zeros(q.shape[:-1] + v_cache.shape[-1:], q.dtype)
    lse_all = np.full((q.shape[1], q.shape[0]), -np.inf, np.float32)
    if hasattr(q, "new_zeros") and lse:
        import torch

        lse_all = torch.from_numpy(lse_all).to(q.device)
    for b in range(len(starts_q) - 1):
        a, e, lk = starts_q[b], starts_q[b + 1], int(used[b])
        if e == a or lk == 0:
            continue  # nothing to compute, or sees nothing: zeros, lse -inf (+inf below)
        r = flash_attn_prefill(q[a:e], k_cache, v_cache, block_table=table[b : b + 1], seqused_k=used[b : b + 1],
                               offset=lk - (e - a), **kw)  # fmt: skip
        if lse:
            out[a:e], lse_all[:, a:e] = r
        else:
            out[a:e] = r
    return (out, lse_all) if lse else out


def _common(fa: FlashAttnArgs) -> dict:
    """The front door's keywords for FlashAttention's arguments, checked."""
    dropout_p, causal, return_attn_probs = fa.dropout_p, fa.causal, fa.return_attn_probs
    if not isinstance(dropout_p, numbers.Real) or isinstance(dropout_p, bool):
        raise ArgumentTypeError(f"dropout_p must be a number, got {dropout_p!r} ({type(dropout_p).__name__})")
    if dropout_p != 0:
        raise UnsupportedFeatureError(
            f"dropout_p={dropout_p}: mlx_native is for inference only and computes no dropout; pass dropout_p=0.0 "
            "(as FlashAttention's callers do in eval mode)"
        )
    if not isinstance(causal, bool):
        raise ArgumentTypeError(f"causal must be True or False, got {causal!r} ({type(causal).__name__})")
    if not isinstance(return_attn_probs, bool):
        raise ArgumentTypeError(f"return_attn_probs must be True or False, got {return_attn_probs!r}")
    causal, window = _window(causal, fa.window_size)
    kw = dict(causal=causal, window=window, softcap=0.0 if fa.softcap is None else fa.softcap,
              scale=fa.softmax_scale, return_lse=return_attn_probs)  # fmt: skip
    if fa.alibi_slopes is not None:
        kw["alibi_slopes"] = fa.alibi_slopes
    return kw


def _window(causal: bool, window_size: Any) -> Tuple[bool, Any]:
    """``(causal, window)`` for the front door from FlashAttention's ``causal`` and
    ``window_size`` (as its ``mha_fwd`` normalises them: ``causal`` makes ``right`` 0, and
    ``(-1, 0)`` is causal)."""
    if (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in window_size)
    ):
        raise ArgumentTypeError(
            f"window_size must be a pair of integers (left, right), -1 for unbounded, got {window_size!r}"
        )
    left, right = (int(x) for x in window_size)
    if left < -1 or right < -1:
        raise InvalidArgumentError(f"window_size {window_size!r}: each side is -1 (unbounded) or a count >= 0")
    if causal:
        right = 0
    if right == 0:  # query p sees p - left .. p: our causal window of left + 1 rows
        return True, (None if left == -1 else left + 1)
    if left == -1 and right == -1:
        return False, None
    return False, (left, right)  # two-sided: the kernels' two-sided windows


def _some_cache_shorter(cu_q, cu_k) -> bool:
    lq, lk = _lengths(cu_q), _lengths(cu_k)
    return len(lq) == len(lk) and any(b < a for a, b in zip(lq, lk))


def _lengths(cu) -> list:
    vals = [int(x) for x in (cu.tolist() if hasattr(cu, "tolist") else cu)]
    return [b - a for a, b in zip(vals[:-1], vals[1:])]


def _by_sequence(q, k, v, cu_q, cu_k, kw):
    """Variable length where a causal sequence's cache is shorter than its queries (its
    first rows see nothing): each sequence on its own, with its offset (our variable-length
    plan takes one offset for all). Slower (one call per sequence), and only this case."""
    import torch

    lse = kw["return_lse"]
    starts_q = [int(x) for x in cu_q.tolist()]
    starts_k = [int(x) for x in cu_k.tolist()]
    out = q.new_zeros(q.shape[:-1] + v.shape[-1:])
    lse_t = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device) if lse else None
    for b in range(len(starts_q) - 1):
        a, e, ka, ke = starts_q[b], starts_q[b + 1], starts_k[b], starts_k[b + 1]
        if e == a:
            continue
        if ke == ka:
            continue  # sees nothing: zeros, lse -inf (+inf below)
        r = flash_attn_prefill(q[a:e], k[ka:ke], v[ka:ke], offset=(ke - ka) - (e - a), **kw)
        if lse:
            out[a:e], lse_t[:, a:e] = r
        else:
            out[a:e] = r
    return (out, lse_t) if lse else out


def _finish(result):
    """FlashAttention's return: ``out`` or ``(out, softmax_lse, None)``, the lse of a row
    that sees nothing ``+inf`` (FlashAttention's value) rather than our -inf."""
    if not isinstance(result, tuple):
        return result
    out, lse = result
    if hasattr(lse, "masked_fill"):  # torch
        lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    else:  # numpy
        lse = np.where(lse == -np.inf, np.float32(np.inf), lse)
    return out, lse, None


def _check_pack(x, name: str, ndim: int, n: int, axis: int) -> None:
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) != ndim or shape[axis] != n:
        lead = "[batch, seqlen, " if ndim == 5 else "[total, "
        raise InvalidArgumentError(f"{name} must be {lead}{n}, heads, head_dim], got shape {shape}")
