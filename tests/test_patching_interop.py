"""A patched model against transformers' own machinery: models built on its config, the tied-weights and shared-
tensor checks of save / load / init, and what ``named_buffers`` / ``state_dict`` show."""
from __future__ import annotations

import warnings

import pytest
import torch
from transformers import OPTForCausalLM

import fuseinfer
from fuseinfer import FuseInferError

from conftest import random_opt


def _ids(model, batch=2, length=7):
    return torch.randint(3, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def _logits(model, ids):
    return model(input_ids=ids).logits


def test_model_built_on_a_patched_config_runs_and_patches():
    """OPTForCausalLM(patched.config) starts with the fuseinfer attention (it runs on unpatched modules too) and
    can be patched itself; a part of a patched model still cannot."""
    model = random_opt()
    fuseinfer.patch(model)
    other = OPTForCausalLM(model.config).eval()
    other.load_state_dict(random_opt().state_dict())
    ids = _ids(other)
    with torch.no_grad():
        assert other.config._attn_implementation == "fuseinfer"
        expected = _logits(random_opt(), ids)  # the same weights with transformers' own attention
        torch.testing.assert_close(_logits(other, ids), expected, rtol=1e-5, atol=1e-5)
        report = fuseinfer.patch(other)
        assert report.swaps
        torch.testing.assert_close(_logits(other, ids), expected, rtol=1e-5, atol=1e-5)
    fuseinfer.unpatch(other)
    assert other.config._attn_implementation == "fuseinfer"  # as it was before patching
    with pytest.raises(FuseInferError, match="part of"):
        fuseinfer.patch(model.model)
    fuseinfer.unpatch(model)
    assert model.config._attn_implementation != "fuseinfer"


def test_state_dict_and_tied_weights_keys_unchanged_by_patch():
    model = random_opt()
    keys, tied = list(model.state_dict()), model.get_expanded_tied_weights_keys()
    buffers = [n for n, _ in model.named_buffers()]
    fuseinfer.patch(model)
    assert list(model.state_dict()) == keys
    assert model.get_expanded_tied_weights_keys() == tied
    # the fused (3E, E) q/k/v tensor is kept outside the buffer registry: named_buffers lists what it listed
    assert [n for n, _ in model.named_buffers()] == buffers
    assert model.model.decoder.layers[0].self_attn.qkv_weight is not None


def _shared_storage_groups(model) -> list[list[str]]:
    """transformers' tied-weights check (test_modeling_common's test_tied_weights_keys): state_dict names grouped
    by the storage their tensors share (``id_tensor_storage``), groups of two or more."""
    import collections

    from transformers.pytorch_utils import id_tensor_storage

    ptrs = collections.defaultdict(list)
    for name, tensor in model.state_dict().items():
        ptrs[id_tensor_storage(tensor)].append(name)
    return sorted(names for names in ptrs.values() if len(names) > 1)


@pytest.mark.parametrize("tie", [True, False])
def test_patched_at_construction_reports_only_the_declared_tied_weights(tie):
    """A model patched right after it is built shows transformers' tied-weight checks what the unpatched one does:
    the q/k/v views of the fused tensor are no undeclared ties; the declared ones (lm_head / embed_tokens) remain;
    state_dict(keep_vars=True) still hands out the Parameters themselves."""
    plain = random_opt(tie_word_embeddings=tie)
    model = random_opt(tie_word_embeddings=tie)
    fuseinfer.patch(model)
    assert _shared_storage_groups(model) == _shared_storage_groups(plain)
    assert [n for n, _ in model.named_buffers()] == [n for n, _ in plain.named_buffers()]
    attn = model.model.decoder.layers[0].self_attn
    assert model.state_dict(keep_vars=True)["model.decoder.layers.0.self_attn.q_proj.weight"] is attn.q_proj.weight
    fuseinfer.unpatch(model)
    assert not attn._state_dict_hooks


def test_to_dtype_and_deepcopy_keep_the_fused_tensor_linked():
    """``model.to(dtype)`` converts the fused q/k/v tensor (a plain attribute) and the projections stay views of
    it; a deep copy gets its own, linked the same way."""
    import copy

    from fuseinfer.models.opt.modules import _qkv_linked, _qkv_params

    model = random_opt()
    ids = _ids(model)
    fuseinfer.patch(model)
    expected = _logits(model, ids)
    model.to(torch.float64)
    for m in (model, copy.deepcopy(model)):
        attn = m.model.decoder.layers[1].self_attn
        assert attn.qkv_weight.dtype == torch.float64 and _qkv_linked(attn, _qkv_params(attn))
        assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.qkv_weight.untyped_storage().data_ptr()
        torch.testing.assert_close(_logits(m, ids).float(), expected, rtol=1e-4, atol=1e-4)


def test_save_load_and_init_paths_keep_the_fused_buffer(tmp_path):
    """save_pretrained raises no shared-tensor error or warning (the q/k/v views are disjoint and transformers clones
    them), from_pretrained gives the same logits, load_state_dict and tie_weights / init on the patched model still
    reach the fused GEMM (the q/k/v Parameters stay views of the buffer)."""
    model = random_opt()
    ids = _ids(model)
    fuseinfer.patch(model)
    expected = _logits(model, ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a shared-tensor warning would fail here
        model.save_pretrained(tmp_path)
    loaded = OPTForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(_logits(loaded, ids), expected, rtol=1e-5, atol=1e-5)
    # load new weights into the patched model: the fused buffer sees them
    other = random_opt(seed=3)
    model.load_state_dict(other.state_dict())
    torch.testing.assert_close(_logits(model, ids), _logits(other, ids), rtol=1e-5, atol=1e-5)
    model.tie_weights()
    attn = model.model.decoder.layers[0].self_attn
    e = attn.embed_dim
    assert attn.k_proj.weight.data_ptr() == attn.qkv_weight.data_ptr() + e * e * attn.qkv_weight.element_size()
    torch.testing.assert_close(_logits(model, ids), _logits(other, ids), rtol=1e-5, atol=1e-5)


def test_bad_inputs_to_the_patched_forward_are_one_clear_error():
    model = random_opt()
    fuseinfer.patch(model)
    with pytest.raises(FuseInferError, match=r"empty input: input_ids has shape \(0, 5\)"):
        model(input_ids=torch.zeros(0, 5, dtype=torch.long))
    too_long = torch.ones(1, model.config.max_position_embeddings + 1, dtype=torch.long)
    with pytest.raises(FuseInferError, match="exceed the model's max_position_embeddings"):
        model(input_ids=too_long)
    fuseinfer.unpatch(model)
    assert not model.model.decoder._forward_pre_hooks  # the check is gone with the patch


def test_report_says_when_only_references_run():
    model = random_opt()  # on the CPU: every op runs its reference
    report = fuseinfer.patch(model)
    assert report.references_only and "correct but slower than the unpatched model" in str(report)
