"""fuseinfer::w8a8_linear_int8out (a W8A8 linear whose epilogue writes int8 with a static per-tensor scale): the
reference against an independent integer formula in float64 (hypothesis over shapes, odd ones included), saturation
at +-127, the op registration (opcheck), bad input, the CUDA registration's fallback (w8a8_linear in the bias'
dtype, then quantize_int8_static) run on the CPU; on an sm_90 GPU (marked), the CUTLASS int8-output kernel against
the reference (the int32 products are exact, so nearly every value equal, none more than one step off), at each tile
configuration's M, saturation, the fallback for N % 16 != 0, and a graph-captured scale."""
from __future__ import annotations

import importlib

import pytest
import torch
from helpers import assert_graph_follows_scale, assert_rejects_each, scaled_linear_operands
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.library import opcheck

from fuseinfer.ops.linear_8bit_out import w8a8_linear_int8out, w8a8_linear_int8out_ref
from fuseinfer.ops.quant import quantize_int8_ref, quantize_int8_static


def operands(lead, n, k, bias_dtype=torch.float16, seed=0, device="cpu"):
    """(x_q, x_scale, w_q, w_scale, bias): per-token int8 x (*lead, K), per-channel int8 w (N, K), bias (N,)."""
    return scaled_linear_operands(quantize_int8_ref, lead, n, k, bias_dtype, seed, device)


def float64_y(x_q, x_scale, w_q, w_scale, bias, activation):
    """Independent: the exact integer products in float64, the scales, bias, activation (before the quantization)."""
    acc = x_q.double() @ w_q.double().T  # exact: |products| sum < 2^53
    y = acc * w_scale.double().reshape(-1) * x_scale.double()
    if bias is not None:
        y = y + bias.double()
    return y.clamp_min(0) if activation == "relu" else y


def static_scale(y: torch.Tensor, headroom: float = 1.0) -> torch.Tensor:
    """A static scale for y: amax / 127 times ``headroom`` (< 1: the largest values saturate)."""
    return (y.abs().amax().float() / 127 * headroom).clamp_min(1e-12).reshape(1)


def near(out: torch.Tensor, v: torch.Tensor, slack: float) -> torch.Tensor:
    """out (int8) within ``slack`` of the exact v (float64) rounded and clamped: per element."""
    return (out.double() - v.clamp(-127, 127)).abs() <= 0.5 + slack


# ------------------------------------------------------------------------------------------------------- CPU

def test_quantize_static_rounds_half_to_even_and_saturates():
    s = torch.tensor([0.5])
    x = torch.tensor([0.0, 0.25, 0.75, -1.0, 63.25, 1e6, -1e6, 0.2])  # 0.25 / 0.5 = 0.5: to even 0; 1.5: to 2
    assert quantize_int8_static(x, s).tolist() == [0, 0, 2, -2, 126, 127, -127, 0]


@pytest.mark.parametrize("activation", ["none", "relu"])
@pytest.mark.parametrize("bias_dtype", [torch.float16, torch.bfloat16, torch.float32, None])
def test_reference_is_the_static_quantization_of_the_integer_formula(activation, bias_dtype):
    args = operands((37,), 48, 80, bias_dtype)
    y = float64_y(*args, activation)
    s = static_scale(y)
    out = w8a8_linear_int8out(*args, out_scale=s, activation=activation)
    assert out.dtype == torch.int8 and out.shape == (37, 48)
    # fp32 epilogue against float64: equal but at near-ties
    assert near(out, y / s.double(), 1e-4).all()
    assert (out.double() - torch.round(y / s.double()).clamp(-127, 127)).abs().le(1).all()
    if activation == "relu":
        assert (out >= 0).all()


@settings(max_examples=40, deadline=None)
@given(lead=st.lists(st.integers(1, 9), min_size=1, max_size=3), n=st.integers(1, 70), k=st.integers(1, 130),
       bias_dtype=st.sampled_from([torch.float16, torch.bfloat16, None]), relu=st.booleans(),
       headroom=st.sampled_from([1.0, 0.25]), seed=st.integers(0, 2 ** 16))
def test_reference_over_shapes(lead, n, k, bias_dtype, relu, headroom, seed):
    """Any (..., K) x (N, K), odd sizes included, a scale that saturates the top values too (headroom 0.25): the
    exact value rounded half to even and clamped to +-127, but at near-ties (fp32 epilogue)."""
    act = "relu" if relu else "none"
    args = operands(tuple(lead), n, k, bias_dtype, seed)
    y = float64_y(*args, act)
    s = static_scale(y, headroom)
    out = w8a8_linear_int8out(*args, out_scale=s, activation=act)
    assert out.shape == (*lead, n) and out.dtype == torch.int8
    assert near(out, y / s.double(), 1e-4 * (1 + (y / s.double()).abs().max().item())).all()
    assert out.abs().max() <= 127


def test_opcheck():
    for bias_dtype, act in ((torch.float16, "relu"), (None, "none"), (torch.bfloat16, "none")):
        args = operands((2, 5), 32, 48, bias_dtype)
        opcheck(torch.ops.fuseinfer.w8a8_linear_int8out.default, (*args, torch.tensor([0.01]), act))
    args = operands((3,), 7, 9)  # odd sizes
    opcheck(torch.ops.fuseinfer.w8a8_linear_int8out.default, (*args, torch.tensor([0.02]), "relu"))


def test_bad_input_is_one_clear_error():
    args = (*operands((4,), 16, 32), torch.tensor([0.1]), "none")
    x_q, x_s, w_q, w_s, b, s, _ = args
    assert_rejects_each(w8a8_linear_int8out, args, [(5, torch.tensor([0.1, 0.2])), (5, s.double()), (5, None)],
                        "out_scale must be one fp32 value")
    assert_rejects_each(w8a8_linear_int8out, args, [(0, x_q.float()), (2, w_q.float())], "int8")
    assert_rejects_each(w8a8_linear_int8out, args, [(6, "gelu")], "activation must be")
    assert_rejects_each(w8a8_linear_int8out, args, [(1, x_s[:2])], "one per token")


@pytest.mark.parametrize("bias_dtype", [torch.float16, torch.bfloat16, None])
def test_cuda_registration_fallback_on_cpu(bias_dtype):
    """The CUDA registration where the kernel does not serve (run here on the CPU, where w8a8_linear is the
    reference): w8a8_linear in the bias' dtype (fp16 without one), then the static quantization: within one step of
    the reference (the extra rounding to that dtype may move a value across a rounding boundary)."""
    mod = importlib.import_module("fuseinfer.ops.linear_8bit_out")
    args = operands((2, 9), 48, 64, bias_dtype)
    s = static_scale(float64_y(*args, "relu"), 0.5)
    out = mod._w8a8_linear_int8out_cuda(*args, s, "relu")
    ref = w8a8_linear_int8out_ref(*args, s, "relu")
    assert out.shape == ref.shape == (2, 9, 48) and out.dtype == torch.int8
    assert (out.int() - ref.int()).abs().max() <= 1
    assert not mod.kernel_serves(args[0], args[2], args[4])  # (no kernel on the CPU)


# ------------------------------------------------------------------------------------------------------- GPU

def _needs_kernel():
    from fuseinfer.ops.w8a8_linear import w8a8_backend

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if w8a8_backend(torch.device("cuda"), torch.float16) != "cutlass-sm90":
        pytest.skip("the sm_90 W8A8 GEMM is not built for this GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("lead,n,k", [((64,), 128, 256), ((2, 37), 256, 512), ((1,), 48, 64), ((300,), 1024, 2048),
                                      ((2040,), 8192, 2048), ((700,), 528, 256), ((5,), 24, 40), ((7,), 40, 32)])
@pytest.mark.parametrize("bias_dtype", [torch.float16, torch.bfloat16, None])
@pytest.mark.parametrize("headroom", [1.0, 0.25])
def test_gpu_kernel_matches_the_reference(lead, n, k, bias_dtype, headroom):
    """The CUTLASS int8-output GEMM (K % 16 and N % 16; M 1, 64, 700, 2040: the small, medium and large tile
    configurations' ranges) against the exact value: the int32 accumulation is exact and the epilogue fp32, so nearly
    every value equals the CPU reference and none is more than one step off; saturated values at exactly +-127; ReLU
    before the quantization. (5, 24, 40) and (7, 40, 32): N not a multiple of 16, the fallback, whose rounding to
    the bias' dtype (fp16 without one) first may move a value one step."""
    mod = importlib.import_module("fuseinfer.ops.linear_8bit_out")
    _needs_kernel()
    args = operands(lead, n, k, bias_dtype, device="cuda")
    served = mod.kernel_serves(args[0], args[2], args[4])
    assert served == (k % 16 == 0 and n % 16 == 0)
    for act in ("relu", "none"):
        y = float64_y(*args, act)
        s = static_scale(y, headroom)
        out = w8a8_linear_int8out(*args, out_scale=s, activation=act)
        via_op = torch.ops.fuseinfer.w8a8_linear_int8out(*args, s, act)  # the dispatcher's CUDA registration
        assert torch.equal(out, via_op)
        assert out.dtype == torch.int8 and out.shape == (*lead, n)
        v = y / s.double()
        assert near(out, v, 1e-4 * (1 + v.abs().max().item()) if served else 1.0).all(), act
        if act == "relu":
            assert (out >= 0).all()
        assert out.abs().max() <= 127
        if headroom < 1:
            assert out.abs().max() == 127
        cpu = w8a8_linear_int8out_ref(*(None if t is None else t.cpu() for t in args), s.cpu(), act)
        assert (out.cpu().int() - cpu.int()).abs().max() <= 1
        assert (out.cpu() == cpu).float().mean() > (0.99 if served else 0.9)


@pytest.mark.gpu
def test_gpu_kernel_takes_a_graph_captured_scale():
    """The scale is read on the device (no host sync): a CUDA graph captured once follows a changed scale."""
    _needs_kernel()
    args = operands((256,), 512, 1024, torch.float16, device="cuda")
    assert_graph_follows_scale(lambda s: w8a8_linear_int8out(*args, out_scale=s, activation="relu"),
                               torch.tensor([0.05], device="cuda"))
