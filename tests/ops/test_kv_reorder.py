"""fuseinfer::kv_reorder (fuseinfer/ops/kv_reorder.py): the reference against a plain per-row loop (swapping beams,
rows that keep their cache, the count bound), bad input, the registration (opcheck), property tests against the
loop (hypothesis) on every device and, on a GPU, the CUDA kernel (exact equality with the reference for every
dtype and unit width, misaligned views, device-side start / count inside a CUDA graph with no host sync)."""
from __future__ import annotations

import pytest
import torch
from helpers import DEVICES, examples, given, require_kernel, st

from fuseinfer import FuseInferError, ops


def _loop_reorder(kv, parent, start, count, max_count):
    """The semantics spelled out: snapshot, then each moving row copies its parent's slots from the snapshot."""
    old = kv.clone()
    t = kv.shape[4]
    lo = max(int(start), 0)
    hi = min(int(start) + max(0, min(int(count), max_count)), t)
    for r, p in enumerate(parent.tolist()):
        if p != r and hi > lo:
            kv[:, :, r, :, lo:hi] = old[:, :, p, :, lo:hi]


def _require_reorder_kernel():
    require_kernel()
    from fuseinfer.ops.kv_reorder import available
    if not available(torch.device("cuda")):
        pytest.fail("the built extension has no kv_reorder kernel (rebuild it)")


def _long(v, device):
    return torch.tensor([v], dtype=torch.long, device=device)


def test_swap_and_fan_out(device):
    """Rows 0 and 1 swap, row 2 takes row 0's (old) slots, row 3 keeps its own: only slots [3, 6) change."""
    kv = torch.randn(2, 2, 4, 3, 10, 8, device=device)
    before = kv.clone()
    parent = torch.tensor([1, 0, 0, 3], device=device)
    ops.kv_reorder(kv, parent, _long(3, device), _long(3, device), 5)
    for r, p in enumerate([1, 0, 0, 3]):
        assert torch.equal(kv[:, :, r, :, 3:6], before[:, :, p, :, 3:6])
    assert torch.equal(kv[..., :3, :], before[..., :3, :]) and torch.equal(kv[..., 6:, :], before[..., 6:, :])


@pytest.mark.parametrize("count,max_count,start", [(0, 4, 2), (7, 3, 1), (5, 9, 8), (4, 4, -2), (-1, 3, 0)])
def test_bounds(count, max_count, start, device):
    """count is capped by max_count, the span by the cache's ends; nothing moves for count <= 0."""
    kv = torch.randn(1, 2, 3, 2, 10, 4, device=device)
    expected = kv.clone()
    parent = torch.tensor([2, 2, 0], device=device)
    _loop_reorder(expected, parent, start, count, max_count)
    ops.kv_reorder(kv, parent, _long(start, device), _long(count, device), max_count)
    assert torch.equal(kv, expected)


def test_loop_oracle_can_fail():
    """The loop reads a snapshot: a sequential in-place copy (no snapshot) differs on a swap."""
    kv = torch.randn(1, 2, 2, 1, 4, 2)
    expected, naive = kv.clone(), kv.clone()
    _loop_reorder(expected, torch.tensor([1, 0]), 0, 4, 4)
    for r, p in enumerate([1, 0]):
        naive[:, :, r] = naive[:, :, p]
    assert not torch.equal(expected, naive)


def test_errors(device):
    kv = torch.zeros(1, 2, 3, 2, 5, 4, device=device)
    one = _long(1, device)
    with pytest.raises(FuseInferError, match="expected kv"):
        ops.kv_reorder(kv[0], torch.arange(3, device=device), one, one, 2)
    with pytest.raises(FuseInferError, match="expected kv"):
        ops.kv_reorder(kv, torch.arange(2, device=device), one, one, 2)
    with pytest.raises(FuseInferError, match="must be int64"):
        ops.kv_reorder(kv, torch.arange(3, dtype=torch.int32, device=device), one, one, 2)
    with pytest.raises(FuseInferError, match="max_count"):
        ops.kv_reorder(kv, torch.arange(3, device=device), one, one, -1)


def test_opcheck_cpu():
    args = (torch.randn(2, 2, 4, 3, 9, 16), torch.tensor([1, 0, 1, 3]), _long(2, "cpu"), _long(4, "cpu"), 6)
    torch.library.opcheck(torch.ops.fuseinfer.kv_reorder.default, args)


# ---- property tests against the loop (hypothesis) ----

@st.composite
def reorder_cases(draw, device):
    """(kv, parent, start, count, max_count): 1-3 layers, 1-9 rows (beams swapping, fanning out, staying), 1-4
    heads, odd head dims (every unit width of the kernel), misaligned bases, spans inside and beyond the cache."""
    torch.manual_seed(draw(st.integers(0, 2**32 - 1)))
    layers, rows, heads = draw(st.integers(1, 3)), draw(st.integers(1, 9)), draw(st.integers(1, 4))
    t = draw(st.integers(1, 40))
    d = draw(st.one_of(st.integers(1, 17), st.sampled_from([64, 128])))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    shape = (layers, 2, rows, heads, t, d)
    if draw(st.booleans()):  # base pointer one element past an aligned boundary
        kv = torch.randn(torch.Size(shape).numel() + 1, dtype=dtype, device=device)[1:].view(shape)
    else:
        kv = torch.randn(shape, dtype=dtype, device=device)
    parent = torch.tensor(draw(st.lists(st.integers(0, rows - 1), min_size=rows, max_size=rows)), device=device)
    start = draw(st.integers(-2, t + 1))
    max_count = draw(st.integers(0, t + 2))
    count = draw(st.integers(-1, max_count + 2))
    return kv, parent, start, count, max_count


@pytest.mark.parametrize("device", DEVICES)
def test_reorder_matches_loop_property(device):
    """Exact: the op (kernel on CUDA, reference on the CPU) writes the loop's bits, in place, nothing else."""
    @examples(device, cpu=60, cuda=200)
    @given(case=reorder_cases(device))
    def check(case):
        kv, parent, start, count, max_count = case
        expected = kv.clone()
        _loop_reorder(expected, parent, start, count, max_count)
        ptr = kv.data_ptr()
        ops.kv_reorder(kv, parent, _long(start, device), _long(count, device), max_count)
        assert kv.data_ptr() == ptr
        assert torch.equal(kv, expected)
    check()


@pytest.mark.parametrize("device", DEVICES)
def test_reorder_opcheck_property(device):
    @examples(device, cpu=3, cuda=3)
    @given(case=reorder_cases(device))
    def check(case):
        kv, parent, start, count, max_count = case
        torch.library.opcheck(torch.ops.fuseinfer.kv_reorder.default,
                              (kv, parent, _long(start, device), _long(count, device), max_count))
    check()


# ---- CUDA kernel ----

GPU_CASES = [  # (L, R, H, T, D, start, count, max_count): OPT-1.3b-like beams, GQA heads, odd dims, many rows
    (24, 4, 32, 256, 64, 128, 60, 128), (4, 8, 2, 160, 64, 17, 143, 143), (3, 5, 3, 40, 123, 2, 30, 38),
    (2, 12, 4, 64, 128, 0, 64, 64), (2, 3, 2, 33, 6, 5, 28, 28), (1, 64, 1, 20, 8, 3, 9, 16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", GPU_CASES, ids=[f"l{c[0]}r{c[1]}h{c[2]}t{c[3]}d{c[4]}" for c in GPU_CASES])
def test_reorder_kernel_exact(case, dtype):
    _require_reorder_kernel()
    layers, rows, heads, t, d, start, count, max_count = case
    kv = torch.randn(layers, 2, rows, heads, t, d, dtype=dtype, device="cuda")
    parent = torch.randint(0, rows, (rows,), device="cuda")
    parent[:2] = torch.tensor([1, 0])  # a swap, always
    expected = kv.clone()
    ops.kv_reorder_ref(expected, parent, _long(start, "cuda"), _long(count, "cuda"), max_count)
    loop = kv.clone()
    _loop_reorder(loop, parent, start, count, max_count)
    assert torch.equal(expected, loop)
    ops.kv_reorder(kv, parent, _long(start, "cuda"), _long(count, "cuda"), max_count)
    assert torch.equal(kv, expected)


@pytest.mark.gpu
def test_reorder_kernel_leaves_bad_parents_alone():
    _require_reorder_kernel()
    kv = torch.randn(2, 2, 4, 2, 8, 64, dtype=torch.float16, device="cuda")
    expected = kv.clone()
    parent = torch.tensor([1, -1, 7, 2], device="cuda")  # rows 1 and 2: parents outside [0, R)
    _loop_reorder(expected, torch.tensor([1, 1, 2, 2]), 0, 8, 8)
    ops.kv_reorder(kv, parent, _long(0, "cuda"), _long(8, "cuda"), 8)
    assert torch.equal(kv, expected)


@pytest.mark.gpu
def test_opcheck_cuda():
    _require_reorder_kernel()
    kv = torch.randn(2, 2, 4, 3, 9, 64, dtype=torch.float16, device="cuda")
    args = (kv, torch.tensor([1, 0, 1, 3], device="cuda"), _long(2, "cuda"), _long(4, "cuda"), 6)
    torch.library.opcheck(torch.ops.fuseinfer.kv_reorder.default, args)


@pytest.mark.gpu
def test_reorder_kernel_in_cuda_graph():
    """start and count live on the device: a graph captured once copies a growing span on each replay (as a beam
    search's step counter grows), with a different parent per replay written by a kernel inside the graph."""
    _require_reorder_kernel()
    layers, rows, heads, t, d, first = 3, 4, 2, 24, 64, 5
    kv = torch.randn(layers, 2, rows, heads, t, d, dtype=torch.float16, device="cuda")
    start, count = _long(first, "cuda"), _long(0, "cuda")
    parents = torch.randint(0, rows, (t - first, rows), device="cuda")
    parent = parents[0].clone()
    ops.kv_reorder(kv.clone(), parent, start, count, t - first)  # warm-up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        parent.copy_(parents.index_select(0, count).view(-1))
        ops.kv_reorder(kv, parent, start, count, t - first)
        count.add_(1)
    expected = kv.clone()
    for i in range(t - first):
        graph.replay()
        _loop_reorder(expected, parents[i], first, i, t - first)
    torch.cuda.synchronize()
    assert torch.equal(kv, expected)
