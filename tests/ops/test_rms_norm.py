"""fuseinfer::add_rms_norm (fuseinfer/ops/rms_norm.py): the reference against transformers' RMSNorm modules (bit for
bit) and the formula, bad input, gradients, the registration (opcheck), property tests against the reference
(hypothesis) on every device, and the CUDA kernel (csrc/rms_norm.cu) over fixed shapes, in a CUDA graph and on rows
whose statistics are exact (where it must give transformers' bits)."""
from __future__ import annotations

import pytest
import torch
from helpers import (
    DEVICES,
    LOWP,
    assert_lowp_close,
    examples,
    given,
    lowp_atol,
    record_kernel_calls,
    ref_dtype,
    require_kernel,
    st,
    up,
)
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from fuseinfer import FuseInferError, ops

ALL_DTYPES = [torch.float32, *LOWP]


@pytest.fixture(autouse=True)
def _seed():
    """Each test's random inputs do not depend on which tests ran before it (a failure reproduces alone)."""
    torch.manual_seed(0)


def _hf_norm(cls, weight: torch.Tensor, eps: float):
    """transformers' RMSNorm module ``cls`` of weight's width, dtype and device, holding ``weight``."""
    norm = cls(weight.shape[0], eps=eps).to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


# ---- the reference ----

@pytest.mark.parametrize("cls", [LlamaRMSNorm, Qwen2RMSNorm, MistralRMSNorm])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_reference_is_transformers_rms_norm_bit_for_bit(cls, dtype, with_residual):
    """The family's decoder layer computes ``norm(residual + x)``; the op (on the CPU: its reference) gives the same
    bits, and s is that sum."""
    n = 200
    x, r = (torch.randn(3, 17, n) * 4).to(dtype), (torch.randn(3, 17, n) * 4).to(dtype)
    w = (1 + 0.3 * torch.randn(n)).to(dtype)
    norm = _hf_norm(cls, w, 1e-5)
    s = x + r if with_residual else x
    with torch.no_grad():
        expected = norm(s)
    y, s_out = ops.add_rms_norm(x, r if with_residual else None, w, 1e-5, store_sum=True)
    assert y.dtype == dtype and torch.equal(y, expected)
    assert torch.equal(s_out, s)
    assert torch.equal(ops.add_rms_norm_ref(x, r if with_residual else None, w, 1e-5, False)[0], expected)


@pytest.mark.parametrize("n", [1, 123, 256])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("with_weight", [True, False])
def test_add_rms_norm_matches_formula(n, with_residual, with_weight, device):
    f64 = dict(dtype=torch.float64, device=device)
    x, r, w = torch.randn(7, 5, n, **f64), torch.randn(7, 5, n, **f64), torch.randn(n, **f64)
    s = x + r if with_residual else x
    expected = s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * (w if with_weight else 1)
    y, s_out = ops.add_rms_norm(x, r if with_residual else None, w if with_weight else None, 1e-6, store_sum=True)
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)  # (statistics in fp32, as transformers', even here)
    torch.testing.assert_close(s_out, s, rtol=0, atol=0)
    assert ops.add_rms_norm(x, r, w, 1e-6, store_sum=False)[1].numel() == 0


def test_add_rms_norm_of_no_rows(device):
    x = torch.randn(0, 64, device=device, dtype=torch.float16)
    y, s = ops.add_rms_norm(x, x, torch.ones(64, device=device, dtype=torch.float16), 1e-6, store_sum=True)
    assert y.shape == s.shape == (0, 64) and y.dtype == s.dtype == torch.float16


def test_add_rms_norm_rejects_bad_weight(device):
    with pytest.raises(FuseInferError, match=r"weight must be \(8,\), x's last dim, got \(7,\)"):
        ops.add_rms_norm(torch.randn(4, 8, device=device), None, torch.randn(7, device=device))


def test_add_rms_norm_rejects_a_broadcast_or_other_dtype_residual(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(FuseInferError, match=r"x's shape and dtype \(4, 8\) torch.float32, got \(8,\) torch.float32"):
        ops.add_rms_norm(x, torch.randn(8, device=device))
    with pytest.raises(FuseInferError, match=r"got \(4, 8\) torch.float64"):
        ops.add_rms_norm(x, torch.randn(4, 8, dtype=torch.float64, device=device))


@pytest.mark.parametrize("residual,weight,store_sum", [(True, True, True), (True, True, False), (False, True, True),
                                                       (False, False, False), (True, False, True)])
def test_add_rms_norm_gradients_match_the_formula(residual, weight, store_sum, device):
    """The op's gradients (x, residual, weight; through y and, with store_sum, through s) against autograd through
    the fp64 formula. Not gradcheck: the reference's statistics are fp32 even for fp64 inputs (as transformers'), too
    coarse for finite differences."""
    f64 = dict(dtype=torch.float64, device=device)
    x = torch.randn(6, 5, 11, **f64).transpose(0, 1)  # strided
    r = torch.randn(5, 6, 11, **f64) if residual else None
    w = torch.randn(11, **f64) if weight else None
    gy, gs = torch.randn(5, 6, 11, **f64), torch.randn(5, 6, 11, **f64)

    def grads(fn):
        args = [t.detach().requires_grad_() for t in (x, r, w) if t is not None]
        y, s = fn(*args)
        loss = (y * gy).sum() + ((s * gs).sum() if store_sum else 0)
        return torch.autograd.grad(loss, args)

    def op(*a):
        it = iter(a)
        return ops.add_rms_norm(next(it), next(it) if residual else None, next(it) if weight else None, 1e-6,
                                store_sum=store_sum)

    def formula(*a):
        it = iter(a)
        xx = next(it)
        s = xx + next(it) if residual else xx
        y = s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (y * next(it) if weight else y), s

    for ours, expected in zip(grads(op), grads(formula)):
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


OPCHECK_CASES = {  # fp32 inputs (on CUDA: the fp32 kernel; test_opcheck_cuda takes fp16)
    "add_rms_norm": lambda dev: (torch.randn(5, 123, device=dev), torch.randn(5, 123, device=dev),
                                 torch.randn(123, device=dev), 1e-6, True),
    "add_rms_norm_no_residual": lambda dev: (torch.randn(2, 3, 96, device=dev), None, None, 1e-5, True),
    "add_rms_norm_no_store": lambda dev: (torch.randn(4, 256, device=dev), torch.randn(4, 256, device=dev),
                                          torch.randn(256, device=dev), 1e-6, False),
    "add_rms_norm_strided": lambda dev: (torch.randn(6, 5, 32, device=dev).transpose(0, 1),  # contiguous outputs
                                         torch.randn(5, 6, 32, device=dev), torch.randn(32, device=dev), 1e-6, True),
    "add_rms_norm_strided_no_residual": lambda dev: (torch.randn(6, 5, 32, device=dev).transpose(0, 1), None, None,
                                                     1e-6, True),
    # a weight of another dtype than x: y takes the promoted dtype (the reference's, transformers')
    "add_rms_norm_fp32_weight": lambda dev: (torch.randn(4, 64, device=dev, dtype=torch.bfloat16), None,
                                             torch.randn(64, device=dev), 1e-6, True),
    # inputs that need gradients: the autograd formula is registered and traces under AOT autograd
    "add_rms_norm_grad": lambda dev: tuple(torch.randn(*s, device=dev).requires_grad_()
                                           for s in ((5, 123), (5, 123), (123,))) + (1e-6, True),
}


@pytest.mark.parametrize("case", sorted(OPCHECK_CASES))
def test_opcheck(case, device):
    torch.library.opcheck(torch.ops.fuseinfer.add_rms_norm.default, OPCHECK_CASES[case](device))


# ---- property tests against the reference (hypothesis) ----

@st.composite
def rms_cases(draw, device):
    """(x, residual, weight, eps, store_sum): 1 row, a few, many; odd and Llama-sized widths; contiguous,
    transposed, sliced (row stride > N) and misaligned (contiguous, starting one element into its buffer) inputs;
    with or without a residual and a weight."""
    torch.manual_seed(draw(st.integers(0, 2**32 - 1)))  # the tensors follow from the drawn seed (replayable)
    rows = draw(st.one_of(st.just(1), st.integers(2, 9), st.integers(10, 300)))
    hidden_max = 300 if device == "cpu" else 8192
    n = draw(st.one_of(st.integers(1, 9), st.integers(10, hidden_max),
                       st.sampled_from([64, 100, 256, 2048, 4096, 5120, 8192] if device == "cuda" else [64, 100, 256])))
    dtype = draw(st.sampled_from(ALL_DTYPES))
    lead = draw(st.sampled_from(["2d", "3d"]))
    shape = (rows, n) if lead == "2d" or rows == 1 else (2, (rows + 1) // 2, n)
    scale = draw(st.sampled_from([1.0, 30.0]))  # large values: the fp32 statistics matter

    def make():
        layout = draw(st.sampled_from(["contiguous", "transposed", "sliced", "misaligned"]))
        count = torch.Size(shape).numel()
        if layout == "transposed" and len(shape) == 3:
            t = torch.randn(shape[1], shape[0], n, device=device).transpose(0, 1)
        elif layout == "sliced":  # every row a view into a wider buffer
            t = torch.randn(*shape[:-1], n + 5, device=device)[..., 2:n + 2]
        elif layout == "misaligned":  # contiguous, so the op passes it on as it is: the kernel's scalar path
            return (torch.randn(count + 1, device=device) * scale).to(dtype)[1:].view(shape)
        else:
            t = torch.randn(shape, device=device)
        return (t * scale).to(dtype)

    x = make()
    r = make() if draw(st.booleans()) else None
    w = (1 + 0.5 * torch.randn(n, device=device)).to(dtype) if draw(st.booleans()) else None
    eps = draw(st.sampled_from([1e-6, 1e-5, 0.1]))
    return x, r, w, eps, draw(st.booleans())


@pytest.mark.parametrize("device", DEVICES)
def test_add_rms_norm_matches_reference_property(device):
    """The 2x rule against the reference in a higher precision; on the CPU (the reference itself) exactly
    transformers' bits, on CUDA (the kernel) s exactly x + r."""
    @examples(device, cpu=40, cuda=200)
    @given(case=rms_cases(device))
    def check(case):
        x, r, w, eps, store_sum = case
        y, s = ops.add_rms_norm(x, r, w, eps, store_sum=store_sum)
        assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous()
        if store_sum:  # the sum is rounded once to x's dtype, exactly like torch's x + r
            assert s.is_contiguous() and torch.equal(s, x if r is None else x + r)
        else:
            assert s.numel() == 0
        hi = ref_dtype(x.dtype)
        ref = ops.add_rms_norm_ref(up(x, hi), up(r, hi), up(w, hi), eps, False)[0]
        torch_same = ops.add_rms_norm_ref(x, r, w, eps, False)[0]
        if device == "cpu":
            assert torch.equal(y, torch_same)
        assert_lowp_close(y, torch_same, ref, f"add_rms_norm {tuple(x.shape)} {x.dtype}", lowp_atol(ref, x.dtype))
    check()


@pytest.mark.parametrize("device", DEVICES)
def test_add_rms_norm_opcheck_property(device):
    """opcheck (schema, fake impl, autograd registration, AOT dispatch) on drawn shapes and layouts."""
    @examples(device, cpu=3, cuda=3)
    @given(case=rms_cases(device), grad=st.booleans())
    def check(case, grad):
        x, r, w, eps, store_sum = case
        if grad:  # fp32 for the gradient checks
            x, r, w = (None if t is None else t.float().requires_grad_() for t in (x, r, w))
        torch.library.opcheck(torch.ops.fuseinfer.add_rms_norm.default, (x, r, w, eps, store_sum))
    check()


# ---- CUDA kernel ----

WIDTHS = [1, 7, 100, 256, 2048, 4096, 5120, 8192]
ROWS = [1, 4, 37, 300]


def _require_rms_kernel():
    require_kernel()
    from fuseinfer.core.extension import extension
    if not hasattr(extension(), "add_rms_norm"):
        pytest.fail("fuseinfer._C has no add_rms_norm: rebuild it")


def _check_kernel(x, r, w, eps, what):
    """The kernel's (y, s) against the reference: s bit for bit, y under the 2x rule."""
    y, s = ops.add_rms_norm(x, r, w, eps, store_sum=True)
    assert y.is_contiguous() and y.dtype == x.dtype
    assert torch.equal(s, x if r is None else x + r), what  # one rounding, like torch
    hi = ref_dtype(x.dtype)
    ref = ops.add_rms_norm_ref(up(x, hi), up(r, hi), up(w, hi), eps, False)[0]
    torch_same = ops.add_rms_norm_ref(x, r, w, eps, False)[0]
    assert_lowp_close(y, torch_same, ref, what, lowp_atol(ref, x.dtype))
    y2, s2 = ops.add_rms_norm(x, r, w, eps, store_sum=False)
    assert torch.equal(y2, y) and s2.numel() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_add_rms_norm_kernel(n, rows, dtype, monkeypatch):
    _require_rms_kernel()
    calls = record_kernel_calls(monkeypatch)
    dev = dict(device="cuda", dtype=dtype)
    x, r = torch.randn(rows, n, **dev) * 3, torch.randn(rows, n, **dev)
    w = (1 + 0.5 * torch.randn(n, device="cuda")).to(dtype)
    for res, weight in ((r, w), (None, w), (r, None), (None, None)):
        _check_kernel(x, res, weight, 1e-6, f"add_rms_norm ({rows}, {n}) {dtype} residual {res is not None} "
                                            f"weight {weight is not None}")
    assert calls and set(calls) == {"add_rms_norm"}


@pytest.mark.gpu
@pytest.mark.parametrize("n", [8, 4096, 16384])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_add_rms_norm_kernel_misaligned_and_widest(n, dtype):
    """Contiguous inputs that start one element into their buffers (the scalar path, whatever the width), and the
    widest rows the kernel takes."""
    _require_rms_kernel()
    rows = 19
    x = (torch.randn(rows * n + 1, device="cuda") * 3).to(dtype)[1:].view(rows, n)
    r = torch.randn(rows * n + 1, device="cuda").to(dtype)[1:].view(rows, n)
    w = (1 + 0.5 * torch.randn(n + 1, device="cuda")).to(dtype)[1:]
    _check_kernel(x, r, w, 1e-5, f"misaligned ({rows}, {n}) {dtype}")
    _check_kernel(x.contiguous().clone(), r.clone(), w.clone(), 1e-5, f"aligned ({rows}, {n}) {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("n", [256, 2048, 4096, 8192])
@pytest.mark.parametrize("rows", [1, 300])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_add_rms_norm_kernel_gives_transformers_bits_where_the_statistics_are_exact(n, rows, dtype):
    """Small integers and a power-of-two width: every sum of squares is exact in fp32 in any order and so is the
    mean, leaving rsqrt (the kernel's and torch's CUDA rsqrt: the same single-precision rsqrt) and the two roundings
    of the contract, which then give transformers' LlamaRMSNorm on the GPU bit for bit."""
    _require_rms_kernel()
    x = torch.randint(-8, 9, (rows, n), device="cuda").to(dtype)
    r = torch.randint(-8, 9, (rows, n), device="cuda").to(dtype)
    w = (1 + 0.5 * torch.randn(n, device="cuda")).to(dtype)
    norm = _hf_norm(LlamaRMSNorm, w, 1e-5)
    with torch.no_grad():
        expected = norm(x + r)
    y, s = ops.add_rms_norm(x, r, w, 1e-5, store_sum=True)
    assert torch.equal(s, x + r)
    assert torch.equal(y, expected), (y.double() - expected.double()).abs().max().item()
    assert torch.equal(ops.add_rms_norm(x, None, None, 1e-5)[0], ops.add_rms_norm_ref(x, None, None, 1e-5, False)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_add_rms_norm_kernel_in_cuda_graph(dtype):
    """Captured once, replayed on new inputs written into the captured tensors: the same bits as eager calls."""
    _require_rms_kernel()
    dev = dict(device="cuda", dtype=dtype)
    x, r, w = torch.randn(37, 4096, **dev), torch.randn(37, 4096, **dev), torch.randn(4096, **dev)
    ops.add_rms_norm(x, r, w, 1e-6, True)  # warm-up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y1, s1 = ops.add_rms_norm(x, r, w, 1e-6, True)
        y2, _ = ops.add_rms_norm(y1, s1, w, 1e-6, False)  # a second norm reading the first one's outputs (PDL)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        r.copy_(torch.randn_like(r))
        graph.replay()
        e1, es1 = ops.add_rms_norm(x, r, w, 1e-6, True)
        e2, _ = ops.add_rms_norm(e1, es1, w, 1e-6, False)
        torch.cuda.synchronize()
        assert torch.equal(y1, e1) and torch.equal(s1, es1) and torch.equal(y2, e2)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["add_rms_norm", "add_rms_norm_strided", "add_rms_norm_grad"])
def test_opcheck_cuda(name):
    dev = dict(device="cuda", dtype=torch.float16)
    args = {
        "add_rms_norm": (torch.randn(5, 123, **dev), torch.randn(5, 123, **dev), torch.randn(123, **dev), 1e-6, True),
        "add_rms_norm_strided": (torch.randn(6, 5, 64, **dev).transpose(0, 1), None,  # the outputs are contiguous
                                 torch.randn(64, **dev), 1e-6, True),
        # inputs that need gradients: the kernel's forward, the reference's gradients
        "add_rms_norm_grad": tuple(torch.randn(*s, **dev).requires_grad_() for s in ((5, 123), (5, 123), (123,)))
        + (1e-6, True),
    }[name]
    torch.library.opcheck(torch.ops.fuseinfer.add_rms_norm.default, args)


@pytest.mark.gpu
def test_eager_fast_path_equals_registered_op(monkeypatch):
    """The op wrapper calls the extension directly in eager mode; the dispatcher path must run the same kernel and
    give the same bits."""
    _require_rms_kernel()
    calls = record_kernel_calls(monkeypatch)
    dev = dict(device="cuda", dtype=torch.bfloat16)
    x, r, w = torch.randn(9, 2048, **dev), torch.randn(9, 2048, **dev), torch.randn(2048, **dev)
    for direct, registered in zip(ops.add_rms_norm(x, r, w, 1e-6, True),
                                  torch.ops.fuseinfer.add_rms_norm(x, r, w, 1e-6, True)):
        assert torch.equal(direct, registered)
    assert calls == ["add_rms_norm"] * 2


@pytest.mark.gpu
def test_add_rms_norm_takes_the_reference_where_the_kernel_does_not_serve(monkeypatch):
    """fp64 inputs, and a weight of another dtype than x (fp32 weight, bf16 x: the reference's type promotion),
    run the reference on CUDA instead of failing in the extension."""
    calls = record_kernel_calls(monkeypatch)
    x64 = torch.randn(9, 256, device="cuda", dtype=torch.float64)
    torch.testing.assert_close(ops.add_rms_norm(x64, x64)[0], ops.add_rms_norm_ref(x64, x64, None, 1e-6, False)[0])
    xb, w32 = torch.randn(9, 256, device="cuda", dtype=torch.bfloat16), torch.randn(256, device="cuda")
    assert torch.equal(ops.add_rms_norm(xb, None, w32)[0], ops.add_rms_norm_ref(xb, None, w32, 1e-6, False)[0])
    assert calls == []
