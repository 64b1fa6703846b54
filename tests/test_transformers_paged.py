"""mlx_native as the attention of transformers' continuous batching
(``mlx_native.integrations.transformers_paged``): a tiny random-weight Llama model in
bfloat16 generating greedily with ``generate_batch`` (transformers' ``PagedAttentionCache``,
pages of 16 rows, prompts spanning pages), ours (K/V read in place through a block table)
against transformers' own sdpa continuous batching (K/V gathered by ``index_select``):
the same tokens, and log-probabilities within 0.03. Why 0.03: the model and its cache are
bfloat16 in both runs, so each layer's attention output is rounded to bfloat16 (8 bits)
after summing in a different order; the log-probabilities (magnitudes 2 to 8 here) carry
those roundings, and 0.03 is one bfloat16 ulp at 4 (observed: under 0.004). What the path
cannot run is refused by name."""

from __future__ import annotations

import pytest

import mlx_native as mn
from helpers import import_test_extra

torch = import_test_extra("torch")
transformers = import_test_extra("transformers")
from transformers import AutoModelForCausalLM, GenerationConfig  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402

from mlx_native.integrations import transformers_paged as mn_paged  # noqa: E402

PAGE = 16
PROMPTS = [[1, 2, 3, 4, 5], list(range(6, 36)), list(range(40, 57))]  # 5, 30 (two pages), 17 rows


def llama(dtype=torch.bfloat16, **kw):
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=256, **kw,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype).eval()


def cb_config():
    return ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=64, page_size=PAGE, return_logprobs=True)


GREEDY = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=-1, pad_token_id=0)


def test_paged_generate_batch_matches_sdpa(monkeypatch):
    model = llama()
    theirs = model.generate_batch(PROMPTS, generation_config=GREEDY, continuous_batching_config=cb_config())
    tables = []
    real = mn_paged._block_table

    def spy(*args):
        out = real(*args)
        tables.append(out)
        return out

    monkeypatch.setattr(mn_paged, "_block_table", spy)
    ours = mn_paged.generate_batch(model, PROMPTS, generation_config=GREEDY, continuous_batching_config=cb_config())
    assert list(ours) == list(theirs)
    for rid in theirs:
        assert ours[rid].generated_tokens == theirs[rid].generated_tokens, rid
        assert len(ours[rid].generated_tokens) == GREEDY.max_new_tokens
        diff = max(abs(a - b) for a, b in zip(ours[rid].logprobs, theirs[rid].logprobs))
        assert diff <= 0.03, (rid, diff)
    # The cache was read through block tables (decode steps), with sequences over two pages.
    assert tables, "no forward read the cache through a block table"
    assert max(int(t.shape[1]) for t, _ in tables) >= 2
    assert model.config._attn_implementation == "sdpa"  # restored


def test_attention_function_outside_generate_batch_is_refused():
    model = llama()
    name = mn_paged.register()
    model.set_attn_implementation(name)
    with pytest.raises(mn.UnsupportedFeatureError, match="generate_batch"):
        model(torch.tensor([[1, 2, 3]]))


def test_float32_model_is_refused():
    with pytest.raises(mn.UnsupportedFeatureError, match="bfloat16 or float16"):
        mn_paged.generate_batch(llama(torch.float32), PROMPTS, generation_config=GREEDY)


def test_sliding_window_is_refused():
    with pytest.raises(mn.UnsupportedFeatureError, match="sliding"):
        mn_paged.generate_batch(llama(sliding_window=8), PROMPTS, generation_config=GREEDY)


def test_non_cpu_device_is_refused():
    model = llama().to("meta")
    with pytest.raises(mn.UnsupportedFeatureError, match="CPU"):
        mn_paged.generate_batch(model, PROMPTS, generation_config=GREEDY)


def test_plain_transformers_refuses_the_name():
    # transformers' continuous batching accepts only "paged|eager", "sdpa" or flash names:
    # the reason generate_batch builds its manager under "sdpa".
    model = llama()
    model.set_attn_implementation(mn_paged.register())
    with pytest.raises(ValueError, match="not supported for continuous batching"):
        model.generate_batch(PROMPTS, generation_config=GREEDY)
