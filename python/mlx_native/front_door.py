"""``mlx_native.flash_attn_prefill``, the public call: torch tensors go through the
``torch.ops.mlx_native`` operators (``torch_ops.py``), so that ``torch.compile`` traces a
function that calls it without a graph break; every other array (and torch tensors with a
``mlx_native.Device`` object, which no operator schema can carry) goes straight to the
array call of ``attention.py``, which the operators run too. Its keywords are those of
:class:`~mlx_native.options.PrefillArgs`, written there once."""

from __future__ import annotations

from typing import Any

from . import attention
from .device import Device
from .head_dims import cut_head_dim, pad_head_dims
from .options import PrefillArgs, from_keywords, signature

__all__ = ["flash_attn_prefill"]


def flash_attn_prefill(q: Any, k: Any, v: Any, mask: Any = None, **keywords: Any) -> Any:
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
    - ``block_table``, ``seqused_k``: paged K/V (SPEC 11, the CPU, CUDA and Metal backends): k and v
      are caches ``[num_blocks, block_size, kv_heads, head_dim]`` (block_size a multiple of
      16 from 16 to 256), ``block_table`` int32 ``[batch, max_blocks]``, ``seqused_k`` int32
      ``[batch]`` each sequence's cache length; sequence b's cache row j is
      ``k[block_table[b, j // block_size], j % block_size]``. q is ``[batch, rows, heads,
      head_dim]`` (3-D: one sequence) or variable length with ``cu_seqlens_q`` alone. The
      result is the contiguous layout's bit for bit; entries past a sequence's last block
      are never read. Torch tensors go through the torch operators as every other argument
      does (``torch.compile`` traces the call without a graph break).
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
    ``ValueError`` or a ``TypeError``.

    Torch tensors (q, k, v and any mask, ``cu_seqlens``, ``sinks``, ``alibi_slopes``,
    ``block_table``, ``seqused_k``, ``k_descale``, ``v_descale``; quantised K/V included) go
    through the operator
    ``torch.ops.mlx_native.flash_attn_prefill`` (``flash_attn_prefill_lse`` with
    ``return_lse``), so ``torch.compile(fn, fullgraph=True)`` traces a function that calls
    this without a graph break; ``device`` as a ``mlx_native.Device`` object runs outside it.
    ``softcap``, ``max_bias``, ``sinks`` (SPEC 10) and ``offset`` are passed on when not
    their defaults.

    Head dims without a kernel of their own (any up to the largest kernel's, e.g.
    FlashAttention's 32, 40, 59, 160, 224) run on the next kernel size: q, k and v are
    copied with zero columns up to it (which change no score), the output's extra columns
    are cut off, and ``scale=None`` stays ``1/sqrt`` of the caller's head dim. Numpy arrays
    and torch tensors only; the plan (``PrefillPlan``) takes kernel head dims alone."""
    args = from_keywords("flash_attn_prefill", mask, keywords)
    if args.softcap is None or args.max_bias is None:
        # None (as transformers passes "no softcap") is 0.0: off; anything else goes to the check.
        args = args._replace(softcap=_off_if_none(args.softcap), max_bias=_off_if_none(args.max_bias))
    # A head dim without a kernel runs on the next kernel size, zero-padded (head_dims.py):
    # here, so that every entry (torch operators and arrays alike) gets it.
    q, k, v, scale, cut = pad_head_dims(q, k, v, args.scale)
    if cut is not None:
        args = args._replace(scale=scale)
    if _through_torch_op(q, k, v, args) and not isinstance(args.device, Device):
        out = (_torch_ops or _import_torch_ops()).flash_attn_prefill(q, k, v, args)
    else:
        out = attention.prefill(q, k, v, args)
    if cut is None:
        return out
    if isinstance(out, tuple):
        return cut_head_dim(out[0], cut), out[1]
    return cut_head_dim(out, cut)


flash_attn_prefill.__signature__ = signature(flash_attn_prefill)  # type: ignore[attr-defined]


def _off_if_none(x: Any) -> Any:
    return 0.0 if x is None else x


#: ``torch_ops`` once imported (an import statement per call would cost more than the
#: operator's dispatch).
_torch_ops = None


def _import_torch_ops():
    global _torch_ops
    from . import torch_ops  # registers the operators; torch is imported by now (q is a tensor)

    _torch_ops = torch_ops
    return torch_ops


def _is_torch(x) -> bool:
    mod = type(x).__module__
    return mod == "torch" or mod.startswith("torch.")


def _through_torch_op(q, k, v, args: PrefillArgs) -> bool:
    """Whether every array argument is a torch tensor (the optional ones may be None): an
    operator's schema takes nothing else, and the array call gives the typed error for
    anything else."""
    if not (_is_torch(q) and _is_torch(k) and _is_torch(v)):
        return False
    optional = (args.mask, args.cu_seqlens_q, args.cu_seqlens_k, args.sinks, args.alibi_slopes, args.block_table,
                args.seqused_k)  # fmt: skip
    # Quantised K/V's descale factors: tensors, or numbers (the operator makes those tensors).
    descales = all(x is None or type(x) in (int, float) or _is_torch(x) for x in (args.k_descale, args.v_descale))
    return descales and all(x is None or _is_torch(x) for x in optional)
