"""The patch engine: ``patch(model, config)`` swaps modules in place and returns a report; ``unpatch`` undoes it.

Model families live in ``fuseinfer/models/`` (one file each, registered by ``model_type``, each implementing
:class:`fuseinfer.models.base.ModelFamily`). The engine checks the input before anything is touched, so a refused
model is left exactly as it was, keeps the state needed to undo the patch on the model itself (``state.py``), and
renders the report. On models with ``generate`` it also installs the fast-decode ``generate`` of
``fuseinfer.runtime`` (which hands unsupported calls back to transformers), and a causal LM whose family has a lean
loop gets the fast forward's class (``runtime/forward.py``), which unpatch takes back.
"""
from __future__ import annotations

import logging

from torch import nn

from fuseinfer import models
from fuseinfer.core.extension import extension_status
from fuseinfer.core.config import ATTN_NAME, OPS, REFERENCES_ONLY, SUPPORTED_DTYPES, PatchConfig, PatchReport, Swap
from fuseinfer.core.errors import FuseInferError
from fuseinfer.core.quant_config import apply_scheme
from fuseinfer.layers import attention_backend
from fuseinfer.core.placement import offloaded_tensor_names, placement
from fuseinfer.runtime import GenerateHook, release
from fuseinfer.runtime.forward import fast_class_for
from fuseinfer.core.state import (
    STATE_ATTR,
    PatchState,
    config_owner,
    model_lock,
    patch_report,
    patch_state,
    unwrapped,
)

logger = logging.getLogger("fuseinfer")
_warned: list = []  # the references-only warning is logged once per process

__all__ = ["ATTN_NAME", "OPS", "PatchConfig", "PatchReport", "PatchState", "Swap", "patch", "patch_report",
           "patch_state", "unpatch", "unwrapped"]


def _family_for(model: nn.Module):
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    family = models.family(model_type)
    if family is None:
        raise FuseInferError(f"fuseinfer cannot patch {type(model).__name__} (model_type={model_type!r}); "
                             f"supported: {models.supported()}")
    return model_type, family


def _check_tensors(model: nn.Module, allow_meta: bool = False) -> None:
    offloaded = offloaded_tensor_names(model)  # on meta between calls: accelerate's hooks load them (patch skips them)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_meta and not allow_meta and name not in offloaded:
            raise FuseInferError(
                f"{name} is on the meta device: load real weights before patching (no accelerate hook offloads it, "
                "so it was never loaded; e.g. from_pretrained without init_empty_weights, or model.to_empty() then "
                "load a state_dict)")
    for name, p in model.named_parameters():
        if p.dtype not in SUPPORTED_DTYPES:
            raise FuseInferError(f"{name} has dtype {p.dtype}; fuseinfer patches fp16, bf16 and fp32 models: "
                                 "load the model with dtype=torch.float16 (or bfloat16 / float32)")


def warn_if_references_only(report: PatchReport) -> None:
    """Log, once per process, that no fuseinfer CUDA kernel runs for a patched model (every op its reference)."""
    if report.references_only and not _warned:
        _warned.append(True)
        logger.warning("fuseinfer: %s", REFERENCES_ONLY)


def patch(model: nn.Module, config: PatchConfig | None = None) -> PatchReport:
    """Swap ``model``'s modules for fused ones in place; returns a :class:`PatchReport`.

    Raises :class:`FuseInferError` (leaving the model untouched) for an unsupported model, a model on the
    meta device, an unsupported dtype, or a model that is, or has a part that is, already patched.
    """
    if not isinstance(model, nn.Module):
        raise FuseInferError(f"fuseinfer.patch takes a torch.nn.Module, got {type(model).__name__}")
    model = unwrapped(model)
    with model_lock(model):  # a generate call or forward running on the model finishes first
        return _patch(model, config)


def _patch(model: nn.Module, config: PatchConfig | None) -> PatchReport:
    config = PatchConfig() if config is None else config
    if not isinstance(config, PatchConfig):
        raise FuseInferError(f"fuseinfer.patch takes a PatchConfig as config, got {type(config).__name__}: "
                             "e.g. fuseinfer.patch(model, fuseinfer.PatchConfig(ops=('linear',)))")
    model_type, family = _family_for(model)
    if hasattr(model, STATE_ATTR):
        quant = getattr(model, STATE_ATTR).config.quant
        raise FuseInferError("this model is already patched" + (f" and quantized ({quant.scheme})" if quant else "")
                             + "; call fuseinfer.unpatch(model) before patching again")
    inner = next((name for name, m in model.named_modules() if hasattr(m, STATE_ATTR)
                  or type(m).__module__.startswith("fuseinfer.")), None)
    if inner is not None:
        raise FuseInferError(f"part of this model ({inner or 'the model'}) is already patched by fuseinfer: unpatch "
                             "the module that was patched before patching again")
    owner = config_owner(getattr(model, "config", None))
    if owner is not None and any(m is model for m in owner.modules()):
        raise FuseInferError(f"this model's config selects the {ATTN_NAME!r} attention of the patched model it is "
                             "part of: unpatch that model, or patch the whole model instead of this part")
    _check_tensors(model, allow_meta=config.quant is not None and config.quant._empty)  # (load_quantized's build)
    attention_backend.check(config)  # flash_attn without the package: refused before anything is touched
    report = PatchReport(model_type=model_type, extension=extension_status(next(model.parameters()).device))
    state = family.patch(model, config, report)
    report.placement = placement(model, report)  # where each module runs, for a model accelerate placed
    quant = None
    if config.quant is not None:  # after the swaps: quantizes the linears of the swapped modules
        try:
            quant = apply_scheme(config.quant, model, report)
        except FuseInferError:  # refused before changing anything: the model goes back as it was
            family.unpatch(model, state)
            raise
    if not (config.quant is not None and config.quant._empty):  # (a meta build warns once its tensors are placed)
        warn_if_references_only(report)
    from fuseinfer.models.common import swap_class  # (imports transformers: not at ``import fuseinfer``)

    forward_class = None
    fast = fast_class_for(model, family)  # model(input_ids) through the lean loop where it applies
    if fast is not None:
        forward_class = type(model)
        swap_class(model, fast)
    object.__setattr__(model, STATE_ATTR, PatchState(family, state, report, config, model.__dict__.get("generate"),
                                                     quant, forward_class))
    if hasattr(model, "generate"):
        object.__setattr__(model, "generate", GenerateHook(model))
    return report


def unpatch(model: nn.Module) -> nn.Module:
    """Restore the model ``patch`` changed: module classes, parameters and buffers bit for bit."""
    model = unwrapped(model)
    with model_lock(model):  # a generate call or forward running on the model finishes first
        return _unpatch(model)


def _unpatch(model: nn.Module) -> nn.Module:
    if not hasattr(model, STATE_ATTR):
        inner = next((name for name, m in model.named_modules() if hasattr(m, STATE_ATTR)), None)
        raise FuseInferError("this model is not patched by fuseinfer (nothing to unpatch)" if inner is None else
                             f"this model is not patched by fuseinfer, its module {inner!r} is: "
                             f"fuseinfer.unpatch(model.get_submodule({inner!r}))")
    patched = getattr(model, STATE_ATTR)
    if patched.quant is not None:  # refuses (model untouched) when the original weights were not kept
        patched.quant.check_undo()
    release(model)
    model.__dict__.pop("generate", None)
    if patched.generate is not None:
        object.__setattr__(model, "generate", patched.generate)
    if patched.forward_class is not None:
        from fuseinfer.models.common import swap_class

        swap_class(model, patched.forward_class)
    if patched.quant is not None:
        patched.quant.undo(model)
    patched.family.unpatch(model, patched.state)
    object.__delattr__(model, STATE_ATTR)
    return model
