"""Models larger than one GPU: accelerate placement (``placement``: patch works under accelerate's hooks and
offload) and tensor parallel over torch.distributed (``tensor_parallel``), plus big random models built on the
meta device and materialized on their GPU (``materialize``). See docs/multi_gpu.md.

Names are imported on first use, so that ``import fuseinfer`` does not import transformers or torch.distributed's
process groups.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "tensor_parallel": "fuseinfer.parallel.sharding", "tp_info": "fuseinfer.parallel.sharding",
    "TPInfo": "fuseinfer.parallel.sharding", "init_distributed": "fuseinfer.parallel.dist",
    # built by the harness (random: models use them too), offered here with tensor parallel
    "materialize": "fuseinfer.harness.materialize", "random_init": "fuseinfer.harness.materialize",
    "random_model": "fuseinfer.harness.materialize", "meta_model": "fuseinfer.harness.materialize",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
