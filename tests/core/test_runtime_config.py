"""fuseinfer.RuntimeConfig: validation (one FuseInferError naming the allowed values), its FUSEINFER_* knobs as
defaults only (read when a config is built; an explicit field wins), PatchConfig carrying it (pickling, deep
copies), and the runtime following the patched model's config rather than the environment of the moment."""
from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch
from conftest import random_opt
from hypothesis import given, settings
from hypothesis import strategies as st

import fuseinfer
from fuseinfer import FuseInferError, PatchConfig, RuntimeConfig
from fuseinfer.core import knobs
from fuseinfer.runtime import prefill as pf
from fuseinfer.runtime.cache import COUNTS

GOOD = {"decode_kernel": ("auto", "on", "off"), "cuda_graphs": (True, False), "graph_steps": (1, 16, 64),
        "prefill": ("auto", "graph", "lean", "module"), "tp_graphs": (True, False), "kv_cache": ("auto", "fp8")}
# values of the wrong kind or outside the choices, including the knobs' spellings ("0" / "1")
BAD = st.one_of(st.text(max_size=6), st.integers(-5, 0), st.floats(allow_nan=False), st.none(),
                st.sampled_from(["0", "1", "yes", "Lean", 1.0, 0]))


@settings(max_examples=80, deadline=None)
@given(name=st.sampled_from(sorted(GOOD)), value=BAD)
def test_a_bad_field_is_one_clear_error_naming_the_allowed_values(name, value):
    ok = value in GOOD[name] and type(value) is type(GOOD[name][0])
    if ok:
        assert getattr(RuntimeConfig(**{name: value}), name) == value
        return
    with pytest.raises(FuseInferError) as caught:
        RuntimeConfig(**{name: value})
    message = str(caught.value)
    assert f"RuntimeConfig.{name} must be" in message and "\n" not in message
    if name in ("decode_kernel", "prefill", "kv_cache"):
        assert ", ".join(GOOD[name]) in message


def test_every_field_has_a_knob_and_the_knob_names_its_field():
    for f in dataclasses.fields(RuntimeConfig):
        assert knobs.KNOBS[RuntimeConfig.knob_of(f.name)].field == f.name
    assert {k.field for k in knobs.KNOBS.values() if k.field} == {f.name for f in dataclasses.fields(RuntimeConfig)}


@pytest.mark.parametrize("knob, value, name, expected", [
    ("FUSEINFER_PREFILL", "lean", "prefill", "lean"), ("FUSEINFER_DECODE_KERNEL", "0", "decode_kernel", "off"),
    ("FUSEINFER_DECODE_KERNEL", "1", "decode_kernel", "on"), ("FUSEINFER_CUDA_GRAPHS", "0", "cuda_graphs", False),
    ("FUSEINFER_DECODE_GRAPH_STEPS", "4", "graph_steps", 4), ("FUSEINFER_TP_GRAPHS", "0", "tp_graphs", False),
    ("FUSEINFER_KV_CACHE", "fp8", "kv_cache", "fp8")])
def test_the_knob_is_the_default_and_an_explicit_field_beats_it(monkeypatch, knob, value, name, expected):
    assert getattr(RuntimeConfig(), name) == {f.name: f for f in dataclasses.fields(RuntimeConfig)}[name] \
        .default_factory()  # (unset: the built-in default)
    monkeypatch.setenv(knob, value)
    assert getattr(RuntimeConfig(), name) == expected
    assert getattr(PatchConfig().runtime, name) == expected  # PatchConfig() builds one
    explicit = next(v for v in GOOD[name] if v != expected)
    assert getattr(RuntimeConfig(**{name: explicit}), name) == explicit
    monkeypatch.setenv(knob, "nonsense")
    with pytest.raises(FuseInferError, match=knob):  # a bad knob names the knob
        RuntimeConfig()
    assert getattr(RuntimeConfig(**{name: explicit}), name) == explicit  # (not read when given)


def test_patch_config_carries_a_runtime_config_through_pickle_and_deepcopy(monkeypatch):
    config = PatchConfig(ops=("linear",), runtime=RuntimeConfig(prefill="lean", graph_steps=3))
    monkeypatch.setenv("FUSEINFER_PREFILL", "module")  # (an unpickled config keeps its values, not the knob's)
    back = pickle.loads(pickle.dumps(config))
    assert back == config and back.runtime == RuntimeConfig(prefill="lean", graph_steps=3)
    assert copy.deepcopy(config) is config
    with_filter = PatchConfig(filter_fn=lambda m, n: True, runtime=RuntimeConfig(decode_kernel="off"))
    assert pickle.loads(pickle.dumps(with_filter)).runtime.decode_kernel == "off"
    with pytest.raises(FuseInferError, match="PatchConfig.runtime must be a fuseinfer.RuntimeConfig"):
        PatchConfig(runtime={"prefill": "lean"})


def _generate(model, ids):
    """(tokens, prefill graphs captured, lean-loop calls) of one fuseinfer.generate."""
    calls = []
    lean = pf.lean_logits
    pf.lean_logits = lambda *a, **k: calls.append(1) or lean(*a, **k)
    try:
        before = COUNTS["prefill_graph"]
        out = fuseinfer.generate(model, ids, max_new_tokens=4)
    finally:
        pf.lean_logits = lean
    return out, COUNTS["prefill_graph"] - before, len(calls)


def test_the_runtime_follows_the_models_config_not_the_environment(tiny_model_path, monkeypatch):
    """A model patched with prefill='lean' runs the lean loop though FUSEINFER_PREFILL says module, and one patched
    with prefill='module' the modules though it says lean; a model patched without a runtime setting follows the
    knob as it was at patch time; set_runtime / using_runtime change a patched model's config."""
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[2, 133, 2064, 16, 10, 1539]])
    lean_model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    module_model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    default_model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    fuseinfer.patch(lean_model, PatchConfig(runtime=RuntimeConfig(prefill="lean")))
    fuseinfer.patch(module_model, PatchConfig(runtime=RuntimeConfig(prefill="module")))
    monkeypatch.setenv("FUSEINFER_PREFILL", "module")
    fuseinfer.patch(default_model)  # the knob, read now: module
    monkeypatch.setenv("FUSEINFER_PREFILL", "lean")  # (changing the environment later changes nothing)
    lean_out, graphs, lean_calls = _generate(lean_model, ids)
    assert lean_calls == 1 and graphs == 0
    monkeypatch.setenv("FUSEINFER_PREFILL", "module")
    module_out, _, module_calls = _generate(module_model, ids)
    assert module_calls == 0 and torch.equal(module_out, lean_out)
    monkeypatch.setenv("FUSEINFER_PREFILL", "lean")
    assert _generate(default_model, ids)[2] == 0
    assert fuseinfer.patch_state(default_model).config.runtime.prefill == "module"
    with fuseinfer.runtime.using_runtime(default_model, prefill="lean"):
        assert _generate(default_model, ids)[2] == 1
    assert fuseinfer.patch_state(default_model).config.runtime.prefill == "module"
    old = fuseinfer.runtime.set_runtime(default_model, RuntimeConfig(prefill="auto"))
    assert old.prefill == "module" and _generate(default_model, ids)[2] == 1  # (auto on CPU: the lean loop)


def test_set_runtime_rebuilds_sessions_and_checks_its_arguments():
    model = random_opt()
    with pytest.raises(FuseInferError, match="set_runtime needs a patched model"):
        fuseinfer.runtime.set_runtime(model, prefill="lean")
    fuseinfer.patch(model, PatchConfig(runtime=RuntimeConfig(graph_steps=2)))
    ids = torch.tensor([[5, 6, 7]])
    fuseinfer.generate(model, ids, max_new_tokens=3)
    (session,) = model.__dict__["_fuseinfer_sessions"].values()
    assert session.graph_steps == 2 and session.path.startswith("per op")
    fuseinfer.runtime.set_runtime(model, graph_steps=5, decode_kernel="off")
    assert "_fuseinfer_sessions" not in model.__dict__  # released: the next call builds them under the new config
    fuseinfer.generate(model, ids, max_new_tokens=3)
    (session,) = model.__dict__["_fuseinfer_sessions"].values()
    assert session.graph_steps == 5 and "decode_kernel='off'" in session.path
    with pytest.raises(FuseInferError, match="unknown RuntimeConfig field"):
        fuseinfer.runtime.set_runtime(model, prefil="lean")
    with pytest.raises(FuseInferError, match="RuntimeConfig.prefill must be one of"):
        fuseinfer.runtime.set_runtime(model, prefill="fast")
    with pytest.raises(FuseInferError, match="takes a fuseinfer.RuntimeConfig"):
        fuseinfer.runtime.set_runtime(model, {"prefill": "lean"})
