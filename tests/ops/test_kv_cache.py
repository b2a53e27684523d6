"""fuseinfer::kv_cache_append (fuseinfer/ops/kv_cache.py): the reference against a plain loop, the static cache's
in-place update through it, bad input, the registration (opcheck), strided k/v views like the fused QKV output's,
odd head dims (the kernel's scalar path), property tests against the reference (hypothesis) on every device and,
on a GPU, the CUDA kernel (exact equality with the reference, out-of-range slots skipped, replay inside a CUDA
graph)."""
from __future__ import annotations

import pytest
import torch
from helpers import DEVICES, examples, given, require_kernel, st

from fuseinfer import FuseInferError, ops


def _qkv_views(b, s, h, d, dtype=torch.float32, device="cpu"):
    """k, v (B, H, S, D) as the patched attention makes them: views into a fused (B, S, 3, H, D) output."""
    qkv = torch.randn(b, s, 3, h, d, dtype=dtype, device=device)
    _, k, v = qkv.unbind(2)  # (B, S, H, D)
    return k.transpose(1, 2), v.transpose(1, 2)


def _loop_append(k_cache, v_cache, k, v, slots):
    for s, slot in enumerate(slots.tolist()):
        k_cache[:, :, slot] = k[:, :, s]
        v_cache[:, :, slot] = v[:, :, s]


@pytest.mark.parametrize("d", [64, 96, 123])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "qkv_view"])
def test_append_matches_loop(d, strided, device):
    b, h, s, t = 2, 3, 5, 11
    k, v = _qkv_views(b, s, h, d, device=device) if strided else \
        (torch.randn(b, h, s, d, device=device), torch.randn(b, h, s, d, device=device))
    assert strided == (not k.is_contiguous())
    slots = torch.tensor([7, 0, 3, 10, 4], device=device)
    caches = [torch.randn(b, h, t, d, device=device) for _ in range(2)]
    expected = [c.clone() for c in caches]
    _loop_append(*expected, k, v, slots)
    ops.kv_cache_append(*caches, k, v, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


def test_static_cache_update_writes_in_place():
    from fuseinfer.runtime import StaticKVCache

    cache = StaticKVCache(2, batch=2, heads=3, head_dim=8, capacity=6, dtype=torch.float32, device="cpu")
    k, v = _qkv_views(2, 4, 3, 8)
    cache.write_idx = torch.arange(1, 5)
    keys, values = cache.update(k, v, 1)
    assert keys is cache.keys[1] and values is cache.values[1]
    assert torch.equal(keys[:, :, 1:5], k) and torch.equal(values[:, :, 1:5], v)
    assert keys[:, :, 0].eq(0).all() and keys[:, :, 5].eq(0).all() and cache.keys[0].eq(0).all()


def test_shape_errors(device):
    cache = torch.zeros(1, 2, 4, 8, device=device)
    z = lambda *s: torch.zeros(*s, device=device)  # noqa: E731
    with pytest.raises(FuseInferError):
        ops.kv_cache_append(cache, cache.clone(), z(1, 2, 3, 8), z(1, 2, 3, 8), torch.arange(2, device=device))
    with pytest.raises(FuseInferError):
        ops.kv_cache_append(cache, cache.clone(), z(1, 3, 1, 8), z(1, 3, 1, 8), torch.arange(1, device=device))


def test_dtype_errors(device):
    cache, kv = torch.zeros(1, 2, 6, 4, device=device), torch.randn(1, 2, 3, 4, device=device)
    with pytest.raises(FuseInferError, match="slots must be int64"):
        ops.kv_cache_append(cache, cache.clone(), kv, kv, torch.arange(3, dtype=torch.int32, device=device))
    with pytest.raises(FuseInferError, match="in the caches' dtype"):
        ops.kv_cache_append(cache, cache.clone(), kv.half(), kv.half(), torch.arange(3, device=device))


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "qkv_view"])
def test_opcheck_cpu(strided):
    k, v = _qkv_views(2, 3, 4, 96) if strided else (torch.randn(2, 4, 3, 96), torch.randn(2, 4, 3, 96))
    args = (torch.randn(2, 4, 9, 96), torch.randn(2, 4, 9, 96), k, v, torch.tensor([8, 2, 5]))
    torch.library.opcheck(torch.ops.fuseinfer.kv_cache_append.default, args)


# ---- property tests against the reference (hypothesis) ----

@st.composite
def append_cases(draw, device):
    """(k_cache, v_cache, k, v, slots): batch 1-4, heads 1-6, one new token (decode) or a chunk, odd head dims,
    k/v contiguous, as fused-QKV views or misaligned (offset by one element), distinct slots in any order."""
    torch.manual_seed(draw(st.integers(0, 2**32 - 1)))  # the tensors follow from the drawn seed (replayable)
    b, h = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    s = draw(st.one_of(st.just(1), st.integers(2, 40)))
    t = s + draw(st.integers(0, 60))
    d = draw(st.one_of(st.integers(1, 17), st.sampled_from([64, 96, 123, 128])))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    layout = draw(st.sampled_from(["contiguous", "qkv", "offset"]))
    if layout == "qkv":
        k, v = _qkv_views(b, s, h, d, dtype, device)
    elif layout == "offset":  # base pointers one element past an aligned boundary
        k, v = (torch.randn(b, h, s, d + 1, dtype=dtype, device=device)[..., 1:] for _ in range(2))
    else:
        k, v = (torch.randn(b, h, s, d, dtype=dtype, device=device) for _ in range(2))
    slots = torch.randperm(t, device=device)[:s]
    caches = [torch.randn(b, h, t, d, dtype=dtype, device=device) for _ in range(2)]
    return (*caches, k, v, slots)


@pytest.mark.parametrize("device", DEVICES)
def test_append_matches_reference_property(device):
    """Exact: the op writes the reference's bits (a copy), in place, nothing else."""
    @examples(device, cpu=40, cuda=150)
    @given(case=append_cases(device))
    def check(case):
        k_cache, v_cache, k, v, slots = case
        expected = [k_cache.clone(), v_cache.clone()]
        ops.kv_cache_append_ref(*expected, k, v, slots)
        ptrs = k_cache.data_ptr(), v_cache.data_ptr()
        ops.kv_cache_append(k_cache, v_cache, k, v, slots)
        assert (k_cache.data_ptr(), v_cache.data_ptr()) == ptrs
        assert torch.equal(k_cache, expected[0]) and torch.equal(v_cache, expected[1])
    check()


@pytest.mark.parametrize("device", DEVICES)
def test_append_opcheck_property(device):
    @examples(device, cpu=3, cuda=3)
    @given(case=append_cases(device))
    def check(case):
        torch.library.opcheck(torch.ops.fuseinfer.kv_cache_append.default, case)
    check()


# ---- CUDA kernel ----

GPU_CASES = [  # (B, H, S, T, D, layout): decode, prefill, odd head dims and misaligned views (scalar path)
    (1, 32, 1, 640, 64, "qkv"), (4, 12, 37, 128, 64, "qkv"), (2, 8, 5, 64, 128, "contiguous"),
    (3, 5, 4, 16, 96, "qkv"), (2, 3, 6, 20, 123, "qkv"), (1, 2, 3, 8, 8, "contiguous"), (2, 4, 3, 12, 64, "offset"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", GPU_CASES, ids=[f"b{c[0]}h{c[1]}s{c[2]}t{c[3]}d{c[4]}" for c in GPU_CASES])
def test_append_kernel_exact(case, dtype):
    require_kernel()
    b, h, s, t, d, layout = case
    if layout == "qkv":
        k, v = _qkv_views(b, s, h, d, dtype, "cuda")
    elif layout == "offset":  # base pointers 1 element past a 16-byte boundary
        k, v = (torch.randn(b, h, s, d + 1, dtype=dtype, device="cuda")[..., 1:] for _ in range(2))
    else:
        k, v = (torch.randn(b, h, s, d, dtype=dtype, device="cuda") for _ in range(2))
    slots = torch.randperm(t, device="cuda")[:s]
    caches = [torch.randn(b, h, t, d, dtype=dtype, device="cuda") for _ in range(2)]
    expected = [c.clone() for c in caches]
    ops.kv_cache_append_ref(*expected, k, v, slots)
    ops.kv_cache_append(*caches, k, v, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


@pytest.mark.gpu
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "qkv_view"])
def test_opcheck_cuda(strided):
    """The op's CUDA registration (the kernel, which writes the caches in place) under opcheck, like the CPU one."""
    require_kernel()
    dev = dict(dtype=torch.float16, device="cuda")
    k, v = _qkv_views(2, 3, 4, 96, torch.float16, "cuda") if strided else \
        (torch.randn(2, 4, 3, 96, **dev), torch.randn(2, 4, 3, 96, **dev))
    args = (torch.randn(2, 4, 9, 96, **dev), torch.randn(2, 4, 9, 96, **dev), k, v,
            torch.tensor([8, 2, 5], device="cuda"))
    torch.library.opcheck(torch.ops.fuseinfer.kv_cache_append.default, args)


@pytest.mark.gpu
def test_append_kernel_skips_out_of_range_slots():
    require_kernel()
    k, v = _qkv_views(2, 4, 4, 64, torch.float16, "cuda")  # (B, H, S=4, D): one write per slot below
    caches = [torch.randn(2, 4, 8, 64, dtype=torch.float16, device="cuda") for _ in range(2)]
    expected = [c.clone() for c in caches]
    slots = torch.tensor([5, -1, 8, 2], device="cuda")
    keep = torch.tensor([0, 3])  # the in-range entries of slots
    ops.kv_cache_append_ref(*expected, k[:, :, keep], v[:, :, keep], slots[keep.cuda()])
    ops.kv_cache_append(*caches, k, v, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


@pytest.mark.gpu
def test_append_kernel_in_cuda_graph():
    require_kernel()
    b, h, t, d = 2, 4, 16, 64
    k, v = _qkv_views(b, 1, h, d, torch.float16, "cuda")
    caches = [torch.zeros(b, h, t, d, dtype=torch.float16, device="cuda") for _ in range(2)]
    slot = torch.zeros(1, dtype=torch.long, device="cuda")
    ops.kv_cache_append(*caches, k, v, slot)  # warm-up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.kv_cache_append(*caches, k, v, slot)
        slot += 1
    for _ in range(t):  # capture ran nothing: replay i writes slot i, then advances it
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(caches[0], k.expand(b, h, t, d)) and torch.equal(caches[1], v.expand(b, h, t, d))
