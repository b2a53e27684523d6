"""The gated MLP's gate/up linear with ``silu_mul`` as its activation (linear_epilogue and w8a16_linear with
activation "silu_mul"): the reference against the formula, bad input, gradients, the registration (opcheck), property
tests against the reference and against the unfused pair (linear, then silu_mul) on every device, and on CUDA the
decode GEMV's epilogue (one kernel, bit-identical to the pair) and FUSEINFER_GEMV_EPILOGUES=0 (the pair), and the
sm_90 prefill GEMM with SiLU(gate) * up in its epilogue (opt-in, FUSEINFER_SILU_GEMM=1: one kernel, within the rule;
by default the pair)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import (DEVICES, LOWP, assert_lowp_close, cuda_kernel_names, examples, given, lowp_atol, needs_sm90,
                     paths_taken, ref_dtype, st, up)

from fuseinfer import FuseInferError, ops


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def quantize_per_channel(w):
    """int8 (N, K) and fp32 (N,) scales, as the weight-only quantizer stores them."""
    q, s = ops.quantize_per_channel(w)
    return q, s.view(-1)


def _pair(x, w, b):
    """The unfused decode path: the fused gate/up linear, then silu_mul. (..., 2F) -> (..., F)."""
    return ops.silu_mul(ops.linear_epilogue(x, w, b, None, "none"))


def _pair_int8(x, q, s, b):
    return ops.silu_mul(ops.w8a16_linear(x, q, s, b, None, "none"))


# ---- reference, checks, gradients, registration ----

@pytest.mark.parametrize("bias", [False, True])
def test_reference_is_silu_of_gate_times_up(bias):
    """transformers' gated MLP: act_fn(gate_proj(x)) * up_proj(x), with the two weights stacked gate first."""
    x = torch.randn(3, 5, 24)
    gate, upw = torch.randn(10, 24), torch.randn(10, 24)
    bg, bu = (torch.randn(10), torch.randn(10)) if bias else (None, None)
    w = torch.cat([gate, upw])
    b = torch.cat([bg, bu]) if bias else None
    expect = F.silu(F.linear(x, gate, bg)) * F.linear(x, upw, bu)
    for ours in (ops.linear_epilogue_ref(x, w, b, None, "silu_mul"), ops.linear_epilogue(x, w, b, None, "silu_mul")):
        assert ours.shape == (3, 5, 10)
        # fp32 GEMMs of 20 and of 10 rows block their sums differently on some CPUs: a few units of fp32 rounding
        # over K = 24 (5e-6 seen at values ~2)
        torch.testing.assert_close(ours, expect, rtol=1e-5, atol=2e-5)


def test_int8_reference_is_the_dequantized_linear_then_silu_mul():
    x, w = torch.randn(4, 32), torch.randn(14, 32)
    q, s = quantize_per_channel(w)
    deq = ops.dequantize_weight(q, s, torch.float32)
    torch.testing.assert_close(ops.w8a16_linear(x, q, s, None, None, "silu_mul"),
                               ops.silu_mul(F.linear(x, deq)), rtol=0, atol=0)


def test_rejects_bad_input():
    x, w = torch.randn(2, 8), torch.randn(6, 8)
    with pytest.raises(FuseInferError, match="even count"):
        ops.linear_epilogue(x, torch.randn(5, 8), None, None, "silu_mul")
    with pytest.raises(FuseInferError, match="activation and a residual"):
        ops.linear_epilogue(x, w, None, torch.randn(2, 6), "silu_mul")
    with pytest.raises(FuseInferError, match="activation must be one of"):
        ops.linear_epilogue(x, w, None, None, "gelu")
    q, s = quantize_per_channel(torch.randn(5, 8))
    with pytest.raises(FuseInferError, match="even count"):
        ops.w8a16_linear(x, q, s, None, None, "silu_mul")
    q, s = quantize_per_channel(w)
    with pytest.raises(FuseInferError, match="activation and a residual"):
        ops.w8a16_linear(x, q, s, None, torch.randn(2, 6), "silu_mul")
    with pytest.raises(FuseInferError, match="activation must be one of"):  # fp8 / w8a8 linears take no silu_mul
        ops.fp8_weight_linear(x, torch.randn(6, 8).to(torch.float8_e4m3fn), torch.ones(6), None, None, "silu_mul")


@pytest.mark.parametrize("bias", [False, True])
def test_gradients_gradcheck(bias):
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(10, 7, dtype=torch.float64, requires_grad=True)
    b = torch.randn(10, dtype=torch.float64, requires_grad=True) if bias else None
    assert torch.autograd.gradcheck(lambda *t: ops.linear_epilogue(*t, None, "silu_mul"), (x, w, b))


def test_int8_gradients_are_the_references():
    """dx and dbias through the registered op's formula equal autograd through the reference."""
    x = torch.randn(3, 16, requires_grad=True)
    b = torch.randn(12, requires_grad=True)
    q, s = quantize_per_channel(torch.randn(12, 16))
    grad = torch.randn(3, 6)
    dx, db = torch.autograd.grad(ops.w8a16_linear(x, q, s, b, None, "silu_mul"), (x, b), grad)
    rx, rb = torch.autograd.grad(ops.w8a16_linear_ref(x, q, s, b, None, "silu_mul"), (x, b), grad)
    torch.testing.assert_close(dx, rx)
    torch.testing.assert_close(db, rb)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [False, True])
def test_opcheck(device, bias):
    dtype = torch.float32 if device == "cpu" else torch.float16
    x = torch.randn(3, 32, device=device, dtype=dtype)
    w = torch.randn(2 * 24, 32, device=device, dtype=dtype)
    b = torch.randn(48, device=device, dtype=dtype) if bias else None
    torch.library.opcheck(torch.ops.fuseinfer.linear_epilogue.default, (x, w, b, None, "silu_mul"))
    q, s = quantize_per_channel(w.float())
    torch.library.opcheck(torch.ops.fuseinfer.w8a16_linear.default, (x, q.to(device), s.to(device), b, None,
                                                                     "silu_mul"))
    if device == "cpu":  # the autograd registration
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        torch.library.opcheck(torch.ops.fuseinfer.linear_epilogue.default, (xg, wg, b, None, "silu_mul"))


# ---- property tests: the reference's tolerance and the unfused pair's bits ----

@st.composite
def gated_cases(draw, device):
    """(x, weight (2F, K) or (int8, scale), bias, int8?): decode rows (1, 2-8, 9-16: the GEMV's one and two token
    tiles) and prefill rows; F odd or a multiple of 8 (a tile's 8 outputs); K a multiple of 16 (both GEMVs) or odd
    (the GEMM); 2-D or 3-D x."""
    torch.manual_seed(draw(st.integers(0, 2**32 - 1)))
    cuda = device == "cuda"
    m = draw(st.one_of(st.just(1), st.integers(2, 8), st.integers(9, 16), st.integers(17, 80)))
    f = draw(st.one_of(st.integers(1, 40), st.sampled_from([64, 136, 1000] if cuda else [64, 136])))
    k = draw(st.one_of(st.sampled_from([16, 48, 256, 1040] if cuda else [16, 48, 256]), st.integers(1, 70)))
    int8 = draw(st.booleans())
    if int8:
        k = max(16, k // 16 * 16) if draw(st.booleans()) else k
    dtype = draw(st.sampled_from([*LOWP, torch.float32] if cuda else [torch.float32, *LOWP]))
    lead = (m,) if m == 1 or draw(st.booleans()) else (2, (m + 1) // 2)
    x = torch.randn(*lead, k, device=device).to(dtype)
    w = torch.randn(2 * f, k, device=device) * k ** -0.5 * 3  # gates in SiLU's bend
    b = torch.randn(2 * f, device=device).to(dtype) if draw(st.booleans()) else None
    if int8:
        q, s = quantize_per_channel(w)
        return x, (q, s), b, True
    return x, w.to(dtype), b, False


def _ours_ref_pair(case):
    x, w, b, int8 = case
    hi = ref_dtype(x.dtype)
    if int8:
        q, s = w
        ours = ops.w8a16_linear(x, q, s, b, None, "silu_mul")
        deq = ops.dequantize_weight(q, s, hi)  # (the reference: the dequantized weight in the higher precision)
        ref = ops.linear_epilogue_ref(up(x, hi), deq, up(b, hi), None, "silu_mul")
        return ours, ops.w8a16_linear_ref(x, q, s, b, None, "silu_mul"), ref, _pair_int8(x, q, s, b)
    ref = ops.linear_epilogue_ref(up(x, hi), up(w, hi), up(b, hi), None, "silu_mul")
    return ours_plain(x, w, b), ops.linear_epilogue_ref(x, w, b, None, "silu_mul"), ref, _pair(x, w, b)


def ours_plain(x, w, b):
    return ops.linear_epilogue(x, w, b, None, "silu_mul")


@pytest.mark.parametrize("device", DEVICES)
def test_matches_reference_and_the_unfused_pair_property(device):
    """Within the low-precision rule of the higher-precision reference; and equal to the linear + silu_mul pair
    (bit for bit: the GEMV rounds gate and up as the linear stores them; int8 with a bias within the rule only, as
    the plain GEMV may or may not fuse its scale and bias into one fma per output)."""
    @examples(device, cpu=30, cuda=200)
    @given(case=gated_cases(device))
    def check(case):
        x, w, b, int8 = case
        (ours, torch_same, ref, pair), paths = paths_taken(lambda: _ours_ref_pair(case)) if device == "cuda" else \
            (_ours_ref_pair(case), {})
        what = f"silu_mul linear x{tuple(x.shape)} {'int8' if int8 else x.dtype} bias={b is not None}"
        assert ours.shape == (*x.shape[:-1], ref.shape[-1]) and ours.dtype == x.dtype, what
        # (atol: a rounding step of gate and of up each reach the product, so two half-ulps of its largest value)
        assert_lowp_close(ours, torch_same, ref, what, 2 * lowp_atol(ref, x.dtype))
        # the sm_90 GEMM sums k in another order than cuBLASLt's: gate and up may round the other way (the rule only)
        if not (int8 and b is not None) and "linear.silu_gemm" not in paths:
            assert torch.equal(ours, pair), what
    check()


# ---- CUDA: the GEMV's epilogue ----

# Llama-3.2-1B's MLP (F 8192, K 2048) at 1 and 16 rows, Qwen2-0.5B's (F 4864, K 896), odd F (a partial last tile),
# K with a partial last k-block (1040), more tiles than SMs.
@pytest.mark.gpu
@pytest.mark.parametrize("mfk", [(1, 8192, 2048), (16, 8192, 2048), (5, 4864, 896), (9, 123, 1040), (1, 3, 16),
                                 (12, 20000, 256)])
@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("fmt", ["half", "int8"])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_silu_mul_is_one_kernel_equal_to_the_pair(mfk, dtype, fmt, bias):
    m, f, k = mfk
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(2 * f, k, device="cuda") * k ** -0.5 * 3
    b = torch.randn(2 * f, device="cuda", dtype=dtype) if bias else None
    if fmt == "int8":
        q, s = quantize_per_channel(w)
        call, pair = (lambda: ops.w8a16_linear(x, q, s, b, None, "silu_mul")), (lambda: _pair_int8(x, q, s, b))
        deq = ops.dequantize_weight(q, s, torch.float32)
        ref = ops.linear_epilogue_ref(x.float(), deq, up(b), None, "silu_mul")
        torch_same = ops.w8a16_linear_ref(x, q, s, b, None, "silu_mul")
    else:
        w = w.to(dtype)
        call, pair = (lambda: ops.linear_epilogue(x, w, b, None, "silu_mul")), (lambda: _pair(x, w, b))
        ref = ops.linear_epilogue_ref(x.float(), w.float(), up(b), None, "silu_mul")
        torch_same = ops.linear_epilogue_ref(x, w, b, None, "silu_mul")
    names = cuda_kernel_names(call)
    assert len(names) == 1 and "skinny" in names[0], names  # no silu_mul kernel, no (M, 2F) intermediate
    if fmt == "half":
        assert paths_taken(call)[1] == {"linear.skinny": 1}
    ours = call()
    assert_lowp_close(ours, torch_same, ref, f"{mfk} {dtype} {fmt} bias={bias}")
    if not (fmt == "int8" and bias):
        assert torch.equal(ours, pair())


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["half", "int8"])
def test_knob_off_runs_the_gemv_then_silu_mul(fmt, set_knob):
    """FUSEINFER_GEMV_EPILOGUES=0 (benchmarks: the unfused decode in the same process): two kernels, the same bits."""
    x = torch.randn(2, 512, device="cuda", dtype=torch.float16)
    w = torch.randn(2 * 256, 512, device="cuda") * 512 ** -0.5
    if fmt == "int8":
        q, s = quantize_per_channel(w)
        call = lambda: ops.w8a16_linear(x, q, s, None, None, "silu_mul")  # noqa: E731
    else:
        w = w.half()
        call = lambda: ops.linear_epilogue(x, w, None, None, "silu_mul")  # noqa: E731
    fused = call()
    set_knob("FUSEINFER_GEMV_EPILOGUES", "0")
    names = cuda_kernel_names(call)
    assert len(names) == 2 and "skinny" in names[0] and "silu_mul" in names[1], names
    assert torch.equal(call(), fused)


# ---- CUDA: the sm_90 prefill GEMM with SiLU(gate) * up in its epilogue ----

# Llama-3.2-1B's MLP (F 8192, K 2048) at 2048 rows, Qwen2.5-1.5B's (F 8960, K 1536), Llama-3.1-8B's (F 14336,
# K 4096) at 520 rows (a partial row tile); odd sizes: a partial row tile, a partial column tile (F 1000), a partial
# last k-block (K 1040), more tiles than SMs (each CTA walks several, the ring wraps), 17 rows (one row tile), F 6
# (one partial column tile), F 1001 (scalar stores), K 40 (one partial k-block).
@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("mfk", [(2048, 8192, 2048), (300, 8960, 1536), (520, 14336, 4096), (300, 1000, 1040),
                                 (17, 136, 256), (1030, 4000, 264), (40, 6, 64), (130, 1001, 64),
                                 (70, 136, 40)])
@pytest.mark.parametrize("dtype", LOWP)
def test_prefill_gemm_with_silu_mul_epilogue_is_one_kernel_within_the_rule(mfk, dtype, set_knob):
    set_knob("FUSEINFER_SILU_GEMM", "1")
    m, f, k = mfk
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = (torch.randn(2 * f, k, device="cuda") * k ** -0.5 * 3).to(dtype)
    call = lambda: ops.linear_epilogue(x, w, None, None, "silu_mul")  # noqa: E731
    names = cuda_kernel_names(call)
    assert len(names) == 1 and "silu_gemm" in names[0], names  # no (M, 2F) intermediate, no silu_mul pass
    ours, paths = paths_taken(call)
    assert paths == {"linear.silu_gemm": 1}, paths
    ref = ops.linear_epilogue_ref(x.float(), w.float(), None, None, "silu_mul")
    torch_same = ops.linear_epilogue_ref(x, w, None, None, "silu_mul")
    assert_lowp_close(ours, torch_same, ref, f"{mfk} {dtype}", 2 * lowp_atol(ref, dtype))
    # against the unfused pair (cuBLASLt, then silu_mul): the same rounding steps, k summed in another order
    pair = _pair(x, w, None)
    assert (ours.float() - pair.float()).abs().max() <= 4 * lowp_atol(ref, dtype), mfk


@pytest.mark.gpu
@needs_sm90
def test_prefill_gemm_falls_back_where_it_does_not_apply(set_knob):
    """By default (FUSEINFER_SILU_GEMM=0), or with a bias, K % 8 != 0, a misaligned x or fp32: cuBLASLt then silu_mul
    (the pair's bits)."""
    x = torch.randn(40, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * 128, 256, device="cuda", dtype=torch.bfloat16) * 256 ** -0.5
    names = cuda_kernel_names(lambda: ops.linear_epilogue(x, w, None, None, "silu_mul"))
    assert len(names) >= 2 and "silu_mul" in names[-1] and not any("skinny" in n for n in names), names
    assert torch.equal(ops.linear_epilogue(x, w, None, None, "silu_mul"), _pair(x, w, None))
    set_knob("FUSEINFER_SILU_GEMM", "1")
    b = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    xs = torch.randn(40 * 256 + 1, device="cuda", dtype=torch.bfloat16)[1:].view(40, 256)  # 2 bytes off alignment
    for args in ((x, w, b), (x[:, :250], w[:, :250].contiguous(), None), (xs, w, None), (x.float(), w.float(), None)):
        out, paths = paths_taken(lambda: ops.linear_epilogue(*args, None, "silu_mul"))
        assert "linear.silu_gemm" not in paths, paths
        assert torch.equal(out, _pair(*args)), [a.shape if a is not None else None for a in args]


@pytest.mark.gpu
@needs_sm90
def test_prefill_gemm_in_a_cuda_graph(set_knob):
    """Captured and replayed (prefill graphs): the replay reads the new input."""
    set_knob("FUSEINFER_SILU_GEMM", "1")
    x = torch.randn(300, 512, device="cuda", dtype=torch.float16)
    w = torch.randn(2 * 1024, 512, device="cuda", dtype=torch.float16) * 512 ** -0.5
    eager, paths = paths_taken(lambda: ops.linear_epilogue(x, w, None, None, "silu_mul"))  # warm-up, not captured
    assert paths == {"linear.silu_gemm": 1}, paths
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, paths = paths_taken(lambda: ops.linear_epilogue(x, w, None, None, "silu_mul"))
    assert paths == {"linear.silu_gemm": 1}, paths
    graph.replay()
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, ops.linear_epilogue(x, w, None, None, "silu_mul"), rtol=0, atol=0)


@pytest.mark.gpu
def test_gemv_silu_mul_in_a_cuda_graph():
    """Captured and replayed (the decode step's CUDA graphs): the replay reads the new input."""
    x = torch.randn(1, 2048, device="cuda", dtype=torch.float16)
    w = torch.randn(2 * 1024, 2048, device="cuda", dtype=torch.float16) * 2048 ** -0.5
    ops.linear_epilogue(x, w, None, None, "silu_mul")  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.linear_epilogue(x, w, None, None, "silu_mul")
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, _pair(x, w, None), rtol=0, atol=0)
