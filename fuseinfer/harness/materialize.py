"""Models too big for host memory: built on the ``meta`` device, their parameters made one at a time on the GPU.

``random_init(seed)`` draws each parameter from a generator seeded by (seed, parameter name) on the device it is
made on, so every rank of a tensor-parallel run (and a single-GPU run of the same model) makes the same full
tensor and keeps its own slice of it; nothing passes through host memory. ``materialize`` replaces a meta model's
parameters in place (keeping tied parameters tied); ``random_model`` is what ``random:`` models of the eval use.
"""
from __future__ import annotations

import zlib
from typing import Callable

import torch
from torch import nn

from fuseinfer.core.errors import FuseInferError

# init(name, shape, dtype, device) -> the full tensor of parameter ``name``
Init = Callable[[str, torch.Size, torch.dtype, torch.device], torch.Tensor]
# shard(name) -> (dim, index, parts) to keep slice ``index`` of ``parts`` along ``dim``, None to keep all of it,
# or "drop" to hold no tensor (a row-parallel bias on ranks other than 0)
Shard = Callable[[str], "tuple[int, int, int] | None | str"]


def random_init(seed: int = 0, std: float = 0.02) -> Init:
    """Random weights: matrices, embeddings and biases ~ N(0, std), norm weights (LayerNorm, RMSNorm: a module whose
    name has "norm") 1 + N(0, std), LayerNorm biases N(0, std) (biases are not zero, so a bias added twice shows in a comparison). Drawn in fp32
    with a generator seeded by ``seed`` and the name (crc32), then rounded to ``dtype``: the same values for every
    dtype on one device type."""

    def init(name: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        gen = torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        t = torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, std, generator=gen)
        if name.endswith(".weight") and "norm" in name.rsplit(".", 2)[-2]:
            t += 1.0
        return t.to(dtype)

    return init


@torch.no_grad()
def materialize(model: nn.Module, device, init: Init | None = None, shard: Shard | None = None) -> nn.Module:
    """Give every parameter of ``model`` a real tensor on ``device`` (a device, or ``name -> device`` to follow a
    device map): a meta parameter from ``init`` (required then), another one copied; with ``shard``, only the slice
    it names (copied from the host slice, not the whole tensor). One full parameter at a time is on the device
    besides the model. Tied parameters stay one object (on the device of the first name that holds them)."""
    from fuseinfer import models

    where = device if callable(device) else (lambda name, d=torch.device(device): d)
    made: dict[int, nn.Parameter | None] = {}
    fam = models.family_of(model)
    if fam is not None:  # buffers no checkpoint holds (rotary tables), made on the CPU, placed below
        fam.init_buffers(model)
    for prefix, module in model.named_modules():
        for pname, param in list(module._parameters.items()):
            if param is None:
                continue
            name = f"{prefix}.{pname}".lstrip(".")
            if id(param) not in made:
                made[id(param)] = _make(name, param, torch.device(where(name)), init, shard)
            module._parameters[pname] = made[id(param)]
        for bname, buf in list(module._buffers.items()):
            if buf is not None and buf.is_meta:
                raise FuseInferError(f"buffer {prefix}.{bname} is on the meta device and has no initializer")
            if buf is not None:
                module._buffers[bname] = buf.to(where(f"{prefix}.{bname}".lstrip(".")))
    return model


def _make(name, param, device, init, shard):
    how = shard(name) if shard is not None else None
    if how == "drop":
        return None
    if how is None and not param.is_meta and param.device == device:
        return param  # already where it belongs: the same Parameter object
    if param.is_meta:
        if init is None:
            raise FuseInferError(f"{name} is on the meta device and no init was given")
        full = init(name, param.shape, param.dtype, device)
    else:
        full = param.detach()
    if how is not None:
        dim, index, parts = how
        size = full.shape[dim] // parts
        full = full.narrow(dim, index * size, size)
    t = full.to(device).contiguous()
    if (t.data_ptr() == param.data_ptr() and not param.is_meta) or t.untyped_storage().nbytes() > t.nbytes:
        # never share storage with the tensor it replaces, and never keep a whole parameter alive for its slice: a
        # dim-0 slice is a contiguous view, so without the copy each rank of OPT-66b TP=2 held ~36 GiB of the other
        # rank's halves (the 98.9 GiB peak per GPU of the first two-GPU run, 61.6 GiB of it weights)
        t = t.clone()
    return nn.Parameter(t, requires_grad=False)


def meta_model(config, dtype: torch.dtype):
    """A causal LM of ``config`` (any family) with every tensor on the meta device, in eval mode."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def random_model(config, dtype: torch.dtype, device: torch.device | str, seed: int = 0) -> nn.Module:
    """The eval's ``random:`` model: built on meta, each parameter drawn on ``device`` (``random_init``)."""
    return materialize(meta_model(config, dtype), device, random_init(seed, getattr(config, "init_std", 0.02)))


def device_map_lookup(device_map: dict) -> Callable[[str], torch.device]:
    """name -> device of an accelerate device map ({module prefix: device}; the longest matching prefix wins)."""

    def where(name: str) -> torch.device:
        best = max((k for k in device_map if k == "" or name == k or name.startswith(k + ".")), key=len, default=None)
        if best is None:
            raise FuseInferError(f"{name} is not covered by the device map")
        dev = device_map[best]
        return torch.device(f"cuda:{dev}" if isinstance(dev, int) else dev)

    return where
