"""Model families fuseinfer can patch, by ``config.model_type``; each implements ``base.ModelFamily``.

A family's module is imported on first use (it imports transformers' modeling code), so ``import fuseinfer`` stays
light. A new family is one more entry here: ``model_type -> (module, class, architectures)``.
"""
from __future__ import annotations

import importlib

from fuseinfer.models.base import ModelFamily

_REGISTRY = {
    "opt": (".opt.family", "OPTFamily",
            ("OPTForCausalLM", "OPTModel", "OPTForSequenceClassification", "OPTForQuestionAnswering")),
    # the Llama architecture: one family module, a class per model_type (Mistral adds a sliding window, Qwen2 q/k/v
    # biases)
    "llama": (".llama.family", "LlamaFamily", ("LlamaForCausalLM", "LlamaModel")),
    "mistral": (".llama.family", "MistralFamily", ("MistralForCausalLM", "MistralModel")),
    "qwen2": (".llama.family", "Qwen2Family", ("Qwen2ForCausalLM", "Qwen2Model")),
}
_loaded: dict[str, ModelFamily] = {}
# family -> its light module (no transformers import) holding RANDOM_CONFIGS, its random: names (an entry's
# "model_type", where it has one, names its model_type; else the key does)
_CONFIGS = {"opt": ".opt.configs", "llama": ".llama.configs"}


def family(model_type: str | None) -> ModelFamily | None:
    """The family that patches ``model_type``, or None."""
    if model_type not in _REGISTRY:
        return None
    if model_type not in _loaded:
        module, cls, _ = _REGISTRY[model_type]
        _loaded[model_type] = getattr(importlib.import_module(module, __name__), cls)()
    return _loaded[model_type]


def supported() -> str:
    """'opt (OPTForCausalLM, ...)' for error messages."""
    return ", ".join(f"{k} ({', '.join(archs)})" for k, (_, _, archs) in _REGISTRY.items())


def family_of(model) -> ModelFamily | None:
    """The family of ``model`` (by its ``config.model_type``), or None."""
    return family(getattr(getattr(model, "config", None), "model_type", None))


def random_configs() -> dict[str, str]:
    """Every family's published configurations behind ``random:<name>``: hub id -> model_type. Read from the
    families' light config modules, so listing the names (e.g. for --help) loads no modeling code."""
    return {name: kwargs.get("model_type", model_type) for model_type, module in _CONFIGS.items()
            for name, kwargs in importlib.import_module(module, __name__).RANDOM_CONFIGS.items()}
