"""What the fast-decode runtime (``fuseinfer/runtime/decode.py``) asks about a placed or sharded model, in one
place: whether it runs at all (``refusal``: accelerate offload falls back to transformers), its forward (logits
brought to the session's device), the KV cache (per-layer devices; this rank's heads under tensor parallel),
and whether the one-kernel step and CUDA graphs apply (``DecodePlan``). For a plain model every answer is the
runtime's default."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fuseinfer.core.state import runtime_config
from fuseinfer.core import placement

TP_ATTR = "_fuseinfer_tp"  # (sharding.TP_ATTR; read here without importing transformers)


def tp_info(model: nn.Module):
    return getattr(model, TP_ATTR, None)


def decode_refusals(model: nn.Module) -> tuple[str | None, str | None]:
    """(why the one-kernel step is not used, why CUDA graphs are not used) for a tensor-parallel model."""
    if tp_info(model) is None:
        return None, None
    no_graphs = None if runtime_config(model).tp_graphs else \
        "RuntimeConfig(tp_graphs=False): the tensor-parallel step runs eagerly"
    return ("tensor parallel: the one-kernel step has no all-reduce between its phases (the per-op step, NCCL "
            "all-reduces included, is captured instead)"), no_graphs


@dataclass(frozen=True)
class DecodePlan:
    """no_kernel / no_graphs: why the one-kernel step / CUDA graphs are not used (None: the runtime decides)."""

    no_kernel: str | None = None
    no_graphs: str | None = None
    devices: tuple | None = None  # per-layer devices of a model split over several, else None
    # torch.cuda.graph's capture_error_mode: under tensor parallel, "thread_local", so that NCCL's watchdog thread
    # may query its events while this thread captures (in "global" mode CUDA forbids that process-wide)
    capture_mode: str = "global"


def refusal(model: nn.Module) -> str | None:
    """Why fast decode does not run this model (accelerate offload), or None."""
    return placement.decode_refusal(model) if placement.is_hooked(model) else None


def forward(model: nn.Module, fn, layers: tuple[str, nn.ModuleList]):
    """The runtime's forward for ``model``: ``fn``, with its logits moved to the model's first device when the
    model is split over devices (the LM head may sit on the last GPU). layers: the model's decoder layers as its
    family finds them, (qualified name, module list)."""
    if fn is None or placement.graph_refusal(model, layers) is None:
        return fn
    return placement.logits_on(next(model.parameters()).device, fn)


def plan(model: nn.Module, layers: tuple[str, nn.ModuleList]) -> DecodePlan:
    """The DecodePlan of ``model``; logs (once per reason) why CUDA graphs are off. layers: as :func:`forward`."""
    no_kernel, no_graphs = decode_refusals(model)
    if no_kernel is None and placement.is_hooked(model):
        no_kernel = "the model is placed by accelerate: its hooks run per module (the per-op step calls them)"
    devices = None
    split = placement.graph_refusal(model, layers)
    if split is not None:
        no_graphs, devices = split, tuple(placement.layer_devices(model, layers))
        placement._log_once(f"fast decode: {split}")
    return DecodePlan(no_kernel, no_graphs, devices, "thread_local" if tp_info(model) is not None else "global")

