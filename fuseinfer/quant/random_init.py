"""Random-weight quantized models built without a full-precision copy (e.g. OPT-66b int8 on one 80 GB GPU).

``random_quantized("opt-66b", device="cuda")`` (any family's published configuration,
``ModelFamily.random_configs``; ``random_quantized_opt`` is the same function): the model is built on the meta
device, patched with an ``Int8WeightOnly`` that lays out empty int8 / scale tensors (as ``load_quantized`` does),
allocated on the device (``to_empty``: int8 linears + everything else in the model's dtype; 66b: ~66 GB), then
filled layer by layer: each linear's weight is drawn in the model's dtype on the device (``normal(0, init_std)``, as
transformers' OPT init, from a seeded generator), quantized per channel by the CUDA kernel into the int8 / scale
tensors and freed, so the largest full-precision tensor alive is one weight (66b: the first MLP projection, 680 MB).
Biases are zero, LayerNorms (1, 0), embeddings ``normal(0, init_std)`` (OPT's init; ``initializer_range`` where the
config has no ``init_std``). For latency and memory measurements only.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from fuseinfer.quant.loading import refresh_report, to_empty_keep_ties
from fuseinfer.core.quant_config import Int8WeightOnly
from fuseinfer.layers.linear import Int8WeightOnlyLinear


def random_quantized(name: str = "opt-66b", device="cuda", dtype=torch.float16, seed: int = 0,
                     config: Int8WeightOnly | None = None, ops=None):
    """A patched, int8-quantized causal LM with random weights (see the module docstring); ``name``: a published
    configuration's hub id or short name (``opt-1.3b``)."""
    from fuseinfer import models
    from fuseinfer.core.errors import FuseInferError
    from fuseinfer.harness.models import published_names
    from fuseinfer.ops import quantize_per_channel
    from fuseinfer.patching import PatchConfig, patch

    short = published_names()
    key = short.get(name.lower(), name)
    if key not in short.values():
        raise FuseInferError(f"unknown model size {name!r}; choose from {', '.join(short)}")
    fam = models.family(models.random_configs()[key])
    cfg = fam.build_config(key)
    model = fam.empty_model(cfg, dtype)
    qconfig = dataclasses.replace(config or Int8WeightOnly(), keep_original=None, _empty=True)
    patch(model, PatchConfig(**({"ops": ops} if ops else {}), quant=qconfig))
    to_empty_keep_ties(model, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    std = getattr(cfg, "init_std", None) or getattr(cfg, "initializer_range", 0.02)
    with torch.no_grad():
        for name_, module in model.named_modules():
            if isinstance(module, Int8WeightOnlyLinear):
                for r0 in range(0, module.out_features, 8192):  # (row blocks: a bounded fp16 temporary)
                    rows = slice(r0, min(r0 + 8192, module.out_features))
                    w = torch.empty(rows.stop - r0, module.in_features, dtype=dtype, device=device)
                    w.normal_(0.0, std, generator=gen)
                    q, scale = quantize_per_channel(w)
                    module.qweight[rows].copy_(q)
                    module.scale[rows].copy_(scale.reshape(-1))
                    del w, q, scale
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.LayerNorm):
                if module.weight is not None:
                    module.weight.fill_(1.0)
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, std, generator=gen)
                if module.padding_idx is not None:
                    module.weight[module.padding_idx].zero_()
    refresh_report(model)
    return model


random_quantized_opt = random_quantized
