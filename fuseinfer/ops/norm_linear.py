"""RMSNorm folded into the next linear: ``rms_norm_linear`` (``linear_epilogue`` of ``RMSNorm(x)``) and
``rms_norm_linear_rope_append`` (``linear_rope_append`` of ``RMSNorm(x)``), the Llama family's norm -> gate/up and
norm -> q/k/v at decode.

``RMSNorm(x)`` is ``add_rms_norm(x, None, norm_weight, eps)`` (``ops/rms_norm.py``, transformers' rounding: ``x * rstd``
rounded to the dtype, then times the weight, rounded). On CUDA at decode sizes (the decode GEMV's: at most 16 rows,
fp16 / bf16, the rows fitting shared memory; ``csrc/linear.cu``, ``csrc/linear_rope.cu``) one kernel: every block of
the GEMV computes the rows' statistics and stages the normalised rows in shared memory before its dot products (the
GEMV's RMSNorm prologue), so the norm kernel and its (M, K) output are gone. The prologue rounds as ``add_rms_norm``
does; only its fp32 sum of squares is added in another order, so a rare last-bit difference of ``rstd`` can move a
normalised value by one unit in the last place. Elsewhere (prefill, fp32, FUSEINFER_GEMV_EPILOGUES=0) the two ops run.
"""
from __future__ import annotations

import torch

from fuseinfer.core.errors import FuseInferError
from fuseinfer.core.extension import extension, route
from fuseinfer.ops.linear import _check as _check_linear
from fuseinfer.ops.linear import linear_epilogue, linear_epilogue_ref
from fuseinfer.ops.linear_rope import check_operands as _check_rope
from fuseinfer.ops.linear_rope import linear_rope_append, linear_rope_append_ref
from fuseinfer.ops.rms_norm import add_rms_norm, add_rms_norm_ref

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the raw ops take (fp32: the two ops)


def _norm_ref(x, norm_weight, eps):
    return add_rms_norm_ref(x, None, norm_weight, eps, False)[0]


def rms_norm_linear_ref(x, norm_weight, eps: float, weight, bias, residual, activation: str):
    """Pure-PyTorch reference: ``linear_epilogue_ref(RMSNorm(x), weight, bias, residual, activation)``; x (..., K),
    norm_weight (K,) -> (..., N), or (..., N / 2) for ``"silu_mul"``."""
    return linear_epilogue_ref(_norm_ref(x, norm_weight, eps), weight, bias, residual, activation)


def rms_norm_linear_rope_append_ref(x, norm_weight, eps: float, weight, bias, cos, sin, heads: int, kv_heads: int,
                                    k_cache, v_cache, slots):
    """Pure-PyTorch reference: ``linear_rope_append_ref`` of ``RMSNorm(x)`` (x (B, S, K)) with weight in x's dtype."""
    return linear_rope_append_ref(_norm_ref(x, norm_weight, eps), weight, None, bias, cos, sin, heads, kv_heads,
                                  k_cache, v_cache, slots)


# ---- rms_norm_linear ----

@torch.library.custom_op("fuseinfer::rms_norm_linear", mutates_args=())
def _rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                     bias: torch.Tensor | None, residual: torch.Tensor | None, activation: str) -> torch.Tensor:
    return rms_norm_linear_ref(x, norm_weight, eps, weight, bias, residual, activation)


@_rms_norm_linear.register_kernel("cuda")
def _rms_norm_linear_cuda(x, norm_weight, eps, weight, bias, residual, activation):
    ext = extension(x.device)
    # a strided weight would be copied just before the GEMV, which reads weights before its PDL wait (launch.h)
    if ext is None or not hasattr(ext, "rms_norm_linear") or not weight.is_contiguous() \
            or x.dtype not in KERNEL_DTYPES:
        return linear_epilogue(add_rms_norm(x, None, norm_weight, eps)[0], weight, bias, residual, activation)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # (M, K)
    r2 = None if residual is None else residual.reshape(-1, weight.shape[0]).contiguous()  # (M, N)
    y = ext.rms_norm_linear(x2, norm_weight.contiguous(), eps, weight, None if bias is None else bias.contiguous(),
                            r2, activation)  # (M, N or N / 2)
    return y.view(*lead, y.shape[-1])


@_rms_norm_linear.register_fake
def _(x, norm_weight, eps, weight, bias, residual, activation):
    return x.new_empty(*x.shape[:-1], weight.shape[0] // (2 if activation == "silu_mul" else 1))


def _check_norm(name: str, x, norm_weight) -> None:
    if norm_weight.shape != x.shape[-1:] or norm_weight.dtype != x.dtype:
        raise FuseInferError(f"{name}: norm_weight must be ({x.shape[-1]},) in x's dtype {x.dtype}, got "
                             f"{tuple(norm_weight.shape)} in {norm_weight.dtype}")


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def rms_norm_linear(x, norm_weight, eps: float, weight, bias=None, residual=None, activation: str = "none"):
    """``linear_epilogue(add_rms_norm(x, None, norm_weight, eps)[0], weight, bias, residual, activation)``, one
    kernel at decode on CUDA. x (..., K); norm_weight (K,) and weight (N, K) in x's dtype. See the module doc."""
    _check_norm("rms_norm_linear", x, norm_weight)
    _check_linear(x, weight, bias, residual, activation)
    if _needs_grad(x, norm_weight, weight, bias, residual):  # (the kernels are forward-only): the two ops' gradients
        return linear_epilogue(add_rms_norm(x, None, norm_weight, eps)[0], weight, bias, residual, activation)
    return route(torch.ops.fuseinfer.rms_norm_linear, rms_norm_linear_ref, _rms_norm_linear_cuda,
                 (x, norm_weight, eps, weight, bias, residual, activation), (x, norm_weight, weight, bias, residual))


# ---- rms_norm_linear_rope_append ----

@torch.library.custom_op("fuseinfer::rms_norm_linear_rope_append", mutates_args=("k_cache", "v_cache"))
def _rms_norm_linear_rope_append(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                                 bias: torch.Tensor | None, cos: torch.Tensor | None, sin: torch.Tensor | None,
                                 heads: int, kv_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 slots: torch.Tensor) -> torch.Tensor:
    return rms_norm_linear_rope_append_ref(x, norm_weight, eps, weight, bias, cos, sin, heads, kv_heads, k_cache,
                                           v_cache, slots)


@_rms_norm_linear_rope_append.register_kernel("cuda")
def _rms_norm_linear_rope_append_cuda(x, norm_weight, eps, weight, bias, cos, sin, heads, kv_heads, k_cache, v_cache,
                                      slots):
    ext = extension(x.device)
    if ext is None or not hasattr(ext, "rms_norm_linear_rope_append") or not weight.is_contiguous():
        return linear_rope_append(add_rms_norm(x, None, norm_weight, eps)[0], weight, None, bias, cos, sin, heads,
                                  kv_heads, k_cache, v_cache, slots)
    return ext.rms_norm_linear_rope_append(x, norm_weight.contiguous(), eps, weight,
                                           None if bias is None else bias.contiguous(),
                                           None if cos is None else cos.contiguous(),
                                           None if sin is None else sin.contiguous(), heads, kv_heads, k_cache,
                                           v_cache, slots)


@_rms_norm_linear_rope_append.register_fake
def _(x, norm_weight, eps, weight, bias, cos, sin, heads, kv_heads, k_cache, v_cache, slots):
    b, s, _ = x.shape
    return x.new_empty(b, heads, s, weight.shape[0] // (heads + 2 * kv_heads))


def rms_norm_linear_rope_append(x, norm_weight, eps: float, weight, bias, cos, sin, heads: int, kv_heads: int,
                                k_cache, v_cache, slots):
    """``linear_rope_append(add_rms_norm(x, None, norm_weight, eps)[0], weight, None, bias, cos, sin, heads, kv_heads,
    k_cache, v_cache, slots)`` -> q (B, H, S, D), one kernel at decode on CUDA. x (B, S, K); norm_weight (K,) and
    weight ((H + 2 Hkv) D, K) in x's dtype (no int8 weights). See the module doc."""
    if x.dim() != 3:
        raise FuseInferError(f"rms_norm_linear_rope_append: expected x (B, S, K), got {tuple(x.shape)}")
    _check_norm("rms_norm_linear_rope_append", x, norm_weight)
    if weight.dtype != x.dtype:
        raise FuseInferError(f"rms_norm_linear_rope_append: the weight must be in x's dtype {x.dtype}, got "
                             f"{weight.dtype}")
    _check_rope(x, weight, None, bias, cos, sin, heads, kv_heads)
    return route(torch.ops.fuseinfer.rms_norm_linear_rope_append, rms_norm_linear_rope_append_ref,
                 _rms_norm_linear_rope_append_cuda,
                 (x, norm_weight, eps, weight, bias, cos, sin, heads, kv_heads, k_cache, v_cache, slots),
                 (x, norm_weight) if cos is None else (x, norm_weight, cos, sin))
