"""Every backend ``python -m fuseinfer.eval`` can run, by name, in :data:`BACKENDS`.

Each module of this package registers one kind of backend with :func:`register`; the imports at the end of this
file make the registry complete. Adding a backend: define it on :class:`fuseinfer.harness.backends.Backend` (in
the feature package it measures, when the profiler or a library user should reach it too), register it in a new
module here, and import that module below. The table's order is the order ``--help`` lists them in.
"""
from __future__ import annotations

import sys

from fuseinfer.harness.backends import Backend

BACKENDS: dict[str, type[Backend]] = {}
REGISTERED_BY: dict[str, str] = {}  # backend name -> the module of this package that registered it


def register(cls: type[Backend]) -> type[Backend]:
    """Add backend ``cls`` under its ``name`` (a decorator, or a call on a class defined elsewhere); a name taken
    twice is a programming error."""
    if not cls.name or cls.name in BACKENDS:
        raise ValueError(f"backend name {cls.name!r} is empty or already registered (by "
                         f"{REGISTERED_BY.get(cls.name)})")
    BACKENDS[cls.name] = cls
    REGISTERED_BY[cls.name] = sys._getframe(1).f_globals["__name__"]
    return cls


# the backend modules, each registering its backends (this order is the listing order); parallel.py registers none
# of its own (--tp runs the fuseinfer backend sharded) and is imported by the runner when --tp asks for it
import fuseinfer.eval.backends.eager  # noqa: E402,F401,I001
import fuseinfer.eval.backends.compile  # noqa: E402,F401
import fuseinfer.eval.backends.fuseinfer  # noqa: E402,F401
import fuseinfer.eval.backends.quant  # noqa: E402,F401
import fuseinfer.eval.backends.onnx  # noqa: E402,F401
import fuseinfer.eval.backends.tensorrt  # noqa: E402,F401

__all__ = ["BACKENDS", "Backend", "register"]
