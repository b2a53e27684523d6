"""fuseinfer::rms_norm_linear and fuseinfer::rms_norm_linear_rope_append (fuseinfer/ops/norm_linear.py): RMSNorm
folded into the next linear. On every device: equal to add_rms_norm then the linear op (linear_epilogue, or
linear_rope_append), bad input, the registrations (opcheck), a property test over odd shapes; on CUDA: one kernel
(the decode GEMV with its RMSNorm prologue) within the dtype rule of the fp32 reference and next to bit-equal to the
two kernels, with every epilogue; the knob off, prefill sizes and rows too large for shared memory run the two ops;
a CUDA graph. (tests/ops/test_linear.py checks every built GEMV kernel, these included, for local memory.)"""
from __future__ import annotations

import pytest
import torch
from helpers import DEVICES, LOWP, assert_lowp_close, assert_rejects_each, cuda_kernel_names, examples, given, \
    lowp_atol, require_kernel, rope_cache_inputs, st

from fuseinfer import ops


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _norm(x, nw, eps):
    return ops.add_rms_norm(x, None, nw, eps)[0]


def _case(device, dtype, m=3, k=64, n=48, bias=False, residual=False, activation="none", scale=3.0):
    """(x, norm_weight, eps, weight, bias, residual, activation): rows of RMS ~scale (the norm must matter)."""
    x = (torch.randn(m, k, device=device) * scale).to(dtype)
    nw = (1 + 0.5 * torch.randn(k, device=device)).to(dtype)
    w = (torch.randn(n, k, device=device) * k ** -0.5).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    out = n // 2 if activation == "silu_mul" else n
    r = torch.randn(m, out, device=device).to(dtype) if residual else None
    return [x, nw, 1e-5, w, b, r, activation]


def _pair(args):
    x, nw, eps, w, b, r, act = args
    return ops.linear_epilogue(_norm(x, nw, eps), w, b, r, act)


def _rope_case(device, dtype, b=2, s=1, k=64, heads=4, kv_heads=2, d=32, t=10, bias=False, rotate=True):
    """(x, norm_weight, eps, weight, bias, cos, sin, H, Hkv, k_cache, v_cache, slots); slots s..: the last past the
    cache (skipped)."""
    n = (heads + 2 * kv_heads) * d
    x = (torch.randn(b, s, k, device=device) * 3).to(dtype)
    nw = (1 + 0.5 * torch.randn(k, device=device)).to(dtype)
    w = (torch.randn(n, k, device=device) * k ** -0.5).to(dtype)
    bb = torch.randn(n, device=device).to(dtype) if bias else None
    cos, sin, k_cache, v_cache, slots = rope_cache_inputs(device, dtype, b, s, d, kv_heads, t, rotate)
    return [x, nw, 1e-6, w, bb, cos, sin, heads, kv_heads, k_cache, v_cache, slots]


def _rope_ours(args):
    args = list(args)
    args[9], args[10] = args[9].clone(), args[10].clone()
    return ops.rms_norm_linear_rope_append(*args), args[9], args[10]


def _rope_pair(args):
    x, nw, eps, w, b, cos, sin, h, hkv, kc, vc, slots = args
    kc, vc = kc.clone(), vc.clone()
    return ops.linear_rope_append(_norm(x, nw, eps), w, None, b, cos, sin, h, hkv, kc, vc, slots), kc, vc


# ---- every device ----

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ["none", "relu", "silu_mul"])
def test_equals_add_rms_norm_then_linear_epilogue(device, activation):
    dtype = torch.float32 if device == "cpu" else torch.float16
    args = _case(device, dtype, bias=True, residual=activation == "none", activation=activation)
    ours = ops.rms_norm_linear(*args)
    assert torch.equal(ours, _pair(args))
    # the norm is applied: without it the result differs
    assert not torch.allclose(ours, ops.linear_epilogue(args[0], *args[3:]), atol=1e-2)


def test_reference_is_transformers_rms_norm_then_the_linear():
    """The reference against transformers' LlamaRMSNorm and F.linear, in fp16 on the CPU (the rounding points)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, nw, eps, w, b, r, act = _case("cpu", torch.float16, m=4, k=96, n=40, bias=True)
    norm = LlamaRMSNorm(96, eps=eps).half()
    norm.weight.data.copy_(nw)
    with torch.no_grad():
        expect = torch.nn.functional.linear(norm(x), w, b)
    assert torch.equal(ops.rms_norm_linear_ref(x, nw, eps, w, b, None, "none"), expect)
    assert torch.equal(ops.rms_norm_linear(x, nw, eps, w, b), expect)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rotate", [True, False])
def test_rope_equals_add_rms_norm_then_linear_rope_append(device, rotate):
    dtype = torch.float32 if device == "cpu" else torch.float16
    args = _rope_case(device, dtype, bias=True, rotate=rotate)
    ours, pair = _rope_ours(args), _rope_pair(args)
    for a, p in zip(ours, pair):
        assert torch.equal(a, p)
    assert not torch.equal(ours[1], args[9])  # the cache was written


def test_rejects_bad_input():
    args = _case("cpu", torch.float32)
    bad = [(1, torch.ones(63)), (1, torch.ones(64, dtype=torch.float16)), (3, torch.ones(48, 32)),
           (6, "gelu"), (4, torch.ones(7))]
    assert_rejects_each(ops.rms_norm_linear, args, bad)
    rargs = _rope_case("cpu", torch.float32)
    assert_rejects_each(ops.rms_norm_linear_rope_append, rargs,
                        [(0, torch.ones(2, 64)), (1, torch.ones(32)), (3, rargs[3].half()), (7, 3), (6, None)],
                        match="rms_norm_linear_rope_append|linear_rope_append")


def test_gradients_are_the_two_ops():
    args = _case("cpu", torch.float64, bias=True)
    x, nw, w = (args[i].detach().requires_grad_() for i in (0, 1, 3))
    args[0], args[1], args[3] = x, nw, w
    ours = torch.autograd.grad(ops.rms_norm_linear(*args).square().sum(), (x, nw, w))
    ref = torch.autograd.grad(ops.rms_norm_linear_ref(*args).square().sum(), (x, nw, w))
    for a, r in zip(ours, ref):
        torch.testing.assert_close(a, r)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ["none", "silu_mul"])
def test_opcheck(device, activation):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    args = _case(device, dtype, bias=True, residual=activation == "none", activation=activation)
    torch.library.opcheck(torch.ops.fuseinfer.rms_norm_linear.default, tuple(args))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rotate", [True, False])
def test_opcheck_rope(device, rotate):
    args = _rope_case(device, torch.float32 if device == "cpu" else torch.bfloat16, bias=True, rotate=rotate)
    torch.library.opcheck(torch.ops.fuseinfer.rms_norm_linear_rope_append.default, tuple(args))


@pytest.mark.parametrize("device", DEVICES)
def test_equals_the_pair_property(device):
    """Drawn rows (decode 1-16, prefill), odd K and N, epilogue, bias, residual, dtype: on the CPU (the references)
    bit-equal to add_rms_norm then linear_epilogue; on CUDA within the dtype rule of the fp32 reference."""
    @examples(device, cpu=20, cuda=150)
    @given(m=st.sampled_from([1, 2, 5, 8, 9, 16, 40]), k=st.sampled_from([8, 24, 200, 264, 2048]),
           n=st.sampled_from([2, 18, 64, 130]), activation=st.sampled_from(["none", "relu", "silu_mul"]),
           bias=st.booleans(), residual=st.booleans(),
           dtype=st.sampled_from([torch.float32, *LOWP] if device == "cpu" else [*LOWP, torch.float32]))
    def check(m, k, n, activation, bias, residual, dtype):
        args = _case(device, dtype, m=m, k=k, n=n, bias=bias, residual=residual and activation == "none",
                     activation=activation)
        ours = ops.rms_norm_linear(*args)
        if device == "cpu":
            assert torch.equal(ours, _pair(args))
        else:
            _within_rule(ours, args)
    check()


@pytest.mark.parametrize("device", DEVICES)
def test_rope_equals_the_pair_property(device):
    @examples(device, cpu=10, cuda=100)
    @given(b=st.integers(1, 4), s=st.sampled_from([1, 1, 2, 9]), k=st.sampled_from([16, 48, 272, 2048]),
           heads=st.sampled_from([(2, 1), (4, 2), (8, 1)]), d=st.sampled_from([16, 64, 40]), bias=st.booleans(),
           rotate=st.booleans(),
           dtype=st.sampled_from([torch.float32, *LOWP] if device == "cpu" else [*LOWP, torch.float32]))
    def check(b, s, k, heads, d, bias, rotate, dtype):
        args = _rope_case(device, dtype, b=b, s=s, k=k, heads=heads[0], kv_heads=heads[1], d=d, t=12, bias=bias,
                          rotate=rotate)
        ours, pair = _rope_ours(args), _rope_pair(args)
        if device == "cpu":
            for a, p in zip(ours, pair):
                assert torch.equal(a, p)
        else:
            _rope_within_rule(ours, pair, args)
    check()


# ---- CUDA ----

def _within_rule(ours, args):
    """|ours - ref32| <= 2 |torch_in_dtype - ref32| + lowp_atol, ref32 the fp32 reference over the same inputs."""
    ref = ops.rms_norm_linear_ref(*[a.float() if isinstance(a, torch.Tensor) else a for a in args])
    torch_lowp = ops.rms_norm_linear_ref(*args)
    assert_lowp_close(ours, torch_lowp, ref, "rms_norm_linear", lowp_atol(ref, ours.dtype))


def _rope_within_rule(ours, pair, args):
    """q and the written caches: within the dtype rule of the fp32 reference (the pair of kernels stands in for
    PyTorch in the dtype: it rounds as the reference does)."""
    f32 = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    f32[9], f32[10] = f32[9].clone(), f32[10].clone()
    ref = (ops.rms_norm_linear_rope_append_ref(*f32), f32[9], f32[10])
    for what, a, p, r in zip(("q", "k cache", "v cache"), ours, pair, ref):
        assert_lowp_close(a, p, r, what, lowp_atol(r, a.dtype))


def _bits_differ(a, b) -> float:
    return (a != b).float().mean().item()


# Llama-3.2-1B's gate/up (F 8192, K 2048) and q/k/v at 1, 8 and 16 rows; K with a partial last k-block; Qwen2-0.5B's
# K 896 with biases
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("shape", [(2048, 2 * 8192, "silu_mul"), (2048, 3072, "none"), (1040, 96, "silu_mul"),
                                   (896, 1152, "none"), (200, 40, "relu")])
@pytest.mark.parametrize("dtype", LOWP)
def test_decode_is_one_kernel_within_the_rule(m, shape, dtype):
    require_kernel()
    k, n, act = shape
    args = _case("cuda", dtype, m=m, k=k, n=n, bias=k == 896, residual=act == "none" and k != 896, activation=act)
    names = cuda_kernel_names(lambda: ops.rms_norm_linear(*args))
    assert len(names) == 1 and "skinny" in names[0], names  # no norm kernel, no silu_mul kernel
    ours = ops.rms_norm_linear(*args)
    _within_rule(ours, args)
    pair = _pair(args)
    # the prologue rounds as add_rms_norm; only its sum of squares runs in another order (a rare 1-ulp rstd step)
    assert _bits_differ(ours, pair) < 0.02, _bits_differ(ours, pair)
    assert torch.equal(ops.rms_norm_linear(*args), ours)  # deterministic


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("shape", [(32, 8, 64, 2048), (14, 2, 64, 896), (4, 2, 32, 1040), (32, 8, 128, 4096)])
@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("rotate", [True, False])
def test_rope_decode_is_one_kernel_within_the_rule(rows, shape, dtype, rotate):
    require_kernel()
    heads, kv_heads, d, k = shape
    args = _rope_case("cuda", dtype, b=rows, s=1, k=k, heads=heads, kv_heads=kv_heads, d=d, t=20, bias=heads == 14,
                      rotate=rotate)
    names = cuda_kernel_names(lambda: _rope_ours(args))
    gemv = [n for n in names if "skinny" in n]
    assert len(gemv) == 1 and not any("rope" in n or "append" in n or "rows" in n for n in names), names
    ours, pair = _rope_ours(args), _rope_pair(args)
    _rope_within_rule(ours, pair, args)
    assert _bits_differ(ours[0], pair[0]) < 0.02


@pytest.mark.gpu
def test_knob_off_runs_the_norm_then_the_gemv(set_knob):
    require_kernel()
    args = _case("cuda", torch.float16, m=2, k=256, n=64, activation="silu_mul")
    rargs = _rope_case("cuda", torch.float16, b=2, k=256, heads=8, kv_heads=2, d=64)
    set_knob("FUSEINFER_GEMV_EPILOGUES", "0")
    names = cuda_kernel_names(lambda: ops.rms_norm_linear(*args))
    assert len(names) >= 2 and "rows" in names[0] and "skinny" in names[1], names
    assert torch.equal(ops.rms_norm_linear(*args), _pair(args))
    for a, p in zip(_rope_ours(rargs), _rope_pair(rargs)):
        assert torch.equal(a, p)


@pytest.mark.gpu
def test_prefill_and_rows_beyond_shared_memory_run_the_pair():
    """40 rows (cuBLASLt) and 16 rows of K 16384 (the staged rows would not fit shared memory): the two ops,
    bit-equal to them."""
    require_kernel()
    for m, k in ((40, 256), (16, 16384)):
        args = _case("cuda", torch.bfloat16, m=m, k=k, n=64)
        names = cuda_kernel_names(lambda: ops.rms_norm_linear(*args))  # noqa: B023
        assert any("rows" in n for n in names), names
        assert torch.equal(ops.rms_norm_linear(*args), _pair(args))


@pytest.mark.gpu
def test_in_a_cuda_graph():
    """Captured and replayed: the replay reads the new rows."""
    require_kernel()
    args = _case("cuda", torch.float16, m=1, k=2048, n=2 * 512, activation="silu_mul")
    ops.rms_norm_linear(*args)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = ops.rms_norm_linear(*args)
    args[0].copy_(torch.randn_like(args[0]) * 5)
    graph.replay()
    assert torch.equal(y, ops.rms_norm_linear(*args))
    _within_rule(y, args)
