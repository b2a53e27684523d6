"""fuseinfer::quantize_int8 / fuseinfer::dequantize_int8 (fuseinfer/ops/quant.py): accuracy (SQNR floor, half-step
bound), edge cases, bad input, gradients, the registrations (opcheck) and property tests against the references
(hypothesis) on every device (no kernel yet: the references run everywhere)."""
from __future__ import annotations

import pytest
import torch
from helpers import DEVICES, examples, given, sqnr_db, st

from fuseinfer import FuseInferError, ops


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_int8_edge_cases(device):
    q, scale = ops.quantize_per_token(torch.randn(3, 0, device=device))  # K = 0: empty values, the all-zero scale
    assert q.shape == (3, 0) and q.dtype == torch.int8 and scale.shape == (3, 1) and bool((scale > 0).all())
    with pytest.raises(FuseInferError, match="must broadcast to q's shape"):
        ops.dequantize(torch.zeros(1, 4, dtype=torch.int8, device=device), torch.ones(3, 1, device=device))


def test_dequantize_rejects_a_scale_that_does_not_broadcast(device):
    with pytest.raises(FuseInferError, match=r"scale \(4,\) must broadcast to q's shape \(4, 8\)"):
        ops.dequantize(torch.zeros(4, 8, dtype=torch.int8, device=device), torch.ones(4, device=device))


def test_int8_quantize_is_not_differentiable_and_dequantize_is(device):
    x = torch.randn(4, 33, requires_grad=True, device=device)
    q, scale = ops.quantize_per_token(x)
    assert not q.requires_grad and not scale.requires_grad
    scale = scale.clone().requires_grad_()
    g = torch.randn(4, 33, device=device)
    (ops.dequantize(q, scale, torch.float32) * g).sum().backward()
    torch.testing.assert_close(scale.grad, (g * q.float()).sum(-1, keepdim=True))


@pytest.mark.parametrize("shape", [(113, 123), (4, 9, 256)])
def test_int8_quantisation_sqnr_and_bounds(shape, device):
    x = torch.randn(*shape, device=device)
    q, scale = ops.quantize_per_token(x)
    assert q.dtype == torch.int8 and scale.shape == (*shape[:-1], 1) and scale.dtype == torch.float32
    deq = ops.dequantize(q, scale, torch.float32)
    assert (deq - x).abs().le(scale / 2 + 1e-6).all()  # round-to-nearest: at most half a step off
    assert sqnr_db(x, deq) > 35.0  # int8 absmax on Gaussian rows gives about 38-40 dB
    assert q.abs().amax(-1).eq(127).all()  # the absmax element of every row maps to +-127


def test_int8_per_channel_weight_and_zero_rows(device):
    w = torch.randn(64, 96, device=device)
    w[3] = 0
    q, scale = ops.quantize_per_channel(w)
    assert scale.shape == (64, 1) and q[3].eq(0).all()
    assert sqnr_db(w, ops.dequantize(q, scale, torch.float32)) > 35.0


OPCHECK_CASES = {
    "quantize_int8": lambda dev: (torch.ops.fuseinfer.quantize_int8.default, (torch.randn(7, 123, device=dev), -1)),
    "dequantize_int8": lambda dev: (torch.ops.fuseinfer.dequantize_int8.default,
                                    (torch.randint(-127, 128, (7, 123), dtype=torch.int8, device=dev),
                                     torch.rand(7, 1, device=dev), torch.float16)),
}


@pytest.mark.parametrize("case", sorted(OPCHECK_CASES))
def test_opcheck(case, device):
    op, args = OPCHECK_CASES[case](device)
    torch.library.opcheck(op, args)


# ---- property tests against the references (hypothesis) ----

@st.composite
def quant_cases(draw, device):
    """x (..., K): 1 row, a few, many; odd K (1 too); fp32 / fp16 / bf16; contiguous, transposed or sliced; rows
    of zeros and of one outlier; Gaussian values at a drawn scale."""
    torch.manual_seed(draw(st.integers(0, 2**32 - 1)))  # the tensors follow from the drawn seed (replayable)
    rows = draw(st.one_of(st.just(1), st.integers(2, 9), st.integers(10, 400)))
    k = draw(st.one_of(st.integers(1, 9), st.integers(10, 300), st.sampled_from([64, 123, 256, 4096])))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    layout = draw(st.sampled_from(["contiguous", "transposed", "sliced", "3d"]))
    scale = draw(st.sampled_from([1e-3, 1.0, 50.0]))
    if layout == "transposed":
        x = torch.randn(k, rows, device=device).t()
    elif layout == "sliced":
        x = torch.randn(rows, k + 4, device=device)[:, 3:k + 3]
    elif layout == "3d":
        x = torch.randn(2, rows, k, device=device)
    else:
        x = torch.randn(rows, k, device=device)
    x = x * scale
    special = draw(st.sampled_from(["none", "zero_row", "outlier_row"]))
    if special == "zero_row":
        x[..., 0, :] = 0
    elif special == "outlier_row":
        x[..., -1, draw(st.integers(0, k - 1))] = 1000 * scale
    return x.to(dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_int8_quantize_matches_reference_property(device):
    @examples(device, cpu=40, cuda=100)
    @given(x=quant_cases(device))
    def check(x):
        q, scale = ops.quantize_per_token(x)
        q_ref, scale_ref = ops.quantize_int8_ref(x, -1)
        assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)
        assert q.shape == x.shape and q.dtype == torch.int8 and scale.shape == (*x.shape[:-1], 1)
        assert scale.dtype == torch.float32 and bool((scale > 0).all()) and int(q.abs().max()) <= 127
        x32 = x.float()
        deq = ops.dequantize(q, scale, torch.float32)
        assert (deq - x32).abs().le(scale * (0.5 + 1e-4)).all()  # round to nearest: half a step (+ fp32 rounding)
        nonzero = x32.abs().amax(-1) > 0
        assert q.abs().amax(-1)[nonzero].eq(127).all()  # each row's absmax maps to +-127
        assert q[~nonzero].eq(0).all()  # an all-zero row stays 0 (no 0/0)
        for dtype in (torch.float32, x.dtype):
            out = ops.dequantize(q, scale, dtype)
            assert out.dtype == dtype and torch.equal(out, ops.dequantize_int8_ref(q, scale, dtype))
        if x.shape[-1] >= 64 and bool((x32.abs().amax(-1) < 8 * x32.std(-1)).all()):  # Gaussian rows, no outlier
            assert sqnr_db(x32, deq) > 35.0  # int8 absmax on Gaussian rows gives about 38-40 dB
    check()


@pytest.mark.parametrize("device", DEVICES)
def test_int8_opcheck_property(device):
    @examples(device, cpu=3, cuda=3)
    @given(x=quant_cases(device))
    def check(x):
        torch.library.opcheck(torch.ops.fuseinfer.quantize_int8.default, (x, -1))
        q, scale = ops.quantize_per_token(x)
        torch.library.opcheck(torch.ops.fuseinfer.dequantize_int8.default, (q, scale, x.dtype))
    check()
