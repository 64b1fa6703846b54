"""transformers with mlx_native's attention where users already are (issue 28): a model in
eval mode called without ``torch.no_grad()`` runs (a backward is refused when called);
``torch.compile(model, fullgraph=True)`` traces it in one graph (``torch._dynamo.explain``:
0 graph breaks); a head dim no kernel can take is refused when the implementation is set.
Outputs are compared with the same model on transformers' SDPA attention (float32): the
kernels read K/V in float16 and ``half(scale * q)``, so the bar is what that rounding
explains (measured: about 2e-4 on logits of size 0.6)."""

from __future__ import annotations

import pytest

import mlx_native as mn
from helpers import import_test_extra

torch = import_test_extra("torch")
transformers = import_test_extra("transformers")
from mlx_native.integrations import transformers as mn_hf  # noqa: E402

#: Logits' largest difference from SDPA's allowed (float16 K/V and Q against float32).
BAR = 2e-3


def _llama(head_dim=32, **kw):
    return transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, **kw)  # fmt: skip


def _pair(cfg):
    """The same random weights on SDPA and on mlx_native."""
    torch.manual_seed(0)
    sdpa = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    ours = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    ours.load_state_dict(sdpa.state_dict())
    mn_hf.set_attention(ours)
    assert ours.config._attn_implementation == "mlx_native"
    return sdpa, ours


def _ids():
    return torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("head_dim", [32, 64])
def test_forward_outside_no_grad_matches_sdpa(head_dim):
    sdpa, ours = _pair(_llama(head_dim))
    ids = _ids()
    ref, out = sdpa(ids).logits, ours(ids).logits  # grad mode on, weights require grad
    assert out.requires_grad
    assert (out - ref).abs().max().item() < BAR


def test_a_backward_is_refused_when_called():
    _, ours = _pair(_llama())
    logits = ours(_ids()).logits
    with pytest.raises(mn.UnsupportedFeatureError, match="backward pass"):
        logits.sum().backward()
    assert all(p.grad is None for p in ours.model.layers[0].self_attn.parameters())


def test_fullgraph_compile_has_no_graph_break_and_matches_sdpa():
    sdpa, ours = _pair(_llama())
    ids = _ids()
    torch._dynamo.reset()
    explain = torch._dynamo.explain(ours)(ids)
    assert explain.graph_break_count == 0, [str(b.reason) for b in explain.break_reasons]
    assert explain.graph_count == 1
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    out = compiled(ids).logits  # under grad mode, as a user calls it
    with torch.no_grad():
        ref = sdpa(ids).logits
        eager = ours(ids).logits
    assert (out - ref).abs().max().item() < BAR
    assert torch.allclose(out, eager, atol=1e-6, rtol=0)


def test_no_native_call_on_the_traced_path(monkeypatch):
    # The forward's checks are plain Python: a native call there would break the graph.
    from mlx_native.integrations import transformers as integration

    assert not hasattr(integration, "check_head_dims")
    assert integration._head_dim_refusal(32, 32) is None  # padded to 64
    assert integration._head_dim_refusal(1024, 1024) is not None


@pytest.mark.parametrize("head_dim", [1024, 640])
def test_a_head_dim_without_a_kernel_is_refused_when_set(head_dim):
    cfg = _llama(head_dim)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    with pytest.raises(mn.UnsupportedFeatureError, match=f"head dim {head_dim}"):
        mn_hf.set_attention(model)
    assert model.config._attn_implementation == "sdpa", "a refused model keeps its attention"
    with pytest.raises(mn.UnsupportedFeatureError, match=f"head dim {head_dim}"):
        mn_hf.register(config=cfg)
