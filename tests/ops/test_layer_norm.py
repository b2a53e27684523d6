"""fuseinfer::add_layer_norm (fuseinfer/ops/layer_norm.py): the reference against the formula, bad input, gradients,
the registration (opcheck), property tests against the reference (hypothesis) on every device, and the CUDA kernel
over fixed shapes."""
from __future__ import annotations

import pytest
import torch
from helpers import DEVICES, LOWP, assert_lowp_close, examples, given, lowp_atol, record_kernel_calls, ref_dtype, st, up

from fuseinfer import FuseInferError, ops


@pytest.fixture(autouse=True)
def _seed():
    """Each test's random inputs do not depend on which tests ran before it (a failure reproduces alone)."""
    torch.manual_seed(0)


@pytest.mark.parametrize("n", [123, 256])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_layer_norm_ref_matches_formula(n, with_residual, device):
    f64 = dict(dtype=torch.float64, device=device)
    x, r = torch.randn(7, 5, n, **f64), torch.randn(7, 5, n, **f64)
    w, b = torch.randn(n, **f64), torch.randn(n, **f64)
    s = x + r if with_residual else x
    expected = (s - s.mean(-1, keepdim=True)) / torch.sqrt(s.var(-1, unbiased=False, keepdim=True) + 1e-5) * w + b
    y, s_out = ops.add_layer_norm(x, r if with_residual else None, w, b, 1e-5, store_sum=True)
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(s_out, s)
    assert ops.add_layer_norm(x, r, w, b, 1e-5, store_sum=False)[1].numel() == 0


def test_add_layer_norm_rejects_bad_weight(device):
    with pytest.raises(FuseInferError, match=r"weight must be \(8,\), x's last dim, got \(7,\)"):
        ops.add_layer_norm(torch.randn(4, 8, device=device), None, torch.randn(7, device=device))


def test_add_layer_norm_rejects_a_broadcast_or_other_dtype_residual(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(FuseInferError, match=r"x's shape and dtype \(4, 8\) torch.float32, got \(8,\) torch.float32"):
        ops.add_layer_norm(x, torch.randn(8, device=device))
    with pytest.raises(FuseInferError, match=r"got \(4, 8\) torch.float64"):  # (the fake op promised x's dtype)
        ops.add_layer_norm(x, torch.randn(4, 8, dtype=torch.float64, device=device))


@pytest.mark.parametrize("residual,affine,store_sum", [(True, True, True), (True, True, False), (False, True, True),
                                                       (False, False, False)])
def test_add_layer_norm_gradients_gradcheck(residual, affine, store_sum, device):
    f64 = dict(dtype=torch.float64, device=device)
    x = torch.randn(6, 5, 11, **f64).transpose(0, 1)  # strided
    r = torch.randn(5, 6, 11, **f64) if residual else None
    w, b = (torch.randn(11, **f64), torch.randn(11, **f64)) if affine else (None, None)
    args = [t.requires_grad_() if t is not None else None for t in (x, r, w, b)]

    def f(*a):
        y, s = ops.add_layer_norm(*a, eps=1e-5, store_sum=store_sum)
        return (y, s) if store_sum else y
    assert torch.autograd.gradcheck(f, args)


OPCHECK_CASES = {  # fp32 inputs (on CUDA: the fp32 kernel; test_opcheck_cuda takes fp16)
    "add_layer_norm": lambda dev: (torch.randn(5, 123, device=dev), torch.randn(5, 123, device=dev),
                                   torch.randn(123, device=dev), torch.randn(123, device=dev), 1e-5, True),
    "add_layer_norm_no_residual": lambda dev: (torch.randn(2, 3, 96, device=dev), None, None, None, 1e-5, True),
    "add_layer_norm_strided": lambda dev: (torch.randn(6, 5, 32, device=dev).transpose(0, 1),  # contiguous outputs
                                           torch.randn(5, 6, 32, device=dev), torch.randn(32, device=dev),
                                           torch.randn(32, device=dev), 1e-5, True),
    "add_layer_norm_strided_no_residual": lambda dev: (torch.randn(6, 5, 32, device=dev).transpose(0, 1), None, None,
                                                       None, 1e-5, True),
    # inputs that need gradients: the autograd formula is registered and traces under AOT autograd
    "add_layer_norm_grad": lambda dev: tuple(torch.randn(*s, device=dev).requires_grad_()
                                             for s in ((5, 123), (5, 123), (123,), (123,))) + (1e-5, True),
}


@pytest.mark.parametrize("case", sorted(OPCHECK_CASES))
def test_opcheck(case, device):
    torch.library.opcheck(torch.ops.fuseinfer.add_layer_norm.default, OPCHECK_CASES[case](device))


# ---- property tests against the reference (hypothesis) ----

def _dtypes(device):
    return st.sampled_from([torch.float32, *LOWP]) if device == "cpu" else st.sampled_from([*LOWP, torch.float32])


@st.composite
def ln_cases(draw, device):
    """(x, residual, weight, bias, store_sum): 1 row, a few, many; odd hidden sizes; contiguous, transposed and
    sliced (row stride > N) inputs; with or without a residual and the affine parameters."""
    torch.manual_seed(draw(st.integers(0, 2**32 - 1)))  # the tensors follow from the drawn seed (replayable)
    rows = draw(st.one_of(st.just(1), st.integers(2, 9), st.integers(10, 300 if device == "cpu" else 3000)))
    hidden_max = 300 if device == "cpu" else 8192
    n = draw(st.one_of(st.integers(1, 9), st.integers(10, hidden_max), st.sampled_from([96, 123, 256, 2048, 4097])))
    dtype = draw(_dtypes(device))
    lead = draw(st.sampled_from(["2d", "3d"]))
    shape = (rows, n) if lead == "2d" or rows == 1 else (2, (rows + 1) // 2, n)
    scale = draw(st.sampled_from([1.0, 30.0]))  # large values: the fp32 statistics matter

    def make():
        layout = draw(st.sampled_from(["contiguous", "transposed", "sliced"]))
        if layout == "transposed" and len(shape) == 3:
            t = torch.randn(shape[1], shape[0], n, device=device).transpose(0, 1)
        elif layout == "sliced":  # every row a view into a wider buffer
            t = torch.randn(*shape[:-1], n + 5, device=device)[..., 2:n + 2]
        else:
            t = torch.randn(shape, device=device)
        return (t * scale).to(dtype)

    x = make()
    r = make() if draw(st.booleans()) else None
    affine = draw(st.sampled_from(["both", "none", "weight"]))
    w = (1 + 0.5 * torch.randn(n, device=device)).to(dtype) if affine != "none" else None
    b = torch.randn(n, device=device).to(dtype) if affine == "both" else None
    return x, r, w, b, draw(st.booleans())


@pytest.mark.parametrize("device", DEVICES)
def test_add_layer_norm_matches_reference_property(device):
    @examples(device, cpu=40, cuda=150)
    @given(case=ln_cases(device))
    def check(case):
        x, r, w, b, store_sum = case
        y, s = ops.add_layer_norm(x, r, w, b, 1e-5, store_sum=store_sum)
        assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous()
        if store_sum:  # the sum is rounded once to x's dtype, exactly like torch's x + r
            assert s.is_contiguous() and torch.equal(s, x if r is None else x + r)
        else:
            assert s.numel() == 0
        hi = ref_dtype(x.dtype)
        ref = ops.add_layer_norm_ref(up(x, hi), up(r, hi), up(w, hi), up(b, hi), 1e-5, False)[0]
        torch_same = torch.nn.functional.layer_norm(x if r is None else x + r, x.shape[-1:], w, b, 1e-5)
        assert_lowp_close(y, torch_same, ref, f"add_layer_norm {tuple(x.shape)} {x.dtype}", lowp_atol(ref, x.dtype))
    check()


@pytest.mark.parametrize("device", DEVICES)
def test_add_layer_norm_opcheck_property(device):
    """opcheck (schema, fake impl, autograd registration, AOT dispatch) on drawn shapes and layouts."""
    @examples(device, cpu=3, cuda=3)
    @given(case=ln_cases(device), grad=st.booleans())
    def check(case, grad):
        x, r, w, b, store_sum = case
        if grad:  # fp32 for the gradient checks
            x, r, w, b = (None if t is None else t.float().requires_grad_() for t in (x, r, w, b))
        torch.library.opcheck(torch.ops.fuseinfer.add_layer_norm.default, (x, r, w, b, 1e-5, store_sum))
    check()


# ---- CUDA kernel ----

LN_SHAPES = [(113, 123), (3, 5, 96), (9, 256), (64, 2048), (5, 5120), (7, 4097), (2, 16384)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", LN_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, *LOWP])
@pytest.mark.parametrize("residual,affine", [(True, True), (False, True), (True, False)])
def test_add_layer_norm_kernel(shape, dtype, residual, affine):
    n = shape[-1]
    x = torch.randn(shape, device="cuda", dtype=dtype)
    r = torch.randn(shape, device="cuda", dtype=dtype) if residual else None
    w = torch.randn(n, device="cuda", dtype=dtype) if affine else None
    b = torch.randn(n, device="cuda", dtype=dtype) if affine else None
    y, s = ops.add_layer_norm(x, r, w, b, 1e-5, store_sum=True)
    torch.testing.assert_close(s, x if r is None else x + r, rtol=0, atol=0)  # one rounding, like torch
    ref32 = ops.add_layer_norm_ref(up(x), up(r), up(w), up(b), 1e-5, False)[0]
    if dtype == torch.float32:
        torch.testing.assert_close(y, ref32, rtol=1e-5, atol=1e-5)
    else:
        assert_lowp_close(y, ops.add_layer_norm_ref(x, r, w, b, 1e-5, False)[0], ref32, "layer_norm")
    assert ops.add_layer_norm(x, r, w, b, 1e-5, store_sum=False)[1].numel() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["add_layer_norm", "add_layer_norm_strided", "add_layer_norm_grad"])
def test_opcheck_cuda(name):
    dev = dict(device="cuda", dtype=torch.float16)
    args = {
        "add_layer_norm": (torch.randn(5, 123, **dev), torch.randn(5, 123, **dev), torch.randn(123, **dev),
                           torch.randn(123, **dev), 1e-5, True),
        "add_layer_norm_strided": (torch.randn(6, 5, 64, **dev).transpose(0, 1), None,  # the outputs are contiguous
                                   torch.randn(64, **dev), torch.randn(64, **dev), 1e-5, True),
        # inputs that need gradients: the kernel's forward, the reference's gradients
        "add_layer_norm_grad": tuple(torch.randn(*s, **dev).requires_grad_() for s in ((5, 123), (5, 123), (123,),
                                                                                       (123,))) + (1e-5, True),
    }[name]
    torch.library.opcheck(torch.ops.fuseinfer.add_layer_norm.default, args)


@pytest.mark.gpu
def test_eager_fast_path_equals_registered_op(monkeypatch):
    """The op wrapper calls the extension directly in eager mode; the dispatcher path must run the same kernel and
    give the same bits."""
    calls = record_kernel_calls(monkeypatch)
    x, r = torch.randn(9, 2048, device="cuda", dtype=torch.float16), torch.randn(9, 2048, device="cuda",
                                                                                 dtype=torch.float16)
    w, b = torch.randn(2048, device="cuda", dtype=torch.float16), torch.randn(2048, device="cuda",
                                                                              dtype=torch.float16)
    for direct, registered in zip(ops.add_layer_norm(x, r, w, b, 1e-5, True),
                                  torch.ops.fuseinfer.add_layer_norm(x, r, w, b, 1e-5, True)):
        assert torch.equal(direct, registered)
    assert calls == ["add_layer_norm"] * 2


@pytest.mark.gpu
def test_add_layer_norm_takes_the_reference_for_fp64(monkeypatch):
    """fp64 inputs, which the kernels do not take, run the reference on CUDA instead of failing in the extension."""
    calls = record_kernel_calls(monkeypatch)
    x64 = torch.randn(9, 256, device="cuda", dtype=torch.float64)
    torch.testing.assert_close(ops.add_layer_norm(x64, x64)[0], torch.nn.functional.layer_norm(2 * x64, (256,)))
    assert calls == []
