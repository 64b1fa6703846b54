"""mlx_native as a Hugging Face transformers attention backend
(``mlx_native.integrations.transformers``), on tiny random-weight Gemma 3, Gemma 4 and
Gemma 3n models built from configs: logits and greedy ``generate`` against transformers'
eager attention, batch 1 and a left-padded batch 2; the masks described to the kernel (no
``[seq, kv]`` array) where the pattern allows and explicit otherwise; the features the
kernels lack refused by name. torch and transformers are test extras: without them this
module fails, not skips. The CUDA tests need a GPU (the lead runs them on an H200)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

import mlx_native as mn
from helpers import import_test_extra

torch = import_test_extra("torch")
transformers = import_test_extra("transformers")
from transformers import AttentionInterface, AutoModelForCausalLM  # noqa: E402
from transformers import masking_utils as hf_masks  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

from mlx_native.reference import reference_prefill  # noqa: E402
from mlx_native.integrations import transformers as mn_hf  # noqa: E402
from mlx_native.integrations.transformers_masks import PrefillMask, describe_mask_function, prefill_mask  # noqa: E402

NAME = mn_hf.register()
HAS_CUDA = "cuda" in mn.backends() and torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU, its driver and a CUDA build of torch")
VOCAB, SEQ, WINDOW = 128, 40, 8  # the window is a fifth of the sequence: it hides most of each row

# ------------------------------------------------------------------ the reference: f16 inputs, float64 math
# Our kernel reads half(scale * q), half(k) and half(v) (SPEC 2). The reference attention
# below does exactly that rounding and nothing else (float64 softmax and products), so the
# distance from eager to it is what float16 inputs alone explain, in this very model.


def _f16_input_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **_):
    s = query.shape[-1] ** -0.5 if scaling is None else scaling
    q = (query * s).half().double()
    k, v = key.half().double(), value.half().double()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if attention_mask is not None:
        scores = scores + attention_mask[..., : k.shape[-2]].double()
    out = torch.softmax(scores, dim=-1) @ v
    return out.transpose(1, 2).contiguous().to(query.dtype), None


REFERENCE = "mlx_native_test_f16_inputs"
AttentionInterface.register(REFERENCE, _f16_input_attention)
AttentionMaskInterface.register(REFERENCE, hf_masks.eager_mask)

# ------------------------------------------------------------------ tiny models


def gemma3_config(**kw):
    return transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=256, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=256, **kw,
    )  # fmt: skip


def gemma4_config(**kw):
    # Sliding layers at head dim 256, global ones at 512 with one KV head and K = V
    # (Gemma 4 26B's pattern), the per-layer inputs, and the last two layers reusing the
    # KV of the first two (which makes the model slice its masks' query axis in generate).
    return transformers.Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=256, global_head_dim=512, num_global_key_value_heads=1, attention_k_eq_v=True,
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
        vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16, max_position_embeddings=256, **kw,
    )  # fmt: skip


def gemma3n_config(**kw):
    return transformers.Gemma3nTextConfig(
        vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=64, hidden_size_per_layer_input=16,
        intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=256,
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
        laurel_rank=8, activation_sparsity_pattern=[0.0] * 4, max_position_embeddings=256, **kw,
    )  # fmt: skip


CONFIGS = {"gemma3": gemma3_config, "gemma4": gemma4_config, "gemma3n": gemma3n_config}


def models(config, impls=("eager", REFERENCE, NAME)):
    """One model per attention implementation, with the same random weights (each from its
    own copy of the config: from_config writes the implementation into it)."""
    torch.manual_seed(0)
    out = {}
    for impl in impls:
        m = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl).eval()
        if out:
            m.load_state_dict(next(iter(out.values())).state_dict())
        out[impl] = m
    return out


@pytest.fixture(scope="module")
def built():
    return {name: models(make()) for name, make in CONFIGS.items()}


def inputs(batch: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (batch, SEQ), generator=g)
    mask = torch.ones(batch, SEQ, dtype=torch.long)
    if batch > 1:
        mask[1, :7] = 0  # left padding
        ids[1, :7] = 0
    return ids, mask


def rel(a, b, keep):
    d = (a - b)[keep]
    return float(d.norm() / b[keep].norm())


class Spy:
    """Records what transformers hands our attention function."""

    def __init__(self, monkeypatch):
        self.calls = []
        inner = mn_hf.attention_forward

        def spy(module, query, key, value, attention_mask, **kw):
            self.calls.append((tuple(query.shape), tuple(key.shape), attention_mask))
            return inner(module, query, key, value, attention_mask, **kw)

        monkeypatch.setitem(AttentionInterface._global_mapping, NAME, spy)


# ------------------------------------------------------------------ logits and generate


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("model", list(CONFIGS))
def test_logits_are_eagers_within_what_float16_inputs_explain(built, model, batch):
    """float32 models. Bounds, relative (Frobenius) over the logits of real tokens:

    - ours against the f16-input reference <= 2e-3: what the kernel adds beyond rounding
      its inputs (P rounded to half, the order of its sums) is a few half roundoffs (u =
      2^-11 = 4.9e-4) per layer, measured 2e-4 (Gemma 3) to 7e-4 (Gemma 4);
    - ours against eager <= 1.5 x (reference against eager) + 1e-4: the inputs' rounding
      explains what is left. It is 4e-4 on Gemma 3 (scale 1/16 keeps the scores small),
      about 5e-3 on Gemma 4 and 2e-3 on Gemma 3n, whose scale 1 over normalised q and k
      gives scores of tens, where half's relative rounding of q and k becomes an absolute
      error of 1e-2 in the scores;
    - on Gemma 3, ours against eager < 1e-3 as well (about 5e-4 expected)."""
    ms = built[model]
    ids, mask = inputs(batch)
    keep = mask.bool()
    with torch.no_grad():
        logits = {k: m(ids, attention_mask=mask if batch > 1 else None).logits for k, m in ms.items()}
    ours, eager, ref = logits[NAME], logits["eager"], logits[REFERENCE]
    assert ours.dtype == torch.float32 and ours.shape == (batch, SEQ, VOCAB)
    explained = rel(ref, eager, keep)
    assert rel(ours, ref, keep) <= 2e-3
    assert rel(ours, eager, keep) <= 1.5 * explained + 1e-4, (rel(ours, eager, keep), explained)
    if model == "gemma3":
        assert rel(ours, eager, keep) < 1e-3


@pytest.mark.parametrize("model", list(CONFIGS))
def test_greedy_generate_matches_eager(built, model):
    ms = built[model]
    ids, mask = inputs(2)
    with torch.no_grad():
        want = ms["eager"].generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        got = ms[NAME].generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert got.shape == (2, SEQ + 4) and torch.equal(got, want)


def test_generate_with_a_static_cache_matches_eager(built):
    """A static cache: the queries are not at the end of its rows (those after them are
    unwritten) and its offset is a tensor, so the masks are explicit."""
    ms = built["gemma3"]
    ids, mask = inputs(2)
    kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        assert torch.equal(ms[NAME].generate(ids, **kw), ms["eager"].generate(ids, **kw))


# ------------------------------------------------------------------ described and explicit masks


@pytest.mark.parametrize("batch", [1, 2])
def test_masks_are_described_and_no_seq_by_kv_mask_is_made(built, monkeypatch, batch):
    spy = Spy(monkeypatch)
    monkeypatch.setattr(hf_masks, "sdpa_mask", lambda **kw: pytest.fail("an explicit [seq, kv] mask was built"))
    ids, mask = inputs(batch)
    with torch.no_grad():
        built["gemma4"][NAME](ids, attention_mask=mask if batch > 1 else None)
    assert len(spy.calls) == 4
    dims = set()
    for q_shape, k_shape, m in spy.calls:
        assert isinstance(m, PrefillMask) and m.causal and m.shape == (batch, 1, SEQ, SEQ)
        dims.add(q_shape[-1])
        assert m.window == (WINDOW if q_shape[-1] == 256 else None)
        if batch == 1:
            assert m.padding is None
        else:
            assert m.padding.shape == (2, 1, 1, SEQ) and m.padding[1, 0, 0, :7].sum() == 0 and m.padding[0].all()
    assert dims == {256, 512}  # Gemma 4's sliding and global layers both ran here


def test_decode_steps_describe_the_sliding_cache(built, monkeypatch):
    """generate's decode steps: one query at the end of a cache; the sliding layers' cache
    holds the window's last rows only (its offset), the global layers' all of them."""
    spy = Spy(monkeypatch)
    ids, mask = inputs(2)
    with torch.no_grad():
        built["gemma3"][NAME].generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    decode = [(q, k, m) for q, k, m in spy.calls if q[2] == 1]
    assert decode and all(isinstance(m, PrefillMask) and m.q_length == 1 for _, _, m in decode)
    assert {m.kv_length for _, _, m in decode if m.window} == {WINDOW}
    assert {m.kv_length for _, _, m in decode if not m.window} == {SEQ + 1, SEQ + 2}


def test_a_pattern_the_kernel_cannot_describe_gets_an_explicit_mask(monkeypatch):
    """Gemma 3 with bidirectional attention adds an overlay (an or_mask_function): no
    description, transformers' boolean mask instead, and the same logits as eager."""
    ms = models(gemma3_config(use_bidirectional_attention=True))
    spy = Spy(monkeypatch)
    ids, mask = inputs(2)
    keep = mask.bool()
    with torch.no_grad():
        logits = {k: m(ids, attention_mask=mask).logits for k, m in ms.items()}
    assert spy.calls and all(isinstance(m, torch.Tensor) and m.dtype == torch.bool for _, _, m in spy.calls)
    assert rel(logits[NAME], logits[REFERENCE], keep) <= 2e-3
    assert rel(logits[NAME], logits["eager"], keep) <= 1.5 * rel(logits[REFERENCE], logits["eager"], keep) + 1e-4


def test_a_callers_additive_4d_mask_is_used(built):
    """A 4-D float mask passed to the model goes through as it is (transformers returns it
    untouched): here a causal mask in finfo.min, the same as no mask."""
    ms = built["gemma3"]
    ids, _ = inputs(1)
    causal = torch.full((SEQ, SEQ), torch.finfo(torch.float32).min).triu(1)[None, None]
    sliding_and_full = {"full_attention": causal, "sliding_attention": causal.clone()}
    sliding_and_full["sliding_attention"][0, 0] += torch.full((SEQ, SEQ), torch.finfo(torch.float32).min).tril(-WINDOW)
    with torch.no_grad():
        want = ms[NAME](ids).logits
        got = ms[NAME](ids, attention_mask=sliding_and_full).logits
    assert torch.allclose(got, want, rtol=0, atol=1e-5)


# ------------------------------------------------------------------ the mask function itself


def _sdpa(**kw):
    return hf_masks.sdpa_mask(allow_is_causal_skip=False, **kw)


@pytest.mark.parametrize(
    "q_length, kv_length, q_offset, kv_offset, window",
    # fresh prompts, decode steps of a full and a sliding cache, a chunk after a cache
    [(12, 12, 0, 0, None), (12, 12, 0, 0, 5), (1, 13, 12, 0, None), (1, 8, 12, 5, 8), (4, 11, 9, 2, 8),
     (6, 20, 14, 0, None)],
)
def test_a_described_mask_is_transformers_mask(q_length, kv_length, q_offset, kv_offset, window):
    fn = hf_masks.causal_mask_function if window is None else hf_masks.sliding_window_causal_mask_function(window)
    padding = torch.ones(2, q_offset + q_length, dtype=torch.bool)
    padding[1, :3] = False
    for pad in (None, padding):
        kw = dict(batch_size=2, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
                  mask_function=fn, attention_mask=pad)  # fmt: skip
        m = prefill_mask(**kw, local_size=window)
        padded = pad is not None and not pad[:, kv_offset : kv_offset + kv_length].all()  # in the cache's rows
        assert isinstance(m, PrefillMask) and m.window == window and (m.padding is not None) == padded
        want = _sdpa(**kw)
        assert torch.equal(m.to_tensor(), want)
        # The query axis sliced as Gemma 4 does: the last rows stay a description.
        last = m[:, :, -1:, :]
        assert isinstance(last, PrefillMask) and torch.equal(last.to_tensor(), want[:, :, -1:, :])
        first = m[:, :, :1, :]  # not the last rows (unless there is one): made explicit
        assert isinstance(first, PrefillMask) == (q_length == 1)
        assert torch.equal(first.to_tensor() if q_length == 1 else first, want[:, :, :1, :])


def test_only_the_patterns_the_kernel_computes_are_described():
    assert describe_mask_function(hf_masks.causal_mask_function) == (True, None)
    assert describe_mask_function(hf_masks.bidirectional_mask_function) == (False, None)
    assert describe_mask_function(hf_masks.sliding_window_causal_mask_function(7)) == (True, 7)
    undescribed = [
        hf_masks.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long)),
        hf_masks.sliding_window_bidirectional_mask_function(3),
        hf_masks.or_masks(hf_masks.causal_mask_function, hf_masks.bidirectional_mask_function),
        hf_masks.and_masks(hf_masks.causal_mask_function, lambda b, h, q, kv: kv >= 0),
        hf_masks.and_masks(hf_masks.sliding_window_overlay(3)),  # a window on both sides
        lambda b, h, q, kv: kv <= q,
    ]
    assert all(describe_mask_function(f) is None for f in undescribed)


def test_a_static_cache_and_a_caller_that_reads_the_mask_get_arrays():
    kw = dict(batch_size=1, q_length=4, kv_length=16, kv_offset=0, mask_function=hf_masks.causal_mask_function)
    static = prefill_mask(q_offset=torch.tensor(0), **kw)  # the queries are the first rows
    assert isinstance(static, torch.Tensor) and torch.equal(static, _sdpa(q_offset=0, **kw))
    reads = prefill_mask(q_offset=12, allow_is_causal_skip=False, **kw)  # e.g. an indexer reads the values
    assert isinstance(reads, torch.Tensor) and torch.equal(reads, _sdpa(q_offset=12, **kw))


# ------------------------------------------------------------------ refusals


def test_dropout_in_training_is_refused():
    m = models(gemma3_config(attention_dropout=0.1), impls=(NAME,))[NAME].train()
    ids, _ = inputs(1)
    with torch.no_grad(), pytest.raises(mn.UnsupportedFeatureError, match="dropout"):
        m(ids)
    m.eval()
    with torch.no_grad():
        m(ids)  # dropout is 0 in eval


def test_a_forward_under_grad_mode_runs_and_a_backward_is_refused(built):
    ids, _ = inputs(1)
    logits = built["gemma3"][NAME](ids).logits  # grad enabled, weights that require grad
    with torch.no_grad():
        assert torch.equal(logits.detach(), built["gemma3"][NAME](ids).logits)
    with pytest.raises(NotImplementedError, match="backward"):
        logits.sum().backward()


def test_a_head_dim_below_the_kernels_runs_padded():
    # Issue 28: head dim 24 has no kernel of its own; the front door runs it on 32, zero-padded.
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=24)  # fmt: skip
    ms = models(cfg, impls=(NAME, REFERENCE))
    with torch.no_grad():
        ids = inputs(1)[0]
        ours, ref = ms[NAME](ids).logits, ms[REFERENCE](ids).logits
    assert (ours - ref).abs().max() < 1e-4


def test_a_head_dim_without_any_kernel_is_refused_when_set():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=1024)  # fmt: skip
    with pytest.raises(mn.UnsupportedFeatureError, match="head dim 1024") as e:
        mn_hf.register(config=cfg)
    assert isinstance(e.value, NotImplementedError) and "256" in str(e.value)  # it names the dims it takes


def test_gemma2s_softcap_is_computed():
    cfg = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=256, sliding_window=WINDOW,
                                    attn_logit_softcapping=50.0)  # fmt: skip
    ms = models(cfg)
    ids, mask = inputs(2)
    with torch.no_grad():
        logits = {k: m(ids, attention_mask=mask).logits for k, m in ms.items()}
    keep = mask.bool()
    assert rel(logits[NAME], logits[REFERENCE], keep) <= 2e-3
    assert rel(logits[NAME], logits["eager"], keep) <= 1.5 * rel(logits[REFERENCE], logits["eager"], keep) + 1e-4


def _layer_inputs(heads=4, kv_heads=2, dim=256, seq=6):
    module = torch.nn.Module()
    module.is_causal = True
    q = torch.randn(1, heads, seq, dim)
    k = torch.randn(1, kv_heads, seq, dim)
    return module, q, k, k.clone()


def test_what_the_kernels_do_not_take_is_refused_at_the_attention_function():
    module, q, k, v = _layer_inputs()
    with torch.no_grad():
        with pytest.raises(mn.UnsupportedFeatureError, match="a mask per head"):
            mn_hf.attention_forward(module, q, k, v, torch.zeros(1, 4, 6, 6))
        with pytest.raises(mn.UnsupportedFeatureError, match="position bias"):
            mn_hf.attention_forward(module, q, k, v, None, position_bias=torch.zeros(1, 4, 6, 6))
        # Head dims below the largest kernel's run zero-padded (issue 28); beyond it, refused.
        wide = [x.new_zeros(x.shape[:-1] + (600,)) for x in (q, k, v)]
        with pytest.raises(mn.UnsupportedFeatureError, match=r"head dim 600 \(values 600\)"):
            mn_hf.attention_forward(module, *wide, None)
        with pytest.raises(mn.UnsupportedFeatureError, match="batch 1 against keys of batch 2"):
            mn_hf.attention_forward(module, q, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1), None)


def test_sinks_s_aux_are_computed():
    """gpt-oss's sinks (``s_aux``, one per head) join each row's softmax (SPEC 10)."""
    module, q, k, v = _layer_inputs()
    s_aux = torch.tensor([0.0, 1.5, -2.0, 4.0])
    with torch.no_grad():
        out, _ = mn_hf.attention_forward(module, q, k, v, None, scaling=0.1, s_aux=s_aux)
        plain, _ = mn_hf.attention_forward(module, q, k, v, None, scaling=0.1)
    f16 = lambda x: x[0].transpose(0, 1).to(torch.float16).numpy()  # noqa: E731
    want, _ = reference_prefill(q[0].transpose(0, 1).numpy(), f16(k), f16(v), causal=True, scale=0.1,
                                sinks=s_aux.numpy())  # fmt: skip
    got = out[0].double().numpy()
    assert np.abs(got - want).max() <= 2e-3 * np.abs(want).max()
    assert not torch.allclose(out, plain, atol=1e-3)  # the sinks changed it


def test_the_attention_function_returns_sdpas_layout():
    """[batch, seq, heads, head_dim] in q's dtype, and no weights, as transformers' SDPA
    function returns; with no mask, causal as the module says (and as SDPA reads it)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module, q, k, v = _layer_inputs()
    module.num_key_value_groups = 2
    with torch.no_grad():
        for causal in (True, False):
            module.is_causal = causal
            out, weights = mn_hf.attention_forward(module, q, k, v, None, scaling=0.1)
            want, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.1)
            assert weights is None and out.shape == want.shape == (1, 6, 4, 256) and out.dtype == q.dtype
            assert torch.allclose(out, want, rtol=0, atol=2e-3)


def test_a_bfloat16_models_kv_reach_the_cpu_kernels_uncast():
    """On the CPU a bfloat16 model's K/V go to the kernels as they are (the CPU multiplies
    BF16 K/V exactly, SPEC 9; on AMX that is the BF16 item the kernel benchmark times): the
    output is the front door's on the bfloat16 K/V, and on the FMA kernels bit-identical to
    the float16 cast's (a bfloat16 value within float16's range is exact in it). Elsewhere
    (CUDA; here a meta tensor) they are still cast to float16."""
    from helpers import cpu_fma_kernels

    module, q, k, v = _layer_inputs(heads=8, kv_heads=2, dim=128, seq=70)
    v = torch.randn_like(v)
    q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    module.num_key_value_groups = 4
    given = []
    as_it_is = mn_hf._kv
    mn_hf._kv = lambda x: given.append(as_it_is(x)) or given[-1]
    try:
        with torch.no_grad():
            out, _ = mn_hf.attention_forward(module, q, k, v, None, scaling=0.1)
    finally:
        mn_hf._kv = as_it_is
    assert [x.dtype for x in given] == [torch.bfloat16, torch.bfloat16]
    assert given[0].data_ptr() == k.data_ptr() and given[1].data_ptr() == v.data_ptr()  # no copy
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    with torch.no_grad():
        assert torch.equal(out, mn.flash_attn_prefill(t(q), t(k), t(v), causal=True, scale=0.1))
        with cpu_fma_kernels():
            out, _ = mn_hf.attention_forward(module, q, k, v, None, scaling=0.1)
            cast = mn.flash_attn_prefill(t(q), t(k.half()), t(v.half()), causal=True, scale=0.1)
        assert out.dtype == torch.bfloat16 and torch.equal(out, cast)
    meta = torch.empty(1, 2, 4, 128, dtype=torch.bfloat16, device="meta")
    assert mn_hf._kv(meta).dtype == torch.float16
    assert mn_hf._kv(torch.zeros(2, dtype=torch.float32)).dtype == torch.float16  # a float32 model's: cast


def test_register_names_the_implementation():
    assert mn_hf.register("mlx_native_other") == "mlx_native_other"
    assert AttentionInterface._global_mapping["mlx_native_other"] is mn_hf.attention_forward
    assert AttentionMaskInterface._global_mapping["mlx_native_other"] is mn_hf.prefill_mask
    assert mn.integrations.transformers is mn_hf
    with pytest.raises(TypeError):
        mn_hf.register("")


# ------------------------------------------------------------------ CUDA (GPU only)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model", ["gemma3", "gemma4"])
def test_cuda_forward_matches_eager(model, dtype):
    ms = {k: m.to("cuda", dtype) for k, m in models(CONFIGS[model](), impls=("eager", "sdpa", REFERENCE, NAME)).items()}
    ids, mask = (x.cuda() for x in inputs(2))
    keep = mask.bool()
    with torch.no_grad():
        logits = {k: m(ids, attention_mask=mask).logits.float() for k, m in ms.items()}
        got = ms[NAME].generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert logits[NAME].is_cuda and got.is_cuda
    if dtype == torch.float32:
        assert rel(logits[NAME], logits[REFERENCE], keep) <= 2e-3
        assert rel(logits[NAME], logits["eager"], keep) <= 1.5 * rel(logits[REFERENCE], logits["eager"], keep) + 2e-3
        want = ms["eager"].generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        assert torch.equal(got, want)
    else:
        # A bfloat16 model's own rounding between layers dominates (Gemma 4's scores of tens
        # amplify it: 0.034 from the float16-input reference on the H200): ours is as far
        # from eager as PyTorch's SDPA, a bfloat16 flash kernel, is.
        sdpa = rel(logits["sdpa"], logits["eager"], keep)
        assert rel(logits[NAME], logits["eager"], keep) <= 1.5 * sdpa + 2e-3, sdpa


def test_numpy_inputs_are_unaffected():
    # The integration changes nothing for the array call's other users.
    q = np.ones((4, 2, 256), np.float32)
    k = np.ones((4, 1, 256), np.float16)
    assert isinstance(mn.flash_attn_prefill(q, k, k, causal=True), np.ndarray)
