"""Quantized checkpoints: ``save_quantized(model, dir)`` / ``load_quantized(dir, ...)``, no re-quantization on load.

Format: ``dir/config.json`` is the model's Hugging Face config with a ``fuseinfer_quantization`` entry (the
scheme's ``describe()``: bits, granularity, scale dtype, rounding; the PatchConfig ops; the quantized module names
and the fuseinfer version), and ``dir/model.safetensors`` the patched model's state dict (int8 ``qweight`` and fp32
``scale`` per quantized linear, the fused q/k/v as ``self_attn.qkv_proj``; everything else in the model's dtype;
tied tensors stored once by ``safetensors.torch.save_model``). SmoothQuant W8A8 models (``SmoothQuantW8A8``) save
the same way: int8 ``weight_q`` and fp32 ``weight_scale`` (N, 1) per linear, their biases, and the LayerNorms with
the smoothing factors already folded in; the config records alpha and the calibration source.

Loading builds the model on the meta device, applies ``patch`` with the recorded ops and the scheme's config in its
empty-layout form (``Int8WeightOnly`` / ``SmoothQuantW8A8`` with ``_empty``: int8 / scale tensors laid out, nothing
quantized, calibrated or smoothed), allocates everything on ``device``
(``to_empty``: the int8 model's size, never an fp16 copy) and loads the tensors, strictly (every key, every shape).

Why not transformers' quantizer hooks (``HfQuantizer`` / ``quantization_config``): the layout depends on
fuseinfer's patch (the fused (3E, E) q/k/v exists only in a patched model, and the quantized modules run fuseinfer
ops), so the model must be patched before its tensors load; transformers would load, then we would re-patch, with
its loader's private registries (``AUTO_QUANTIZER_MAPPING``) changing across the supported 5.17-5.23. One small
explicit format is easier to keep correct.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from ..errors import FuseInferError

CONFIG_KEY = "fuseinfer_quantization"
WEIGHTS = "model.safetensors"
# the config fields that fix the tensors' shapes: a checkpoint loads only into a model that agrees on all of them
ARCH_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "ffn_dim", "num_attention_heads", "vocab_size",
               "word_embed_proj_dim", "max_position_embeddings", "do_layer_norm_before", "enable_bias",
               "layer_norm_elementwise_affine", "_remove_final_layer_norm")


def save_quantized(model, directory) -> Path:
    """Write the quantized (patched) ``model`` to ``directory`` (created; existing files of the format replaced)."""
    from safetensors.torch import save_model

    from .. import __version__
    from ..state import patch_state, unwrapped

    model = unwrapped(model)
    state = patch_state(model)
    if state is None or state.config.quant is None:
        raise FuseInferError("save_quantized takes a model quantized by fuseinfer.patch(model, fuseinfer.PatchConfig("
                             "quant=fuseinfer.Int8WeightOnly() or fuseinfer.SmoothQuantW8A8())); this one is not "
                             "quantized")
    if getattr(model, "config", None) is None:
        raise FuseInferError("save_quantized needs a Hugging Face model with a config")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("_attn_implementation_internal", None)
    config["_attn_implementation"] = None
    config[CONFIG_KEY] = {
        **state.config.quant.describe(), "ops": list(state.config.ops),
        "modules": [e.name for e in state.report.quant.entries], "fuseinfer_version": __version__,
        **({"calibration_source": state.report.quant.calibration_source,
            "calibration_samples": state.report.quant.calibration_samples}
           if getattr(state.report.quant, "calibration_source", "") else {}),
        "architectures": [type(model).__name__], "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
    }
    tmp = directory / (WEIGHTS + ".tmp")
    save_model(model, str(tmp), metadata={"format": "pt", CONFIG_KEY: json.dumps(config[CONFIG_KEY])})
    os.replace(tmp, directory / WEIGHTS)  # (a failed save leaves no half-written model.safetensors)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
    return directory


def _read(directory: Path) -> tuple[dict, dict]:
    cfg_path, weights = directory / "config.json", directory / WEIGHTS
    if not cfg_path.exists() or not weights.exists():
        raise FuseInferError(f"{directory} is not a fuseinfer quantized checkpoint (needs config.json and {WEIGHTS}, "
                             "as fuseinfer.save_quantized writes)")
    raw = json.loads(cfg_path.read_text())
    quant = raw.pop(CONFIG_KEY, None)
    if quant is None:
        raise FuseInferError(f"{cfg_path} has no '{CONFIG_KEY}' entry: not written by fuseinfer.save_quantized (load "
                             "an unquantized checkpoint with from_pretrained, then fuseinfer.patch it)")
    return raw, quant


def _quant_config(quant: dict):
    """The config that lays out the checkpoint's scheme with empty tensors (``_empty``: no quantization, and for
    SmoothQuant no calibration or smoothing; the saved tensors hold their results)."""
    from .config import Int8WeightOnly, SmoothQuantW8A8

    scheme = quant.get("scheme")
    if scheme == Int8WeightOnly.scheme:
        return dataclasses.replace(Int8WeightOnly(include_lm_head=bool(quant.get("include_lm_head"))), _empty=True)
    if scheme == SmoothQuantW8A8.scheme:
        return dataclasses.replace(SmoothQuantW8A8(alpha=float(quant.get("alpha", 0.5))), _empty=True)
    raise FuseInferError(f"this checkpoint's scheme {scheme!r} is not supported by this fuseinfer "
                         f"(supported: {Int8WeightOnly.scheme!r}, {SmoothQuantW8A8.scheme!r})")


def load_quantized(directory, device="cpu", model=None, ops=None):
    """The model ``save_quantized`` wrote to ``directory``, patched and quantized, on ``device``.

    model: None (build it from the checkpoint's config, in its dtype) or an unpatched model of the same
      architecture, whose tensors are replaced (FuseInferError, model untouched, if its config differs in a field
      that fixes a shape, ``ARCH_FIELDS``). ops: PatchConfig ops (default: those recorded).
    Returns the model (eval mode). Its ``unpatch`` refuses (no original weights exist).
    """
    from safetensors import safe_open
    from safetensors.torch import load_model
    from transformers import AutoModelForCausalLM, OPTConfig

    from ..config import PatchConfig
    from ..patching import patch
    from ..state import patch_state, unwrapped

    directory = Path(directory)
    raw, quant = _read(directory)
    qconfig = _quant_config(quant)
    saved = OPTConfig.from_dict({k: v for k, v in raw.items() if k not in ("architectures",)}) \
        if raw.get("model_type") == "opt" else None
    if saved is None:
        raise FuseInferError(f"this checkpoint holds a {raw.get('model_type')!r} model; fuseinfer quantizes OPT")
    dtype = getattr(torch, quant.get("dtype", "float16"))
    if model is not None:
        model = unwrapped(model)
        if patch_state(model) is not None:
            raise FuseInferError("load_quantized(model=...) takes an unpatched model: fuseinfer.unpatch(model) first")
        mine = getattr(model, "config", None)
        diff = [f"{f}: checkpoint {getattr(saved, f, None)!r}, model {getattr(mine, f, None)!r}" for f in ARCH_FIELDS
                if getattr(saved, f, None) != getattr(mine, f, None)]
        if quant.get("architectures") and type(model).__name__ not in quant["architectures"]:
            diff.insert(0, f"class: checkpoint {quant['architectures'][0]}, model {type(model).__name__}")
        if diff:
            raise FuseInferError(f"this checkpoint does not fit the model (a different architecture): "
                                 f"{'; '.join(diff)}; load it with load_quantized(directory) instead")
        if next(model.parameters()).dtype != dtype:
            raise FuseInferError(f"the checkpoint is {dtype}, the model {next(model.parameters()).dtype}: "
                                 f"model.to({dtype}) first")
        device = next(model.parameters()).device
        ties = tied_parameters(model)
        model.to("meta")
    else:
        saved._attn_implementation = "sdpa"
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(saved, dtype=dtype, attn_implementation="sdpa")
        ties = tied_parameters(model)
    model.eval()
    patch(model, PatchConfig(ops=tuple(ops or quant.get("ops") or ()) or PatchConfig().ops, quant=qconfig))
    to_empty_keep_ties(model, device, ties)
    with safe_open(str(directory / WEIGHTS), framework="pt") as f:
        stored = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    wrong = [f"{k}: stored {stored[k]}, model {expected[k]}" for k in stored if k in expected and stored[k] !=
             expected[k]]
    if wrong:
        raise FuseInferError(f"checkpoint tensors do not fit the model: {'; '.join(wrong[:3])}")
    missing, unexpected = load_model(model, str(directory / WEIGHTS), strict=False, device=str(device))
    if unexpected or missing:
        raise FuseInferError(f"checkpoint and model disagree: missing {sorted(missing)[:3]}, unexpected "
                             f"{sorted(unexpected)[:3]}")
    _refresh_report(model)
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
    ties = tied_parameters(model) if ties is None else ties
    model.to_empty(device=device)
    for group in ties:
        first = group[0][0]._parameters[group[0][1]]
        for module, name in group[1:]:
            module._parameters[name] = first


def _refresh_report(model) -> None:
    """The patch ran on the meta device: name the backends the loaded tensors run on."""
    from .._ext import backend_for
    from ..state import patch_state

    report = patch_state(model).report
    p = next(model.parameters())
    for swap in report.swaps:
        swap.ops = {op: (backend_for(p) if "(" not in b else b) for op, b in swap.ops.items()}
    from ..patching import warn_if_references_only

    warn_if_references_only(report)  # (patch skipped it: on the meta device every op looked like a reference)
