"""LayerNorm folded into the next linear: ``layer_norm_linear`` (``linear_epilogue`` or ``w8a16_linear`` of
``LayerNorm(x)``) and ``layer_norm_linear_append`` (``linear_rope_append`` without rotation of ``LayerNorm(x)``), the
OPT family's pre-LN norms -> the MLP's first linear (+ ReLU) and -> q/k/v (+ the cache write) at decode.

``LayerNorm(x)`` is ``add_layer_norm(x, None, ln_weight, ln_bias, eps)`` (``ops/layer_norm.py``: fp32 statistics,
the mean and then the squared deviations, ``(x - mean) * rstd * weight + bias`` rounded once to the dtype). The
weight is in x's dtype, or int8 with fp32 per-row scales (W8A16). On CUDA at decode sizes (the decode GEMV's: at most
16 rows, fp16 / bf16, the rows fitting shared memory; ``csrc/linear.cu``, ``csrc/linear_rope.cu``) one kernel: every
block of the GEMV computes the rows' statistics and stages the normalised rows in shared memory before its dot
products (the GEMV's LayerNorm prologue), so the norm kernel and its (M, K) output are gone. The prologue rounds as
``add_layer_norm`` does; only its fp32 sums are added in another order, so a rare last-bit difference of the mean or
``rstd`` can move a normalised value by one unit in the last place. Elsewhere (prefill, fp32, the activation
``"silu_mul"``, FUSEINFER_GEMV_EPILOGUES=0) the two ops run.
"""
from __future__ import annotations

import torch

from fuseinfer.core.errors import FuseInferError
from fuseinfer.core.extension import extension, route
from fuseinfer.ops.layer_norm import add_layer_norm, add_layer_norm_ref
from fuseinfer.ops.linear import _check as _check_linear
from fuseinfer.ops.linear import linear_epilogue, linear_epilogue_ref
from fuseinfer.ops.linear_rope import check_operands as _check_rope
from fuseinfer.ops.linear_rope import linear_rope_append, linear_rope_append_ref
from fuseinfer.ops.norm_linear import KERNEL_DTYPES, _needs_grad
from fuseinfer.ops.w8a16_linear import _check as _check_int8
from fuseinfer.ops.w8a16_linear import w8a16_linear, w8a16_linear_ref

def _norm_ref(x, ln_weight, ln_bias, eps):
    return add_layer_norm_ref(x, None, ln_weight, ln_bias, eps, False)[0]


def _linear(x, weight, scale, bias, residual, activation, ref: bool):
    """The linear op after the norm: w8a16_linear for an int8 weight (with its scales), else linear_epilogue."""
    if weight.dtype == torch.int8:
        return (w8a16_linear_ref if ref else w8a16_linear)(x, weight, scale, bias, residual, activation)
    return (linear_epilogue_ref if ref else linear_epilogue)(x, weight, bias, residual, activation)


def layer_norm_linear_ref(x, ln_weight, ln_bias, eps: float, weight, scale, bias, residual, activation: str):
    """Pure-PyTorch reference: the linear reference (``w8a16_linear_ref`` for an int8 weight, else
    ``linear_epilogue_ref``) of ``add_layer_norm_ref(x, None, ln_weight, ln_bias, eps)``; x (..., K), ln_weight and
    ln_bias (K,) -> (..., N)."""
    return _linear(_norm_ref(x, ln_weight, ln_bias, eps), weight, scale, bias, residual, activation, ref=True)


def layer_norm_linear_append_ref(x, ln_weight, ln_bias, eps: float, weight, scale, bias, heads: int, kv_heads: int,
                                 k_cache, v_cache, slots):
    """Pure-PyTorch reference: ``linear_rope_append_ref`` without rotation of LayerNorm(x) (x (B, S, K))."""
    return linear_rope_append_ref(_norm_ref(x, ln_weight, ln_bias, eps), weight, scale, bias, None, None, heads,
                                  kv_heads, k_cache, v_cache, slots)


# ---- layer_norm_linear ----

@torch.library.custom_op("fuseinfer::layer_norm_linear", mutates_args=())
def _layer_norm_linear(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, eps: float,
                       weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
                       residual: torch.Tensor | None, activation: str) -> torch.Tensor:
    return layer_norm_linear_ref(x, ln_weight, ln_bias, eps, weight, scale, bias, residual, activation)


@_layer_norm_linear.register_kernel("cuda")
def _layer_norm_linear_cuda(x, ln_weight, ln_bias, eps, weight, scale, bias, residual, activation):
    ext = extension(x.device)
    # a strided weight would be copied just before the GEMV, which reads weights before its PDL wait (launch.h)
    if ext is None or not hasattr(ext, "layer_norm_linear") or not weight.is_contiguous() \
            or x.dtype not in KERNEL_DTYPES:
        return _linear(add_layer_norm(x, None, ln_weight, ln_bias, eps)[0], weight, scale, bias, residual,
                       activation, ref=False)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # (M, K)
    r2 = None if residual is None else residual.reshape(-1, weight.shape[0]).contiguous()  # (M, N)
    y = ext.layer_norm_linear(x2, ln_weight.contiguous(), ln_bias.contiguous(), eps, weight,
                              None if scale is None else scale.contiguous(),
                              None if bias is None else bias.contiguous(), r2, activation)  # (M, N or N / 2)
    return y.view(*lead, y.shape[-1])


@_layer_norm_linear.register_fake
def _(x, ln_weight, ln_bias, eps, weight, scale, bias, residual, activation):
    return x.new_empty(*x.shape[:-1], weight.shape[0] // (2 if activation == "silu_mul" else 1))


def _check_norm(name: str, x, ln_weight, ln_bias) -> None:
    for what, t in (("ln_weight", ln_weight), ("ln_bias", ln_bias)):
        if t.shape != x.shape[-1:] or t.dtype != x.dtype:
            raise FuseInferError(f"{name}: {what} must be ({x.shape[-1]},) in x's dtype {x.dtype}, got "
                                 f"{tuple(t.shape)} in {t.dtype}")


def layer_norm_linear(x, ln_weight, ln_bias, eps: float, weight, scale=None, bias=None, residual=None,
                      activation: str = "none"):
    """``linear_epilogue(add_layer_norm(x, None, ln_weight, ln_bias, eps)[0], weight, bias, residual, activation)``
    (or ``w8a16_linear`` of it, with ``scale``, for an int8 weight), one kernel at decode on CUDA. x (..., K);
    ln_weight, ln_bias (K,) in x's dtype; weight (N, K) in x's dtype, or int8 with fp32 scales (N,). See the module
    doc."""
    _check_norm("layer_norm_linear", x, ln_weight, ln_bias)
    if weight.dtype == torch.int8:
        if scale is None:
            raise FuseInferError("layer_norm_linear: an int8 weight needs its fp32 per-row scales")
        _check_int8(x, weight, scale, bias, residual, activation)
    else:
        if scale is not None:
            raise FuseInferError("layer_norm_linear: scales go with an int8 weight only")
        _check_linear(x, weight, bias, residual, activation)
    if _needs_grad(x, ln_weight, ln_bias, weight, bias, residual):  # (the kernels are forward-only): the two ops'
        return _linear(add_layer_norm(x, None, ln_weight, ln_bias, eps)[0], weight, scale, bias, residual,
                       activation, ref=False)
    return route(torch.ops.fuseinfer.layer_norm_linear, layer_norm_linear_ref, _layer_norm_linear_cuda,
                 (x, ln_weight, ln_bias, eps, weight, scale, bias, residual, activation),
                 (x, ln_weight, ln_bias, weight, bias, residual))


# ---- layer_norm_linear_append ----

@torch.library.custom_op("fuseinfer::layer_norm_linear_append", mutates_args=("k_cache", "v_cache"))
def _layer_norm_linear_append(x: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, eps: float,
                              weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, heads: int,
                              kv_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slots: torch.Tensor) -> torch.Tensor:
    return layer_norm_linear_append_ref(x, ln_weight, ln_bias, eps, weight, scale, bias, heads, kv_heads, k_cache,
                                        v_cache, slots)


@_layer_norm_linear_append.register_kernel("cuda")
def _layer_norm_linear_append_cuda(x, ln_weight, ln_bias, eps, weight, scale, bias, heads, kv_heads, k_cache, v_cache,
                                   slots):
    ext = extension(x.device)
    if ext is None or not hasattr(ext, "layer_norm_linear_append") or not weight.is_contiguous():
        return linear_rope_append(add_layer_norm(x, None, ln_weight, ln_bias, eps)[0], weight, scale, bias, None,
                                  None, heads, kv_heads, k_cache, v_cache, slots)
    return ext.layer_norm_linear_append(x, ln_weight.contiguous(), ln_bias.contiguous(), eps, weight,
                                        None if scale is None else scale.contiguous(),
                                        None if bias is None else bias.contiguous(), heads, kv_heads, k_cache,
                                        v_cache, slots)


@_layer_norm_linear_append.register_fake
def _(x, ln_weight, ln_bias, eps, weight, scale, bias, heads, kv_heads, k_cache, v_cache, slots):
    b, s, _ = x.shape
    return x.new_empty(b, heads, s, weight.shape[0] // (heads + 2 * kv_heads))


def layer_norm_linear_append(x, ln_weight, ln_bias, eps: float, weight, scale, bias, heads: int, kv_heads: int,
                             k_cache, v_cache, slots):
    """``linear_rope_append(add_layer_norm(x, None, ln_weight, ln_bias, eps)[0], weight, scale, bias, None, None,
    heads, kv_heads, k_cache, v_cache, slots)`` -> q (B, H, S, D), with k and v written into the caches (B, Hkv, T, D)
    at slots (S,); one kernel at decode on CUDA. x (B, S, K); ln_weight, ln_bias (K,) in x's dtype; weight
    ((H + 2 Hkv) D, K) in x's dtype (scale None) or int8 with fp32 per-row scales. See the module doc."""
    if x.dim() != 3:
        raise FuseInferError(f"layer_norm_linear_append: expected x (B, S, K), got {tuple(x.shape)}")
    _check_norm("layer_norm_linear_append", x, ln_weight, ln_bias)
    _check_rope(x, weight, scale, bias, None, None, heads, kv_heads)
    return route(torch.ops.fuseinfer.layer_norm_linear_append, layer_norm_linear_append_ref,
                 _layer_norm_linear_append_cuda,
                 (x, ln_weight, ln_bias, eps, weight, scale, bias, heads, kv_heads, k_cache, v_cache, slots),
                 (x, ln_weight, ln_bias))
