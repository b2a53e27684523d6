"""fuseinfer::fp8_linear_fp8out (an FP8 linear whose epilogue writes e4m3 with a static per-tensor scale) and
quantize_fp8_static: the reference against an independent float64 formula (hypothesis over shapes, odd ones
included), saturation, the op registration (opcheck), bad input, the CUDA registration's fallback (fp8_linear in the
bias' dtype, then the static quantize) run on the CPU; on an sm_90 GPU (marked), the CUTLASS e4m3-output kernel
against the reference within one e4m3 step (plus the FP8 fast accumulation's error), saturation and the fallback for
N % 16 != 0."""
from __future__ import annotations

import importlib

import pytest
import torch
from helpers import assert_graph_follows_scale, scaled_linear_operands
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.library import opcheck

from fuseinfer import FuseInferError
from fuseinfer.ops.fp8_linear import FP8_DTYPE, FP8_MAX, quantize_fp8_ref
from fuseinfer.ops.linear_8bit_out import fp8_linear_fp8out, fp8_linear_fp8out_ref, quantize_fp8_static

# opcheck's schema test compares float8 tensors with torch.allclose, which they do not implement (see test_fp8_ops)
FP8_OPCHECK = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def operands(lead, n, k, bias_dtype=torch.float16, seed=0, device="cpu"):
    """(x_q, x_scale, w_q, w_scale, bias): per-token e4m3 x (*lead, K), per-channel e4m3 w (N, K), bias (N,)."""
    return scaled_linear_operands(quantize_fp8_ref, lead, n, k, bias_dtype, seed, device)


def float64_y(x_q, x_scale, w_q, w_scale, bias, activation):
    """Independent: the dequantized operands in float64, one matmul, bias, activation (before the quantization)."""
    y = (x_q.double() * x_scale.double()) @ (w_q.double() * w_scale.double().reshape(-1, 1)).T
    if bias is not None:
        y = y + bias.double()
    return y.clamp_min(0) if activation == "relu" else y


def e4m3_step(v: torch.Tensor) -> torch.Tensor:
    """The spacing of e4m3 values at |v| (in units of the e4m3 value): 2^(e - 3) for normals (e = floor(log2|v|),
    |v| >= 2^-6), 2^-9 for subnormals."""
    e = torch.floor(torch.log2(v.abs().clamp_min(2.0 ** -6)))
    return torch.pow(2.0, e - 3)


def static_scale(y: torch.Tensor, headroom: float = 1.0) -> torch.Tensor:
    """A static scale for y: amax / 448 times ``headroom`` (< 1: the largest values saturate)."""
    return (y.abs().amax().float() / FP8_MAX * headroom).clamp_min(1e-12).reshape(1)


# ------------------------------------------------------------------------------------------------------- CPU

def test_quantize_static_rounds_and_saturates():
    s = torch.tensor([0.5])
    x = torch.tensor([0.0, 0.5, -1.0, 104.0, 100.0, 224.0, 1e6, -1e6])  # (200: a tie, to even 192)
    q = quantize_fp8_static(x, s)
    assert q.dtype == FP8_DTYPE
    assert q.float().tolist() == [0.0, 1.0, -2.0, 208.0, 192.0, 448.0, 448.0, -448.0]  # 1e6 saturates, never NaN
    assert torch.equal(quantize_fp8_static(x.half(), s).view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize("activation", ["none", "relu"])
@pytest.mark.parametrize("bias_dtype", [torch.float16, torch.bfloat16, torch.float32, None])
def test_reference_is_the_static_quantization_of_the_float64_formula(activation, bias_dtype):
    args = operands((37,), 48, 80, bias_dtype)
    y = float64_y(*args, activation)
    s = static_scale(y)
    out = fp8_linear_fp8out(*args, out_scale=s, activation=activation)
    assert out.dtype == FP8_DTYPE and out.shape == (37, 48)
    v = (y / s.double()).clamp(-FP8_MAX, FP8_MAX)
    # the fp32 sums' error is far below half an e4m3 step: exact rounding except at near-ties
    assert ((out.double() - v).abs() <= e4m3_step(v) / 2 + 1e-5 * v.abs()).all()
    if activation == "relu":
        assert (out.float() >= 0).all()


@settings(max_examples=40, deadline=None)
@given(lead=st.lists(st.integers(1, 9), min_size=1, max_size=3), n=st.integers(1, 70), k=st.integers(1, 130),
       bias_dtype=st.sampled_from([torch.float16, torch.bfloat16, None]), relu=st.booleans(),
       headroom=st.sampled_from([1.0, 0.25]), seed=st.integers(0, 2 ** 16))
def test_reference_over_shapes(lead, n, k, bias_dtype, relu, headroom, seed):
    """Any (..., K) x (N, K), odd sizes included, a scale that saturates the top values too (headroom 0.25): within
    half an e4m3 step (plus fp32 summation error) of the float64 value, clamped to +-448."""
    act = "relu" if relu else "none"
    args = operands(tuple(lead), n, k, bias_dtype, seed)
    y = float64_y(*args, act)
    s = static_scale(y, headroom)
    out = fp8_linear_fp8out(*args, out_scale=s, activation=act)
    assert out.shape == (*lead, n) and out.dtype == FP8_DTYPE
    v = (y / s.double()).clamp(-FP8_MAX, FP8_MAX)
    assert ((out.double() - v).abs() <= e4m3_step(v) / 2 + 1e-5 * (1 + v.abs())).all()
    assert not out.float().isnan().any()


def test_opcheck():
    for bias_dtype, act in ((torch.float16, "relu"), (None, "none"), (torch.bfloat16, "none")):
        args = operands((2, 5), 32, 48, bias_dtype)
        opcheck(torch.ops.fuseinfer.fp8_linear_fp8out.default, (*args, torch.tensor([0.01]), act),
                test_utils=FP8_OPCHECK)
    args = operands((3,), 7, 9)  # odd sizes
    opcheck(torch.ops.fuseinfer.fp8_linear_fp8out.default, (*args, torch.tensor([0.02]), "relu"),
            test_utils=FP8_OPCHECK)


def test_bad_input_is_one_clear_error():
    x_q, x_s, w_q, w_s, b = operands((4,), 16, 32)
    s = torch.tensor([0.1])
    with pytest.raises(FuseInferError, match="out_scale must be one fp32 value"):
        fp8_linear_fp8out(x_q, x_s, w_q, w_s, b, torch.tensor([0.1, 0.2]))
    with pytest.raises(FuseInferError, match="out_scale must be one fp32 value"):
        fp8_linear_fp8out(x_q, x_s, w_q, w_s, b, s.double())
    with pytest.raises(FuseInferError, match="out_scale must be one fp32 value"):
        fp8_linear_fp8out(x_q, x_s, w_q, w_s, b, None)
    with pytest.raises(FuseInferError, match="float8_e4m3fn"):
        fp8_linear_fp8out(x_q.float(), x_s, w_q, w_s, b, s)
    with pytest.raises(FuseInferError, match="activation must be"):
        fp8_linear_fp8out(x_q, x_s, w_q, w_s, b, s, "gelu")
    with pytest.raises(FuseInferError, match="one per token"):
        fp8_linear_fp8out(x_q, x_s[:2], w_q, w_s, b, s)


@pytest.mark.parametrize("bias_dtype", [torch.float16, torch.bfloat16, None])
def test_cuda_registration_fallback_on_cpu(bias_dtype):
    """The CUDA registration where the kernel does not serve (run here on the CPU, where fp8_linear is the
    reference): fp8_linear in the bias' dtype (fp16 without one), then the static quantization: within one e4m3 step
    of the reference (the extra rounding to that dtype may move a value to the next e4m3 value)."""
    mod = importlib.import_module("fuseinfer.ops.linear_8bit_out")
    args = operands((2, 9), 48, 64, bias_dtype)
    s = static_scale(float64_y(*args, "relu"), 0.5)
    out = mod._fp8_linear_fp8out_cuda(*args, s, "relu")
    ref = fp8_linear_fp8out_ref(*args, s, "relu")
    assert out.shape == ref.shape == (2, 9, 48) and out.dtype == FP8_DTYPE
    assert ((out.float() - ref.float()).abs() <= e4m3_step(ref.float())).all()
    assert not mod.kernel_serves(args[0], args[2], args[4])  # (no kernel on the CPU)


# ------------------------------------------------------------------------------------------------------- GPU

def _needs_kernel(dtype=torch.float16):
    from fuseinfer.ops.fp8_linear import fp8_backend

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU of compute capability >= 8.9 (FP8 tensor cores)")
    if fp8_backend(torch.device("cuda"), dtype) != "cutlass-sm90":
        pytest.skip("the sm_90 FP8 GEMM is not built for this GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("lead,n,k", [((64,), 128, 256), ((2, 37), 256, 512), ((1,), 48, 64), ((300,), 1024, 2048),
                                      ((2040,), 8192, 2048), ((5,), 24, 40), ((7,), 40, 32)])
@pytest.mark.parametrize("bias_dtype", [torch.float16, torch.bfloat16, None])
@pytest.mark.parametrize("headroom", [1.0, 0.25])
def test_gpu_kernel_matches_the_reference(lead, n, k, bias_dtype, headroom):
    """The CUTLASS e4m3-output GEMM (K % 16 and N % 16; (5, 24, 40) and (7, 40, 32): N not a multiple of 16, the
    fallback) against the float64 value: within one e4m3 step at the value plus the FP8 fast accumulation's error
    (2^-8 of the sum of |products|, as test_fp8_ops bounds fp8_linear), in units of the scale; saturated values at
    exactly +-448, never NaN; ReLU before the quantization (no negative output)."""
    mod = importlib.import_module("fuseinfer.ops.linear_8bit_out")
    _needs_kernel()
    args = operands(lead, n, k, bias_dtype, device="cuda")
    assert mod.kernel_serves(args[0], args[2], args[4]) == (k % 16 == 0 and n % 16 == 0)
    for act in ("relu", "none"):
        y = float64_y(*args, act)
        s = static_scale(y, headroom)
        out = fp8_linear_fp8out(*args, out_scale=s, activation=act)
        via_op = torch.ops.fuseinfer.fp8_linear_fp8out(*args, s, act)  # the dispatcher's CUDA registration
        assert torch.equal(out.view(torch.uint8), via_op.view(torch.uint8))
        assert out.dtype == FP8_DTYPE and out.shape == (*lead, n) and not out.float().isnan().any()
        v = (y / s.double()).clamp(-FP8_MAX, FP8_MAX)
        x_q, x_s, w_q, w_s = args[:4]
        magnitude = float64_y(x_q.double().abs(), x_s, w_q.double().abs(), w_s, None, "none") / s.double()
        tol = e4m3_step(v) + magnitude * 2 ** -8 + 1e-3
        err = (out.double() - v).abs()
        assert (err <= tol).all(), (act, err.max().item())
        if act == "relu":
            assert (out.float() >= 0).all()
        if headroom < 1:
            assert out.float().abs().amax() == FP8_MAX
        cpu = fp8_linear_fp8out_ref(*(None if t is None else t.cpu() for t in args), s.cpu(), act)
        # the kernel and the CPU reference: the same e4m3 value for nearly every element
        assert (out.cpu().view(torch.uint8) == cpu.view(torch.uint8)).float().mean() > 0.95


@pytest.mark.gpu
def test_gpu_kernel_takes_a_graph_captured_scale():
    """The scale is read on the device (no host sync): a CUDA graph captured once follows a changed scale."""
    _needs_kernel()
    args = operands((256,), 512, 1024, torch.float16, device="cuda")
    assert_graph_follows_scale(lambda s: fp8_linear_fp8out(*args, out_scale=s, activation="relu"),
                               torch.tensor([0.05], device="cuda"))
