"""The machine's ceilings, measured in the same run as the profile: copy bandwidth, GEMM rates, launch floor.

* copy bandwidth (GB/s): bytes read + written by a device-to-device copy of a buffer far beyond the caches / its
  median time (on CUDA the eval CLI's ``copy_bandwidth_gbps``: 2 x 512 MiB; on CPU 2 x 64 MiB, ``perf_counter``);
* GEMM rate (TFLOP/s, TOP/s for int8) per precision: 2 n^3 / median time of ``torch.mm`` of two n x n matrices
  (n = 8192 on CUDA, 512 on CPU) in fp16 / bf16 / fp32 as the model's dtype needs, and of ``torch._int_mm`` (int8
  -> int32) where torch has it for the device;
* launch floor (µs): the time per call of a one-element add, back to back (on CUDA replayed from a CUDA graph, so
  it is the device's per-kernel cost, not the host's), the shortest time any kernel / op can take.

The ridge point of a precision is its GEMM rate / the copy bandwidth (FLOP per byte).
"""
from __future__ import annotations

import time

import torch

from fuseinfer.harness.timing import copy_bandwidth_gbps, free_memory, summarize, synchronize

GEMM_N = {"cuda": 8192, "cpu": 512}
PRECISIONS = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _median_ms(fn, device: torch.device, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return summarize(times)["median"]


def copy_gbps(device: torch.device) -> float:
    if device.type == "cuda":
        return copy_bandwidth_gbps(device)
    nbytes = 64 * 2**20
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), device, repeats=5)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def gemm_tflops(device: torch.device, precision: str) -> float | None:
    """2 n^3 / median time of an n x n x n GEMM in ``precision`` (``int8``: torch._int_mm), or None where torch
    cannot run it on this device."""
    n = GEMM_N[device.type]
    try:
        if precision == "int8":
            a = torch.randint(-64, 64, (n, n), dtype=torch.int8, device=device)
            b = torch.randint(-64, 64, (n, n), dtype=torch.int8, device=device).t()  # column-major, as cuBLASLt wants
            fn = lambda: torch._int_mm(a, b)  # noqa: E731
        else:
            a = torch.randn(n, n, device=device, dtype=PRECISIONS[precision])
            b = torch.randn(n, n, device=device, dtype=PRECISIONS[precision])
            fn = lambda: torch.mm(a, b)  # noqa: E731
        ms = _median_ms(fn, device, repeats=10 if device.type == "cuda" else 3)
    except (RuntimeError, NotImplementedError):  # (no int8 GEMM for this device / build)
        return None
    finally:
        free_memory(device)
    return 2.0 * n**3 / (ms * 1e-3) / 1e12


def launch_floor_us(device: torch.device, calls: int = 200) -> float:
    x = torch.zeros(1, device=device)
    if device.type == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x.add_(1)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                x.add_(1)
        ms = _median_ms(graph.replay, device, repeats=5)
        return ms * 1e3 / calls
    ms = _median_ms(lambda: [x.add_(1) for _ in range(calls)], device, repeats=5)
    return ms * 1e3 / calls


def measure(device: torch.device, dtype: torch.dtype) -> dict:
    """Every ceiling the verdicts use, for the model's dtype (plus fp16 on CUDA and int8 where torch has it)."""
    synchronize(device)
    model_precision = str(dtype).removeprefix("torch.")
    precisions = [model_precision] + (["float16"] if device.type == "cuda" and model_precision != "float16" else [])
    gemm = {p: gemm_tflops(device, p) for p in precisions + ["int8"]}
    return {"device": str(device), "copy_gbps": copy_gbps(device),
            "gemm_tflops": {p: v for p, v in gemm.items() if v is not None},
            "launch_floor_us": launch_floor_us(device), "gemm_n": GEMM_N[device.type],
            "model_precision": model_precision}


def ridge(ceilings: dict, precision: str) -> float:
    """FLOP per byte where the GEMM rate of ``precision`` meets the copy bandwidth."""
    return peak_tflops(ceilings, precision) * 1e12 / (ceilings["copy_gbps"] * 1e9)


def peak_tflops(ceilings: dict, precision: str | None) -> float:
    """The measured GEMM rate for ``precision``, else the model precision's (e.g. an fp32 op on an fp16 run)."""
    gemm = ceilings["gemm_tflops"]
    return gemm.get(precision or "", gemm.get(ceilings["model_precision"], max(gemm.values())))
