"""The mask function of the transformers backend (``AttentionMaskInterface``): what a layer
may see, told to mlx_native's kernel as a description where it can be.

transformers builds each layer's mask by calling the registered mask function with the
pattern (``mask_function``: causal, sliding window, bidirectional, or a composition with
image or packing overlays), the sizes and offsets of the queries and the cache, and the 2-D
padding mask. For the patterns the kernel takes as a description (causal, causal with a
window, bidirectional; the prompt at the end of its cache) this returns a
:class:`PrefillMask`: no ``[rows, kv]`` array exists, and padding, when a sequence has any,
travels as one ``[B, 1, 1, kv]`` row that the kernel adds on the visible pairs. Any other
pattern gets transformers' own boolean mask (True = may attend), which the attention
function passes on as an explicit mask; so nothing is ever dropped, only described when it
can be."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Tuple

import torch
from transformers import masking_utils as hf_masks
from transformers.utils.import_utils import is_tracing

__all__ = ["PrefillMask", "prefill_mask", "describe_mask_function"]


@dataclass(frozen=True, eq=False)
class PrefillMask:
    """A layer's visibility as a description: ``causal`` (query row ``r`` sees cache row
    ``j <= r + kv_length - q_length``), ``window`` (also ``j > r + kv_length - q_length -
    window``) and ``padding``, bool ``[batch, 1, 1, kv_length]`` (True = may attend) or
    None when no sequence has padding. It stands where transformers passes a ``[batch, 1,
    q_length, kv_length]`` mask, and takes the slicing of its query axis that models do
    (Gemma 4 keeps the last rows before its KV-shared layers); :meth:`to_tensor` makes the
    boolean mask it describes, for code that needs one."""

    batch: int
    q_length: int
    kv_length: int
    causal: bool
    window: Optional[int]
    padding: Optional[torch.Tensor]
    device: torch.device

    @property
    def shape(self) -> Tuple[int, int, int, int]:
        return (self.batch, 1, self.q_length, self.kv_length)

    @property
    def ndim(self) -> int:
        return 4

    def to_tensor(self) -> torch.Tensor:
        """The boolean mask ``[batch, 1, q_length, kv_length]`` it describes."""
        rows = torch.arange(self.q_length, device=self.device)[:, None] + (self.kv_length - self.q_length)
        cols = torch.arange(self.kv_length, device=self.device)[None, :]
        visible = torch.ones(self.q_length, self.kv_length, dtype=torch.bool, device=self.device)
        if self.causal:
            visible &= cols <= rows
        if self.window is not None:
            visible &= cols > rows - self.window
        visible = visible[None, None].expand(self.batch, 1, self.q_length, self.kv_length)
        return visible & self.padding if self.padding is not None else visible

    def __getitem__(self, index: Any):
        kept = self._kept_rows(index)
        if kept is not None:
            return replace(self, q_length=kept)
        return self.to_tensor()[index]

    def _kept_rows(self, index: Any) -> Optional[int]:
        """The rows kept by an index that only slices the query axis and keeps a run of
        rows that the description still describes: the last rows (the prompt's end stays
        at the cache's end), or any rows when nothing is causal; else None."""
        if not isinstance(index, tuple) or len(index) != 4:
            return None
        full = slice(None)
        b, h, r, k = index
        if b != full or h != full or k != full or not isinstance(r, slice) or r.step not in (None, 1):
            return None
        start, stop, _ = r.indices(self.q_length)
        if stop <= start:
            return None
        if self.causal and stop != self.q_length:
            return None
        return stop - start


def _closure(fn: Callable) -> dict:
    cells = fn.__closure__ or ()
    return {name: cell.cell_contents for name, cell in zip(fn.__code__.co_freevars, cells)}


def _from_masking_utils(fn: Any, qualname: str) -> bool:
    return getattr(fn, "__module__", None) == hf_masks.__name__ and getattr(fn, "__qualname__", None) == qualname


def describe_mask_function(fn: Callable) -> Optional[Tuple[bool, Optional[int]]]:
    """``(causal, window)`` of a transformers mask pattern the kernel takes as a description,
    read from the pattern's own functions in ``transformers.masking_utils`` (the causal and
    bidirectional patterns, the sliding-window overlay and ``and_masks`` over them); None for
    anything else (overlays for images, packed sequences, chunks, patterns of a model's own),
    which then gets an explicit mask."""
    if fn is hf_masks.causal_mask_function:
        return True, None
    if fn is hf_masks.bidirectional_mask_function:
        return False, None
    if not _from_masking_utils(fn, "and_masks.<locals>.and_mask"):
        return None
    causal, window = False, None
    for part in _closure(fn).get("mask_functions", ()):
        if part is hf_masks.causal_mask_function:
            causal = True
        elif part is hf_masks.bidirectional_mask_function:
            pass
        elif _from_masking_utils(part, "sliding_window_overlay.<locals>.inner_mask"):
            w = _closure(part).get("sliding_window")
            if not isinstance(w, int) or isinstance(w, bool) or w < 1:
                return None
            window = w if window is None else min(window, w)
        else:
            return None
    if window is not None and not causal:
        return None  # a window on both sides is not the kernel's window
    return causal, window


def _padding_rows(attention_mask: Optional[torch.Tensor], batch: int, kv_length: int, kv_offset: int, device):
    """The padding of the cache rows ``kv_offset .. kv_offset + kv_length`` as bool ``[batch,
    1, 1, kv_length]`` (True = may attend), or None when there is no padding (read on the
    host, as transformers' SDPA mask does; kept as it is while tracing or capturing a CUDA
    graph, where reading it would break the graph)."""
    if attention_mask is None:
        return None
    rows = hf_masks.prepare_padding_mask(attention_mask, kv_length, kv_offset)[:, kv_offset : kv_offset + kv_length]
    rows = rows.to(device=device, dtype=torch.bool)
    if not is_tracing(rows) and bool(rows.all()):
        return None
    return rows[:, None, None, :].expand(batch, 1, 1, kv_length)


def prefill_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: int = 0,
    mask_function: Callable = hf_masks.causal_mask_function,
    attention_mask: Optional[torch.Tensor] = None,
    allow_is_causal_skip: bool = True,
    allow_is_bidirectional_skip: bool = False,
    use_vmap: bool = False,
    device: Any = "cpu",
    **_: Any,
):
    """The mask function registered with ``AttentionMaskInterface``: a :class:`PrefillMask`
    where the pattern is a description, else transformers' boolean ``[batch, 1, q_length,
    kv_length]`` mask.

    A description needs a pattern :func:`describe_mask_function` reads, its queries at the
    end of its cache (``q_offset + q_length == kv_offset + kv_length``, which dynamic caches
    keep; a static cache's tensor offset and its unwritten rows do not), and a caller that
    would take a mask that is not an array (``allow_is_causal_skip`` for causal patterns,
    ``allow_is_bidirectional_skip`` for bidirectional ones: those that refuse it read the
    mask's values)."""
    described = None if use_vmap else describe_mask_function(mask_function)
    if described is not None:
        causal, window = described
        at_end = isinstance(q_offset, int) and q_offset + q_length == kv_offset + kv_length
        may_skip = allow_is_causal_skip if causal else allow_is_bidirectional_skip
        if may_skip and (at_end or not causal):
            padding = _padding_rows(attention_mask, batch_size, kv_length, kv_offset, device)
            return PrefillMask(batch_size, q_length, kv_length, causal, window, padding, torch.device(device))
    return hf_masks.sdpa_mask(
        batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
        mask_function=mask_function, attention_mask=attention_mask, allow_is_causal_skip=False,
        allow_is_bidirectional_skip=False, use_vmap=use_vmap, device=device,
    )  # fmt: skip
