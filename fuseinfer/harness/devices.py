"""The dtypes and devices an evaluation runs in: the names the CLIs take (``--dtype``, ``--device``) and their
checks, one clear error per bad name."""
from __future__ import annotations

import torch

from fuseinfer.harness.errors import EvalError

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def resolve_device(name: str | None) -> torch.device:
    """The device ``name`` names (None: cuda when a GPU is visible, else cpu); raises :class:`EvalError` for one
    that does not exist here."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise EvalError(f"unknown device {name!r}: use cuda, cuda:N or cpu") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EvalError(f"--device {name} but no CUDA GPU is visible (torch {torch.__version__}, "
                        f"built for CUDA {torch.version.cuda}); use --device cpu")
    if device.type not in ("cuda", "cpu"):
        raise EvalError(f"unsupported device {name!r}: use cuda, cuda:N or cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise EvalError(f"--device {name}: only {torch.cuda.device_count()} CUDA GPU(s) visible, "
                        f"use cuda:0 ... cuda:{torch.cuda.device_count() - 1}")
    return device
