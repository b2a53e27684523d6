"""fuseinfer::add_layer_norm_quant (int8) and fuseinfer::add_layer_norm_quant_fp8 (e4m3): the references against
LayerNorm + per-token quantisation written out, opcheck, hypothesis shapes, the SQNR of the int8 output, bad input; on
the GPU, the kernels against the references, and bit for bit against the per-token quantize references applied to
the add_layer_norm kernel's y (the fused kernel's fast division and rounding change no bit)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fuseinfer import FuseInferError
from fuseinfer.ops.fp8_linear import FP8_DTYPE, FP8_MAX, quantize_fp8_ref
from fuseinfer.ops.layer_norm import add_layer_norm
from fuseinfer.ops.layer_norm_quant import (add_layer_norm_quant, add_layer_norm_quant_fp8,
                                            add_layer_norm_quant_fp8_ref, add_layer_norm_quant_ref)
from fuseinfer.ops.quant import quantize_int8_ref


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


def formula_fp8(x, residual, w, b, eps):
    """LayerNorm in float64 (y rounded to x's dtype), then per-token e4m3: (y / scale in float64, scale)."""
    s = (x + residual) if residual is not None else x
    s64 = s.double()
    y = (s64 - s64.mean(-1, keepdim=True)) / torch.sqrt(s64.var(-1, unbiased=False, keepdim=True) + eps)
    if w is not None:
        y = y * w.double() + b.double()
    y = y.to(x.dtype).double()
    scale = (y.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return y / scale, scale


def e4m3_step(v):
    """The e4m3 grid spacing at |v| (3 mantissa bits, subnormal step 2^-9). The exponent from frexp, exactly: CUDA's
    float64 log2 of an exact power of two may come out just below the integer (log2(64) = 5.999...), which halved the
    step there and failed a q that was one step off at 64 or 8."""
    _, exponent = torch.frexp(v.abs().clamp_min(2.0 ** -6))  # |v| = m 2^e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(v), exponent - 4)


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


# ----------------------------------------------------------------------------------------------------------- e4m3

@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fp8_reference_matches_formula(residual, dtype):
    """e4m3 values within half a grid step of y / scale (one step where y's rounding differs), |q| <= 448 and the
    row's largest |y| on 448; the scale is amax / 448."""
    torch.manual_seed(1)
    x, r = torch.randn(4, 5, 160).to(dtype), torch.randn(4, 5, 160).to(dtype)
    w, b = torch.randn(160).to(dtype), torch.randn(160).to(dtype)
    q, scale, s = add_layer_norm_quant_fp8(x, r if residual else None, w, b, 1e-5, store_sum=True)
    ev, escale = formula_fp8(x, r if residual else None, w, b, 1e-5)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape and scale.shape == (4, 5, 1) and scale.dtype == torch.float32
    torch.testing.assert_close(scale.double(), escale, rtol=1e-5, atol=0)
    err = (q.double() - ev).abs() / e4m3_step(ev)
    assert err.max() <= 1 and (err <= 0.5 + 1e-6).float().mean() >= 0.99
    assert q.float().abs().max() <= FP8_MAX and (q.float().abs().amax(-1) == FP8_MAX).all()
    torch.testing.assert_close(s, x + r if residual else x)


def test_fp8_reference_is_layer_norm_then_quantize_fp8_ref():
    """The fused reference is exactly add_layer_norm then the FP8 linear's per-token quantize (same y, same bits)."""
    torch.manual_seed(2)
    x, r, w, b = torch.randn(6, 96).half(), torch.randn(6, 96).half(), torch.randn(96).half(), torch.randn(96).half()
    q, scale, _ = add_layer_norm_quant_fp8(x, r, w, b)
    eq, escale = quantize_fp8_ref(add_layer_norm(x, r, w, b)[0], -1)
    assert torch.equal(q.view(torch.uint8), eq.view(torch.uint8)) and torch.equal(scale, escale)


def test_fp8_all_zero_row_and_saturation():
    q, scale, _ = add_layer_norm_quant_fp8(torch.zeros(2, 16), None, torch.ones(16), torch.zeros(16))
    assert (q.float() == 0).all() and (scale > 0).all()
    # one large value per row: it lands on +-448 and never past it (no NaN from an e4m3 overflow)
    x = torch.randn(3, 64)
    x[:, 5] = 1e4
    q, _, _ = add_layer_norm_quant_fp8(x)
    assert not q.float().isnan().any() and (q.float()[:, 5] == FP8_MAX).all()


@settings(max_examples=25, deadline=None)
@given(lead=st.lists(st.integers(1, 4), min_size=0, max_size=2), n=st.integers(1, 300),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), residual=st.booleans(),
       store_sum=st.booleans(), affine=st.booleans())
def test_fp8_shapes(lead, n, dtype, residual, store_sum, affine):
    torch.manual_seed(n)
    x = torch.randn(*lead, n).to(dtype)
    r = torch.randn(*lead, n).to(dtype) if residual else None
    w, b = (torch.randn(n).to(dtype), torch.randn(n).to(dtype)) if affine else (None, None)
    q, scale, s = add_layer_norm_quant_fp8(x, r, w, b, 1e-5, store_sum)
    assert q.shape == x.shape and q.dtype == FP8_DTYPE and scale.shape == (*lead, 1) and q.is_contiguous()
    assert s.shape == (x.shape if store_sum else (0,))
    if n == 1 and not affine:  # y = s - mean is only rounding noise, which the scale blows up to +-448
        assert (q.float().abs() <= FP8_MAX).all()
        return
    ev, _ = formula_fp8(x, r, w, b, 1e-5)
    assert ((q.double() - ev).abs() <= e4m3_step(ev) + 1e-12).all()


FP8_OPCHECK_CASES = {
    "residual_sum": lambda: (torch.randn(5, 123), torch.randn(5, 123), torch.randn(123), torch.randn(123), 1e-5,
                             True),
    "no_residual": lambda: (torch.randn(2, 3, 96), None, None, None, 1e-5, True),
    "bf16_no_sum": lambda: (torch.randn(4, 64).bfloat16(), torch.randn(4, 64).bfloat16(),
                            torch.randn(64).bfloat16(), torch.randn(64).bfloat16(), 1e-5, False),
}


# ------------------------------------------------------------------------------------------------- both outputs

@pytest.mark.parametrize("op, case", [("add_layer_norm_quant", c) for c in sorted(OPCHECK_CASES)]
                         + [("add_layer_norm_quant_fp8", c) for c in sorted(FP8_OPCHECK_CASES)])
def test_opcheck_cpu(op, case):
    cases = OPCHECK_CASES if op == "add_layer_norm_quant" else FP8_OPCHECK_CASES
    torch.library.opcheck(getattr(torch.ops.fuseinfer, op).default, cases[case]())


@pytest.mark.parametrize("op", [add_layer_norm_quant, add_layer_norm_quant_fp8])
def test_bad_input(op):
    x, name = torch.randn(4, 8), op.__name__
    with pytest.raises(FuseInferError, match=f"{name}: residual must have x's shape and dtype"):
        op(x, torch.randn(4, 7))
    with pytest.raises(FuseInferError, match=rf"{name}: weight must be \(8,\) in torch.float32"):
        op(x, None, torch.randn(7))
    with pytest.raises(FuseInferError, match=rf"{name}: bias must be \(8,\) in torch.float32"):
        op(x, None, torch.randn(8), torch.randn(8).half())


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


# The kernels' quantisation against the references applied to the add_layer_norm kernel's y: exact (same y, then the
# same IEEE division and rounding; the fused kernel divides with a hoisted reciprocal and rounds with an fp32 add).
# Rows of more than 4224 (132 SMs x 32 blocks) where a row takes a block: both ops then take the default layout
# (with fewer rows each may spread a row over more threads, as its own occupancy allows, which reorders the sums).
EXACT_SHAPES = [(1, 256), (7, 768), (5, 100), (4608, 2048), (4608, 4096), (4608, 8192), (4608, 4100), (4608, 16384)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", EXACT_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["int8", "e4m3"])
def test_kernel_bits_equal_quantize_ref_of_add_layer_norm(shape, dtype, fmt):
    torch.manual_seed(shape[0] + shape[1])
    x = (torch.randn(*shape, device="cuda") * 3).to(dtype)
    r = torch.randn(*shape, device="cuda").to(dtype)
    w = (torch.randn(shape[1], device="cuda") * 0.5 + 1).to(dtype)
    b = (torch.randn(shape[1], device="cuda") * 0.1).to(dtype)
    y = add_layer_norm(x, r, w, b, 1e-5)[0]
    if fmt == "int8":
        q, scale, s = add_layer_norm_quant(x, r, w, b, 1e-5, True)
        eq, escale = quantize_int8_ref(y, -1)
    else:
        q, scale, s = add_layer_norm_quant_fp8(x, r, w, b, 1e-5, True)
        eq, escale = quantize_fp8_ref(y, -1)
    assert torch.equal(s, x + r)
    assert torch.equal(scale, escale)
    assert torch.equal(q.view(torch.uint8), eq.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["int8", "e4m3"])
def test_kernel_division_is_exact_over_many_scales(dtype, fmt):
    """weight 0 makes y = bias (zeros take the sign of s - mean, far from 0 for rows of +-1), so each call quantises
    a chosen row: random values over many magnitudes (every scale the fast division sees, and the tiny and huge ones
    it leaves to the exact division), near-ties of the int8 rounding, signed zeros; bits compared with the
    references applied to add_layer_norm's y."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    n = 4096
    x = (torch.randint(0, 2, (4, n), device="cuda", generator=gen) * 2 - 1).to(dtype)  # s - mean = +-1 - mean
    w = torch.zeros(n, device="cuda", dtype=dtype)
    exps = [-30, -12, -3, 0, 1, 5, 9, 15] + ([-70, -100, 40, 80] if dtype != torch.float16 else [])
    quant, ref = (add_layer_norm_quant, quantize_int8_ref) if fmt == "int8" else (add_layer_norm_quant_fp8,
                                                                                   quantize_fp8_ref)
    checked = 0
    for e in exps:
        for kind in range(3):
            v = torch.randn(n, device="cuda", generator=gen) * 2.0 ** e
            if kind == 1:  # halves of the int8 grid: (k + 0.5) * amax / 127
                v = (torch.randint(-127, 127, (n,), device="cuda", generator=gen) + 0.5) * 2.0 ** e / 127
                v[0] = 2.0 ** e
            elif kind == 2:  # few distinct magnitudes, zeros of both signs
                v = torch.randint(-3, 4, (n,), device="cuda", generator=gen).float() * 2.0 ** e
                v[1::7] = -0.0
            bias = v.to(dtype)
            if not bias.isfinite().all():
                continue
            y = add_layer_norm(x, None, w, bias)[0]
            assert torch.equal(y[:, bias != 0], bias[bias != 0].expand(4, -1))
            q, scale, _ = quant(x, None, w, bias)
            eq, escale = ref(y, -1)
            assert torch.equal(scale, escale), (e, kind)
            assert torch.equal(q.view(torch.uint8), eq.view(torch.uint8)), (e, kind)
            checked += 1
    assert checked >= 20


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 256), (7, 768), (33, 4096), (5, 100), (2048, 2048)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("residual", [True, False])
def test_fp8_kernel_matches_reference(shape, dtype, residual):
    """The e4m3 kernel against the reference: s exact, scales to fp32 rounding, q within one e4m3 step (y's
    rounding may differ by an ulp from aten's LayerNorm), and >= 99% of q equal (a row whose largest |y| differs
    by an ulp has every value scaled 1e-3 apart, which moves ~1% of its values across an e4m3 rounding boundary;
    test_kernel_bits_equal_quantize_ref_of_add_layer_norm holds the kernel to the bit against the same y)."""
    torch.manual_seed(shape[1])
    x = torch.randn(*shape, device="cuda").to(dtype)
    r = torch.randn(*shape, device="cuda").to(dtype) if residual else None
    w = (torch.randn(shape[1], device="cuda") * 0.5 + 1).to(dtype)
    b = (torch.randn(shape[1], device="cuda") * 0.1).to(dtype)
    q, scale, s = add_layer_norm_quant_fp8(x, r, w, b, 1e-5, True)
    eq, escale, es = add_layer_norm_quant_fp8_ref(x, r, w, b, 1e-5, True)
    assert q.dtype == FP8_DTYPE
    torch.testing.assert_close(s, es, rtol=0, atol=0)
    torch.testing.assert_close(scale, escale, rtol=2e-3 if dtype != torch.float32 else 1e-5, atol=0)
    diff = (q.double() - eq.double()).abs()
    assert (diff <= e4m3_step(eq.double()) + 1e-12).all() and (diff == 0).double().mean() >= 0.99


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(FP8_OPCHECK_CASES))
def test_fp8_opcheck_cuda(case):
    args = tuple(t.cuda() if isinstance(t, torch.Tensor) else t for t in FP8_OPCHECK_CASES[case]())
    torch.library.opcheck(torch.ops.fuseinfer.add_layer_norm_quant_fp8.default, args)
