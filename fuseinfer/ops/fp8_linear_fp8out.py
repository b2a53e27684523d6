"""FP8 linear with e4m3 output: the next linear's input written by this one's epilogue, with a static scale.

    out = e4m3(clamp(act(acc * x_scale[m] * w_scale[n] + bias[n]) / out_scale, -448, 448)),   acc = x_q @ w_q.T

x_q (..., K) float8_e4m3fn with per-token fp32 scales x_scale (..., 1), w_q (N, K) float8_e4m3fn with
per-output-channel fp32 scales w_scale (N, 1) or (N,), bias (N,) fp16 / bf16 / fp32 or None, act = ReLU or none,
out_scale one fp32 value: the *static* per-tensor scale of the next linear's input (calibrated ``amax / 448``, as
TensorRT-LLM and ModelOpt quantize FP8 activations). A per-token scale cannot be formed in one GEMM epilogue (it needs
the row's maximum over every N tile); a static one can, so the output is written once, one byte per element, and the
next linear takes it with ``x_scale = out_scale`` for every row (``quantize_fp8_static`` quantizes an fp16 / bf16
tensor the same way, where the output was not written by this op).

Backends:
  * the CUTLASS sm_90 FP8 GEMM of ``fp8_linear`` with an e4m3-output epilogue (``csrc/fp8_linear_fp8out_sm90.cu``:
    the scale's reciprocal formed once per CTA on the device, round to nearest even, saturating), on an sm_90 GPU
    with the extension built with CUTLASS, K % 16 == 0 and N % 16 == 0 (the e4m3 output's 16-byte rows);
  * elsewhere on CUDA: ``fp8_linear`` in the bias' dtype (fp16 without a bias), then ``quantize_fp8_static`` (one
    more pass, and a rounding to that dtype before the e4m3 one);
  * CPU: the reference, ``fp8_linear_fp8out_ref``: ``fp8_linear_ref`` in fp32, then the static quantization.
"""
from __future__ import annotations

import torch

from fuseinfer.core.errors import FuseInferError
from fuseinfer.core.extension import extension, route
from fuseinfer.ops.fp8_linear import _fp8_linear_cuda, FP8_DTYPE, FP8_MAX, fp8_linear_ref
from fuseinfer.ops.w8a8_linear import _aligned, _kernel_ok, check_scaled_linear

KERNEL_BIAS_DTYPES = (torch.float16, torch.bfloat16)  # csrc/fp8_linear_fp8out_sm90*.cu
ALIGN_N = 16  # the e4m3 output's rows: 16 one-byte values (TMA)


def quantize_fp8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (...) floating point, scale one fp32 value -> (...) float8_e4m3fn: ``x / scale`` clamped to +-448 (e4m3fn
    has no infinity: an out-of-range value would become NaN) and rounded to nearest even. A static (calibrated)
    per-tensor scale, so values beyond ``448 * scale`` saturate."""
    return (x.float() / scale.float().reshape(())).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def fp8_linear_fp8out_ref(x_q, x_scale, w_q, w_scale, bias, out_scale, activation: str) -> torch.Tensor:
    """Pure-PyTorch reference: ``fp8_linear_ref`` in fp32 (the epilogue's one fp32 rounding), then
    ``quantize_fp8_static`` with out_scale. (..., K) -> (..., N) float8_e4m3fn."""
    y = fp8_linear_ref(x_q, x_scale, w_q, w_scale, bias, None, activation, torch.float32)
    return quantize_fp8_static(y, out_scale)


@torch.library.custom_op("fuseinfer::fp8_linear_fp8out", mutates_args=())
def _fp8_linear_fp8out(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
    out_scale: torch.Tensor, activation: str,
) -> torch.Tensor:
    return fp8_linear_fp8out_ref(x_q, x_scale, w_q, w_scale, bias, out_scale, activation)


def kernel_serves(x_q: torch.Tensor, w_q: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the sm_90 e4m3-output kernel runs this call (else the fp8_linear + quantize fallback)."""
    ext = extension(x_q.device) if x_q.is_cuda else None
    return (ext is not None and hasattr(ext, "fp8_linear_fp8out") and _kernel_ok(ext, x_q.device)
            and x_q.shape[-1] % 16 == 0 and w_q.shape[0] % ALIGN_N == 0
            and (bias is None or bias.dtype in KERNEL_BIAS_DTYPES))


@_fp8_linear_fp8out.register_kernel("cuda")
def _fp8_linear_fp8out_cuda(x_q, x_scale, w_q, w_scale, bias, out_scale, activation):
    k, n = x_q.shape[-1], w_q.shape[0]
    lead = x_q.shape[:-1]
    if x_q.numel() and kernel_serves(x_q, w_q, bias):
        x2 = _aligned(x_q.reshape(-1, k))  # (M, K)
        m = x2.shape[0]
        out = torch.empty(m, n, dtype=FP8_DTYPE, device=x_q.device)  # (M, N)
        extension(x_q.device).fp8_linear_fp8out(
            x2, _aligned(x_scale.reshape(m)), _aligned(w_q), _aligned(w_scale.reshape(n)),
            None if bias is None else _aligned(bias), out_scale.reshape(1).float(), activation == "relu", out)
        return out.view(*lead, n)
    dtype = torch.float16 if bias is None else bias.dtype
    y = _fp8_linear_cuda(x_q, x_scale, w_q, w_scale, bias, None, activation, dtype)  # (..., N)
    return quantize_fp8_static(y, out_scale)


@_fp8_linear_fp8out.register_fake
def _(x_q, x_scale, w_q, w_scale, bias, out_scale, activation):
    return x_q.new_empty(*x_q.shape[:-1], w_q.shape[0], dtype=FP8_DTYPE)


def check_out_scale(op: str, out_scale, device: torch.device, what: str = "x_q") -> None:
    """A static output scale: one fp32 value in a tensor on ``device``, else one clear error naming ``op``."""
    if not isinstance(out_scale, torch.Tensor) or out_scale.dtype != torch.float32 or out_scale.numel() != 1 \
            or out_scale.device != device:
        got = f"{tuple(out_scale.shape)} {out_scale.dtype} on {out_scale.device}" \
            if isinstance(out_scale, torch.Tensor) else type(out_scale).__name__
        raise FuseInferError(f"{op}: out_scale must be one fp32 value (a tensor on {what}'s device), got {got}")


def _check(x_q, x_scale, w_q, w_scale, bias, out_scale, activation):
    check_scaled_linear("fp8_linear_fp8out", FP8_DTYPE, "quantize_fp8_per_token / quantize_fp8_ref", x_q, x_scale,
                        w_q, w_scale, bias, None, activation, torch.float32 if bias is None else bias.dtype)
    check_out_scale("fp8_linear_fp8out", out_scale, x_q.device)


def fp8_linear_fp8out(x_q, x_scale, w_q, w_scale, bias=None, out_scale=None, activation: str = "none"):
    """``e4m3(act(x_q @ w_q.T * x_scale * w_scale.T + bias) / out_scale)``, (..., K) -> (..., N) float8_e4m3fn (see
    the module docstring). The next linear takes the result with ``x_scale = out_scale`` on every row. Not
    differentiable."""
    _check(x_q, x_scale, w_q, w_scale, bias, out_scale, activation)
    args = (x_q, x_scale, w_q, w_scale, bias, out_scale, activation)
    return route(torch.ops.fuseinfer.fp8_linear_fp8out, fp8_linear_fp8out_ref, _fp8_linear_fp8out_cuda, args,
                 (x_q, x_scale, w_q, w_scale, bias, out_scale))
