"""``python -m mlx_native bench --transformers``: the forward of Gemma- and Llama-shaped
transformers models (random weights, built from configs: nothing is downloaded) with
transformers' eager and SDPA attention and with mlx_native's (``integrations.transformers``), and the share of
each forward spent in the attention.

- Models (:data:`MODELS`): the attention shapes of SPEC 4, of Gemma 3 12B and of Llama 3 8B
  (``llama``: every layer global, d128 32/8), each layer of the released model's width, ``--layers`` of them in the models' pattern (five sliding
  layers to one global; the last layer global). A small vocabulary and ``logits_to_keep=1``
  keep the embedding and the head out of the time (they do not depend on the attention).
- The forward: ``model(input_ids, use_cache=False, logits_to_keep=1)`` under
  ``torch.inference_mode()``, one prompt of ``rows`` tokens, no padding. The same model (one
  set of weights) runs every implementation in turn (``set_attn_implementation``), one
  forward each per round, after a warm-up forward each; the best of ``--repeats`` rounds is
  kept. On CUDA each forward is timed between two synchronisations.
- The attention: each implementation runs under a name of its own whose attention function
  and mask function are the implementation's, timed (on CUDA between synchronisations):
  ``attention`` is their sum over the forward (the layers' attention and the masks made for
  them, e.g. eager's ``[rows, rows]`` float masks), measured directly rather than as the
  difference of two forwards, so that a load on a shared machine falls on it only as much
  as on the rest; ``share`` is its part of the forward.
"""

from __future__ import annotations

import copy
import platform
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

#: Implementations timed, in the order they run each round.
IMPLS = ("eager", "sdpa", "mlx_native")
VOCAB = 4096
_TIMED = "mlx_native_bench_timed_"


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


def _llama(transformers, layer_types: List[str]):
    # Llama 3 8B's layer: hidden 4096, MLP 14336, 32 query and 8 KV heads of dim 128, every
    # layer global and causal (the pattern's layer types are not used: only their count).
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, num_hidden_layers=len(layer_types), max_position_embeddings=131072,
    )  # fmt: skip


MODELS: Dict[str, Callable] = {"gemma3": _gemma3, "gemma4": _gemma4, "llama": _llama}


def layer_pattern(layers: int) -> List[str]:
    """The Gemma pattern over ``layers`` layers: five sliding to one global, the last one
    global."""
    if layers < 1:
        raise ValueError(f"--layers must be at least 1, got {layers}")
    types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)]
    types[-1] = "full_attention"
    return types


class AttentionClock:
    """Seconds spent in the attention and mask functions since the last :meth:`reset`."""

    def __init__(self, sync: Callable[[], None]):
        self.seconds = 0.0
        self._sync = sync

    def reset(self) -> None:
        self.seconds = 0.0

    def timed(self, fn: Callable) -> Callable:
        def run(*args, **kwargs):
            self._sync()
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync()
                self.seconds += time.perf_counter() - t

        return run


def _register_timed(model, impl: str, ours: str, clock: AttentionClock) -> str:
    """Register ``impl``'s attention and mask functions, timed by ``clock``, under a name of
    their own, and return it. Eager's attention function is the model's own (transformers
    takes it from the model's module when the name is ``eager``)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    key = ours if impl == "mlx_native" else impl
    if key == "eager":
        attention = sys.modules[type(model).__module__].eager_attention_forward
    else:
        attention = AttentionInterface._global_mapping[key]
    mask = AttentionMaskInterface._global_mapping[key]
    name = _TIMED + impl
    AttentionInterface.register(name, clock.timed(attention))
    AttentionMaskInterface.register(name, clock.timed(mask))
    return name


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

    def sync():
        if on_cuda:
            torch.cuda.synchronize(dev)

    clock = AttentionClock(sync)
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
        with dev:  # the weights made (and initialised) on the device itself
            model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager", dtype=dt)
        model = model.to(dev).eval()
        names = {impl: _register_timed(model, impl, ours, clock) for impl in IMPLS}
        for n in rows:
            ids = torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed)).to(dev)
            best = {impl: (float("inf"), float("inf")) for impl in IMPLS}

            def forward(impl):
                model.set_attn_implementation(names[impl])
                clock.reset()
                sync()
                t = time.perf_counter()
                with torch.inference_mode():
                    model(ids, use_cache=False, logits_to_keep=1)
                sync()
                return time.perf_counter() - t, clock.seconds

            for impl in IMPLS:
                forward(impl)  # warm-up: kernels compiled, allocator warm
            for _ in range(repeats):
                for impl in IMPLS:
                    total, attn = forward(impl)
                    best[impl] = (min(best[impl][0], total), min(best[impl][1], attn))
            ours_total, ours_attn = best["mlx_native"]
            for impl in IMPLS:
                total, attn = best[impl]
                r = dict(model=name, rows=n, impl=impl, forward_s=total, attention_s=attn, share=attn / total,
                         ours_x=total / ours_total, ours_x_attention=attn / ours_attn)  # fmt: skip
                results.append(r)
                print(f"{name:8} {n:6d} {impl:11} {1e3 * total:11.1f} {1e3 * attn:13.1f} {100 * r['share']:5.1f}% "
                      f"{r['ours_x']:7.2f} {r['ours_x_attention']:7.2f}")  # fmt: skip
                if on_result is not None:
                    on_result(dict(machine=machine, results=results))
        del model
    return dict(machine=machine, results=results)
