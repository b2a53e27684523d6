"""Residual add + LayerNorm + per-token 8-bit quantisation in one pass, the input side of a W8A8 or FP8 linear.

    s = x + residual,  y = LayerNorm(s) * weight + bias  (rounded to x's dtype, as ``add_layer_norm``),
    add_layer_norm_quant:      q, scale = per-token symmetric int8 of y  (``quantize_int8_ref(y, -1)``:
                               scale = amax|y| / 127, q = round(y / scale)),
    add_layer_norm_quant_fp8:  q, scale = per-token float8_e4m3fn of y  (``quantize_fp8_ref(y, -1)``:
                               scale = amax|y| / 448, q = e4m3(y / scale), nearest even, saturated to +-448).

Returns ``(q, scale, s)``: q (..., N) int8 / float8_e4m3fn, scale (..., 1) fp32, s (..., N) (empty unless
``store_sum``). y itself is never materialised by the kernel (``csrc/layer_norm_quant.cu``): it goes straight to the
8-bit GEMM (``fuseinfer.ops.w8a8_linear.w8a8_linear``, ``fuseinfer.ops.fp8_linear.fp8_linear``) whose epilogue
multiplies by ``scale``. With SmoothQuant the smoothing factors are already folded into ``weight`` and ``bias``
(``fuseinfer.quant.smoothquant``).
"""
from __future__ import annotations

import torch

from fuseinfer.core.extension import eager_cuda, extension, transformed
from fuseinfer.core.errors import FuseInferError
from fuseinfer.ops.fp8_linear import FP8_DTYPE, quantize_fp8_per_token, quantize_fp8_ref
from fuseinfer.ops.layer_norm import add_layer_norm, add_layer_norm_ref
from fuseinfer.ops.quant import quantize_int8_ref, quantize_per_token

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # csrc/layer_norm_quant.cu; others: the reference
MAX_N = 16384  # the kernel's largest row


def add_layer_norm_quant_ref(x, residual, weight, bias, eps: float, store_sum: bool):
    """Pure-PyTorch reference: (q int8 (..., N), scale fp32 (..., 1), s (..., N) or empty)."""
    y, s = add_layer_norm_ref(x, residual, weight, bias, eps, store_sum)
    q, scale = quantize_int8_ref(y, -1)
    return q, scale, s


@torch.library.custom_op("fuseinfer::add_layer_norm_quant", mutates_args=())
def _add_layer_norm_quant(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, bias: torch.Tensor | None,
    eps: float, store_sum: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _contiguous(x, *add_layer_norm_quant_ref(x, residual, weight, bias, eps, store_sum))


def _contiguous(x, q, scale, s):
    """Outputs contiguous, as the kernel returns them, and never an input (s is x itself without a residual)."""
    return q.contiguous(), scale.contiguous(), (s.clone(memory_format=torch.contiguous_format) if s is x
                                                else s.contiguous())


def _unfused(x, residual) -> bool:
    """Whether the CUDA ops run the LayerNorm kernel, then the quantize (the same bits as the fused kernel where
    both were compared), instead of the fused kernel: for rows that are not whole 16-byte packs (e4m3: there the two
    differed in a GPU test). Rows without a residual take the fused kernel: it gave the LayerNorm kernel + quantize's
    bits at 512, 2048 and 4096 rows of 2048 (a GPU test's one-step tolerance had been wrong at exact powers of
    two)."""
    return x.shape[-1] % 8 != 0


def _cuda(name: str, ref, quantize, x, residual, weight, bias, eps, store_sum):
    """The CUDA form of the op ``name`` (its reference ``ref``, its per-token quantize ``quantize``: the row
    quantize kernel, bit for bit the quantize reference): the fused kernel, the LayerNorm kernel then the quantize
    (``_unfused``), or the reference where the kernel cannot run."""
    ext = extension(x.device)
    if ext is None or x.dtype not in KERNEL_DTYPES or not hasattr(ext, name) or x.shape[-1] > MAX_N:
        return _contiguous(x, *ref(x, residual, weight, bias, eps, store_sum))
    if _unfused(x, residual):
        y, s = add_layer_norm(x, residual, weight, bias, eps, store_sum)
        return _contiguous(x, *quantize(y), s)
    return getattr(ext, name)(x.contiguous(), None if residual is None else residual.contiguous(),
                              None if weight is None else weight.contiguous(),
                              None if bias is None else bias.contiguous(), eps, store_sum)


@_add_layer_norm_quant.register_kernel("cuda")
def _add_layer_norm_quant_cuda(x, residual, weight, bias, eps, store_sum):
    return _cuda("add_layer_norm_quant", add_layer_norm_quant_ref, quantize_per_token, x, residual, weight, bias, eps,
                 store_sum)


@_add_layer_norm_quant.register_fake
def _(x, residual, weight, bias, eps, store_sum):
    return (torch.empty_like(x, dtype=torch.int8, memory_format=torch.contiguous_format),
            x.new_empty(*x.shape[:-1], 1, dtype=torch.float32),
            x.new_empty(x.shape) if store_sum else x.new_empty(0))


def add_layer_norm_quant(x, residual=None, weight=None, bias=None, eps: float = 1e-5, store_sum: bool = False):
    """Fused residual add + LayerNorm + per-token int8 quantisation over the last dim -> ``(q, scale, s)``.
    Not differentiable (int8 output)."""
    _check("add_layer_norm_quant", x, residual, weight, bias)
    args = (x, residual, weight, bias, eps, store_sum)
    if transformed():
        return add_layer_norm_quant_ref(*args)
    if eager_cuda(x, residual, weight, bias):  # (skips the dispatcher's Python layer, as the other ops do)
        return _add_layer_norm_quant_cuda(*args)
    return torch.ops.fuseinfer.add_layer_norm_quant(*args)


def _check(op, x, residual, weight, bias):
    """The shapes and dtypes both ops take, with ``op``'s name in the error."""
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise FuseInferError(f"{op}: residual must have x's shape and dtype {tuple(x.shape)} "
                             f"{x.dtype}, got {tuple(residual.shape)} {residual.dtype}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.shape != x.shape[-1:] or t.dtype != x.dtype):
            raise FuseInferError(f"{op}: {name} must be ({x.shape[-1]},) in {x.dtype}, got "
                                 f"{tuple(t.shape)} {t.dtype}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise FuseInferError(f"{op}: x must be (..., N) with N > 0, got {tuple(x.shape)}")


# ------------------------------------------------------------------------------------------------------ e4m3

def add_layer_norm_quant_fp8_ref(x, residual, weight, bias, eps: float, store_sum: bool):
    """Pure-PyTorch reference: (q float8_e4m3fn (..., N), scale fp32 (..., 1), s (..., N) or empty)."""
    y, s = add_layer_norm_ref(x, residual, weight, bias, eps, store_sum)
    q, scale = quantize_fp8_ref(y, -1)
    return q, scale, s


@torch.library.custom_op("fuseinfer::add_layer_norm_quant_fp8", mutates_args=())
def _add_layer_norm_quant_fp8(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, bias: torch.Tensor | None,
    eps: float, store_sum: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _contiguous(x, *add_layer_norm_quant_fp8_ref(x, residual, weight, bias, eps, store_sum))


@_add_layer_norm_quant_fp8.register_kernel("cuda")
def _add_layer_norm_quant_fp8_cuda(x, residual, weight, bias, eps, store_sum):
    return _cuda("add_layer_norm_quant_fp8", add_layer_norm_quant_fp8_ref, quantize_fp8_per_token, x, residual, weight,
                 bias, eps, store_sum)


@_add_layer_norm_quant_fp8.register_fake
def _(x, residual, weight, bias, eps, store_sum):
    return (torch.empty_like(x, dtype=FP8_DTYPE, memory_format=torch.contiguous_format),
            x.new_empty(*x.shape[:-1], 1, dtype=torch.float32),
            x.new_empty(x.shape) if store_sum else x.new_empty(0))


def add_layer_norm_quant_fp8(x, residual=None, weight=None, bias=None, eps: float = 1e-5,
                             store_sum: bool = False):
    """Fused residual add + LayerNorm + per-token float8_e4m3fn quantisation over the last dim -> ``(q, scale, s)``
    (the input of ``fp8_linear``). Not differentiable (e4m3 output)."""
    _check("add_layer_norm_quant_fp8", x, residual, weight, bias)
    args = (x, residual, weight, bias, eps, store_sum)
    if transformed():
        return add_layer_norm_quant_fp8_ref(*args)
    if eager_cuda(x, residual, weight, bias):  # (skips the dispatcher's Python layer, as the other ops do)
        return _add_layer_norm_quant_fp8_cuda(*args)
    return torch.ops.fuseinfer.add_layer_norm_quant_fp8(*args)
