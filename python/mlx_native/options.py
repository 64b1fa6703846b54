"""The prefill's keywords, written once: :class:`PrefillArgs` holds every argument of a
prefill but q, k and v, with its default, and :func:`checked` checks them, the one place
they are checked. The front door, the torch operators, the array call and
:class:`~mlx_native.PrefillPlan` take a ``PrefillArgs`` (or keywords that make one)
instead of listing the keywords again."""

from __future__ import annotations

import inspect
from typing import Any, Callable, NamedTuple, Optional, Tuple, Union

from .checks import (
    check_bool,
    check_device,
    check_max_bias,
    check_offset,
    check_out_dtype,
    check_run_options,
    check_scale,
    check_softcap,
    check_tensor_layout,
    check_window_sides,
)
from .device import Device
from .quant import kv_format_name

__all__ = ["PrefillArgs", "checked", "from_keywords", "plan_key", "run_options", "signature"]


class PrefillArgs(NamedTuple):
    """Every argument of a prefill but q, k and v (``flash_attn_prefill``'s and
    ``PrefillPlan``'s keywords, with their defaults). The fields stand in the order of the
    torch operators' schema (``torch_ops.py``), which calls with them by position;
    ``return_lse``, which picks the operator, stands last. A NamedTuple: built in well
    under a microsecond, immutable, and read by ``torch.compile`` without a graph break."""

    mask: Any = None
    causal: bool = False
    window: Union[None, int, Tuple[int, int]] = None
    scale: Optional[float] = None
    cu_seqlens_q: Any = None
    cu_seqlens_k: Any = None
    out_dtype: Any = None
    device: Union[None, str, Device] = None
    check_finite: bool = False
    softcap: float = 0.0
    max_bias: float = 0.0
    sinks: Any = None
    offset: Optional[int] = None
    layout: str = "NHD"
    alibi_slopes: Any = None
    # How it runs (the plan's report, ``PrefillPlan.choices``, says what was chosen); None:
    # the library's choice, which an environment variable may override (README's table).
    kv_splits: Optional[int] = None
    cta_pairs: Optional[str] = None
    cuda_form: Optional[str] = None
    cpu_isa: Optional[str] = None
    #: Paged K/V (SPEC 11): k and v are caches [num_blocks, block_size, kv_heads, head_dim],
    #: sequence b's cache row j in block ``block_table[b, j // block_size]``; ``seqused_k``
    #: int32 [batch] holds each sequence's cache length (``paged.py``).
    block_table: Any = None
    seqused_k: Any = None
    #: Quantised K/V (SPEC 11, the CPU and CUDA backends; ``quant.py``): ``kv_dtype`` names the format
    #: of uint8 k/v bytes ("float8_e4m3fn", "float8_e5m2", "q8_0"; None: k's own dtype), and
    #: FP8's descale factors (None, a number, or float32 [1] / [kv_heads]).
    kv_dtype: Any = None
    k_descale: Any = None
    v_descale: Any = None
    return_lse: bool = False


#: The keywords of a call (``mask`` may also come by position).
KEYWORDS = frozenset(PrefillArgs._fields)


def from_keywords(caller: str, mask: Any, keywords: dict) -> PrefillArgs:
    """The :class:`PrefillArgs` of a call ``caller(q, k, v, mask=None, **keywords)``; a
    keyword it does not take is Python's own ``TypeError``, naming it."""
    try:
        return PrefillArgs(mask, **keywords)
    except TypeError:
        for name in keywords:
            if name not in KEYWORDS or name == "mask":
                how = "multiple values for argument" if name == "mask" else "an unexpected keyword argument"
                raise TypeError(f"{caller}() got {how} {name!r}") from None
        raise


def signature(fn: Callable) -> inspect.Signature:
    """``fn``'s signature with its ``**keywords`` written out as :class:`PrefillArgs`'
    keyword-only fields and their defaults (what ``help`` and editors show)."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    named = {p.name for p in params}
    params += [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=PrefillArgs._field_defaults[name])
        for name in PrefillArgs._fields
        if name not in named
    ]
    return sig.replace(parameters=params)


def checked(a: PrefillArgs) -> PrefillArgs:
    """``a`` with every option checked and in its normal form (the checks of ``checks.py``,
    each raising a typed error that names the argument and the fix). The arrays are checked
    against q, k and v where a plan is made (``plan.py``); ``out_dtype`` becomes its name."""
    layout = check_tensor_layout(a.layout)
    causal = check_bool(a.causal, "causal")
    causal, window = check_window_sides(a.window, causal)
    offset = check_offset(a.offset, causal or window is not None)
    scale = check_scale(a.scale)
    return_lse = check_bool(a.return_lse, "return_lse")
    check_finite = check_bool(a.check_finite, "check_finite")
    device = check_device(a.device)
    softcap, max_bias = check_softcap(a.softcap), check_max_bias(a.max_bias)
    out_dtype = None if a.out_dtype is None else check_out_dtype(a.out_dtype, None)  # None: q's
    run_options = check_run_options(a.kv_splits, a.cta_pairs, a.cuda_form, a.cpu_isa)
    # Made anew rather than by _replace, which costs a call about a microsecond more.
    return PrefillArgs(
        a.mask, causal, window, scale, a.cu_seqlens_q, a.cu_seqlens_k, out_dtype, device, check_finite, softcap,
        max_bias, a.sinks, offset, layout, a.alibi_slopes, *run_options, a.block_table, a.seqused_k,
        kv_format_name(a.kv_dtype), a.k_descale, a.v_descale, return_lse,
    )  # fmt: skip


def plan_key(a: PrefillArgs) -> tuple:
    """What of checked arguments a plan is made from, besides the arrays' layouts and the
    sequence offsets' values: the options, and of the sinks and slopes their presence and
    the slopes' rank, and whether K/V are paged (the table's values are the key's, as the
    sequence offsets' are)."""
    slopes = None if a.alibi_slopes is None else (len(getattr(a.alibi_slopes, "shape", ())),)
    return (
        a.causal, a.window, a.offset, a.scale, a.return_lse, a.out_dtype, a.device, a.check_finite,
        (a.softcap, a.max_bias, a.sinks is not None, slopes), a.layout, run_options(a), a.block_table is not None,
        a.kv_dtype,
    )  # fmt: skip


def run_options(a: PrefillArgs) -> tuple:
    """The run options of ``a`` (``kv_splits``, ``cta_pairs``, ``cuda_form``, ``cpu_isa``),
    in the order of the C ABI's ``MlxnRunOptions``."""
    return a.kv_splits, a.cta_pairs, a.cuda_form, a.cpu_isa
