"""Shared helpers for the benchmark scripts in bench/: timing, ceilings, environment and result files.

Kernel benchmarks time with CUDA events through ``triton.testing.do_bench`` (warm-up excluded; decode-sized
calls also back to back in a CUDA graph, ``graph_calls_ms``) and report the median with the 10th and 90th
percentiles; where two implementations are compared they take turns over rounds (``paired_ms``, reporting the
median, min and max over rounds, and ``paired_ratio``; bench_attention does the same over all its
implementations). Medians of an even count are the upper one. bench_decode times whole generate calls by wall
clock. Every benchmark re-measures the two ceilings
of the GPU in the same run (device-to-device copy bandwidth, by the eval CLI's ``copy_bandwidth_gbps``, and cuBLAS
fp16 matmul rate) and writes ``bench/results/<name>.json`` plus a Markdown table next to it.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path

import torch

from fuseinfer.core.knobs import override
from fuseinfer.harness.timing import copy_bandwidth_gbps, summarize, time_call

RESULTS_DIR = Path(os.environ.get("FUSEINFER_BENCH_DIR", Path(__file__).resolve().parent / "results"))


def bench_ms(fn, warmup_ms: float = 25, rep_ms: float = 100) -> dict:
    """Times ``fn`` with CUDA events; returns median, p10 and p90 in milliseconds."""
    from triton.testing import do_bench

    p50, p10, p90 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.1, 0.9], return_mode="median")
    return {"median_ms": p50, "p10_ms": p10, "p90_ms": p90}


def paired_ms(fns: dict, rounds: int = 5, rep_ms: float = 50, contexts: dict | None = None) -> dict:
    """Times the closures in ``fns`` in turn, ``rounds`` times over (A B A B ...), so that clock and thermal
    drift between them cancels in a ratio. Returns, per name, the median over rounds of each round's do_bench
    median (``median_ms``), the smallest and largest of them and the list (``min_ms``, ``max_ms``, ``rounds_ms``).
    ``contexts`` maps a name to a context-manager factory entered around that closure's timing (e.g. a knob
    override that selects the implementation; outside the timed calls)."""
    contexts = contexts or {}
    per = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            with contexts.get(name, contextlib.nullcontext)():
                per[name].append(bench_ms(fn, rep_ms=rep_ms)["median_ms"])
    return {name: round_stats(times) for name, times in per.items()}


def round_stats(times: list) -> dict:
    """One implementation's per-round times (ms, in round order): their median, min and max, and the list."""
    s = sorted(times)
    return {"median_ms": s[len(s) // 2], "min_ms": s[0], "max_ms": s[-1], "rounds_ms": times}


def paired_ratio(a: dict, b: dict) -> float:
    """Median over rounds of a's time / b's time in the same round (two entries of one ``paired_ms`` result)."""
    r = sorted(x / y for x, y in zip(a["rounds_ms"], b["rounds_ms"]))
    return r[len(r) // 2]


def fused_bench_args(doc: str, stem: str, argv=None):
    """The fused-projection benches' command line: (args, dtype, rows M); ``--quick`` M 512 and 2048 only; the result
    file name defaults to ``<stem>_<dtype>``."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="M 512 and 2048 only")
    ap.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    ap.add_argument("--name", default=None, help=f"result file name (default {stem}_<dtype>)")
    args = ap.parse_args(argv)
    args.name = args.name or f"{stem}_{args.dtype}"
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    return args, dtype, (512, 2048) if args.quick else (128, 512, 2048, 8192)


# the columns of fused_pair_gemm_row, after the bench's own
FUSED_PAIR_GEMM_COLUMNS = ["fused_kernel", "fused_ms", "pair_ms", "gemm_ms", "fused_TFLOPs", "gemm_TFLOPs",
                           "fused_over_pair", "fused_over_gemm", "max_abs_diff_vs_pair"]


def fused_pair_gemm_row(fns: dict, knob: str, values: dict, flops: float) -> dict:
    """A fused projection against its unfused pair and the bare GEMM: ``fns`` "fused", "pair" and "gemm" timed in turn
    (``paired_ms``) with the knob FUSEINFER_``knob`` set to ``values[name]`` around each. Their medians, TFLOP/s
    (``flops`` per call) of fused and gemm, the ratios fused / pair and fused / gemm (medians of per-round ratios) and
    the spread."""
    t = paired_ms(fns, contexts={name: (lambda v=v: override(**{knob: v})) for name, v in values.items()})
    return {"fused_ms": t["fused"]["median_ms"], "pair_ms": t["pair"]["median_ms"], "gemm_ms": t["gemm"]["median_ms"],
            "fused_TFLOPs": flops / (t["fused"]["median_ms"] * 1e-3) / 1e12,
            "gemm_TFLOPs": flops / (t["gemm"]["median_ms"] * 1e-3) / 1e12,
            "fused_over_pair": paired_ratio(t["fused"], t["pair"]),
            "fused_over_gemm": paired_ratio(t["fused"], t["gemm"]), "spread": t}


def show_fused_row(model: str, m: int, row: dict) -> None:
    """One progress line of a fused-projection bench."""
    shown = ("fused_ms", "pair_ms", "gemm_ms", "fused_over_pair", "fused_over_gemm")
    print(model, m, {c: round(row[c], 4) for c in shown}, flush=True)


def write_fused_results(args, rows_m, ceilings: dict, rows: list, lead: list) -> Path:
    """A fused-projection bench's results: its ``lead`` columns, then FUSED_PAIR_GEMM_COLUMNS."""
    return write_results(args.name, {"dtype": args.dtype, "rows": list(rows_m), "rounds": 5,
                                     "timing": "CUDA events (do_bench), implementations in turn"},
                         ceilings, rows, [*lead, *FUSED_PAIR_GEMM_COLUMNS])


def capture_calls(calls) -> torch.cuda.CUDAGraph:
    """One CUDA graph of the closures ``calls`` back to back, each run once outside it first (kernel selection,
    workspaces, lazily made buffers)."""
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    return graph


def graph_calls_ms(groups: dict, rounds: int = 5, replays: int = 10, warmup_ms: float = 50) -> dict:
    """Per-call time of each group of ``calls`` (closures, e.g. one per weight copy) captured back to back in a
    CUDA graph of its own. This is how the decode step runs them: no host launch overhead, and (with PDL) each
    kernel overlapping the previous one's tail. Give the calls distinct weights whose total exceeds L2 so every
    call reads HBM. Each graph first replays, untimed, for at least ``warmup_ms`` (three replays did before: right
    after bench_linear's M = 8192 GEMMs, OPT-6.7b's fc2 at M = 1 timed 55.5 us per call in a 2-call graph, 47.5 us
    in a process of its own, H100); then the groups take turns, ``rounds`` times over, each turn ``replays`` timed
    replays (a lone run of 20 replays once read OPT-6.7b's out_proj at M = 8 at half its speed in the rounds
    around it). Per group: the median over all timed replays (``median_ms``, with p10 and p90), per call."""
    graphs = {name: (capture_calls(calls), len(calls)) for name, calls in groups.items()}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for graph, _ in graphs.values():  # batches of 5 replays until warmup_ms have passed on the GPU
        warm = 0.0
        while warm < warmup_ms:
            start.record()
            for _ in range(5):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            warm += start.elapsed_time(end)
    times = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, (graph, n_calls) in graphs.items():
            for _ in range(replays):
                start.record()
                graph.replay()
                end.record()
                torch.cuda.synchronize()
                times[name].append(start.elapsed_time(end) / n_calls)
    return {name: percentile_stats(t) for name, t in times.items()}


def attention_cases(spec: str, ap) -> list[tuple]:
    """(case, B, H, HKV, CTX, D) for each BATCHxHEADSxKV_HEADSxCONTEXTxHEAD_DIM of the comma list ``spec``; a case
    whose heads are not a multiple of its key/value heads stops the command line (``ap.error``)."""
    cases = []
    for case in spec.split(","):
        b, h, hkv, ctx, d = (int(x) for x in case.lower().split("x"))
        if h % hkv:
            ap.error(f"case {case}: heads must be a multiple of key/value heads")
        cases.append((case, b, h, hkv, ctx, d))
    return cases


def wall_ms(fn) -> float:
    """Wall time of fn() in ms, the GPU synchronised before and after (host work included, e.g. a generate call's)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def event_ms(fn) -> float:
    """GPU time of one fn() call in ms by CUDA events, the GPU idle before it (fuseinfer.harness.timing.time_call)."""
    return time_call(fn, torch.device("cuda"))


def percentile_stats(times: list) -> dict:
    """Median, 10th and 90th percentile (ms) of ``times``, interpolated between ranks as the eval CLI's
    ``fuseinfer.harness.timing.summarize`` does (torch.quantile), plus the count."""
    s = summarize(times)
    return {"median_ms": s["median"], "p10_ms": s["p10"], "p90_ms": s["p90"], "n": s["n"]}


def decode_model(name: str, dtype: str):
    """(model, its ModelStats) for a decode benchmark: ``name`` (``random:...`` or a folder) loaded on CUDA in
    ``dtype`` ("fp16" / "bf16"), seed 0, with no EOS id (random weights must never stop early)."""
    from fuseinfer.harness.models import load_config, load_model, model_stats, resolve_model

    source = resolve_model(name)
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    model = load_model(source, load_config(source), torch_dtype, torch.device("cuda"), seed=0)
    model.generation_config.eos_token_id = None
    return model, model_stats(model)


def measure_ceilings() -> dict:
    """Measured copy bandwidth (GB/s of bytes read + written, ``fuseinfer.harness.timing.copy_bandwidth_gbps``, the
    eval CLI's measurement) and cuBLAS fp16 matmul TFLOP/s."""
    copy_gbs = copy_bandwidth_gbps(torch.device("cuda"))
    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.float16)
    b = torch.randn(m, m, device="cuda", dtype=torch.float16)
    mm = bench_ms(lambda: a @ b)
    tflops = 2 * m**3 / (mm["median_ms"] * 1e-3) / 1e12
    return {"copy_GBps": copy_gbs, "matmul_fp16_TFLOPs": tflops}


def environment() -> dict:
    """GPU name, driver, CUDA, torch, transformers and fuseinfer versions (the eval CLI's record)."""
    from fuseinfer.harness.environment import environment as eval_environment

    return eval_environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def write_results(name: str, settings: dict, ceilings: dict, rows: list[dict], columns: list[str]) -> Path:
    """Writes results/<name>.json and results/<name>.md; returns the JSON path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in settings.items() if k != "out"}  # (where the files went is no setting of the run)
    env = environment()
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps({"name": name, "environment": env, "settings": settings,
                                "ceilings": ceilings, "rows": rows}, indent=2))
    lines = [f"# {name}", "", f"GPU: {env.get('gpu')}, driver {env.get('driver')}, CUDA {env.get('cuda')}, "
             f"torch {env.get('torch')}, transformers {env.get('transformers')}", "",
             f"Ceilings measured in this run: copy {ceilings['copy_GBps']:.0f} GB/s, "
             f"cuBLAS fp16 {ceilings['matmul_fp16_TFLOPs']:.0f} TFLOP/s. Settings: {json.dumps(settings)}", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [f"{row[c]:.4g}" if isinstance(row.get(c), float) else str(row.get(c, "")) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    (RESULTS_DIR / f"{name}.md").write_text("\n".join(lines) + "\n")
    return path
