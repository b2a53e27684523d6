"""fuseinfer::attention_fp8out and fuseinfer::attention_int8out (attention whose output is quantized to e4m3 / int8
with a static scale in the prefill kernels' epilogue, fuseinfer/ops/attention_8bit_out.py): the references against an
independent float64 attention (hypothesis over shapes, grouped-query heads, masks and offsets; saturation; rows
without keys), the registrations (opcheck), bad input, the CUDA registrations' fallback run on the CPU; on a GPU
(marked), the wgmma and mma.sync prefill kernels against the reference within one 8-bit step, through their path
counts, the split-KV fallback, a graph-captured scale."""
from __future__ import annotations

import importlib

import pytest
import torch
from helpers import assert_graph_follows_scale, examples, given, paths_taken, require_kernel, st, wgmma_available
from torch.library import opcheck

from fuseinfer import FuseInferError
from fuseinfer.ops.attention import allowed_mask, attention, sm90_prefill
from fuseinfer.ops.attention_8bit_out import attention_8bit, attention_8bit_ref
from fuseinfer.ops.linear_8bit_out import FP8_DTYPE, FP8_MAX, quantize_fp8_static
from fuseinfer.ops.quant import quantize_int8_static

# opcheck's schema test compares float8 tensors with torch.allclose, which they do not implement
FP8_OPCHECK = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
MOD = importlib.import_module("fuseinfer.ops.attention_8bit_out")
FMTS = ["e4m3", "int8"]
QMAX = {"e4m3": FP8_MAX, "int8": 127.0}
DTYPE = {"e4m3": FP8_DTYPE, "int8": torch.int8}
QUANTIZE = {"e4m3": quantize_fp8_static, "int8": quantize_int8_static}


def op(fmt):
    return getattr(torch.ops.fuseinfer, MOD.FORMATS[fmt][2]).default


def step(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """The spacing of the format's values at |v| (in units of the scale): int8 1; e4m3 2^(floor(log2|v|) - 3) for
    normals, 2^-9 for subnormals."""
    if fmt == "int8":
        return torch.ones_like(v)
    return torch.pow(2.0, torch.floor(torch.log2(v.abs().clamp_min(2.0 ** -6))) - 3)


def case(b, h, hkv, sq, skv, d, dtype=torch.float32, device="cpu", pads=None, q_start=None, seed=0):
    """(q, k, v, key_mask, q_start): q (B, H, Sq, D), k, v (B, Hkv, Skv, D); pads: left padding per row."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, sq, d, generator=g)
    k, v = torch.randn(b, hkv, skv, d, generator=g), torch.randn(b, hkv, skv, d, generator=g)
    key_mask = None if pads is None else torch.arange(skv)[None] >= torch.tensor(pads)[:, None]  # (B, Skv)
    qs = None if q_start is None else torch.tensor(q_start, dtype=torch.int32)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(q.to(dtype)), to(k.to(dtype)), to(v.to(dtype)), to(key_mask), to(qs)


def float64_attention(q, k, v, key_mask, q_start, scale) -> torch.Tensor:
    """Independent: softmax(scale q k^T) v in float64 over the allowed keys, key/value heads repeated; rows without
    keys 0 -> (B, Sq, H, D)."""
    b, h, sq, _ = q.shape
    group = h // k.shape[1]
    k, v = (t.double().repeat_interleave(group, 1) for t in (k, v))  # (B, H, Skv, D)
    allowed = allowed_mask(key_mask, q_start, b, sq, k.shape[2], q.device)  # (B, 1, Sq, Skv)
    s = (q.double() @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # (rows without keys: NaN -> 0)
    return (p @ v).transpose(1, 2)


def static_scale(y: torch.Tensor, fmt: str, headroom: float = 1.0) -> torch.Tensor:
    return (y.abs().amax().float() / QMAX[fmt] * headroom).clamp_min(1e-12).reshape(1).to(y.device)


def target(y: torch.Tensor, s: torch.Tensor, fmt: str) -> torch.Tensor:
    """y / s in the format's range (float64)."""
    return (y / s.double()).clamp(-QMAX[fmt], QMAX[fmt])


# ------------------------------------------------------------------------------------------------------- CPU

@pytest.mark.parametrize("fmt", FMTS)
def test_reference_is_the_static_quantization_of_float64_attention(fmt):
    """Within half a step (plus fp32 error) of the float64 attention over out_scale, in the format's range (headroom
    < 1: the largest values saturate, never NaN); rows without an allowed key are exactly 0."""
    @examples("cpu", cpu=20, cuda=20)
    @given(b=st.integers(1, 2), hkv=st.integers(1, 3), group=st.sampled_from([1, 2, 4]), sq=st.integers(1, 40),
           extra=st.integers(0, 20), d=st.sampled_from([8, 16, 24, 64]), pad=st.integers(0, 5),
           headroom=st.sampled_from([1.0, 0.3]), seed=st.integers(0, 2 ** 16))
    def check(b, hkv, group, sq, extra, d, pad, headroom, seed):
        skv = sq + extra
        q, k, v, key_mask, q_start = case(b, hkv * group, hkv, sq, skv, d, pads=[min(pad, skv)] * b, seed=seed)
        scale = d ** -0.5
        y = float64_attention(q, k, v, key_mask, q_start, scale)
        s = static_scale(y, fmt, headroom)
        out = attention_8bit(q, k, v, key_mask, q_start, scale, s, fmt)
        assert out.dtype == DTYPE[fmt] and out.shape == (b, sq, hkv * group, d) and out.is_contiguous()
        t = target(y, s, fmt)
        assert ((out.double() - t).abs() <= step(t, fmt) / 2 + 1e-4 * (1 + t.abs())).all()
        assert not out.float().isnan().any()
        no_key = ~allowed_mask(key_mask, q_start, b, sq, skv, q.device).any(-1).view(b, sq)  # (B, Sq)
        assert (out.float()[no_key] == 0).all()
    check()


@pytest.mark.parametrize("fmt", FMTS)
def test_saturation_and_the_unfused_pair(fmt):
    """A scale below the values' range saturates them at the format's largest value; with room the reference is the
    static quantization of attention_ref in fp32 (what the unfused attention + quantize pair gives before its
    rounding to q's dtype)."""
    q, k, v, key_mask, q_start = case(2, 4, 2, 9, 12, 16, pads=[0, 3], q_start=[3, 2])
    ref32 = attention(q, k, v, key_mask, q_start, 0.25)
    small = static_scale(ref32.double(), fmt, 0.1)
    assert attention_8bit(q, k, v, key_mask, q_start, 0.25, small, fmt).float().abs().amax() == QMAX[fmt]
    s = static_scale(ref32, fmt)
    out = attention_8bit(q, k, v, key_mask, q_start, 0.25, s, fmt)
    assert torch.equal(out.view(torch.uint8), QUANTIZE[fmt](ref32, s).view(torch.uint8))


@pytest.mark.parametrize("fmt", FMTS)
def test_opcheck(fmt):
    for args in (case(1, 2, 2, 5, 5, 16), case(2, 4, 2, 3, 7, 8, pads=[0, 2], q_start=[4, 3]),
                 case(1, 3, 1, 17, 20, 64, dtype=torch.float16)):
        opcheck(op(fmt), (*args, 0.3, torch.tensor([0.01])), test_utils=FP8_OPCHECK)


@pytest.mark.parametrize("fmt", FMTS)
def test_bad_input_is_one_clear_error(fmt):
    q, k, v, key_mask, q_start = case(1, 2, 2, 4, 4, 8)
    s = torch.tensor([0.1])
    for bad in (torch.tensor([0.1, 0.2]), s.double(), None):
        with pytest.raises(FuseInferError, match="out_scale must be one fp32 value"):
            attention_8bit(q, k, v, out_scale=bad, fmt=fmt)
    with pytest.raises(FuseInferError, match="share one of"):
        attention_8bit(q, k.to(FP8_DTYPE), v.to(FP8_DTYPE), out_scale=s, fmt=fmt)
    with pytest.raises(FuseInferError, match="expected q"):
        attention_8bit(q, k[:, :, :, :4], v, out_scale=s, fmt=fmt)
    with pytest.raises(FuseInferError, match="key_mask must be"):
        attention_8bit(q, k, v, torch.ones(1, 3, dtype=torch.bool), out_scale=s, fmt=fmt)


@pytest.mark.parametrize("fmt", FMTS)
def test_cuda_registration_fallback_on_cpu(fmt):
    """The CUDA registration where no kernel writes 8 bits (run here on the CPU: SDPA, then the static quantize):
    within one step of the reference (the rounding to q's dtype in between may move a value to the next one)."""
    args = case(2, 4, 2, 20, 26, 16, pads=[0, 5])
    s = static_scale(attention(*args, 0.25), fmt)
    out = MOD._cuda(*args, 0.25, s, fmt)
    ref = attention_8bit_ref(*args, 0.25, s, fmt)
    assert out.shape == ref.shape and out.dtype == DTYPE[fmt]
    assert ((out.float() - ref.float()).abs() <= step(ref.float(), fmt)).all()
    assert not MOD.kernel_serves(args[0], args[1], fmt)


# ------------------------------------------------------------------------------------------------------- GPU

GPU_CASES = [  # (b, h, hkv, sq, skv, pads, q_start)
    dict(b=1, h=32, hkv=32, sq=2040, skv=2040),  # OPT-1.3b's prefill
    dict(b=2, h=12, hkv=12, sq=150, skv=576, pads=[0, 40], q_start=[0, 40]),  # a static cache, left padding
    dict(b=2, h=8, hkv=2, sq=37, skv=50),  # grouped-query heads, odd lengths
    dict(b=3, h=2, hkv=1, sq=17, skv=17),  # the fewest queries the prefill kernels take
]


def _gpu_case(c, d, dtype, seed=0):
    return case(c["b"], c["h"], c["hkv"], c["sq"], c["skv"], d, dtype, "cuda", c.get("pads"), c.get("q_start"), seed)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("c", GPU_CASES)
@pytest.mark.parametrize("wgmma", [True, False])
def test_gpu_kernels_match_the_reference(c, d, dtype, wgmma, fmt):
    """Each prefill kernel (asserted by its path count) writes 8-bit values within one step of the float64
    attention's value plus the low-precision rule's slack (twice PyTorch's own SDPA error in q's dtype: the kernel's
    P is rounded to q's dtype for the PV product, an error that can move a value across a rounding boundary, and
    that dominates where the values are small against the scale), equal to the fp32 reference's value for nearly
    every element, and to the dispatcher's call bit for bit."""
    from helpers import lowp_atol

    from fuseinfer.ops.attention import attention_sdpa

    require_kernel()
    if wgmma and not wgmma_available():
        pytest.skip("the wgmma prefill needs an sm_90 GPU and an sm_90a build")
    q, k, v, key_mask, q_start = _gpu_case(c, d, dtype)
    scale = d ** -0.5
    s = static_scale(attention(q, k, v, key_mask, q_start, scale).float(), fmt, 0.5)  # (the top values saturate)
    with sm90_prefill(wgmma):
        out, paths = paths_taken(lambda: attention_8bit(q, k, v, key_mask, q_start, scale, s, fmt))
        via_op = op(fmt)(q, k, v, key_mask, q_start, scale, s)
    assert paths == {f"attention.{'wgmma' if wgmma else 'mma_sync'}": 1}, paths
    assert torch.equal(out.view(torch.uint8), via_op.view(torch.uint8))
    y = float64_attention(q, k, v, key_mask, q_start, scale)  # (B, Sq, H, D)
    torch_err = (attention_sdpa(q, k, v, key_mask, q_start, scale).double() - y).abs().max().item()
    slack = (2 * torch_err + lowp_atol(y, dtype)) / s.item()  # (in units of the scale)
    t = target(y, s, fmt)
    assert out.dtype == DTYPE[fmt] and out.shape == y.shape and not out.float().isnan().any()
    err = (out.double() - t).abs()
    assert (err <= step(t, fmt) + slack).all(), (err - step(t, fmt)).max().item()
    ref = attention_8bit_ref(q, k, v, key_mask, q_start, scale, s, fmt)
    same = (out.view(torch.uint8) == ref.view(torch.uint8)).float().mean().item()
    print(f"{c} d{d} {dtype} {fmt} {'wgmma' if wgmma else 'mma.sync'}: {100 * same:.2f}% of the values equal the "
          f"reference's; slack {slack:.3g} scale units")
    assert same > (0.95 if dtype == torch.float16 else 0.85)  # (bf16's P: 3 fewer bits)
    assert out.float().abs().amax() == QMAX[fmt]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_decode_sized_and_other_head_dims_take_the_unfused_pair(dtype, fmt):
    """Up to 16 queries (split-KV) or a head dim the kernels do not take: attention, then the static quantize,
    exactly."""
    require_kernel()
    for c, d in ((dict(b=2, h=8, hkv=2, sq=16, skv=300), 64), (dict(b=1, h=4, hkv=4, sq=40, skv=40), 32)):
        q, k, v, key_mask, q_start = _gpu_case(c, d, dtype)
        assert not MOD.kernel_serves(q, k, fmt)
        s = torch.tensor([0.004], device="cuda")
        out = attention_8bit(q, k, v, key_mask, q_start, 0.2, s, fmt)
        ref = QUANTIZE[fmt](attention(q, k, v, key_mask, q_start, 0.2), s)
        assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
def test_gpu_opcheck(fmt):
    require_kernel()
    for c, d in ((GPU_CASES[2], 64), (GPU_CASES[3], 128)):
        args = _gpu_case(c, d, torch.float16)
        opcheck(op(fmt), (*args, d ** -0.5, torch.tensor([0.01], device="cuda")), test_utils=FP8_OPCHECK)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
def test_gpu_kernel_takes_a_graph_captured_scale(fmt):
    """The scale is read on the device: a CUDA graph captured once follows a changed scale."""
    require_kernel()
    q, k, v, key_mask, q_start = _gpu_case(GPU_CASES[1], 64, torch.float16)
    assert_graph_follows_scale(lambda s: attention_8bit(q, k, v, key_mask, q_start, 0.125, s, fmt),
                               torch.tensor([0.01], device="cuda"), (0.01, 0.003))
