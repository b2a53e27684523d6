"""fuseinfer::kv_cache_append: the reference against a plain loop, the op's registration (opcheck), strided
k/v views like the fused QKV output's, odd head dims (the kernel's scalar path) and, on a GPU, the CUDA kernel
(exact equality with the reference, out-of-range slots skipped, replay inside a CUDA graph)."""
from __future__ import annotations

import pytest
import torch

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
def test_append_matches_loop(d, strided):
    b, h, s, t = 2, 3, 5, 11
    k, v = _qkv_views(b, s, h, d) if strided else (torch.randn(b, h, s, d), torch.randn(b, h, s, d))
    assert strided == (not k.is_contiguous())
    slots = torch.tensor([7, 0, 3, 10, 4])
    caches = [torch.randn(b, h, t, d) for _ in range(2)]
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


def test_shape_errors():
    cache = torch.zeros(1, 2, 4, 8)
    with pytest.raises(FuseInferError):
        ops.kv_cache_append(cache, cache.clone(), torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), torch.arange(2))
    with pytest.raises(FuseInferError):
        ops.kv_cache_append(cache, cache.clone(), torch.zeros(1, 3, 1, 8), torch.zeros(1, 3, 1, 8), torch.arange(1))


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "qkv_view"])
def test_opcheck_cpu(strided):
    k, v = _qkv_views(2, 3, 4, 96) if strided else (torch.randn(2, 4, 3, 96), torch.randn(2, 4, 3, 96))
    args = (torch.randn(2, 4, 9, 96), torch.randn(2, 4, 9, 96), k, v, torch.tensor([8, 2, 5]))
    torch.library.opcheck(torch.ops.fuseinfer.kv_cache_append.default, args)


# ---- CUDA kernel ----

GPU_CASES = [  # (B, H, S, T, D, layout): decode, prefill, odd head dims and misaligned views (scalar path)
    (1, 32, 1, 640, 64, "qkv"), (4, 12, 37, 128, 64, "qkv"), (2, 8, 5, 64, 128, "contiguous"),
    (3, 5, 4, 16, 96, "qkv"), (2, 3, 6, 20, 123, "qkv"), (1, 2, 3, 8, 8, "contiguous"), (2, 4, 3, 12, 64, "offset"),
]


def _require_kernel():
    from fuseinfer._ext import extension

    if extension() is None:
        pytest.fail("fuseinfer._C is not built: the CUDA kernel cannot be tested")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", GPU_CASES, ids=[f"b{c[0]}h{c[1]}s{c[2]}t{c[3]}d{c[4]}" for c in GPU_CASES])
def test_append_kernel_exact(case, dtype):
    _require_kernel()
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
    _require_kernel()
    dev = dict(dtype=torch.float16, device="cuda")
    k, v = _qkv_views(2, 3, 4, 96, torch.float16, "cuda") if strided else \
        (torch.randn(2, 4, 3, 96, **dev), torch.randn(2, 4, 3, 96, **dev))
    args = (torch.randn(2, 4, 9, 96, **dev), torch.randn(2, 4, 9, 96, **dev), k, v,
            torch.tensor([8, 2, 5], device="cuda"))
    torch.library.opcheck(torch.ops.fuseinfer.kv_cache_append.default, args)


@pytest.mark.gpu
def test_append_kernel_skips_out_of_range_slots():
    _require_kernel()
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
    _require_kernel()
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
