"""Every backend ``python -m fuseinfer.eval`` can run, by name: the core ones (``backends.py``) and those of the
feature packages (ONNX Runtime and TensorRT from ``fuseinfer/export``, quantized fuseinfer from ``fuseinfer/quant``),
which subclass :class:`~fuseinfer.eval.backends.Backend`. One list, kept here so that no backend module imports
another package's backends (and nothing imports in a cycle)."""
from __future__ import annotations

from fuseinfer.export.eval_backend import BACKENDS as EXPORT_BACKENDS
from fuseinfer.quant.eval_backend import FuseInferW8A16Backend, FuseInferW8A8Backend
from fuseinfer.eval.backends import CORE_BACKENDS, Backend

BACKENDS: dict[str, type[Backend]] = {cls.name: cls for cls in (*CORE_BACKENDS, FuseInferW8A16Backend, FuseInferW8A8Backend,
                                                                  *EXPORT_BACKENDS)}
