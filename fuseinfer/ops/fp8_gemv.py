"""FP8 weight GEMV for decode: ``y = act(x @ (w * scale).T + bias + residual)`` with float8 e4m3 weights.

w: float8_e4m3fn (N, K), scale: fp32 (N,), one per output channel (``quantize_fp8_ref(w, -1)``); x, bias, residual
and y in the model's dtype (fp16 / bf16). This is what an FP8 model's linears run at decode-sized inputs (at most
``DECODE_ROWS`` rows, ``layers/linear.py``): decode reads every weight once per token, so its time is the weight
bytes, which are the same e4m3 bytes whether or not the activations are quantized too; quantizing them there would
cost a pass and accuracy and buy nothing (the int8 W8A8 linears run the int8 weight-only GEMV for the same reason).

On CUDA (``csrc/fp8_gemv.cu``): the weight-streaming tensor-core GEMV of the int8 weight-only linear with e4m3 weight
chunks, converted to fp16 / bf16 in registers (one instruction per pair on Hopper, exact), fp32 accumulation, the
scale in the fp32 epilogue. Inputs it does not take (more than 16 rows, K not a multiple of 16, fp32, misaligned
or strided tensors) run the reference.
"""
from __future__ import annotations

import torch

from fuseinfer.core.errors import FuseInferError
from fuseinfer.core.extension import extension, route
from fuseinfer.ops.linear import ACTIVATIONS, check_activation, linear_epilogue_ref

FP8_DTYPE = torch.float8_e4m3fn
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
MAX_ROWS = 16  # the GEMV's token limit (skinny_gemv.cuh kMaxM)


def fp8_weight_linear_ref(x, weight, scale, bias, residual, activation: str):
    """Pure-PyTorch reference: the weight dequantized to x's dtype (``weight * scale`` in fp32, rounded once), then
    ``linear_epilogue_ref``. x (..., K), weight (N, K) e4m3, scale (N,) fp32 -> (..., N). The kernel applies the
    scale to the fp32 dot product instead (more accurate: the tests hold both against an fp32 reference)."""
    w = (weight.float() * scale.float()[:, None]).to(x.dtype)  # (N, K)
    return linear_epilogue_ref(x, w, bias, residual, activation)


def _check(x, weight, scale, bias, residual, activation):
    check_activation(activation, residual, 0, ACTIVATIONS)  # (no silu_mul here: the row count does not matter)
    if weight.dtype != FP8_DTYPE or weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise FuseInferError(f"fp8_weight_linear: expected x (..., K) and a float8_e4m3fn weight (N, K), got "
                             f"{tuple(x.shape)} and {tuple(weight.shape)} {weight.dtype}")
    if not x.is_floating_point() or x.dtype == FP8_DTYPE:
        raise FuseInferError(f"fp8_weight_linear: x must be fp16 / bf16 / fp32 (unquantized), got {x.dtype}")
    n = weight.shape[0]
    if scale.shape != (n,) or scale.dtype != torch.float32:
        raise FuseInferError(f"fp8_weight_linear: scale must be ({n},) float32, one per output channel, got "
                             f"{tuple(scale.shape)} {scale.dtype}")
    for name, t, shape in (("bias", bias, (n,)), ("residual", residual, (*x.shape[:-1], n))):
        if t is not None and (tuple(t.shape) != tuple(shape) or t.dtype != x.dtype):
            raise FuseInferError(f"fp8_weight_linear: {name} must be {tuple(shape)} in x's dtype {x.dtype}, got "
                                 f"{tuple(t.shape)} {t.dtype}")


def _kernel_takes(x2: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the CUDA GEMV serves x2 (M, K) @ weight^T (else the reference runs)."""
    m, k = x2.shape
    return (0 < m <= MAX_ROWS and weight.shape[0] > 0 and k % 16 == 0 and x2.dtype in KERNEL_DTYPES
            and weight.is_contiguous() and x2.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0)


@torch.library.custom_op("fuseinfer::fp8_weight_linear", mutates_args=())
def _fp8_weight_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
    residual: torch.Tensor | None, activation: str,
) -> torch.Tensor:
    return fp8_weight_linear_ref(x, weight, scale, bias, residual, activation)


@_fp8_weight_linear.register_kernel("cuda")
def _fp8_weight_linear_cuda(x, weight, scale, bias, residual, activation):
    ext = extension(x.device)
    n = weight.shape[0]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # (M, K)
    if ext is None or not hasattr(ext, "fp8_weight_linear") or not _kernel_takes(x2, weight):
        return fp8_weight_linear_ref(x, weight, scale, bias, residual, activation)
    r2 = None if residual is None else residual.reshape(-1, n).contiguous()  # (M, N)
    y = ext.fp8_weight_linear(x2, weight, scale.contiguous(), None if bias is None else bias.contiguous(), r2,
                              activation)  # (M, N)
    return y.view(*x.shape[:-1], n)


@_fp8_weight_linear.register_fake
def _(x, weight, scale, bias, residual, activation):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def fp8_weight_linear(x, weight, scale, bias=None, residual=None, activation: str = "none"):
    """``act(x @ (weight * scale[:, None]).T + bias + residual)`` with e4m3 weights and unquantized activations:
    one kernel on CUDA for up to 16 rows, the reference otherwise. Not differentiable."""
    _check(x, weight, scale, bias, residual, activation)
    return route(torch.ops.fuseinfer.fp8_weight_linear, fp8_weight_linear_ref, _fp8_weight_linear_cuda,
                 (x, weight, scale, bias, residual, activation), (x, bias, residual))
