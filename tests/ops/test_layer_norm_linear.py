"""fuseinfer::layer_norm_linear and fuseinfer::layer_norm_linear_append (fuseinfer/ops/layer_norm_linear.py): LayerNorm
folded into the next linear (OPT's pre-LN norms -> fc1 and -> q/k/v + the cache write), with fp16 / bf16 or int8
(W8A16) weights. On every device: equal to add_layer_norm then the linear op (linear_epilogue / w8a16_linear, or
linear_rope_append without rotation), bad input, the registrations (opcheck), a property test over odd shapes; on
CUDA: one kernel (the decode GEMV with its LayerNorm prologue) within the dtype rule of the fp32 reference and next
to bit-equal to the two kernels; the knob off, prefill sizes and rows too large for shared memory run the two ops; a
CUDA graph."""
from __future__ import annotations

import pytest
import torch
from helpers import DEVICES, LOWP, assert_lowp_close, assert_rejects_each, cuda_kernel_names, examples, given, \
    lowp_atol, require_kernel, rope_cache_inputs, st

from fuseinfer import ops


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _norm(x, lw, lb, eps):
    return ops.add_layer_norm(x, None, lw, lb, eps)[0]


def _rows(shape, device, dtype, scale=3.0):
    """Rows with a mean offset and an outlier channel (OPT's residual stream): the mean and the variance matter."""
    x = torch.randn(*shape, device=device) * scale + 2.0
    x[..., 1] = 40.0
    return x.to(dtype)


def _affine(k, device, dtype):
    return (1 + 0.5 * torch.randn(k, device=device)).to(dtype), (0.3 * torch.randn(k, device=device)).to(dtype)


def _weight(n, k, device, dtype, int8):
    w = torch.randn(n, k, device=device) * k ** -0.5
    if int8:
        q, scale = ops.quantize_per_channel(w)
        return q, scale.view(-1)
    return w.to(dtype), None


def _case(device, dtype, m=3, k=64, n=48, int8=False, bias=False, residual=False, activation="none"):
    """(x, ln_weight, ln_bias, eps, weight, scale, bias, residual, activation)."""
    x = _rows((m, k), device, dtype)
    lw, lb = _affine(k, device, dtype)
    w, scale = _weight(n, k, device, dtype, int8)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    out = n // 2 if activation == "silu_mul" else n
    r = torch.randn(m, out, device=device).to(dtype) if residual else None
    return [x, lw, lb, 1e-5, w, scale, b, r, activation]


def _pair(args):
    x, lw, lb, eps, w, scale, b, r, act = args
    y = _norm(x, lw, lb, eps)
    return ops.w8a16_linear(y, w, scale, b, r, act) if w.dtype == torch.int8 else ops.linear_epilogue(y, w, b, r, act)


def _append_case(device, dtype, b=2, s=1, k=64, heads=4, kv_heads=2, d=32, t=10, int8=False, bias=False):
    """(x, ln_weight, ln_bias, eps, weight, scale, bias, H, Hkv, k_cache, v_cache, slots); slots s..: the last past
    the cache (skipped)."""
    n = (heads + 2 * kv_heads) * d
    x = _rows((b, s, k), device, dtype)
    lw, lb = _affine(k, device, dtype)
    w, scale = _weight(n, k, device, dtype, int8)
    bb = torch.randn(n, device=device).to(dtype) if bias else None
    _, _, k_cache, v_cache, slots = rope_cache_inputs(device, dtype, b, s, d, kv_heads, t, False)
    return [x, lw, lb, 1e-5, w, scale, bb, heads, kv_heads, k_cache, v_cache, slots]


def _append_ours(args):
    args = list(args)
    args[9], args[10] = args[9].clone(), args[10].clone()
    return ops.layer_norm_linear_append(*args), args[9], args[10]


def _append_pair(args):
    x, lw, lb, eps, w, scale, b, h, hkv, kc, vc, slots = args
    kc, vc = kc.clone(), vc.clone()
    return ops.linear_rope_append(_norm(x, lw, lb, eps), w, scale, b, None, None, h, hkv, kc, vc, slots), kc, vc


# ---- every device ----

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("activation", ["none", "relu"])
def test_equals_add_layer_norm_then_the_linear(device, int8, activation):
    dtype = torch.float32 if device == "cpu" else torch.float16
    args = _case(device, dtype, int8=int8, bias=True, residual=activation == "none", activation=activation)
    ours = ops.layer_norm_linear(*args)
    assert torch.equal(ours, _pair(args))
    # the norm is applied: without it the result differs
    plain = _pair([args[0], torch.ones_like(args[1]), torch.zeros_like(args[2]), *args[3:]])
    assert not torch.allclose(ours, plain, atol=1e-2)


def test_reference_is_torch_layer_norm_then_the_linear():
    """The reference against nn.LayerNorm and F.linear, in fp16 on the CPU (the rounding points)."""
    x, lw, lb, eps, w, _, b, _, _ = _case("cpu", torch.float16, m=4, k=96, n=40, bias=True)
    norm = torch.nn.LayerNorm(96, eps=eps).half()
    norm.weight.data.copy_(lw)
    norm.bias.data.copy_(lb)
    with torch.no_grad():
        expect = torch.nn.functional.linear(norm(x), w, b)
    assert torch.equal(ops.layer_norm_linear_ref(x, lw, lb, eps, w, None, b, None, "none"), expect)
    assert torch.equal(ops.layer_norm_linear(x, lw, lb, eps, w, None, b), expect)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("int8", [False, True])
def test_append_equals_add_layer_norm_then_linear_rope_append(device, int8):
    dtype = torch.float32 if device == "cpu" else torch.float16
    args = _append_case(device, dtype, int8=int8, bias=True)
    ours, pair = _append_ours(args), _append_pair(args)
    for a, p in zip(ours, pair):
        assert torch.equal(a, p)
    assert not torch.equal(ours[1], args[9])  # the cache was written


def test_rejects_bad_input():
    args = _case("cpu", torch.float32)
    bad = [(1, torch.ones(63)), (2, torch.ones(64, dtype=torch.float16)), (4, torch.ones(48, 32)),
           (8, "gelu"), (6, torch.ones(7)), (5, torch.ones(48))]  # (5: scales with a float weight)
    assert_rejects_each(ops.layer_norm_linear, args, bad)
    assert_rejects_each(ops.layer_norm_linear, _case("cpu", torch.float32, int8=True), [(5, None), (5, torch.ones(7))])
    aargs = _append_case("cpu", torch.float32)
    assert_rejects_each(ops.layer_norm_linear_append, aargs,
                        [(0, torch.ones(2, 64)), (1, torch.ones(32)), (2, torch.ones(64, dtype=torch.float16)),
                         (4, aargs[4].half()), (7, 3)], match="layer_norm_linear_append|linear_rope_append")


def test_gradients_are_the_two_ops():
    args = _case("cpu", torch.float64, bias=True)
    x, lw, lb, w = (args[i].detach().requires_grad_() for i in (0, 1, 2, 4))
    args[0], args[1], args[2], args[4] = x, lw, lb, w
    ours = torch.autograd.grad(ops.layer_norm_linear(*args).square().sum(), (x, lw, lb, w))
    ref = torch.autograd.grad(ops.layer_norm_linear_ref(*args).square().sum(), (x, lw, lb, w))
    for a, r in zip(ours, ref):
        torch.testing.assert_close(a, r)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("activation", ["none", "relu"])
def test_opcheck(device, int8, activation):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    args = _case(device, dtype, int8=int8, bias=True, residual=activation == "none", activation=activation)
    torch.library.opcheck(torch.ops.fuseinfer.layer_norm_linear.default, tuple(args))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("int8", [False, True])
def test_opcheck_append(device, int8):
    args = _append_case(device, torch.float32 if device == "cpu" else torch.bfloat16, int8=int8, bias=True)
    torch.library.opcheck(torch.ops.fuseinfer.layer_norm_linear_append.default, tuple(args))


@pytest.mark.parametrize("device", DEVICES)
def test_equals_the_pair_property(device):
    """Drawn rows (decode 1-16, prefill), odd K (not a multiple of 64) and N, weights, epilogue, bias, residual,
    dtype: on the CPU (the references) bit-equal to add_layer_norm then the linear; on CUDA within the dtype rule of
    the fp32 reference."""
    @examples(device, cpu=20, cuda=150)
    @given(m=st.sampled_from([1, 3, 8, 9, 16, 40]), k=st.sampled_from([16, 48, 208, 272, 2048]),
           n=st.sampled_from([2, 18, 64, 130]), int8=st.booleans(), activation=st.sampled_from(["none", "relu"]),
           bias=st.booleans(), residual=st.booleans(),
           dtype=st.sampled_from([torch.float32, *LOWP] if device == "cpu" else [*LOWP, torch.float32]))
    def check(m, k, n, int8, activation, bias, residual, dtype):
        args = _case(device, dtype, m=m, k=k, n=n, int8=int8, bias=bias, residual=residual and activation == "none",
                     activation=activation)
        ours = ops.layer_norm_linear(*args)
        if device == "cpu":
            assert torch.equal(ours, _pair(args))
        else:
            _within_rule(ours, args)
    check()


@pytest.mark.parametrize("device", DEVICES)
def test_append_equals_the_pair_property(device):
    @examples(device, cpu=10, cuda=100)
    @given(b=st.sampled_from([1, 3, 8, 16]), s=st.sampled_from([1, 1, 2]), k=st.sampled_from([16, 48, 272, 2048]),
           heads=st.sampled_from([(2, 1), (4, 2), (4, 4)]), d=st.sampled_from([16, 64, 40]), int8=st.booleans(),
           bias=st.booleans(),
           dtype=st.sampled_from([torch.float32, *LOWP] if device == "cpu" else [*LOWP, torch.float32]))
    def check(b, s, k, heads, d, int8, bias, dtype):
        args = _append_case(device, dtype, b=b, s=s, k=k, heads=heads[0], kv_heads=heads[1], d=d, t=12, int8=int8,
                            bias=bias)
        ours, pair = _append_ours(args), _append_pair(args)
        if device == "cpu":
            for a, p in zip(ours, pair):
                assert torch.equal(a, p)
        else:
            _append_within_rule(ours, pair, args)
    check()


# ---- CUDA ----

def _f32(args):
    """The fp32 reference's operands: float tensors widened (an int8 weight stays, its scales are fp32 already)."""
    return [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]


def _within_rule(ours, args):
    """|ours - ref32| <= 2 |torch_in_dtype - ref32| + lowp_atol, ref32 the fp32 reference over the same inputs."""
    ref = ops.layer_norm_linear_ref(*_f32(args))
    torch_lowp = ops.layer_norm_linear_ref(*args)
    assert_lowp_close(ours, torch_lowp, ref, "layer_norm_linear", lowp_atol(ref, ours.dtype))


def _append_within_rule(ours, pair, args):
    """q and the written caches: within the dtype rule of the fp32 reference (the pair of kernels stands in for
    PyTorch in the dtype: it rounds as the reference does)."""
    f32 = _f32(args)
    f32[9], f32[10] = f32[9].clone(), f32[10].clone()
    ref = (ops.layer_norm_linear_append_ref(*f32), f32[9], f32[10])
    for what, a, p, r in zip(("q", "k cache", "v cache"), ours, pair, ref):
        assert_lowp_close(a, p, r, what, lowp_atol(r, a.dtype))


BITS_DIFFER = 0.05  # the share of outputs whose bits may differ from add_layer_norm + the GEMV (see the tests)


def _bits_differ(a, b) -> float:
    return (a != b).float().mean().item()


# OPT-1.3b's fc1 (K 2048, N 8192, ReLU) and q/k/v-sized plain GEMVs, OPT-125m's K 768, a K with a partial last
# k-block (1040), a small odd one; fp16 / bf16 and int8 weights; 1, 3, 8 and 16 rows
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("shape", [(2048, 8192, "relu"), (2048, 2048, "none"), (768, 3072, "relu"),
                                   (1040, 96, "none"), (208, 40, "relu")])
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("dtype", LOWP)
def test_decode_is_one_kernel_within_the_rule(m, shape, int8, dtype):
    require_kernel()
    k, n, act = shape
    args = _case("cuda", dtype, m=m, k=k, n=n, int8=int8, bias=True, residual=act == "none", activation=act)
    names = cuda_kernel_names(lambda: ops.layer_norm_linear(*args))
    assert len(names) == 1 and "skinny" in names[0], names  # no norm kernel
    ours = ops.layer_norm_linear(*args)
    _within_rule(ours, args)
    pair = _pair(args)
    # the prologue rounds as add_layer_norm; only its fp32 sums run in another order (a 1-ulp mean / rstd step
    # moves a row's roundings: up to ~3% of outputs seen at K 4096; the tolerance rule above is the accuracy check)
    assert _bits_differ(ours, pair) < BITS_DIFFER, _bits_differ(ours, pair)
    assert torch.equal(ops.layer_norm_linear(*args), ours)  # deterministic


# OPT-1.3b's (32 heads of 64, K 2048), OPT-125m's (12 of 64, K 768), OPT-6.7b's (32 of 128, K 4096), a K with a
# partial last k-block
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 8, 16])
@pytest.mark.parametrize("shape", [(32, 64, 2048), (12, 64, 768), (32, 128, 4096), (4, 32, 1040)])
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("dtype", LOWP)
def test_append_decode_is_one_kernel_within_the_rule(rows, shape, int8, dtype):
    require_kernel()
    heads, d, k = shape
    args = _append_case("cuda", dtype, b=rows, s=1, k=k, heads=heads, kv_heads=heads, d=d, t=20, int8=int8,
                        bias=True)
    names = cuda_kernel_names(lambda: _append_ours(args))
    gemv = [n for n in names if "skinny" in n]
    assert len(gemv) == 1 and not any("append" in n or "rows" in n for n in names), names
    ours, pair = _append_ours(args), _append_pair(args)
    _append_within_rule(ours, pair, args)
    assert _bits_differ(ours[0], pair[0]) < BITS_DIFFER


@pytest.mark.gpu
def test_knob_off_runs_the_norm_then_the_gemv(set_knob):
    require_kernel()
    args = _case("cuda", torch.float16, m=2, k=256, n=64, activation="relu")
    iargs = _case("cuda", torch.float16, m=2, k=256, n=64, int8=True, activation="relu")
    aargs = _append_case("cuda", torch.float16, b=2, k=256, heads=8, kv_heads=8, d=64, int8=True)
    set_knob("FUSEINFER_GEMV_EPILOGUES", "0")
    names = cuda_kernel_names(lambda: ops.layer_norm_linear(*args))
    assert len(names) >= 2 and "rows" in names[0] and "skinny" in names[1], names
    assert torch.equal(ops.layer_norm_linear(*args), _pair(args))
    assert torch.equal(ops.layer_norm_linear(*iargs), _pair(iargs))
    for a, p in zip(_append_ours(aargs), _append_pair(aargs)):
        assert torch.equal(a, p)


@pytest.mark.gpu
@pytest.mark.parametrize("int8", [False, True])
def test_prefill_and_rows_beyond_shared_memory_run_the_pair(int8):
    """40 rows (the GEMM) and 16 rows of K 16384 (the staged rows would not fit shared memory): the two ops,
    bit-equal to them."""
    require_kernel()
    for m, k in ((40, 256), (16, 16384)):
        args = _case("cuda", torch.bfloat16, m=m, k=k, n=64, int8=int8)
        names = cuda_kernel_names(lambda: ops.layer_norm_linear(*args))  # noqa: B023
        assert any("rows" in n for n in names), names
        assert torch.equal(ops.layer_norm_linear(*args), _pair(args))


@pytest.mark.gpu
@pytest.mark.parametrize("int8", [False, True])
def test_in_a_cuda_graph(int8):
    """Captured and replayed: the replay reads the new rows."""
    require_kernel()
    args = _case("cuda", torch.float16, m=1, k=2048, n=8192, int8=int8, bias=True, activation="relu")
    ops.layer_norm_linear(*args)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = ops.layer_norm_linear(*args)
    args[0].copy_(_rows(args[0].shape, "cuda", torch.float16) * 2)
    graph.replay()
    assert torch.equal(y, ops.layer_norm_linear(*args))
    _within_rule(y, args)
