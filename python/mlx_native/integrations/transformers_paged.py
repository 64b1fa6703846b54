"""mlx_native as the attention of transformers' continuous batching (``generate_batch``,
its ``PagedAttentionCache``), on the CPU, reading the paged cache through a block table::

    from mlx_native.integrations import transformers_paged as mn_paged

    out = mn_paged.generate_batch(model, [[1, 2, 3], [4, 5]], generation_config=gc)

What transformers 5.24 does (``transformers/generation/continuous_batching``), and why this
is a function of its own rather than an ``attn_implementation`` name:

- ``ContinuousBatchingManager.switch_to_cb_friendly_attn`` (``continuous_api.py``) accepts only
  ``"paged|eager"``, ``"sdpa"`` or a name containing ``"flash"``; any other registered name
  is a ``ValueError`` ("Implementation ... is not supported for continuous batching"), and a
  name containing ``"flash"`` is loaded as a flash-attn kernel when the model is built
  (``_check_and_adjust_attn_implementation`` -> ``lazy_import_flash_attention``: "Could not
  find the currently requested flash attention implementation"). So :func:`generate_batch`
  builds the manager under ``"sdpa"`` and then switches the model to this module's function.
- The cache is one flat tensor; ``FullAttentionCacheAllocator.get_cache_for_block_table``
  gives each layer's K and V as page views ``[num_pages, page_size, kv_heads, head_dim]``
  (contiguous, the model's dtype): exactly SPEC 11's ``k_cache`` / ``v_cache``, addressable
  by our block table as they are.
- On the CPU transformers never passes a block table: its block-table path (the "decode fast
  path", ``flash_attn_with_kvcache``) exists only for decode batches under FlashAttention 2/3
  on CUDA or 2 on XPU (``initialization.ensure_decode_fast_path_is_available`` zeroes
  ``max_blocks_per_request`` otherwise). Every CPU forward takes the index path:
  ``PagedAttentionCache.update`` writes the new K/V (``index_copy_``) and then gathers each
  sequence's whole cache into a contiguous copy (``index_select`` by ``read_index``) before
  the attention function is called. :func:`generate_batch` replaces ``update`` on its cache
  instance with the write half alone (:func:`_write_only_update`), and
  :func:`paged_attention_forward` rebuilds the block table from transformers' own
  ``read_index`` (the first row of each page, divided by the page size: a few ints per
  page), so K and V are read in place from the cache's pages: no gather, no copy.

Refused by name (:class:`mlx_native.UnsupportedFeatureError`): a model off the CPU (the paged
kernels run on CUDA and Metal too, but this integration's replacement of transformers' cache
update is built and tested against its CPU index path only), sliding-window layers (transformers' sliding allocator keeps
a ring of pages that no block table describes), a float32 model (its cache holds float32
K/V; the kernels would need a converted copy of the whole cache: run the model in bfloat16 or
float16), dropout, softcap, attention sinks, a page size the kernels do not take (a multiple
of 16 from 16 to 256; transformers' default is 256).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from transformers import AttentionInterface, GenerationConfig

from ..errors import UnsupportedFeatureError
from ..front_door import flash_attn_prefill
from .transformers import _head_dim_refusal, check_config

__all__ = ["NAME", "register", "paged_attention_forward", "generate_batch"]

#: The name the attention function is registered under.
NAME = "mlx_native_paged"

_KV_DTYPES = (torch.float16, torch.bfloat16)


def register(name: str = NAME) -> str:
    """Register :func:`paged_attention_forward` with transformers' ``AttentionInterface``
    under ``name`` and return it. transformers' continuous batching refuses this name when
    its manager is built (see the module's text): use :func:`generate_batch`."""
    AttentionInterface.register(name, paged_attention_forward)
    return name


def check_model(model: torch.nn.Module) -> None:
    """Raise :class:`~mlx_native.UnsupportedFeatureError` for what the paged path cannot
    run: a model off the CPU, sliding-window layers, float32, head dims without a kernel."""
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise UnsupportedFeatureError(
            f"mlx_native's paged attention for transformers' continuous batching runs on the CPU so far, not on "
            f"{device}: this integration is built and tested against transformers' CPU path only (the paged kernels "
            "themselves run on CUDA: call mn.flash_attn_prefill with block_table= there); use "
            "attn_implementation='sdpa' for this model"
        )
    from transformers.generation.continuous_batching.cache import group_layers_by_attn_type  # noqa: PLC0415

    if "sliding_attention" in group_layers_by_attn_type(model.config.get_text_config()):
        raise UnsupportedFeatureError(
            "sliding-window layers under continuous batching: transformers' SlidingAttentionCacheAllocator keeps a "
            "ring of pages that no block table describes; use attn_implementation='sdpa'"
        )
    if model.dtype not in _KV_DTYPES:
        raise UnsupportedFeatureError(
            f"a {model.dtype} model under continuous batching: transformers' paged cache holds K/V in the model's "
            "dtype, and the kernels read float16 or bfloat16 pages in place (a float32 cache would need a converted "
            "copy of the whole cache at every layer): load the model in bfloat16 or float16"
        )
    check_config(model.config)


def _write_only_update(cache: Any, key_states, value_states, layer_idx: int, kwargs: dict):
    """``PagedAttentionCache.update`` without its read-back: the layer's kwargs get their
    per-layer ``cu_seq_lens_k`` / ``max_length_k`` as transformers' update gives them, the new
    K/V are written to their pages (the allocator's update with an empty read index, which
    transformers itself takes when a batch reads no cache), and the new rows are returned
    (:func:`paged_attention_forward` reads the cache's pages)."""
    allocator = cache.layer_to_allocator[layer_idx]
    if kwargs.get("block_table") is not None:  # transformers' decode fast path: not on the CPU
        return type(cache).update(cache, key_states, value_states, layer_idx, kwargs)
    kwargs["cu_seq_lens_k"] = kwargs["cu_seq_lens_k"][allocator.layer_type].to(torch.int32)
    kwargs["max_length_k"] = kwargs["max_length_k"][allocator.layer_type]
    write_index = kwargs["write_index"][allocator.index]
    k, v = (x.squeeze(0).transpose(0, 1) for x in (key_states, value_states))
    allocator.update(k, v, layer_idx, write_index.new_empty(0), write_index)
    kwargs["mlx_native_allocator"] = allocator  # the layer's pages, for the attention function
    return key_states, value_states


def _block_table(read_index: torch.Tensor, cu_k: torch.Tensor, page: int):
    """The block table (int32 ``[batch, max_pages]``, in pages of the layer's page views) and
    ``seqused_k`` of a batch, from transformers' read index: sequence b's cache rows are
    ``read_index[cu_k[b]:cu_k[b+1]]``, whole pages in order. Checked row by row (an int
    per cache row; no K/V is touched)."""
    cu = cu_k.to(torch.int64).cpu()
    used = (cu[1:] - cu[:-1]).to(torch.int32)
    batch = used.numel()
    max_pages = max(1, int(((used.max() + page - 1) // page).item())) if batch else 1
    table = torch.zeros(batch, max_pages, dtype=torch.int32)
    ri = read_index.to(torch.int64).cpu()
    for b in range(batch):
        rows = ri[cu[b] : cu[b + 1]]
        n = rows.numel()
        if n == 0:
            continue
        firsts = rows[::page]
        if bool((firsts % page != 0).any()):
            raise UnsupportedFeatureError("transformers' read index does not start its pages on page boundaries")
        expected = (firsts // page).repeat_interleave(page)[:n] * page + torch.arange(n) % page
        if not torch.equal(expected, rows):
            raise UnsupportedFeatureError("transformers' read index is not whole pages in order: no block table reads it")
        table[b, : firsts.numel()] = (firsts // page).to(torch.int32)
    return table, used


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    softcap: Optional[float] = None,
    s_aux: Optional[torch.Tensor] = None,
    **kwargs: Any,
):
    """The attention function of a continuous-batching forward: ``query`` ``[1, heads,
    total_q, head_dim]`` (the batch's sequences packed, ``cu_seq_lens_q``), and the layer's
    pages of transformers' ``PagedAttentionCache`` (the allocator :func:`_write_only_update`
    hands over, ``read_index``, ``cu_seq_lens_k``) read through a block table: ``flash_attn_prefill(q, k_pages, v_pages,
    block_table=, seqused_k=, cu_seqlens_q=, causal=True)`` (each sequence's queries are the
    end of its cache). ``attention_mask`` (transformers' sdpa mask for the packed batch) is
    not read: it says what ``causal`` with the lengths says. Returns ``([1, total_q, heads,
    head_dim], None)``."""
    allocator = kwargs.get("mlx_native_allocator")
    if allocator is None:
        raise UnsupportedFeatureError(
            f"{NAME} is the attention of transformers' continuous batching run by "
            "mlx_native.integrations.transformers_paged.generate_batch (its cache writes the new K/V and hands the "
            "layer's pages over, without transformers' gather); for ordinary forwards use "
            "mlx_native.integrations.transformers.register()"
        )
    if dropout:
        raise UnsupportedFeatureError(f"attention dropout ({dropout}): mlx_native computes no dropout; call model.eval()")
    if softcap is not None or s_aux is not None:
        raise UnsupportedFeatureError("softcap and attention sinks are not wired into the paged path yet")
    if query.device.type != "cpu":
        raise UnsupportedFeatureError(f"paged K/V runs on the CPU backend so far, not on {query.device}")
    refusal = _head_dim_refusal(int(query.shape[-1]), int(value.shape[-1]))
    if refusal is not None:
        raise UnsupportedFeatureError(refusal)
    layer_idx = module.layer_idx
    if not getattr(allocator, "supports_block_table", False):
        raise UnsupportedFeatureError(f"{type(allocator).__name__}'s pages are not described by a block table")
    page = allocator.tokens_per_page
    q = query[0].transpose(0, 1)  # [total_q, heads, head_dim], a view
    cu_q = kwargs["cu_seq_lens_q"].to(torch.int32)
    cu_k = kwargs["cu_seq_lens_k"]
    read_index = kwargs["read_index"][allocator.index]
    if read_index.numel() == 0:
        # No sequence reads cached rows (every one a whole prompt): the new K/V are each
        # sequence's whole cache, contiguous, in the batch's order.
        k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)
        out = flash_attn_prefill(
            q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k.to(torch.int32), causal=True, scale=scaling
        )  # fmt: skip
        return out.unsqueeze(0), None
    k_pages, v_pages = allocator.get_cache_for_block_table(layer_idx)
    table, used = _block_table(read_index, cu_k, page)
    out = flash_attn_prefill(
        q, k_pages, v_pages, block_table=table, seqused_k=used, cu_seqlens_q=cu_q, causal=True, scale=scaling
    )  # fmt: skip
    return out.unsqueeze(0), None


def generate_batch(
    model: torch.nn.Module,
    inputs: list,
    generation_config: Optional[GenerationConfig] = None,
    continuous_batching_config: Any = None,
    max_new_tokens: Optional[int] = None,
    name: str = NAME,
) -> dict:
    """``model.generate_batch(inputs, ...)`` (transformers' continuous batching) with
    mlx_native's paged attention: the manager is built under ``"sdpa"`` (the names
    transformers accepts), the model switched to :func:`paged_attention_forward`, and the
    manager's cache told to write without gathering (:func:`_write_only_update`). Returns
    transformers' ``{request_id: GenerationOutput}`` in the order of ``inputs``; the
    model's attention implementation is restored afterwards. Greedy or sampled, as
    ``generation_config`` says; one return sequence per prompt."""
    check_model(model)
    register(name)
    gen = generation_config if generation_config is not None else model.generation_config
    if (gen.num_return_sequences or 1) != 1:
        raise UnsupportedFeatureError("num_return_sequences > 1 (forked requests) is not wired into the paged path")
    original = model.config._attn_implementation
    from transformers.generation.continuous_batching.utils import WorkloadHints  # noqa: PLC0415

    new_tokens = max_new_tokens if max_new_tokens is not None else gen.max_new_tokens
    hints = WorkloadHints(
        max_prompt_length=max(len(x) for x in inputs), max_generated_length=new_tokens or 0, num_requests=len(inputs)
    )
    model.set_attn_implementation("sdpa")
    manager = None
    try:
        with torch.no_grad():
            manager = model.init_continuous_batching(
                generation_config=gen, continuous_batching_config=continuous_batching_config, workload_hints=hints
            )
            model.set_attn_implementation(name)
            if manager.batch_processor is None:
                manager.batch_processor = manager._create_batch_processor()
            cache = manager.batch_processor.cache
            cache.update = functools.partial(_write_only_update, cache)
            manager.start()
            ids = manager.add_requests(inputs=inputs, max_new_tokens=new_tokens)
            results = {}
            while len(results) < len(ids):
                r = manager.get_result(timeout=1)
                if r is not None and r.is_finished():
                    results[r.request_id] = r
                elif r is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped before every request finished")
            errors = {k: r.error for k, r in results.items() if r.error is not None}
            if errors:
                raise RuntimeError(f"continuous batching requests failed: {errors}")
            return {k: results[k] for k in ids}
    finally:
        if manager is not None:
            manager.stop(block=True, timeout=5)
            manager.destroy()
        model.set_attn_implementation(original)
