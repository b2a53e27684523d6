"""A static KV cache laid out for fuseinfer's attention op.

Per layer, keys and values live in preallocated (B, H, capacity, D) buffers. Rows are left-padded to a
common length, so every row writes the same slots at each step and the whole cache is described to the
attention op by a (B, capacity) key mask (False for padding) and the write position (``q_start``). The object
has the one method the patched attention calls, ``update(k, v, layer_idx)``, so it plugs into the patched
decoder layers unchanged.
"""
from __future__ import annotations

import collections

import torch

from torch import nn

from fuseinfer.core.decode_plan import DecodePlan, tp_info
from fuseinfer.ops.kv_cache import kv_cache_append


# What fast decode made, for tests and benchmarks (only ever incremented: read a difference): sessions built
# ("session"), decode graph sets captured ("decode_graphs"), caches allocated ("cache", decode.py), prefill graphs
# captured ("prefill_graph", prefill.py). Kept here, the module both import.
COUNTS: collections.Counter = collections.Counter()


class StaticKVCache:
    def __init__(self, num_layers: int, batch: int, heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (batch, heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.key_mask = torch.zeros(batch, capacity, dtype=torch.bool, device=device)  # (B, T)
        self.write_idx = torch.zeros(1, dtype=torch.long, device=device)  # (S,) slots the next update writes

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int):
        """k, v: (B, H, S, D) -> the layer's whole (B, H, T, D) buffers, with k, v written in place."""
        kv_cache_append(self.keys[layer_idx], self.values[layer_idx], k, v, self.write_idx)  # one launch
        return self.keys[layer_idx], self.values[layer_idx]


def kv_bytes(cache) -> int:
    """Bytes of a static KV cache's buffers (keys, values, key mask): what a fast-decode session holds between calls
    (any cache with those attributes, e.g. a tensor-parallel rank's or a split model's)."""
    return sum(t.numel() * t.element_size() for t in [*cache.keys, *cache.values, cache.key_mask])


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

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int):
        """k, v: (B, H, S, D) -> the layer's whole (B, H, T, D) buffers, with k, v written in place."""
        idx = self.write_idx if self.write_idx.device == k.device else self.write_idx.to(k.device)
        kv_cache_append(self.keys[layer_idx], self.values[layer_idx], k, v, idx)
        return self.keys[layer_idx], self.values[layer_idx]


def kv_cache(model: nn.Module, decode_plan: DecodePlan, layers: int, batch: int, heads: int, head_dim: int,
             capacity: int, dtype: torch.dtype, device: torch.device):
    """A static KV cache for ``model``: this rank's heads under tensor parallel, one device per layer for a split
    model, else the runtime's StaticKVCache as asked."""
    tp = tp_info(model)
    if tp is not None:  # whole heads per rank (tensor parallel checks that they divide)
        heads //= tp.size
    if decode_plan.devices is not None:
        return SplitKVCache(decode_plan.devices, batch, heads, head_dim, capacity, dtype)
    return StaticKVCache(layers, batch, heads, head_dim, capacity, dtype, device)
