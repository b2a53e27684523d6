"""fuseinfer::silu_mul (fuseinfer/ops/silu_mul.py): the reference against transformers' gated MLP activation (bit for
bit) and its rounding contract, bad input, gradients, the registration (opcheck), property tests against the
reference (hypothesis) on every device, and the CUDA kernel (csrc/silu_mul.cu) over fixed shapes and in a CUDA
graph."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
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
from transformers.activations import ACT2FN

from fuseinfer import FuseInferError, ops

ALL_DTYPES = [torch.float32, *LOWP]


@pytest.fixture(autouse=True)
def _seed():
    """Each test's random inputs do not depend on which tests ran before it (a failure reproduces alone)."""
    torch.manual_seed(0)


def _rounded_as_documented(gate_up: torch.Tensor) -> torch.Tensor:
    """The contract spelled out: silu in fp32 rounded to the dtype, then the product in fp32 rounded to the dtype."""
    gate, up_ = gate_up.float().chunk(2, dim=-1)
    act = (gate / (1 + torch.exp(-gate))).to(gate_up.dtype).float()
    return (act * up_).to(gate_up.dtype)


# ---- the reference ----

@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("f", [1, 7, 64, 300])
def test_reference_is_transformers_gated_activation_bit_for_bit(dtype, f):
    """The family's MLP computes ``act_fn(gate_proj(x)) * up_proj(x)``; silu_mul of the two side by side gives the
    same bits (on the CPU the op is the reference)."""
    gate, up_ = (torch.randn(3, 11, f) * 4).to(dtype), (torch.randn(3, 11, f) * 4).to(dtype)
    gate_up = torch.cat([gate, up_], -1)
    expected = ACT2FN["silu"](gate) * up_
    out = ops.silu_mul(gate_up)
    assert out.shape == (3, 11, f) and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, expected) and torch.equal(ops.silu_mul_ref(gate_up), expected)
    assert torch.equal(out, F.silu(gate) * up_)


@pytest.mark.parametrize("dtype", LOWP)
def test_reference_rounds_as_documented(dtype):
    """silu in fp32 rounded to the dtype, then the product rounded (not one rounding of the fp32 product)."""
    gate_up = (torch.randn(64, 2 * 512) * 6).to(dtype)
    assert torch.equal(ops.silu_mul_ref(gate_up), _rounded_as_documented(gate_up))
    one_rounding = (F.silu(gate_up[:, :512].float()) * gate_up[:, 512:].float()).to(dtype)
    assert not torch.equal(ops.silu_mul_ref(gate_up), one_rounding)  # the test tells the two apart


def test_silu_mul_of_no_rows(device):
    out = ops.silu_mul(torch.randn(0, 2, 64, device=device, dtype=torch.bfloat16))
    assert out.shape == (0, 2, 32) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("bad,what", [(torch.randn(4, 7), r"\(4, 7\) torch.float32"),
                                      (torch.randn(()), r"\(\) torch.float32"),
                                      (torch.ones(4, 8, dtype=torch.int32), r"\(4, 8\) torch.int32")])
def test_silu_mul_rejects_odd_widths_scalars_and_integers(bad, what, device):
    with pytest.raises(FuseInferError, match=r"silu_mul: expected a floating-point \(\.\.\., 2F\) tensor, got " + what):
        ops.silu_mul(bad.to(device))


def test_silu_mul_gradients_gradcheck(device):
    gate_up = torch.randn(6, 5, 22, dtype=torch.float64, device=device).transpose(0, 1).requires_grad_()  # strided
    assert torch.autograd.gradcheck(ops.silu_mul, (gate_up,))


OPCHECK_CASES = {  # fp32 inputs (on CUDA: the fp32 kernel; test_opcheck_cuda takes fp16)
    "silu_mul": lambda dev: (torch.randn(5, 2 * 123, device=dev),),
    "silu_mul_3d": lambda dev: (torch.randn(2, 3, 2 * 64, device=dev),),
    "silu_mul_strided": lambda dev: (torch.randn(64, 5, device=dev).t(),),  # contiguous output
    "silu_mul_grad": lambda dev: (torch.randn(5, 2 * 96, device=dev).requires_grad_(),),
}


@pytest.mark.parametrize("case", sorted(OPCHECK_CASES))
def test_opcheck(case, device):
    torch.library.opcheck(torch.ops.fuseinfer.silu_mul.default, OPCHECK_CASES[case](device))


# ---- property tests against the reference (hypothesis) ----

@st.composite
def silu_cases(draw, device):
    """gate_up (..., 2F): 1 row, a few, many; odd and Llama-sized F; contiguous, transposed, sliced (row stride >
    2F) and misaligned (contiguous, starting one element into its buffer) layouts; large values (silu's tails)."""
    torch.manual_seed(draw(st.integers(0, 2**32 - 1)))  # the tensors follow from the drawn seed (replayable)
    rows = draw(st.one_of(st.just(1), st.integers(2, 9), st.integers(10, 300)))
    f_max = 300 if device == "cpu" else 8192
    f = draw(st.one_of(st.integers(1, 9), st.integers(10, f_max),
                       st.sampled_from([8, 100, 256, 2048, 4096, 5120, 8192] if device == "cuda" else [8, 100, 256])))
    dtype = draw(st.sampled_from(ALL_DTYPES))
    shape = (rows, 2 * f) if draw(st.booleans()) or rows == 1 else (2, (rows + 1) // 2, 2 * f)
    scale = draw(st.sampled_from([1.0, 4.0, 30.0]))
    layout = draw(st.sampled_from(["contiguous", "transposed", "sliced", "misaligned"]))
    if layout == "transposed" and len(shape) == 3:
        t = torch.randn(shape[1], shape[0], 2 * f, device=device).transpose(0, 1)
    elif layout == "sliced":
        t = torch.randn(*shape[:-1], 2 * f + 6, device=device)[..., 3:2 * f + 3]
    elif layout == "misaligned":  # contiguous, so the op passes it on as it is: the kernel's scalar path
        return (torch.randn(torch.Size(shape).numel() + 1, device=device) * scale).to(dtype)[1:].view(shape)
    else:
        t = torch.randn(shape, device=device)
    return (t * scale).to(dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_silu_mul_matches_reference_property(device):
    """The eager PyTorch result in the same dtype bit for bit (the kernel computes exactly its roundings), and so
    also the 2x rule against the reference in a higher precision."""
    @examples(device, cpu=40, cuda=200)
    @given(gate_up=silu_cases(device))
    def check(gate_up):
        out = ops.silu_mul(gate_up)
        f = gate_up.shape[-1] // 2
        assert out.shape == (*gate_up.shape[:-1], f) and out.dtype == gate_up.dtype and out.is_contiguous()
        torch_same = ops.silu_mul_ref(gate_up)
        assert torch.equal(out, torch_same), f"silu_mul {tuple(gate_up.shape)} {gate_up.dtype}"
        ref = ops.silu_mul_ref(up(gate_up, ref_dtype(gate_up.dtype)))
        assert_lowp_close(out, torch_same, ref, f"silu_mul {tuple(gate_up.shape)}", lowp_atol(ref, gate_up.dtype))
    check()


@pytest.mark.parametrize("device", DEVICES)
def test_silu_mul_opcheck_property(device):
    @examples(device, cpu=3, cuda=3)
    @given(gate_up=silu_cases(device), grad=st.booleans())
    def check(gate_up, grad):
        if grad:
            gate_up = gate_up.float().requires_grad_()
        torch.library.opcheck(torch.ops.fuseinfer.silu_mul.default, (gate_up,))
    check()


# ---- CUDA kernel ----

WIDTHS = [1, 7, 100, 256, 2048, 4096, 5120, 8192, 14336]
ROWS = [1, 4, 37, 300]


def _require_silu_kernel():
    require_kernel()
    from fuseinfer.core.extension import extension
    if not hasattr(extension(), "silu_mul"):
        pytest.fail("fuseinfer._C has no silu_mul: rebuild it")


def _check_kernel(gate_up, what):
    """Bit for bit eager PyTorch on the GPU (same roundings, same expf), and the 2x rule against the fp32 (fp64)
    reference; the contract's roundings spelled out give the same bits too."""
    out = ops.silu_mul(gate_up)
    torch_same = F.silu(gate_up[..., :gate_up.shape[-1] // 2]) * gate_up[..., gate_up.shape[-1] // 2:]
    assert out.is_contiguous() and out.dtype == gate_up.dtype
    assert torch.equal(out, torch_same), f"{what}: {(out.double() - torch_same.double()).abs().max().item()}"
    if gate_up.dtype != torch.float32:  # (fp32: torch's exp and the elementwise one may differ in the last bit)
        assert torch.equal(out, _rounded_as_documented(gate_up)), what
    ref = ops.silu_mul_ref(up(gate_up, ref_dtype(gate_up.dtype)))
    assert_lowp_close(out, torch_same, ref, what, lowp_atol(ref, gate_up.dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("f", WIDTHS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_silu_mul_kernel(f, rows, dtype, monkeypatch):
    _require_silu_kernel()
    calls = record_kernel_calls(monkeypatch)
    gate_up = (torch.randn(rows, 2 * f, device="cuda") * 4).to(dtype)
    _check_kernel(gate_up, f"silu_mul ({rows}, {2 * f}) {dtype}")
    misaligned = (torch.randn(rows * 2 * f + 1, device="cuda") * 4).to(dtype)[1:].view(rows, 2 * f)  # scalar path
    _check_kernel(misaligned, f"silu_mul misaligned ({rows}, {2 * f}) {dtype}")
    assert calls == ["silu_mul"] * 2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_silu_mul_kernel_tails_and_specials(dtype):
    """Large |gate| (exp overflows to inf: silu is -0 or gate), zeros, infinities and NaN, as eager PyTorch."""
    _require_silu_kernel()
    vals = torch.tensor([0.0, -0.0, 1.0, -1.0, 20.0, -20.0, 88.0, -88.0, 100.0, -100.0, 1e4, -1e4, float("inf"),
                         float("-inf"), float("nan"), 3.5], device="cuda")
    gate = vals.repeat(16).to(dtype)
    up_ = vals.roll(3).repeat(16).to(dtype)
    out = ops.silu_mul(torch.cat([gate, up_])[None])
    expected = F.silu(gate) * up_
    assert torch.equal(out[0].isnan(), expected.isnan())
    assert torch.equal(out[0].nan_to_num(), expected.nan_to_num())


@pytest.mark.gpu
def test_silu_mul_kernel_large_input():
    """More output packs than the grid has threads (the grid-stride loop goes round several times)."""
    _require_silu_kernel()
    gate_up = torch.randn(4096, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(ops.silu_mul(gate_up), ops.silu_mul_ref(gate_up))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_silu_mul_kernel_in_cuda_graph(dtype):
    """Captured once (after a GEMM whose output it reads: PDL), replayed on new inputs: the same bits as eager."""
    _require_silu_kernel()
    x = torch.randn(37, 512, device="cuda", dtype=dtype)
    w = torch.randn(2 * 2048, 512, device="cuda", dtype=dtype) / 20
    ops.silu_mul(x @ w.t())  # warm-up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gate_up = x @ w.t()
        out = ops.silu_mul(gate_up)
        out2 = ops.silu_mul(torch.cat([out, out], -1))  # a second call reading the first one's output
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        e = ops.silu_mul(x @ w.t())
        torch.cuda.synchronize()
        assert torch.equal(out, e) and torch.equal(out2, ops.silu_mul(torch.cat([e, e], -1)))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["silu_mul", "silu_mul_odd", "silu_mul_grad"])
def test_opcheck_cuda(name):
    dev = dict(device="cuda", dtype=torch.float16)
    args = {
        "silu_mul": (torch.randn(5, 2 * 128, **dev),),
        "silu_mul_odd": (torch.randn(3, 5, 2 * 7, **dev),),
        "silu_mul_grad": (torch.randn(5, 2 * 96, **dev).requires_grad_(),),
    }[name]
    torch.library.opcheck(torch.ops.fuseinfer.silu_mul.default, args)


@pytest.mark.gpu
def test_eager_fast_path_equals_registered_op(monkeypatch):
    _require_silu_kernel()
    calls = record_kernel_calls(monkeypatch)
    gate_up = torch.randn(9, 2 * 2048, device="cuda", dtype=torch.float16)
    assert torch.equal(ops.silu_mul(gate_up), torch.ops.fuseinfer.silu_mul(gate_up))
    assert calls == ["silu_mul"] * 2


@pytest.mark.gpu
def test_silu_mul_takes_the_reference_for_fp64(monkeypatch):
    calls = record_kernel_calls(monkeypatch)
    gate_up = torch.randn(9, 256, device="cuda", dtype=torch.float64)
    assert torch.equal(ops.silu_mul(gate_up), ops.silu_mul_ref(gate_up))
    assert calls == []
