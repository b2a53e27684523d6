"""W8A8 linear: int8 activations x int8 weights with the dequantisation fused into the GEMM's epilogue.

    out = act(acc * x_scale[m] * w_scale[n] + bias[n] + residual[m, n]),   acc = x_q @ w_q.T (exact, int32)

x_q (..., K) int8 with per-token fp32 scales x_scale (..., 1) (from ``add_layer_norm_quant`` or
``quantize_per_token``) or one static scale for every token (one value), w_q (N, K) int8 with per-output-channel fp32
scales w_scale (N, 1) or (N,) (``quantize_per_channel``); bias (N,) and residual (..., N) in the output dtype; act =
ReLU or none. The epilogue math is fp32 with one rounding to ``out_dtype``, so the only error against fp32 is the
quantisation itself.

Backends (``w8a8_backend(device)`` says which one serves a device):
  * ``cutlass-sm90``: on an sm_90 GPU (H100/H200) with the extension built with CUTLASS and sm_90a, a CUTLASS
    warp-specialized int8 wgmma GEMM with the scales, bias, residual and ReLU in an epilogue visitor tree
    (``csrc/w8a8_linear_sm90.cu``), fp16/bf16 output, K % 16 == 0 and N % 8 == 0;
  * ``int_mm``: any other CUDA GPU, a build without CUTLASS, or shapes the kernel does not take (fp32 output, K or N
    not aligned): the documented fallback, ``torch._int_mm`` (cuBLAS / CUTLASS sm80 int8, exact int32 accumulators)
    followed by the rescale and epilogue as separate PyTorch ops (needs M > 16 and K, N multiples of 8; else the
    reference);
  * ``reference``: CPU (and the fallback's fallback): ``w8a8_linear_ref``, exact integer products (fp32 or float64).
"""
from __future__ import annotations

import torch

from fuseinfer.core.extension import eager_cuda, extension, transformed
from fuseinfer.core.errors import FuseInferError

ACTIVATIONS = ("none", "relu")
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
KERNEL_OUT_DTYPES = (torch.float16, torch.bfloat16)  # csrc/w8a8_linear_sm90.cu


def _epilogue(acc: torch.Tensor, x_scale, w_scale, bias, residual, activation: str, out_dtype) -> torch.Tensor:
    """acc (..., N) fp32 -> act(acc * w_scale * x_scale + bias + residual) in fp32, rounded once to out_dtype. The
    kernel's order: per-channel scale first, then per-token scale with the bias (one fma), then the residual."""
    y = acc * w_scale.reshape(-1).float() * x_scale.float()
    if bias is not None:
        y = y + bias.float()
    if residual is not None:
        y = y + residual.float()
    if activation == "relu":
        y = torch.relu(y)
    return y.to(out_dtype)


def w8a8_linear_ref(x_q, x_scale, w_q, w_scale, bias, residual, activation: str, out_dtype: torch.dtype):
    """Pure-PyTorch reference. x_q (..., K) int8, x_scale (..., 1) fp32, w_q (N, K) int8, w_scale (N, 1) or (N,)
    fp32, bias (N,), residual (..., N) -> (..., N) out_dtype. The integer products are summed exactly: in fp32 while
    every partial sum stays below 2^24 (K * 127^2 <= 2^24, K <= 1040), else in float64 (exact for K < 2^53 / 127^2),
    then rounded to fp32 like the kernel's int32 -> fp32 conversion."""
    # (fp32 only on CPU: a CUDA fp32 matmul may run in TF32)
    exact = torch.float32 if x_q.device.type == "cpu" and x_q.shape[-1] * 127 * 127 <= 2 ** 24 else torch.float64
    acc = (x_q.to(exact) @ w_q.to(exact).T).float()  # (..., N), exact then one rounding
    return _epilogue(acc, x_scale, w_scale, bias, residual, activation, out_dtype)


def _int_mm_fallback(x_q, x_scale, w_q, w_scale, bias, residual, activation, out_dtype):
    """The documented path without the sm90 kernel: torch._int_mm's exact int32 GEMM, then the epilogue as separate
    PyTorch ops (one more pass over the (M, N) output in fp32). torch._int_mm needs M > 16 and K, N multiples of 8."""
    lead, k, n = x_q.shape[:-1], x_q.shape[-1], w_q.shape[0]
    x2 = x_q.reshape(-1, k)  # (M, K)
    if x2.shape[0] <= 16 or k % 8 or n % 8 or k == 0:
        return w8a8_linear_ref(x_q, x_scale, w_q, w_scale, bias, residual, activation, out_dtype)
    acc = torch._int_mm(x2.contiguous(), w_q.t()).float().view(*lead, n)  # (..., N) int32 -> fp32
    return _epilogue(acc, x_scale, w_scale, bias, residual, activation, out_dtype)


def w8a8_backend(device: torch.device, out_dtype: torch.dtype = torch.float16) -> str:
    """'cutlass-sm90', 'int_mm' or 'reference': what serves a W8A8 linear on ``device`` (K, N aligned)."""
    if device.type != "cuda":
        return "reference"
    ext = extension(device)
    if ext is None or out_dtype not in KERNEL_OUT_DTYPES or not hasattr(ext, "w8a8_linear_unavailable"):
        return "int_mm"
    return "cutlass-sm90" if _kernel_ok(ext, device) else "int_mm"


_unavailable: dict[int, str] = {}


def _kernel_ok(ext, device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _unavailable:
        _unavailable[index] = ext.w8a8_linear_unavailable(index)
    return not _unavailable[index]


def w8a8_unavailable_reason(device: torch.device) -> str:
    """Why the sm90 kernel does not serve ``device`` ("" when it does)."""
    if device.type != "cuda":
        return "not a CUDA device"
    ext = extension(device)
    if ext is None:
        return "the fuseinfer CUDA extension is not available"
    if not hasattr(ext, "w8a8_linear_unavailable"):
        return "fuseinfer._C is older than this fuseinfer: rebuild it"
    _kernel_ok(ext, device)
    return _unavailable[device.index if device.index is not None else torch.cuda.current_device()]


SLOW_ON_SM90 = "slower than fp16 on this GPU"


def w8a8_gemm_note(device: torch.device, out_dtype: torch.dtype = torch.float16) -> str:
    """One line for the patch report and the eval's notes: the GEMM a W8A8 linear's prefill runs on ``device`` and,
    for the torch._int_mm fallback on an sm_90 GPU (measured slower than the fp16 GEMMs it replaces), the fix."""
    backend = w8a8_backend(device, out_dtype)
    if backend == "cutlass-sm90":
        return "W8A8 GEMM: CUTLASS sm_90 int8"
    if backend == "reference":
        return f"W8A8 GEMM: PyTorch reference ({device.type}: exact integer products, slow)"
    if out_dtype not in KERNEL_OUT_DTYPES:
        why, fix = f"{out_dtype} output: the kernel writes fp16/bf16", "run the model in fp16 or bf16"
    else:
        why = w8a8_unavailable_reason(device)
        fix = ("reinstall fuseinfer with its CUDA extension built" if extension(device) is None else
               "pip install nvidia-cutlass, then reinstall fuseinfer (pip install --no-build-isolation ...)")
    line = f"W8A8 GEMM: torch._int_mm fallback ({why})"
    if torch.cuda.get_device_capability(device) == (9, 0):
        line += f"; {SLOW_ON_SM90}" + ("" if "pip install" in why else f": {fix}")  # (the stub's reason names it)
    return line


@torch.library.custom_op("fuseinfer::w8a8_linear", mutates_args=())
def _w8a8_linear(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
    residual: torch.Tensor | None, activation: str, out_dtype: torch.dtype,
) -> torch.Tensor:
    return w8a8_linear_ref(x_q, x_scale, w_q, w_scale, bias, residual, activation, out_dtype)


@_w8a8_linear.register_kernel("cuda")
def _w8a8_linear_cuda(x_q, x_scale, w_q, w_scale, bias, residual, activation, out_dtype):
    out = sm90_scaled_linear(x_q, x_scale, w_q, w_scale, bias, residual, activation, out_dtype)
    if out is None:
        return _int_mm_fallback(x_q, x_scale, w_q, w_scale, bias, residual, activation, out_dtype)
    return out


def sm90_scaled_linear(x_q, x_scale, w_q, w_scale, bias, residual, activation, out_dtype) -> torch.Tensor | None:
    """The CUTLASS sm_90 GEMM with the scales, bias, residual and ReLU in its epilogue, for int8 or float8_e4m3fn
    operands (``fuseinfer_C::w8a8_linear``; the arguments as ``w8a8_linear_ref``'s), or None where it does not
    serve them (no kernel on this device, another output dtype, K % 16 or N % 8)."""
    ext = extension(x_q.device)
    k, n = x_q.shape[-1], w_q.shape[0]
    if (ext is None or out_dtype not in KERNEL_OUT_DTYPES or not hasattr(ext, "w8a8_linear")
            or not _kernel_ok(ext, x_q.device) or k % 16 or n % 8):
        return None
    lead = x_q.shape[:-1]
    x2 = _aligned(x_q.reshape(-1, k))  # (M, K)
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=x_q.device)  # (M, N)
    r2 = None if residual is None else _aligned(residual.reshape(m, n))
    ext.w8a8_linear(x2, _aligned(x_scale.reshape(-1)), _aligned(w_q), _aligned(w_scale.reshape(n)),
                    None if bias is None else _aligned(bias), r2, activation == "relu", out)
    return out.view(*lead, n)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t contiguous with a 16-byte aligned start (TMA and the epilogue's vector loads need it): a copy only for
    views that are not."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


@_w8a8_linear.register_fake
def _(x_q, x_scale, w_q, w_scale, bias, residual, activation, out_dtype):
    return x_q.new_empty(*x_q.shape[:-1], w_q.shape[0], dtype=out_dtype)


def check_scaled_linear(op: str, qdtype: torch.dtype, hint: str, x_q, x_scale, w_q, w_scale, bias, residual,
                        activation, out_dtype) -> None:
    """The argument checks of a linear on quantized activations and weights with per-token and per-channel scales
    (``w8a8_linear``, ``fp8_linear``): one FuseInferError naming the argument and the fix. ``qdtype``: the
    quantized dtype both operands must have; ``hint``: how to quantize them."""
    if activation not in ACTIVATIONS:
        raise FuseInferError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if out_dtype not in OUT_DTYPES:
        raise FuseInferError(f"{op}: out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if x_q.dtype != qdtype or w_q.dtype != qdtype:
        raise FuseInferError(f"{op}: x_q and w_q must be {str(qdtype).removeprefix('torch.')} (quantize them first: "
                             f"{hint}), got {x_q.dtype}, {w_q.dtype}")
    if w_q.dim() != 2 or x_q.dim() < 1 or x_q.shape[-1] != w_q.shape[1]:
        raise FuseInferError(f"{op}: expected x_q (..., K) and w_q (N, K), got {tuple(x_q.shape)} and "
                             f"{tuple(w_q.shape)}")
    rows, n = x_q.shape[:-1].numel(), w_q.shape[0]
    per_token = x_scale.numel() == rows and x_scale.shape[:-1] == x_q.shape[:-1]
    if x_scale.dtype != torch.float32 or not (per_token or x_scale.numel() == 1):
        raise FuseInferError(f"{op}: x_scale must be fp32 {tuple(x_q.shape[:-1]) + (1,)} (one per token) or one "
                             f"value (a static scale for every token), got {tuple(x_scale.shape)} {x_scale.dtype}")
    if w_scale.dtype != torch.float32 or w_scale.numel() != n or w_scale.shape[0] != n:
        raise FuseInferError(f"{op}: w_scale must be fp32 ({n}, 1) or ({n},) (one per output channel), got "
                             f"{tuple(w_scale.shape)} {w_scale.dtype}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != out_dtype):
        raise FuseInferError(f"{op}: bias must be ({n},) in {out_dtype}, got {tuple(bias.shape)} {bias.dtype}")
    if residual is not None and (residual.shape != (*x_q.shape[:-1], n) or residual.dtype != out_dtype):
        raise FuseInferError(f"{op}: residual must be {tuple(x_q.shape[:-1]) + (n,)} in {out_dtype}, got "
                             f"{tuple(residual.shape)} {residual.dtype}")


def _check(x_q, x_scale, w_q, w_scale, bias, residual, activation, out_dtype):
    check_scaled_linear("w8a8_linear", torch.int8, "fuseinfer.ops.quantize_per_token / quantize_per_channel",
                        x_q, x_scale, w_q, w_scale, bias, residual, activation, out_dtype)


def w8a8_linear(x_q, x_scale, w_q, w_scale, bias=None, residual=None, activation: str = "none",
                out_dtype: torch.dtype = torch.float16):
    """``act(x_q @ w_q.T * x_scale * w_scale.T + bias + residual)`` in ``out_dtype``: one CUTLASS sm90 kernel on
    H100/H200 (extension built with CUTLASS), else ``torch._int_mm`` + a separate rescale on CUDA, else the
    reference (see the module docstring). Not differentiable (int8 inputs)."""
    _check(x_q, x_scale, w_q, w_scale, bias, residual, activation, out_dtype)
    args = (x_q, x_scale, w_q, w_scale, bias, residual, activation, out_dtype)
    if transformed():
        return w8a8_linear_ref(*args)
    if eager_cuda(x_q, x_scale, w_q, w_scale, bias, residual):
        return _w8a8_linear_cuda(*args)
    return torch.ops.fuseinfer.w8a8_linear(*args)
