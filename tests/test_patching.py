"""The patch engine on CPU: every OPT layout, patched vs unpatched logits, generation, padding, unpatch,
save/load, torch.compile, config and filter options, and the errors for bad input."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import VARIANTS, loss_and_grads, random_opt, traced_by_compile

import fuseinfer
from fuseinfer import FuseInferError, PatchConfig

SEQ = 113  # odd on purpose


def _ids(model, batch=2, seq=SEQ, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (batch, seq), generator=g)


@torch.no_grad()
def _logits(model, ids, mask=None):
    return model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fp32_logits_match(variant):
    model = random_opt(**VARIANTS[variant])
    ids = _ids(model)
    ref = _logits(model, ids)
    report = fuseinfer.patch(model)
    out = _logits(model, ids)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert report.swaps and set(report.backends) == set(fuseinfer.OPS)


def test_fp32_logits_match_trained_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    ids = _ids(model, seq=256)
    ref = _logits(model, ids)
    fuseinfer.patch(model)
    assert (_logits(model, ids) - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("variant", ["pre_ln", "post_ln_project_in_out"])
def test_bf16_error_within_twice_torch_bf16_error(variant):
    model32 = random_opt(**VARIANTS[variant])
    ids = _ids(model32)
    ref = _logits(model32, ids)  # fp32 reference
    model16 = copy.deepcopy(model32).to(torch.bfloat16)
    torch_err = (_logits(model16, ids).float() - ref).abs().max()
    fuseinfer.patch(model16)
    ours_err = (_logits(model16, ids).float() - ref).abs().max()
    assert ours_err <= 2 * torch_err, (ours_err, torch_err)


def test_greedy_generate_32_tokens_identical(tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    ids = _ids(model, batch=1, seq=20)
    kwargs = dict(max_new_tokens=32, do_sample=False, min_new_tokens=32)
    ref = model.generate(ids, **kwargs)
    fuseinfer.patch(model)
    assert torch.equal(model.generate(ids, **kwargs), ref)


@pytest.mark.parametrize("variant", ["pre_ln", "post_ln_project_in_out"])
def test_left_padded_batch_matches_each_prompt_alone(variant):
    model = random_opt(**VARIANTS[variant])
    fuseinfer.patch(model)
    lengths = [SEQ, 40, 7]
    prompts = [_ids(model, batch=1, seq=n, seed=n)[0] for n in lengths]
    ids = torch.full((3, SEQ), model.config.pad_token_id)
    mask = torch.zeros(3, SEQ, dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding
        ids[i, SEQ - len(p):], mask[i, SEQ - len(p):] = p, 1
    batched = _logits(model, ids, mask)
    assert torch.isfinite(batched).all()
    for i, p in enumerate(prompts):
        alone = _logits(model, p[None])[0]
        got = batched[i, SEQ - len(p):]
        assert (got - alone).abs().max() <= 1e-5 * alone.abs().max(), i


def test_left_padded_batch_generate_matches_unpatched(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_path, padding_side="left")
    enc = tok(["The tower", "In 1990 , the band released their second album", "He"], return_tensors="pt",
              padding=True)
    kwargs = dict(max_new_tokens=16, do_sample=False, min_new_tokens=16)
    ref = model.generate(**enc, **kwargs)
    fuseinfer.patch(model)
    assert torch.equal(model.generate(**enc, **kwargs), ref)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_unpatch_restores_classes_and_state_dict_bit_for_bit(variant):
    model = random_opt(**VARIANTS[variant])
    classes = {name: type(m) for name, m in model.named_modules()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    impl = model.config._attn_implementation
    fuseinfer.patch(model)
    assert fuseinfer.patch_report(model) is not None
    fuseinfer.unpatch(model)
    assert {name: type(m) for name, m in model.named_modules()} == classes
    after = model.state_dict()
    assert after.keys() == state.keys()
    assert all(torch.equal(after[k], state[k]) and after[k].dtype == state[k].dtype for k in state)
    assert model.config._attn_implementation == impl
    assert not any(hasattr(m, "qkv_weight") or hasattr(m, "_fuseinfer_ops") for m in model.modules())
    assert fuseinfer.patch_report(model) is None
    fuseinfer.patch(model)  # patchable again after unpatch


def test_save_pretrained_loads_in_plain_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    model = random_opt(**VARIANTS["post_ln_project_in_out"])
    ids = _ids(model)
    fuseinfer.patch(model)
    expected = _logits(model, ids)
    model.save_pretrained(tmp_path)
    fuseinfer.unpatch(model)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config._attn_implementation != "fuseinfer"
    torch.testing.assert_close(_logits(loaded, ids), expected, rtol=1e-5, atol=1e-5)


def test_torch_compile_of_patched_model():
    """The compiled graph calls the registered fuseinfer ops (on CUDA, the kernels), not their references."""
    model = random_opt()
    ids = _ids(model)
    ref = _logits(model, ids)
    fuseinfer.patch(model)
    with torch.no_grad():
        out, code = traced_by_compile(model, input_ids=ids)
    assert (out.logits - ref).abs().max() <= 1e-5 * ref.abs().max()
    for op in ("linear_epilogue", "add_layer_norm", "attention"):
        assert f"torch.ops.fuseinfer.{op}" in code, op
    out = _logits(torch.compile(model, fullgraph=True), ids)  # and through inductor
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("op", fuseinfer.OPS)
def test_each_op_alone(op):
    model = random_opt(**VARIANTS["post_ln_project_in_out"])
    ids = _ids(model)
    ref = _logits(model, ids)
    report = fuseinfer.patch(model, PatchConfig(ops=(op,)))
    assert set(report.backends) == {op}
    assert (_logits(model, ids) - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_filter_fn_patches_only_selected_modules():
    model = random_opt(num_hidden_layers=3)
    ids = _ids(model)
    ref = _logits(model, ids)
    report = fuseinfer.patch(model, PatchConfig(filter_fn=lambda m, name: ".layers.1" in name))
    assert {s.name for s in report.swaps} == {"model.decoder.layers.1", "model.decoder.layers.1.self_attn"}
    assert type(model.model.decoder.layers[0]).__name__ == "OPTDecoderLayer"
    assert (_logits(model, ids) - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_filter_fn_sees_the_names_the_report_gives():
    """Patching a part (here the decoder itself): filter_fn sees each module under the name the report uses."""
    model = random_opt()
    seen = []
    report = fuseinfer.patch(model.model.decoder, PatchConfig(
        filter_fn=lambda m, name: seen.append(name) or name != "final_layer_norm"))
    assert "final_layer_norm" in seen and "layers.0" in seen
    assert {s.name for s in report.swaps} == set(seen) - {"final_layer_norm"}
    assert type(model.model.decoder.final_layer_norm) is torch.nn.LayerNorm


def test_fused_layer_without_fused_attention():
    model = random_opt()
    ids = _ids(model)
    ref = _logits(model, ids)
    fuseinfer.patch(model, PatchConfig(filter_fn=lambda m, name: not name.endswith("self_attn")))
    assert (_logits(model, ids) - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_output_hidden_states_and_report_text():
    model = random_opt()
    ids = _ids(model)
    ref = model(input_ids=ids, output_hidden_states=True).hidden_states
    report = fuseinfer.patch(model)
    out = model(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(out) == len(ref)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    text = str(report)
    assert "FusedOPTDecoderLayer" in text and "attention implementation: 'sdpa' -> 'fuseinfer'" in text
    assert "reference" in text  # no CUDA here: every op names the reference backend


def test_qkv_fusion_adds_no_parameter_memory():
    """q, k and v become views of the (3E, E) buffer the fused GEMM reads, at offsets 0, E and 2E rows."""
    from fuseinfer.models.opt.modules import _qkv_fused

    model = random_opt()
    fuseinfer.patch(model)
    for layer in model.model.decoder.layers:
        attn = layer.self_attn
        with torch.no_grad():  # (with gradients on, the projections run: autograd does not reach the buffer)
            assert _qkv_fused(attn)
        e = attn.embed_dim
        for i, proj in enumerate((attn.q_proj, attn.k_proj, attn.v_proj)):
            assert proj.weight.data_ptr() == attn.qkv_weight.data_ptr() + i * e * e * attn.qkv_weight.element_size()
            assert proj.bias.data_ptr() == attn.qkv_bias.data_ptr() + i * e * attn.qkv_bias.element_size()


def test_patch_leaves_a_model_sharing_the_config_alone():
    """Two models on one config object: patching one changes the other's attention implementation neither while
    patched nor after; unpatch puts the original object back, with a setting changed meanwhile."""
    from transformers import OPTForCausalLM

    a = random_opt()
    b = OPTForCausalLM(a.config).eval()
    config = a.config
    fuseinfer.patch(a)
    assert b.config is config and config._attn_implementation == "sdpa"
    assert a.config._attn_implementation == "fuseinfer"
    assert a.model.decoder.layers[0].self_attn.config is a.config
    fuseinfer.patch(b)  # patchable on its own
    fuseinfer.unpatch(b)
    a.config.use_cache = False
    fuseinfer.unpatch(a)
    assert a.config is config and a.model.decoder.layers[0].self_attn.config is config
    assert config._attn_implementation == "sdpa" and config.use_cache is False


def test_layer_with_parameters_in_another_dtype_is_skipped():
    """fp32 LayerNorms in an fp16 model (the fused kernels take one dtype): those modules stay unswapped, and the
    report says why; the rest is patched and the logits match."""
    model = random_opt(dtype=torch.float16)
    model.model.decoder.layers[1].self_attn_layer_norm.float()
    ids = _ids(model)
    ref = _logits(model, ids)
    report = fuseinfer.patch(model)
    assert ("model.decoder.layers.1", "it has torch.float32 parameters in a torch.float16 model: the fused ops take "
            "one dtype (e.g. model.to(torch.float16))") in report.skipped
    assert type(model.model.decoder.layers[1]).__name__ == "OPTDecoderLayer"
    assert type(model.model.decoder.layers[0]).__name__ == "FusedOPTDecoderLayer"
    torch.testing.assert_close(_logits(model, ids), ref, rtol=2e-3, atol=2e-3)


def test_training_mode_report_leaves_attention_out():
    model = random_opt().train()
    report = fuseinfer.patch(model)
    assert ("attention", "model is in training mode; call model.eval() first") in report.skipped
    assert report.swaps and all("attention" not in s.ops for s in report.swaps)
    assert report.attn_implementation is None


def test_training_mode_falls_back_to_the_original_forward():
    """With dropout on, the same seed gives the unpatched model's training-mode logits (the fused path has none)."""
    model = random_opt(dropout=0.2, attention_dropout=0.2).train()
    ids = _ids(model)
    torch.manual_seed(7)
    ref = _logits(model, ids)
    model.eval()
    fuseinfer.patch(model)
    model.train()
    torch.manual_seed(7)
    torch.testing.assert_close(_logits(model, ids), ref, rtol=0, atol=0)


def test_training_after_patch_backpropagates_like_unpatched():
    """Patched in eval mode, then .train(): the fused modules, attention included, run the original forward, so a
    left-padded batch's loss and every gradient match the unpatched model's."""
    ref, model = random_opt(), random_opt()
    fuseinfer.patch(model)
    ids = _ids(model)
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    labels = ids.masked_fill(mask == 0, -100)
    out = []
    for m in (ref, model):
        loss = m.train()(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        out.append((loss.detach(), {n: p.grad for n, p in m.named_parameters()}))
    torch.testing.assert_close(out[1][0], out[0][0], rtol=1e-5, atol=0)
    assert out[1][1].keys() == out[0][1].keys()
    for name, grad in out[0][1].items():
        torch.testing.assert_close(out[1][1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_eval_mode_backward_matches_unpatched(variant):
    """Patched in eval mode with gradients on (no torch.no_grad()), the fused forward backpropagates through the
    ops' references, and q/k/v (whose weights the fused GEMM reads through its own buffer) through the three
    projections: the loss and every gradient, inputs included, match the unpatched model's with eager attention (its SDPA
    attention gives other input gradients for the left-padded row at head dim 32 on CPU, by up to 9% of the
    largest)."""
    ref, model = random_opt(**VARIANTS[variant]), random_opt(**VARIANTS[variant])
    ref.config._attn_implementation = "eager"
    fuseinfer.patch(model)
    ids = _ids(model, seq=37)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    (loss_ref, grads_ref), (loss, grads) = loss_and_grads(ref, ids, mask), loss_and_grads(model, ids, mask)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=0)
    assert grads.keys() == grads_ref.keys()
    for name, grad in grads_ref.items():
        assert grad is not None, name
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_eval_mode_backward_under_torch_compile():
    ref, model = random_opt(), random_opt()
    ref.config._attn_implementation = "eager"
    fuseinfer.patch(model)
    ids = _ids(model, seq=37)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    (loss_ref, grads_ref), (loss, grads) = loss_and_grads(ref, ids, mask), loss_and_grads(model, ids, mask, True)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=0)
    for name, grad in grads_ref.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_torch_func_transforms_and_forward_ad_match_unpatched():
    """Under torch.func transforms and forward-mode AD the ops run their references: a jvp through the patched model
    (its tangent was silently 0: the ops' formulas are reverse-mode only) and torch.func.grad (it raised) give the
    unpatched model's results."""
    import torch.autograd.forward_ad as fwad

    ref, model = random_opt(), random_opt()
    ref.config._attn_implementation = "eager"
    fuseinfer.patch(model)
    ids = _ids(model, seq=9)
    e = model.get_input_embeddings()(ids).detach()
    t = torch.randn_like(e)
    (p_ref, j_ref), (p, j) = (torch.func.jvp(lambda e: m(inputs_embeds=e).logits, (e,), (t,)) for m in (ref, model))
    torch.testing.assert_close(p, p_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(j, j_ref, rtol=1e-4, atol=1e-5)
    assert j_ref.abs().max() > 1
    g_ref, g = (torch.func.grad(lambda e: m(inputs_embeds=e, labels=ids).loss)(e) for m in (ref, model))
    torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-6)
    x, w, tx = torch.randn(3, 4), torch.randn(5, 4), torch.randn(3, 4)
    with fwad.dual_level():
        y = fuseinfer.ops.linear_epilogue(fwad.make_dual(x, tx), w)
        torch.testing.assert_close(fwad.unpack_dual(y).tangent, tx @ w.T)


def test_functional_call_with_other_parameters_uses_them():
    """torch.func.functional_call with another model's parameters: the projections then hold other tensors than
    the views of the fused q/k/v buffer, so the three projections run (the fused GEMM read the model's own)."""
    ref, model, other = random_opt(), random_opt(), random_opt(seed=1)
    fuseinfer.patch(model)
    params = {n: p.detach() for n, p in other.named_parameters()}
    ids = _ids(model, seq=9)
    with torch.no_grad():
        expected = torch.func.functional_call(ref, params, (ids,)).logits
        out = torch.func.functional_call(model, params, (ids,)).logits
        assert (model(ids).logits - expected).abs().max() > 0.1  # the other parameters matter
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_weights_reassigned_through_data_are_used():
    """``param.data = t`` (vector_to_parameters does it) keeps the Parameter but ends its view of the fused q/k/v
    buffer: the three projections then run on the new weights."""
    ref, model = random_opt(seed=1), random_opt()
    fuseinfer.patch(model)
    torch.nn.utils.vector_to_parameters(torch.nn.utils.parameters_to_vector(ref.parameters()), model.parameters())
    ids = _ids(model, seq=9)
    torch.testing.assert_close(_logits(model, ids), _logits(ref, ids), rtol=1e-5, atol=1e-5)
    attn = model.model.decoder.layers[0].self_attn
    attn.v_proj.weight.data = torch.zeros_like(attn.v_proj.weight)
    ref.model.decoder.layers[0].self_attn.v_proj.weight.data.zero_()
    torch.testing.assert_close(_logits(model, ids), _logits(ref, ids), rtol=1e-5, atol=1e-5)


def test_autocast_to_another_dtype_runs_the_original_forward():
    """An fp32 patched model under CPU autocast to bf16 (it crashed: autocast made x bf16 next to an fp32 residual)
    gives the unpatched model's autocast logits and loss."""
    ref, model = random_opt(), random_opt()
    fuseinfer.patch(model)
    ids = _ids(model, seq=9)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ref, out = ref(ids, labels=ids), model(ids, labels=ids)
    torch.testing.assert_close(out.logits, out_ref.logits, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=1e-2, atol=0)
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_to_after_patch_keeps_qkv_fused():
    """model.to() converts the (3E, E) q/k/v buffer and the projections' weights one by one; they must end up
    views of one buffer again (the same Parameter objects), so a later load_state_dict reaches the fused GEMM."""
    model = random_opt()
    fuseinfer.patch(model)
    attn = model.model.decoder.layers[0].self_attn
    q_weight = attn.q_proj.weight
    model.to(torch.bfloat16)
    assert attn.q_proj.weight is q_weight and attn.qkv_weight.dtype == torch.bfloat16
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.qkv_weight.untyped_storage().data_ptr()
    model.load_state_dict(random_opt(seed=5).to(torch.bfloat16).state_dict())
    fresh = random_opt(seed=5).to(torch.bfloat16)
    fuseinfer.patch(fresh)
    ids = _ids(model)
    assert torch.equal(_logits(model, ids), _logits(fresh, ids))


def test_torch_save_and_load_of_patched_model(tmp_path):
    """torch.save pickles a patched model (its generate hook and decode sessions included); the loaded copy
    generates the same tokens and unpatches."""
    from transformers.models.opt.modeling_opt import OPTAttention

    model = random_opt()
    fuseinfer.patch(model)
    ids = _ids(model, seq=9)
    out = fuseinfer.generate(model, ids, max_new_tokens=6)
    torch.save(model, tmp_path / "patched.pt")
    loaded = torch.load(tmp_path / "patched.pt", weights_only=False)
    assert torch.equal(fuseinfer.generate(loaded, ids, max_new_tokens=6), out)
    hf_kwargs = dict(max_new_tokens=6, do_sample=False)
    assert torch.equal(loaded.generate(ids, **hf_kwargs), model.generate(ids, **hf_kwargs))  # through the hook
    fuseinfer.unpatch(loaded)
    assert type(loaded.model.decoder.layers[0].self_attn) is OPTAttention


def test_torch_save_of_model_patched_with_a_lambda_filter(tmp_path):
    """A lambda filter_fn does not pickle: torch.save still works, and the loaded config's filter_fn says so."""
    model = random_opt(num_hidden_layers=3)
    fuseinfer.patch(model, PatchConfig(filter_fn=lambda m, name: ".layers.1" in name))
    ids = _ids(model, seq=9)
    torch.save(model, tmp_path / "patched.pt")
    loaded = torch.load(tmp_path / "patched.pt", weights_only=False)
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), rtol=0, atol=0)
    assert type(loaded.model.decoder.layers[1]).__name__ == "FusedOPTDecoderLayer"
    assert type(loaded.model.decoder.layers[0]).__name__ == "OPTDecoderLayer"
    with pytest.raises(FuseInferError, match="unpickled without its filter_fn"):
        fuseinfer.patch_state(loaded).config.filter_fn(loaded, "x")
    assert copy.deepcopy(model)._fuseinfer_state.config.filter_fn(None, ".layers.1")  # a deep copy keeps it


# ---- bad input: one clear error, model untouched ----

def _snapshot(model):
    return {n: type(m) for n, m in model.named_modules()}, model.config._attn_implementation


def test_non_opt_model_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    before = _snapshot(model)
    with pytest.raises(FuseInferError, match=r"cannot patch GPT2LMHeadModel.*supported: opt \(OPTForCausalLM"):
        fuseinfer.patch(model)
    assert _snapshot(model) == before
    with pytest.raises(FuseInferError, match="torch.nn.Module"):
        fuseinfer.patch("facebook/opt-125m")


def test_meta_device_model_is_refused():
    with torch.device("meta"):
        model = random_opt(device="meta")
    before = _snapshot(model)
    with pytest.raises(FuseInferError, match="meta device: load real weights"):
        fuseinfer.patch(model)
    assert _snapshot(model) == before


def test_unknown_op_name_is_refused():
    with pytest.raises(FuseInferError, match=r"unknown op name\(s\) \['flash'\].*choose from"):
        PatchConfig(ops=("flash",))
    with pytest.raises(FuseInferError, match="filter_fn must be a callable"):
        PatchConfig(filter_fn=5)


def test_double_patch_and_unpatched_unpatch_are_refused():
    model = random_opt()
    with pytest.raises(FuseInferError, match="not patched"):
        fuseinfer.unpatch(model)
    fuseinfer.patch(model)
    before = _snapshot(model)
    with pytest.raises(FuseInferError, match="already patched"):
        fuseinfer.patch(model)
    with pytest.raises(FuseInferError, match=r"part of this model \(decoder.*\) is already patched"):
        fuseinfer.patch(model.model)  # a part of a patched model
    assert _snapshot(model) == before
    fuseinfer.unpatch(model)
    fuseinfer.patch(model.model)
    with pytest.raises(FuseInferError, match=r"part of this model \(model\) is already patched"):
        fuseinfer.patch(model)  # a model with a patched part
    with pytest.raises(FuseInferError, match=r"its module 'model' is: fuseinfer.unpatch\(model.get_submodule"):
        fuseinfer.unpatch(model)
    fuseinfer.unpatch(model.model)
    fuseinfer.patch(model, PatchConfig(filter_fn=lambda m, name: False))  # sets the attention implementation only
    with pytest.raises(FuseInferError, match="selects the .fuseinfer. attention of the patched model it is part of"):
        fuseinfer.patch(model.model)
    fuseinfer.unpatch(model)
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(FuseInferError, match="takes a PatchConfig as config, got dict"):
        fuseinfer.patch(model, {"ops": ("linear",)})


def test_unsupported_dtype_is_refused():
    model = random_opt().to(torch.float64)
    with pytest.raises(FuseInferError, match="float64.*dtype=torch.float16"):
        fuseinfer.patch(model)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copied_patched_model_keeps_qkv_tied(how):
    """A deep or pickled copy's q/k/v weights stay views of its own (3E, E) buffer, so load_state_dict on the
    copy reaches the fused GEMM (copying a Parameter clones it)."""
    import pickle

    model = random_opt()
    fuseinfer.patch(model)
    c = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    attn = c.model.decoder.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.qkv_weight.untyped_storage().data_ptr()
    c.load_state_dict(random_opt(seed=5).state_dict())
    fresh = random_opt(seed=5)
    ids = _ids(model)
    torch.testing.assert_close(_logits(c, ids), _logits(fresh, ids), rtol=1e-4, atol=1e-4)


def _lora_like(linear):
    """An adapter in the style of LoRA: a subclass of nn.Linear whose forward adds a low-rank term."""
    class LoRALinear(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) + x @ self.a.t() @ self.b.t()

    lora = LoRALinear(linear.in_features, linear.out_features)
    lora.load_state_dict(linear.state_dict())
    lora.a = torch.nn.Parameter(torch.randn(2, linear.in_features))
    lora.b = torch.nn.Parameter(torch.randn(linear.out_features, 2))
    return lora


@pytest.mark.parametrize("case", ["hook_on_fc2", "hook_on_q_proj", "hook_on_self_attn", "hook_on_layer_norm",
                                  "hook_on_activation_fn", "lora_fc1", "lora_q_proj", "instance_forward_fc2",
                                  "instance_forward_layer"])
def test_modules_with_hooked_or_adapted_submodules_are_left_alone(case):
    """The fused forwards read fc1 / fc2 / q, k, v / LayerNorm weights without calling those modules: a layer
    whose such submodule has hooks or is an adapter stays unswapped (reported), and the logits and the hook's
    calls are those of the unpatched model."""
    model = random_opt()
    layer = model.model.decoder.layers[1]
    target = {"hook_on_fc2": layer.fc2, "hook_on_q_proj": layer.self_attn.q_proj,
              "hook_on_self_attn": layer.self_attn, "hook_on_layer_norm": layer.final_layer_norm,
              "hook_on_activation_fn": layer.activation_fn}.get(case)
    calls = []
    if target is not None:
        target.register_forward_hook(  # halves the output (the attention module's is a tuple)
            lambda m, i, o: calls.append(1) or ((o[0] * 0.5, *o[1:]) if isinstance(o, tuple) else o * 0.5))
    elif case.startswith("instance_forward"):  # how accelerate's hooks wrap a module
        mod = layer.fc2 if case == "instance_forward_fc2" else layer
        original = mod.forward
        mod.forward = lambda *a, **k: calls.append(1) or (lambda o: o * 0.5 if torch.is_tensor(o) else o)(
            original(*a, **k))
    elif case == "lora_fc1":
        layer.fc1 = _lora_like(layer.fc1)
    else:
        layer.self_attn.q_proj = _lora_like(layer.self_attn.q_proj)
    ids = _ids(model)
    ref = _logits(model, ids)
    ref_calls = len(calls)
    report = fuseinfer.patch(model)
    skipped = dict(report.skipped)
    name = "model.decoder.layers.1" + (".self_attn" if case in ("hook_on_q_proj", "hook_on_self_attn", "lora_q_proj")
                                       else "")
    assert name in skipped, report
    torch.testing.assert_close(_logits(model, ids), ref, rtol=1e-5, atol=1e-5)
    assert len(calls) == 2 * ref_calls
    if case == "hook_on_q_proj":  # output_attentions: the unswapped attention still gives its weights, in order
        from transformers import OPTForCausalLM

        fuseinfer.unpatch(model)
        eager = OPTForCausalLM._from_config(model.config, attn_implementation="eager").eval()
        eager.load_state_dict(model.state_dict())
        eager.model.decoder.layers[1].self_attn.q_proj.register_forward_hook(lambda m, i, o: o * 0.5)
        with torch.no_grad():
            ref = eager(ids, output_attentions=True).attentions
            fuseinfer.patch(eager)
            ours = eager(ids, output_attentions=True).attentions
        assert len(ours) == len(ref) == 2
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hook", ["full_backward_fc1", "backward_pre_fc2", "full_backward_out_proj"])
def test_modules_with_backward_hooks_on_bypassed_submodules_are_left_alone(hook):
    model = random_opt()
    layer = model.model.decoder.layers[1]
    calls = []
    if hook == "backward_pre_fc2":
        layer.fc2.register_full_backward_pre_hook(lambda m, g: calls.append(hook))
    else:
        (layer.fc1 if hook == "full_backward_fc1" else layer.self_attn.out_proj).register_full_backward_hook(
            lambda m, gi, go: calls.append(hook))
    ids = _ids(model, seq=9)
    model(ids).logits.sum().backward()
    ref_calls = len(calls)
    report = fuseinfer.patch(model)
    assert any(name.startswith("model.decoder.layers.1") for name, _ in report.skipped), report
    model(ids).logits.sum().backward()
    assert ref_calls == 1 and len(calls) == 2


def test_global_module_hooks_see_every_call():
    """A hook for every module (register_module_forward_hook, as profilers use) sees the unpatched model's calls:
    while one is registered the fused modules run their original forwards."""
    model = random_opt()
    ids = _ids(model, seq=9)
    ref = _logits(model, ids)
    fuseinfer.patch(model)
    calls = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: calls.append(type(m).__name__))
    try:
        torch.testing.assert_close(_logits(model, ids), ref, rtol=1e-5, atol=1e-5)
        patched_calls = list(calls)
        fuseinfer.unpatch(model)
        calls.clear()
        _logits(model, ids)
    finally:
        handle.remove()
    assert len(patched_calls) == len(calls) and calls.count("Linear") == 13
    backward = []  # and a hook for every module's backward
    handle = torch.nn.modules.module.register_module_full_backward_hook(lambda m, gi, go: backward.append(1))
    try:
        model(ids).logits.sum().backward()
        ref_calls, backward[:] = len(backward), []
        fuseinfer.patch(model)
        model(ids).logits.sum().backward()
    finally:
        handle.remove()
    assert len(backward) == ref_calls > 13


def test_output_attentions_on_patched_model():
    """output_attentions=True returns the attention weights (those calls take eager attention)."""
    from transformers import OPTForCausalLM

    base = random_opt()
    model = OPTForCausalLM._from_config(base.config, attn_implementation="eager").eval()
    model.load_state_dict(base.state_dict())
    ids = _ids(model, seq=17)
    with torch.no_grad():
        ref = model(ids, output_attentions=True)
        fuseinfer.patch(model)
        ours = model(ids, output_attentions=True)
    assert len(ours.attentions) == len(ref.attentions) == model.config.num_hidden_layers
    for a, b in zip(ours.attentions, ref.attentions):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.logits, ref.logits, rtol=1e-5, atol=1e-5)


def test_filter_fn_that_raises_leaves_the_model_untouched():
    model = random_opt()
    before = _snapshot(model)

    def filter_fn(module, name):
        if name.endswith("layers.1"):
            raise RuntimeError("user filter failed")
        return True

    with pytest.raises(RuntimeError, match="user filter failed"):
        fuseinfer.patch(model, PatchConfig(filter_fn=filter_fn))
    assert _snapshot(model) == before
    assert not any(hasattr(m, "qkv_weight") for m in model.modules())
    fuseinfer.patch(model)  # a clean patch afterwards
    fuseinfer.unpatch(model)
    assert _snapshot(model) == before


def test_patch_through_torch_compile_wrapper_and_own_generate_restored():
    """patch(torch.compile(model)) patches the wrapped model (generate works through the wrapper); unpatch puts
    back a generate the model had as an instance attribute."""
    model = random_opt()
    own_calls = []
    own = lambda *a, **k: own_calls.append(1) or type(model).generate(model, *a, **k)  # noqa: E731
    model.generate = own
    compiled = torch.compile(model)
    ids = _ids(model, batch=1, seq=7)
    ref = type(model).generate(model, ids, max_new_tokens=5, do_sample=False)
    fuseinfer.patch(compiled)
    assert fuseinfer.patch_report(model) is not None
    assert torch.equal(compiled.generate(ids, max_new_tokens=5, do_sample=False), ref)
    assert torch.equal(fuseinfer.generate(compiled, ids, max_new_tokens=5), ref)
    compiled.generate(ids, max_new_tokens=5, do_sample=False, num_beams=2,
                      return_dict_in_generate=True)  # middle path: runs the user's
    assert own_calls == [1]
    fuseinfer.unpatch(compiled)
    assert model.generate is own


def test_one_kernel_step_refuses_skipped_layers_and_hooks(monkeypatch):
    """The one-kernel decode step reads every layer's weights itself: not when patch skipped a layer, nor when
    any module has hooks (the per-op step, which calls the modules, runs instead)."""
    import types

    from fuseinfer.models.opt.decode import decode_step_kernel

    monkeypatch.setenv("FUSEINFER_DECODE_KERNEL", "1")
    cache = types.SimpleNamespace(key_mask=torch.ones(1, 16, dtype=torch.bool))
    model = random_opt()
    model.model.decoder.layers[1].fc1.register_forward_hook(lambda m, i, o: o)
    fuseinfer.patch(model)
    assert "not fully fused" in decode_step_kernel(model, cache)[1]
    model = random_opt()
    fuseinfer.patch(model)
    handle = model.lm_head.register_forward_hook(lambda m, i, o: o)
    assert "has hooks" in decode_step_kernel(model, cache)[1]
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: o)
    try:
        assert "has hooks" in decode_step_kernel(model, cache)[1]
    finally:
        handle.remove()
    for overrides, why in ((dict(do_layer_norm_before=False), "post-LN OPT"),
                           (dict(word_embed_proj_dim=32), "projected embeddings"),
                           (dict(activation_function="gelu"), "the kernel covers ReLU"),
                           (dict(enable_bias=False), "the kernel covers ReLU")):
        other = random_opt(**overrides)
        fuseinfer.patch(other)
        assert why in decode_step_kernel(other, cache)[1]
    attn = model.model.decoder.layers[0].self_attn  # the step would read the fused buffer, no longer q's weights
    attn.q_proj.weight.data = attn.q_proj.weight.detach().clone()
    assert "replaced after patch" in decode_step_kernel(model, cache)[1]


def test_patch_config_ops_must_be_a_tuple_of_names():
    with pytest.raises(FuseInferError, match="PatchConfig.ops must be a tuple of op names"):
        PatchConfig(ops=None)
