"""Named ranges per module for the profiler (``record_function``) and for Nsight (NVTX), added by module hooks.

``ModuleRanges(model)`` opens a range ``fi:<kind>:<qualified name>`` around every call of a module whose kind it
knows: decoder layers, attention modules, LayerNorms and embeddings by class; the q/k/v and attention output
projections, the MLP's two projections, activations, the LM head by their names in the model's family
(``ModelFamily.module_kinds``). Patched (fused) modules skip their submodules' calls, so a fused layer's MLP shows
as ops directly under its ``layer`` range, and a fused attention's q/k/v GEMM directly under ``attention``:
``trace.classify`` sorts those ops by shape. Hooks are per module (a global hook would make patched modules run
their original forward), added after patching and after the fast-decode session exists (its one-kernel step is
only taken for a model without hooks), and removed on exit.

``OpRanges()`` gives fuseinfer's ops a range where they skip the dispatcher: on CUDA in eager mode the op
wrappers call their ``_<op>_cuda`` function directly (``_ext.route`` / ``eager_cuda``), which the profiler would
not see as an op; the range is named ``<op>|<input dims>|<dtypes>`` so that the analysis can cost it like a
recorded op.
"""
from __future__ import annotations

import json
import sys

import torch
from torch import nn

PREFIX = "fi:"
OP_SEPARATOR = "|"
# the fused q/k/v a quantizer puts in an attention module, whatever the family
_GENERIC_KINDS = {"qkv_proj": "qkv"}


def leaf_kinds(model: nn.Module) -> dict[str, str]:
    """Module attribute name -> kind for ``model``: its family's names (none for a model of no family)."""
    from fuseinfer import models

    fam = models.family_of(model)
    return {**_GENERIC_KINDS, **(fam.module_kinds() if fam is not None else {})}


def module_kind(name: str, module: nn.Module, leaf: dict[str, str]) -> str | None:
    """The kind of range a module gets (``leaf``: :func:`leaf_kinds`), or None for modules without one (the model,
    the decoder, containers)."""
    if not name:
        return None
    cls = type(module).__name__
    last = name.rsplit(".", 1)[-1]
    if cls.endswith("DecoderLayer"):
        return "layer"
    if "Attention" in cls:
        return "attention"
    if last in leaf:
        return leaf[last]
    if isinstance(module, nn.LayerNorm):
        return "layernorm"
    if isinstance(module, nn.Embedding) or cls.endswith("Embedding"):
        return "embeddings"
    return None


def range_name(kind: str, name: str) -> str:
    return f"{PREFIX}{kind}:{name}"


def parse_range(name: str) -> tuple[str, str] | None:
    """(kind, qualified module name) of a range ``ModuleRanges`` opened, else None."""
    if not name.startswith(PREFIX):
        return None
    kind, _, qual = name[len(PREFIX):].partition(":")
    return kind, qual


class ModuleRanges:
    """Context manager: a ``record_function`` range (and an NVTX range when ``nvtx``) around each call of each
    module :func:`module_kind` names."""

    def __init__(self, model: nn.Module, nvtx: bool = False):
        self.model, self.nvtx = model, nvtx
        self.handles: list = []
        self.open: list = []  # ranges entered and not exited yet, innermost last

    def _hooks(self, label: str):
        def pre(module, args):
            rf = torch.autograd.profiler.record_function(label)
            rf.__enter__()
            self.open.append(rf)
            if self.nvtx:
                torch.cuda.nvtx.range_push(label)

        def post(module, args, output):
            if self.open:
                self.open.pop().__exit__(None, None, None)
                if self.nvtx:
                    torch.cuda.nvtx.range_pop()

        return pre, post

    def __enter__(self):
        leaf = leaf_kinds(self.model)
        for name, module in self.model.named_modules():
            kind = module_kind(name, module, leaf)
            if kind is None:
                continue
            pre, post = self._hooks(range_name(kind, name))
            self.handles.append(module.register_forward_pre_hook(pre))
            self.handles.append(module.register_forward_hook(post))
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        while self.open:  # a forward that raised leaves its ranges open
            self.open.pop().__exit__(None, None, None)
            if self.nvtx:
                torch.cuda.nvtx.range_pop()
        return False


def _describe(args: tuple) -> tuple[list, list]:
    """(dims, dtype names) of an op's arguments, as the profiler records them ([] and "" for non-tensors)."""
    dims, types = [], []
    for a in args:
        if isinstance(a, torch.Tensor):
            dims.append(list(a.shape))
            types.append(str(a.dtype))
        elif isinstance(a, (list, tuple)) and a and all(isinstance(t, torch.Tensor) for t in a):
            dims.append([list(t.shape) for t in a])
            types.append(str(a[0].dtype))
        else:
            dims.append([])
            types.append(str(a) if isinstance(a, (bool, int, float, str)) else "")
    return dims, types


def op_range_name(op_name: str, args: tuple) -> str:
    dims, types = _describe(args)
    # no double quote in the name: torch's Chrome-trace writer does not escape them (the dtypes go ';'-joined)
    return OP_SEPARATOR.join((op_name, json.dumps(dims, separators=(",", ":")),
                              ";".join(t.replace(";", ",").replace('"', "'") for t in types)))


def parse_op_range(name: str) -> tuple[str, list, list] | None:
    """(op, dims, dtypes) of a range :class:`OpRanges` opened, else None."""
    parts = name.split(OP_SEPARATOR)
    if len(parts) != 3 or "::" not in parts[0]:
        return None
    try:
        return parts[0], json.loads(parts[1]), parts[2].split(";") if parts[2] else []
    except ValueError:
        return None


class OpRanges:
    """Context manager: fuseinfer's direct extension calls (``fuseinfer/ops/<op>.py``'s ``_<op>_cuda``, which the
    op wrappers call in eager mode on CUDA instead of the dispatcher) open a named range with the op, its input
    dims and dtypes. Calls through the dispatcher are recorded as ops by the profiler itself (the registered
    kernels hold the original functions, so they are not wrapped twice)."""

    def __init__(self, nvtx: bool = False):
        self.nvtx = nvtx
        self.patched: list[tuple[object, str, object]] = []

    def _wrap(self, op_name: str, fn):
        nvtx = self.nvtx

        def traced(*args):
            label = op_range_name(op_name, args)
            if nvtx:
                torch.cuda.nvtx.range_push(op_name)
            try:
                with torch.autograd.profiler.record_function(label):
                    return fn(*args)
            finally:
                if nvtx:
                    torch.cuda.nvtx.range_pop()

        return traced

    def __enter__(self):
        ops = torch.ops.fuseinfer
        for name, module in list(sys.modules.items()):
            if not name.startswith("fuseinfer.ops.") or module is None:
                continue
            for attr, fn in list(vars(module).items()):
                op = attr[1:-len("_cuda")] if attr.startswith("_") and attr.endswith("_cuda") else None
                if op and callable(fn) and hasattr(ops, op):
                    self.patched.append((module, attr, fn))
                    setattr(module, attr, self._wrap(f"fuseinfer::{op}", fn))
        return self

    def __exit__(self, *exc):
        for module, attr, fn in self.patched:
            setattr(module, attr, fn)
        self.patched.clear()
        return False
