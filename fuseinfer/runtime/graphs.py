"""Capture streams for fuseinfer's CUDA graphs: each graph is captured on a stream that no other live graph uses.

Why: PyTorch keys its cuBLAS / cuBLASLt workspaces by (handle, stream) and allocates one lazily, so the first
capture on a stream allocates it inside that graph's private memory pool, and later captures on the stream bake
the same address into their graphs. When a CUDAGraph is destroyed, PyTorch erases the workspaces of its capture
stream and releases its pool (``CUDAGraph::reset``). ``torch.cuda.graph`` captures every graph on one shared
default stream, so destroying one graph (a fast-decode session rebuilt for other settings, say) frees the
workspace that other live graphs still use, and their next replay reads freed memory: on the H200 this was the
illegal memory access of patched ``model.generate``'s beam search at 32 rows, after the benchmark had rebuilt
other sessions of the model. With a stream per live graph, a graph's workspace is allocated during its own capture
and freed with it.

Streams come from the extension (``cudaStreamCreateWithFlags``) and go back to a free list when their graph is
collected; without the extension they are PyTorch's pooled streams (shared with other users of the pool).
"""
from __future__ import annotations

import threading
import weakref

import torch

from fuseinfer.core.extension import extension

_free: dict[int, list[torch.cuda.Stream]] = {}  # device index -> streams whose graph is gone
_lock = threading.Lock()


def capture_stream(graph: torch.cuda.CUDAGraph, device: torch.device) -> torch.cuda.Stream:
    """A stream for capturing ``graph`` on ``device`` (pass it as ``torch.cuda.graph(..., stream=)``), reserved
    for it until the graph object is collected."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        free = _free.setdefault(index, [])
        stream = free.pop() if free else None
    if stream is None:
        ext = extension(torch.device("cuda", index))
        if ext is not None and hasattr(ext, "new_stream"):
            stream = torch.cuda.ExternalStream(ext.new_stream(index), device=torch.device("cuda", index))
        else:
            stream = torch.cuda.Stream(device=index)
    # (the graph's reset, which erases the stream's workspaces, runs right after this callback in the same
    # deallocation, before any other capture can take the stream)
    weakref.finalize(graph, _give_back, index, stream)
    return stream


def _give_back(index: int, stream: torch.cuda.Stream) -> None:
    with _lock:
        _free.setdefault(index, []).append(stream)


def warm_and_capture(graph: torch.cuda.CUDAGraph, fn, device: torch.device, pool=None, warmups: int = 2):
    """``fn()`` run ``warmups`` times on a side stream (cuBLASLt's algorithm choice and the kernels' lazily made
    buffers happen outside the graph), then captured into ``graph`` on its own capture stream; returns what the
    captured call returned (tensors in the graph's pool, rewritten by each replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph, pool=pool, stream=capture_stream(graph, device)):
        return fn()
