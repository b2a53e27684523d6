"""fuseinfer/runtime/graphs.py: every CUDA graph is captured on a stream of its own, so destroying one graph does not
free the cuBLAS workspace that another live graph replays (PyTorch keys workspaces by stream and erases a
destroyed graph's capture-stream workspaces)."""
import gc

import pytest
import torch

from fuseinfer.runtime.graphs import capture_stream

pytestmark = pytest.mark.gpu


def _capture(x, w):
    graph = torch.cuda.CUDAGraph()
    stream = capture_stream(graph, x.device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x @ w  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph, stream=stream):
        y = x @ w  # cuBLAS with its workspace, (32, 4096) x (4096, 4096)
    return graph, stream, y


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_graph_replays_after_another_graph_is_destroyed():
    torch.manual_seed(0)
    x = torch.randn(32, 4096, device="cuda", dtype=torch.float16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.float16) / 64
    first, s1, _ = _capture(x, w)
    second, s2, y = _capture(x, w)
    assert s1.cuda_stream != s2.cuda_stream
    del first
    gc.collect()
    torch.cuda.empty_cache()  # the destroyed graph's pool goes back to the driver
    filler = torch.full((256, 2**20), 7.0, device="cuda")  # reuse what was freed
    y.zero_()
    second.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, x @ w)
    del filler


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_collected_graphs_stream_is_reused_not_shared():
    x = torch.randn(32, 256, device="cuda", dtype=torch.float16)
    w = torch.randn(256, 256, device="cuda", dtype=torch.float16)
    first, s1, _ = _capture(x, w)
    live, s_live, _ = _capture(x, w)
    ptr = s1.cuda_stream
    del first
    gc.collect()
    third, s3, _ = _capture(x, w)
    assert s3.cuda_stream == ptr and s3.cuda_stream != s_live.cuda_stream
