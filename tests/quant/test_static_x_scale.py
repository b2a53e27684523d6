"""The scaled 8-bit GEMMs take one static x_scale for every row (a calibrated per-tensor input scale) as well as one
per token: ``w8a8_linear``, ``fp8_linear``, ``w8a8_linear_int8out`` and ``fp8_linear_fp8out`` with x_scale of one
value give exactly what they give with that value repeated per row (the references on CPU; on an sm_90 GPU, marked,
the CUTLASS kernels, whose epilogue broadcasts the one value instead of reading a per-row copy: bit for bit, at each
tile configuration's M), and other shapes are still one clear error."""
from __future__ import annotations

import pytest
import torch
from helpers import scaled_linear_operands

from fuseinfer import FuseInferError
from fuseinfer.ops.fp8_linear import fp8_linear, quantize_fp8_ref
from fuseinfer.ops.linear_8bit_out import fp8_linear_fp8out, w8a8_linear_int8out
from fuseinfer.ops.quant import quantize_int8_ref
from fuseinfer.ops.w8a8_linear import w8a8_linear

QUANTIZE = {"int8": quantize_int8_ref, "e4m3": quantize_fp8_ref}


def calls(fmt: str, dtype: torch.dtype):
    """(name, f(x_q, x_scale, w_q, w_scale, bias, residual)) of the scaled GEMMs of ``fmt`` with ``dtype`` output (the
    8-bit-output ones take no residual)."""
    linear = w8a8_linear if fmt == "int8" else fp8_linear
    out_8bit = w8a8_linear_int8out if fmt == "int8" else fp8_linear_fp8out
    return [("linear", lambda x, xs, w, ws, b, r: linear(x, xs, w, ws, b, r, "relu", dtype)),
            ("8bit_out", lambda x, xs, w, ws, b, r: out_8bit(x, xs, w, ws, b, torch.tensor([0.05], device=x.device),
                                                             "relu"))]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else torch.equal(a, b)


def _check(fmt, dtype, lead, n, k, device):
    x_q, _, w_q, w_s, b = scaled_linear_operands(QUANTIZE[fmt], lead, n, k, dtype, device=device)
    one = torch.tensor([0.0123], device=device)  # (1,): every row
    rows = one.expand(*lead, 1).contiguous()     # the same value per row
    residual = torch.randn(*lead, n, device=device).to(dtype)
    for name, f in calls(fmt, dtype):
        r = residual if name == "linear" else None
        assert _same(f(x_q, one, w_q, w_s, b, r), f(x_q, rows, w_q, w_s, b, r)), name
        assert _same(f(x_q, one.reshape(()), w_q, w_s, b, r), f(x_q, rows, w_q, w_s, b, r)), name


@pytest.mark.parametrize("fmt", ["int8", "e4m3"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_one_value_is_that_value_on_every_row(fmt, dtype):
    _check(fmt, dtype, (2, 9), 48, 64, "cpu")


@pytest.mark.parametrize("fmt", ["int8", "e4m3"])
def test_other_x_scale_shapes_are_one_clear_error(fmt):
    x_q, _, w_q, w_s, b = scaled_linear_operands(QUANTIZE[fmt], (4,), 16, 32, torch.float16)
    for bad in (torch.ones(2), torch.ones(4, 2), torch.ones(1).double()):
        for name, f in calls(fmt, torch.float16):
            with pytest.raises(FuseInferError, match="x_scale must be"):
                f(x_q, bad, w_q, w_s, b, None)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int8", "e4m3"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lead", [(1,), (5,), (200,), (2, 350)])
def test_gpu_kernel_broadcasts_one_value(fmt, dtype, lead):
    """The CUTLASS kernels (K % 16, N % 16) with one x_scale value and with it repeated per row: the same bits."""
    from fuseinfer.ops.w8a8_linear import w8a8_backend

    if not torch.cuda.is_available() or w8a8_backend(torch.device("cuda"), dtype) != "cutlass-sm90":
        pytest.skip("needs an sm_90 GPU and the extension built with CUTLASS")
    _check(fmt, dtype, lead, 528, 256, "cuda")
