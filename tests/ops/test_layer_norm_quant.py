"""fuseinfer::add_layer_norm_quant: the reference against LayerNorm + per-token quantisation written out, opcheck,
hypothesis shapes, the SQNR of the int8 output, bad input; on the GPU, the kernel against the reference."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fuseinfer import FuseInferError
from fuseinfer.ops.layer_norm_quant import add_layer_norm_quant, add_layer_norm_quant_ref


def sqnr_db(ref, approx) -> float:
    return 10 * math.log10(ref.double().pow(2).sum().item() / (ref.double() - approx.double()).pow(2).sum().item())


def formula(x, residual, w, b, eps):
    """LayerNorm and symmetric per-token int8, written out in float64 (y rounded to x's dtype first)."""
    s = (x + residual) if residual is not None else x
    s64 = s.double()
    y = (s64 - s64.mean(-1, keepdim=True)) / torch.sqrt(s64.var(-1, unbiased=False, keepdim=True) + eps)
    if w is not None:
        y = y * w.double() + b.double()
    y = y.to(x.dtype).double()
    scale = (y.abs().amax(-1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.round(y / scale).clamp(-127, 127), scale, s


@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("affine", [True, False])
def test_reference_matches_formula(residual, affine):
    torch.manual_seed(0)
    x, r = torch.randn(3, 7, 96), torch.randn(3, 7, 96)
    w, b = (torch.randn(96), torch.randn(96)) if affine else (None, None)
    q, scale, s = add_layer_norm_quant(x, r if residual else None, w, b, 1e-5, store_sum=True)
    eq, escale, es = formula(x, r if residual else None, w, b, 1e-5)
    assert q.dtype == torch.int8 and scale.shape == (3, 7, 1) and scale.dtype == torch.float32
    torch.testing.assert_close(scale.double(), escale, rtol=1e-5, atol=0)
    assert (q.double() - eq).abs().max() <= 1  # a value at a rounding boundary may land on either side
    torch.testing.assert_close(s, es)
    assert add_layer_norm_quant(x, r, w, b, store_sum=False)[2].numel() == 0


def test_int8_output_sqnr_floor():
    """Dequantized output against the fp32 LayerNorm: SQNR >= 35 dB on Gaussian rows of 1024 (measured ~39 dB)."""
    torch.manual_seed(0)
    x, w, b = torch.randn(64, 1024), torch.randn(1024), torch.randn(1024)
    q, scale, _ = add_layer_norm_quant(x, None, w, b)
    y = torch.nn.functional.layer_norm(x, (1024,), w, b)
    assert sqnr_db(y, q.float() * scale) >= 35.0


def test_all_zero_row_quantizes_to_zero():
    x = torch.zeros(2, 16)
    q, scale, _ = add_layer_norm_quant(x, None, torch.ones(16), torch.zeros(16))
    assert (q == 0).all() and (scale > 0).all()


@settings(max_examples=25, deadline=None)
@given(lead=st.lists(st.integers(1, 4), min_size=0, max_size=2), n=st.integers(1, 300),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), residual=st.booleans(),
       store_sum=st.booleans())
def test_shapes(lead, n, dtype, residual, store_sum):
    torch.manual_seed(n)
    x = torch.randn(*lead, n).to(dtype)
    r = torch.randn(*lead, n).to(dtype) if residual else None
    w, b = torch.randn(n).to(dtype), torch.randn(n).to(dtype)
    q, scale, s = add_layer_norm_quant(x, r, w, b, 1e-5, store_sum)
    assert q.shape == x.shape and scale.shape == (*lead, 1) and q.is_contiguous()
    assert s.shape == (x.shape if store_sum else (0,))
    eq, escale, _ = formula(x, r, w, b, 1e-5)
    assert (q.double() - eq).abs().max() <= 1


OPCHECK_CASES = {
    "residual_sum": lambda: (torch.randn(5, 123), torch.randn(5, 123), torch.randn(123), torch.randn(123), 1e-5,
                             True),
    "no_residual": lambda: (torch.randn(2, 3, 96), None, None, None, 1e-5, True),
    "fp16_no_sum": lambda: (torch.randn(4, 64).half(), torch.randn(4, 64).half(), torch.randn(64).half(),
                            torch.randn(64).half(), 1e-5, False),
    "strided": lambda: (torch.randn(6, 5, 32).transpose(0, 1), None, torch.randn(32), torch.randn(32), 1e-5, True),
}


@pytest.mark.parametrize("case", sorted(OPCHECK_CASES))
def test_opcheck_cpu(case):
    torch.library.opcheck(torch.ops.fuseinfer.add_layer_norm_quant.default, OPCHECK_CASES[case]())


def test_bad_input():
    x = torch.randn(4, 8)
    with pytest.raises(FuseInferError, match="residual must have x's shape and dtype"):
        add_layer_norm_quant(x, torch.randn(4, 7))
    with pytest.raises(FuseInferError, match=r"weight must be \(8,\) in torch.float32"):
        add_layer_norm_quant(x, None, torch.randn(7))
    with pytest.raises(FuseInferError, match=r"bias must be \(8,\) in torch.float32"):
        add_layer_norm_quant(x, None, torch.randn(8), torch.randn(8).half())


# ---------------------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 256), (7, 768), (128, 2048), (33, 4096), (4, 8192), (3, 16384), (5, 100),
                                   (2048, 2048)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("residual", [True, False])
def test_kernel_matches_reference(shape, dtype, residual):
    """The kernel against the reference on the GPU: s exact, scales to fp32 rounding of the same amax, q within one
    step (y's rounding may differ by an ulp from aten's LayerNorm), and >= 99.9% of q equal."""
    torch.manual_seed(shape[1])
    x = torch.randn(*shape, device="cuda").to(dtype)
    r = torch.randn(*shape, device="cuda").to(dtype) if residual else None
    w = (torch.randn(shape[1], device="cuda") * 0.5 + 1).to(dtype)
    b = (torch.randn(shape[1], device="cuda") * 0.1).to(dtype)
    q, scale, s = add_layer_norm_quant(x, r, w, b, 1e-5, True)
    eq, escale, es = add_layer_norm_quant_ref(x, r, w, b, 1e-5, True)
    torch.testing.assert_close(s, es, rtol=0, atol=0)
    torch.testing.assert_close(scale, escale, rtol=2e-3 if dtype != torch.float32 else 1e-5, atol=0)
    diff = (q.int() - eq.int()).abs()
    assert diff.max() <= 1 and (diff == 0).float().mean() >= 0.999


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(OPCHECK_CASES))
def test_opcheck_cuda(case):
    args = tuple(t.cuda() if isinstance(t, torch.Tensor) else t for t in OPCHECK_CASES[case]())
    torch.library.opcheck(torch.ops.fuseinfer.add_layer_norm_quant.default, args)
