"""fuseinfer::linear_rope_append (fuseinfer/ops/linear_rope.py): the q/k/v projection with the rotary embedding and
the static-cache write in its epilogue. On every device: equal to the two ops it fuses (the linear, then
qkv_rope_append; without cos / sin, the linear then kv_cache_append: OPT's decode q/k/v), bad input, the registration
(opcheck), a property test over shapes; on CUDA: one kernel at decode sizes, bit-identical to the two ops,
FUSEINFER_GEMV_EPILOGUES=0 (the two kernels), a CUDA graph; at prefill sizes on sm_90 with FUSEINFER_QKV_GEMM=1 one
kernel too (the GEMM with the rotary, the split and the cache write in its epilogue) within the rule, by default and
for odd head dims the pair."""
from __future__ import annotations

import pytest
import torch
from helpers import (DEVICES, LOWP, assert_lowp_close, assert_rejects_each, cuda_kernel_names, examples, given,
                     lowp_atol, needs_sm90, paths_taken, rope_cache_inputs, st)

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


def _same(ours, pair, args, gemm: bool = False):
    """Bit for bit; within a rounding step of the projection for int8 weights with a bias (the plain GEMV may fuse the
    scale and the bias into one fma per output or not) and where the prefill GEMM ran (``gemm``: k summed in another
    order than cuBLASLt's). Either way the projection can differ in its last bit before the rotation, and a rotated
    value a cos - b sin then differs by up to a unit in the last place of a and b each, which is many of its own units
    where it is small: about 1.42 units of the largest projection, plus the rounding of the rotated value."""
    x, w, scale, b = args[:4]
    step = None  # (bit for bit)
    if gemm or (scale is not None and b is not None):
        proj = ops.w8a16_linear(x, w, scale, b) if scale is not None else ops.linear_epilogue(x, w, b)
        step = torch.finfo(proj.dtype).eps * proj.abs().max().item()
    for a, r in zip(ours, pair):
        if step is None:
            assert torch.equal(a, r)
        else:
            torch.testing.assert_close(a, r, rtol=0, atol=3 * step)


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
    format, bias, dtype, FUSEINFER_QKV_GEMM: bit-identical to the two ops (within a rounding step of the projection
    where the sm_90 prefill GEMM ran)."""
    from fuseinfer.core.knobs import override

    @examples(device, cpu=15, cuda=150)
    @given(b=st.integers(1, 4), s=st.sampled_from([1, 1, 2, 4, 9]), kdim=st.sampled_from([16, 48, 272, 2048]),
           heads=st.sampled_from([(2, 1), (4, 2), (4, 4), (8, 1)]), d=st.sampled_from([16, 32, 64, 128, 40]),
           int8=st.booleans(), bias=st.booleans(), rotate=st.booleans(), fused=st.booleans(),
           dtype=st.sampled_from([torch.float32, *LOWP] if device == "cpu" else [*LOWP, torch.float32]))
    def check(b, s, kdim, heads, d, int8, bias, rotate, fused, dtype):
        args = _case(device, dtype, b=b, s=s, k=kdim, heads=heads[0], kv_heads=heads[1], d=d, t=12, int8=int8,
                     bias=bias, rotate=rotate)
        with override(QKV_GEMM="1" if fused else "0"):
            ours, paths = paths_taken(lambda: _ours(args)) if device == "cuda" else (_ours(args), {})
        _same(ours, _pair(args), args, gemm="linear.qkv_rope_gemm" in paths)
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
def test_default_and_odd_head_dims_run_the_pair(set_knob):
    """Prefill by default (FUSEINFER_QKV_GEMM=0), and with the GEMM on, head dims its epilogue does not take (40, and
    96, which does not divide its 256-column tiles): cuBLASLt's GEMM, then qkv_rope_append, bit for bit."""
    for s, d, knob in ((24, 64, "0"), (24, 40, "1"), (1, 40, "1"), (24, 96, "1")):
        set_knob("FUSEINFER_QKV_GEMM", knob)
        args = _case("cuda", torch.bfloat16, s=s, k=128, d=d, t=30)
        names = cuda_kernel_names(lambda: ops.linear_rope_append(*args))  # noqa: B023
        assert any("qkv_rope_kernel" in n for n in names), names
        ours, paths = paths_taken(lambda: _ours(args))  # noqa: B023
        assert "linear.qkv_rope_gemm" not in paths, paths
        _same(ours, _pair(args), args)


# Prefill on sm_90: (B, S, H, Hkv, D, K, bias, rotate). Llama-3.2-1B's q/k/v at 2048 rows, Qwen2.5-1.5B's (biases,
# D 128), Llama-3.1-8B's at a partial row tile, OPT-1.3b's without rotation (32 / 32 heads, biases) over two batch
# rows; then odd ones: N = 384 (the last tile's second weight box wholly past N), batch boundaries inside a tile, a
# partial k-block (K 40); D 256 (pairs across the tile's halves) at 17 rows; D 32 and D 16.
PREFILL = [(1, 2048, 32, 8, 64, 2048, False, True), (1, 520, 12, 2, 128, 1536, True, True),
           (1, 300, 32, 8, 128, 4096, False, True), (2, 130, 32, 32, 64, 2048, True, False),
           (3, 50, 4, 1, 64, 40, True, True), (1, 17, 2, 1, 256, 264, False, True), (2, 9, 8, 4, 32, 1040, True, True),
           (1, 33, 6, 2, 16, 64, False, True)]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("shape", PREFILL)
@pytest.mark.parametrize("dtype", LOWP)
def test_prefill_is_one_kernel_within_the_rule(shape, dtype, set_knob):
    """With FUSEINFER_QKV_GEMM=1, one kernel (the GEMM with the rotary, the split and the cache write in its
    epilogue), within a rounding step of the projection of the pair, and within twice PyTorch's own error against fp32
    (q and the written cache rows); the last row's slot lies past the cache and is skipped: nothing else written."""
    set_knob("FUSEINFER_QKV_GEMM", "1")
    b, s, heads, kv_heads, d, k, bias, rotate = shape
    args = _case("cuda", dtype, b=b, s=s, k=k, heads=heads, kv_heads=kv_heads, d=d, t=s + 3, bias=bias, rotate=rotate)
    args[1] = (args[1].float() * 3).to(dtype)  # projections of about unit size
    in_range = args[10].clone()  # (for the references, whose index_copy_ would assert on the skipped slot)
    args[10][-1] = s + 3
    # the caches at the start of larger buffers, so that a write past them (a skipped slot mis-addressed) shows
    bufs = [torch.randn(c.numel() + 4096, device="cuda").to(dtype) for c in args[8:10]]
    args[8], args[9] = (buf[:c.numel()].view(c.shape) for buf, c in zip(bufs, args[8:10]))
    before = [buf.clone() for buf in bufs]
    call = lambda: ops.linear_rope_append(*args)  # noqa: E731
    names = cuda_kernel_names(call)
    assert len(names) == 1 and "qkv_rope_gemm" in names[0], names  # no (M, N) projection, no rotary pass
    ours, paths = paths_taken(lambda: _ours(args))
    assert paths == {"linear.qkv_rope_gemm": 1}, paths
    pair = _pair(args)
    _same(ours, pair, args, gemm=True)
    up = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    up[8], up[9], up[10] = up[8].clone(), up[9].clone(), in_range
    ref = (ops.linear_rope_append_ref(*up), up[8], up[9])
    low = list(args)
    low[8], low[9], low[10] = low[8].clone(), low[9].clone(), in_range
    torch_low = (ops.linear_rope_append_ref(*low), low[8], low[9])
    for i, (a, t, r) in enumerate(zip(ours, torch_low, ref)):
        if i > 0:  # the cache rows the slots wrote (3 .. s + 1)
            a, t, r = (c[:, :, 3:s + 2] for c in (a, t, r))
        assert_lowp_close(a, t, r, f"{shape} {dtype} output {i}", 2 * lowp_atol(r, dtype))
    for buf, old in zip(bufs, before):  # every cache row but those written (3 .. s + 1), and past the caches: untouched
        cache, old_cache = (t[:args[8].numel()].view(args[8].shape) for t in (buf, old))
        assert torch.equal(cache[:, :, :3], old_cache[:, :, :3])
        assert torch.equal(cache[:, :, s + 2:], old_cache[:, :, s + 2:])
        assert torch.equal(buf[args[8].numel():], old[args[8].numel():])


@pytest.mark.gpu
@needs_sm90
def test_prefill_gemm_in_a_cuda_graph(set_knob):
    """The prefill GEMM captured and replayed: the replay reads the new x, cos, sin and slots."""
    set_knob("FUSEINFER_QKV_GEMM", "1")
    args = _case("cuda", torch.float16, b=1, s=64, k=2048, heads=32, kv_heads=8, d=64, t=80)
    ops.linear_rope_append(*args)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, paths = paths_taken(lambda: ops.linear_rope_append(*args))
    assert paths == {"linear.qkv_rope_gemm": 1}, paths
    args[0].copy_(torch.randn_like(args[0]))
    args[4].copy_(torch.randn_like(args[4]))
    args[5].copy_(torch.randn_like(args[5]))
    args[10].sub_(10)
    expect = _pair(args)
    graph.replay()
    _same((q, args[8], args[9]), expect, args, gemm=True)


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
