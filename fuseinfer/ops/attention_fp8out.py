"""Attention whose output is the output projection's e4m3 input, quantized in the attention kernel's epilogue.

    out = e4m3(clamp(attention(q, k, v, key_mask, q_start, scale) / out_scale, -448, 448))   (B, Sq, H, D)

Masking and layout as ``attention`` (``ops/attention.py``); ``out_scale`` is one fp32 value, the *static* per-tensor
scale of the output projection's input (calibrated ``amax / 448``: ``Float8(out_proj_input="static")``), so the
output projection takes the result with ``x_scale = out_scale`` on every row. A per-token scale cannot be formed
here: a token's row spans every head, and each head is another thread block's work. TensorRT-LLM's FP8 attention
kernels write their output with a static scale the same way.

Backends:
  * CUDA prefill (fp16 / bf16, more than 16 queries, head dim 64 or 128): the prefill kernels (wgmma on sm_90, else
    mma.sync) store e4m3 from their fp32 accumulators (the softmax normalisation and ``1 / out_scale`` in one
    multiply, round to nearest even, saturating): one byte per element written and no separate quantize pass;
  * other CUDA calls (decode-sized, other dtypes or head dims): ``attention``, then ``quantize_fp8_static`` (the
    output rounded to q's dtype before the e4m3 rounding);
  * CPU: the reference, ``attention_fp8out_ref``: the attention in fp32, then ``quantize_fp8_static``.
Inference only: not differentiable.
"""
from __future__ import annotations

import torch

from fuseinfer.core.errors import FuseInferError
from fuseinfer.core.extension import extension, route
from fuseinfer.ops.attention import KERNEL_GQA, _attention_cuda, _probs, check_mask, check_shapes, kernel_supports
from fuseinfer.ops.fp8_linear_fp8out import FP8_DTYPE, check_out_scale, quantize_fp8_static

KERNEL_MIN_SQ = 17  # queries from which the prefill kernels run (fewer: split-KV, which writes q's dtype)


def attention_fp8out_ref(q, k, v, key_mask, q_start, scale: float, out_scale) -> torch.Tensor:
    """Pure-PyTorch reference: ``attention_ref``'s fp32 attention, not rounded to q's dtype, then
    ``quantize_fp8_static`` with out_scale -> (B, Sq, H, D) float8_e4m3fn."""
    probs, _, v32 = _probs(q, k, v, key_mask, q_start, scale)  # (B, H, Sq, Skv), (B, H, Skv, D)
    out = torch.matmul(probs, v32).transpose(1, 2)  # (B, Sq, H, D) fp32
    return quantize_fp8_static(out, out_scale).contiguous()


@torch.library.custom_op("fuseinfer::attention_fp8out", mutates_args=())
def _attention_fp8out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                      q_start: torch.Tensor | None, scale: float, out_scale: torch.Tensor) -> torch.Tensor:
    return attention_fp8out_ref(q, k, v, key_mask, q_start, scale, out_scale)


def kernel_serves(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether a prefill kernel writes the e4m3 output itself (else attention, then the quantize pass)."""
    ext = extension(q.device) if q.is_cuda else None
    return (ext is not None and hasattr(ext, "attention_fp8out") and kernel_supports(q)
            and q.shape[2] >= KERNEL_MIN_SQ and (KERNEL_GQA or k.shape[1] == q.shape[1]))


@_attention_fp8out.register_kernel("cuda")
def _attention_fp8out_cuda(q, k, v, key_mask, q_start, scale, out_scale):
    if kernel_serves(q, k):
        return extension(q.device).attention_fp8out(q, k, v, key_mask, q_start, scale, out_scale.reshape(1))
    return quantize_fp8_static(_attention_cuda(q, k, v, key_mask, q_start, scale), out_scale)


@_attention_fp8out.register_fake
def _(q, k, v, key_mask, q_start, scale, out_scale):
    b, h, sq, d = q.shape
    return q.new_empty(b, sq, h, d, dtype=FP8_DTYPE)


def attention_fp8out(q, k, v, key_mask=None, q_start=None, scale: float | None = None, out_scale=None):
    """``attention`` with its output quantized to e4m3 with the static scale ``out_scale`` (one fp32 value on q's
    device): (B, Sq, H, D) float8_e4m3fn; see the module docstring. k, v in q's dtype (fp16 / bf16 / fp32)."""
    check_shapes(q, k, v)
    if not q.dtype == k.dtype == v.dtype or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise FuseInferError(f"attention_fp8out: q, k and v must share one of float16, bfloat16, float32, got "
                             f"{q.dtype}, {k.dtype}, {v.dtype}; an FP8 cache is read by attention (then quantize)")
    check_mask(q, k, key_mask, q_start)
    check_out_scale("attention_fp8out", out_scale, q.device, "q")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    args = (q, k, v, key_mask, q_start, scale, out_scale)
    return route(torch.ops.fuseinfer.attention_fp8out, attention_fp8out_ref, _attention_fp8out_cuda, args,
                 (q, k, v, out_scale))
