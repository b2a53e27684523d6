"""The W8A8 decoder layer's fused LayerNorm + quantize and W8A8 models through the lean prefill loop.

* the pre-LN W8A8 layer runs ``add_layer_norm_quant`` for self_attn_layer_norm and final_layer_norm (op counts
  from torch.profiler on CPU: 2 per layer, no fp16 LayerNorm, 2 separate quantize passes instead of 4) and gives
  the unfused path's logits (LayerNorm, then quantize_per_token: bit for bit on CPU, where both are the references)
  and the reference path's (``smoothquant_reference``) within the W8A8 tolerance;
* W8A8 models take the lean loop (``fuseinfer.prefill``, fast decode's prefill): the same ops in the same order as
  the patched modules, so the same logits and cache contents bit for bit on CPU; generate gives the same tokens
  through the lean loop and through the modules (FUSEINFER_PREFILL=module); a linear swapped after patch sends it
  back to the modules; int8 weight-only models keep their modules.
"""
from __future__ import annotations

import collections
import copy

import pytest
import torch
from conftest import VARIANTS, random_opt
from helpers import (assert_lean_equals_modules, assert_prefill_op_counts, assert_same_tokens_graph_lean_modules,
                     assert_same_tokens_lean_and_modules, fuseinfer_op_counts, modules_forward)

import fuseinfer
from fuseinfer import PatchConfig, SmoothQuantW8A8
from fuseinfer.models.opt import lean
from fuseinfer.models.opt.modules import FusedOPTDecoderLayer
from fuseinfer.quant import smoothquant as sq
from fuseinfer.runtime import prefill as pf

W8A8_VARIANTS = ["pre_ln", "post_ln_project_in_out", "no_bias", "ln_without_affine", "odd_hidden96_3heads"]


def _stats(model):
    """Calibration statistics on seeded random ids (the model's function does not matter here)."""
    ids = torch.randint(3, model.config.vocab_size, (1, 256), generator=torch.Generator().manual_seed(3))
    return sq.calibrate(model, ids=ids, samples=2, seq_len=128)


def _w8a8(variant="pre_ln", out_proj_input="dynamic", fc2_input="dynamic", **kw):
    base = random_opt(**VARIANTS[variant], **kw).eval()
    model = copy.deepcopy(base)
    fuseinfer.patch(model, PatchConfig(quant=SmoothQuantW8A8(calibration=_stats(base), out_proj_input=out_proj_input,
                                                             fc2_input=fc2_input)))
    return base, model


def _ids(vocab, rows=2, length=24):
    return torch.randint(3, vocab, (rows, length), generator=torch.Generator().manual_seed(0))



@pytest.fixture
def unfused(monkeypatch):
    """Within the fixture's scope, switch the W8A8 layer back to the unfused LayerNorm -> quantize_per_token path
    (what it ran before add_layer_norm_quant was wired in)."""
    def off():
        monkeypatch.setattr(FusedOPTDecoderLayer, "_int8_qkv", lambda self, h: None)
        monkeypatch.setattr(FusedOPTDecoderLayer, "_int8_fc1", lambda self: None)
    return off


def test_pre_ln_layer_runs_add_layer_norm_quant(unfused):
    _, model = _w8a8()
    ids = _ids(model.config.vocab_size)
    layers = model.config.num_hidden_layers
    fused = fuseinfer_op_counts(lambda: modules_forward(model, input_ids=ids))
    # per layer: 2 fused LN+quant, 4 W8A8 GEMMs, 2 quantize (attention output -> out_proj, fc1 output -> fc2);
    # the decoder's final LayerNorm is the one fp16 LayerNorm left
    assert fused["fuseinfer::add_layer_norm_quant"] == 2 * layers
    assert fused["fuseinfer::w8a8_linear"] == 4 * layers
    assert fused["fuseinfer::quantize_int8"] == 2 * layers
    assert fused["fuseinfer::add_layer_norm"] == 1
    got = modules_forward(model, input_ids=ids).logits
    unfused()
    plain = fuseinfer_op_counts(lambda: modules_forward(model, input_ids=ids))
    assert plain["fuseinfer::add_layer_norm_quant"] == 0
    assert plain["fuseinfer::add_layer_norm"] == 2 * layers + 1
    assert plain["fuseinfer::quantize_int8"] == 4 * layers
    before = modules_forward(model, input_ids=ids).logits
    # CPU: add_layer_norm_quant_ref is add_layer_norm_ref then quantize_int8_ref, exactly the unfused path
    assert torch.equal(got, before)


@pytest.mark.parametrize("variant", ["pre_ln", "post_ln_project_in_out", "ln_without_affine"])
def test_fused_path_within_w8a8_tolerance_of_the_reference_path(variant):
    """Against smoothquant_reference (nn.LayerNorm, each W8A8Linear quantizing its own input) on the same stats:
    the tolerance test_w8a8_patch uses for the patched model (2% of the logits' range, argmax agreeing)."""
    base = random_opt(**VARIANTS[variant]).eval()
    stats = _stats(base)
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    fuseinfer.patch(model, PatchConfig(quant=SmoothQuantW8A8(calibration=stats)))
    sq.smoothquant_reference(ref, stats, alpha=0.5)
    ids = _ids(base.config.vocab_size)
    with torch.no_grad():
        got, expected = model(input_ids=ids).logits, ref(input_ids=ids).logits
    assert (got - expected).abs().max().item() <= 0.02 * expected.abs().max().item()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.97


def test_post_ln_layer_keeps_the_fp16_layernorm():
    """Post-LN (opt-350m): the LayerNorm output is the residual stream, so it is formed and quantized apart."""
    _, model = _w8a8("post_ln_project_in_out")
    counts = fuseinfer_op_counts(lambda: modules_forward(model, input_ids=_ids(model.config.vocab_size)))
    assert counts["fuseinfer::add_layer_norm_quant"] == 0
    assert counts["fuseinfer::quantize_int8"] == 4 * model.config.num_hidden_layers


# ---- W8A8 through the lean prefill loop ----


@pytest.mark.parametrize("variant", W8A8_VARIANTS)
def test_lean_loop_takes_w8a8_models_and_equals_the_patched_modules(variant):
    _, model = _w8a8(variant)
    assert_lean_equals_modules(model, _ids(model.config.vocab_size), "fuseinfer::w8a8_linear")


@pytest.mark.parametrize("variant", W8A8_VARIANTS)
def test_static_out_proj_input_lean_loop_equals_the_modules(variant):
    """SmoothQuantW8A8(out_proj_input="static"): out_proj holds a calibrated (1,) fp32 input_scale (amax / 127 of
    its smoothed input); the lean loop and the modules both run the attention as attention_int8out (its output in
    int8 with that scale) and out_proj on it: the same logits and caches."""
    _, model = _w8a8(variant, out_proj_input="static")
    layer = model.model.decoder.layers[0]
    scale = layer.self_attn.out_proj.input_scale
    assert scale.shape == (1,) and scale.dtype == torch.float32 and scale > 0 and layer.fc2.input_scale is None
    assert_lean_equals_modules(model, _ids(model.config.vocab_size), "fuseinfer::attention_int8out", per_layer=1)


def test_static_out_proj_input_leaves_one_quantize_pass_per_layer():
    """Pre-LN with out_proj_input="static": per layer one quantize_int8 (fc2's input) instead of two, the attention
    as attention_int8out, every GEMM the W8A8 one."""
    _, model = _w8a8(out_proj_input="static")
    assert_prefill_op_counts(model, _ids(model.config.vocab_size), {
        "quantize_int8": 1, "attention_int8out": 1, "attention": 0, "w8a8_linear": 4, "add_layer_norm_quant": 2
    })


def test_static_out_proj_input_equals_the_emulated_layer():
    """out_proj's scale is amax / 127 of its calibrated input divided by the smoothing factors, and out_proj on the
    int8 attention output equals its own call on the fp32 attention output (which quantizes with the scale)."""
    from helpers import assert_out_proj_takes_8bit_attention

    base = random_opt().eval()
    stats = _stats(base)
    model = copy.deepcopy(base)
    report = fuseinfer.patch(model, PatchConfig(quant=SmoothQuantW8A8(calibration=stats, out_proj_input="static")))
    out_proj = model.model.decoder.layers[0].self_attn.out_proj
    name = "model.decoder.layers.0.self_attn.out_proj"
    amax = (stats.act_max[name] / report.quant.smoothing.factors[name]).max()
    torch.testing.assert_close(out_proj.input_scale, (amax / 127).reshape(1), rtol=1e-6, atol=0)
    assert_out_proj_takes_8bit_attention(model, out_proj, "int8")


@pytest.mark.parametrize("variant", W8A8_VARIANTS)
def test_static_fc2_input_lean_loop_equals_the_modules(variant):
    """SmoothQuantW8A8(fc2_input="static"): fc2 holds a calibrated (1,) fp32 input_scale; the lean loop and the
    modules both run fc1 as w8a8_linear_int8out (int8 out with that scale, ReLU first) and fc2 on it: the same
    logits and caches."""
    _, model = _w8a8(variant, fc2_input="static")
    layer = model.model.decoder.layers[0]
    scale = layer.fc2.input_scale
    assert scale.shape == (1,) and scale.dtype == torch.float32 and scale > 0
    assert layer.fc1.input_scale is None and layer.self_attn.out_proj.input_scale is None
    assert_lean_equals_modules(model, _ids(model.config.vocab_size), "fuseinfer::w8a8_linear_int8out", per_layer=1)


def test_static_inputs_leave_no_quantize_pass():
    """Pre-LN with both inputs static: no per-token quantize at all, the attention as attention_int8out, fc1 as
    w8a8_linear_int8out, q/k/v, out_proj and fc2 as w8a8_linear, the LayerNorms quantizing."""
    _, model = _w8a8(out_proj_input="static", fc2_input="static")
    assert_prefill_op_counts(model, _ids(model.config.vocab_size), {
        "quantize_int8": 0, "attention_int8out": 1, "attention": 0, "w8a8_linear_int8out": 1, "w8a8_linear": 3,
        "add_layer_norm_quant": 2
    })


def test_static_fc2_input_equals_the_emulated_layer():
    """fc2's scale is amax / 127 of its calibrated input divided by the smoothing factors folded into fc1 (when
    smoothed), and fc1's int8 output is the static quantization of relu(fc1) with that scale; fc2 on it equals its
    own call on the fp32 activation (which quantizes with the static scale)."""
    from fuseinfer.ops.linear_8bit_out import w8a8_linear_int8out_ref
    from fuseinfer.ops.quant import quantize_int8_ref, quantize_int8_static

    base = random_opt().eval()
    stats = _stats(base)
    model = copy.deepcopy(base)
    report = fuseinfer.patch(model, PatchConfig(quant=SmoothQuantW8A8(calibration=stats, fc2_input="static")))
    layer = model.model.decoder.layers[0]
    name = "model.decoder.layers.0.fc2"
    factors = report.quant.smoothing.factors.get(name)
    amax = (stats.act_max[name] / (1 if factors is None else factors)).max()
    torch.testing.assert_close(layer.fc2.input_scale, (amax / 127).reshape(1), rtol=1e-6, atol=0)
    x = torch.randn(7, model.config.hidden_size)
    xq, xs = quantize_int8_ref(x, -1)
    fc1, fc2 = layer.fc1, layer.fc2
    y = w8a8_linear_int8out_ref(xq, xs, fc1.weight_q, fc1.weight_scale, fc1.bias, fc2.input_scale, "relu")
    h = torch.relu(fc1.forward_quantized(xq, xs, None, "none", torch.float32))
    assert torch.equal(y, quantize_int8_static(h, fc2.input_scale))
    out = fc2.fused(h)
    ref = fc2.forward_quantized(y, fc2.static_scales(y), None, "none", torch.float32)
    assert torch.equal(out, ref)


def test_fuseinfer_prefill_of_a_w8a8_model_equals_its_forward():
    _, model = _w8a8()
    ids = _ids(model.config.vocab_size)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits[:, -1]
    torch.testing.assert_close(fuseinfer.prefill(model, ids, mask), ref, rtol=1e-5, atol=1e-5)


def test_generate_same_tokens_through_lean_and_module_prefill():
    _, model = _w8a8()
    assert_same_tokens_lean_and_modules(model, _ids(model.config.vocab_size, rows=1, length=20))


def test_swapped_linear_or_int8_lm_head_keeps_the_modules():
    _, model = _w8a8()
    assert pf.lean_reason(model) is None
    fc1 = model.model.decoder.layers[0].fc1
    model.model.decoder.layers[0].fc1 = copy.deepcopy(fc1)  # a module put in after patch: not the plan's
    assert "int8 linear was replaced" in pf.lean_reason(model)
    model.model.decoder.layers[0].fc1 = fc1
    assert pf.lean_reason(model) is None
    w16 = random_opt().eval()  # (int8 weight-only models take the lean loop: tests/quant/test_w8a16_prefill.py)
    fuseinfer.patch(w16, PatchConfig(quant=fuseinfer.Int8WeightOnly(include_lm_head=True)))
    assert "LM head" in pf.lean_reason(w16)


# ---- GPU: the kernels (add_layer_norm_quant, quantize_int8_rows, the sm90 W8A8 GEMM) in the lean loop / graph ----

def _gpu_w8a8(dtype, static=()):
    base = random_opt(hidden_size=256, num_attention_heads=4, ffn_dim=1024, num_hidden_layers=3,
                      max_position_embeddings=512)
    stats = _stats(base)
    model = base.to("cuda", dtype)
    fuseinfer.patch(model, PatchConfig(quant=SmoothQuantW8A8(calibration=stats, **{f: "static" for f in static})))
    return model


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("static", [(), ("out_proj_input",), ("fc2_input", "out_proj_input")],
                         ids=["dynamic", "static-out_proj", "static-both"])
def test_gpu_lean_loop_and_graph_equal_the_w8a8_modules(dtype, static):
    """On CUDA the lean loop calls the extension directly (the sm90 GEMM where it is built): it must give what the
    patched modules give (the same kernels in the same order: logits equal up to the LM head's row count), and
    generate must choose the same tokens through the prefill graph, the lean loop and the modules (static: the
    attention kernel writing out_proj's int8 input, fc1's GEMM fc2's)."""
    from fuseinfer.ops.w8a8_linear import w8a8_backend

    model = _gpu_w8a8(dtype, static)
    assert pf.lean_reason(model) is None
    print("w8a8 backend:", w8a8_backend(torch.device("cuda"), dtype))
    ids = _ids(model.config.vocab_size, rows=2, length=150).cuda()
    with torch.no_grad():
        ref = model(input_ids=ids).logits[:, -1].float()
    ours = fuseinfer.prefill(model, ids)
    torch.testing.assert_close(ours, ref, rtol=0, atol=2e-2 * ref.abs().max().item())
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    assert_same_tokens_graph_lean_modules(model, ids[:1])


@pytest.mark.gpu
def test_gpu_decode_rows_run_the_w8a16_gemv(monkeypatch):
    """At decode-sized inputs on CUDA (<= 16 rows) the W8A8 linears run the int8 weight-only GEMV on their int8
    weights: no per-token quantize and no fused LayerNorm + quantize; the lean loop does the same, so fast decode's
    prefill of a short prompt and the modules agree; above 16 rows the W8A8 GEMM runs again."""
    from fuseinfer.models.opt import modules as opt_mod

    model = _gpu_w8a8(torch.float16)
    layers = model.config.num_hidden_layers
    calls = collections.Counter()

    def counting(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call
    monkeypatch.setattr(sq, "w8a16_linear", counting("w8a16_linear", sq.w8a16_linear))
    monkeypatch.setattr(sq, "quantize_per_token", counting("quantize", sq.quantize_per_token))
    monkeypatch.setattr(opt_mod, "_norm_quant", counting("norm_quant", opt_mod._norm_quant))
    ids = _ids(model.config.vocab_size, rows=1, length=12).cuda()
    short = modules_forward(model, input_ids=ids).logits[:, -1].float()
    assert calls == {"w8a16_linear": 4 * layers}, calls
    calls.clear()
    modules_forward(model, input_ids=_ids(model.config.vocab_size, rows=1, length=40).cuda())
    assert calls["w8a16_linear"] == 0 and calls["norm_quant"] == 2 * layers, calls
    # the lean loop takes the same path at 12 rows (the int8 ops, not the W8A8 layers): same logits as the modules
    monkeypatch.setattr(lean.W8A8LeanOps, "__init__",
                        lambda *a, **k: pytest.fail("the lean loop ran W8A8 GEMMs at 12 rows"))
    monkeypatch.setattr(lean.Int8LeanOps, "lin", counting("lean_int8", lean.Int8LeanOps.lin))
    calls.clear()
    torch.testing.assert_close(fuseinfer.prefill(model, ids), short, rtol=0, atol=1e-2 * short.abs().max().item())
    assert calls["lean_int8"] == 4 * layers, calls
    # one linear against the fp32 product with its dequantized weight
    lin = model.model.decoder.layers[0].fc2
    x = torch.randn(3, lin.in_features, device="cuda", dtype=torch.float16)
    ref = x.float() @ lin.dequantized_weight(torch.float32).T + lin.bias.float()
    torch.testing.assert_close(lin.fused(x).float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
