"""The ONNX export's two strategies (fuseinfer.export.graph: plain ONNX ops, onnxruntime contrib ops) run OPT's one
decoder layer (models/opt/layer.py) inside OPT's export graph (models/opt/export.py); run eagerly as PyTorch (the
contrib ops' reference forwards), both give transformers' OPT logits, prompt and decode steps over the past."""
from __future__ import annotations

import pytest
import torch

from conftest import VARIANTS, random_opt
from fuseinfer.export.graph import FLAVOURS, DecoderGraph
from fuseinfer.models import family

ATOL = 1e-5  # fp32, the same math in another order; relative to the logits' size when they are under 1 (a random
# model's are ~0.1, where 1e-5 would miss a wrong wiring)


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def _batch(vocab, length=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2, length), generator=g)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, :3] = 0  # left padding, as in batched generation
    return ids, mask


def _check(model, flavour, prompt_len=6):
    """The graph's logits over the whole batch (no past), then a prompt and one-token steps feeding the presents
    back as past, against one transformers forward; padded positions are not compared."""
    graph = DecoderGraph(model, flavour)
    spec = graph.spec
    ids, mask = _batch(spec.vocab)
    keep_all = torch.zeros(1, dtype=torch.long)
    empty = [torch.zeros(2, spec.heads, 0, spec.head_dim) for _ in range(2 * spec.layers)]
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits  # (2, L, V)
        logits, *presents = graph(ids, mask, keep_all, *empty)
        assert len(presents) == 2 * spec.layers
        assert all(p.shape == (2, spec.heads, ids.shape[1], spec.head_dim) for p in presents)
        valid = mask.bool()
        tol = ATOL * min(1.0, ref.abs().max().item())
        assert (logits - ref)[valid].abs().max() < tol
        got, past = [], empty
        for t in range(prompt_len, ids.shape[1] + 1):
            start = 0 if t == prompt_len else t - 1
            keep = torch.ones(1, dtype=torch.long)  # the last position's logits only
            step, *past = graph(ids[:, start:t], mask[:, :t], keep, *past)
            got.append(step)
    assert (torch.cat(got, dim=1) - ref[:, prompt_len - 1:]).abs().max() < tol


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_tiny_model_logits_match_transformers(tiny, flavour):
    _check(tiny, flavour)


@pytest.mark.parametrize("variant", ["post_ln_project_in_out", "no_final_ln", "ln_without_affine", "no_bias"])
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_layouts_match_transformers(variant, flavour):
    _check(random_opt(**VARIANTS[variant]), flavour, prompt_len=4)


def test_gelu_model_matches_transformers():
    """gelu models take the fused flavour's BiasGelu."""
    for flavour in FLAVOURS:
        _check(random_opt(activation_function="gelu"), flavour, prompt_len=4)


def test_the_family_describes_the_graph(tiny):
    fam = family("opt")
    spec = fam.export_spec(tiny)
    cfg = tiny.config
    assert (spec.layers, spec.heads, spec.head_dim, spec.hidden, spec.vocab) == (
        cfg.num_hidden_layers, cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads,
        cfg.hidden_size, cfg.vocab_size)
    assert DecoderGraph(tiny, "plain").spec == spec
    assert set(fam.ort_matmul_kinds()) == {"qkv", "out", "mlp_in", "mlp_out", "head"}


def test_a_model_without_lm_head_has_no_graph(tiny):
    with pytest.raises(NotImplementedError, match="causal LMs"):
        family("opt").export_spec(tiny.model)
