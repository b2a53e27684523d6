"""Patching models placed by accelerate (``from_pretrained(..., device_map=...)``, ``dispatch_model``, offload).

accelerate's ``add_hook_to_module`` replaces ``module.forward`` on the instance by a wrapper that runs the hook's
``pre_forward`` (move the inputs to the execution device, load offloaded weights), then ``module._old_forward``
(a bound method of the module's class's forward, taken when the hook was added), then ``post_forward``. The
wrapper looks ``_old_forward`` up at every call, so a swapped module runs its fused forward under the hook when
``_old_forward`` is re-pointed at the new class's forward (``swap_forward``); ``unpatch`` puts the very same bound
method object back (``restore_forward``), so hooks and modules are as they were.

Offloaded modules (CPU or disk offload: an ``AlignDevicesHook`` with ``offload=True`` on the module or a
submodule) keep their weights on the meta device between calls; the hook loads them for each forward and drops
them after. The fused modules read their weights directly and the fused q/k/v buffer is a concatenation of
resident weights, so an offloaded module is left unswapped (it runs its original forward under its hooks) and
the patch report says so.

Fast decode (``decode_plan``): offloaded models fall back to transformers' generate (the static cache and the
graphs need resident weights); a model split over several GPUs runs the per-op step eagerly, without CUDA graphs.
Why not one graph per device segment: PyTorch captures a graph on one device with that device's memory pool, and
the hooks' cross-device copies between segments would have to join the capture from the other device's stream;
and for the models that need splitting the step is bound by weight reads (tens of ms per token), against which
the host launch time that graphs save (~5 us a kernel, overlapped with the GPU's work) is small. The KV cache of
each layer lives on that layer's execution device (``fuseinfer.runtime.cache.SplitKVCache``).
"""
from __future__ import annotations

import logging
import types

import torch
from torch import nn

logger = logging.getLogger("fuseinfer")


def _hooks(module: nn.Module) -> list:
    """The accelerate hooks on ``module`` itself (a SequentialHook's members flattened)."""
    hook = module.__dict__.get("_hf_hook")
    if hook is None:
        return []
    return list(getattr(hook, "hooks", None) or [hook])


def is_hooked(model: nn.Module) -> bool:
    """Whether accelerate placed ``model``: a hook on any module, or a device map over several devices (a map with
    one device, as ``from_pretrained(device_map={"": "cuda:0"})`` may record, placed it without hooks: a plain
    model on that device)."""
    device_map = getattr(model, "hf_device_map", None) or {}
    return len({str(d) for d in device_map.values()}) > 1 or any(_hooks(m) for m in model.modules())


def offload_device(module: nn.Module) -> str | None:
    """'cpu', 'disk' or 'offloaded' when accelerate offloads a weight of ``module`` or of a submodule, else None."""
    for m in module.modules():
        for hook in _hooks(m):
            if getattr(hook, "offload", False):
                wm = getattr(hook, "weights_map", None)
                dataset = getattr(wm, "dataset", None)  # accelerate's PrefixedDataset over an OffloadedWeightsLoader
                if dataset is not None and getattr(dataset, "save_folder", None):
                    return "disk"
                return "cpu" if wm is not None else "offloaded"
    return None


def offloaded_tensor_names(model: nn.Module) -> set[str]:
    """Qualified names of the parameters and buffers that an offloading hook loads at each forward (they are on the
    meta device in between, which ``patch`` must not mistake for a model whose weights were never loaded)."""
    names = set()
    for prefix, m in model.named_modules():
        if any(getattr(h, "offload", False) for h in _hooks(m)):
            for sub_prefix, sub in m.named_modules(prefix=prefix):
                names.update(f"{sub_prefix}.{n}".lstrip(".") for n, _ in sub.named_parameters(recurse=False))
                names.update(f"{sub_prefix}.{n}".lstrip(".") for n, _ in sub.named_buffers(recurse=False))
    return names


def _accelerate_wrapped(module: nn.Module) -> bool:
    """Whether ``module.forward`` is accelerate's hook wrapper around the module's own class's forward."""
    old = module.__dict__.get("_old_forward")
    return bool(_hooks(module)) and isinstance(old, types.MethodType) and old.__self__ is module \
        and old.__func__ is type(module).forward


def passive_hook(module: nn.Module) -> bool:
    """Whether ``module``'s only hooks are accelerate's execution-device hooks that a fused parent may bypass:
    ``dispatch_model`` puts one (no offload, no output move) on every submodule of a placed block besides the
    block's own, and they only move inputs to the device where the module's tensors already are (the block's hook
    moved them there). A hook of another kind, or tensors elsewhere, is not passive."""
    hooks = _hooks(module)
    if not hooks or not _accelerate_wrapped(module):
        return False
    for hook in hooks:
        if type(hook).__name__ != "AlignDevicesHook" or hook.offload or hook.io_same_device \
                or hook.execution_device is None:
            return False
        dev = hook.execution_device
        dev = torch.device(f"cuda:{dev}" if isinstance(dev, int) else dev)
        tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        if any(t.device != dev for t in tensors):
            return False
    return True


def bypass_reason(module: nn.Module) -> str | None:
    """Why ``module`` must stay unswapped because of how it is placed, or None (no hook, or accelerate's hook,
    under which the fused forward runs after ``swap_forward``)."""
    where = offload_device(module)
    if where is not None:
        return (f"offloaded by accelerate ({where}): its weights stay on the meta device until its hook loads them "
                "for each forward, so the fused forward (which reads them directly) and the fused q/k/v buffer "
                "cannot be built; it runs unswapped under its hooks (load it on a GPU to fuse it)")
    if "forward" in module.__dict__ or "_hf_hook" in module.__dict__:
        if _accelerate_wrapped(module):
            return None
        return ("its forward is replaced on the instance (not by an accelerate hook around its class's forward): "
                "the fused forward would not run")
    return None


def swap_forward(module: nn.Module, cls: type, state: dict) -> None:
    """After ``module.__class__ = cls``: make accelerate's wrapper call ``cls.forward`` (the hook keeps moving
    inputs); remembers the original bound method in ``state['hooks']`` for ``restore_forwards``."""
    old = module.__dict__.get("_old_forward")
    if old is None or not _hooks(module):
        return
    state.setdefault("hooks", []).append((module, old))
    module._old_forward = types.MethodType(cls.forward, module)


def restore_forwards(state: dict) -> None:
    """Undo every ``swap_forward``: the hooks call the very bound methods they called before ``patch``."""
    for module, old in state.pop("hooks", []):
        module._old_forward = old


def execution_device(module: nn.Module) -> torch.device | None:
    """Where ``module`` computes: its accelerate hook's execution device, else its first non-meta tensor's."""
    for hook in _hooks(module):
        dev = getattr(hook, "execution_device", None)
        if dev is not None:
            return torch.device(f"cuda:{dev}" if isinstance(dev, int) else dev)
    for t in list(module.parameters()) + list(module.buffers()):
        if not t.is_meta:
            return t.device
    return None


def placement(model: nn.Module, report) -> dict[str, str]:
    """For a model accelerate placed: {module name: where it runs} for each swapped and each skipped module
    ('cuda:1', or 'cuda:0, offloaded to cpu'); {} for a model without accelerate's hooks."""
    if not is_hooked(model):
        return {}
    out = {}
    names = [s.name for s in report.swaps] + [name for name, _ in report.skipped]
    modules = dict(model.named_modules())
    for name in names:
        module = modules.get(name)
        if module is None:
            continue
        dev = _inherited_device(model, name) or execution_device(module)
        where = offload_device(module)
        out[name] = f"{dev}" + (f", offloaded to {where}" if where else "")
    return out


def _inherited_device(model: nn.Module, name: str) -> torch.device | None:
    """The execution device of the closest hooked ancestor of module ``name`` (itself included)."""
    parts = name.split(".") if name else []
    for i in range(len(parts), -1, -1):
        m = model.get_submodule(".".join(parts[:i]))
        for hook in _hooks(m):
            dev = getattr(hook, "execution_device", None)
            if dev is not None:
                return torch.device(f"cuda:{dev}" if isinstance(dev, int) else dev)
    return None


# ---- fast decode on placed models -----------------------------------------------------------------------------

_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.warning("fuseinfer: %s", message)


def layer_devices(model: nn.Module, layers: tuple[str, nn.ModuleList]) -> list[torch.device]:
    """The execution device of each decoder layer (where its KV cache must live). layers: (qualified name, the
    module list) of the model's decoder layers, as its family finds them (``ModelFamily.decoder_layers``)."""
    prefix, modules = layers
    return [_inherited_device(model, f"{prefix}.{i}") or execution_device(layer) for i, layer in enumerate(modules)]


def decode_refusal(model: nn.Module) -> str | None:
    """Why fast decode does not take this placed model (offload), or None."""
    where = offload_device(model)
    if where is not None:
        return (f"accelerate offloads part of the model ({where}): fast decode's static cache and graphs need "
                "resident weights: model.generate hands such calls to transformers' generate (whose hooks load the "
                "weights layer by layer)")
    return None


def graph_refusal(model: nn.Module, layers: tuple[str, nn.ModuleList]) -> str | None:
    """Why the decode step runs eagerly instead of as a CUDA graph (a model split over devices), or None; layers as
    :func:`layer_devices` takes them."""
    if not is_hooked(model):
        return None
    devices = {d for d in layer_devices(model, layers) if d is not None}
    devices.add(next(model.parameters()).device)
    devices.discard(torch.device("meta"))
    if len(devices) > 1:
        return (f"the model is split over {len(devices)} devices by accelerate ({', '.join(sorted(map(str, devices)))}"
                "): the per-op step runs eagerly (no CUDA graph: docs/multi_gpu.md)")
    return None



def logits_on(device: torch.device, forward):
    """``forward`` with its logits moved to ``device`` (the LM head may run on another GPU than the session)."""

    def moved(model, *args):
        return forward(model, *args).to(device)

    return moved
