"""Per-call evidence, cheaper than a walk over the modules, that a model's tensors and module tree did not change.

Every ``generate`` call needs two facts that a walk over the whole module tree gives: where and how the model's
tensors are stored (``weights_key``: a session's graphs and step kernel read them there; ``model.to`` / ``.half()``
/ ``load_state_dict(assign=True)`` / ``fuseinfer.unpatch`` move or replace them) and whether accelerate placed the
model (``hooked``). The walk cost ~1 ms a call on a 24-layer model, a quarter of a short prompt's first token.

A :class:`ModelProbe` walks once and keeps, flat: every module's tensor dicts (``_parameters``, ``_buffers``) with
the objects they held, every module's ``_modules`` dict with its children, every non-root module's ``__dict__`` (an
accelerate hook is its ``_hf_hook`` attribute) and each tensor's address and dtype. ``same(model)`` checks those
in one flat pass (identity of every dict entry, so a tensor or module assigned, added or removed is seen; every
tensor's ``data_ptr()`` and dtype, so a ``.data`` swap, which ``model.to`` does in place, is seen; the root's hook
and device map). Only then is the walk redone. In-place writes (``load_state_dict`` without ``assign``, an
optimizer step) keep addresses, and the sessions stay valid, as before.

The probe lives in the model's ``__dict__`` (no global table holding models), references no object that
references the root (its children, their dicts and tensors), and is not copied with the model.
"""
from __future__ import annotations

import contextlib
import itertools
import operator
import threading

import torch
from torch import nn

from fuseinfer.core import placement

PROBE_ATTR = "_fuseinfer_probe"


def weights_key_walk(model: nn.Module) -> tuple:
    """Where and how the model's tensors are stored, by a walk over the modules' own dicts (about 4x cheaper than
    ``parameters()`` and ``buffers()``, whose generators and de-duplication cost more; a tied tensor appears
    twice)."""
    key, stack = [], [model]
    while stack:
        m = stack.pop()
        for tensors in (m._parameters, m._buffers):
            for t in tensors.values():
                if t is not None:
                    key.append((t.data_ptr(), t.dtype, t.device))
        stack.extend(c for c in m._modules.values() if c is not None)
    return tuple(key)


class ModelProbe:
    """The walk's results for one state of a model and what ``same`` checks to trust them (see the module)."""

    def __deepcopy__(self, memo):  # a copy of the model has its own tensors: it walks anew
        return None

    def __reduce__(self):  # so does a pickled (torch.save) model
        return type(None), ()

    def __init__(self, model: nn.Module):
        self.key = weights_key_walk(model)
        self.hooked = placement.is_hooked(model)
        self.device_map = model.__dict__.get("hf_device_map")
        self.root_hook = "_hf_hook" in model.__dict__
        dicts = []  # every module's _parameters, _buffers and _modules
        attrs = []  # every non-root module's __dict__
        stack = [model]
        while stack:
            m = stack.pop()
            if m is not model:
                attrs.append(m.__dict__)
            dicts.extend((m._parameters, m._buffers, m._modules))
            stack.extend(c for c in m._modules.values() if c is not None)
        # most modules' dicts are empty (leaves have no children, most modules no buffers): that they stay empty is
        # a length check, cheaper than reading their values with the others'
        self.filled = [d for d in dicts if d]
        self.empty = [d for d in dicts if not d]
        self.attrs = attrs
        self.values = tuple(itertools.chain.from_iterable(map(dict.values, self.filled)))  # tensors, modules, None
        self.tensors = tuple(v for v in self.values if isinstance(v, torch.Tensor))
        self.ptrs = tuple(map(_data_ptr, self.tensors))
        self.dtypes = tuple(map(_dtype, self.tensors))
        self.any_hook = any(map(operator.contains, attrs, itertools.repeat("_hf_hook")))

    def same(self, model: nn.Module) -> bool:
        """Whether the model's tree, tensors and placement are still those recorded: one flat pass with the loops in
        C (the entries of every module dict in walk order, by identity, so an entry assigned, added or removed
        anywhere shows; then every tensor's address and dtype)."""
        root = model.__dict__
        if ("_hf_hook" in root) != self.root_hook or root.get("hf_device_map") is not self.device_map:
            return False
        if any(map(len, self.empty)):
            return False
        now = tuple(itertools.chain.from_iterable(map(dict.values, self.filled)))
        if len(now) != len(self.values) or not all(map(operator.is_, now, self.values)):  # (a tensor's == is
            return False  # elementwise: identity)
        return (tuple(map(_data_ptr, self.tensors)) == self.ptrs and tuple(map(_dtype, self.tensors)) == self.dtypes
                and any(map(operator.contains, self.attrs, itertools.repeat("_hf_hook"))) == self.any_hook)


_data_ptr = torch.Tensor.data_ptr
_dtype = operator.attrgetter("dtype")


def probe(model: nn.Module) -> ModelProbe:
    """The model's probe, walked anew when the recorded one no longer holds (the caller holds ``model_lock``).
    Inside ``one_check(model)`` (a generate call, during which the model does not change) it is checked once."""
    p = model.__dict__.get(PROBE_ATTR)
    scope = getattr(_scope, "models", None)
    if scope is not None and scope.get(id(model)) is p is not None:
        return p
    if not isinstance(p, ModelProbe) or not p.same(model):
        p = None  # (the stale probe's references go before the walk)
        model.__dict__.pop(PROBE_ATTR, None)
        p = model.__dict__[PROBE_ATTR] = ModelProbe(model)
    if scope is not None and id(model) in scope:
        scope[id(model)] = p
    return p


_scope = threading.local()  # .models: {id(model): its probe checked in the scope, or None} inside one_check


@contextlib.contextmanager
def one_check(model: nn.Module):
    """Within: ``probe(model)`` checks the model at its first use only (a call that holds ``model_lock`` and does
    not change the model in between asks twice: once for the forward, once for the sessions' weights)."""
    models = getattr(_scope, "models", None)
    outer = models is not None and id(model) in models
    if models is None:
        models = _scope.models = {}
    if not outer:
        models[id(model)] = None
    try:
        yield
    finally:
        if not outer:
            models.pop(id(model), None)
            if not models:
                _scope.models = None


def forget(model: nn.Module) -> None:
    """Drop the model's probe (``release``: the objects it references go with it)."""
    model.__dict__.pop(PROBE_ATTR, None)
