"""The FP8 decoder layer's fused LayerNorm + e4m3 quantize: the pre-LN Float8 layer runs ``add_layer_norm_quant_fp8``
for self_attn_layer_norm and final_layer_norm (op counts from torch.profiler on CPU: 2 per layer, 2 separate e4m3
quantize passes left, for out_proj's and fc2's inputs, instead of 4) and gives the unfused path's logits (LayerNorm,
then quantize_fp8_per_token: bit for bit on CPU, where both are the references) and, within the FP8 tolerance, the
fp32 model's."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import VARIANTS, random_opt
from helpers import fuseinfer_op_counts, modules_forward

import fuseinfer
from fuseinfer import Float8, PatchConfig
from fuseinfer.models.opt.modules import FusedOPTDecoderLayer

FP8_VARIANTS = ["pre_ln", "no_bias", "ln_without_affine", "odd_hidden96_3heads"]


def _fp8(variant="pre_ln"):
    base = random_opt(**VARIANTS[variant]).eval()
    model = copy.deepcopy(base)
    fuseinfer.patch(model, PatchConfig(quant=Float8()))
    return base, model


def _ids(vocab, rows=2, length=24):
    return torch.randint(3, vocab, (rows, length), generator=torch.Generator().manual_seed(0))


def _unfuse(monkeypatch):
    """Switch the layer back to the unfused LayerNorm -> quantize_fp8_per_token path."""
    monkeypatch.setattr(FusedOPTDecoderLayer, "_int8_qkv", lambda self, h: None)
    monkeypatch.setattr(FusedOPTDecoderLayer, "_int8_fc1", lambda self: None)


def test_pre_ln_fp8_layer_runs_add_layer_norm_quant_fp8(monkeypatch):
    _, model = _fp8()
    ids = _ids(model.config.vocab_size)
    layers = model.config.num_hidden_layers
    fused = fuseinfer_op_counts(lambda: modules_forward(model, input_ids=ids))
    # per layer: 2 fused LN + e4m3 quantize, 4 FP8 GEMMs, 2 quantize (attention output -> out_proj, fc1 output ->
    # fc2); the decoder's final LayerNorm is the one fp16 LayerNorm left
    assert fused["fuseinfer::add_layer_norm_quant_fp8"] == 2 * layers
    assert fused["fuseinfer::fp8_linear"] == 4 * layers
    assert fused["fuseinfer::quantize_fp8_per_token"] == 2 * layers
    assert fused["fuseinfer::add_layer_norm"] == 1
    assert fused["fuseinfer::add_layer_norm_quant"] == 0
    got = modules_forward(model, input_ids=ids).logits
    _unfuse(monkeypatch)
    plain = fuseinfer_op_counts(lambda: modules_forward(model, input_ids=ids))
    assert plain["fuseinfer::add_layer_norm_quant_fp8"] == 0
    assert plain["fuseinfer::add_layer_norm"] == 2 * layers + 1
    assert plain["fuseinfer::quantize_fp8_per_token"] == 4 * layers
    # CPU: add_layer_norm_quant_fp8_ref is add_layer_norm_ref then quantize_fp8_ref, exactly the unfused path
    assert torch.equal(got, modules_forward(model, input_ids=ids).logits)


@pytest.mark.parametrize("variant", FP8_VARIANTS)
def test_fused_fp8_variants_match_unfused_and_fp32(variant, monkeypatch):
    base, model = _fp8(variant)
    ids = _ids(model.config.vocab_size)
    got = modules_forward(model, input_ids=ids).logits
    with torch.no_grad():
        ref = base(input_ids=ids).logits
    # e4m3 activations and weights: a few percent of the logits' spread
    assert (got - ref).abs().max() <= 0.1 * ref.abs().max()
    _unfuse(monkeypatch)
    assert torch.equal(got, modules_forward(model, input_ids=ids).logits)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_fp8_layer_on_cuda_matches_unfused(dtype, monkeypatch):
    """On the GPU at prefill: the fused kernel's e4m3 activations are the per-token quantize of the same y (bit for
    bit where both LayerNorm kernels give the same y), so the logits match the unfused path closely."""
    _, model = _fp8()
    model = model.to("cuda", dtype)
    ids = _ids(model.config.vocab_size, rows=2, length=64).cuda()
    fused = modules_forward(model, input_ids=ids).logits.float()
    _unfuse(monkeypatch)
    plain = modules_forward(model, input_ids=ids).logits.float()
    assert (fused - plain).abs().max() <= 0.02 * plain.abs().max()
