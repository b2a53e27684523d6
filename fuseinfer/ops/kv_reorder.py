"""KV-cache beam reorder: every beam row continues from its parent beam's cache, in one kernel.

``kv`` (L, 2, R, H, T, D) holds the keys (``kv[l, 0]``) and values (``kv[l, 1]``) of every layer for R beam rows.
For every row r with ``parent[r] != r`` the op copies slots [start, start + min(count, max_count)) clipped to [0, T) of
every layer's keys and values from row ``parent[r]`` to row r, with all reads before any write (beams may swap).
``start`` and ``count`` are one-element int64 tensors on the cache's device (a beam search's prompt length and
step counter), so the op runs inside a CUDA graph without a host sync; ``max_count`` only bounds the copy (the
kernel's grid). Parents must lie in [0, R) (the kernel leaves a row with another parent alone).
"""
from __future__ import annotations

import torch

from fuseinfer.core.errors import FuseInferError
from fuseinfer.core.extension import eager_cuda, extension

MAX_ROWS = 2048  # the kernel's limit (its shared-memory tile holds a piece of every row)


def kv_reorder_ref(kv: torch.Tensor, parent: torch.Tensor, start: torch.Tensor, count: torch.Tensor,
                   max_count: int) -> None:
    """Pure-PyTorch reference, in place and without a host sync: gather every row's new contents over all T slots
    (its parent's where the slot is copied, its own elsewhere), then write them back."""
    rows, t = kv.shape[2], kv.shape[4]
    row_ids = torch.arange(rows, device=kv.device)  # (R,)
    slot_ids = torch.arange(t, device=kv.device)  # (T,)
    first = start.reshape(())
    last = first + count.reshape(()).clamp(0, max_count)  # (exclusive)
    copied = (slot_ids >= first) & (slot_ids < last)  # (T,)
    src = torch.where(copied[None, :], parent.long()[:, None], row_ids[:, None])  # (R, T) row each slot comes from
    new = kv[:, :, src, :, slot_ids[None, :]]  # (R, T, L, 2, H, D): all reads first
    kv.copy_(new.permute(2, 3, 0, 4, 1, 5))


@torch.library.custom_op("fuseinfer::kv_reorder", mutates_args=("kv",))
def _kv_reorder(kv: torch.Tensor, parent: torch.Tensor, start: torch.Tensor, count: torch.Tensor,
                max_count: int) -> None:
    kv_reorder_ref(kv, parent, start, count, max_count)


def kernel_supports(kv: torch.Tensor, parent: torch.Tensor, start: torch.Tensor, count: torch.Tensor) -> bool:
    """Whether the CUDA kernel handles these tensors (else the op runs the reference)."""
    return (kv.is_contiguous() and 2 <= kv.element_size() <= 8 and kv.shape[2] <= MAX_ROWS
            and parent.dtype == start.dtype == count.dtype == torch.int64)


def available(device: torch.device) -> bool:
    """Whether the extension on ``device`` has the kernel (an extension built before it has not)."""
    ext = extension(device)
    return ext is not None and hasattr(ext, "kv_reorder")


@_kv_reorder.register_kernel("cuda")
def _kv_reorder_cuda(kv, parent, start, count, max_count):
    if not available(kv.device) or not kernel_supports(kv, parent, start, count):
        kv_reorder_ref(kv, parent, start, count, max_count)
    else:
        extension(kv.device).kv_reorder(kv, parent, start, count, max_count)


@_kv_reorder.register_fake
def _(kv, parent, start, count, max_count):
    return None


def kv_reorder(kv: torch.Tensor, parent: torch.Tensor, start: torch.Tensor, count: torch.Tensor,
               max_count: int) -> None:
    """Rows of ``kv`` (L, 2, R, H, T, D) take slots [start, start + min(count, max_count)) of their ``parent`` (R,)
    rows, in place; start, count: (1,) int64 on the cache's device."""
    if kv.dim() != 6 or kv.shape[1] != 2 or parent.shape != (kv.shape[2],) or start.numel() != 1 \
            or count.numel() != 1:
        raise FuseInferError(f"kv_reorder: expected kv (L,2,R,H,T,D), parent (R,) and one-element start and count; "
                             f"got {tuple(kv.shape)}, {tuple(parent.shape)}, {tuple(start.shape)}, "
                             f"{tuple(count.shape)}")
    if not parent.dtype == start.dtype == count.dtype == torch.int64:
        raise FuseInferError(f"kv_reorder: parent, start and count must be int64; got {parent.dtype}, "
                             f"{start.dtype}, {count.dtype}")
    if max_count < 0:
        raise FuseInferError(f"kv_reorder: max_count must be >= 0, got {max_count}")
    if eager_cuda(kv):
        _kv_reorder_cuda(kv, parent, start, count, max_count)
    else:
        torch.ops.fuseinfer.kv_reorder(kv, parent, start, count, max_count)
