"""Linear layer with int8 weights (W8A16) and the fused epilogue: ``y = act(x @ (q * scale).T + bias + residual)``.

q: int8 (N, K), scale: fp32 (N,), one per output channel (``fuseinfer/quant``); x, bias, residual and y in the
model's dtype. On CUDA (``csrc/w8a16_linear.cu``): for M <= 16 tokens (decode) a GEMV that streams the int8
weights (half the bytes of fp16), converts them to fp16/bf16 in registers (exact: |q| <= 127), multiplies
on tensor cores with fp32 accumulation and applies ``scale`` in the fp32 epilogue with bias / ReLU / residual; for
more tokens (prefill) it dequantizes the weight to x's dtype in a scratch buffer and runs the fp16/bf16 cuBLASLt
epilogue GEMM of ``linear_epilogue``. Activation ``"silu_mul"`` (a gated MLP's fused gate/up weight, gate rows then up
rows) as in ``linear_epilogue``: ``silu(gate) * up``, in the decode GEMV's epilogue.
"""
from __future__ import annotations

import torch

from fuseinfer.core.extension import extension, route
from fuseinfer.core.errors import FuseInferError
from fuseinfer.ops.linear import check_activation, linear_epilogue_ref
from fuseinfer.ops.silu_mul import silu_mul_grad

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # csrc/w8a16_linear.cu; others run the reference


def dequantize_weight_ref(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 (N, K) and fp32 scales (N,) -> (N, K) in ``dtype``: q * scale in fp32, rounded once."""
    return (qweight.float() * scale.float()[:, None]).to(dtype)


def w8a16_linear_ref(x, qweight, scale, bias, residual, activation: str):
    """Pure-PyTorch reference: the weight dequantized to x's dtype, then ``linear_epilogue_ref``. x: (..., K),
    qweight: (N, K) int8, scale: (N,) fp32, bias: (N,), residual: (..., N) -> (..., N).

    The prefill kernel computes exactly this (dequantize, then the fp16 GEMM); the decode kernel applies the scale
    to the fp32 accumulator instead of rounding each weight to fp16 first, which is more accurate (the tests
    compare both with an fp32 reference)."""
    return linear_epilogue_ref(x, dequantize_weight_ref(qweight, scale, x.dtype), bias, residual, activation)


def _check(x, qweight, scale, bias, residual, activation):
    check_activation(activation, residual, qweight.shape[0] if qweight.dim() == 2 else 0)
    if qweight.dtype != torch.int8 or qweight.dim() != 2 or x.dim() < 1 or x.shape[-1] != qweight.shape[1]:
        raise FuseInferError(f"w8a16_linear: expected x (..., K) and an int8 weight (N, K), got {tuple(x.shape)} and "
                             f"{tuple(qweight.shape)} {qweight.dtype}")
    if not x.is_floating_point():
        raise FuseInferError(f"w8a16_linear: x must be floating point (the activations stay unquantized), got {x.dtype}")
    n = qweight.shape[0]
    if scale.shape != (n,) or scale.dtype != torch.float32:
        raise FuseInferError(f"w8a16_linear: scale must be ({n},) float32, one per output channel, got "
                             f"{tuple(scale.shape)} {scale.dtype}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise FuseInferError(f"w8a16_linear: bias must be ({n},) in x's dtype {x.dtype}, got {tuple(bias.shape)} "
                             f"{bias.dtype}")
    if residual is not None and (residual.shape != (*x.shape[:-1], n) or residual.dtype != x.dtype):
        raise FuseInferError(f"residual must be {tuple(x.shape[:-1]) + (n,)} in {x.dtype}, got "
                             f"{tuple(residual.shape)} in {residual.dtype}")


@torch.library.custom_op("fuseinfer::w8a16_linear", mutates_args=())
def _int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
    residual: torch.Tensor | None, activation: str,
) -> torch.Tensor:
    return w8a16_linear_ref(x, qweight, scale, bias, residual, activation)


@_int8_linear.register_kernel("cuda")
def _int8_linear_cuda(x, qweight, scale, bias, residual, activation):
    ext = extension(x.device)
    # the decode kernel reads weights before its PDL wait (launch.h): a strided weight, which would be copied just
    # before the call, takes the reference instead
    if ext is None or not hasattr(ext, "w8a16_linear") or not qweight.is_contiguous() or x.dtype not in KERNEL_DTYPES:
        return w8a16_linear_ref(x, qweight, scale, bias, residual, activation)
    lead = x.shape[:-1]
    n = qweight.shape[0]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # (M, K)
    r2 = None if residual is None else residual.reshape(-1, n).contiguous()  # (M, N)
    y = ext.w8a16_linear(x2, qweight, scale.contiguous(), None if bias is None else bias.contiguous(), r2,
                        activation)  # (M, N), or (M, N / 2) for silu_mul
    return y.view(*lead, y.shape[-1])


@_int8_linear.register_fake
def _(x, qweight, scale, bias, residual, activation):
    return x.new_empty(*x.shape[:-1], qweight.shape[0] // (2 if activation == "silu_mul" else 1))


def _setup_context(ctx, inputs, output):
    x, qweight, scale, bias, residual, activation = inputs
    ctx.silu = activation == "silu_mul"
    ctx.save_for_backward(qweight, scale, output if activation == "relu" else None,
                          *((x, bias) if ctx.silu else (None, None)))
    ctx.has_bias, ctx.has_residual, ctx.dtype = bias is not None, residual is not None, x.dtype


def _backward(ctx, grad):
    """The reference's gradients for x, bias and residual (g = grad * act'(y), silu_mul's recomputed at the
    linear's output; dx = g W with W the dequantized weight); the int8 weight and its scales are constants (no
    gradient)."""
    qweight, scale, y, x, bias = ctx.saved_tensors
    if ctx.silu:
        w = dequantize_weight_ref(qweight, scale, ctx.dtype)
        grad = silu_mul_grad(torch.nn.functional.linear(x, w, bias), grad)  # (..., F) -> (..., 2F)
    g = grad if y is None else grad * (y > 0)  # (..., N)
    need = ctx.needs_input_grad
    dx = g @ dequantize_weight_ref(qweight, scale, ctx.dtype) if need[0] else None  # (..., K)
    db = g.reshape(-1, g.shape[-1]).sum(0) if ctx.has_bias and need[3] else None  # (N,)
    dr = g if ctx.has_residual and need[4] else None
    return dx, None, None, db, dr, None


_int8_linear.register_autograd(_backward, setup_context=_setup_context)


def w8a16_linear(x, qweight, scale, bias=None, residual=None, activation: str = "none"):
    """``act(x @ (qweight * scale[:, None]).T + bias + residual)`` with int8 weights, one kernel on CUDA."""
    _check(x, qweight, scale, bias, residual, activation)
    return route(torch.ops.fuseinfer.w8a16_linear, w8a16_linear_ref, _int8_linear_cuda,
                 (x, qweight, scale, bias, residual, activation), (x, bias, residual))


def dequantize_weight(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 (N, K) + fp32 scales (N,) -> (N, K) in ``dtype`` (one CUDA kernel where built, else the reference)."""
    ext = extension(qweight.device) if qweight.is_cuda else None
    if ext is not None and hasattr(ext, "int8_dequantize") and qweight.is_contiguous() and \
            dtype in KERNEL_DTYPES:
        return ext.int8_dequantize(qweight, scale.contiguous(), dtype)
    return dequantize_weight_ref(qweight, scale, dtype)
