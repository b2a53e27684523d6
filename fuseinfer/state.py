"""Where a patch is recorded on a model, and how to read it back.

``patch`` keeps a :class:`PatchState` on the model (the family that patched it, what it needs to undo the patch,
the report and the config). The runtime and the feature packages read it through :func:`patch_state` without
importing the engine.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, NamedTuple

import torch

from .config import PatchConfig, PatchReport

if TYPE_CHECKING:
    from .patches.base import ModelFamily

STATE_ATTR = "_fuseinfer_state"


class PatchState(NamedTuple):
    family: "ModelFamily"  # the family's rules (fuseinfer/patches/<family>.py)
    state: dict  # what the family needs to undo its swaps
    report: PatchReport
    config: PatchConfig
    generate: object = None  # the model's own instance attribute ``generate`` before patching, if it had one
    quant: object = None  # PatchConfig.quant's state (its ``undo(model)`` runs in unpatch), or None


def unwrapped(model):
    """The module a ``torch.compile`` wrapper (OptimizedModule) compiles, else ``model``: patching swaps the
    wrapped model's modules (dynamo recompiles for them), and its ``generate`` is what the wrapper exposes."""
    return getattr(model, "_orig_mod", model) if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) \
        else model


def patch_state(model) -> PatchState | None:
    """What ``patch`` recorded on ``model`` (family, undo state, report, config), or None if unpatched."""
    return getattr(unwrapped(model), STATE_ATTR, None)


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
