"""The host time of a patched model's calls before their GPU work starts, per call, on any device (the CPU too).

Two calls of a random-weight patched model, batch 1:

* ``generate``: ``model.generate(ids, max_new_tokens=1)``: the time from the call to the entry of its session's
  prefill (``prefill.session_prefill``: the first launch of the prefill graph or lean loop), the argument checks,
  the model probe, the session lookup and ``begin`` included;
* ``forward``: ``model(ids)``: the time from the call to the entry of its lean loop or graph replay, and the time
  from the loop's return to the call's (the LM head, the cache, the output).

Each is the median over ``--calls`` calls (after warm-up calls), then a cProfile of the part before the prefill
(function calls per call and the functions by own time). The host logic is the same on the CPU and on CUDA up to
the prefill's launch (CUDA replays graphs there, the CPU runs the lean loop), so a CPU run tracks the host work
on the GPU; ``--shrink`` keeps the model's layers and tensors (what the probe and the checks walk) but makes them
small, for a CPU.

    python tools/profile_host.py [--model random:opt-1.3b] [--device cpu|cuda] [--prompt 128] [--shrink]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

import fuseinfer
from fuseinfer.harness.models import load_config, load_model, resolve_model
from fuseinfer.harness.timing import host_before_prefill_s, on_session_prefill


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def before_prefill_us(fn, dev: torch.device, calls: int) -> float:
    """Median µs from the start of ``fn()`` (a generate call) to its session prefill's entry."""
    return statistics.median(host_before_prefill_s(fn, calls, lambda: _sync(dev))) * 1e6


def forward_split_us(model, fn, dev: torch.device, calls: int) -> tuple[float, float]:
    """Median µs of ``fn()`` (a ``model(ids)`` call) before its lean loop / graph replay starts, and after it
    ends (the loop itself excluded; on CUDA the replay is a launch, so 'after' is host time too)."""
    from fuseinfer.runtime import forward as fw

    family = fuseinfer.core.state.patch_state(model).family
    real_hidden, real_run = type(family).lean_hidden, fw.HiddenGraph.run
    marks, before, after = [], [], []

    def hidden(self, *args, **kwargs):
        marks.append(time.perf_counter())
        out = real_hidden(self, *args, **kwargs)
        marks.append(time.perf_counter())
        return out

    def run(self, *args, **kwargs):
        marks.append(time.perf_counter())
        out = real_run(self, *args, **kwargs)
        marks.append(time.perf_counter())
        return out

    type(family).lean_hidden, fw.HiddenGraph.run = hidden, run
    try:
        for _ in range(calls):
            _sync(dev)
            marks.clear()
            start = time.perf_counter()
            fn()
            end = time.perf_counter()
            before.append((marks[0] - start) * 1e6)
            after.append((end - marks[-1]) * 1e6)
    finally:
        type(family).lean_hidden, fw.HiddenGraph.run = real_hidden, real_run
    return statistics.median(before), statistics.median(after)


def profile_before_prefill(fn, calls: int, rows: int = 25) -> str:
    """cProfile of ``calls`` calls of ``fn()`` (generate calls), each up to its session prefill's entry."""
    prof = cProfile.Profile()
    with on_session_prefill(prof.disable):
        for _ in range(calls):
            prof.enable()
            fn()
            prof.disable()  # (a call that did not reach the prefill)
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(rows)
    text = "\n".join(line for line in out.getvalue().splitlines() if line.strip())
    return f"function calls per call: {stats.total_calls / calls:.0f}\n{text}"


def build(spec: str, device: torch.device, dtype: torch.dtype, shrink: bool):
    source = resolve_model(spec)
    config = load_config(source)
    if shrink:  # the same layers and modules, small tensors (the host work walks modules, not bytes)
        config.hidden_size = config.word_embed_proj_dim = 64
        config.ffn_dim, config.num_attention_heads, config.vocab_size = 128, 2, 512
    model = load_model(source, config, dtype, device, seed=0)
    fuseinfer.patch(model)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:opt-1.3b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="float16 (CUDA default) or float32 (CPU default)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--shrink", action="store_true", help="small tensors, the model's layer count (for a CPU)")
    ap.add_argument("--parts", default="generate,forward")
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("float16" if dev.type == "cuda" else "float32"))
    model = build(args.model, dev, dtype, args.shrink)
    ids = torch.randint(3, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    ids = ids.to(dev)
    print(f"{args.model}{' (shrunk)' if args.shrink else ''} {dtype} on {dev}, torch {torch.__version__}, "
          f"1x{args.prompt}, {model.config.num_hidden_layers} layers")
    parts = args.parts.split(",")
    with torch.no_grad():
        if "generate" in parts:
            gen = lambda: model.generate(ids, max_new_tokens=1, do_sample=False)  # noqa: E731
            for _ in range(3):
                gen()
            print(f"\n== model.generate(max_new_tokens=1): host before the prefill "
                  f"{before_prefill_us(gen, dev, args.calls):.0f} us per call (median of {args.calls})")
            print(profile_before_prefill(gen, args.calls))
        if "forward" in parts:
            fwd = lambda: model(ids)  # noqa: E731
            for _ in range(3):
                fwd()
            before, after = forward_split_us(model, fwd, dev, args.calls)
            print(f"\n== model(ids): host before the lean loop / graph {before:.0f} us, after it {after:.0f} us "
                  f"per call (median of {args.calls})")
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                fwd()
            prof.disable()
            out = io.StringIO()
            stats = pstats.Stats(prof, stream=out)
            stats.sort_stats("tottime").print_stats(15)
            print(f"function calls per call (the loop included): {stats.total_calls / args.calls:.0f}")
            print("\n".join(line for line in out.getvalue().splitlines() if line.strip()))


if __name__ == "__main__":
    main()
