"""Where a patch is recorded on a model, and how to read it back.

``patch`` keeps a :class:`PatchState` on the model (the family that patched it, what it needs to undo the patch,
the report and the config). The runtime and the feature packages read it through :func:`patch_state` without
importing the engine. :func:`model_lock` is the one lock per model that ``patch``, ``unpatch``, generate calls and
the patched forward hold, so that no caller sees a model half patched or half unpatched.
"""
from __future__ import annotations

import threading
import weakref
from typing import NamedTuple

import torch

from fuseinfer.core.config import PatchConfig, PatchReport, RuntimeConfig

STATE_ATTR = "_fuseinfer_state"
LOCK_ATTR = "_fuseinfer_lock"


class PatchState(NamedTuple):
    family: object  # the family's rules: a fuseinfer.models.base.ModelFamily (a layer above this one)
    state: dict  # what the family needs to undo its swaps
    report: PatchReport
    config: PatchConfig
    generate: object = None  # the model's own instance attribute ``generate`` before patching, if it had one
    quant: object = None  # PatchConfig.quant's state (its ``undo(model)`` runs in unpatch), or None
    forward_class: type | None = None  # the model's class before patch gave it the fast forward's, or None


def unwrapped(model):
    """The module a ``torch.compile`` wrapper (OptimizedModule) compiles, else ``model``: patching swaps the
    wrapped model's modules (dynamo recompiles for them), and its ``generate`` is what the wrapper exposes."""
    return getattr(model, "_orig_mod", model) if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) \
        else model


class ModelLock:
    """The holder of a model's lock (``model.__dict__[LOCK_ATTR]``, shared with the patched decoder it contains). A
    deep copy or a pickled copy of the model gets a lock of its own (a lock cannot be copied)."""

    def __init__(self):
        self.lock = threading.RLock()

    def __deepcopy__(self, memo):
        return ModelLock()

    def __reduce__(self):
        return ModelLock, ()


_LOCK_GUARD = threading.Lock()


def lock_holder(model) -> ModelLock:
    """``model``'s :class:`ModelLock`, made on first use and kept for the model's lifetime (patched or not), so that
    a caller waiting on it while another unpatches and re-patches the model still waits on the same lock."""
    model = unwrapped(model)
    holder = model.__dict__.get(LOCK_ATTR)
    if holder is None:
        with _LOCK_GUARD:
            holder = model.__dict__.get(LOCK_ATTR)
            if holder is None:
                holder = ModelLock()
                object.__setattr__(model, LOCK_ATTR, holder)
    return holder


def model_lock(model) -> threading.RLock:
    """The lock that serialises ``patch``, ``unpatch``, generate calls and forwards of the patched model on
    ``model``: the patch swaps module classes and tensors that a running forward reads, and fast decode's sessions
    (static cache, step buffers, graphs) are one per batch bucket, shared by every caller. Re-entrant:
    ``model.generate`` holds it while it calls ``fuseinfer.generate`` and the model's forward."""
    return lock_holder(model).lock


def patch_state(model) -> PatchState | None:
    """What ``patch`` recorded on ``model`` (family, undo state, report, config), or None if unpatched."""
    return getattr(unwrapped(model), STATE_ATTR, None)


def runtime_config(model) -> RuntimeConfig:
    """How ``model`` runs: the RuntimeConfig it was patched with (``PatchConfig.runtime``); for an unpatched model,
    the defaults (the ``FUSEINFER_*`` variables as set now)."""
    state = patch_state(model)
    return state.config.runtime if state else RuntimeConfig()


def patch_report(model) -> PatchReport | None:
    """The report of the patch currently applied to ``model``, or None."""
    state = patch_state(model)
    return state.report if state else None


# The config copies patched models hold (patches/opt.py gives each patched model its own copy, see README): id of
# the copy -> (weak reference to it, weak reference to the model). Lets ``patch`` tell a part of a patched model
# (refused) from another model built on a patched model's config (patched like any other).
_config_owners: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def own_config(config, model) -> None:
    """Record that ``model`` (patched) holds the config copy ``config``."""
    _config_owners[id(config)] = (weakref.ref(config, lambda _, key=id(config): _config_owners.pop(key, None)),
                                  weakref.ref(model))


def disown_config(config) -> None:
    _config_owners.pop(id(config), None)


def config_owner(config):
    """The patched model holding the config copy ``config``, or None."""
    refs = _config_owners.get(id(config))
    if refs is None or refs[0]() is not config:
        return None
    return refs[1]()
