"""The patch engine: ``patch(model, config)`` swaps modules in place and returns a report; ``unpatch`` undoes it.

Model families live in ``fuseinfer/patches/`` (one file each, registered by ``model_type``). The engine checks
the input before anything is touched, so a refused model is left exactly as it was, keeps the state needed to
undo the patch on the model itself, and renders the report. On models with ``generate`` it also installs the
fast-decode ``generate`` of ``fuseinfer.runtime`` (which hands unsupported calls back to transformers).
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch
from torch import nn

from ._ext import extension_status
from .errors import FuseInferError

OPS = ("layer_norm", "linear", "qkv", "attention")
ATTN_NAME = "fuseinfer"  # the attention implementation patch registers with transformers (patches/hf_attention.py)
STATE_ATTR = "_fuseinfer_state"
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class PatchConfig:
    """What to patch.

    ops: which fusions to apply, any of ``OPS``:
      ``layer_norm`` (residual add + LayerNorm), ``linear`` (GEMM with bias / ReLU / residual epilogues),
      ``qkv`` (q, k, v projections as one GEMM), ``attention`` (the ``"fuseinfer"`` attention implementation).
    filter_fn: ``(module, qualified_name) -> bool``, called for each candidate module (decoder layers, attention
      modules and the decoder's final LayerNorm); only those for which it returns True are swapped (torchao's
      ``filter_fn`` idea).
    """

    ops: tuple[str, ...] = OPS
    filter_fn: Callable[[nn.Module, str], bool] | None = None

    def __post_init__(self):
        if isinstance(self.ops, str):
            object.__setattr__(self, "ops", (self.ops,))
        if not isinstance(self.ops, (tuple, list, set, frozenset)):
            raise FuseInferError(f"PatchConfig.ops must be a tuple of op names from {list(OPS)}, got {self.ops!r}")
        unknown = [op for op in self.ops if op not in OPS]
        if unknown:
            raise FuseInferError(f"unknown op name(s) {unknown} in PatchConfig.ops; choose from {list(OPS)}")
        if self.filter_fn is not None and not callable(self.filter_fn):
            raise FuseInferError(f"PatchConfig.filter_fn must be a callable (module, name) -> bool, got "
                                 f"{self.filter_fn!r}; e.g. filter_fn=lambda module, name: 'layers.0.' not in name")

    def selects(self, module: nn.Module, name: str) -> bool:
        return self.filter_fn is None or bool(self.filter_fn(module, name))

    def __deepcopy__(self, memo):  # immutable: a deep copy of a patched model shares it
        return self

    def __reduce__(self):
        """Pickling (``torch.save`` of a patched model, which records its config) keeps ``filter_fn`` where it
        pickles; a lambda or local function does not, and is replaced by a stand-in that says so if called."""
        fn = self.filter_fn
        try:
            pickle.dumps(fn)
        except Exception:  # (pickle raises several types: PicklingError, AttributeError, TypeError)
            fn = _UnpickledFilter(repr(fn))
        return PatchConfig, (tuple(self.ops), fn)


class _UnpickledFilter:
    """Stands in for a ``filter_fn`` that could not be pickled with its patched model (the swaps it chose are in
    the pickle; nothing calls it after loading)."""

    def __init__(self, what: str):
        self.what = what

    def __call__(self, module, name):
        raise FuseInferError(f"this PatchConfig was unpickled without its filter_fn {self.what}, which could not "
                             "be pickled; build a new PatchConfig to patch with it")


@dataclass
class Swap:
    """One module swapped: its name, the class it became, and the backend each of its ops runs on."""

    name: str
    old_class: str
    new_class: str
    ops: dict[str, str]  # op -> "cuda" | "reference"


@dataclass
class PatchReport:
    """What ``patch`` did: the swaps, what it skipped and why, and where the kernels run."""

    model_type: str
    swaps: list[Swap] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (name or op, reason)
    attn_implementation: tuple[str, str] | None = None  # (before, after)
    extension: str = field(default_factory=extension_status)
    placement: dict[str, str] = field(default_factory=dict)  # module -> device (accelerate) or tensor parallel

    @property
    def backends(self) -> dict[str, set[str]]:
        """op -> the set of backends it runs on across all swaps."""
        out: dict[str, set[str]] = {}
        for swap in self.swaps:
            for op, backend in swap.ops.items():
                out.setdefault(op, set()).add(backend)
        return out

    def __str__(self) -> str:
        lines = [f"fuseinfer patch report ({self.model_type}; CUDA extension: {self.extension})"]
        if self.attn_implementation:
            lines.append(f"  attention implementation: {self.attn_implementation[0]!r} -> "
                         f"{self.attn_implementation[1]!r}")
        lines.append(f"  swapped {len(self.swaps)} module(s):")
        width = max((len(s.name) for s in self.swaps), default=0)
        for s in self.swaps:
            ops = ", ".join(f"{op}={backend}" for op, backend in s.ops.items())
            lines.append(f"    {s.name:<{width}}  {s.old_class} -> {s.new_class}  [{ops}]")
        for what, why in self.skipped:
            lines.append(f"  skipped {what}: {why}")
        if self.placement:
            from .parallel.placement import summary

            lines += summary(self.placement)
        return "\n".join(lines)


class PatchState(NamedTuple):
    family: object  # the family's rules object (fuseinfer/patches/<family>.py)
    state: dict  # what the family needs to undo its swaps
    report: PatchReport
    config: PatchConfig
    generate: object = None  # the model's own instance attribute ``generate`` before patching, if it had one


def unwrapped(model):
    """The module a ``torch.compile`` wrapper (OptimizedModule) compiles, else ``model``: patching swaps the
    wrapped model's modules (dynamo recompiles for them), and its ``generate`` is what the wrapper exposes."""
    return getattr(model, "_orig_mod", model) if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) \
        else model


def _family_for(model: nn.Module):
    from .patches import FAMILIES

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in FAMILIES:
        supported = ", ".join(f"{k} ({', '.join(f.architectures)})" for k, f in FAMILIES.items())
        raise FuseInferError(
            f"fuseinfer cannot patch {type(model).__name__} (model_type={model_type!r}); "
            f"supported: {supported}")
    return model_type, FAMILIES[model_type]


def _check_tensors(model: nn.Module) -> None:
    from .parallel.placement import offloaded_tensor_names

    offloaded = offloaded_tensor_names(model)  # on meta between calls: accelerate's hooks load them (patch skips them)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_meta and name not in offloaded:
            raise FuseInferError(
                f"{name} is on the meta device: load real weights before patching (no accelerate hook offloads it, "
                "so it was never loaded; e.g. from_pretrained without init_empty_weights, or model.to_empty() then "
                "load a state_dict)")
    for name, p in model.named_parameters():
        if p.dtype not in SUPPORTED_DTYPES:
            raise FuseInferError(f"{name} has dtype {p.dtype}; fuseinfer patches fp16, bf16 and fp32 models: "
                                 "load the model with dtype=torch.float16 (or bfloat16 / float32)")


def patch(model: nn.Module, config: PatchConfig | None = None) -> PatchReport:
    """Swap ``model``'s modules for fused ones in place; returns a :class:`PatchReport`.

    Raises :class:`FuseInferError` (leaving the model untouched) for an unsupported model, a model on the
    meta device, an unsupported dtype, or a model that is, or has a part that is, already patched.
    """
    if not isinstance(model, nn.Module):
        raise FuseInferError(f"fuseinfer.patch takes a torch.nn.Module, got {type(model).__name__}")
    model = unwrapped(model)
    config = PatchConfig() if config is None else config
    if not isinstance(config, PatchConfig):
        raise FuseInferError(f"fuseinfer.patch takes a PatchConfig as config, got {type(config).__name__}: "
                             "e.g. fuseinfer.patch(model, fuseinfer.PatchConfig(ops=('linear',)))")
    model_type, family = _family_for(model)
    if hasattr(model, STATE_ATTR):
        raise FuseInferError("this model is already patched; call fuseinfer.unpatch(model) before patching again")
    inner = next((name for name, m in model.named_modules() if hasattr(m, STATE_ATTR)
                  or type(m).__module__.startswith("fuseinfer.")), None)
    if inner is not None:
        raise FuseInferError(f"part of this model ({inner or 'the model'}) is already patched by fuseinfer: unpatch "
                             "the module that was patched before patching again")
    if getattr(getattr(model, "config", None), "_attn_implementation", None) == ATTN_NAME:
        raise FuseInferError(f"this model's config already selects the {ATTN_NAME!r} attention, but the model is not "
                             "patched: it is part of a patched model (unpatch that one) or was built on a patched "
                             "model's config (set model.config._attn_implementation = 'sdpa' first)")
    _check_tensors(model)
    report = PatchReport(model_type=model_type, extension=extension_status(next(model.parameters()).device))
    state = family.patch(model, config, report)
    from .parallel.placement import placement

    report.placement = placement(model, report)  # where each module runs, for a model accelerate placed
    object.__setattr__(model, STATE_ATTR, PatchState(family, state, report, config, model.__dict__.get("generate")))
    if hasattr(model, "generate"):
        from .runtime import GenerateHook

        object.__setattr__(model, "generate", GenerateHook(model))
    return report


def unpatch(model: nn.Module) -> nn.Module:
    """Restore the model ``patch`` changed: module classes, parameters and buffers bit for bit."""
    model = unwrapped(model)
    if not hasattr(model, STATE_ATTR):
        inner = next((name for name, m in model.named_modules() if hasattr(m, STATE_ATTR)), None)
        raise FuseInferError("this model is not patched by fuseinfer (nothing to unpatch)" if inner is None else
                             f"this model is not patched by fuseinfer, its module {inner!r} is: "
                             f"fuseinfer.unpatch(model.get_submodule({inner!r}))")
    patched = getattr(model, STATE_ATTR)
    from .runtime import release

    release(model)
    model.__dict__.pop("generate", None)
    if patched.generate is not None:
        object.__setattr__(model, "generate", patched.generate)
    patched.family.unpatch(model, patched.state)
    object.__delattr__(model, STATE_ATTR)
    return model


def patch_state(model: nn.Module) -> PatchState | None:
    """What ``patch`` recorded on ``model`` (family, undo state, report, config), or None if unpatched."""
    return getattr(unwrapped(model), STATE_ATTR, None)


def patch_report(model: nn.Module) -> PatchReport | None:
    """The report of the patch currently applied to ``model``, or None."""
    state = patch_state(model)
    return state.report if state else None
