"""Timing and memory: CUDA events on GPU, ``time.perf_counter`` on CPU; peak memory from the caching allocator.

All times are milliseconds. A series is summarised as its median with the 10th and 90th percentiles; a series whose
spread is wide gets a warning (``spread_warnings``). On CPU the run pins torch to one thread (``cpu_threads``): on a
loaded machine the thread pool's waits made identical runs differ by 1000x in their ratios.
"""
from __future__ import annotations

import contextlib
import gc
import os
import time
from typing import Callable

import torch

MIB = 2**20
WIDE_SPREAD = 0.5  # (p90 - p10) / median above which a timing is reported as noisy


class StepClock:
    """Marks instants in a stream of work; ``intervals()`` returns the ms between consecutive marks.

    On CUDA each mark records an event on the current stream (no host sync between marks, so the launches of a
    step overlap the GPU work of the previous one, as in real generation); on CPU it reads ``perf_counter``.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


def time_call(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds one call of ``fn`` takes on ``device`` (all its queued work included)."""
    synchronize(device)
    clock = StepClock(device)
    clock.mark()
    fn()
    clock.mark()
    return clock.intervals()[0]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summarize(times_ms: list[float]) -> dict:
    """{"median", "p10", "p90", "n"} of a series of milliseconds."""
    q = torch.tensor(times_ms, dtype=torch.float64).quantile(torch.tensor([0.5, 0.1, 0.9], dtype=torch.float64))
    return {"median": q[0].item(), "p10": q[1].item(), "p90": q[2].item(), "n": len(times_ms)}


def spread_warnings(rows: dict, keys=("prefill_ms", "decode_ms_per_token")) -> list[str]:
    """One line per backend timing (``rows[name][key]``, a ``summarize`` dict) whose p10-p90 spread exceeds
    WIDE_SPREAD of its median: ratios between such rows are not to be trusted."""
    out = []
    for name, row in rows.items():
        for key in keys:
            stats = row.get(key) or {}
            median = stats.get("median") or 0
            if median > 0 and (stats["p90"] - stats["p10"]) / median > WIDE_SPREAD:
                out.append(f"{name} {key}: p10-p90 spread {stats['p10']:.3g}-{stats['p90']:.3g} ms around a median "
                           f"of {median:.3g} ms: the machine is busy, so the ratios are unreliable; rerun on an idle "
                           "machine or with more --repeats")
    return out


@contextlib.contextmanager
def cpu_threads(device: torch.device):
    """On CPU, torch at one thread while the block runs (unless OMP_NUM_THREADS sets the count); yields the line
    that says so for the report, or None on a GPU."""
    if device.type != "cpu":
        yield None
        return
    before = torch.get_num_threads()
    threads = int(os.environ["OMP_NUM_THREADS"]) if os.environ.get("OMP_NUM_THREADS", "").isdigit() else 1
    torch.set_num_threads(max(1, threads))
    try:
        yield (f"CPU timings at {torch.get_num_threads()} torch thread(s) "
               f"({'OMP_NUM_THREADS' if threads != 1 or 'OMP_NUM_THREADS' in os.environ else 'default'}; "
               "set OMP_NUM_THREADS for another count)")
    finally:
        torch.set_num_threads(before)


def _copy_ms(device: torch.device, nbytes: int, repeats: int) -> float:
    """Median ms of copying ``nbytes`` from one device buffer to another."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    return summarize([time_call(lambda: dst.copy_(src), device) for _ in range(repeats)])["median"]


def copy_bandwidth_gbps(device: torch.device, nbytes: int = 512 * MIB, repeats: int = 10) -> float | None:
    """Device-to-device copy bandwidth in GB/s, or None on CPU: bytes read + written (2 x ``nbytes``, by default
    far beyond L2) / median time of ``repeats`` copies. The memory ceiling of the eval CLI and of bench/."""
    if device.type != "cuda":
        return None
    ms = _copy_ms(device, nbytes, repeats)
    free_memory(device)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def free_memory(device: torch.device) -> None:
    """Drop unreachable tensors and return cached blocks, so the next backend starts from a clean allocator."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict | None:
    """{"max_allocated_mib", "max_reserved_mib"} since the last :func:`reset_peak`; None on CPU."""
    if device.type != "cuda":
        return None
    return {"max_allocated_mib": torch.cuda.max_memory_allocated(device) / MIB,
            "max_reserved_mib": torch.cuda.max_memory_reserved(device) / MIB}


def allocated_mib(device: torch.device) -> float | None:
    return torch.cuda.memory_allocated(device) / MIB if device.type == "cuda" else None


@contextlib.contextmanager
def on_session_prefill(callback: Callable[[], object]):
    """Within: ``callback()`` runs at the entry of every fast-decode session's prefill
    (``fuseinfer.runtime.prefill.session_prefill``: the first launch of a patched generate call's prefill graph or
    lean loop), before the prefill itself. For measuring the host work a generate call does before its GPU work."""
    from fuseinfer.runtime import prefill

    real = prefill.session_prefill

    def marked(*args, **kwargs):
        callback()
        return real(*args, **kwargs)

    prefill.session_prefill = marked
    try:
        yield
    finally:
        prefill.session_prefill = real


def host_before_prefill_s(fn: Callable[[], object], calls: int, sync: Callable[[], object]) -> list[float]:
    """Host seconds of each of ``calls`` calls of ``fn()`` (a patched generate call) from its start to its session
    prefill's entry (:func:`on_session_prefill`): the argument checks, the model probe, the session lookup, the
    launches before the prefill's. ``sync()`` runs before each call (the device idle at each start)."""
    marks, times = [], []
    with on_session_prefill(lambda: marks.append(time.perf_counter())):
        for _ in range(calls):
            sync()
            marks.clear()
            start = time.perf_counter()
            fn()
            times.append(marks[0] - start)
    return times
