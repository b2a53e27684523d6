"""fuseinfer::fp8_linear and fuseinfer::quantize_fp8_per_token: the quantizer's e4m3 grid and scales, the linear's
reference against a float64 computation on the dequantized operands (hypothesis over shapes, odd ones included),
the accuracy of FP8 against the unquantized fp32 linear (SQNR floor), the op registrations (opcheck), bad input;
on a GPU of compute capability >= 8.9 (marked), the torch._scaled_mm path against the reference."""
from __future__ import annotations

import importlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.library import opcheck

from fuseinfer import FuseInferError
from fuseinfer.ops.fp8_linear import (
    FP8_DTYPE,
    FP8_MAX,
    fp8_backend,
    fp8_gemm_note,
    fp8_linear,
    fp8_linear_ref,
    quantize_fp8_per_token,
    quantize_fp8_ref,
)

SQNR_FLOOR_DB = 25.0  # measured ~29 dB on Gaussian x and w (e4m3: 3 mantissa bits on both operands)
# opcheck's schema test compares inputs before / after with torch.allclose, which float8 tensors do not implement:
# the other checks run (the schema's mutates_args=() says what test_schema would)
FP8_OPCHECK = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def sqnr_db(ref, approx) -> float:
    """Signal-to-noise ratio of ``approx`` against ``ref`` in dB (inf where they are equal: the GPU takes the
    reference for shapes ``_scaled_mm`` cannot take)."""
    noise = (ref.double() - approx.double()).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(ref.double().pow(2).sum().item() / noise)


def operands(lead, n, k, dtype=torch.float32, bias=True, residual=False, seed=0, device="cpu"):
    """(x, w, b, r): x (*lead, K) in dtype, w (N, K) fp32, bias (N,), residual (*lead, N)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    r = torch.randn(*lead, n, generator=g).to(dtype) if residual else None
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(x), to(w), to(b), to(r)


def float64_formula(x_q, x_scale, w_q, w_scale, bias, residual, activation):
    """Independent: the dequantized operands in float64, one matmul, the epilogue (fused_linear's order)."""
    x = x_q.double() * x_scale.double()
    w = w_q.double() * w_scale.double().reshape(-1, 1)
    y = x @ w.T
    if bias is not None:
        y = y + bias.double()
    if residual is not None:
        y = y + residual.double()
    return y.clamp_min(0) if activation == "relu" else y


# --------------------------------------------------------------------------------------------------- quantize

def test_quantize_scale_is_amax_over_448_and_values_are_on_the_e4m3_grid():
    x = torch.randn(7, 33) * torch.logspace(-3, 3, 7)[:, None]  # rows over six decades
    q, s = quantize_fp8_ref(x, -1)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32 and s.shape == (7, 1)
    torch.testing.assert_close(s, x.abs().amax(-1, keepdim=True) / FP8_MAX, rtol=0, atol=0)
    assert q.float().abs().amax() == FP8_MAX  # each row's largest magnitude maps to 448 exactly
    # round to nearest: within half an e4m3 step (2^-3 relative below 448; subnormals: 2^-10 absolute)
    deq = q.float() * s
    err = (deq - x).abs()
    assert (err <= x.abs() * 2 ** -4 + s * 2 ** -10 + 1e-12).all()
    assert torch.equal(q.float().to(FP8_DTYPE).float(), q.float())


def test_quantize_zero_rows_and_empty_rows():
    q, s = quantize_fp8_ref(torch.zeros(3, 8), -1)
    assert (q.float() == 0).all() and (s > 0).all()
    q, s = quantize_fp8_ref(torch.zeros(3, 0), -1)
    assert q.shape == (3, 0) and s.shape == (3, 1)


def test_per_token_op_matches_the_reference_and_keeps_the_leading_shape():
    x = torch.randn(2, 5, 24, dtype=torch.float16)
    q, s = quantize_fp8_per_token(x)
    rq, rs = quantize_fp8_ref(x, -1)
    assert q.shape == (2, 5, 24) and s.shape == (2, 5, 1)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    with pytest.raises(FuseInferError, match="floating-point"):
        quantize_fp8_per_token(torch.ones(3, 4, dtype=torch.int8))


def test_quantize_opcheck():
    for x in (torch.randn(4, 16), torch.randn(2, 3, 40, dtype=torch.float16), torch.randn(1, 7, dtype=torch.bfloat16)):
        opcheck(torch.ops.fuseinfer.quantize_fp8_per_token.default, (x,))


# ------------------------------------------------------------------------------------------------------ linear

def quantized(lead, n, k, dtype=torch.float32, bias=True, residual=False, seed=0, device="cpu"):
    x, w, b, r = operands(lead, n, k, dtype, bias, residual, seed, device)
    x_q, x_s = quantize_fp8_ref(x, -1)
    w_q, w_s = quantize_fp8_ref(w, -1)
    return x_q, x_s, w_q, w_s, b, r


@pytest.mark.parametrize("activation,bias,residual", [("none", True, False), ("relu", True, False),
                                                      ("none", True, True), ("none", False, False)])
def test_reference_matches_the_float64_formula(activation, bias, residual):
    args = quantized((37,), 24, 80, bias=bias, residual=residual)
    out = fp8_linear(*args, activation=activation, out_dtype=torch.float32)
    torch.testing.assert_close(out.double(), float64_formula(*args, activation), rtol=1e-5, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(lead=st.lists(st.integers(1, 9), min_size=1, max_size=3), n=st.integers(1, 70), k=st.integers(1, 130),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), bias=st.booleans(),
       residual=st.booleans(), relu=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_reference_over_shapes(lead, n, k, dtype, bias, residual, relu, seed):
    """Any (..., K) x (N, K), odd sizes included: the fp32 sums then one rounding to out_dtype, so the result is
    within half an ulp of out_dtype (plus fp32 summation error) of the float64 formula."""
    args = quantized(tuple(lead), n, k, dtype, bias, residual, seed)
    act = "relu" if relu else "none"
    out = fp8_linear(*args, activation=act, out_dtype=dtype)
    assert out.shape == (*lead, n) and out.dtype == dtype
    ref = float64_formula(*args, act)
    eps = torch.finfo(dtype).eps
    assert ((out.double() - ref).abs() <= ref.abs() * eps + 1e-5 * (1 + ref.abs().amax())).all()


@pytest.mark.parametrize("m,n,k", [(64, 128, 256), (17, 48, 80), (3, 200, 1000)])
def test_sqnr_against_the_unquantized_linear(m, n, k):
    x, w, b, _ = operands((m,), n, k)
    q, s = quantize_fp8_per_token(x)
    w_q, w_s = quantize_fp8_ref(w, -1)
    out = fp8_linear(q, s, w_q, w_s, b, None, "none", torch.float32)
    ref = x.double() @ w.double().T + b.double()
    db = sqnr_db(ref - b.double(), out.double() - b.double())  # (the GEMM's error, the bias is exact)
    print(f"fp8_linear ({m}x{k} @ {k}x{n}) SQNR {db:.1f} dB")
    assert db >= SQNR_FLOOR_DB, db


def test_linear_opcheck():
    for dtype in (torch.float16, torch.float32):
        args = quantized((2, 5), 24, 40, dtype, bias=True, residual=True)
        opcheck(torch.ops.fuseinfer.fp8_linear.default, (*args, "relu", dtype), test_utils=FP8_OPCHECK)
        args = quantized((3,), 7, 9, dtype, bias=False)
        opcheck(torch.ops.fuseinfer.fp8_linear.default, (*args, "none", dtype), test_utils=FP8_OPCHECK)


def test_bad_input_is_one_clear_error():
    x_q, x_s, w_q, w_s, b, _ = quantized((4,), 8, 16, torch.float16)
    with pytest.raises(FuseInferError, match="float8_e4m3fn"):
        fp8_linear(x_q.float(), x_s, w_q, w_s, b, out_dtype=torch.float16)
    with pytest.raises(FuseInferError, match=r"expected x_q \(\.\.\., K\)"):
        fp8_linear(x_q[:, :8], x_s, w_q, w_s, b, out_dtype=torch.float16)
    with pytest.raises(FuseInferError, match="one per token"):
        fp8_linear(x_q, x_s[:2], w_q, w_s, b, out_dtype=torch.float16)
    with pytest.raises(FuseInferError, match="one per output channel"):
        fp8_linear(x_q, x_s, w_q, w_s.double(), b, out_dtype=torch.float16)
    with pytest.raises(FuseInferError, match="bias must be"):
        fp8_linear(x_q, x_s, w_q, w_s, b.float(), out_dtype=torch.float16)
    with pytest.raises(FuseInferError, match="activation must be"):
        fp8_linear(x_q, x_s, w_q, w_s, b, activation="gelu", out_dtype=torch.float16)


def test_backend_on_cpu_is_the_reference():
    assert fp8_backend(torch.device("cpu")) == "reference"
    assert "PyTorch reference" in fp8_gemm_note(torch.device("cpu"))


# --------------------------------------------------------------------------------------------------------- GPU

def _needs_fp8_gpu():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU of compute capability >= 8.9 (FP8 tensor cores)")


@pytest.mark.gpu
@pytest.mark.parametrize("lead,n,k", [((64,), 128, 256), ((2, 37), 256, 512), ((1,), 48, 64), ((5,), 24, 40),
                                      ((300,), 1024, 2048)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("path", ["cutlass", "scaled_mm"])
def test_gpu_paths_match_the_reference(lead, n, k, dtype, path):
    """The CUTLASS sm_90 FP8 GEMM with its fused epilogue (what fp8_linear runs on an H100/H200 build with CUTLASS)
    and torch._scaled_mm (fp32 accumulation, bf16 output, then the epilogue) against the float64 formula: within a
    bf16 rounding of the GEMM output plus the out_dtype rounding. (5, 24, 40): K, N not multiples of 16, the
    reference path."""
    mod = importlib.import_module("fuseinfer.ops.fp8_linear")  # (the package exports the function by that name)

    _needs_fp8_gpu()
    if path == "cutlass":
        assert fp8_backend(torch.device("cuda"), dtype) == "cutlass-sm90", "the sm_90 FP8 GEMM is not built"
        assert "CUTLASS sm_90 e4m3" in fp8_gemm_note(torch.device("cuda"), dtype)
    for act, residual in (("none", True), ("relu", False)):
        args = quantized(lead, n, k, dtype, bias=True, residual=residual, device="cuda")
        if path == "cutlass":
            out = fp8_linear(*args, activation=act, out_dtype=dtype)
            via_op = torch.ops.fuseinfer.fp8_linear(*args, act, dtype)  # the dispatcher's CUDA registration
            assert torch.equal(out, via_op)
        else:
            out = mod._scaled_mm(*args, act, dtype)
        ref = float64_formula(*args, act)
        gemm = float64_formula(*args[:4], None, None, "none").abs()
        # the sum of |products|: the FP8 tensor cores' fast accumulation (the CUTLASS path) keeps fewer bits than
        # fp32, so its error scales with it (bounded by 2^-8 of it: a wrong element is off by O(1) of it)
        x_q, x_scale, w_q, w_scale = args[:4]
        magnitude = float64_formula(x_q.double().abs(), x_scale, w_q.double().abs(), w_scale, None, None, "none")
        tol = (gemm * 2 ** -8 + magnitude * 2 ** -8 + ref.abs() * torch.finfo(dtype).eps + 1e-3).cpu()
        err = (out.double() - ref).abs().cpu()
        assert (err <= tol).all(), (path, err.max().item(), (err / magnitude.cpu()).max().item())
        cpu = fp8_linear_ref(*(None if t is None else t.cpu() for t in args), act, dtype)
        assert sqnr_db(cpu, out.cpu()) >= 40  # the GPU path and the CPU reference agree far beyond fp8's noise
    assert not mod._failed, mod._failed  # torch._scaled_mm ran (it did not fall back after an error)


@pytest.mark.gpu
def test_quantize_on_cuda_matches_the_cpu_reference():
    _needs_fp8_gpu()
    x = torch.randn(9, 96, dtype=torch.float16)
    q, s = quantize_fp8_per_token(x.cuda())
    rq, rs = quantize_fp8_ref(x, -1)
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s.cpu(), rs)


def test_scaled_mm_wiring_and_fallback_on_cpu(monkeypatch):
    """The GPU path's call, run on the CPU with a stand-in for torch._scaled_mm that checks what the row-wise FP8
    GEMM requires (row-major A, column-major B, fp32 scales (M, 1) and (1, N), bf16 output) and computes it; then a
    _scaled_mm that raises: the reference from then on, the note saying why."""
    mod = importlib.import_module("fuseinfer.ops.fp8_linear")
    seen = []

    def fake(a, b, scale_a, scale_b, out_dtype):
        m, k = a.shape
        n = b.shape[1]
        assert a.is_contiguous() and b.stride() == (1, k) and b.shape == (k, n)
        assert scale_a.shape == (m, 1) and scale_b.shape == (1, n) and scale_a.dtype == scale_b.dtype == torch.float32
        assert scale_a.is_contiguous() and scale_b.is_contiguous() and out_dtype == torch.bfloat16
        seen.append((m, n, k))
        return ((a.double() @ b.double()) * scale_a.double() * scale_b.double()).to(out_dtype)

    monkeypatch.setattr(mod, "_scaled_mm_ok", lambda device: True)
    monkeypatch.setattr(mod, "_index", lambda device: 0)
    monkeypatch.setattr(mod, "_failed", {})
    monkeypatch.setattr(torch, "_scaled_mm", fake)
    args = quantized((2, 9), 32, 48, torch.float16, bias=True, residual=True)
    out = mod._fp8_linear_cuda(*args, "relu", torch.float16)
    assert seen == [(18, 32, 48)] and out.shape == (2, 9, 32) and out.dtype == torch.float16
    ref = float64_formula(*args, "relu")
    gemm = float64_formula(*args[:4], None, None, "none").abs()
    assert ((out.double() - ref).abs() <= gemm * 2 ** -8 + ref.abs() * 2 ** -10 + 1e-3).all()
    mod._fp8_linear_cuda(*quantized((3,), 24, 40), "none", torch.float32)  # K, N not multiples of 16: reference
    assert len(seen) == 1

    def broken(*a, **k):
        raise RuntimeError("Only bf16 high precision output types are supported for row-wise scaling.")

    monkeypatch.setattr(torch, "_scaled_mm", broken)
    with pytest.warns(RuntimeWarning, match="run the PyTorch reference"):
        out = mod._fp8_linear_cuda(*args, "none", torch.float16)
    torch.testing.assert_close(out, fp8_linear_ref(*args, "none", torch.float16))
    assert "row-wise scaling" in mod._failed[0]
