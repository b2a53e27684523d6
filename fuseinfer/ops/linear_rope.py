"""The fused q/k/v projection with the rotary embedding and the static-cache write in its epilogue:
``linear_rope_append(x, w, scale, bias, cos, sin, H, Hkv, k_cache, v_cache, slots) -> q``, exactly
``qkv_rope_append(linear(x), ...)`` (``ops/rope.py``) over the linear ``x @ w.T + bias`` (fp16/bf16/fp32 weights in x's
dtype) or ``x @ (w * scale[:, None]).T + bias`` (int8 weights, ``w8a16_linear``). With ``cos`` and ``sin`` None
there is no rotation: q is split off and k / v are written into the cache as they come out of the linear
(``kv_cache_append``), which is OPT's decode q/k/v.

On CUDA at decode sizes (B S <= 16 tokens, fp16/bf16, head dim a multiple of 16) one kernel (``csrc/linear_rope.cu``):
the weight-streaming GEMV computes dims d and d + D/2 of a head in one tile, so it rotates q and k and writes k and v
into the cache itself; the (B, S, (H + 2 Hkv) D) projection is never stored nor read again. It rounds as the two ops
do and agrees with them bit for bit. Elsewhere (prefill, other layouts) the two ops run. Inference only (a cache
write has no gradient).
"""
from __future__ import annotations

import torch

from fuseinfer.core.errors import FuseInferError
from fuseinfer.core.extension import extension, route
from fuseinfer.ops.linear import linear_epilogue_ref
from fuseinfer.ops.kv_cache import kv_cache_append, kv_cache_append_ref
from fuseinfer.ops.rope import qkv_rope_append, qkv_rope_append_ref
from fuseinfer.ops.w8a16_linear import w8a16_linear_ref


def _linear_ref(x, weight, scale, bias):
    if weight.dtype == torch.int8:
        return w8a16_linear_ref(x, weight, scale, bias, None, "none")
    return linear_epilogue_ref(x, weight, bias, None, "none")


def _append(qkv, heads: int, kv_heads: int, k_cache, v_cache, slots, append=kv_cache_append_ref):
    """No rotation: qkv (B, S, (H + 2 Hkv) D) -> q (B, H, S, D); k and v written into the caches at ``slots`` by
    ``append`` (the reference, or the op where the extension lacks the fused one)."""
    b, s, n = qkv.shape
    d = n // (heads + 2 * kv_heads)
    q, k, v = qkv.view(b, s, heads + 2 * kv_heads, d).transpose(1, 2).split([heads, kv_heads, kv_heads], dim=1)
    append(k_cache, v_cache, k, v, slots)
    return q.contiguous()


def linear_rope_append_ref(x, weight, scale, bias, cos, sin, heads: int, kv_heads: int, k_cache, v_cache, slots):
    """Pure-PyTorch reference: x (B, S, K) -> q (B, H, S, D); k and v written into the caches (B, Hkv, T, D);
    cos / sin (B, S, D), or both None (no rotation)."""
    qkv = _linear_ref(x, weight, scale, bias)
    if cos is None:
        return _append(qkv, heads, kv_heads, k_cache, v_cache, slots)
    return qkv_rope_append_ref(qkv, cos, sin, heads, kv_heads, k_cache, v_cache, slots)


@torch.library.custom_op("fuseinfer::linear_rope_append", mutates_args=("k_cache", "v_cache"))
def _linear_rope_append(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
                        cos: torch.Tensor | None, sin: torch.Tensor | None, heads: int, kv_heads: int, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return linear_rope_append_ref(x, weight, scale, bias, cos, sin, heads, kv_heads, k_cache, v_cache, slots)


@_linear_rope_append.register_kernel("cuda")
def _linear_rope_append_cuda(x, weight, scale, bias, cos, sin, heads, kv_heads, k_cache, v_cache, slots):
    ext = extension(x.device)
    # a strided weight would be copied just before the GEMV, which reads weights before its PDL wait (launch.h)
    if ext is None or not hasattr(ext, "linear_rope_append") or not weight.is_contiguous():
        qkv = _linear_ref(x, weight, scale, bias)
        if cos is None:
            return _append(qkv, heads, kv_heads, k_cache, v_cache, slots, kv_cache_append)
        return qkv_rope_append(qkv, cos, sin, heads, kv_heads, k_cache, v_cache, slots)
    return ext.linear_rope_append(x, weight, None if scale is None else scale.contiguous(),
                                  None if bias is None else bias.contiguous(),
                                  None if cos is None else cos.contiguous(), None if sin is None else sin.contiguous(),
                                  heads, kv_heads, k_cache, v_cache, slots)


@_linear_rope_append.register_fake
def _(x, weight, scale, bias, cos, sin, heads, kv_heads, k_cache, v_cache, slots):
    b, s, _ = x.shape
    return x.new_empty(b, heads, s, weight.shape[0] // (heads + 2 * kv_heads))


def check_operands(x, weight, scale, bias, cos, sin, heads: int, kv_heads: int) -> None:
    """linear_rope_append's checks of its operands (FuseInferError naming what is wrong)."""
    if (cos is None) != (sin is None):
        raise FuseInferError("linear_rope_append: give both cos and sin, or neither (no rotation)")
    if x.dim() != 3 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise FuseInferError(f"linear_rope_append: expected x (B, S, K) and weight (N, K), got {tuple(x.shape)} and "
                             f"{tuple(weight.shape)}")
    int8 = weight.dtype == torch.int8
    if int8 != (scale is not None) or (not int8 and weight.dtype != x.dtype):
        raise FuseInferError(f"linear_rope_append: the weight must be in x's dtype {x.dtype} without scales, or int8 "
                             f"with fp32 per-row scales; got {weight.dtype} and {'no ' if scale is None else ''}scales")
    n = weight.shape[0]
    if int8 and (scale.shape != (n,) or scale.dtype != torch.float32):
        raise FuseInferError(f"linear_rope_append: scale must be ({n},) float32, got {tuple(scale.shape)} "
                             f"{scale.dtype}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise FuseInferError(f"linear_rope_append: bias must be ({n},) in {x.dtype}, got {tuple(bias.shape)} "
                             f"{bias.dtype}")
    if heads <= 0 or kv_heads <= 0 or n % (heads + 2 * kv_heads):
        raise FuseInferError(f"linear_rope_append: the weight's {n} rows are not (H + 2 Hkv) D for H={heads}, "
                             f"Hkv={kv_heads}")


def linear_rope_append(x, weight, scale, bias, cos, sin, heads: int, kv_heads: int, k_cache, v_cache, slots):
    """q (B, H, S, D) of the rotated q projection of x (B, S, K); the rotated k and the v projections written into
    k_cache / v_cache (B, Hkv, T, D) at slots (S,). weight ((H + 2 Hkv) D, K): in x's dtype (scale None) or int8
    with fp32 per-row scales (N,). cos, sin (B, S, D), or both None: no rotation. See the module doc."""
    check_operands(x, weight, scale, bias, cos, sin, heads, kv_heads)
    return route(torch.ops.fuseinfer.linear_rope_append, linear_rope_append_ref, _linear_rope_append_cuda,
                 (x, weight, scale, bias, cos, sin, heads, kv_heads, k_cache, v_cache, slots),
                 (x,) if cos is None else (x, cos, sin))
