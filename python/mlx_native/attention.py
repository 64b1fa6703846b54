"""``flash_attn_prefill``: the one call. It keeps a :class:`~mlx_native.PrefillPlan` per
(layouts, description, device) and runs it, so that a call costs little more than a plan's
run: a key built from the arrays' layouts, one dictionary look-up, the run's one C call."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Optional

from .arrays import layout_key
from .options import PrefillArgs, checked, from_keywords, plan_key, signature
from .paged import table_key
from .plan import PrefillPlan
from .quant import descale_key

__all__ = ["flash_attn_prefill", "prefill", "clear_plan_cache", "PLAN_CACHE_SIZE"]

#: Plans the one call keeps (the least recently used goes first).
PLAN_CACHE_SIZE = 64

_cache: "OrderedDict[tuple, PrefillPlan]" = OrderedDict()
_cache_lock = threading.Lock()


def clear_plan_cache() -> None:
    """Drop the plans :func:`flash_attn_prefill` keeps (and the C ABI handles they hold)."""
    with _cache_lock:
        _cache.clear()


def flash_attn_prefill(q: Any, k: Any, v: Any, mask: Any = None, **keywords: Any) -> Any:
    """The array call, :func:`mlx_native.flash_attn_prefill` (which says what each argument
    means) without the torch operators and the padding of head dims: :func:`prefill` of
    the keywords."""
    return prefill(q, k, v, from_keywords("flash_attn_prefill", mask, keywords))


flash_attn_prefill.__signature__ = signature(flash_attn_prefill)  # type: ignore[attr-defined]


def prefill(q: Any, k: Any, v: Any, args: PrefillArgs) -> Any:
    """The prefill of ``q``, ``k``, ``v`` with ``args`` (checked here, before anything runs),
    on the plan this cache keeps for their layouts, made on a miss."""
    args = checked(args)
    key = _key(q, k, v, args)
    plan = None
    if key is not None:
        with _cache_lock:
            plan = _cache.get(key)
            if plan is not None:
                _cache.move_to_end(key)
    if plan is None:
        plan = PrefillPlan.from_args(q, k, v, args)
        plan._planned = None  # the cache keeps no arrays alive
        plan._planned_sinks = None
        plan._planned_alibi = None
        if key is not None:
            with _cache_lock:
                _cache[key] = plan
                while len(_cache) > PLAN_CACHE_SIZE:
                    _cache.popitem(last=False)
    return plan._run_call(q, k, v, args.mask, args.sinks, args.alibi_slopes)


def _key(q, k, v, args: PrefillArgs) -> Optional[tuple]:
    """The plan cache's key: the arrays' layouts, the sequence offsets' values and the
    checked arguments (``options.plan_key``); None (no caching) for arrays of another kind
    or an out_dtype that is not hashable."""
    mask, cu_q, cu_k = args.mask, args.cu_seqlens_q, args.cu_seqlens_k
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
        # (cu_seqlens_q alone: paged K/V's variable-length queries; the plan refuses it otherwise.)
        cu = tuple(x if x is None else _values(x) for x in (cu_q, cu_k))
        if any(x is not None and c is None for x, c in zip((cu_q, cu_k), cu)):
            return None
    if args.block_table is not None:  # paged K/V: the table and the lengths belong to the plan
        pages = table_key(args.block_table, args.seqused_k)
        if pages is None:
            return None
        cu = (cu, pages)
    descale = None
    if args.k_descale is not None or args.v_descale is not None:  # FP8's factors belong to the plan
        descale = (descale_key(args.k_descale), descale_key(args.v_descale))
        if False in descale:
            return None
    try:
        return _hashable((lq, lk, lv, lm, cu, descale, plan_key(args)))
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
