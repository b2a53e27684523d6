"""Where a fast-decode step spends its time: per-kernel CUDA times of graph replays (torch.profiler) for a
random-weight OPT, and in-graph times of the decode GEMVs (ours vs cuBLAS via F.linear) over weights far
larger than L2. Used to pick the next optimisation; prints tables only."""
from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import fuseinfer
from fuseinfer.core import knobs
from fuseinfer.core.extension import extension
from fuseinfer.harness.models import load_config, load_model, resolve_model
from fuseinfer.ops import linear_epilogue
from fuseinfer.runtime.decode import SESSIONS_ATTR, release

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from common import graph_calls_ms  # noqa: E402


def ours_vs_cublas_us(x, ws, b) -> tuple[float, float]:
    """Per-call µs of linear_epilogue and of cuBLAS (F.linear) over the weights ``ws``, one call each, back to back
    in a graph per side, the two sides in turn over five rounds (common.graph_calls_ms)."""
    t = graph_calls_ms({"ours": [lambda w=w: linear_epilogue(x, w, b) for w in ws],
                        "cublas": [lambda w=w: F.linear(x, w, b) for w in ws]})
    return t["ours"]["median_ms"] * 1e3, t["cublas"]["median_ms"] * 1e3


def gemv_table(m: int) -> None:
    print(f"in-graph linear, M={m}, 16 weight copies rotated (cold L2); GB/s on weight bytes")
    for name, n, k in (("qkv", 6144, 2048), ("out_proj", 2048, 2048), ("fc1", 8192, 2048), ("fc2", 2048, 8192)):
        ws = [torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02 for _ in range(16)]
        b = torch.randn(n, device="cuda", dtype=torch.float16)
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        t_ours, t_cublas = ours_vs_cublas_us(x, ws, b)
        gb = n * k * 2 / 1e9
        print(f"  {name:9s} N={n:5d} K={k:5d}: ours {t_ours:6.1f} us ({gb / t_ours * 1e6:5.0f} GB/s)  "
              f"cuBLAS {t_cublas:6.1f} us ({gb / t_cublas * 1e6:5.0f} GB/s)")
        del ws
    # What a call costs when its weights are not the limit: 16 calls on one weight (L2-resident after the first)
    # and on a 16-row weight (one tile, 64 KB). Each call still waits for the previous one (PDL), as in a model.
    print("  the same calls with the weight bytes taken out of the way:")
    for name, n, k in (("out_proj, one weight (L2)", 2048, 2048), ("16 rows (one tile)", 16, 2048)):
        w = torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02
        b = torch.randn(n, device="cuda", dtype=torch.float16)
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        t_ours, t_cublas = ours_vs_cublas_us(x, [w] * 16, b)
        print(f"  {name:26s}: ours {t_ours:6.2f} us  cuBLAS {t_cublas:6.2f} us")


PHASES = ["qkv", "attention", "attn rows + out_proj", "LN2 + fc1", "ffn rows + fc2", "next LN"]
# (the reads of attn rows, h for the LayerNorms and ffn rows wait for their tagged writers: csrc/decode_step.cu)


def trace_table(out: str | None = None) -> None:
    """Per-phase times of the one-kernel step from its trace (FUSEINFER_DECODE_TRACE=1): mean over layers of
    the mean and the max over blocks of each block's own interval, and how late the last block ends each phase;
    ``out``: a file to save the raw trace to (torch.save)."""
    t = extension().decode_step_trace()
    if t is None or t.numel() == 0:
        print("no trace: set FUSEINFER_DECODE_TRACE=1 (and run the one-kernel step)")
        return
    t = t.double().cpu() / 1e3  # (blocks, 2 + (P + 2) L) µs, P = len(PHASES)
    p = len(PHASES)
    layers = (t.shape[1] - 2) // (p + 2)
    stamps, waits = t[:, :2 + p * layers], t[:, 2 + p * layers:].reshape(t.shape[0], layers, 2)
    d = stamps[:, 1:] - stamps[:, :-1]  # (blocks, 1 + P L): the interval ending at each event
    per_layer = d[:, :p * layers].reshape(t.shape[0], layers, p)
    waited = torch.diff(waits, dim=1, prepend=torch.zeros_like(waits[:, :1]))  # (blocks, L, 2) per layer
    print(f"one-kernel step trace, {t.shape[0]} blocks, {layers} layers: total "
          f"{(stamps[:, -1] - stamps[:, 0]).mean():.1f} us")
    print(f"  {'phase':28s} {'mean us':>8s} {'max-block us':>12s}  (per layer)")
    for i, name in enumerate(PHASES):
        print(f"  {name:28s} {per_layer[:, :, i].mean():8.2f} {per_layer[:, :, i].max(0).values.mean():12.2f}")
    print(f"  {'producer: ring full':28s} {waited[:, :, 0].mean():8.2f} {waited[:, :, 0].max(0).values.mean():12.2f}")
    print(f"  {'consumers: ring empty':28s} {waited[:, :, 1].mean():8.2f} {waited[:, :, 1].max(0).values.mean():12.2f}")
    print(f"  {'LM head':28s} {d[:, -1].mean():8.2f} {d[:, -1].max():12.2f}")
    # %globaltimer is one clock for all SMs: how far the last block ends each phase after the median block does
    # (a hand-off waits for the last writer of what it reads), mean over layers.
    ends = stamps[:, 1:1 + p * layers].reshape(t.shape[0], layers, p)  # (blocks, L, P) absolute µs
    lag = ends.max(0).values - ends.median(0).values  # (L, P)
    print("  phase end, last block after the median block (us, mean over layers): " +
          ", ".join(f"{name} {lag[:, i].mean():.2f}" for i, name in enumerate(PHASES)))
    if out is not None:
        torch.save(t, out)
        print(f"  raw trace (blocks x events, us) saved to {out}")


def time_step(model, ids):
    """A fresh fast-decode session for ``ids``; prints the graph-replayed step time (mean of 50) and returns it."""
    release(model)
    fuseinfer.generate(model, ids, max_new_tokens=256)  # room for the 70 steps below
    session = next(iter(model.__dict__[SESSIONS_ATTR].values()))
    session.begin(ids, torch.ones_like(ids))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        session.advance()
    end.record()
    torch.cuda.synchronize()
    print(f"one decode step (graph replay): {start.elapsed_time(end) * 1e3 / 50:.1f} us")
    return session


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="random:opt-1.3b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--no-gemv-table", action="store_true", help="only the decode step")
    ap.add_argument("--quant", choices=["none", "int8", "fp8"], default="none",
                    help="the step's weights: fp16, int8 weight-only or FP8 (e4m3)")
    ap.add_argument("--trace-out", default=None, help="save the one-kernel step's raw trace here (torch.save)")
    ap.add_argument("--sweep", default="", help="environment settings read when a session is made, each "
                    "combination timed in this process, e.g. 'FUSEINFER_DECODE_KERNEL=0,1,0,1'")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    if not args.no_gemv_table:
        gemv_table(args.batch)
    src = resolve_model(args.model)
    model = load_model(src, load_config(src), torch.float16, torch.device("cuda"), seed=0)
    quant = {"none": None, "int8": fuseinfer.Int8WeightOnly(), "fp8": fuseinfer.Float8()}[args.quant]
    fuseinfer.patch(model, fuseinfer.PatchConfig(quant=quant))
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.context), device="cuda")
    if args.sweep:
        sweep = [(k, v.split(",")) for k, v in (part.split("=") for part in args.sweep.split(";"))]
        for values in itertools.product(*(vals for _, vals in sweep)):
            setting = dict(zip((k for k, _ in sweep), values))
            os.environ.update(setting)
            knobs.push()  # the extension's switches come from fuseinfer.core.knobs
            fuseinfer.runtime.set_runtime(model, fuseinfer.RuntimeConfig())  # the runtime's: the model's config
            print(setting, end=": ")
            time_step(model, ids)
        return
    session = time_step(model, ids)
    print("decode step:", session.path)
    if session.step_kernel is not None:
        trace_table(args.trace_out)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            session.advance()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))


if __name__ == "__main__":
    main()
