"""A static KV cache laid out for fuseinfer's attention op.

Per layer, keys and values live in preallocated (B, H, capacity, D) buffers. Rows are left-padded to a
common length, so every row writes the same slots at each step and the whole cache is described to the
attention op by a (B, capacity) key mask (False for padding) and the write position (``q_start``). The object
has the one method the patched attention calls, ``update(k, v, layer_idx)``, so it plugs into the patched
decoder layers unchanged.

An FP8 cache (``RuntimeConfig(kv_cache="fp8")``) holds float8 e4m3 keys and values and, per layer, ``kv_scales[i]``
(2, Hkv) fp32 (keys' and values' scale per head; ops/kv_cache.py says how they are chosen). ``calibrate`` is True
while a sequence's prefill writes (``_Session.begin``): those writes set the scales, the decode writes keep them.
The attention reads the scales through ``hf_attention.MaskInfo.kv_scales`` (module path) or the cache (lean loops).
"""
from __future__ import annotations

import collections

import torch

from torch import nn

from fuseinfer.core.decode_plan import DecodePlan, tp_info
from fuseinfer.core.errors import FuseInferError
from fuseinfer.core.state import runtime_config
from fuseinfer.ops.kv_cache import FP8_DTYPE, kv_cache_append, kv_cache_append_fp8


# What fast decode made, for tests and benchmarks (only ever incremented: read a difference): sessions built
# ("session"), decode graph sets captured ("decode_graphs"), caches allocated ("cache", decode.py), prefill graphs
# captured ("prefill_graph", prefill.py). Kept here, the module both import.
COUNTS: collections.Counter = collections.Counter()


class StaticKVCache:
    def __init__(self, num_layers: int, batch: int, heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device, kv_dtype: torch.dtype | None = None):
        """kv_dtype: what keys and values are stored as (None: ``dtype``; torch.float8_e4m3fn: an FP8 cache)."""
        shape = (batch, heads, capacity, head_dim)
        store = dtype if kv_dtype is None else kv_dtype
        self.keys = [torch.zeros(shape, dtype=store, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=store, device=device) for _ in range(num_layers)]
        self.key_mask = torch.zeros(batch, capacity, dtype=torch.bool, device=device)  # (B, T)
        self.write_idx = torch.zeros(1, dtype=torch.long, device=device)  # (S,) slots the next update writes
        # FP8: (2, Hkv) fp32 scales per layer (keys, values); None for a cache in the model's dtype
        self.kv_scales = [torch.ones(2, heads, device=device) for _ in range(num_layers)] \
            if store == FP8_DTYPE else None
        self.calibrate = False  # (FP8) whether writes set the scales: True during a sequence's prefill

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int):
        """k, v: (B, H, S, D) -> the layer's whole (B, H, T, D) buffers, with k, v written in place."""
        if self.kv_scales is not None:
            kv_cache_append_fp8(self.keys[layer_idx], self.values[layer_idx], k, v, self.write_idx,
                                self.kv_scales[layer_idx], self.calibrate)
        else:
            kv_cache_append(self.keys[layer_idx], self.values[layer_idx], k, v, self.write_idx)  # one launch
        return self.keys[layer_idx], self.values[layer_idx]


def kv_bytes(cache) -> int:
    """Bytes of a static KV cache's buffers (keys, values, key mask): what a fast-decode session holds between calls
    (any cache with those attributes, e.g. a tensor-parallel rank's or a split model's)."""
    scales = getattr(cache, "kv_scales", None) or []
    return sum(t.numel() * t.element_size() for t in [*cache.keys, *cache.values, cache.key_mask, *scales])


class SplitKVCache:
    """A :class:`~fuseinfer.runtime.StaticKVCache` whose layers live on their own devices (a model split by
    accelerate); the key mask and the write position live on the first device, the write position is copied to a
    layer's device when it differs (the hooks move the mask with the layer's other inputs)."""

    def __init__(self, devices, batch: int, heads: int, head_dim: int, capacity: int, dtype: torch.dtype):
        shape = (batch, heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=d) for d in devices]
        self.values = [torch.zeros(shape, dtype=dtype, device=d) for d in devices]
        self.key_mask = torch.zeros(batch, capacity, dtype=torch.bool, device=devices[0])  # (B, T)
        self.write_idx = torch.zeros(1, dtype=torch.long, device=devices[0])  # (S,)
        self.kv_scales, self.calibrate = None, False  # (no FP8 form: kv_cache refuses it)

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int):
        """k, v: (B, H, S, D) -> the layer's whole (B, H, T, D) buffers, with k, v written in place."""
        idx = self.write_idx if self.write_idx.device == k.device else self.write_idx.to(k.device)
        kv_cache_append(self.keys[layer_idx], self.values[layer_idx], k, v, idx)
        return self.keys[layer_idx], self.values[layer_idx]


def kv_cache(model: nn.Module, decode_plan: DecodePlan, layers: int, batch: int, heads: int, head_dim: int,
             capacity: int, dtype: torch.dtype, device: torch.device):
    """A static KV cache for ``model``: this rank's heads under tensor parallel, one device per layer for a split
    model, else the runtime's StaticKVCache as asked: in the model's dtype, or FP8 with ``RuntimeConfig(kv_cache=
    "fp8")`` (a single-device model only)."""
    fp8 = kv_cache_dtype(model) == FP8_DTYPE
    tp = tp_info(model)
    if fp8 and (tp is not None or decode_plan.devices is not None):
        raise FuseInferError("RuntimeConfig(kv_cache='fp8') serves models on one device; a tensor-parallel or split "
                             "model needs kv_cache='auto' (fuseinfer.runtime.set_runtime(model, kv_cache='auto'))")
    if tp is not None:  # whole heads per rank (tensor parallel checks that they divide)
        heads //= tp.size
    if decode_plan.devices is not None:
        return SplitKVCache(decode_plan.devices, batch, heads, head_dim, capacity, dtype)
    return StaticKVCache(layers, batch, heads, head_dim, capacity, dtype, device, FP8_DTYPE if fp8 else None)


def kv_cache_dtype(model: nn.Module) -> torch.dtype | None:
    """What the model's fast-decode caches store keys and values as: torch.float8_e4m3fn under
    ``RuntimeConfig(kv_cache="fp8")``, else None (the model's dtype)."""
    runtime = runtime_config(model)
    return FP8_DTYPE if runtime is not None and runtime.kv_cache == "fp8" else None


def refuse_fp8(model: nn.Module, what: str) -> None:
    """Raise the one-line error for a path that has no FP8 cache (``what``: the path, e.g. 'beam search')."""
    if kv_cache_dtype(model) is not None:
        raise FuseInferError(f"{what} has no FP8 KV cache: set fuseinfer.runtime.set_runtime(model, "
                             "kv_cache='auto') for it (RuntimeConfig(kv_cache='fp8') serves fuseinfer.generate and model.generate's "
                             "greedy and sampling calls)")
