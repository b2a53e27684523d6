"""fuseinfer::fp8_weight_linear (fuseinfer/ops/fp8_gemv.py), the e4m3 weight GEMV FP8 models run at decode: the
reference against a float64 computation on the dequantized weight (hypothesis over shapes), the op registration
(opcheck), bad input; on the GPU (marked) the kernel against the fp32 reference within twice PyTorch's own
low-precision error, odd shapes and every row count up to 16, and an FP8 model's decode-sized linear taking it."""
from __future__ import annotations

import pytest
import torch
from helpers import LOWP, assert_lowp_close, examples, given, lowp_atol, require_kernel, st
from torch.library import opcheck

from fuseinfer import FuseInferError
from fuseinfer.ops.fp8_gemv import fp8_weight_linear, fp8_weight_linear_ref
from fuseinfer.ops.fp8_linear import FP8_DTYPE, quantize_fp8_ref

# opcheck's schema test compares inputs with torch.allclose, which float8 tensors do not implement
FP8_OPCHECK = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def operands(m, n, k, dtype, bias=True, residual=False, seed=0, device="cpu"):
    """x (M, K) in dtype, e4m3 weight (N, K) with fp32 (N,) scales, bias (N,), residual (M, N)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w_q, w_s = quantize_fp8_ref(torch.randn(n, k, generator=g) * 0.05, -1)  # (N, K) e4m3, (N, 1) fp32
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    r = torch.randn(m, n, generator=g).to(dtype) if residual else None
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(x), to(w_q), to(w_s.view(-1)), to(b), to(r)


def float64_formula(x, w_q, scale, bias, residual, activation):
    y = x.double() @ (w_q.double() * scale.double()[:, None]).T
    y = y + (0 if bias is None else bias.double()) + (0 if residual is None else residual.double())
    return torch.relu(y) if activation == "relu" else y


@given(m=st.integers(1, 20), n=st.integers(1, 40), k=st.integers(1, 48), relu=st.booleans(),
       bias=st.booleans(), residual=st.booleans(), seed=st.integers(0, 99))
@examples("cpu", cpu=25, cuda=0)
def test_reference_matches_the_float64_formula(m, n, k, relu, bias, residual, seed):
    act = "relu" if relu and not residual else "none"
    x, w_q, s, b, r = operands(m, n, k, torch.float32, bias, residual, seed)
    out = fp8_weight_linear(x, w_q, s, b, r, act)  # the CPU runs the reference
    torch.testing.assert_close(out.double(), float64_formula(x, w_q, s, b, r, act), rtol=1e-5, atol=1e-5)
    assert out.shape == (m, n) and out.dtype == x.dtype


def test_weights_are_exact_in_fp16_and_bf16():
    """Every e4m3 value is an fp16 and a bf16 value (the kernel's in-register conversion is exact)."""
    every = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE)
    finite = every.float().isfinite()
    for dtype in LOWP:
        assert torch.equal(every.float()[finite], every.to(dtype).float()[finite])


def test_opcheck_cpu():
    x, w_q, s, b, r = operands(3, 24, 32, torch.float32, bias=True, residual=True)
    opcheck(torch.ops.fuseinfer.fp8_weight_linear.default, (x, w_q, s, b, r, "none"), test_utils=FP8_OPCHECK)
    opcheck(torch.ops.fuseinfer.fp8_weight_linear.default, (x, w_q, s, None, None, "relu"), test_utils=FP8_OPCHECK)


@pytest.mark.parametrize("change,words", [
    (dict(w_q="int8"), "float8_e4m3fn weight"),
    (dict(s="(N,1)"), "scale must be (24,) float32"),
    (dict(b="half"), "bias must be (24,) in x's dtype"),
    (dict(act="gelu"), "activation must be one of"),
    (dict(relu_residual=True), "an activation and a residual"),
    (dict(k=31), "expected x (..., K)"),
])
def test_bad_input_is_one_clear_error(change, words):
    x, w_q, s, b, r = operands(3, 24, 32, torch.float32, bias=True, residual=True)
    act = change.get("act", "none")
    if "w_q" in change:
        w_q = w_q.float().to(torch.int8)
    if "s" in change:
        s = s[:, None]
    if "b" in change:
        b = b.half()
    if "k" in change:
        x = x[:, :31]
    if change.get("relu_residual"):
        act = "relu"
    with pytest.raises(FuseInferError, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        fp8_weight_linear(x, w_q, s, b, r if act == "none" or change.get("relu_residual") else None, act)


# ---- GPU ----

GPU_SHAPES = [(1, 2048, 2048), (1, 6144, 2048), (1, 2048, 8192), (3, 136, 96), (8, 50, 64), (9, 1000, 160),
              (16, 33, 4096), (5, 7, 16)]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", GPU_SHAPES)
@pytest.mark.parametrize("dtype", LOWP)
def test_kernel_within_twice_pytorchs_error(m, n, k, dtype):
    """The GEMV against the fp32 reference (the same e4m3 weights): within twice the error of PyTorch's own
    low-precision computation (the reference in the model dtype), with bias + residual and with ReLU."""
    require_kernel()
    from fuseinfer.core.extension import extension

    for act, residual in (("none", True), ("relu", False)):
        x, w_q, s, b, r = operands(m, n, k, dtype, bias=True, residual=residual, seed=m + n, device="cuda")
        ours = extension().fp8_weight_linear(x, w_q, s, b, r, act)  # the kernel itself, not a fallback
        assert torch.equal(ours, fp8_weight_linear(x, w_q, s, b, r, act))
        ref = float64_formula(x, w_q, s, b, r, act).float()
        lowp = fp8_weight_linear_ref(x, w_q, s, b, r, act)
        assert_lowp_close(ours, lowp, ref, f"{m}x{n}x{k} {act}", atol=lowp_atol(ref, dtype))


@pytest.mark.gpu
def test_opcheck_cuda():
    require_kernel()
    x, w_q, s, b, r = operands(4, 48, 64, torch.float16, bias=True, residual=True, device="cuda")
    opcheck(torch.ops.fuseinfer.fp8_weight_linear.default, (x, w_q, s, b, r, "none"), test_utils=FP8_OPCHECK)


@pytest.mark.gpu
def test_inputs_the_kernel_does_not_take_run_the_reference():
    """17 rows (past the GEMV), K not a multiple of 16, fp32: the reference, the same values as on the CPU."""
    for m, k, dtype in ((17, 64, torch.float16), (2, 40, torch.float16), (2, 64, torch.float32)):
        x, w_q, s, b, _ = operands(m, 24, k, dtype, device="cuda")
        out = fp8_weight_linear(x, w_q, s, b)
        cpu = fp8_weight_linear_ref(*(t.cpu() for t in (x, w_q, s, b)), None, "none")
        torch.testing.assert_close(out.cpu(), cpu, rtol=2e-3, atol=2e-3)
