"""Int8 weight-only (W8A16) on the Llama-architecture families, CPU: the fused q/k/v and gate/up each quantized as one
int8 tensor (grouped-query rows sliced right), o_proj and down_proj on their own; the quantized model computes what
transformers' model holding the dequantized weights computes; greedy tokens of fast decode equal that model's;
WikiText-2 perplexity within 0.5% of fp; unpatch exact (keep_original='cpu') or refused; quantized checkpoints
(save_pretrained / load_quantized / from_pretrained) give the same logits, Qwen2's q/k/v biases included; SmoothQuant
refused with one clear line, leaving the model as it was."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import random_llama
from helpers import assert_same_state, state

import fuseinfer
from fuseinfer import FuseInferError, Int8WeightOnly, PatchConfig, SmoothQuantW8A8
from fuseinfer import models
from fuseinfer.layers.linear import Int8WeightOnlyLinear, QKVSlice


@pytest.fixture
def tiny(tiny_llama_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()


def _ids(model, rows=2, length=17, seed=0):
    return torch.randint(3, model.config.vocab_size, (rows, length), generator=torch.Generator().manual_seed(seed))


def _dequantized_twin(original, quantized):
    """A deep copy of the unpatched ``original`` whose decoder linears hold the quantized model's dequantized weights
    (the fused q/k/v and gate/up split back by rows)."""
    twin = copy.deepcopy(original)
    with torch.no_grad():
        for layer, qlayer in zip(twin.model.layers, quantized.model.layers):
            for mod, qmod, fused, parts in ((layer.self_attn, qlayer.self_attn, "qkv_proj", ("q_proj", "k_proj",
                                                                                            "v_proj")),
                                            (layer.mlp, qlayer.mlp, "gate_up_proj", ("gate_proj", "up_proj"))):
                w = qmod._modules[fused].dequantized_weight(torch.float32)
                start = 0
                for name in parts:
                    rows = getattr(mod, name).out_features
                    getattr(mod, name).weight.copy_(w[start:start + rows])
                    start += rows
                assert start == w.shape[0]
            layer.self_attn.o_proj.weight.copy_(qlayer.self_attn.o_proj.dequantized_weight(torch.float32))
            layer.mlp.down_proj.weight.copy_(qlayer.mlp.down_proj.dequantized_weight(torch.float32))
    return twin


@pytest.mark.parametrize("kind", ["tiny", "qwen2"])
def test_int8_weight_only_computes_the_dequantized_model(kind, tiny):
    model = tiny if kind == "tiny" else random_llama("qwen2", num_attention_heads=8, num_key_value_heads=2)
    original = copy.deepcopy(model)
    report = fuseinfer.patch(model, PatchConfig(quant=Int8WeightOnly()))
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads if kind == "qwen2" else cfg.head_dim
    names = [e.name.split(".", 3)[-1] for e in report.quant.entries]
    assert names == ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"] * \
        cfg.num_hidden_layers
    shapes = {e.name.split(".")[-1]: e.shape for e in report.quant.entries}
    assert shapes["qkv_proj"] == ((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d, cfg.hidden_size)
    assert shapes["gate_up_proj"] == (2 * cfg.intermediate_size, cfg.hidden_size)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, Int8WeightOnlyLinear) and isinstance(attn.k_proj, QKVSlice)
    assert (attn.k_proj.start, attn.v_proj.start) == (cfg.num_attention_heads * d,
                                                      (cfg.num_attention_heads + cfg.num_key_value_heads) * d)
    assert (attn.qkv_proj.bias is not None) == (kind == "qwen2")
    twin = _dequantized_twin(original, model)
    ids = _ids(model)
    with torch.no_grad():
        ours, ref = model(input_ids=ids).logits, twin(input_ids=ids).logits
        plain = original(input_ids=ids).logits
    torch.testing.assert_close(ours, ref, rtol=0, atol=2e-5)
    assert not torch.allclose(ours, plain, atol=1e-4)  # (the weights are quantized: the test can tell)
    # a slice computes its rows of the fused int8 linear (what a call of k_proj alone gives)
    x = torch.randn(3, cfg.hidden_size)
    torch.testing.assert_close(attn.k_proj(x), twin.model.layers[0].self_attn.k_proj(x), rtol=0, atol=2e-5)


def test_fast_decode_of_the_quantized_model_equals_the_dequantized_model(tiny):
    original = copy.deepcopy(tiny)
    fuseinfer.patch(tiny, PatchConfig(quant=Int8WeightOnly()))
    twin = _dequantized_twin(original, tiny)
    ids = _ids(tiny, rows=3, length=9, seed=2)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    with torch.no_grad():
        ref = twin.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                            pad_token_id=1)[:, ids.shape[1]:]
    ours = fuseinfer.generate(tiny, ids, mask, max_new_tokens=8, min_new_tokens=8, pad_token_id=1)
    assert torch.equal(ours[:, -8:], ref)


@pytest.mark.slow
def test_int8_weight_only_perplexity_within_half_a_percent(tiny, tiny_llama_path):
    from tests.models.llama.test_family import _perplexities

    fp, w8 = _perplexities(tiny, tiny_llama_path, windows=3, quant=Int8WeightOnly())
    print(f"llama-wt2-tiny WikiText-2 test PPL (3 windows of 512): fp32 {fp:.4f}, W8A16 {w8:.4f} "
          f"({100 * (w8 / fp - 1):+.3f}%)")
    assert w8 != fp and abs(w8 / fp - 1) < 0.005


def test_unpatch_restores_the_original_weights(tiny):
    before, classes = state(tiny), {n: type(m) for n, m in tiny.named_modules()}
    fuseinfer.patch(tiny, PatchConfig(quant=Int8WeightOnly(keep_original="cpu")))
    fuseinfer.unpatch(tiny)
    assert {n: type(m) for n, m in tiny.named_modules()} == classes
    assert_same_state(tiny, before)
    assert not any(k in vars(m) for m in tiny.modules() for k in ("qkv_weight", "gate_up_weight"))


def test_unpatch_without_kept_weights_is_refused(tiny):
    fuseinfer.patch(tiny, PatchConfig(quant=Int8WeightOnly()))
    with pytest.raises(FuseInferError, match="keep_original"):
        fuseinfer.unpatch(tiny)


@pytest.mark.parametrize("kind", ["tiny", "qwen2"])
def test_quantized_checkpoint_round_trip(kind, tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny if kind == "tiny" else random_llama("qwen2")
    fuseinfer.patch(model, PatchConfig(quant=Int8WeightOnly()))
    ids = _ids(model)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    model.save_pretrained(tmp_path)
    loaded = fuseinfer.load_quantized(tmp_path)
    reread = AutoModelForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, ref)
        assert torch.equal(reread(input_ids=ids).logits, ref)
    # the rotary tables (no checkpoint holds them) were recomputed, not left as allocated
    assert torch.equal(loaded.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)


def test_smoothquant_is_refused_with_one_clear_line(tiny):
    before = state(tiny)
    with pytest.raises(FuseInferError, match="Int8WeightOnly") as err:
        fuseinfer.patch(tiny, PatchConfig(quant=SmoothQuantW8A8()))
    assert "\n" not in str(err.value)
    assert_same_state(tiny, before)
    assert not hasattr(tiny, "_fuseinfer_state") and type(tiny.model.layers[0]).__name__ == "LlamaDecoderLayer"


def test_quant_targets_are_every_decoder_linear(tiny):
    targets = models.family("llama").quant_targets(tiny)
    per_layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj"]
    assert targets == [f"model.layers.{i}.{n}" for i in range(4) for n in per_layer]
