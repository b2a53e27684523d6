"""FP8 (e4m3) linear: per-token float8_e4m3fn activations x per-channel float8_e4m3fn weights, fp32 scales.

    out = act(acc * x_scale[m] * w_scale[n] + bias[n] + residual[m, n]),   acc = x_q @ w_q.T

x_q (..., K) float8_e4m3fn with per-token fp32 scales x_scale (..., 1) (``quantize_fp8_per_token``: scale =
max|x_row| / 448, dynamic; on CUDA one kernel, ``csrc/quant.cu``'s ``quantize_fp8_rows``, bit-exact to
``quantize_fp8_ref``) or one static scale for every token (one value), w_q (N, K) float8_e4m3fn with
per-output-channel fp32 scales w_scale (N, 1) or (N,) (``quantize_fp8_ref(w, -1)``); bias (N,) and residual (..., N)
in the output dtype; act = ReLU or none. The epilogue is ``fused_linear``'s protocol, shared with the int8 W8A8 op
(``w8a8_linear._epilogue``).

Backends (``fp8_backend(device)`` says which one serves a device):
  * ``cutlass-sm90``: an sm_90 GPU with the extension built with CUTLASS (the int8 W8A8 kernels' build): the CUTLASS
    warp-specialized FP8 GEMM (the tensor cores' fast accumulation) with the per-token x per-channel scales, bias, residual and
    ReLU in its epilogue and one rounding to the output dtype (``w8a8_linear.sm90_scaled_linear``). K % 16 and N % 8;
    other shapes take the next backend;
  * ``scaled_mm``: a CUDA GPU of compute capability >= 8.9 (Ada, H100/H200): ``torch._scaled_mm`` with row-wise
    scales (x_scale (M, 1) x w_scale (1, N), fp32 accumulation), bf16 output (the row-wise path's output dtype),
    then the bias / residual / ReLU as separate PyTorch ops in fp32. Needs K and N multiples of 16; other shapes
    run the reference;
  * ``reference``: CPU, older GPUs and the shapes above: ``fp8_linear_ref``, the fp8 values' products summed in fp32
    (float64 on CUDA, where an fp32 matmul may run in TF32).

At decode-sized inputs the FP8 linears run the e4m3 weight GEMV instead (``fp8_gemv.py``).
"""
from __future__ import annotations

import warnings

import torch

from fuseinfer.core.errors import FuseInferError
from fuseinfer.core.extension import route
from fuseinfer.ops.quant import rows_kernel
from fuseinfer.ops.w8a8_linear import _epilogue, check_scaled_linear, sm90_scaled_linear, w8a8_backend

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores (Ada, Hopper)
ALIGN = 16  # torch._scaled_mm: K and N multiples of 16


# ------------------------------------------------------------------------------------------------------- quantize

def quantize_fp8_ref(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: x (...) -> (q float8_e4m3fn like x, scale fp32 with ``dim`` of size 1), scale = amax / 448 (an
    all-zero row gets the smallest normal fp32 scale, so q = 0), q = x / scale rounded to nearest even in e4m3."""
    if x.shape[dim] == 0:  # nothing to reduce
        shape = list(x.shape)
        shape[dim] = 1
        amax = x.new_zeros(shape, dtype=torch.float32)
    else:
        amax = x.detach().float().abs().amax(dim=dim, keepdim=True)
    # a tensor divisor: IEEE division on every device (as quantize_int8_ref)
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp_min(torch.finfo(torch.float32).tiny)
    # (the clamp: x / scale may land one ulp above 448, and e4m3fn has no infinity: the cast would give NaN)
    q = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


@torch.library.custom_op("fuseinfer::quantize_fp8_per_token", mutates_args=())
def _quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_fp8_ref(x, -1)


@_quantize_fp8_per_token.register_kernel("cuda")
def _quantize_fp8_per_token_cuda(x):
    return rows_kernel("quantize_fp8_rows", x, lambda t: quantize_fp8_ref(t, -1))


@_quantize_fp8_per_token.register_fake
def _(x):
    return x.new_empty(x.shape, dtype=FP8_DTYPE), x.new_empty(*x.shape[:-1], 1, dtype=torch.float32)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K) fp16/bf16/fp32 -> (x_q (..., K) float8_e4m3fn, x_scale (..., 1) fp32): dynamic, one scale per
    token (row), scale = max|x_row| / 448."""
    if not x.is_floating_point() or x.dtype == FP8_DTYPE or x.dim() < 1:
        raise FuseInferError(f"quantize_fp8_per_token takes a floating-point (..., K) tensor, got {x.dtype} "
                             f"{tuple(x.shape)}")
    return route(torch.ops.fuseinfer.quantize_fp8_per_token, lambda t: quantize_fp8_ref(t, -1),
                 _quantize_fp8_per_token_cuda, (x,), (x,))


# --------------------------------------------------------------------------------------------------------- linear

def fp8_linear_ref(x_q, x_scale, w_q, w_scale, bias, residual, activation: str, out_dtype: torch.dtype):
    """Pure-PyTorch reference. x_q (..., K) e4m3, x_scale (..., 1) fp32, w_q (N, K) e4m3, w_scale (N, 1) or (N,)
    fp32, bias (N,), residual (..., N) -> (..., N) out_dtype. Each product of two e4m3 values is exact in fp32 (4 + 4
    significant bits); the sums round in fp32 on CPU, in float64 on CUDA (an fp32 CUDA matmul may run in TF32)."""
    acc_dtype = torch.float32 if x_q.device.type == "cpu" else torch.float64
    acc = (x_q.to(acc_dtype) @ w_q.to(acc_dtype).T).float()  # (..., N)
    return _epilogue(acc, x_scale, w_scale, bias, residual, activation, out_dtype)


# device index -> why torch._scaled_mm raised there (its first line): that device then runs the reference, and the
# patch report / eval notes say why (a constraint of another torch version, not a wrong result)
_failed: dict[int, str] = {}


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def fp8_backend(device: torch.device, out_dtype: torch.dtype = torch.float16) -> str:
    """'cutlass-sm90', 'scaled_mm' or 'reference': what serves an FP8 linear on ``device`` (aligned shapes)."""
    if device.type == "cuda" and w8a8_backend(device, out_dtype) == "cutlass-sm90":
        return "cutlass-sm90"
    return "scaled_mm" if _scaled_mm_ok(device) else "reference"


def _scaled_mm_ok(device: torch.device) -> bool:
    """Whether torch._scaled_mm serves FP8 linears on ``device`` (compute capability >= 8.9, and it has not raised
    there)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm") or _index(device) in _failed:
        return False
    return torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def fp8_gemm_note(device: torch.device, out_dtype: torch.dtype = torch.float16) -> str:
    """One line for the patch report and the eval's notes: the GEMM an FP8 linear runs on ``device``."""
    backend = fp8_backend(device, out_dtype)
    if backend == "cutlass-sm90":
        return ("FP8 GEMM: CUTLASS sm_90 e4m3 (scales, bias, residual, ReLU in the epilogue; K % 16 or N % 8 "
                "otherwise: torch._scaled_mm)")
    if backend == "scaled_mm":
        return ("FP8 GEMM: torch._scaled_mm (row-wise scales, bf16 output; bias / residual / ReLU as separate ops; "
                "K or N not a multiple of 16: the reference)")
    if device.type == "cuda" and _index(device) in _failed:
        return f"FP8 GEMM: PyTorch reference (torch._scaled_mm raised on this GPU: {_failed[_index(device)]}; slow)"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return (f"FP8 GEMM: PyTorch reference (compute capability {major}.{minor} < 8.9: no FP8 tensor cores; "
                "slow)")
    return f"FP8 GEMM: PyTorch reference ({device.type}: the fp8 values' products summed in fp32, slow)"


def _scaled_mm(x_q, x_scale, w_q, w_scale, bias, residual, activation, out_dtype):
    """torch._scaled_mm with row-wise scales, then the epilogue in fp32; the reference where it cannot run."""
    lead, k, n = x_q.shape[:-1], x_q.shape[-1], w_q.shape[0]
    x2 = x_q.reshape(-1, k)  # (M, K)
    m = x2.shape[0]
    if m == 0 or k == 0 or k % ALIGN or n % ALIGN or not _scaled_mm_ok(x_q.device):
        return fp8_linear_ref(x_q, x_scale, w_q, w_scale, bias, residual, activation, out_dtype)
    # row-major (M, K) x column-major (K, N): w_q (N, K) contiguous, transposed as a view
    try:
        y = torch._scaled_mm(x2.contiguous(), w_q.contiguous().t(),
                             scale_a=x_scale.reshape(-1, 1).float().expand(m, 1).contiguous(),
                             scale_b=w_scale.reshape(1, n).float().contiguous(), out_dtype=torch.bfloat16)  # (M, N)
    except RuntimeError as exc:  # a constraint this torch build has: the reference from now on, and said so
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        _failed[_index(x_q.device)] = why
        warnings.warn(f"fuseinfer: torch._scaled_mm raised ({why}); FP8 linears on this GPU run the PyTorch "
                      "reference", RuntimeWarning, stacklevel=2)
        return fp8_linear_ref(x_q, x_scale, w_q, w_scale, bias, residual, activation, out_dtype)
    y = y.float().view(*lead, n)
    if bias is not None:
        y = y + bias.float()
    if residual is not None:
        y = y + residual.float()
    if activation == "relu":
        y = torch.relu(y)
    return y.to(out_dtype)


@torch.library.custom_op("fuseinfer::fp8_linear", mutates_args=())
def _fp8_linear(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
    residual: torch.Tensor | None, activation: str, out_dtype: torch.dtype,
) -> torch.Tensor:
    return fp8_linear_ref(x_q, x_scale, w_q, w_scale, bias, residual, activation, out_dtype)


@_fp8_linear.register_kernel("cuda")
def _fp8_linear_cuda(x_q, x_scale, w_q, w_scale, bias, residual, activation, out_dtype):
    if x_q.numel():
        out = sm90_scaled_linear(x_q, x_scale, w_q, w_scale, bias, residual, activation, out_dtype)
        if out is not None:
            return out
    return _scaled_mm(x_q, x_scale, w_q, w_scale, bias, residual, activation, out_dtype)


@_fp8_linear.register_fake
def _(x_q, x_scale, w_q, w_scale, bias, residual, activation, out_dtype):
    return x_q.new_empty(*x_q.shape[:-1], w_q.shape[0], dtype=out_dtype)


def _check(x_q, x_scale, w_q, w_scale, bias, residual, activation, out_dtype):
    check_scaled_linear("fp8_linear", FP8_DTYPE, "quantize_fp8_per_token / quantize_fp8_ref", x_q, x_scale, w_q,
                        w_scale, bias, residual, activation, out_dtype)


def fp8_linear(x_q, x_scale, w_q, w_scale, bias=None, residual=None, activation: str = "none",
               out_dtype: torch.dtype = torch.float16):
    """``act(x_q @ w_q.T * x_scale * w_scale.T + bias + residual)`` in ``out_dtype``: ``torch._scaled_mm`` on
    CUDA GPUs of compute capability >= 8.9, else the reference (see the module docstring). Not differentiable."""
    _check(x_q, x_scale, w_q, w_scale, bias, residual, activation, out_dtype)
    args = (x_q, x_scale, w_q, w_scale, bias, residual, activation, out_dtype)
    return route(torch.ops.fuseinfer.fp8_linear, fp8_linear_ref, _fp8_linear_cuda, args,
                 (x_q, x_scale, w_q, w_scale, bias, residual))
