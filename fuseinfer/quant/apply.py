"""The one place that maps each quantization config to the code that applies it (the configs stay plain data).

``quantize(config, model, report)`` quantizes a model the family has just patched, in place, adding to ``report``,
and returns a state with ``check_undo()`` and ``undo(model)``; it raises FuseInferError, leaving the model as the
family's patch left it, for input it cannot quantize. A quantized model's ``save_pretrained`` (and so
``push_to_hub``) writes the fuseinfer checkpoint (``quant/checkpoint.py``) until ``undo``.
"""
from __future__ import annotations

import weakref

from fuseinfer.core.errors import FuseInferError
from fuseinfer.core.quant_config import Float8, Int8WeightOnly, QuantConfig, SmoothQuantW8A8, register_scheme
from fuseinfer.quant.fp8 import quantize_fp8
from fuseinfer.quant.w8a8 import quantize_w8a8
from fuseinfer.quant.weight_only import quantize_weight_only

HANDLERS = {Int8WeightOnly: quantize_weight_only, SmoothQuantW8A8: quantize_w8a8, Float8: quantize_fp8}


def quantize(config: QuantConfig, model, report):
    handler = HANDLERS.get(type(config))
    if handler is None:
        raise FuseInferError(f"no quantizer for {type(config).__name__}; choose from "
                             f"{', '.join(c.__name__ for c in HANDLERS)}")
    state = handler(model, config, report)
    if hasattr(model, "save_pretrained"):
        object.__setattr__(model, "save_pretrained", SavePretrained(model))
    return _Saving(state)


for _cls in HANDLERS:  # the engine (fuseinfer.patching) applies a config through core's registry
    register_scheme(_cls, quantize)


class SavePretrained:
    """A quantized model's ``save_pretrained(directory)``: ``fuseinfer.save_quantized`` (one file layout for both;
    a weak reference, so the model does not keep itself alive)."""

    # what transformers' push_to_hub passes, and values that change nothing in the one-file safetensors layout
    _IGNORED = {"max_shard_size", "is_main_process", "token"}
    _DEFAULTS = {"safe_serialization": True, "push_to_hub": False, "state_dict": None, "variant": None}

    def __init__(self, model):
        self._model = weakref.ref(model)

    def __reduce__(self):
        # deepcopy and pickle rebuild it around the copy of its model (both memoize the model, which is already
        # being rebuilt when its __dict__ reaches this object), never around the original
        return SavePretrained, (self._model(),)

    def __call__(self, save_directory, **kwargs):
        from fuseinfer.quant.checkpoint import save_quantized

        bad = [k for k, v in kwargs.items() if k not in self._IGNORED and (k not in self._DEFAULTS
                                                                          or v is not self._DEFAULTS[k])]
        if bad:
            raise FuseInferError(f"save_pretrained of a fuseinfer-quantized model writes config.json and one "
                                 f"model.safetensors; it does not take {', '.join(bad)} (call model.push_to_hub "
                                 f"to upload)")
        save_quantized(self._model(), save_directory)


class _Saving:
    """The quantizer's undo state, which also gives the model back transformers' ``save_pretrained``."""

    def __init__(self, state):
        self.state = state

    def check_undo(self):
        self.state.check_undo()

    def undo(self, model):
        model.__dict__.pop("save_pretrained", None)
        self.state.undo(model)
