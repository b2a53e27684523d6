"""Linear with fused epilogue (fuseinfer_C::linear_epilogue) against cuBLAS, eager PyTorch and torch.compile.

The four linears of an OPT decoder layer, each with the epilogue the patched model uses, fp16:
  qkv       N = 3h,  K = h    bias
  out_proj  N = h,   K = h    bias + residual
  fc1       N = ffn, K = h    bias + ReLU
  fc2       N = h,   K = ffn  bias + residual
for OPT-1.3b (h 2048, ffn 8192) and OPT-6.7b (h 4096, ffn 16384), at prefill (M = 2048, 8192 tokens) and decode
(M = 1, 8, 16, 32) sizes. Columns: ours; "bare mm" = torch.mm(x, w.t()) alone (the GEMM ceiling, no epilogue), the
two timed in turn over five rounds (common.paired_ms; "ours/bare" is the median of the per-round ratios);
"eager" = F.linear(x, w, b) followed by the separate + residual / ReLU op, as the unpatched model runs it;
"compile" = torch.compile(mode="max-autotune-no-cudagraphs") of that eager expression (max-autotune without
CUDA graphs: graph replay would add a copy of x and r into static buffers to every call, and the launch overhead
graphs remove is hidden here anyway; skipped with --no-autotune: each shape autotunes for tens of seconds).
Prefill rows report TFLOP/s = 2MNK / t, decode rows GB/s on the weight bytes (N K 2 / t) and that as % of the
copy bandwidth measured in the same run. M <= 16 runs our skinny tensor-core kernel, larger M cuBLASLt (mirrors
kSkinnyMaxM in csrc/linear.cu). Decode rows also
report the time as the decode step sees it ("graph" columns): calls over distinct weight copies (together
> 4x L2, so every call reads HBM) captured back to back in one CUDA graph, per-call median over five rounds in
which ours and cuBLAS take turns (common.graph_calls_ms); "graph cuBLAS" is
the eager expression (F.linear, plus the separate add / ReLU kernel where the epilogue has one) timed the same
way.

Every row first checks ours against an fp32 reference: error at most 2x eager's (+ slack).
Usage: python bench/bench_linear.py [--quick] [--no-autotune] [--models opt-6.7b] [--name linear]
  -> bench/results/<name>.json and .md (the full run with autotuning takes about 15 minutes on an H100, without
  about one; --quick is OPT-1.3b at M 1, 32, 2048).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import bench_ms, graph_calls_ms, measure_ceilings, paired_ms, paired_ratio, write_results  # noqa: E402

from fuseinfer.core import knobs  # noqa: E402

from fuseinfer.core.extension import extension  # noqa: E402

C = extension()  # the CUDA extension's ops (torch.ops.fuseinfer_C); None when it is not built

DTYPE = torch.float16
SKINNY_MAX_M = 16
MODELS = {"opt-1.3b": (2048, 8192), "opt-6.7b": (4096, 16384)}  # hidden, ffn
PREFILL_M = (2048, 8192)
DECODE_M = (1, 8, 16, 32)
COLUMNS = ["model", "layer", "epilogue", "M", "N", "K", "path", "ours ms", "bare mm ms", "eager ms",
           "compile ms", "ours/bare", "x eager", "x compile", "TFLOP/s", "weight GB/s", "% copy", "graph ms",
           "graph cuBLAS ms", "graph GB/s", "graph % copy"]


def layers(hidden: int, ffn: int):
    """(layer, N, K, epilogue) of one decoder layer."""
    return [("qkv", 3 * hidden, hidden, "bias"), ("out_proj", hidden, hidden, "bias+residual"),
            ("fc1", ffn, hidden, "bias+relu"), ("fc2", hidden, ffn, "bias+residual")]


def eager_fn(epilogue: str):
    """The unfused PyTorch expression: linear with bias, then the residual add or the ReLU as its own op."""
    if epilogue == "bias+residual":
        return lambda x, w, b, r: F.linear(x, w, b) + r
    if epilogue == "bias+relu":
        return lambda x, w, b, r: torch.relu(F.linear(x, w, b))
    return lambda x, w, b, r: F.linear(x, w, b)


def ours_fn(epilogue: str):
    residual = epilogue == "bias+residual"
    act = "relu" if epilogue == "bias+relu" else "none"
    return lambda x, w, b, r: C.linear_epilogue(x, w, b, r if residual else None, act)


def graph_columns(ours, eager, x, w, b, r, copy_gbps: float) -> dict:
    """In-graph per-call time of ours and of cuBLAS (the eager expression) over weight copies > 4x L2."""
    nbytes = w.numel() * w.element_size()
    copies = max(2, -(-4 * torch.cuda.get_device_properties(w.device).L2_cache_size // nbytes))
    ws = [w.clone() for _ in range(copies)]
    t = graph_calls_ms({"ours": [lambda wi=wi: ours(x, wi, b, r) for wi in ws],
                        "cublas": [lambda wi=wi: eager(x, wi, b, r) for wi in ws]})
    t_ours, t_cublas = t["ours"], t["cublas"]
    gbs = nbytes / (t_ours["median_ms"] * 1e-3) / 1e9
    return {"graph ms": t_ours["median_ms"], "graph cuBLAS ms": t_cublas["median_ms"], "graph GB/s": gbs,
            "graph % copy": 100 * gbs / copy_gbps, "graph": t_ours, "graph_cublas": t_cublas,
            "graph_weight_copies": copies}


def check(ours, eager, x, w, b, r):
    """|ours - ref32| <= 2 |eager - ref32| + slack, max over the output; ref32 = eager in fp32."""
    ref32 = eager(x.float(), w.float(), b.float(), r.float())
    ours_err = (ours(x, w, b, r).float() - ref32).abs().max().item()
    eager_err = (eager(x, w, b, r).float() - ref32).abs().max().item()
    assert ours_err <= 2 * eager_err + 1e-6, f"ours err {ours_err:.3g} vs eager {eager_err:.3g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="OPT-1.3b only, M in (1, 32, 2048)")
    parser.add_argument("--no-autotune", action="store_true", help="skip the torch.compile max-autotune column")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    parser.add_argument("--name", default="linear", help="results file name (bench/results/<name>.json, .md)")
    args = parser.parse_args()
    names = ["opt-1.3b"] if args.quick else args.models.split(",")
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}: choose from {', '.join(MODELS)}")
    torch.manual_seed(0)
    models = {name: MODELS[name] for name in names}
    m_values = (1, 32, 2048) if args.quick else DECODE_M + PREFILL_M
    ceilings = measure_ceilings()
    rows = []
    with torch.no_grad():
        for model, (hidden, ffn) in models.items():
            for layer, n, k, epilogue in layers(hidden, ffn):
                w = torch.randn(n, k, device="cuda", dtype=DTYPE) * k**-0.5
                b = torch.randn(n, device="cuda", dtype=DTYPE)
                eager, ours = eager_fn(epilogue), ours_fn(epilogue)
                for m in m_values:
                    x = torch.randn(m, k, device="cuda", dtype=DTYPE)
                    r = torch.randn(m, n, device="cuda", dtype=DTYPE)
                    check(ours, eager, x, w, b, r)
                    # ours and bare alternate over rounds: "ours/bare" is the median of the per-round ratios
                    paired = paired_ms({"ours": lambda: ours(x, w, b, r), "bare": lambda: torch.mm(x, w.t())})
                    t_ours, t_mm = paired["ours"], paired["bare"]
                    t_eager = bench_ms(lambda: eager(x, w, b, r))
                    row = {"model": model, "layer": layer, "epilogue": epilogue, "M": m, "N": n, "K": k,
                           "path": "skinny" if m <= SKINNY_MAX_M else "cublasLt",
                           "ours ms": t_ours["median_ms"], "bare mm ms": t_mm["median_ms"],
                           "eager ms": t_eager["median_ms"],
                           "ours/bare": paired_ratio(t_ours, t_mm),
                           "x eager": t_eager["median_ms"] / t_ours["median_ms"],
                           "ours": t_ours, "bare_mm": t_mm, "eager": t_eager}
                    if not args.no_autotune:
                        torch._dynamo.reset()
                        compiled = torch.compile(eager, mode="max-autotune-no-cudagraphs", dynamic=False)
                        compiled(x, w, b, r)  # compile and autotune outside the timing
                        t_comp = bench_ms(lambda: compiled(x, w, b, r))
                        row.update({"compile ms": t_comp["median_ms"], "compile": t_comp,
                                    "x compile": t_comp["median_ms"] / t_ours["median_ms"]})
                    if m in PREFILL_M:
                        row["TFLOP/s"] = 2 * m * n * k / (t_ours["median_ms"] * 1e-3) / 1e12
                    else:
                        gbs = n * k * DTYPE.itemsize / (t_ours["median_ms"] * 1e-3) / 1e9
                        row.update({"weight GB/s": gbs, "% copy": 100 * gbs / ceilings["copy_GBps"]})
                        row.update(graph_columns(ours, eager, x, w, b, r, ceilings["copy_GBps"]))
                    rows.append(row)
                    print(" | ".join(f"{c}={row[c]:.4g}" if isinstance(row[c], float) else f"{c}={row[c]}"
                                     for c in COLUMNS if c in row), flush=True)
    settings = {"dtype": str(DTYPE), "models": list(models), "M": list(m_values), "quick": args.quick,
                "autotune": not args.no_autotune, "skinny_max_m": SKINNY_MAX_M,
                "note": "L2 flushed before every timed call (triton do_bench); ours and bare mm alternate over 5 "
                        "rounds, ours/bare = median of the per-round ratios; graph columns: back-to-back calls "
                        "over weight copies > 4x L2 in one CUDA graph, >= 50 ms warm-up, ours and cuBLAS in turn "
                        "over 5 rounds of 10 replays, median", "pdl": knobs.get("FUSEINFER_PDL"),
                "gemm_tune": knobs.get("FUSEINFER_GEMM_TUNE")}
    path = write_results(args.name, settings, ceilings, rows, COLUMNS)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
