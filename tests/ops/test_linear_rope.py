"""fuseinfer::linear_rope_append (fuseinfer/ops/linear_rope.py): the q/k/v projection with the rotary embedding and
the static-cache write in its epilogue. On every device: equal to the two ops it fuses (the linear, then
qkv_rope_append; without cos / sin, the linear then kv_cache_append: OPT's decode q/k/v), bad input, the registration
(opcheck), a property test over shapes; on CUDA: one kernel at decode sizes, bit-identical to the two ops,
FUSEINFER_GEMV_EPILOGUES=0 (the two kernels), prefill sizes, a CUDA graph."""
from __future__ import annotations

import pytest
import torch
from helpers import DEVICES, LOWP, assert_rejects_each, cuda_kernel_names, examples, given, rope_cache_inputs, st

from fuseinfer import ops


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _case(device, dtype, b=2, s=1, k=64, heads=4, kv_heads=2, d=32, t=10, int8=False, bias=False, rotate=True):
    """(x, weight, scale, bias, cos, sin, H, Hkv, k_cache, v_cache, slots) of random values (cos, sin None without
    ``rotate``); slots s..: the last past the cache (skipped)."""
    n = (heads + 2 * kv_heads) * d
    x = torch.randn(b, s, k, device=device).to(dtype)
    w = torch.randn(n, k, device=device) * k ** -0.5
    scale = None
    if int8:
        w, scale = ops.quantize_per_channel(w)
        scale = scale.view(-1)
    else:
        w = w.to(dtype)
    bb = torch.randn(n, device=device).to(dtype) if bias else None
    cos, sin, k_cache, v_cache, slots = rope_cache_inputs(device, dtype, b, s, d, kv_heads, t, rotate)
    return [x, w, scale, bb, cos, sin, heads, kv_heads, k_cache, v_cache, slots]


def _pair(args):
    """The unfused path: the linear op, then qkv_rope_append (without cos / sin: q, k, v as the linear's heads, k
    and v written with kv_cache_append), on copies of the caches."""
    x, w, scale, b, cos, sin, h, hkv, kc, vc, slots = args
    qkv = ops.w8a16_linear(x, w, scale, b) if scale is not None else ops.linear_epilogue(x, w, b)
    kc, vc = kc.clone(), vc.clone()
    if cos is None:
        bb, ss, n = qkv.shape
        heads = qkv.view(bb, ss, h + 2 * hkv, n // (h + 2 * hkv)).transpose(1, 2)  # (B, H + 2 Hkv, S, D)
        ops.kv_cache_append(kc, vc, heads[:, h:h + hkv], heads[:, h + hkv:], slots)
        return heads[:, :h], kc, vc
    return ops.qkv_rope_append(qkv, cos, sin, h, hkv, kc, vc, slots), kc, vc


def _same(ours, pair, args):
    """Bit for bit; int8 weights with a bias within a rounding step of the projection (the plain GEMV may fuse the
    scale and the bias into one fma per output or not, so the projection can differ in its last bit before the
    rotation, and a rotated value a cos - b sin then differs by up to a unit in the last place of a and b each, which
    is many of its own units where it is small: about 1.42 units of the largest projection, plus the rounding of the
    rotated value)."""
    x, w, scale, b = args[:4]
    for a, r in zip(ours, pair):
        if scale is not None and b is not None:
            step = torch.finfo(a.dtype).eps * ops.w8a16_linear(x, w, scale, b).abs().max().item()
            torch.testing.assert_close(a, r, rtol=0, atol=3 * step)
        else:
            assert torch.equal(a, r)


def _ours(args):
    args = list(args)
    args[8], args[9] = args[8].clone(), args[9].clone()
    return ops.linear_rope_append(*args), args[8], args[9]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rotate", [True, False])
def test_equals_the_linear_then_qkv_rope_append(device, int8, bias, rotate):
    dtype = torch.float32 if device == "cpu" else torch.float16
    args = _case(device, dtype, int8=int8, bias=bias, rotate=rotate)
    _same(_ours(args), _pair(args), args)
    assert not torch.equal(_ours(args)[1], args[8])  # the cache was written


def test_reference_rotates_as_transformers():
    """q against transformers' apply_rotary_pos_emb over the projection."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    x, w, scale, b, cos, sin, h, hkv, kc, vc, slots = _case("cpu", torch.float32, s=3)
    qkv = torch.nn.functional.linear(x, w).view(2, 3, h + 2 * hkv, 32).transpose(1, 2)
    q, k = apply_rotary_pos_emb(qkv[:, :h], qkv[:, h:h + hkv], cos, sin)
    ours = ops.linear_rope_append(x, w, None, None, cos, sin, h, hkv, kc, vc, slots)
    torch.testing.assert_close(ours, q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kc[:, :, slots], k, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(vc[:, :, slots], qkv[:, h + hkv:], rtol=0, atol=0)


def test_without_rotation_q_and_the_cache_are_the_linear_heads():
    """cos, sin None: q is the linear's first H heads and the cache slots hold its k and v heads, unrotated."""
    x, w, scale, b, cos, sin, h, hkv, kc, vc, slots = _case("cpu", torch.float32, s=3, bias=True, rotate=False)
    heads = torch.nn.functional.linear(x, w, b).view(2, 3, h + 2 * hkv, 32).transpose(1, 2)
    q = ops.linear_rope_append(x, w, None, b, None, None, h, hkv, kc, vc, slots)
    torch.testing.assert_close(q, heads[:, :h], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kc[:, :, slots[:2]], heads[:, h:h + hkv, :2], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(vc[:, :, slots[:2]], heads[:, h + hkv:, :2], rtol=1e-6, atol=1e-6)


def test_rejects_bad_input():
    args = _case("cpu", torch.float32)
    bad = [(1, torch.randn(5, 64)), (1, args[1].half()), (2, torch.ones(256)), (3, torch.ones(7)), (6, 3), (5, None)]
    assert_rejects_each(ops.linear_rope_append, args, bad, match="linear_rope_append")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("rotate", [True, False])
def test_opcheck(device, int8, rotate):
    args = _case(device, torch.float32 if device == "cpu" else torch.bfloat16, int8=int8, bias=True, rotate=rotate)
    torch.library.opcheck(torch.ops.fuseinfer.linear_rope_append.default, tuple(args))


@pytest.mark.parametrize("device", DEVICES)
def test_equals_the_pair_property(device):
    """Drawn rows (decode 1-16 tokens, prefill), head dims (multiples of 16 and not), grouped-query heads, weight
    format, bias, dtype: bit-identical to the two ops."""
    @examples(device, cpu=15, cuda=150)
    @given(b=st.integers(1, 4), s=st.sampled_from([1, 1, 2, 4, 9]), kdim=st.sampled_from([16, 48, 272, 2048]),
           heads=st.sampled_from([(2, 1), (4, 2), (4, 4), (8, 1)]), d=st.sampled_from([16, 32, 64, 128, 40]),
           int8=st.booleans(), bias=st.booleans(), rotate=st.booleans(),
           dtype=st.sampled_from([torch.float32, *LOWP] if device == "cpu" else [*LOWP, torch.float32]))
    def check(b, s, kdim, heads, d, int8, bias, rotate, dtype):
        args = _case(device, dtype, b=b, s=s, k=kdim, heads=heads[0], kv_heads=heads[1], d=d, t=12, int8=int8,
                     bias=bias, rotate=rotate)
        _same(_ours(args), _pair(args), args)
    check()


# ---- CUDA ----

# Llama-3.2-1B's q/k/v (32 heads, 8 KV heads, D 64, K 2048) at 1 and 16 rows; Qwen2-0.5B's (14 / 2, D 64, K 896)
# with biases; head dim 128 (Llama-3.1-8B); K with a partial k-block; without rotation, OPT-1.3b's (32 / 32, D 64,
# K 2048, biases) at 8 rows.
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 32, 8, 64, 2048, True), (16, 32, 8, 64, 2048, True), (3, 14, 2, 64, 896, True),
                                   (2, 32, 8, 128, 4096, True), (9, 4, 2, 32, 1040, True),
                                   (8, 32, 32, 64, 2048, False), (1, 4, 4, 32, 1040, False)])
@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("int8", [False, True])
def test_decode_is_one_kernel_equal_to_the_pair(shape, dtype, int8):
    rows, heads, kv_heads, d, k, rotate = shape
    args = _case("cuda", dtype, b=rows, s=1, k=k, heads=heads, kv_heads=kv_heads, d=d, t=20, int8=int8,
                 bias=heads in (14, 32) and not rotate, rotate=rotate)
    names = cuda_kernel_names(lambda: _ours(args))
    gemv = [n for n in names if "skinny" in n]
    assert len(gemv) == 1 and not any("rope" in n or "append" in n for n in names), names  # (the rest: the clones)
    _same(_ours(args), _pair(args), args)
    args[10].fill_(20)  # a slot past the cache: skipped (no host sync to check it), q still computed
    ours = _ours(args)
    assert torch.equal(ours[1], args[8]) and torch.equal(ours[2], args[9])
    _same(ours, _pair(args), args)


@pytest.mark.gpu
@pytest.mark.parametrize("rotate", [True, False])
def test_knob_off_runs_the_gemv_then_qkv_rope_append(set_knob, rotate):
    args = _case("cuda", torch.float16, b=2, k=256, heads=8, kv_heads=2, d=64, rotate=rotate)
    fused = _ours(args)
    set_knob("FUSEINFER_GEMV_EPILOGUES", "0")
    names = cuda_kernel_names(lambda: ops.linear_rope_append(*args))
    second = "rope" if rotate else "append"
    assert len(names) >= 2 and "skinny" in names[0] and second in names[1], names
    for a, r in zip(_ours(args), fused):
        assert torch.equal(a, r)


@pytest.mark.gpu
def test_prefill_and_odd_head_dims_run_the_pair():
    for s, d in ((24, 64), (1, 40)):
        args = _case("cuda", torch.bfloat16, s=s, k=128, d=d, t=30)
        names = cuda_kernel_names(lambda: ops.linear_rope_append(*args))  # noqa: B023
        assert any("rope" in n for n in names), names
        _same(_ours(args), _pair(args), args)


@pytest.mark.gpu
def test_in_a_cuda_graph():
    """Captured and replayed as the decode step's graphs are: the replay reads the new x, cos, sin and slot."""
    args = _case("cuda", torch.float16, b=1, k=2048, heads=32, kv_heads=8, d=64, t=16)
    ops.linear_rope_append(*args)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = ops.linear_rope_append(*args)
    args[0].copy_(torch.randn_like(args[0]))
    args[4].copy_(torch.randn_like(args[4]))
    args[10].fill_(3)
    expect = _pair(args)
    graph.replay()
    assert torch.equal(q, expect[0]) and torch.equal(args[8], expect[1]) and torch.equal(args[9], expect[2])
