"""The int8 ops on CPU: references against formulas, opcheck of every registration, hypothesis odd shapes, SQNR
floor of the quantize / dequantize round trip, bad input. The CUDA kernels: test_int8_gpu.py."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fuseinfer import FuseInferError, ops
from fuseinfer.ops.w8a16_linear import dequantize_weight_ref, w8a16_linear_ref


def sqnr_db(ref, approx) -> float:
    return 10 * math.log10(ref.double().pow(2).sum().item() / (ref.double() - approx.double()).pow(2).sum().item())


def qweight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), torch.rand(n, generator=g) * 0.02 + 1e-3


@pytest.mark.parametrize("activation,residual", [("none", False), ("relu", False), ("none", True)])
def test_int8_linear_ref_matches_formula(activation, residual):
    q, s = qweight(37, 48)
    x, b = torch.randn(3, 5, 48, dtype=torch.float64), torch.randn(37, dtype=torch.float64)
    r = torch.randn(3, 5, 37, dtype=torch.float64) if residual else None
    expected = x @ (q.float() * s[:, None]).double().T + b + (r if residual else 0)  # (dequantized in fp32)
    expected = expected.clamp_min(0) if activation == "relu" else expected
    torch.testing.assert_close(ops.w8a16_linear(x, q, s, b, r, activation), expected)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(0, 20), n=st.integers(1, 70), k=st.integers(1, 90), bias=st.booleans(),
       form=st.sampled_from(["none", "relu", "residual"]), seed=st.integers(0, 2**16))
def test_int8_linear_odd_shapes_match_the_dequantized_linear(m, n, k, bias, form, seed):
    q, s = qweight(n, k, seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    r = torch.randn(m, n, generator=g) if form == "residual" else None
    act = "relu" if form == "relu" else "none"
    y = ops.w8a16_linear(x, q, s, b, r, act)
    w = q.float() * s[:, None]
    expected = torch.nn.functional.linear(x, w, b) + (0 if r is None else r)
    torch.testing.assert_close(y, expected.relu() if act == "relu" else expected)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 9), k=st.integers(1, 300), scale=st.floats(1e-3, 1e3), seed=st.integers(0, 2**16))
def test_quantize_per_channel_round_trip(rows, k, scale, seed):
    w = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * scale
    q, s = ops.quantize_per_channel(w)
    assert q.dtype == torch.int8 and s.shape == (rows, 1) and s.dtype == torch.float32
    assert q.abs().max() <= 127 and (q.abs().amax(1) == 127).all()  # the row maximum maps to +-127
    err = (ops.dequantize(q, s, torch.float32) - w).abs()
    assert (err <= s / 2 * (1 + 1e-5)).all()  # round to nearest: at most half a step
    torch.testing.assert_close(dequantize_weight_ref(q, s.reshape(-1), torch.float32), ops.dequantize(q, s, torch.float32))


def test_rounding_is_half_to_even():
    w = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5]])  # scale 1: halves round to even
    q, s = ops.quantize_per_channel(w)
    assert s.item() == 1.0 and q.tolist() == [[127, 0, 2, 2, 0, -2]]


def test_sqnr_floor_of_weight_quantization():
    w = torch.randn(256, 1024) * 0.02
    q, s = ops.quantize_per_channel(w)
    assert sqnr_db(w, ops.dequantize(q, s, torch.float32)) > 38  # ~ 6.02 * 8 - 10 dB for Gaussian rows


def test_int8_linear_rejects_bad_input():
    q, s = qweight(6, 8)
    x = torch.randn(4, 8)
    with pytest.raises(FuseInferError, match="an int8 weight"):
        ops.w8a16_linear(x, q.float(), s)
    with pytest.raises(FuseInferError, match=r"scale must be \(6,\) float32"):
        ops.w8a16_linear(x, q, s.half())
    with pytest.raises(FuseInferError, match=r"bias must be \(6,\) in x's dtype"):
        ops.w8a16_linear(x, q, s, torch.randn(6).half())
    with pytest.raises(FuseInferError, match="cannot be fused"):
        ops.w8a16_linear(x, q, s, residual=torch.randn(4, 6), activation="relu")
    with pytest.raises(FuseInferError, match="must be floating point"):
        ops.w8a16_linear(x.long(), q, s)


def _opcheck_cases():
    q, s = qweight(12, 32)
    x = torch.randn(3, 32, requires_grad=True)
    b = torch.randn(12, requires_grad=True)
    r = torch.randn(3, 12, requires_grad=True)
    return {
        "int8_linear_bias": (torch.ops.fuseinfer.w8a16_linear.default, (x, q, s, b, None, "none")),
        "int8_linear_relu": (torch.ops.fuseinfer.w8a16_linear.default, (x, q, s, b, None, "relu")),
        "int8_linear_residual": (torch.ops.fuseinfer.w8a16_linear.default, (x, q, s, None, r, "none")),
        "quantize_int8": (torch.ops.fuseinfer.quantize_int8.default, (torch.randn(5, 24), -1)),
        "dequantize_int8": (torch.ops.fuseinfer.dequantize_int8.default,
                            (q, s.reshape(-1, 1).requires_grad_(), torch.float32)),
    }


@pytest.mark.parametrize("case", sorted(_opcheck_cases()))
def test_opcheck_cpu(case):
    op, args = _opcheck_cases()[case]
    torch.library.opcheck(op, args)


def test_int8_linear_gradients_are_the_dequantized_linear_gradients():
    q, s = qweight(10, 16)
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    b = torch.randn(10, dtype=torch.float64, requires_grad=True)
    torch.ops.fuseinfer.w8a16_linear(x, q, s, b, None, "relu").sum().backward()
    x2, b2 = x.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    w8a16_linear_ref(x2, q, s, b2, None, "relu").sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(b.grad, b2.grad)
