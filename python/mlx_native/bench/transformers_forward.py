"""``python -m mlx_native bench --transformers``: the forward of Gemma-shaped transformers
models (random weights, built from configs: nothing is downloaded) with transformers' eager
and SDPA attention and with mlx_native's (``integrations.transformers``), and the attention's
share of the forward.

- Models (:data:`MODELS`): the attention shapes of SPEC 4 and of Gemma 3 12B, each layer of
  the released model's width, ``--layers`` of them in the models' pattern (five sliding
  layers to one global; the last layer global). A small vocabulary and ``logits_to_keep=1``
  keep the embedding and the head out of the time (they do not depend on the attention).
- The forward: ``model(input_ids, use_cache=False, logits_to_keep=1)`` under
  ``torch.inference_mode()``, one prompt of ``rows`` tokens, no padding. The same model (one
  set of weights) runs every implementation in turn (``set_attn_implementation``), one
  forward each per round, after a warm-up forward each; the best of ``--repeats`` rounds is
  kept. On CUDA each forward is timed between two synchronisations.
- The attention's share: the same forward with the attention function replaced by one that
  returns zeros of the output's shape (and the described masks, so no mask is built either)
  is the rest of the model; an implementation's attention time is its forward less that.
"""

from __future__ import annotations

import copy
import platform
import time
from typing import Callable, Dict, List, Optional, Sequence

#: Implementations timed, in the order they run each round; ``none`` is the model without
#: its attention (zeros for the attention's output).
IMPLS = ("eager", "sdpa", "mlx_native", "none")
NO_ATTENTION = "mlx_native_bench_no_attention"
VOCAB = 4096


def _gemma3(transformers, layer_types: List[str]):
    # Gemma 3 12B's layer: hidden 3840, MLP 15360, 16 query and 8 KV heads of dim 256,
    # query_pre_attn_scalar 256, a window of 1024. (27B's heads are of dim 128.)
    return transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=3840, intermediate_size=15360, num_attention_heads=16, num_key_value_heads=8,
        head_dim=256, query_pre_attn_scalar=256, sliding_window=1024, layer_types=layer_types,
        num_hidden_layers=len(layer_types), max_position_embeddings=131072,
    )  # fmt: skip


def _gemma4(transformers, layer_types: List[str]):
    # Gemma 4 26B-A4B's attention (SPEC 4): 16 query heads; sliding layers with 8 KV heads of
    # dim 256 and a window of 1024; global layers with 2 KV heads of dim 512, K = V, scale 1.
    # Hidden 2816 with a dense MLP of 2816 x 4 stands in for its mixture of experts.
    return transformers.Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=2816, intermediate_size=11264, num_attention_heads=16, num_key_value_heads=8,
        head_dim=256, global_head_dim=512, num_global_key_value_heads=2, attention_k_eq_v=True, sliding_window=1024,
        layer_types=layer_types, num_hidden_layers=len(layer_types), hidden_size_per_layer_input=0,
        num_kv_shared_layers=0, enable_moe_block=False, max_position_embeddings=131072,
    )  # fmt: skip


MODELS: Dict[str, Callable] = {"gemma3": _gemma3, "gemma4": _gemma4}


def layer_pattern(layers: int) -> List[str]:
    """The Gemma pattern over ``layers`` layers: five sliding to one global, the last one
    global."""
    if layers < 1:
        raise ValueError(f"--layers must be at least 1, got {layers}")
    types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)]
    types[-1] = "full_attention"
    return types


def _register_no_attention(torch) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from ..integrations.transformers_masks import prefill_mask

    def no_attention(module, query, key, value, attention_mask, **_):
        b, h, s, d = query.shape
        return torch.zeros(b, s, h, value.shape[-1], dtype=query.dtype, device=query.device), None

    AttentionInterface.register(NO_ATTENTION, no_attention)
    AttentionMaskInterface.register(NO_ATTENTION, prefill_mask)


def _impl_name(impl: str, ours: str) -> str:
    return {"mlx_native": ours, "none": NO_ATTENTION}.get(impl, impl)


def run_transformers_bench(
    rows: Sequence[int] = (1024, 4096),
    models: Sequence[str] = ("gemma3", "gemma4"),
    layers: Optional[int] = None,
    device: Optional[str] = None,
    dtype: Optional[str] = None,
    repeats: int = 2,
    seed: int = 0,
    on_result: Optional[Callable[[dict], None]] = None,
) -> dict:
    """Time the forwards (see the module's doc); returns ``dict(machine=..., results=[...])``,
    one result per (model, rows, implementation), printing a table as it goes."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from ..integrations import transformers as mn_hf

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_cuda = dev.type == "cuda"
    dt = getattr(torch, dtype or ("bfloat16" if on_cuda else "float32"))
    layers = layers or (6 if on_cuda else 2)
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise ValueError(f"unknown models {unknown}: choose from {', '.join(MODELS)}")
    ours = mn_hf.register()
    _register_no_attention(torch)

    def sync():
        if on_cuda:
            torch.cuda.synchronize(dev)

    machine = dict(
        device=torch.cuda.get_device_name(dev) if on_cuda else (platform.processor() or platform.machine()),
        threads=torch.get_num_threads(), torch=torch.__version__, transformers=transformers.__version__,
        dtype=str(dt).replace("torch.", ""), layers=layers, layer_types=layer_pattern(layers),
    )  # fmt: skip
    print(f"transformers forward: {layers} layers ({', '.join(t.split('_')[0] for t in layer_pattern(layers))}), "
          f"{machine['dtype']}, on {machine['device']}; best of {repeats} rounds")  # fmt: skip
    print(f"{'model':8} {'rows':>6} {'impl':11} {'forward ms':>11} {'attention ms':>13} {'share':>6} {'ours x':>7} "
          f"{'attn x':>7}")  # fmt: skip
    results: List[dict] = []
    for name in models:
        torch.manual_seed(seed)
        cfg = MODELS[name](transformers, layer_pattern(layers))
        model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager", dtype=dt)
        model = model.to(dev).eval()
        for n in rows:
            ids = torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed)).to(dev)
            best = {impl: float("inf") for impl in IMPLS}

            def forward(impl):
                model.set_attn_implementation(_impl_name(impl, ours))
                sync()
                t = time.perf_counter()
                with torch.inference_mode():
                    model(ids, use_cache=False, logits_to_keep=1)
                sync()
                return time.perf_counter() - t

            for impl in IMPLS:
                forward(impl)  # warm-up: kernels compiled, allocator warm
            for _ in range(repeats):
                for impl in IMPLS:
                    best[impl] = min(best[impl], forward(impl))
            rest = best["none"]
            for impl in IMPLS[:-1]:
                attn = max(best[impl] - rest, 0.0)
                ours_attn = max(best["mlx_native"] - rest, 0.0)
                r = dict(model=name, rows=n, impl=impl, forward_s=best[impl], attention_s=attn,
                         share=attn / best[impl], rest_s=rest, ours_x=best[impl] / best["mlx_native"],
                         ours_x_attention=(attn / ours_attn) if ours_attn > 0 else None)  # fmt: skip
                results.append(r)
                ax = r["ours_x_attention"]
                print(f"{name:8} {n:6d} {impl:11} {1e3 * r['forward_s']:11.1f} {1e3 * attn:13.1f} "
                      f"{100 * r['share']:5.1f}% {r['ours_x']:7.2f} {'-' if ax is None else f'{ax:.2f}':>7}")  # fmt: skip
                if on_result is not None:
                    on_result(dict(machine=machine, results=results))
            print(f"{name:8} {n:6d} {'(no attn)':11} {1e3 * rest:11.1f}")
        del model
    return dict(machine=machine, results=results)
