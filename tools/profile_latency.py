"""Where the latency of the user-facing calls goes: host work against GPU work, and which kernels a step runs.

For a random-weight OPT (default opt-1.3b) fp16, batch 1, patched with the defaults, on a CUDA GPU:

* ``forward``: ``model(ids)`` at each prompt length: the wall time of a call, the GPU's busy time inside it (sum of
  the kernel times torch.profiler records), and the host functions that take the rest (cProfile, by own time);
* ``first_token``: patched ``model.generate(ids, max_new_tokens=1)``: the same split, cProfile by cumulative time;
* ``beam``: patched ``model.generate(num_beams=4)``: the kernels one step replays (count and µs per step);
* ``sampling``: ``fuseinfer.generate`` greedy against top-p + temperature sampling: kernels per step of each.

Prints tables only; used to say what bounds a latency target and what to do next.

    python tools/profile_latency.py [--parts forward,first_token,beam,sampling] [--prompts 128,512]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

import fuseinfer
from fuseinfer.harness.models import load_config, load_model, resolve_model


def _wall_ms(fn, calls: int = 20) -> float:
    """Median wall ms of ``fn()`` with the GPU idle before each call and synchronised after it."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def _kernels(fn, calls: int):
    """(GPU busy µs per call, the profiler's table by CUDA time) over ``calls`` calls of ``fn``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in events) / calls
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60)
    return busy, table, sum(e.count for e in events) / calls


def _host_profile(fn, calls: int, sort: str) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats(sort).print_stats(14)
    return "\n".join(line for line in out.getvalue().splitlines() if line.strip())[:4000]


def split(name: str, fn, sort: str) -> None:
    for _ in range(3):
        fn()  # warm-up (graph captures)
    wall = _wall_ms(fn)
    busy, table, launches = _kernels(fn, 10)
    print(f"\n== {name}: wall {wall:.3f} ms, GPU busy {busy / 1e3:.3f} ms ({launches:.0f} kernels a call), "
          f"host or idle {wall - busy / 1e3:.3f} ms")
    print(_host_profile(fn, 10, sort))


def per_step(name: str, call, new: int = 33) -> None:
    """GPU busy time and kernels of one decode step: ``call(n)`` (a closure generating n tokens) at ``new`` tokens
    against 1, the prefill cancelled."""
    call(new)(), call(1)()  # warm-up (graph captures)
    busy_n, table, k_n = _kernels(call(new), 3)
    busy_1, _, k_1 = _kernels(call(1), 3)
    print(f"\n== {name}, per step: GPU busy {(busy_n - busy_1) / (new - 1):.1f} us, "
          f"{(k_n - k_1) / (new - 1):.0f} kernels (of {new} tokens; prefill cancelled)")
    print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:opt-1.3b")
    ap.add_argument("--prompts", default="128,512")
    ap.add_argument("--parts", default="forward,first_token,beam,sampling")
    args = ap.parse_args()
    parts = args.parts.split(",")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    src = resolve_model(args.model)
    model = load_model(src, load_config(src), torch.float16, torch.device("cuda"), seed=0)
    fuseinfer.patch(model)
    vocab = model.config.vocab_size
    with torch.no_grad():
        for p in (int(x) for x in args.prompts.split(",")):
            ids = torch.randint(3, vocab, (1, p), device="cuda")
            mask = torch.ones_like(ids)
            if "forward" in parts:
                split(f"model(ids) 1x{p}", lambda: model(ids), "tottime")
            if "first_token" in parts:
                split(f"model.generate first token 1x{p}", lambda: model.generate(
                    ids, attention_mask=mask, max_new_tokens=1, do_sample=False), "cumulative")
        ids = torch.randint(3, vocab, (1, 512), device="cuda")
        mask = torch.ones_like(ids)
        if "beam" in parts:
            per_step("beam 4", lambda n: lambda: model.generate(ids, attention_mask=mask, num_beams=4,
                                                                do_sample=False, max_new_tokens=n, min_new_tokens=n))
        if "sampling" in parts:
            for name, kw in (("greedy", {}), ("top-p 0.9 temperature 0.8",
                                              dict(do_sample=True, top_p=0.9, temperature=0.8))):
                per_step(name, lambda n, kw=kw: lambda: fuseinfer.generate(model, ids, max_new_tokens=n,
                                                                            min_new_tokens=n, **kw))

if __name__ == "__main__":
    main()
