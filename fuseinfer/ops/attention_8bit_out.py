"""Attention whose output is the output projection's 8-bit input, quantized in the attention kernel's epilogue.

    attention_fp8out:  out = e4m3(clamp(attention(q, k, v, key_mask, q_start, scale) / out_scale, -448, 448))
    attention_int8out: out = clamp(round(attention(q, k, v, key_mask, q_start, scale) / out_scale), -127, 127)

(B, Sq, H, D), float8_e4m3fn or int8. Masking and layout as ``attention`` (``ops/attention.py``); ``out_scale`` is
one fp32 value, the *static* per-tensor scale of the output projection's input (calibrated ``amax / 448`` or
``amax / 127``: ``Float8(out_proj_input="static")``, ``SmoothQuantW8A8(out_proj_input="static")``), so the output
projection takes the result with ``x_scale = out_scale`` on every row. A per-token scale cannot be formed here: a
token's row spans every head, and each head is another thread block's work. TensorRT-LLM's FP8 attention kernels
write their output with a static scale the same way. Rounding: e4m3 to nearest even, saturating; int8 half to even.

Backends:
  * CUDA prefill (fp16 / bf16, more than 16 queries, head dim 64 or 128): the prefill kernels (wgmma on sm_90, else
    mma.sync) store the 8-bit values from their fp32 accumulators (the softmax normalisation and ``1 / out_scale``
    in one multiply): one byte per element written and no separate quantize pass;
  * other CUDA calls (decode-sized, other dtypes or head dims): ``attention``, then ``quantize_fp8_static`` /
    ``quantize_int8_static`` (the output rounded to q's dtype before the 8-bit rounding);
  * CPU: the references: the attention in fp32, then the static quantization.
Inference only: not differentiable.
"""
from __future__ import annotations

import torch

from fuseinfer.core.errors import FuseInferError
from fuseinfer.core.extension import extension, register_op, route
from fuseinfer.ops.attention import KERNEL_GQA, _attention_cuda, _probs, check_mask, check_shapes, kernel_supports
from fuseinfer.ops.linear_8bit_out import FP8_DTYPE, check_out_scale, quantize_fp8_static
from fuseinfer.ops.quant import quantize_int8_static

KERNEL_MIN_SQ = 17  # queries from which the prefill kernels run (fewer: split-KV, which writes q's dtype)
# format -> (output dtype, the static quantization, the op's name)
FORMATS = {"e4m3": (FP8_DTYPE, quantize_fp8_static, "attention_fp8out"),
           "int8": (torch.int8, quantize_int8_static, "attention_int8out")}


def attention_8bit_ref(q, k, v, key_mask, q_start, scale: float, out_scale, fmt: str) -> torch.Tensor:
    """Pure-PyTorch reference: ``attention_ref``'s fp32 attention, not rounded to q's dtype, then the static
    quantization of ``fmt`` ("e4m3" or "int8") with out_scale -> (B, Sq, H, D) float8_e4m3fn / int8."""
    probs, _, v32 = _probs(q, k, v, key_mask, q_start, scale)  # (B, H, Sq, Skv), (B, H, Skv, D)
    out = torch.matmul(probs, v32).transpose(1, 2)  # (B, Sq, H, D) fp32
    return FORMATS[fmt][1](out, out_scale).contiguous()


def attention_fp8out_ref(q, k, v, key_mask, q_start, scale: float, out_scale) -> torch.Tensor:
    return attention_8bit_ref(q, k, v, key_mask, q_start, scale, out_scale, "e4m3")


def attention_int8out_ref(q, k, v, key_mask, q_start, scale: float, out_scale) -> torch.Tensor:
    return attention_8bit_ref(q, k, v, key_mask, q_start, scale, out_scale, "int8")


def kernel_serves(q: torch.Tensor, k: torch.Tensor, fmt: str = "e4m3") -> bool:
    """Whether a prefill kernel writes the 8-bit output itself (else attention, then the quantize pass)."""
    ext = extension(q.device) if q.is_cuda else None
    return (ext is not None and hasattr(ext, FORMATS[fmt][2]) and kernel_supports(q)
            and q.shape[2] >= KERNEL_MIN_SQ and (KERNEL_GQA or k.shape[1] == q.shape[1]))


def _cuda(q, k, v, key_mask, q_start, scale, out_scale, fmt: str):
    _, quantize, name = FORMATS[fmt]
    if kernel_serves(q, k, fmt):
        return getattr(extension(q.device), name)(q, k, v, key_mask, q_start, scale, out_scale.reshape(1))
    return quantize(_attention_cuda(q, k, v, key_mask, q_start, scale), out_scale)


def _fake(q, fmt: str):
    b, h, sq, d = q.shape
    return q.new_empty(b, sq, h, d, dtype=FORMATS[fmt][0])


def _register(fmt: str):
    """The custom op ``fuseinfer::attention_fp8out`` / ``attention_int8out`` (FORMATS): the reference on CPU, _cuda on
    CUDA, the fake's output in the format's dtype; -> (the op's handle, its reference, its CUDA implementation)."""
    def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                  q_start: torch.Tensor | None, scale: float, out_scale: torch.Tensor) -> torch.Tensor:
        return attention_8bit_ref(q, k, v, key_mask, q_start, scale, out_scale, fmt)

    def cuda(q, k, v, key_mask, q_start, scale, out_scale):
        return _cuda(q, k, v, key_mask, q_start, scale, out_scale, fmt)

    return register_op(FORMATS[fmt][2], reference, cuda,
                       lambda q, k, v, key_mask, q_start, scale, out_scale: _fake(q, fmt))


_OPS = {fmt: _register(fmt) for fmt in FORMATS}


def attention_8bit(q, k, v, key_mask=None, q_start=None, scale: float | None = None, out_scale=None,
                   fmt: str = "e4m3"):
    """``attention`` with its output quantized to ``fmt`` ("e4m3" or "int8") with the static scale ``out_scale``
    (one fp32 value on q's device): (B, Sq, H, D) float8_e4m3fn / int8; see the module docstring. k, v in q's dtype
    (fp16 / bf16 / fp32)."""
    name = FORMATS[fmt][2]
    check_shapes(q, k, v)
    if not q.dtype == k.dtype == v.dtype or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise FuseInferError(f"{name}: q, k and v must share one of float16, bfloat16, float32, got {q.dtype}, "
                             f"{k.dtype}, {v.dtype}; an FP8 cache is read by attention (then quantize)")
    check_mask(q, k, key_mask, q_start)
    check_out_scale(name, out_scale, q.device, "q")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    op, ref, cuda = _OPS[fmt]
    return route(op(), ref, cuda, (q, k, v, key_mask, q_start, scale, out_scale), (q, k, v, out_scale))


def attention_fp8out(q, k, v, key_mask=None, q_start=None, scale: float | None = None, out_scale=None):
    """``attention_8bit`` in e4m3: (B, Sq, H, D) float8_e4m3fn."""
    return attention_8bit(q, k, v, key_mask, q_start, scale, out_scale, "e4m3")


def attention_int8out(q, k, v, key_mask=None, q_start=None, scale: float | None = None, out_scale=None):
    """``attention_8bit`` in int8: (B, Sq, H, D) int8."""
    return attention_8bit(q, k, v, key_mask, q_start, scale, out_scale, "int8")
