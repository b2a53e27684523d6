"""Symmetric int8 quantisation: per-token (activations) and per-channel (weights).

``q = round(x / scale)`` clamped to [-127, 127] with ``scale = amax(|x|) / 127`` taken over ``dim``
(kept as a size-1 dim, fp32); ``round`` is round-half-to-even (``torch.round``; ``__float2int_rn`` /
``rintf`` in the kernels, whose fp32 division is IEEE like PyTorch's, so q and the scale are bit-identical to
the reference). Per-token quantisation of activations (M, K) reduces over K (``dim=-1``); per-channel
quantisation of an nn.Linear weight (N, K), one scale per output channel, also reduces over K.

On CUDA (``csrc/quant.cu``) the last-dim reduction (both of the above) runs one kernel per call: a block per row
computes the row's absolute maximum, then quantizes the row (re-read from L1/L2) with one 8-byte store per 8
values; ``dequantize`` of a 2-D q with one scale per row runs the int8 -> fp16/bf16 kernel of
``csrc/w8a16_linear.cu``. Other dims run the reference. W8A16 (``fuseinfer.Int8WeightOnly``) quantizes its
weights with ``quantize_per_channel``.
"""
from __future__ import annotations

import torch

from fuseinfer.core.extension import extension
from fuseinfer.core.errors import FuseInferError

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

QMAX = 127.0


def quantize_int8_ref(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: x (...) -> (q int8 like x, scale fp32 with ``dim`` of size 1)."""
    if x.shape[dim] == 0:  # nothing to reduce: the scale of an all-zero row
        shape = list(x.shape)
        shape[dim] = 1
        amax = x.new_zeros(shape, dtype=torch.float32)
    else:
        amax = x.detach().float().abs().amax(dim=dim, keepdim=True)
    # a tensor divisor: IEEE division on every device (a Python scalar divisor makes CUDA multiply by its reciprocal,
    # one ulp off the CPU's result and the kernel's)
    scale = (amax / torch.full_like(amax, QMAX)).clamp_min(torch.finfo(torch.float32).tiny)  # all-zero rows: q = 0
    q = torch.round(x.float() / scale).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def quantize_int8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (...) floating point, scale one fp32 value (a static, calibrated per-tensor scale) -> (...) int8:
    ``round(x / scale)`` (half to even) clamped to [-127, 127]; values beyond ``127 * scale`` saturate."""
    return torch.round(x.float() / scale.float().reshape(())).clamp_(-QMAX, QMAX).to(torch.int8)


def dequantize_int8_ref(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reference: q * scale in fp32, cast to ``dtype``."""
    return (q.float() * scale).to(dtype)


@torch.library.custom_op("fuseinfer::quantize_int8", mutates_args=())
def _quantize_int8(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_int8_ref(x, dim)


def rows_kernel(name: str, x: torch.Tensor, ref):
    """x (..., K) quantized per row over its last dim by the extension's row kernel ``name`` ((R, K) -> (q (R, K),
    scale (R,) fp32)) -> (q like x, scale (..., 1)); ``ref(x)`` where that kernel cannot run (no extension or op, an
    empty or non-contiguous x, whose strides q keeps as the fakes say, another dtype)."""
    ext = extension(x.device)
    if ext is None or not hasattr(ext, name) or x.numel() == 0 or x.dtype not in KERNEL_DTYPES \
            or not x.is_contiguous():
        return ref(x)
    q, scale = getattr(ext, name)(x.reshape(-1, x.shape[-1]))  # (R, K), (R,): one kernel
    return q.view(x.shape), scale.view(*x.shape[:-1], 1)


@_quantize_int8.register_kernel("cuda")
def _quantize_int8_cuda(x, dim):
    if dim not in (-1, x.dim() - 1):
        return quantize_int8_ref(x, dim)
    return rows_kernel("quantize_int8_rows", x, lambda t: quantize_int8_ref(t, dim))


@_quantize_int8.register_fake
def _(x, dim):
    shape = list(x.shape)
    shape[dim] = 1
    return torch.empty_like(x, dtype=torch.int8), x.new_empty(shape, dtype=torch.float32)


@torch.library.custom_op("fuseinfer::dequantize_int8", mutates_args=())
def _dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_int8_ref(q, scale, dtype).contiguous()  # (contiguous on every path, as the fake says)


@_dequantize_int8.register_kernel("cuda")
def _dequantize_int8_cuda(q, scale, dtype):
    ext = extension(q.device)
    rows = q.dim() == 2 and scale.shape == (q.shape[0], 1) and scale.dtype == torch.float32
    if ext is None or not hasattr(ext, "int8_dequantize") or not rows or dtype not in KERNEL_DTYPES or q.numel() == 0:
        return dequantize_int8_ref(q, scale, dtype).contiguous()
    return ext.int8_dequantize(q.contiguous(), scale.reshape(-1).contiguous(), dtype)


@_dequantize_int8.register_fake
def _(q, scale, dtype):
    # contiguous whatever q's layout (the kernel writes a contiguous output; empty_like would keep a transposed q's)
    return q.new_empty(q.shape, dtype=dtype)


def _dequantize_setup(ctx, inputs, output):
    q, scale, _ = inputs
    ctx.save_for_backward(q)
    ctx.scale_shape, ctx.scale_dtype = scale.shape, scale.dtype


def _dequantize_backward(ctx, grad):
    """d(q * scale)/d scale = q, summed over the dims the scale was broadcast along; q (int8) gets none."""
    (q,) = ctx.saved_tensors
    dscale = (grad.float() * q.float()).sum_to_size(ctx.scale_shape).to(ctx.scale_dtype)
    return None, dscale, None


_dequantize_int8.register_autograd(_dequantize_backward, setup_context=_dequantize_setup)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations (..., K) -> int8 (..., K) and fp32 scales (..., 1). Not differentiable (no gradient flows)."""
    return torch.ops.fuseinfer.quantize_int8(x.detach(), -1)


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """nn.Linear weight (N, K) -> int8 (N, K) and one fp32 scale per output channel (N, 1). Not differentiable."""
    return torch.ops.fuseinfer.quantize_int8(weight.detach(), -1)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """int8 values and their scales (broadcasting to q's shape) -> ``dtype``, q's shape."""
    try:
        fits = torch.broadcast_shapes(q.shape, scale.shape) == q.shape
    except RuntimeError:  # (shapes that do not broadcast at all)
        fits = False
    if not fits:
        raise FuseInferError(f"scale {tuple(scale.shape)} must broadcast to q's shape {tuple(q.shape)}")
    return torch.ops.fuseinfer.dequantize_int8(q, scale, dtype)
