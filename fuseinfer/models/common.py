"""What every family's module swaps share: when a fused module must run its original forward (training, autocast,
hooks), class and config swaps that keep transformers' bookkeeping, the state_dict hook for fused q/k/v storage, the
op backends a patch report lists, the pending attention call of a patched-modules strategy, Megatron's shard
spec for tensor parallel, and what the lean prefill loops check before each call (their plan's cache, the call
checks). Families import these; no family imports another family's modules.
"""
from __future__ import annotations

import copy
import functools

import torch
from torch import nn

from fuseinfer.core import placement
from fuseinfer.core.config import ATTN_NAME
from fuseinfer.core.errors import FuseInferError
from fuseinfer.core.extension import backend_for
from fuseinfer.core.state import LOCK_ATTR, disown_config, own_config, patch_state
from fuseinfer.layers import attention_backend, hf_attention
from fuseinfer.ops.attention import kernel_supports


def original_forward(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether a fused module runs its original forward: in training mode (dropout is not fused), under autocast
    to another dtype than x's (autocast picks each op's dtype, which the fused ops do not model), and while a
    global module hook is registered (it must see every submodule call, which the fused forwards skip)."""
    return module.training or global_hooks() or (torch.is_autocast_enabled(x.device.type)
                                                 and torch.get_autocast_dtype(x.device.type) != x.dtype)


def global_hooks() -> bool:
    """Whether a hook for every module is registered (``torch.nn.modules.module.register_module_forward_hook``
    and its pre-hook and backward siblings; profilers such as torch's ModuleTracker use them)."""
    m = torch.nn.modules.module
    return bool(m._global_forward_hooks or m._global_forward_pre_hooks or m._global_backward_hooks
                or m._global_backward_pre_hooks)


def has_hooks(module: nn.Module) -> bool:
    """Forward (pre-)hooks other than transformers' own output capture (installed on the decoder layers and
    attention modules by the first call with output_hidden_states / output_attentions; it records the hidden
    states and the attention weights, which the fused modules return as the originals do) and the families' own
    (input checks), backward (pre-)hooks, or a forward replaced on the instance (accelerate's hooks, ``_hf_hook``,
    work that way)."""
    hooks = list(module._forward_hooks.values()) + list(module._forward_pre_hooks.values())
    return (forward_replaced(module) and not placement.passive_hook(module)) or \
        bool(module._backward_hooks or module._backward_pre_hooks) or \
        any(not _own_hook(getattr(h, "__module__", None) or "") for h in hooks)


def _own_hook(module_name: str) -> bool:
    """transformers' output capture, or a hook a family's patch installs (its input checks); a profiler's or any
    other package's hook (fuseinfer's own profiler included) is a user hook."""
    return module_name == "transformers.utils.output_capturing" or module_name.startswith("fuseinfer.models.")


def forward_replaced(module: nn.Module) -> bool:
    """Whether ``module.forward`` is replaced on the instance (accelerate's hooks, ``_hf_hook``, work that way)."""
    return "forward" in module.__dict__ or hasattr(module, "_hf_hook")


def swap_class(model: nn.Module, cls: type) -> None:
    """Change a transformers model's class, carrying over what transformers registered for its class (the outputs
    that ``output_hidden_states`` / ``output_attentions`` record, keyed by the class's name)."""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:  # (a transformers without that registry reads the class attribute)
        _CAN_RECORD_REGISTRY = None
    recorded = _CAN_RECORD_REGISTRY.get(model) if _CAN_RECORD_REGISTRY is not None else None
    model.__class__ = cls
    if recorded:
        _CAN_RECORD_REGISTRY[model] = recorded


def _own_storage(names, module, state_dict, prefix, local_metadata) -> None:
    for name in names:
        for p in ("weight", "bias"):
            key = f"{prefix}{name}.{p}"
            t = state_dict.get(key)
            if t is not None and not isinstance(t, nn.Parameter):
                state_dict[key] = t.clone()


def own_storage_hook(names: tuple):
    """A state_dict hook giving the weights and biases of the submodules ``names`` (views of one fused tensor) as
    copies, each with storage of its own, as the unpatched model's are: transformers takes tensors that share
    storage for tied weights (its save and tied-weights checks). Parameters (``keep_vars=True``) stay themselves.
    (A partial of a module-level function, so that a model holding it still pickles.)"""
    return functools.partial(_own_storage, tuple(names))


own_qkv_storage = own_storage_hook(("q_proj", "k_proj", "v_proj"))


def replace_config(model: nn.Module, old, new) -> None:
    """Point every module of ``model`` that holds the config object ``old`` at ``new``."""
    for m in model.modules():
        if m.__dict__.get("config") is old:
            m.config = new


def own_config_copy(model: nn.Module):
    """Give ``model`` and each of its modules that holds its config object a shallow copy of it, so that changing
    the attention implementation leaves other models on that object (e.g. ``OPTForCausalLM(other.config)``) as
    they are. Returns (original, copy) for ``unpatch`` (not the holders: the state lives on the model, which must
    not reference itself)."""
    original, own = model.config, copy.copy(model.config)
    replace_config(model, original, own)
    own_config(own, model)
    return original, own


def lock_models(modules, cls_of, holder, state: dict) -> None:
    """Swap each base model in ``modules`` to its locked class ``cls_of(module)`` (a forward holding the patched
    model's lock ``holder``, kept in its ``__dict__``); ``state["locked"]`` lists them for :func:`unlock_models`."""
    state["locked"] = list(modules)
    for module in state["locked"]:  # (the holder stays in the module's __dict__ after unpatch: see its forward)
        cls = cls_of(module)
        swap_class(module, cls)
        object.__setattr__(module, LOCK_ATTR, holder)
        placement.swap_forward(module, cls, state)


def unlock_models(state: dict, cls_of) -> None:
    for module in state.get("locked", ()):
        swap_class(module, cls_of(module))


def install_attention(model: nn.Module, config, report, like: torch.Tensor, head_dim: int, attention_types: tuple,
                      state: dict) -> None:
    """Point the model at fuseinfer's attention implementation (on a copy of its config, so that other models on
    the same config object keep theirs) and install the attention backends the patch config resolves; in training
    mode report it skipped. :func:`restore_attention` undoes it."""
    if model.training:
        report.skipped.append(("attention", "model is in training mode; call model.eval() first"))
        return
    state["config"] = own_config_copy(model)
    before = model.config._attn_implementation
    model.config._attn_implementation = hf_attention.NAME
    report.attn_implementation = (before, hf_attention.NAME)
    names = attention_backend.resolve(config, head_dim)
    state["attn_backends"] = attention_backend.install(model, names, attention_types)
    report.attention_backends = attention_backend.describe(names, config, like, head_dim)


def restore_attention(model: nn.Module, state: dict) -> None:
    if state.get("config") is not None:
        original, own = state["config"]
        disown_config(own)
        # what else changed on the copy while patched (e.g. use_cache) carries over to the original
        original.__dict__.update({k: v for k, v in own.__dict__.items() if k != "_attn_implementation_internal"})
        replace_config(model, own, original)
    attention_backend.uninstall(state.get("attn_backends", ()))


def op_backends(module: nn.Module, ops, like: torch.Tensor) -> dict[str, str]:
    """op -> 'cuda' | 'reference' | 'sdpa (why)' for a module's parameters (``like``'s device and dtype for a
    module without any, e.g. a LayerNorm with elementwise_affine=False)."""
    p = next(module.parameters(), like)
    out = {op: backend_for(p) for op in sorted(ops)}
    if "attention" in out and p.is_cuda:  # on CUDA, what our kernel does not cover runs SDPA
        head_dim = getattr(module, "head_dim", 0)
        if out["attention"] != "cuda":
            out["attention"] = "sdpa (no fuseinfer kernels here)"
        elif not kernel_supports(p.new_empty(1, 1, 1, head_dim)):
            out["attention"] = f"sdpa (no kernel for {p.dtype}, head dim {head_dim})"
    return out


class PendingAttention:
    """A patched-modules strategy's ``attention`` result: the attention module's call, made by the output
    projection's step that follows (the module runs that projection itself, with the residual in its epilogue, and
    its hooks see its whole output)."""

    __slots__ = ("attn", "x", "kwargs")

    def __init__(self, attn, x, kwargs):
        self.attn, self.x, self.kwargs = attn, x, kwargs


class PendingNorm:
    """A patched-modules strategy's ``norm`` output when the layer folds its norms into the GEMV after each (the
    families' ``FOLD_NORMS``): the un-normalised rows and the norm module, which the attention / MLP step applies (in
    its GEMV's prologue where it can, else first)."""

    __slots__ = ("x", "norm")

    def __init__(self, x, norm):
        self.x, self.norm = x, norm


def fold_rows(h: torch.Tensor, max_rows: int) -> bool:
    """Whether a layer input h (..., E) is few enough rows (at most ``max_rows``, the family's ``FOLD_MAX_ROWS``) for
    its norms to fold into the GEMV after each, where that gains (the families measure it by batch size)."""
    return h.numel() <= max_rows * h.shape[-1]


def plain_call(module: nn.Module) -> bool:
    """Whether calling ``module`` runs its forward alone (no hooks, no replaced forward), so it may take
    un-normalised rows and a ``prenorm``."""
    return not (has_hooks(module) or module._forward_hooks or module._forward_pre_hooks
                or "forward" in module.__dict__)


def static_cache(cache) -> bool:
    """Whether ``cache`` is fuseinfer's static KV cache (per-layer (B, Hkv, T, D) ``keys`` / ``values`` and the slots
    of the next write, ``write_idx``), which the q/k/v GEMV's epilogue writes into directly
    (``ops.linear_rope_append``)."""
    return isinstance(getattr(cache, "keys", None), list) and isinstance(getattr(cache, "write_idx", None),
                                                                         torch.Tensor)


def cache_slots(cache, device: torch.device) -> torch.Tensor:
    """A static cache's write slots (S,) on ``device`` (a split model's layer may sit on another device)."""
    slots = cache.write_idx
    return slots if slots.device == device else slots.to(device)


def megatron_shard_spec(info, column, row):
    """Tensor parallel's shard spec for ``materialize`` (Megatron's layout): parameter name -> (dim, rank, size),
    None (replicated) or "drop" (not on this rank). ``column`` / ``row``: compiled patterns of the column-parallel
    (split by output features) and row-parallel (split by input features; bias on rank 0 only) parameters."""
    def spec(name: str):
        if column.search(name):
            return (0, info.rank, info.size)  # weight (N, K) rows / bias (N,): this rank's output features
        if row.search(name):  # weight (N, K) columns: this rank's input features; the bias on rank 0 only
            return (1, info.rank, info.size) if name.endswith(".weight") else (None if info.rank == 0 else "drop")
        return None  # replicated

    return spec


# ---- the lean prefill loops (models/<family>/lean.py) ----

LEAN_PLAN_KEY = "prefill_plan"  # where a lean loop's plan is kept in the patch state's family dict


def lean_plan(model: nn.Module, layers, structure_reason, build):
    """(the model's lean-loop plan, None), or (None, why the lean loop cannot serve it): ``structure_reason(model)``
    checked and ``build(model)`` made once per patch, kept with it (in the patch state, which unpatch drops and a deep
    copy of the model copies along with its modules), rebuilt when ``layers`` (the decoder's layer list) is another
    object. ``model`` may be a weak proxy (a session's)."""
    state = patch_state(model)
    if state is None:
        return None, "fuseinfer.prefill needs a patched model: call fuseinfer.patch(model) first"
    cached = state.state.get(LEAN_PLAN_KEY)
    if cached is not None and cached[0] is layers:
        return cached[1], cached[2]
    why = structure_reason(model)
    plan = build(model) if why is None else None
    state.state[LEAN_PLAN_KEY] = (layers, plan, why)
    return plan, why


def checked_plan(plan_and_why):
    """The plan of ``lean_plan``'s (plan, why): ``FuseInferError(why)`` where the lean loop cannot serve the model."""
    plan, why = plan_and_why
    if why is not None:
        raise FuseInferError(why)
    return plan


def lean_call_reason(model: nn.Module, called, like: torch.Tensor) -> str | None:
    """Why a lean loop cannot stand in for the patched modules on this call, or None: training mode, autocast to
    another dtype than ``like``'s (a weight of the model), hooks on the model or on a module the patched forward
    calls (``called``; the lean loop calls none of them)."""
    if model.training:
        return "model is in training mode"
    # (at every call, not with the structure: transformers' generate, the fallback of the patched one, switches
    # the attention implementation back for its call, and the patched modules then run that one)
    if model.config._attn_implementation != ATTN_NAME:
        return ("the model does not run the fuseinfer attention (patch() skips it in training mode: call "
                "model.eval() before fuseinfer.patch(model))")
    dev, dtype = like.device.type, like.dtype
    if torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) != dtype:
        return "autocast to another dtype than the model's (the patched modules run the original forward)"
    # (the modules' own dicts read directly: this runs before every lean call's launch, over every layer)
    if global_hooks() or any(has_hooks(m) for m in (model, *called)
                             if (d := m.__dict__)["_forward_hooks"] or d["_forward_pre_hooks"] or d["_backward_hooks"]
                             or d["_backward_pre_hooks"] or "forward" in d or "_hf_hook" in d):
        return "a module has hooks, which the lean loop would bypass"
    return None
