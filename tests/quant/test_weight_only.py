"""Int8WeightOnly (W8A16) on CPU, reference path: what is quantized, numerics against an independent fake-quant
model, the report, unpatch (bit for bit when kept, refused otherwise) and the bad-input messages."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fuseinfer
from fuseinfer import FuseInferError, Int8WeightOnly, PatchConfig
from fuseinfer.layers.linear import Int8WeightOnlyLinear, QKVSlice
from helpers import state
from tests.conftest import VARIANTS, random_opt

QUANT = PatchConfig(quant=Int8WeightOnly())


def fake_quant(weight: torch.Tensor) -> torch.Tensor:
    """The scheme written out independently: per-row scale max|w| / 127, round half to even, clamp, dequantize."""
    w = weight.detach().double()
    scale = (w.abs().amax(1, keepdim=True) / 127).float().double()  # (the scale is stored in fp32)
    scale = scale.clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(weight.detach().float() / scale.float()).clamp(-127, 127)
    return (q.float() * scale.float()).to(weight.dtype)


def fake_quant_model(model, include_lm_head=False):
    """A copy of the unpatched model whose decoder linears (and LM head) hold their fake-quantized weights. The
    fused q/k/v gets one scale per row of the (3E, E) weight, which equals per-row scales of q, k and v."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, m in ref.named_modules():
            if isinstance(m, nn.Linear) and ".layers." in f".{name}":
                m.weight.copy_(fake_quant(m.weight))
        if include_lm_head:
            ref.lm_head.weight = nn.Parameter(fake_quant(ref.lm_head.weight))
    return ref


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_quantized_logits_match_an_independent_fake_quant_model(variant):
    model = random_opt(**VARIANTS[variant])
    ids = torch.randint(0, 512, (2, 11))
    expected = fake_quant_model(model)(ids).logits
    full = model(ids).logits
    report = fuseinfer.patch(model, QUANT)
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (got - full).abs().max() > 0  # (the weights really changed)
    layers = model.config.num_hidden_layers
    assert len(report.quant.entries) == 4 * layers  # qkv_proj, out_proj, fc1, fc2 per layer
    assert report.quant.bytes_saved > 0


def test_every_decoder_linear_is_int8_and_the_fp_weights_are_gone():
    model = random_opt(dtype=torch.float16)
    fp16_bytes = sum(m.weight.numel() * 2 for n, m in model.named_modules() if isinstance(m, nn.Linear)
                     and ".layers." in n)
    report = fuseinfer.patch(model, QUANT)
    attn = model.model.decoder.layers[0].self_attn
    assert isinstance(attn.qkv_proj, Int8WeightOnlyLinear) and attn.qkv_proj.qweight.shape == (192, 64)
    assert attn.qkv_proj.qweight.dtype == torch.int8 and attn.qkv_proj.scale.dtype == torch.float32
    assert all(isinstance(getattr(attn, n), QKVSlice) for n in ("q_proj", "k_proj", "v_proj"))
    assert attn.qkv_weight is None  # the fp16 (3E, E) buffer is freed
    for layer in model.model.decoder.layers:
        for lin in (layer.fc1, layer.fc2, layer.self_attn.out_proj):
            assert isinstance(lin, Int8WeightOnlyLinear)
    assert type(model.lm_head) is nn.Linear  # off by default
    int8_bytes = sum(e.bytes_after for e in report.quant.entries)
    assert report.quant.bytes_saved == fp16_bytes - int8_bytes
    assert "quantized 8 weight(s) (int8_weight_only)" in str(report)
    assert not any(t.dtype == torch.float16 and t.dim() == 2 and ".layers." in n
                   for n, t in model.state_dict().items() if "layer_norm" not in n)


def test_unpatch_restores_bit_for_bit_when_originals_are_kept():
    model = random_opt(dtype=torch.float16)
    before = state(model)
    q_weight = model.model.decoder.layers[0].self_attn.q_proj.weight
    fc1_weight = model.model.decoder.layers[1].fc1.weight
    fuseinfer.patch(model, PatchConfig(quant=Int8WeightOnly(keep_original="cpu", include_lm_head=True)))
    fuseinfer.unpatch(model)
    after = state(model)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert model.model.decoder.layers[1].fc1.weight is fc1_weight  # the same Parameter objects
    assert model.model.decoder.layers[0].self_attn.q_proj.weight is q_weight
    assert model.lm_head.weight is model.model.decoder.embed_tokens.weight  # still tied
    assert not any(type(m).__module__.startswith("fuseinfer.") for m in model.modules())
    fuseinfer.patch(model, QUANT)  # and it can be patched again


def test_unpatch_without_kept_originals_refuses_and_leaves_the_model_quantized():
    model = random_opt()
    ids = torch.randint(0, 512, (1, 7))
    fuseinfer.patch(model, QUANT)
    logits = model(ids).logits
    with pytest.raises(FuseInferError, match="keep_original=None.*reload the model.*keep_original='cpu'"):
        fuseinfer.unpatch(model)
    assert fuseinfer.patch_state(model) is not None
    torch.testing.assert_close(model(ids).logits, logits, rtol=0, atol=0)


def test_lm_head_option_quantizes_the_tied_head_and_reports_the_added_copy():
    model = random_opt()
    ids = torch.randint(0, 512, (1, 9))
    expected = fake_quant_model(model, include_lm_head=True)(ids).logits
    report = fuseinfer.patch(model, PatchConfig(quant=Int8WeightOnly(include_lm_head=True)))
    assert isinstance(model.lm_head, Int8WeightOnlyLinear)
    head = next(e for e in report.quant.entries if e.name == "lm_head")
    assert head.bytes_before == 0 and head.bytes_after == 512 * 64 + 4 * 512  # tied: an int8 copy is added
    torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_unfused_qkv_is_quantized_per_projection_and_filter_fn_limits_the_layers():
    model = random_opt()
    report = fuseinfer.patch(model, PatchConfig(ops=("linear", "layer_norm", "attention"),
                                                filter_fn=lambda m, name: "layers.1" not in name))
    fuseinfer.unpatch(model)
    report = fuseinfer.patch(model, PatchConfig(ops=("linear", "layer_norm", "attention"), quant=Int8WeightOnly(),
                                                filter_fn=lambda m, name: "layers.1" not in name))
    names = {e.name for e in report.quant.entries}
    assert names == {f"model.decoder.layers.0.{n}" for n in ("fc1", "fc2", "self_attn.q_proj", "self_attn.k_proj",
                                                             "self_attn.v_proj", "self_attn.out_proj")}
    assert type(model.model.decoder.layers[1].fc1) is nn.Linear


def test_one_kernel_decode_step_takes_an_int8_model_and_generate_runs_on_cpu():
    from types import SimpleNamespace

    model = random_opt()
    fuseinfer.patch(model, QUANT)
    family = fuseinfer.patch_state(model).family
    step, why = family.decode_step_kernel(model, SimpleNamespace(key_mask=torch.ones(1, 16, dtype=torch.bool)))
    assert step is None and why.startswith("no kernel")  # the int8 step takes the model; this CPU has no kernel
    ids = torch.randint(0, 512, (2, 6))
    out = fuseinfer.generate(model, ids, max_new_tokens=4)
    greedy = ids
    with torch.no_grad():
        for _ in range(4):
            greedy = torch.cat([greedy, model(greedy).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(out, greedy)
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), greedy)


def test_training_mode_and_gradients_run_through_the_int8_modules():
    model = random_opt()
    fuseinfer.patch(model, QUANT)
    ids = torch.randint(0, 512, (1, 8))
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert model.model.decoder.layers[0].fc1.bias.grad is not None
    model.eval()
    torch.testing.assert_close(model.half().float()(ids).logits, model(ids).logits)  # scales stay fp32


def test_bad_input_one_clear_message_each_model_untouched():
    model = random_opt()
    before = state(model)
    classes = [type(m) for m in model.modules()]
    with pytest.raises(FuseInferError, match="filter_fn left no decoder linear"):
        fuseinfer.patch(model, PatchConfig(quant=Int8WeightOnly(), filter_fn=lambda m, n: False))
    with pytest.raises(FuseInferError, match="quant must be a quantization config"):
        PatchConfig(quant="int8")
    with pytest.raises(FuseInferError, match="keep_original must be None"):
        Int8WeightOnly(keep_original="gpu")
    with pytest.raises(FuseInferError, match="dtype torch.float64"):
        fuseinfer.patch(model.double(), QUANT)
    model.float()
    assert [type(m) for m in model.modules()] == classes
    assert fuseinfer.patch_state(model) is None
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    fuseinfer.patch(model, QUANT)
    with pytest.raises(FuseInferError, match="already patched and quantized \\(int8_weight_only\\)"):
        fuseinfer.patch(model, QUANT)


def test_include_lm_head_without_a_head_is_refused():
    from transformers import OPTConfig, OPTModel

    model = OPTModel(OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, ffn_dim=64, num_attention_heads=2,
                               word_embed_proj_dim=32)).eval()
    with pytest.raises(FuseInferError, match="include_lm_head=True but this model's LM head is missing"):
        fuseinfer.patch(model, PatchConfig(quant=Int8WeightOnly(include_lm_head=True)))
    assert fuseinfer.patch_state(model) is None and not any(
        type(m).__module__.startswith("fuseinfer.") for m in model.modules())


def test_pickled_config_keeps_the_quant_scheme():
    import pickle

    cfg = pickle.loads(pickle.dumps(PatchConfig(quant=Int8WeightOnly(include_lm_head=True))))
    assert cfg.quant == Int8WeightOnly(include_lm_head=True)
