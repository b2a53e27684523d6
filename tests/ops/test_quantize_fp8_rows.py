"""fuseinfer::quantize_fp8_per_token's CUDA kernel (the raw op quantize_fp8_rows, csrc/quant.cu): bit for bit against
quantize_fp8_ref over odd and round widths, fp16 / bf16 / fp32, all-zero rows, huge outliers, the +-448 boundary,
inf and NaN rows, hypothesis shapes; the public op routes CUDA calls to it (and non-contiguous or empty inputs to
the reference); opcheck on CPU and GPU. GPU tests are marked."""
from __future__ import annotations

import pytest
import torch
from helpers import examples, require_kernel
from hypothesis import given
from hypothesis import strategies as st

from fuseinfer.ops.fp8_linear import FP8_DTYPE, FP8_MAX, quantize_fp8_per_token, quantize_fp8_ref

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# opcheck's schema test compares inputs before / after with torch.allclose, which float8 tensors do not implement
FP8_OPCHECK = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def raw(x):
    """The kernel itself (no fallback): x (R, K) contiguous CUDA -> (q (R, K) e4m3, scale (R,) fp32)."""
    from fuseinfer.core.extension import extension

    require_kernel()
    ext = extension(x.device)
    if not hasattr(ext, "quantize_fp8_rows"):
        pytest.fail("the built extension has no quantize_fp8_rows: rebuild it")
    return ext.quantize_fp8_rows(x)


def assert_bits_equal(x):
    """The kernel's q and scale are the reference's, bit for bit (q compared as bytes: e4m3 has signed zeros)."""
    q, s = raw(x)
    rq, rs = quantize_fp8_ref(x, -1)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape and s.dtype == torch.float32 and s.shape == (x.shape[0],)
    assert torch.equal(s.view(torch.int32), rs.view(-1).view(torch.int32)), "scales differ"
    bad = (q.view(torch.uint8) != rq.view(torch.uint8)).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} bytes differ, first at {bad[0].tolist()}"


def rows(r, k, dtype, seed=0, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    # rows over many decades, so that scales (and the fast division's range) vary
    decades = torch.logspace(-4, 4, r, device="cuda")[torch.randperm(r, device="cuda", generator=g)]
    big = torch.finfo(dtype).max / 2  # (finite: inf rows have their own test)
    return (torch.randn(r, k, device="cuda", generator=g) * decades[:, None] * scale).clamp(-big, big).to(dtype)


# ------------------------------------------------------------------------------------------------------------ CPU

def test_public_op_on_cpu_is_the_reference():
    x = torch.randn(3, 5, 40, dtype=torch.bfloat16)
    q, s = quantize_fp8_per_token(x)
    rq, rs = quantize_fp8_ref(x, -1)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs) and s.shape == (3, 5, 1)


@pytest.mark.parametrize("shape,dtype", [((4, 16), torch.float32), ((2, 3, 40), torch.float16),
                                         ((1, 7), torch.bfloat16), ((9,), torch.float16)])
def test_opcheck(shape, dtype, device):
    x = torch.randn(*shape).to(dtype).to(device)
    torch.library.opcheck(torch.ops.fuseinfer.quantize_fp8_per_token.default, (x,), test_utils=FP8_OPCHECK)


# ------------------------------------------------------------------------------------------------------------ GPU

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 7, 100, 2048, 5120, 8192])
@pytest.mark.parametrize("r", [1, 3, 129, 4096])
def test_kernel_bits_equal_reference(r, k, dtype):
    assert_bits_equal(rows(r, k, dtype, seed=r + k))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [7, 96, 8192])
def test_zero_rows_outliers_and_the_448_boundary(k, dtype):
    x = rows(8, k, dtype)
    x[0] = 0  # all zero: scale FLT_MIN, q = 0
    x[1] = -0.0  # negative zeros keep their sign
    x[2, k // 2] = 6e4 if dtype == torch.float16 else 3e37  # a huge outlier: the rest of the row near or at 0
    x[3] = torch.linspace(-1, 1, k, device="cuda").to(dtype)  # +-amax exactly: q = +-448
    x[4, :] = 448.0
    x[4, ::2] = -448.0  # amax 448: scale 1, q = x (the saturation boundary itself)
    x[5] = (torch.arange(k, device="cuda") % 17 - 8).to(dtype) * 2.0 ** -20  # small values
    x[6] = torch.finfo(dtype).tiny * (torch.arange(k, device="cuda") % 3 - 1).to(dtype)  # smallest normals
    x[7, 0] = torch.finfo(dtype).max  # the dtype's largest value
    assert_bits_equal(x.contiguous())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_inf_and_nan_rows(dtype):
    """inf: scale inf, finite values 0, inf / inf NaN, as the reference; a NaN anywhere in a row makes its scale and
    every q NaN, as the reference's amax and clamp do (compared as NaN, whose sign bit the two may set apart)."""
    x = rows(4, 40, dtype)
    x[0, 3] = float("inf")
    x[1, 5] = float("nan")
    x[2, 0] = float("-inf")
    q, s = raw(x)
    rq, rs = quantize_fp8_ref(x, -1)
    assert torch.equal(s.isnan(), rs.view(-1).isnan()) and s[1].isnan()
    assert torch.equal(s[~s.isnan()], rs.view(-1)[~s.isnan()])
    qf, rqf = q.float(), rq.float()
    assert torch.equal(qf.isnan(), rqf.isnan()) and qf[1].isnan().all()
    assert torch.equal(qf[~qf.isnan()], rqf[~rqf.isnan()])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_unaligned_rows_take_the_scalar_path(dtype):
    """x at an offset that is not 16-byte aligned (and widths that are not a multiple of a 16-byte pack)."""
    base = rows(33, 4097, dtype).view(-1)
    assert_bits_equal(base[1:1 + 32 * 4096].view(32, 4096))
    assert_bits_equal(base[: 33 * 4097].view(33, 4097))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_hypothesis_shapes_bit_exact(dtype):
    require_kernel()

    @examples("cuda", 0, 60)
    @given(r=st.integers(1, 300), k=st.integers(1, 3000), seed=st.integers(0, 2 ** 16),
           e=st.integers(-40, 40))
    def check(r, k, seed, e):
        assert_bits_equal(rows(r, k, dtype, seed, scale=2.0 ** e))

    check()


@pytest.mark.gpu
def test_public_op_calls_the_kernel(monkeypatch):
    """quantize_fp8_per_token on CUDA takes the kernel for contiguous fp16/bf16/fp32 inputs of any leading shape,
    and the reference for non-contiguous and empty ones (same bits either way)."""
    from fuseinfer.core import extension as _ext

    require_kernel()
    calls = []

    class Recording:
        def __init__(self, ext):
            self.ext = ext

        def __getattr__(self, name):
            attr = getattr(self.ext, name)
            return (lambda *a: calls.append(name) or attr(*a)) if name == "quantize_fp8_rows" else attr

    monkeypatch.setattr(_ext, "_ext", Recording(_ext.extension()))
    x = torch.randn(2, 5, 96, device="cuda", dtype=torch.float16)
    q, s = quantize_fp8_per_token(x)
    rq, rs = quantize_fp8_ref(x, -1)
    assert calls == ["quantize_fp8_rows"] and q.shape == (2, 5, 96) and s.shape == (2, 5, 1)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    calls.clear()
    xt = torch.randn(96, 10, device="cuda").t()  # non-contiguous
    q, s = quantize_fp8_per_token(xt)
    assert calls == [] and torch.equal(q.view(torch.uint8), quantize_fp8_ref(xt, -1)[0].view(torch.uint8))
    q, s = quantize_fp8_per_token(torch.empty(0, 8, device="cuda"))
    assert calls == [] and q.shape == (0, 8) and s.shape == (0, 1)
