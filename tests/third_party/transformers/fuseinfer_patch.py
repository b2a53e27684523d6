"""pytest plugin for the vendored transformers tests: records each test's outcome and, with
``HFSUITE_PATCH=1``, patches every model the tests build with ``fuseinfer.patch``.

Loaded with ``-p fuseinfer_patch`` by ``tests/models/llama/test_transformers_suite.py``, which runs the suite twice
(unpatched, patched) and compares the outcomes. The hook: each model class of the patched families gets its
``__init__`` wrapped, so that the outermost constructor (``LlamaForCausalLM`` builds a ``LlamaModel`` inside it) patches
the finished model; a model built on the meta device (``from_pretrained`` builds there, then loads the weights) is
patched when ``from_pretrained`` returns instead. ``HFSUITE_OUT`` names the JSON file the outcomes go to:
``{"outcomes": {test id: "passed" | "failed" | "skipped"}, "patched": {test id: models patched}}``.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import threading

import pytest

PATCH = os.environ.get("HFSUITE_PATCH") == "1"
FAMILIES = ("llama", "mistral", "qwen2")  # transformers.models.<name>.modeling_<name> whose classes get patched
_local = threading.local()
_state = {"outcomes": {}, "patched": {}, "current": None}


def _patch(model) -> None:
    import fuseinfer

    if any(p.is_meta for p in model.parameters()) or fuseinfer.patch_state(model) is not None:
        return
    # a freshly built model is in training mode, where patch leaves the attention alone; patch it as in inference
    # (every swap made) and hand it back in the mode it came in (in training the fused modules run the originals)
    training = model.training
    model.eval()
    try:
        fuseinfer.patch(model)
    finally:
        model.train(training)
    test = _state["current"]
    _state["patched"][test] = _state["patched"].get(test, 0) + 1


def _wrap_init(cls) -> None:
    init = cls.__dict__["__init__"]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        depth = getattr(_local, "depth", 0)
        _local.depth = depth + 1
        try:
            init(self, *args, **kwargs)
        finally:
            _local.depth = depth
        if depth == 0 and type(self) is cls:  # the outermost constructor of the class asked for
            _patch(self)

    cls.__init__ = __init__


def _wrap_from_pretrained() -> None:
    from transformers import PreTrainedModel

    original = PreTrainedModel.from_pretrained.__func__

    @functools.wraps(original)
    def from_pretrained(cls, *args, **kwargs):
        model = original(cls, *args, **kwargs)
        if getattr(getattr(model, "config", None), "model_type", None) in FAMILIES:
            _patch(model)
        return model

    PreTrainedModel.from_pretrained = classmethod(from_pretrained)


def pytest_configure(config):
    if not PATCH:
        return
    from transformers import PreTrainedModel

    for family in FAMILIES:
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if (issubclass(cls, PreTrainedModel) and cls.__module__ == module.__name__ and "__init__" in cls.__dict__):
                _wrap_init(cls)
    _wrap_from_pretrained()


def pytest_runtest_logstart(nodeid, location):
    _state["current"] = nodeid


@pytest.hookimpl
def pytest_runtest_logreport(report):
    outcomes = _state["outcomes"]
    if report.failed:
        outcomes[report.nodeid] = "failed"
    elif report.skipped and outcomes.get(report.nodeid) != "failed":
        outcomes[report.nodeid] = "skipped"
    elif report.when == "call" and report.passed:
        outcomes.setdefault(report.nodeid, "passed")


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("HFSUITE_OUT")
    if out:
        with open(out, "w") as f:
            json.dump({"outcomes": _state["outcomes"], "patched": _state["patched"]}, f, indent=1, sort_keys=True)
