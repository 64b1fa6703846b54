"""mlx_native as a Hugging Face transformers attention backend::

    import mlx_native as mn
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=mn.integrations.transformers.register())

:func:`register` adds an attention function (``AttentionInterface``) and a mask function
(``AttentionMaskInterface``, ``transformers_masks.py``) under one name. transformers calls
the attention function with ``[batch, heads, seq, head_dim]`` tensors in the model's dtype;
it passes them to :func:`mlx_native.flash_attn_prefill` as ``[batch, seq, heads, head_dim]``
views (no copy), K and V cast to float16 (the kernels' K/V dtype; a bfloat16 model's K and V
on the CPU go as they are, see :func:`_kv`), Q as it is, and returns ``[batch, seq, heads,
head_dim]`` in the model's dtype, as transformers' SDPA function does.
Features the kernels do not compute (dropout, masks per head, head dims without a kernel,
score transforms of SPEC 10 this build lacks) are refused by name with
:class:`mlx_native.UnsupportedFeatureError` (a ``NotImplementedError``), never dropped. The
forward runs under grad mode (``model.eval(); model(ids)`` without ``torch.no_grad()``); a
backward through it raises that error when it is called. A head dim without a kernel (none
under 512 remain: the front door pads them) is refused when the implementation is set,
by :func:`register` given the model's config or by :func:`set_attention`.

Nothing here calls the native library on the forward path (the head-dim check reads the
plain-Python table of ``head_dims.py``), so ``torch.compile(model, fullgraph=True)``
traces every layer into one graph."""

from __future__ import annotations

from typing import Any, Optional

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.utils import logging

from ..errors import UnsupportedFeatureError
from ..front_door import flash_attn_prefill
from ..head_dims import KERNEL_HEAD_DIMS, kernel_head_dim, supported_pair
from .transformers_masks import PrefillMask, prefill_mask

__all__ = ["register", "set_attention", "check_config", "attention_forward", "prefill_mask", "PrefillMask"]

logger = logging.get_logger(__name__)

#: The K/V dtype handed to the kernels.
KV_DTYPE = torch.float16


def register(name: str = "mlx_native", config: Any = None) -> str:
    """Register the attention and mask functions under ``name`` with transformers and
    return ``name``, to pass as ``attn_implementation``. With a model's ``config`` its head
    dims are checked first (:func:`check_config`): a model the kernels cannot run is
    refused here, before it is built."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string, got {name!r}")
    if config is not None:
        check_config(config)
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, prefill_mask)
    return name


def set_attention(model: torch.nn.Module, name: str = "mlx_native") -> torch.nn.Module:
    """Check the model's head dims (:func:`check_config`), register the functions under
    ``name`` and make them the model's attention (``model.set_attn_implementation``);
    returns the model."""
    register(name, config=model.config)
    model.set_attn_implementation(name)
    return model


#: Config attributes that hold an attention head dim (Gemma 4's global layers have their own).
_HEAD_DIM_ATTRS = ("head_dim", "global_head_dim")


def check_config(config: Any) -> None:
    """Raise :class:`~mlx_native.UnsupportedFeatureError` if a head dim of the model (its
    text config's ``head_dim``, ``global_head_dim``, or ``hidden_size //
    num_attention_heads``) has no kernel, even zero-padded (beyond the largest)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    dims = {getattr(text, a, None) for a in _HEAD_DIM_ATTRS}
    if getattr(text, "head_dim", None) is None and getattr(text, "num_attention_heads", None):
        dims.add(text.hidden_size // text.num_attention_heads)
    for d in sorted(x for x in dims if isinstance(x, int)):
        refusal = _head_dim_refusal(d, d)
        if refusal is not None:
            raise UnsupportedFeatureError(refusal)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    softcap: Optional[float] = None,
    s_aux: Optional[torch.Tensor] = None,
    **kwargs: Any,
):
    """The attention function transformers calls for each layer: ``(attn_output, None)``,
    ``attn_output`` ``[batch, seq, heads, head_dim]`` in the dtype of ``query``.

    ``attention_mask`` is what :func:`prefill_mask` made (a :class:`PrefillMask` or a
    boolean mask), a mask the caller made (bool or additive ``[batch or 1, 1, seq,
    kv]``), or None (causal per ``is_causal`` or the module's ``is_causal``, as transformers'
    SDPA function reads it). ``scaling`` None is ``1/sqrt(head_dim)``; ``softcap`` (Gemma 2)
    and ``s_aux`` (attention sinks, gpt-oss) go to the kernel's SPEC 10 transforms.
    ``sliding_window`` is not read: the mask carries the window."""
    _refuse_what_is_not_computed(query, key, value, dropout, kwargs)
    q_len, kv_len = query.shape[2], key.shape[2]
    mask, causal, window = None, False, None
    if isinstance(attention_mask, PrefillMask):
        if (attention_mask.q_length, attention_mask.kv_length) != (q_len, kv_len):
            raise ValueError(
                f"the layer's mask describes {attention_mask.q_length} queries and {attention_mask.kv_length} cache "
                f"rows, but the layer has {q_len} and {kv_len}: the mask was made for other inputs"
            )
        mask, causal, window = attention_mask.padding, attention_mask.causal, attention_mask.window
    elif attention_mask is not None:
        mask = _explicit_mask(attention_mask, kv_len)
    else:
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True)) and q_len > 1
        if causal and kv_len > q_len:
            # transformers' SDPA reads "causal, no mask" top-left aligned: the queries are
            # the first rows of a static cache whose later rows are unwritten.
            key, value, kv_len = key[:, :, :q_len], value[:, :, :q_len], q_len
        elif causal and kv_len < q_len:
            raise UnsupportedFeatureError(
                f"causal attention with {q_len} queries over {kv_len} keys and no mask: pass a mask that says which "
                "keys each query sees"
            )
    sinks = None
    if s_aux is not None:
        sinks = s_aux.to(device=query.device, dtype=torch.float32)
    out = flash_attn_prefill(
        query.transpose(1, 2), _kv(key).transpose(1, 2), _kv(value).transpose(1, 2), mask, causal=causal,
        window=window, scale=scaling, softcap=0.0 if softcap is None else softcap, sinks=sinks,
    )  # fmt: skip
    return out, None


def _kv(x: torch.Tensor) -> torch.Tensor:
    # The one conversion: K and V in float16 (strides kept: a cast, not a layout copy). On
    # CUDA a bfloat16 model's K/V are cast too: exact for values within float16's range, and
    # the float16 kernels multiply Q and P in float16 where the bfloat16 ones round them to
    # bfloat16 (SPEC 9), which costs a Gemma 4 model's logits 0.034 against 0.02. The CPU's
    # kernels multiply BF16 K/V exactly in f32 (SPEC 9), so there they go as they are: on
    # the FMA kernels the same bits as the cast's (without its pass over K/V, and without
    # its inf beyond 65504), and on AMX the BF16 item, twice as fast as the F16 one, that
    # the kernel benchmark times (docs/benchmarks.md, "Where the in-model attention time
    # goes").
    if x.dtype == KV_DTYPE or (x.dtype == torch.bfloat16 and x.device.type == "cpu"):
        return x
    return x.to(KV_DTYPE)


def _explicit_mask(mask: torch.Tensor, kv_len: int) -> torch.Tensor:
    """A mask transformers or the caller made, as the kernel takes it: one for every head;
    a key axis longer than the keys is cut to them (as transformers' eager attention
    does)."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a tensor, a PrefillMask or None, got {type(mask).__name__}")
    if mask.dim() == 4 and mask.shape[1] != 1 and mask.stride(1) != 0:
        raise UnsupportedFeatureError(
            f"a mask per head ({tuple(mask.shape)}): mlx_native applies one mask to every head; pass it as "
            "[batch, 1, seq, kv]"
        )
    if mask.shape[-1] > kv_len:
        mask = mask[..., :kv_len]
    return mask


def _refuse_what_is_not_computed(query, key, value, dropout, kwargs) -> None:
    if dropout:
        raise UnsupportedFeatureError(
            f"attention dropout ({dropout}): mlx_native computes no dropout; call model.eval(), or set the config's "
            "attention_dropout to 0"
        )
    if kwargs.get("position_bias") is not None:
        raise UnsupportedFeatureError("a position bias (T5-style relative attention): use another attn_implementation")
    if kwargs.get("output_attentions", False):
        logger.warning_once("mlx_native attention does not return attention weights (output_attentions=True)")
    if query.shape[0] != key.shape[0]:
        raise UnsupportedFeatureError(
            f"queries of batch {query.shape[0]} against keys of batch {key.shape[0]}: pass one batch"
        )
    refusal = _head_dim_refusal(int(query.shape[-1]), int(value.shape[-1]))
    if refusal is not None:
        raise UnsupportedFeatureError(refusal)


def _head_dim_refusal(head_dim: int, head_dim_v: int) -> Optional[str]:
    """Why the kernels cannot run these head dims with float16 K/V (the K/V dtype handed
    to them), or None: plain Python, so a traced forward does not break here."""
    if supported_pair(head_dim, head_dim_v, "float16") or kernel_head_dim(head_dim, head_dim_v, "float16") is not None:
        return None
    dims = ", ".join(str(d) for d in sorted(KERNEL_HEAD_DIMS.get("float16", ())))
    return (
        f"head dim {head_dim} (values {head_dim_v}): no kernel takes it, even zero-padded; the kernels' head dims "
        f"are {dims} (smaller ones run padded to the next), and q/k 576 with v 512: use another attn_implementation"
    )
