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


# ---------------------------------------------------------------------------------------------- FP8 (e4m3) caches
#
# An FP8 cache stores keys and values as torch.float8_e4m3fn with one fp32 scale per (layer, key/value head) for the
# keys and one for the values: ``kv_scale`` (2, Hkv), row 0 the keys', row 1 the values'; a stored value x means
# x * scale. The scales are set by the write that starts a sequence (``calibrate``: the prompt's prefill) from its
# largest |k| and |v| per head, with FP8_HEADROOM to spare, and kept for the writes after it (decode), which saturate
# at +-448 * scale. e4m3 is a floating-point format (3 mantissa bits at every magnitude from 2^-6 to 448), so the
# headroom costs precision only for values below max / (448 * 64 / FP8_HEADROOM), which barely move a dot product.

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
FP8_HEADROOM = 4.0  # the prompt's largest |value| lands at FP8_MAX / FP8_HEADROOM: room for 4x larger values later
FP8_MIN_AMAX = 2.0 ** -10  # a head whose prompt values are all ~0 (padding) still gets a finite, nonzero scale


def kv_scales_from(k, v) -> torch.Tensor:
    """The (2, Hkv) fp32 scales that fit k, v (B, Hkv, S, D) with FP8_HEADROOM to spare (row 0: keys, row 1:
    values). Device-side only (no host sync), so it may run inside a CUDA graph."""
    amax = torch.stack([k.detach().abs().amax(dim=(0, 2, 3)), v.detach().abs().amax(dim=(0, 2, 3))])  # (2, Hkv)
    return amax.float().clamp_min(FP8_MIN_AMAX) * (FP8_HEADROOM / FP8_MAX)


def quantize_kv(x, scale) -> torch.Tensor:
    """x (B, Hkv, S, D) / scale (Hkv,) fp32 -> e4m3, saturated at +-FP8_MAX (rounded to nearest even, as the
    kernels' cvt.rn.satfinite does)."""
    y = x.float() / scale.view(1, -1, 1, 1)
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_kv(x, scale, dtype=torch.float32) -> torch.Tensor:
    """An e4m3 cache (B, Hkv, T, D) with its scales (Hkv,) -> ``dtype`` values."""
    return (x.float() * scale.view(1, -1, 1, 1)).to(dtype)


def kv_cache_append_fp8_ref(k_cache, v_cache, k, v, slots, kv_scale) -> None:
    """Pure-PyTorch reference of the FP8 append: quantize k, v with the (2, Hkv) scales, then store them at
    ``slots`` (as kv_cache_append_ref)."""
    kq, vq = quantize_kv(k, kv_scale[0]), quantize_kv(v, kv_scale[1])
    # (as bytes: index_copy_ has no float8 form on every device)
    kv_cache_append_ref(k_cache.view(torch.uint8), v_cache.view(torch.uint8), kq.view(torch.uint8),
                        vq.view(torch.uint8), slots)


@torch.library.custom_op("fuseinfer::kv_cache_append_fp8", mutates_args=("k_cache", "v_cache"))
def _kv_cache_append_fp8(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         slots: torch.Tensor, kv_scale: torch.Tensor) -> None:
    kv_cache_append_fp8_ref(k_cache, v_cache, k, v, slots, kv_scale)


def fp8_kernel_supports(k_cache, v_cache, k, v, slots, kv_scale) -> bool:
    """Whether the CUDA kernel handles these tensors (else the op runs the reference)."""
    return (k_cache.dtype == v_cache.dtype == FP8_DTYPE and k.dtype in (torch.float16, torch.bfloat16)
            and v.dtype == k.dtype and slots.dtype == torch.int64 and kv_scale.dtype == torch.float32
            and kv_scale.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
            and k.stride(-1) == 1 and v.stride(-1) == 1)


@_kv_cache_append_fp8.register_kernel("cuda")
def _kv_cache_append_fp8_cuda(k_cache, v_cache, k, v, slots, kv_scale):
    ext = extension(k_cache.device)
    if ext is None or not hasattr(ext, "kv_cache_append_fp8") or \
            not fp8_kernel_supports(k_cache, v_cache, k, v, slots, kv_scale):
        kv_cache_append_fp8_ref(k_cache, v_cache, k, v, slots, kv_scale)
    else:
        ext.kv_cache_append_fp8(k_cache, v_cache, k, v, slots, kv_scale)


@_kv_cache_append_fp8.register_fake
def _(k_cache, v_cache, k, v, slots, kv_scale):
    return None


def check_kv_scale(kv_scale, k_cache) -> None:
    """An FP8 cache's scales must be a (2, Hkv) fp32 tensor on the cache's device."""
    hkv = k_cache.shape[1]
    if kv_scale is None or kv_scale.dtype != torch.float32 or kv_scale.shape != (2, hkv) \
            or kv_scale.device != k_cache.device:
        got = None if kv_scale is None else f"{tuple(kv_scale.shape)} {kv_scale.dtype} on {kv_scale.device}"
        raise FuseInferError(f"an FP8 (e4m3) KV cache needs kv_scale, a (2, {hkv}) float32 tensor on "
                             f"{k_cache.device} (keys' and values' scale per head), got {got}")


def kv_cache_append_fp8(k_cache, v_cache, k, v, slots, kv_scale, calibrate: bool = False) -> None:
    """Write k, v (B, Hkv, S, D) as e4m3 into k_cache, v_cache (B, Hkv, T, D) float8_e4m3fn at ``slots`` (S,)
    int64, in place, divided by ``kv_scale`` (2, Hkv) fp32. ``calibrate``: first set kv_scale in place from this
    write (``kv_scales_from``: a sequence's first write, its prefill); else the scales are kept and values beyond
    448 * scale saturate."""
    if (k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k.shape != v.shape or k.dim() != 4
            or k.shape[:2] != k_cache.shape[:2] or k.shape[3] != k_cache.shape[3] or slots.shape != (k.shape[2],)):
        raise FuseInferError(f"expected caches (B,H,T,D), k, v (B,H,S,D) and slots (S,); got {tuple(k_cache.shape)}, "
                             f"{tuple(v_cache.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, {tuple(slots.shape)}")
    if slots.dtype != torch.int64 or not k_cache.dtype == v_cache.dtype == FP8_DTYPE or k.dtype != v.dtype \
            or not k.is_floating_point() or k.dtype == FP8_DTYPE:
        raise FuseInferError(f"kv_cache_append_fp8: slots must be int64, the caches float8_e4m3fn and k, v one "
                             f"floating dtype; got slots {slots.dtype}, caches {k_cache.dtype} / {v_cache.dtype}, "
                             f"k, v {k.dtype} / {v.dtype}")
    check_kv_scale(kv_scale, k_cache)
    if calibrate:
        kv_scale.copy_(kv_scales_from(k, v))
    if eager_cuda(k_cache):
        _kv_cache_append_fp8_cuda(k_cache, v_cache, k, v, slots, kv_scale)
    else:
        torch.ops.fuseinfer.kv_cache_append_fp8(k_cache, v_cache, k, v, slots, kv_scale)
