"""What the feature packages ask of a model family, on OPT: decoder layers, quantization targets, q/k/v relinking,
SmoothQuant's groups, the profiler's module kinds, the published configurations behind ``random:`` and the model
built from one; and ``random:`` names resolved through every registered family."""
from __future__ import annotations

import sys
import types

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from conftest import random_opt
from fuseinfer import FuseInferError, models
from fuseinfer.core.config import PatchConfig
from fuseinfer.harness.errors import EvalError
from fuseinfer.harness.models import SHORT_NAMES, load_config, published_names, resolve_model
from fuseinfer.patching import patch

FAM = models.family("opt")


def test_family_of_a_model_and_of_none():
    assert models.family_of(random_opt()) is FAM
    assert models.family_of(nn.Linear(2, 2)) is None


def test_decoder_layers():
    model = random_opt(num_hidden_layers=3)
    prefix, layers = FAM.decoder_layers(model)
    assert prefix == "model.decoder.layers" and model.get_submodule(prefix) is layers and len(layers) == 3
    assert FAM.decoder_layers(model.model)[1] is layers  # an OPTModel too
    with pytest.raises(FuseInferError, match="decoder layers"):
        FAM.decoder_layers(nn.Sequential(nn.Linear(2, 2)))


def test_quant_targets_are_every_decoder_linear():
    model = random_opt(num_hidden_layers=2)
    targets = FAM.quant_targets(model)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n]
    assert targets == linears and len(targets) == 6 * 2
    assert all(t.rsplit(".", 1)[-1] in set(FAM.qkv_names) | {"out_proj", "fc1", "fc2"} for t in targets)


@pytest.mark.parametrize("pre_ln", [True, False])
def test_smoothing_groups_fold_into_what_produces_the_input(pre_ln):
    model = random_opt(num_hidden_layers=2, do_layer_norm_before=pre_ln)
    modules = dict(model.named_modules())
    groups = FAM.smoothing_groups(model)
    assert len(groups) == 4 * 2
    for g in groups:
        src = modules[g.source]
        width = src.normalized_shape[0] if g.kind == "layernorm" else src.out_features
        assert g.kind in ("layernorm", "linear_rows")
        assert all(modules[t].in_features == width for t in g.targets), g  # the targets read what source makes
        assert g.what.startswith(g.source.rsplit(".", 2)[0] if g.kind == "layernorm" else g.what.split(" ")[0])
    skipped = [g for g in groups if g.skipped]
    if pre_ln:
        assert not skipped
    else:  # the LayerNorm output is the residual stream: both LayerNorm groups of every layer are skipped
        assert [g.kind for g in skipped] == ["layernorm"] * 4 and "residual stream" in skipped[0].skipped
    assert {g.targets[0] for g in groups if g.kind == "layernorm"} >= {f"model.decoder.layers.0.self_attn.{n}"
                                                                         for n in FAM.qkv_names[:1]}


def test_a_non_relu_activation_skips_the_mlp_group():
    groups = FAM.smoothing_groups(random_opt(activation_function="gelu"))
    skipped = [g for g in groups if g.skipped]
    assert len(skipped) == 2 and all("not ReLU" in g.skipped and g.kind == "linear_rows" for g in skipped)


def test_relink_qkv_makes_the_projections_views_of_the_fused_buffer_again():
    model = random_opt()
    patch(model, PatchConfig())
    attn = model.model.decoder.layers[0].self_attn
    projs = [getattr(attn, n) for n in FAM.qkv_names]
    params = [p.weight for p in projs]
    for p in projs:  # what a quantizer's undo does: own copies, then the rows of a rebuilt buffer
        p.weight.data = p.weight.detach().clone()
    attn.__dict__["qkv_weight"] = torch.cat([p.weight for p in projs])
    FAM.relink_qkv(attn)
    e = attn.embed_dim
    for i, p in enumerate(projs):
        assert p.weight is params[i]  # the same Parameter objects
        assert p.weight.data_ptr() == attn.qkv_weight.data_ptr() + i * e * e * attn.qkv_weight.element_size()


def test_module_kinds_name_modules_of_the_model_with_the_profiler_kinds():
    from fuseinfer.profile.trace import COARSE

    kinds = FAM.module_kinds()
    model = random_opt(word_embed_proj_dim=32)  # project_in / project_out exist
    attrs = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    assert set(kinds) <= attrs and set(kinds.values()) <= set(COARSE)
    assert {kinds[n] for n in FAM.qkv_names} == {"qkv"}


def test_published_configs_build_with_the_family_config_class():
    from transformers import OPTConfig

    table = FAM.random_configs()
    assert FAM.config_class() is OPTConfig and "facebook/opt-1.3b" in table
    cfg = FAM.build_config("facebook/opt-1.3b")
    assert isinstance(cfg, OPTConfig) and (cfg.hidden_size, cfg.num_hidden_layers) == (2048, 24)
    with pytest.raises(FuseInferError, match="facebook/opt-125m"):
        FAM.build_config("facebook/opt-7b")
    assert all(hasattr(cfg, f) for f in FAM.config_fields)


def test_empty_model_is_on_meta_with_the_config_shapes():
    cfg = FAM.build_config("facebook/opt-125m")
    model = FAM.empty_model(cfg, torch.float16)
    assert not model.training and {p.device.type for p in model.parameters()} == {"meta"}
    assert next(model.parameters()).dtype == torch.float16
    assert len(FAM.decoder_layers(model)[1]) == cfg.num_hidden_layers


def test_random_names_resolve_through_the_family():
    opt_names = {name: kind for name, kind in models.random_configs().items() if kind == "opt"}
    assert opt_names == {name: "opt" for name in FAM.random_configs()}
    assert set(SHORT_NAMES) == set(published_names()) == {n.split("/")[1].lower() for n in models.random_configs()}
    assert {n.split("/")[1] for n in FAM.random_configs()} <= set(published_names())
    for short, hub_id in published_names().items():
        source = resolve_model(f"random:{short}")
        assert source.random_weights and source.path == hub_id
        family = models.family(models.random_configs()[hub_id])
        assert load_config(source).to_dict() == family.build_config(hub_id).to_dict()


@settings(max_examples=25, deadline=None)
@given(st.from_regex(r"[a-z][a-z0-9.-]{0,12}", fullmatch=True))
def test_an_unknown_name_lists_every_family_name(name):
    if name in published_names():
        return
    with pytest.raises(EvalError) as err:
        resolve_model(f"random:{name}")
    assert all(short in str(err.value) for short in published_names())


def test_a_later_family_adds_its_names_by_itself(monkeypatch):
    light = types.ModuleType("fake_family_configs")
    light.RANDOM_CONFIGS = {"acme/fake-7b": {"hidden_size": 8}}
    monkeypatch.setitem(sys.modules, "fake_family_configs", light)
    monkeypatch.setitem(models._CONFIGS, "fake", "fake_family_configs")
    assert resolve_model("random:fake-7b").path == "acme/fake-7b"
    with pytest.raises(EvalError, match="opt-125m.*fake-7b"):
        resolve_model("random:nothing")


def test_random_quantized_refuses_an_unknown_size_listing_the_names():
    from fuseinfer.quant.random_init import random_quantized

    with pytest.raises(FuseInferError, match="opt-125m.*opt-66b"):
        random_quantized("opt-7b", device="cpu")


def test_mlp_width_and_row_read_tensors():
    """The profiler's MLP width is OPT's ffn_dim; the tensor a decode step reads one row of is the position table,
    which the eval's weight bytes per token leave out."""
    from fuseinfer.harness.models import model_stats
    from fuseinfer.models import family_of

    model = random_opt(hidden_size=32, num_attention_heads=2, ffn_dim=48, num_hidden_layers=1)
    fam = family_of(model)
    assert fam.intermediate_size(model.config) == 48
    (table,) = fam.row_read_tensors(model)
    assert table is model.model.decoder.embed_positions.weight
    stats = model_stats(model)
    params = sum(p.numel() for p in model.parameters())
    assert stats.weight_bytes_per_token == (params - table.numel()) * table.element_size()
