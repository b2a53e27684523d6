"""KV-cache append: write new keys and values into preallocated caches at given slots, in one kernel.

``k_cache``/``v_cache`` (B, H, T, D) receive ``k``/``v`` (B, H, S, D): ``k_cache[:, :, slots[s]] = k[:, :, s]``
(same for v). It replaces the two ``index_copy_(2, slots, ...)`` calls of a static cache's update with one
launch that reads k and v straight from their (strided) views into the fused QKV projection output. Slots
must lie in [0, T): the reference raises on others, the CUDA kernel skips them (it never syncs the host).
"""
from __future__ import annotations

import torch

from fuseinfer.core.extension import eager_cuda, extension
from fuseinfer.core.errors import FuseInferError


def kv_cache_append_ref(k_cache, v_cache, k, v, slots) -> None:
    """Pure-PyTorch reference: two index_copy_ along the sequence dim, in place."""
    k_cache.index_copy_(2, slots, k)
    v_cache.index_copy_(2, slots, v)


@torch.library.custom_op("fuseinfer::kv_cache_append", mutates_args=("k_cache", "v_cache"))
def _kv_cache_append(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     slots: torch.Tensor) -> None:
    kv_cache_append_ref(k_cache, v_cache, k, v, slots)


def kernel_supports(k_cache, v_cache, k, v, slots) -> bool:
    """Whether the CUDA kernel handles these tensors (else the op runs the reference)."""
    dtype = k_cache.dtype
    return (dtype in (torch.float16, torch.bfloat16, torch.float32)
            and all(t.dtype == dtype for t in (v_cache, k, v)) and slots.dtype == torch.int64
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and k.stride(-1) == 1 and v.stride(-1) == 1)


@_kv_cache_append.register_kernel("cuda")
def _kv_cache_append_cuda(k_cache, v_cache, k, v, slots):
    ext = extension(k_cache.device)
    if ext is None or not kernel_supports(k_cache, v_cache, k, v, slots):
        kv_cache_append_ref(k_cache, v_cache, k, v, slots)
    else:
        ext.kv_cache_append(k_cache, v_cache, k, v, slots)


@_kv_cache_append.register_fake
def _(k_cache, v_cache, k, v, slots):
    return None


def kv_cache_append(k_cache, v_cache, k, v, slots) -> None:
    """Write k, v (B, H, S, D) into k_cache, v_cache (B, H, T, D) at sequence slots (S,) int64, in place."""
    if (k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k.shape != v.shape or k.dim() != 4
            or k.shape[:2] != k_cache.shape[:2] or k.shape[3] != k_cache.shape[3] or slots.shape != (k.shape[2],)):
        raise FuseInferError(f"expected caches (B,H,T,D), k, v (B,H,S,D) and slots (S,); got {tuple(k_cache.shape)}, "
                             f"{tuple(v_cache.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, {tuple(slots.shape)}")
    if slots.dtype != torch.int64 or not k_cache.dtype == v_cache.dtype == k.dtype == v.dtype:
        raise FuseInferError(f"kv_cache_append: slots must be int64 and k, v in the caches' dtype; got slots "
                             f"{slots.dtype}, caches {k_cache.dtype} / {v_cache.dtype}, k, v {k.dtype} / {v.dtype}")
    if eager_cuda(k_cache):
        _kv_cache_append_cuda(k_cache, v_cache, k, v, slots)
    else:
        torch.ops.fuseinfer.kv_cache_append(k_cache, v_cache, k, v, slots)
