"""The Llama-architecture decoder layer written once (fuseinfer/models/llama/layer.py ``decoder_layer``): the PyTorch
reference strategy gives transformers' own layers and logits (Llama on the tiny trained model; random Llama, Mistral
and Qwen2 with q/k/v biases; grouped-query 4/2 and 8/2 heads, multi-head 4/4), with left padding; the patched modules
run ``decoder_layer``, which is defined once."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from conftest import random_llama

import fuseinfer
from fuseinfer.models.llama.layer import TorchOps, decoder_layer

PACKAGE = Path(fuseinfer.__file__).parent
ATOL = 1e-5


@pytest.fixture(scope="module")
def tiny(tiny_llama_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()


def _models(tiny):
    yield "tiny", tiny
    for model_type, heads, kv in (("llama", 4, 2), ("llama", 8, 2), ("llama", 4, 4), ("mistral", 8, 2),
                                  ("qwen2", 4, 2)):
        yield f"{model_type}-{heads}/{kv}", random_llama(model_type, num_attention_heads=heads,
                                                         num_key_value_heads=kv)


def _ids(model, rows=2, length=19):
    return torch.randint(3, model.config.vocab_size, (rows, length), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def _reference_logits(model, ids, mask=None):
    """The whole model through ``decoder_layer`` over TorchOps: fp32 logits (B, S, V)."""
    base = model.model
    b, s = ids.shape
    h = base.embed_tokens(ids)
    if mask is None:
        positions, bias = torch.arange(s).expand(b, s), None
    else:
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        allowed = torch.ones(s, s, dtype=torch.bool).tril() & mask.bool()[:, None, None, :]  # (B, 1, S, S)
        bias = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    cos, sin = base.rotary_emb(h, positions)
    for i, layer in enumerate(base.layers):
        h = decoder_layer(TorchOps(), i, layer, h, (cos, sin, bias))
    return model.lm_head(base.norm(h)).float()


@torch.no_grad()
def test_torch_ops_strategy_gives_transformers_logits(tiny):
    for name, model in _models(tiny):
        ids = _ids(model)
        ref = model(input_ids=ids).logits.float()
        torch.testing.assert_close(_reference_logits(model, ids), ref, rtol=0, atol=ATOL, msg=name)


@torch.no_grad()
def test_torch_ops_strategy_with_left_padding(tiny):
    for name, model in _models(tiny):
        ids = _ids(model)
        mask = torch.ones_like(ids)
        mask[0, :6] = 0
        ref = model(input_ids=ids, attention_mask=mask).logits.float()
        ours = _reference_logits(model, ids, mask)
        torch.testing.assert_close(ours[0, 6:], ref[0, 6:], rtol=0, atol=ATOL, msg=name)
        torch.testing.assert_close(ours[1], ref[1], rtol=0, atol=ATOL, msg=name)


@torch.no_grad()
def test_one_layer_equals_transformers_layer(tiny):
    """One layer on its own (not only through the stack, where an error could cancel): transformers' layer call."""
    model = random_llama("qwen2", num_attention_heads=8, num_key_value_heads=2)
    layer = model.model.layers[1]
    h = torch.randn(2, 11, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(11).expand(2, 11)
    rotary = model.model.rotary_emb(h, positions)
    ref = layer(h, attention_mask=None, position_embeddings=rotary, position_ids=positions)
    ours = decoder_layer(TorchOps(), 1, layer, h, (*rotary, None))
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)
    # and it can fail: another layer's weights give another output
    assert not torch.allclose(decoder_layer(TorchOps(), 0, model.model.layers[0], h, (*rotary, None)), ref,
                              atol=1e-3)


def test_decoder_layer_is_written_once_and_the_modules_run_it():
    defs, calls = [], set()
    for path in sorted((PACKAGE / "models" / "llama").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == "decoder_layer":
                defs.append(path.name)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "decoder_layer":
                calls.add(path.name)
    assert defs == ["layer.py"]
    assert "modules.py" in calls
