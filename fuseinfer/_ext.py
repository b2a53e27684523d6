"""Loads the optional CUDA extension ``fuseinfer._C`` and says whether a CUDA kernel can serve a tensor.

Importing fuseinfer never fails because the extension is missing: without it every op runs its PyTorch
reference, and the patch report says so.
"""
from __future__ import annotations

import importlib
import os

import torch

_ext = None
_load_error: str | None = None


def extension():
    """The compiled ``fuseinfer._C`` module, or None when it is not built (or FUSEINFER_DISABLE_CUDA=1)."""
    global _ext, _load_error
    if _ext is None and _load_error is None:
        if os.environ.get("FUSEINFER_DISABLE_CUDA", "0") == "1":
            _load_error = "disabled by FUSEINFER_DISABLE_CUDA=1"
        else:
            try:
                _ext = importlib.import_module("fuseinfer._C")
            except ImportError as exc:
                _load_error = f"fuseinfer._C is not built ({exc})"
    return _ext


def cuda_extension_available() -> bool:
    """True when the CUDA kernels are built and a CUDA device is visible."""
    return extension() is not None and torch.cuda.is_available()


def extension_status() -> str:
    """One line for reports: 'built' or why the kernels are unavailable."""
    if extension() is not None:
        return "built" if torch.cuda.is_available() else "built, but no CUDA device is visible"
    return _load_error or "not built"


def backend_for(t: torch.Tensor) -> str:
    """'cuda' when the op on tensor ``t`` runs our kernel, else 'reference'."""
    return "cuda" if t.is_cuda and extension() is not None else "reference"


def eager_cuda(t: torch.Tensor) -> bool:
    """True when an op on ``t`` may call the extension directly instead of through the dispatcher.

    The registered ``fuseinfer::*`` ops are what torch.compile and opcheck see; in eager mode on CUDA the op
    wrappers skip the dispatcher's Python custom-op layer (10-30 µs a call, which dominates a prefill's
    ~170 op calls) and call the same implementation the op's CUDA kernel registration calls.
    """
    return t.is_cuda and extension() is not None and not torch.compiler.is_compiling()
