"""Scaled 8-bit linears whose epilogue writes the next linear's 8-bit input, with a static scale.

    fp8_linear_fp8out:   out = e4m3(clamp(act(acc * x_scale[m] * w_scale[n] + bias[n]) / out_scale, -448, 448))
    w8a8_linear_int8out: out = clamp(round(act(acc * x_scale[m] * w_scale[n] + bias[n]) / out_scale), -127, 127)

acc = x_q @ w_q.T: x_q (..., K) float8_e4m3fn / int8 with per-token fp32 scales x_scale (..., 1) (or one static
value), w_q (N, K) of the same type with per-output-channel fp32 scales w_scale (N, 1) or (N,); bias (N,) fp16, bf16,
fp32 or None, act = ReLU or none, out_scale one fp32 value: the *static* per-tensor scale of the next linear's input
(calibrated ``amax / 448`` or ``amax / 127``, as TensorRT-LLM and ModelOpt quantize static activations). A per-token
scale cannot be formed in one GEMM epilogue (it needs the row's maximum over every N tile); a static one can, so the
output is written once, one byte per element, and the next linear takes it with ``x_scale = out_scale`` for every row
(``quantize_fp8_static`` / ``quantize_int8_static`` quantize an fp16 / bf16 tensor the same way, where the output was
not written by these ops). Rounding: e4m3 to nearest even, saturating; int8 half to even.

Backends:
  * the CUTLASS sm_90 scaled GEMM of ``fp8_linear`` / ``w8a8_linear`` with an 8-bit-output epilogue
    (``csrc/linear_8bit_out_sm90.cu``: the scale's reciprocal formed once per CTA on the device), on an sm_90 GPU
    with the extension built with CUTLASS, K % 16 == 0 and N % 16 == 0 (the 8-bit output's 16-byte rows);
  * elsewhere on CUDA: ``fp8_linear`` / ``w8a8_linear`` in the bias' dtype (fp16 without a bias), then the static
    quantization (one more pass, and a rounding to that dtype before the 8-bit one);
  * CPU: the references: the linear's reference in fp32, then the static quantization.
Inference only: not differentiable.
"""
from __future__ import annotations

import torch

from fuseinfer.core.errors import FuseInferError
from fuseinfer.core.extension import extension, register_op, route
from fuseinfer.ops.fp8_linear import _fp8_linear_cuda, FP8_DTYPE, FP8_MAX, fp8_linear_ref
from fuseinfer.ops.quant import quantize_int8_static
from fuseinfer.ops.w8a8_linear import _aligned, _kernel_ok, _w8a8_linear_cuda, check_scaled_linear, w8a8_linear_ref

KERNEL_BIAS_DTYPES = (torch.float16, torch.bfloat16)  # csrc/linear_8bit_out_sm90.cu
ALIGN_N = 16  # the 8-bit output's rows: 16 one-byte values (TMA)


def quantize_fp8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (...) floating point, scale one fp32 value -> (...) float8_e4m3fn: ``x / scale`` clamped to +-448 (e4m3fn
    has no infinity: an out-of-range value would become NaN) and rounded to nearest even. A static (calibrated)
    per-tensor scale, so values beyond ``448 * scale`` saturate."""
    return (x.float() / scale.float().reshape(())).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


# format -> (operand and output dtype, the static quantization, the op's name, the linear's reference, the linear's
# CUDA implementation, the quantizer a caller names for x_q)
FORMATS = {
    "e4m3": (FP8_DTYPE, quantize_fp8_static, "fp8_linear_fp8out", fp8_linear_ref, _fp8_linear_cuda,
             "quantize_fp8_per_token / quantize_fp8_ref"),
    "int8": (torch.int8, quantize_int8_static, "w8a8_linear_int8out", w8a8_linear_ref, _w8a8_linear_cuda,
             "fuseinfer.ops.quantize_per_token / quantize_per_channel"),
}


def linear_8bit_out_ref(x_q, x_scale, w_q, w_scale, bias, out_scale, activation: str, fmt: str) -> torch.Tensor:
    """Pure-PyTorch reference: the linear's reference in fp32 (the epilogue's one fp32 rounding), then the static
    quantization of ``fmt`` with out_scale. (..., K) -> (..., N) float8_e4m3fn / int8."""
    _, quantize, _, linear_ref, _, _ = FORMATS[fmt]
    return quantize(linear_ref(x_q, x_scale, w_q, w_scale, bias, None, activation, torch.float32), out_scale)


def fp8_linear_fp8out_ref(x_q, x_scale, w_q, w_scale, bias, out_scale, activation: str) -> torch.Tensor:
    return linear_8bit_out_ref(x_q, x_scale, w_q, w_scale, bias, out_scale, activation, "e4m3")


def w8a8_linear_int8out_ref(x_q, x_scale, w_q, w_scale, bias, out_scale, activation: str) -> torch.Tensor:
    return linear_8bit_out_ref(x_q, x_scale, w_q, w_scale, bias, out_scale, activation, "int8")


def kernel_serves(x_q: torch.Tensor, w_q: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the sm_90 8-bit-output kernel runs this call (else the linear + quantize fallback)."""
    ext = extension(x_q.device) if x_q.is_cuda else None
    return (ext is not None and hasattr(ext, "linear_8bit_out") and _kernel_ok(ext, x_q.device)
            and x_q.shape[-1] % 16 == 0 and w_q.shape[0] % ALIGN_N == 0
            and (bias is None or bias.dtype in KERNEL_BIAS_DTYPES))


def _cuda(x_q, x_scale, w_q, w_scale, bias, out_scale, activation, fmt: str):
    dtype, quantize, _, _, linear_cuda, _ = FORMATS[fmt]
    k, n = x_q.shape[-1], w_q.shape[0]
    lead = x_q.shape[:-1]
    if x_q.numel() and kernel_serves(x_q, w_q, bias):
        x2 = _aligned(x_q.reshape(-1, k))  # (M, K)
        m = x2.shape[0]
        out = torch.empty(m, n, dtype=dtype, device=x_q.device)  # (M, N)
        extension(x_q.device).linear_8bit_out(
            x2, _aligned(x_scale.reshape(-1)), _aligned(w_q), _aligned(w_scale.reshape(n)),
            None if bias is None else _aligned(bias), out_scale.reshape(1).float(), activation == "relu", out)
        return out.view(*lead, n)
    y = linear_cuda(x_q, x_scale, w_q, w_scale, bias, None, activation,
                    torch.float16 if bias is None else bias.dtype)  # (..., N)
    return quantize(y, out_scale)


def _register(fmt: str):
    """The custom op ``fuseinfer::fp8_linear_fp8out`` / ``w8a8_linear_int8out`` (FORMATS): the reference on CPU,
    _cuda on CUDA, the fake's output in the format's dtype; -> (the op's handle, its reference, its CUDA
    implementation)."""
    def reference(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                  bias: torch.Tensor | None, out_scale: torch.Tensor, activation: str) -> torch.Tensor:
        return linear_8bit_out_ref(x_q, x_scale, w_q, w_scale, bias, out_scale, activation, fmt)

    def cuda(x_q, x_scale, w_q, w_scale, bias, out_scale, activation):
        return _cuda(x_q, x_scale, w_q, w_scale, bias, out_scale, activation, fmt)

    def fake(x_q, x_scale, w_q, w_scale, bias, out_scale, activation):
        return x_q.new_empty(*x_q.shape[:-1], w_q.shape[0], dtype=FORMATS[fmt][0])

    return register_op(FORMATS[fmt][2], reference, cuda, fake)


_OPS = {fmt: _register(fmt) for fmt in FORMATS}
_fp8_linear_fp8out_cuda = _OPS["e4m3"][2]
_w8a8_linear_int8out_cuda = _OPS["int8"][2]


def check_out_scale(op: str, out_scale, device: torch.device, what: str = "x_q") -> None:
    """A static output scale: one fp32 value in a tensor on ``device``, else one clear error naming ``op``."""
    if not isinstance(out_scale, torch.Tensor) or out_scale.dtype != torch.float32 or out_scale.numel() != 1 \
            or out_scale.device != device:
        got = f"{tuple(out_scale.shape)} {out_scale.dtype} on {out_scale.device}" \
            if isinstance(out_scale, torch.Tensor) else type(out_scale).__name__
        raise FuseInferError(f"{op}: out_scale must be one fp32 value (a tensor on {what}'s device), got {got}")


def linear_8bit_out(x_q, x_scale, w_q, w_scale, bias=None, out_scale=None, activation: str = "none",
                    fmt: str = "e4m3"):
    """``q(act(x_q @ w_q.T * x_scale * w_scale.T + bias) / out_scale)`` in ``fmt`` ("e4m3" or "int8"), (..., K) ->
    (..., N) float8_e4m3fn / int8 (see the module docstring). The next linear takes the result with
    ``x_scale = out_scale`` on every row. Not differentiable."""
    dtype, _, name, _, _, hint = FORMATS[fmt]
    check_scaled_linear(name, dtype, hint, x_q, x_scale, w_q, w_scale, bias, None, activation,
                        torch.float32 if bias is None else bias.dtype)
    check_out_scale(name, out_scale, x_q.device)
    op, ref, cuda = _OPS[fmt]
    args = (x_q, x_scale, w_q, w_scale, bias, out_scale, activation)
    return route(op(), ref, cuda, args, (x_q, x_scale, w_q, w_scale, bias, out_scale))


def fp8_linear_fp8out(x_q, x_scale, w_q, w_scale, bias=None, out_scale=None, activation: str = "none"):
    """``linear_8bit_out`` in e4m3: (..., N) float8_e4m3fn."""
    return linear_8bit_out(x_q, x_scale, w_q, w_scale, bias, out_scale, activation, "e4m3")


def w8a8_linear_int8out(x_q, x_scale, w_q, w_scale, bias=None, out_scale=None, activation: str = "none"):
    """``linear_8bit_out`` in int8: (..., N) int8."""
    return linear_8bit_out(x_q, x_scale, w_q, w_scale, bias, out_scale, activation, "int8")
