"""Tensor parallel over ``torch.distributed`` (NCCL on GPUs, gloo on CPU), Megatron's layout: each block's
column-parallel linears keep this rank's output features, its row-parallel ones this rank's input features, and one
all-reduce per block sums the partial results. Which tensors split how, and the tensor-parallel layer, are the model
family's (``ModelFamily.tp_*``: ``models/opt/tp.py``, ``models/llama/tp.py``); this module checks the input on every
rank, places each rank's shard and patches it.

Why not transformers' ``tp_plan`` / ``DistributedConfig``: OPT's config has no ``base_model_tp_plan`` in
transformers 5.x, and that path shards through DTensor-wrapped nn.Linear forwards, which the fused modules bypass
(they read the weights); here the shards are plain tensors the fused kernels take as they are.

Fast decode captures the per-op step, NCCL all-reduces included, into a CUDA graph on each rank; the one-kernel
decode step has no all-reduce between its phases and is not used. Every rank computes the same tokens (the LM
head's input is the all-reduce's result, identical on every rank; ``init_distributed`` seeds every rank alike for
sampling), so ``model.generate`` returns the same tokens on every rank.

``tensor_parallel`` is one-way: the other ranks' slices are not kept (that is the memory it saves).
``fuseinfer.unpatch`` leaves the sharded model with unfused tensor-parallel modules (still correct).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fuseinfer.core.errors import FuseInferError
from fuseinfer.models import family
from fuseinfer.core import placement
from fuseinfer.parallel.dist import gather_errors
from fuseinfer.harness.materialize import Init, materialize

from fuseinfer.core.decode_plan import TP_ATTR, tp_info  # noqa: F401 (re-exported)


@dataclass(frozen=True, eq=False)
class TPInfo:
    """This rank's place: rank and size in ``group`` (None: the default group)."""

    rank: int
    size: int
    group: object = None

    def __deepcopy__(self, memo):  # a process group cannot be copied; a copy of the model shares it
        return self


def _config_hash(model: nn.Module, size: int) -> str:
    """What every rank must agree on: the config (less its path and transformers version), dtype and TP size."""
    cfg = {k: v for k, v in model.config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    dtype = next(model.parameters()).dtype
    text = json.dumps(cfg, sort_keys=True, default=str) + f"|{dtype}|tp={size}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _local_error(model, size: int, tp_size, device: torch.device, backend: str, init) -> str | None:
    """The first problem with this rank's input, or None (checked before any collective, on every rank)."""
    from fuseinfer.core.state import patch_state

    fam = family(getattr(getattr(model, "config", None), "model_type", None))
    why = (f"tensor_parallel takes a model of a family fuseinfer patches, got {type(model).__name__}"
           if fam is None else fam.tp_reason(model, size))
    if why is not None:
        return why
    if tp_info(model) is not None:
        return "this model is already tensor-parallel (tensor_parallel is one-way: reload the model to change it)"
    if patch_state(model) is not None:
        return "tensor_parallel patches the model itself: pass the unpatched model (fuseinfer.unpatch(model) first)"
    if placement.is_hooked(model):
        return ("the model is dispatched by accelerate (device_map / dispatch_model): tensor_parallel needs the whole "
                "model on one device, or on the meta device: load it without device_map (or device_map='cpu'), or "
                "on meta with an init, and let tensor_parallel place each rank's shard")
    if tp_size is not None and tp_size != size:
        return (f"tp_size={tp_size} but the process group has {size} rank(s): launch torchrun --nproc-per-node "
                f"{tp_size}, or pass group= a process group of {tp_size} ranks")
    if device.type == "cuda":
        if backend != "nccl":
            return (f"tensor_parallel on CUDA needs the NCCL backend, the process group uses {backend!r} (NCCL is "
                    f"{'available' if dist.is_nccl_available() else 'not available in this torch build'}): "
                    "fuseinfer.parallel.init_distributed() picks NCCL when a GPU is visible")
        if size > torch.cuda.device_count():
            return (f"tensor-parallel size {size} is larger than the {torch.cuda.device_count()} visible GPU(s): "
                    f"one GPU per rank (torchrun --nproc-per-node {torch.cuda.device_count()} at most)")
    elif backend == "nccl":
        return "the process group uses NCCL, which needs CUDA tensors: pass device='cuda:N' (or use gloo on CPU)"
    if model.training:
        return "the model is in training mode: call model.eval() (tensor-parallel layers are for inference)"
    meta = next((n for n, p in model.named_parameters() if p.is_meta), None)
    if meta is not None and init is None:
        return (f"{meta} is on the meta device and no init was given: load real weights, or pass "
                "init=fuseinfer.parallel.random_init(seed) for random weights")
    return None


def tensor_parallel(model: nn.Module, tp_size: int | None = None, group=None, *, device=None,
                    init: Init | None = None, config=None):
    """Shard ``model`` (an unpatched causal LM whose family has a tensor-parallel plan, in eval mode, on the
    CPU, on this rank's GPU or on the meta device with ``init``) over the ranks of ``group`` (default: the whole
    default group; ``init_distributed`` joins it), place this rank's shard on ``device`` (default: the current GPU under NCCL, the CPU under gloo),
    and patch it (``config``: a PatchConfig, default every op). Returns the PatchReport.

    Every rank must call it (it runs collectives). Bad input (TP size not dividing the (key/value) heads or the MLP
    width, more ranks than GPUs, a model accelerate dispatched, no NCCL for CUDA, ranks with different configs)
    raises one FuseInferError on every rank, naming the rank that found it, before anything is changed."""
    from fuseinfer.core.config import PatchConfig
    from fuseinfer.patching import patch
    from fuseinfer.core.state import patch_state, unwrapped

    model = unwrapped(model)
    if not isinstance(model, nn.Module):
        raise FuseInferError(f"tensor_parallel takes a torch.nn.Module, got {type(model).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise FuseInferError("tensor_parallel needs torch.distributed initialised: call "
                             "fuseinfer.parallel.init_distributed() in a script launched by torchrun")
    config = PatchConfig() if config is None else config
    backend = dist.get_backend(group)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    device = torch.device(device)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    error = _local_error(model, size, tp_size, device, backend, init)
    hashes = gather_errors(error, None if error else _config_hash(model, size), group)
    if len(set(hashes)) > 1:
        raise FuseInferError(f"the ranks disagree on the model (config/dtype hash per rank: {hashes}): load the same "
                             "model in the same dtype on every rank")
    info = TPInfo(rank, size, group)
    report, error = None, None
    try:
        fam = family(model.config.model_type)
        materialize(model, device, init, fam.tp_shard_spec(info))
        fam.tp_prepare(model, info)
        report = patch(model, config)
        split = fam.tp_finish(model, info, patch_state(model).state, report)
        report.placement = {"tensor_parallel": f"rank {rank} of {size} on {device} ({backend}): {split}"}
        object.__setattr__(model, TP_ATTR, info)
    except Exception as exc:  # (OOM on one rank, say): every rank raises, none waits on a collective
        error = f"{type(exc).__name__}: {exc}"
    gather_errors(error, None, group)
    return report

