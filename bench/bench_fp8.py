"""FP8 (e4m3) linears on Hopper: the CUTLASS sm_90 FP8 GEMM with its fused epilogue against torch._scaled_mm and
cuBLAS fp16, and the e4m3 weight GEMV of decode against the int8 and fp16 ones.

Part 1, GEMM (``fp8_gemm`` results): OPT-1.3b and OPT-6.7b prefill shapes, M = 2048 (and 8192 unless --quick), each
layer's linear with the epilogue it has in the model (q/k/v: + bias; out_proj, fc2: + bias + residual; fc1: + bias,
ReLU). Timed in turn over rounds (common.paired_ms; "x" columns are medians of per-round ratios):
  ours           fuseinfer.ops.fp8_linear: e4m3 x e4m3 wgmma (CUTLASS sm90, fast accumulation) with the per-token x
                 per-channel scales, bias, residual / ReLU in the epilogue, fp16 out (the backend is recorded per row);
  scaled_mm      torch._scaled_mm with row-wise scales (bf16 out), then the epilogue as PyTorch ops (fuseinfer's FP8
                 path without the kernel);
  scaled_mm bare torch._scaled_mm alone (row-wise scales, bf16 out);
  cublas         bare cuBLAS fp16 ``torch.mm(x, w.T)``.
TFLOPs = 2 M N K / median. Targets (OPT-6.7b, M = 2048): ours >= 1.7x cublas and >= 1.1x scaled_mm row-wise.
Each row first checks ours against the float64 formula on the same e4m3 operands (SQNR >= 40 dB).

Part 2, GEMV (``fp8_gemv`` results): OPT-1.3b's four decoder linears at M = 1 and 8, 16 weight copies rotated so
the weights come from HBM, calls back to back in a CUDA graph (common.graph_calls_ms): fp8_weight_linear (e4m3
weights), w8a16_linear (int8) and linear_epilogue (fp16); GB/s over the weight bytes and % of the copy bandwidth
measured in the same run.

Usage: python bench/bench_fp8.py [--quick] [--part gemm|gemv|all]
"""
from __future__ import annotations

import argparse
import importlib
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import graph_calls_ms, measure_ceilings, paired_ms, paired_ratio, write_results  # noqa: E402

from fuseinfer.ops import fp8_weight_linear, linear_epilogue, w8a16_linear  # noqa: E402
from fuseinfer.ops.fp8_linear import fp8_backend, fp8_linear, fp8_linear_ref, quantize_fp8_ref  # noqa: E402
from fuseinfer.ops.quant import quantize_int8_ref  # noqa: E402

MODELS = {"opt-1.3b": (2048, 8192), "opt-6.7b": (4096, 16384)}  # hidden E, ffn F
DTYPE = torch.float16
GEMM_COLUMNS = ["model", "layer", "M", "N", "K", "backend", "ours ms", "scaled_mm ms", "scaled_mm bare ms",
                "cublas ms", "ours TFLOPs", "x cublas", "x scaled_mm", "x scaled_mm bare", "sqnr dB"]
GEMV_COLUMNS = ["layer", "M", "N", "K", "fp8 us", "int8 us", "fp16 us", "fp8 GB/s", "fp8 % copy", "int8 % copy",
                "fp16 % copy"]


def layers(e: int, f: int) -> list[tuple[str, int, int, str, bool]]:
    """(name, N, K, activation, residual) of one OPT decoder layer's linears."""
    return [("qkv", 3 * e, e, "none", False), ("out_proj", e, e, "none", True), ("fc1", f, e, "relu", False),
            ("fc2", e, f, "none", True)]


def sqnr_db(ref, approx) -> float:
    return 10 * math.log10(ref.double().pow(2).sum().item() / (ref.double() - approx.double()).pow(2).sum().item())


def bench_gemm(quick: bool, ceilings: dict) -> list[dict]:
    mod = importlib.import_module("fuseinfer.ops.fp8_linear")
    rows = []
    for model, (e, f) in MODELS.items():
        for m in [2048] if quick else [2048, 8192]:
            for name, n, k, act, has_res in layers(e, f):
                torch.manual_seed(0)
                x = torch.randn(m, k, device="cuda", dtype=DTYPE)
                w = torch.randn(n, k, device="cuda", dtype=DTYPE) * 0.02
                bias = torch.randn(n, device="cuda", dtype=DTYPE) * 0.1
                res = torch.randn(m, n, device="cuda", dtype=DTYPE) if has_res else None
                xq, xs = quantize_fp8_ref(x, -1)  # (M, K) e4m3, (M, 1) fp32
                wq, ws = quantize_fp8_ref(w, -1)  # (N, K) e4m3, (N, 1) fp32
                out = fp8_linear(xq, xs, wq, ws, bias, res, act, DTYPE)
                sq = sqnr_db(fp8_linear_ref(xq, xs, wq, ws, bias, res, act, torch.float32), out)
                assert sq >= 40.0, f"{model} {name} M={m}: SQNR {sq:.1f} dB against the reference"
                wq_t, ws_row = wq.t(), ws.reshape(1, n)
                t = paired_ms({
                    "ours": lambda: fp8_linear(xq, xs, wq, ws, bias, res, act, DTYPE),
                    "scaled_mm": lambda: mod._scaled_mm(xq, xs, wq, ws, bias, res, act, DTYPE),
                    "scaled_mm_bare": lambda: torch._scaled_mm(xq, wq_t, scale_a=xs, scale_b=ws_row,
                                                               out_dtype=torch.bfloat16),
                    "cublas": lambda: torch.mm(x, w.t()),
                }, rounds=3, rep_ms=40)
                flops = 2 * m * n * k
                rows.append({
                    "model": model, "layer": name, "M": m, "N": n, "K": k, "backend": fp8_backend(x.device, DTYPE),
                    "ours ms": t["ours"]["median_ms"], "scaled_mm ms": t["scaled_mm"]["median_ms"],
                    "scaled_mm bare ms": t["scaled_mm_bare"]["median_ms"], "cublas ms": t["cublas"]["median_ms"],
                    "ours TFLOPs": flops / (t["ours"]["median_ms"] * 1e-3) / 1e12,
                    "x cublas": paired_ratio(t["cublas"], t["ours"]),
                    "x scaled_mm": paired_ratio(t["scaled_mm"], t["ours"]),
                    "x scaled_mm bare": paired_ratio(t["scaled_mm_bare"], t["ours"]), "sqnr dB": sq, "times": t,
                })
                print(" | ".join(f"{c}={rows[-1][c]:.4g}" if isinstance(rows[-1][c], float) else f"{c}={rows[-1][c]}"
                                 for c in GEMM_COLUMNS), flush=True)
    return rows


def bench_gemv(ceilings: dict) -> list[dict]:
    rows = []
    e, f = MODELS["opt-1.3b"]
    for m in (1, 8):
        for name, n, k, _, _ in layers(e, f):
            torch.manual_seed(0)
            ws = [torch.randn(n, k, device="cuda") * 0.02 for _ in range(16)]
            fp8 = [quantize_fp8_ref(w, -1) for w in ws]
            int8 = [quantize_int8_ref(w, -1) for w in ws]
            fp16 = [w.to(DTYPE) for w in ws]
            del ws
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            b = torch.randn(n, device="cuda", dtype=DTYPE)
            t = graph_calls_ms({
                "fp8": [lambda q=q, s=s: fp8_weight_linear(x, q, s.view(-1), b) for q, s in fp8],
                "int8": [lambda q=q, s=s: w8a16_linear(x, q, s.view(-1), b) for q, s in int8],
                "fp16": [lambda w=w: linear_epilogue(x, w, b) for w in fp16],
            })
            us = {key: t[key]["median_ms"] * 1e3 for key in t}  # per call
            pct = {key: 100 * n * k * (2 if key == "fp16" else 1) / (us[key] * 1e-6) / 1e9 / ceilings["copy_GBps"]
                   for key in us}
            rows.append({"layer": name, "M": m, "N": n, "K": k, "fp8 us": us["fp8"], "int8 us": us["int8"],
                         "fp16 us": us["fp16"], "fp8 GB/s": n * k / (us["fp8"] * 1e-6) / 1e9,
                         "fp8 % copy": pct["fp8"], "int8 % copy": pct["int8"], "fp16 % copy": pct["fp16"]})
            print(" | ".join(f"{c}={rows[-1][c]:.4g}" if isinstance(rows[-1][c], float) else f"{c}={rows[-1][c]}"
                             for c in GEMV_COLUMNS), flush=True)
            del fp8, int8, fp16
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="M = 2048 only")
    parser.add_argument("--part", choices=["gemm", "gemv", "all"], default="all")
    args = parser.parse_args()
    ceilings = measure_ceilings()
    print(f"ceilings: {ceilings}; FP8 GEMM backend: {fp8_backend(torch.device('cuda'), DTYPE)}", flush=True)
    if args.part in ("gemm", "all"):
        settings = {"dtype": "e4m3 x e4m3 -> fp32, fp16 out", "quick": args.quick, "rounds": 3,
                    "note": "ours / _scaled_mm + epilogue / _scaled_mm bare / cuBLAS fp16 bare in turn over 3 rounds"}
        print(f"wrote {write_results('fp8_gemm', settings, ceilings, bench_gemm(args.quick, ceilings), GEMM_COLUMNS)}")
    if args.part in ("gemv", "all"):
        settings = {"note": "16 weight copies rotated (cold L2), calls back to back in one CUDA graph per format; "
                            "% copy = weight bytes / time over the copy bandwidth of this run"}
        print(f"wrote {write_results('fp8_gemv', settings, ceilings, bench_gemv(ceilings), GEMV_COLUMNS)}")


if __name__ == "__main__":
    main()
