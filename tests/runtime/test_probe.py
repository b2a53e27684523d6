"""The model probe (fuseinfer/runtime/probe.py) that spares generate calls a walk over the modules, and the memo of
the generation-config comparisons (hf_generate._memo): whatever changes a model or a config between calls, the
cached answers equal the full computation (the weights key of the walk, accelerate's hook test, to_diff_dict)."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import random_opt
from helpers import given, settings, st
from torch import nn

import fuseinfer
from fuseinfer.core import placement
from fuseinfer.runtime import hf_generate, probe as probe_mod
from fuseinfer.runtime.decode import SESSIONS_ATTR
from fuseinfer.runtime.probe import PROBE_ATTR, one_check, probe, weights_key_walk


def _assert_fresh(model):
    p = probe(model)
    assert p.key == weights_key_walk(model)
    assert p.hooked == placement.is_hooked(model)
    return p


class _Hook:  # stands in for an accelerate hook: only its presence matters here
    pass


def _move(model):
    model.to(torch.bfloat16)


def _swap_data(model):
    w = model.model.decoder.layers[0].fc1.weight
    w.data = w.data.clone()


def _new_parameter(model):
    layer = model.model.decoder.layers[1].fc2
    layer.weight = nn.Parameter(layer.weight.detach().clone())


def _assign_load(model):
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)


def _replace_module(model):
    layers = model.model.decoder.layers
    layers[0] = copy.deepcopy(layers[0])


def _new_buffer(model):
    model.model.decoder.layers[0].register_buffer("extra", torch.zeros(3))


def _drop_bias(model):
    model.model.decoder.layers[0].fc1.bias = None


def _hook(model):
    model.model.decoder.layers[1].__dict__["_hf_hook"] = _Hook()


def _unhook(model):
    model.model.decoder.layers[1].__dict__.pop("_hf_hook", None)


def _device_map(model):
    model.hf_device_map = {"model.decoder.layers.0": "cpu", "lm_head": "meta"}


CHANGES = [_move, _swap_data, _new_parameter, _assign_load, _replace_module, _new_buffer, _drop_bias, _hook,
           _device_map]


@pytest.mark.parametrize("change", CHANGES, ids=[c.__name__.strip("_") for c in CHANGES])
def test_every_change_is_seen(change):
    model = random_opt()
    fuseinfer.patch(model)
    before = _assert_fresh(model)
    change(model)
    after = _assert_fresh(model)
    assert after is not before


def test_in_place_writes_keep_the_probe():
    """load_state_dict without assign and in-place updates keep every address: no walk, the sessions stay."""
    model = random_opt()
    fuseinfer.patch(model)
    before = _assert_fresh(model)
    model.load_state_dict({k: v.clone() + 1 for k, v in model.state_dict().items()})
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    assert probe(model) is before
    _assert_fresh(model)


@settings(max_examples=25, deadline=None, database=None)
@given(st.lists(st.sampled_from(CHANGES + [_unhook, None]), min_size=1, max_size=5))
def test_probe_equals_the_walk_after_any_changes(changes):
    model = random_opt()
    fuseinfer.patch(model)
    _assert_fresh(model)
    for change in changes:
        if change is not None:
            change(model)
        _assert_fresh(model)


def test_one_check_per_call_scope(monkeypatch):
    model = random_opt()
    fuseinfer.patch(model)
    probe(model)
    checks = []
    same = probe_mod.ModelProbe.same
    monkeypatch.setattr(probe_mod.ModelProbe, "same", lambda self, m: checks.append(1) or same(self, m))
    with one_check(model):
        first = probe(model)
        assert probe(model) is first and probe(model) is first
        with one_check(model):  # (nested: the outer scope's check holds)
            assert probe(model) is first
    assert len(checks) == 1
    _move(model)  # outside a scope every use checks
    assert probe(model) is not first and len(checks) == 2


def test_generate_after_a_move_and_a_parameter_swap_matches_a_fresh_model():
    """Through model.generate (one check per call): a swapped parameter's new values are used."""
    model = random_opt()
    fuseinfer.patch(model)
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    model.generate(ids, max_new_tokens=4, do_sample=False)
    sessions = dict(model.__dict__[SESSIONS_ATTR])
    head = model.lm_head.weight
    model.lm_head.weight = nn.Parameter(torch.randn_like(head))  # (ties broken: a new head)
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert all(model.__dict__[SESSIONS_ATTR].get(k) is not v for k, v in sessions.items() if isinstance(k, int))
    fresh = random_opt()
    fuseinfer.patch(fresh)
    fresh.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    assert torch.equal(out, fresh.generate(ids, max_new_tokens=4, do_sample=False))


def test_release_copy_and_pickle_drop_the_probe(tmp_path):
    model = random_opt()
    fuseinfer.patch(model)
    probe(model)
    assert copy.deepcopy(model).__dict__.get(PROBE_ATTR) is None
    torch.save(model, tmp_path / "m.pt")
    assert torch.load(tmp_path / "m.pt", weights_only=False).__dict__.get(PROBE_ATTR) is None
    fuseinfer.unpatch(model)
    assert PROBE_ATTR not in model.__dict__


# ---- the memo of config comparisons ----

def test_memo_follows_config_changes():
    model = random_opt()
    cfg = model.generation_config
    calls = []

    def diff():
        calls.append(1)
        return frozenset(cfg.to_diff_dict())

    first = hf_generate._memo(cfg, "t-diff", diff)
    assert hf_generate._memo(cfg, "t-diff", diff) is first and len(calls) == 1
    cfg.repetition_penalty = 1.3  # a field set between calls
    second = hf_generate._memo(cfg, "t-diff", diff)
    assert "repetition_penalty" in second and len(calls) == 2
    cfg.bad_words_ids = [[5, 6]]
    assert "bad_words_ids" in hf_generate._memo(cfg, "t-diff", diff)
    cfg.bad_words_ids[0].append(7)  # mutated in place: the deep copy sees it
    hf_generate._memo(cfg, "t-diff", diff)
    assert len(calls) == 4


def test_memo_without_value_equality_computes_every_time():
    model = random_opt()
    cfg = model.generation_config
    cfg.extra_tensor = torch.arange(3)  # == is elementwise: no memo, the value is still right
    calls = []
    for _ in range(2):
        assert hf_generate._memo(cfg, "t-tensor", lambda: calls.append(1) or len(calls)) == len(calls)
    assert len(calls) == 2


def test_generate_sees_a_generation_config_change_between_calls():
    """A setting put on model.generation_config after a first call changes the next call's path and tokens."""
    model = random_opt()
    fuseinfer.patch(model)
    ids = torch.randint(3, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    plain = model.generate(ids, max_new_tokens=6, do_sample=False)
    model.generation_config.repetition_penalty = 5.0
    penalised = model.generate(ids, max_new_tokens=6, do_sample=False)
    ref = random_opt()
    ref.generation_config.repetition_penalty = 5.0
    assert torch.equal(penalised, ref.generate(ids, max_new_tokens=6, do_sample=False))
    model.generation_config.repetition_penalty = None
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), plain)
