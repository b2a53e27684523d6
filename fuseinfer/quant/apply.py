"""The one place that maps each quantization config to the code that applies it (the configs stay plain data).

``quantize(config, model, report)`` quantizes a model the family has just patched, in place, adding to ``report``,
and returns a state with ``check_undo()`` and ``undo(model)``; it raises FuseInferError, leaving the model as the
family's patch left it, for input it cannot quantize.
"""
from __future__ import annotations

from ..errors import FuseInferError
from .config import Int8WeightOnly, QuantConfig, SmoothQuantW8A8
from .w8a8 import quantize_w8a8
from .weight_only import quantize_weight_only

HANDLERS = {Int8WeightOnly: quantize_weight_only, SmoothQuantW8A8: quantize_w8a8}


def quantize(config: QuantConfig, model, report):
    handler = HANDLERS.get(type(config))
    if handler is None:
        raise FuseInferError(f"no quantizer for {type(config).__name__}; choose from "
                             f"{', '.join(c.__name__ for c in HANDLERS)}")
    return handler(model, config, report)
