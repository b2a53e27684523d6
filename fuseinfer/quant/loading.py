"""Loading a quantized checkpoint: ``load_quantized(dir, ...)`` and the meta-model build that transformers'
``from_pretrained`` shares with it (``quant/hf_quantizer.py``).

The model is built on the meta device, patched into the checkpoint's quantized layout (``build_layout``), the
stored tensors are checked against it (``checkpoint.check_tensors``) before anything is allocated, then only the
int8 model is allocated on the device and the tensors are copied in one at a time. The file format and every check
live in ``quant/checkpoint.py``, which imports nothing that patches (so the quantizers can save without an import
cycle); this module is the one that calls ``fuseinfer.patch``.
"""
from __future__ import annotations

from pathlib import Path

import torch

from fuseinfer.core.errors import FuseInferError
from fuseinfer.quant.checkpoint import WEIGHTS, _tensor, check_tensors, empty_layout, read_checkpoint


def build_layout(model, checked: dict, ops=None) -> None:
    """Patch the meta ``model`` into the checkpoint's quantized layout (recorded ops unless ``ops``), in eval mode
    (a model in training mode keeps its attention unpatched)."""
    from fuseinfer.core.config import PatchConfig
    from fuseinfer.patching import patch

    model.eval()
    patch(model, PatchConfig(ops=tuple(ops or checked["ops"]) or PatchConfig().ops, quant=empty_layout(checked)))


def load_quantized(directory, device=None, model=None, ops=None):
    """The model ``save_quantized`` wrote to ``directory``, patched and quantized, on ``device`` (default: the CPU;
    with ``model``, that model's device, and another ``device`` is refused).

    model: None (build it from the checkpoint's config, in its dtype) or an unpatched model of the same
      architecture, whose tensors are replaced (FuseInferError, model untouched, if its config differs in a field
      that fixes a shape, the family's ``config_fields``). ops: PatchConfig ops (default: those recorded).
    Returns the model (eval mode). Its ``unpatch`` refuses (no original weights exist).
    """
    from safetensors import safe_open

    from fuseinfer import models
    from fuseinfer.core.state import patch_state, unwrapped

    directory = Path(directory)
    raw, checked = read_checkpoint(directory)
    fam = models.family(raw.get("model_type"))
    if fam is None:
        raise FuseInferError(f"this checkpoint holds a {raw.get('model_type')!r} model; fuseinfer quantizes "
                             f"{models.supported()}")
    try:
        saved = fam.config_class().from_dict({k: v for k, v in raw.items() if k not in ("architectures", "auto_map")})
    except Exception as exc:  # a config transformers cannot build: one line
        raise FuseInferError(f"{directory / 'config.json'} is not a valid {fam.model_type} config ({exc})") from None
    dtype = checked["dtype"]
    if model is not None:
        model = unwrapped(model)
        if patch_state(model) is not None:
            raise FuseInferError("load_quantized(model=...) takes an unpatched model: fuseinfer.unpatch(model) first")
        mine = getattr(model, "config", None)
        diff = [f"{f}: checkpoint {getattr(saved, f, None)!r}, model {getattr(mine, f, None)!r}"
                for f in fam.config_fields if getattr(saved, f, None) != getattr(mine, f, None)]
        if checked["architectures"] and type(model).__name__ not in checked["architectures"]:
            diff.insert(0, f"class: checkpoint {checked['architectures'][0]}, model {type(model).__name__}")
        if diff:
            raise FuseInferError(f"this checkpoint does not fit the model (a different architecture): "
                                 f"{'; '.join(diff)}; load it with load_quantized(directory) instead")
        if next(model.parameters()).dtype != dtype:
            raise FuseInferError(f"the checkpoint is {dtype}, the model {next(model.parameters()).dtype}: "
                                 f"model.to({dtype}) first")
        # checked on a meta copy first, so that a bad file leaves the given model untouched
        probe = fam.empty_model(saved, dtype)
        build_layout(probe, checked, ops)
        check_tensors(directory / WEIGHTS, probe, checked)
        if device is not None and torch.device(device) != next(model.parameters()).device:
            raise FuseInferError(f"load_quantized(model=...) loads into the model's own device "
                                 f"({next(model.parameters()).device}), not {device}: move the model first or leave "
                                 "device out")
        device = next(model.parameters()).device
        ties = tied_parameters(model)
        model.to("meta")
        build_layout(model, checked, ops)
    else:
        device = "cpu" if device is None else device
        saved._attn_implementation = "sdpa"
        model = fam.empty_model(saved, dtype)
        ties = tied_parameters(model)
        build_layout(model, checked, ops)
        check_tensors(directory / WEIGHTS, model, checked)
    to_empty_keep_ties(model, device, ties)
    with torch.no_grad(), safe_open(str(directory / WEIGHTS), framework="pt", device=str(device)) as f:
        for name in f.keys():  # one tensor at a time: no second copy of the model
            if name != checked["guard"]:
                _tensor(model, name).copy_(f.get_tensor(name))
    refresh_report(model)
    return model


def tied_parameters(model) -> list:
    """Groups of (module, name) holding one Parameter object (tied embeddings), for ``to_empty_keep_ties``."""
    owners: dict[int, list] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((module, name))
    return [group for group in owners.values() if len(group) > 1]


def to_empty_keep_ties(model, device, ties=None) -> None:
    """``model.to_empty(device=device)``, then the parameters that were one object (``ties``, default: now) are made
    one again (moving to or from the meta device gives each module its own new Parameter)."""
    from fuseinfer import models

    ties = tied_parameters(model) if ties is None else ties
    model.to_empty(device=device)
    for group in ties:
        first = group[0][0]._parameters[group[0][1]]
        for module, name in group[1:]:
            module._parameters[name] = first
    fam = models.family_of(model)
    if fam is not None:  # buffers no checkpoint holds (rotary tables): to_empty left them uninitialised
        fam.init_buffers(model)


def refresh_report(model) -> None:
    """The patch ran on the meta device: name the backends the loaded tensors run on."""
    from fuseinfer.core.extension import backend_for
    from fuseinfer.core.state import patch_state

    report = patch_state(model).report
    p = next(model.parameters())
    for swap in report.swaps:
        swap.ops = {op: (backend_for(p) if "(" not in b else b) for op, b in swap.ops.items()}
    if hasattr(report.quant, "gemm"):  # a W8A8 report: the GEMM its linears run, known only on the real device
        from fuseinfer.ops.w8a8_linear import w8a8_gemm_note
        from fuseinfer.quant.fp8 import fp8_note

        note = fp8_note if report.quant.scheme == "float8" else w8a8_gemm_note
        report.quant.gemm = note(p.device, p.dtype)
    from fuseinfer.patching import warn_if_references_only

    warn_if_references_only(report)  # (patch skipped it: on the meta device every op looked like a reference)
