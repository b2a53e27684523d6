"""Float8 (FP8 e4m3) models through the OPT lean prefill loop (``Fp8LeanOps``): the loop runs the patched modules'
ops in the same order (``add_layer_norm_quant_fp8`` for the pre-LN LayerNorms, ``quantize_fp8_per_token`` for
out_proj's and fc2's inputs, ``fp8_linear`` for every GEMM), so on CPU, where every op is its reference, its logits
and cache contents equal the modules' bit for bit; the trained tiny OPT quantized with Float8() and Float8(alpha=0.5)
(smoothed: the factors folded into the LayerNorms): ``lean_reason`` None, the model's own forward (the fast forward)
equals the modules' (final hidden states bit for bit; logits to the rounding of the LM head's other GEMM shape),
``fuseinfer.prefill`` / ``generate`` equal the modules' logits and tokens; a swapped linear
sends it back to the modules. GPU (marked): the same equalities with OPT-125m-shaped random weights, decode-sized
prompts (the e4m3 weight GEMV) included."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import VARIANTS, random_opt
from helpers import (assert_lean_equals_modules, assert_prefill_op_counts, assert_same_tokens_graph_lean_modules,
                     assert_same_tokens_lean_and_modules, cache_run, fuseinfer_op_counts, modules_forward)

import fuseinfer
from fuseinfer import Float8, PatchConfig
from fuseinfer.models.opt import lean
from fuseinfer.models.opt.decode import forward_last_logits
from fuseinfer.quant import smoothquant as sq
from fuseinfer.runtime import prefill as pf

FP8_VARIANTS = ["pre_ln", "post_ln_project_in_out", "no_bias", "ln_without_affine", "odd_hidden96_3heads"]


def _ids(vocab, rows=2, length=24, seed=0):
    return torch.randint(3, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


def _stats(model):
    """Calibration statistics on seeded random ids."""
    ids = torch.randint(3, model.config.vocab_size, (1, 256), generator=torch.Generator().manual_seed(3))
    return sq.calibrate(model, ids=ids, samples=2, seq_len=128)


def _config(base, alpha=None, fc2_input="dynamic", out_proj_input="dynamic"):
    """Float8 with ``alpha``, ``fc2_input`` and ``out_proj_input``, calibrated on seeded ids where one needs it."""
    if alpha is None and fc2_input == out_proj_input == "dynamic":
        return Float8()
    return Float8(alpha=alpha, calibration=_stats(base), fc2_input=fc2_input, out_proj_input=out_proj_input)


def _fp8(variant="pre_ln", alpha=None, fc2_input="dynamic", out_proj_input="dynamic"):
    base = random_opt(**VARIANTS[variant]).eval()
    model = copy.deepcopy(base)
    fuseinfer.patch(model, PatchConfig(quant=_config(base, alpha, fc2_input, out_proj_input)))
    return base, model


@pytest.fixture(scope="module", params=[(None, "dynamic", "dynamic"), (0.5, "dynamic", "dynamic"),
                                        (None, "static", "dynamic"), (0.5, "static", "static")],
                ids=["plain", "smoothed", "static-fc2", "smoothed-static-both"])
def tiny_fp8(request, tiny_model_path):
    """The trained tiny OPT, quantized with Float8(), Float8(alpha=0.5), Float8(fc2_input="static") or
    Float8(alpha=0.5) with both static inputs (calibrated on seeded ids)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, torch_dtype=torch.float32).eval()
    model = copy.deepcopy(base)
    alpha, fc2_input, out_proj_input = request.param
    fuseinfer.patch(model, PatchConfig(quant=_config(base, alpha, fc2_input, out_proj_input)))
    return base, model, alpha


# ---- CPU: random models of every layout ----

@pytest.mark.parametrize("variant", FP8_VARIANTS)
def test_lean_loop_takes_fp8_models_and_equals_the_patched_modules(variant):
    _, model = _fp8(variant)
    assert lean.quant_kind(model) == "fp8"
    assert_lean_equals_modules(model, _ids(model.config.vocab_size), "fuseinfer::fp8_linear")


def test_lean_loop_runs_the_fused_layernorm_quantize_and_two_quantize_passes_per_layer():
    """Pre-LN: 2 add_layer_norm_quant_fp8 and 2 quantize_fp8_per_token per layer (out_proj's and fc2's inputs), the
    final LayerNorm the one fp16 LayerNorm, no int8 op."""
    _, model = _fp8()
    assert_prefill_op_counts(model, _ids(model.config.vocab_size), {
        "add_layer_norm_quant_fp8": 2, "quantize_fp8_per_token": 2, "fp8_linear": 4
    }, {"add_layer_norm": 1, "quantize_int8": 0, "w8a8_linear": 0})


def test_smoothed_fp8_random_model_equals_its_modules():
    _, model = _fp8(alpha=0.5)
    assert_lean_equals_modules(model, _ids(model.config.vocab_size), "fuseinfer::fp8_linear")


@pytest.mark.parametrize("variant", FP8_VARIANTS)
@pytest.mark.parametrize("alpha", [None, 0.5])
def test_static_fc2_input_lean_loop_equals_the_modules(variant, alpha):
    """Float8(fc2_input="static"): fc2 holds a calibrated (1,) fp32 input_scale; the lean loop and the modules both
    run fc1 as fp8_linear_fp8out (e4m3 out with that scale) and fc2 on it: the same logits and caches."""
    _, model = _fp8(variant, alpha, "static")
    fc2 = model.model.decoder.layers[0].fc2
    assert fc2.input_scale.shape == (1,) and fc2.input_scale.dtype == torch.float32 and fc2.input_scale > 0
    assert model.model.decoder.layers[0].fc1.input_scale is None  # (only fc2's input is static)
    assert_lean_equals_modules(model, _ids(model.config.vocab_size), "fuseinfer::fp8_linear_fp8out", per_layer=1)


def test_static_fc2_input_after_a_non_relu_activation():
    """An activation the epilogue cannot apply (GELU): fc1 writes fp16, the activation runs apart, and fc2 quantizes
    its input with its static scale (no fp8_linear_fp8out, no per-token quantize of it): the lean loop as the
    modules, and one per-token quantize per layer only (out_proj's input)."""
    base = random_opt(activation_function="gelu").eval()
    model = copy.deepcopy(base)
    fuseinfer.patch(model, PatchConfig(quant=_config(base, fc2_input="static")))
    assert_lean_equals_modules(model, _ids(model.config.vocab_size), "fuseinfer::fp8_linear")
    counts = fuseinfer_op_counts(lambda: fuseinfer.prefill(model, _ids(model.config.vocab_size)))
    assert counts["fuseinfer::quantize_fp8_per_token"] == model.config.num_hidden_layers
    assert counts["fuseinfer::fp8_linear_fp8out"] == 0


def test_static_fc2_input_replaces_one_quantize_pass_per_layer():
    """Pre-LN with fc2_input="static": per layer one quantize_fp8_per_token (out_proj's input) instead of two, fc1
    as fp8_linear_fp8out, the other three GEMMs fp8_linear."""
    _, model = _fp8(fc2_input="static")
    assert_prefill_op_counts(model, _ids(model.config.vocab_size), {
        "quantize_fp8_per_token": 1, "fp8_linear_fp8out": 1, "fp8_linear": 3, "add_layer_norm_quant_fp8": 2
    })


@pytest.mark.parametrize("variant", FP8_VARIANTS)
@pytest.mark.parametrize("alpha", [None, 0.5])
def test_static_out_proj_input_lean_loop_equals_the_modules(variant, alpha):
    """Float8(out_proj_input="static"): out_proj holds a calibrated (1,) fp32 input_scale; the lean loop and the
    modules both run the attention as attention_fp8out (its output in e4m3 with that scale) and out_proj on it: the
    same logits and caches."""
    _, model = _fp8(variant, alpha, out_proj_input="static")
    layer = model.model.decoder.layers[0]
    scale = layer.self_attn.out_proj.input_scale
    assert scale.shape == (1,) and scale.dtype == torch.float32 and scale > 0
    assert layer.fc2.input_scale is None and layer.fc1.input_scale is None  # (only out_proj's input is static)
    assert_lean_equals_modules(model, _ids(model.config.vocab_size), "fuseinfer::attention_fp8out", per_layer=1)


def test_static_inputs_leave_no_quantize_pass():
    """Pre-LN with both inputs static: no per-token quantize at all, the attention as attention_fp8out, fc1 as
    fp8_linear_fp8out, q/k/v, out_proj and fc2 as fp8_linear, the LayerNorms quantizing."""
    _, model = _fp8(fc2_input="static", out_proj_input="static")
    assert_prefill_op_counts(model, _ids(model.config.vocab_size), {
        "quantize_fp8_per_token": 0, "attention_fp8out": 1, "attention": 0, "fp8_linear_fp8out": 1, "fp8_linear": 3,
        "add_layer_norm_quant_fp8": 2
    })


def test_static_out_proj_input_equals_the_emulated_layer():
    """The static path from first principles: out_proj's scale is amax / 448 of its calibrated input (no smoothing),
    and out_proj on the e4m3 attention output equals its own call on the fp32 attention output (which quantizes with
    the static scale)."""
    from helpers import assert_out_proj_takes_8bit_attention

    base = random_opt().eval()
    stats = _stats(base)
    model = copy.deepcopy(base)
    fuseinfer.patch(model, PatchConfig(quant=Float8(calibration=stats, out_proj_input="static")))
    out_proj = model.model.decoder.layers[0].self_attn.out_proj
    amax = stats.act_max["model.decoder.layers.0.self_attn.out_proj"].max()
    torch.testing.assert_close(out_proj.input_scale, (amax / 448).reshape(1), rtol=0, atol=0)
    assert_out_proj_takes_8bit_attention(model, out_proj, "e4m3")


def test_static_fc2_input_equals_the_emulated_layer():
    """The static path's numbers from first principles: fc2 of layer 0 sees e4m3(relu(fc1) / s) * s, where s =
    amax / 448 of fc2's calibrated input (the calibration's own max over fc2's input channels)."""
    from fuseinfer.ops.linear_8bit_out import fp8_linear_fp8out_ref, quantize_fp8_static
    from fuseinfer.ops.fp8_linear import quantize_fp8_ref

    base = random_opt().eval()
    stats = _stats(base)
    model = copy.deepcopy(base)
    fuseinfer.patch(model, PatchConfig(quant=Float8(calibration=stats, fc2_input="static")))
    layer = model.model.decoder.layers[0]
    amax = stats.act_max["model.decoder.layers.0.fc2"].max()
    torch.testing.assert_close(layer.fc2.input_scale, (amax / 448).reshape(1), rtol=0, atol=0)
    x = torch.randn(7, model.config.hidden_size)
    xq, xs = quantize_fp8_ref(x, -1)
    fc1 = layer.fc1
    y = fp8_linear_fp8out_ref(xq, xs, fc1.weight_q, fc1.weight_scale, fc1.bias, layer.fc2.input_scale, "relu")
    h = torch.relu(fc1.fused(x))  # fc1 in fp32 (the per-token path), then the static quantization
    assert torch.equal(y.view(torch.uint8), quantize_fp8_static(h, layer.fc2.input_scale).view(torch.uint8))
    # fc2's fused call on an fp32 input quantizes with the static scale: what the e4m3 input gives
    out = layer.fc2.fused(h)
    ref = layer.fc2.forward_quantized(y, layer.fc2.static_scales(y), None, "none", torch.float32)
    assert torch.equal(out, ref)


def test_swapped_fp8_linear_keeps_the_modules():
    _, model = _fp8()
    assert pf.lean_reason(model) is None
    fc2 = model.model.decoder.layers[1].fc2
    model.model.decoder.layers[1].fc2 = copy.deepcopy(fc2)  # a module put in after patch: not the plan's
    assert "replaced" in pf.lean_reason(model)
    model.model.decoder.layers[1].fc2 = fc2
    assert pf.lean_reason(model) is None


def test_unquantized_linear_in_an_fp8_model_is_refused():
    """A layer whose linear is not an FP8 one (put back to an nn.Linear before the plan is built) keeps the
    modules, and says which."""
    _, model = _fp8()
    layer = model.model.decoder.layers[0]
    layer.fc1 = torch.nn.Linear(layer.fc1.in_features, layer.fc1.out_features)
    why = lean._structure_reason(model)
    assert why is not None and "fc1 not FP8-quantized" in why


# ---- CPU: the trained tiny OPT, plain and smoothed ----

def test_tiny_fp8_lean_logits_equal_the_patched_forward(tiny_fp8):
    base, model, alpha = tiny_fp8
    assert pf.lean_reason(model) is None
    if alpha is not None:  # the smoothing is folded into the LayerNorms at quantize time: their weights changed
        ln, ln0 = model.model.decoder.layers[0].self_attn_layer_norm, base.model.decoder.layers[0].self_attn_layer_norm
        assert not torch.equal(ln.weight, ln0.weight)
    ids = _ids(model.config.vocab_size, rows=2, length=40, seed=1)
    ours, ref = cache_run(pf.lean_logits, model, ids), cache_run(forward_last_logits, model, ids)
    for a, b in zip(ours, ref):  # logits, last layer's keys and values
        assert torch.equal(a, b)
    # the patched modules' own forward: its final hidden states are the lean loop's bit for bit; its logits come from
    # an LM head over every position (another GEMM shape than the lean loop's one row, so equal to rounding only)
    positions = torch.arange(ids.shape[1]).expand(ids.shape)
    hidden = lean.lean_hidden(model, ids, positions)  # (B, S, E)
    with fuseinfer.runtime.using_runtime(model, prefill="module"), torch.no_grad():
        ref_hidden = model.model(input_ids=ids).last_hidden_state
    assert torch.equal(hidden, ref_hidden)
    modules = modules_forward(model, input_ids=ids).logits  # (B, S, V)
    torch.testing.assert_close(ours[0], modules[:, -1].float(), rtol=1e-5, atol=1e-5)


def test_tiny_fp8_fast_forward_equals_the_modules(tiny_fp8):
    """model(ids) takes the lean loop (runtime/forward.py) and gives the modules' logits at every position."""
    _, model, _ = tiny_fp8
    ids = _ids(model.config.vocab_size, rows=2, length=33, seed=2)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        fast = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(fast, modules_forward(model, input_ids=ids, attention_mask=mask).logits)


def test_tiny_fp8_prefill_and_generate_equal_the_modules(tiny_fp8):
    _, model, _ = tiny_fp8
    ids = _ids(model.config.vocab_size, rows=1, length=20, seed=3)
    with torch.no_grad():
        ref = modules_forward(model, input_ids=ids).logits[:, -1].float()
    torch.testing.assert_close(fuseinfer.prefill(model, ids), ref, rtol=1e-5, atol=1e-5)  # (LM head row counts)
    assert_same_tokens_lean_and_modules(model, ids)


# ---- GPU: the kernels (add_layer_norm_quant_fp8, quantize_fp8_rows, the FP8 GEMM, the e4m3 GEMV) ----

def _gpu_fp8(dtype, alpha=None, layers=2, fc2_input="dynamic", out_proj_input="dynamic"):
    """OPT-125m-shaped random weights (hidden 768, 12 heads, ffn 3072), ``layers`` layers, on CUDA."""
    base = random_opt(hidden_size=768, num_attention_heads=12, ffn_dim=3072, num_hidden_layers=layers,
                      max_position_embeddings=1024, vocab_size=2048)
    config = _config(base, alpha, fc2_input, out_proj_input)
    model = base.to("cuda", dtype)
    fuseinfer.patch(model, PatchConfig(quant=config))
    return model


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("alpha,fc2_input,out_proj_input", [(None, "dynamic", "dynamic"), (0.5, "dynamic", "dynamic"),
                                                           (None, "static", "dynamic"), (0.5, "static", "static")])
@pytest.mark.parametrize("rows,length", [(1, 12), (2, 150), (1, 513)])
def test_gpu_lean_loop_equals_the_fp8_modules(dtype, alpha, fc2_input, out_proj_input, rows, length):
    """The lean loop runs the modules' kernels in the same order: the same logits and cache contents, bit for bit
    (1 x 12 tokens: decode-sized, the e4m3 weight GEMV on unquantized activations; else the quantize kernels and the
    FP8 GEMM; fc2_input="static": fc1 as the e4m3-output GEMM; out_proj_input="static": the attention kernel
    writing e4m3)."""
    model = _gpu_fp8(dtype, alpha, fc2_input=fc2_input, out_proj_input=out_proj_input)
    assert pf.lean_reason(model) is None
    ids = _ids(model.config.vocab_size, rows=rows, length=length).cuda()
    ours = cache_run(pf.lean_logits, model, ids, slots=576)
    ref = cache_run(forward_last_logits, model, ids, slots=576)
    for what, a, b in zip(("logits", "keys", "values"), ours, ref):
        assert torch.equal(a, b), f"{what}: max |diff| {(a.float() - b.float()).abs().max().item()}"
    with torch.no_grad():
        full = modules_forward(model, input_ids=ids).logits[:, -1].float()
    got = fuseinfer.prefill(model, ids)
    torch.testing.assert_close(got, full, rtol=0, atol=2e-2 * full.abs().max().item())  # (LM head row counts)
    assert (got.argmax(-1) == full.argmax(-1)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("static", ["", "fc2", "both"])
def test_gpu_generate_same_tokens_graph_lean_modules(dtype, static):
    model = _gpu_fp8(dtype, fc2_input="static" if static else "dynamic",
                     out_proj_input="static" if static == "both" else "dynamic")
    assert_same_tokens_graph_lean_modules(model, _ids(model.config.vocab_size, rows=1, length=150).cuda())


@pytest.mark.gpu
def test_gpu_lean_loop_runs_the_quantize_kernel_and_the_gemv_at_decode_rows(monkeypatch):
    """On CUDA the lean loop's per-token quantizes are the row kernel (2 per layer for out_proj's and fc2's inputs,
    and 2 more where a pre-LN LayerNorm runs unfused: the LayerNorm kernel, then the quantize kernel), and at
    decode-sized prompts (<= 16 rows) the e4m3 weight GEMV runs every linear instead, with no quantize."""
    import collections

    from helpers import require_kernel

    from fuseinfer.core import extension as _ext

    require_kernel()
    model = _gpu_fp8(torch.float16)
    layers = model.config.num_hidden_layers
    calls = collections.Counter()

    class Recording:
        def __init__(self, ext):
            self.ext = ext

        def __getattr__(self, name):
            attr = getattr(self.ext, name)
            if name not in ("quantize_fp8_rows", "fp8_weight_linear", "add_layer_norm_quant_fp8"):
                return attr
            return lambda *a: calls.update([name]) or attr(*a)

    monkeypatch.setattr(_ext, "_ext", Recording(_ext.extension()))
    with fuseinfer.runtime.using_runtime(model, prefill="lean"):
        fuseinfer.prefill(model, _ids(model.config.vocab_size, rows=1, length=150).cuda())
        assert calls["fp8_weight_linear"] == 0
        assert calls["quantize_fp8_rows"] + calls["add_layer_norm_quant_fp8"] == 4 * layers, calls
        assert calls["quantize_fp8_rows"] >= 2 * layers, calls
        calls.clear()
        fuseinfer.prefill(model, _ids(model.config.vocab_size, rows=1, length=12).cuda())
        assert calls == {"fp8_weight_linear": 4 * layers}, calls
