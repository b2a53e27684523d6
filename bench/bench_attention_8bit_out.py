"""The attention prefill with its output quantized for an 8-bit output projection: in the kernel's epilogue against
the separate quantize passes.

    python bench/bench_attention_8bit_out.py --out DIR [--cases 1x32x2040x64,...] [--rounds 5] [--graph-calls 10]

Per case BxHxSxD (causal self-attention, q = k = v length S, fp16), six implementations timed in turn round after
round, each as a CUDA graph of ``--graph-calls`` back-to-back calls (as the prefill graph runs them, PDL overlap
included), time per call:
  * ``fp16``: ``attention`` alone (fp16 output; no quantization: the floor of the others);
  * ``dynamic``: ``attention`` then ``quantize_fp8_per_token`` (what ``Float8()`` runs before out_proj);
  * ``static_pass``: ``attention`` then ``quantize_fp8_static`` (a static scale, quantized in a pass of its own);
  * ``fused``: ``attention_fp8out`` (``Float8(out_proj_input="static")``: e4m3 written by the attention kernel);
  * ``int8_dynamic``: ``attention`` then ``quantize_per_token`` (what ``SmoothQuantW8A8()`` runs before out_proj);
  * ``int8_fused``: ``attention_int8out`` (``SmoothQuantW8A8(out_proj_input="static")``).
Every fused implementation's output is checked against its reference first (the same 8-bit value for > 95% of the
elements; a wrong result stops the run). Reports microseconds per call (median over rounds, with the spread),
attention TFLOP/s with the causal count 4 * B * H * S^2 * D / 2, and the cost of each quantization over ``fp16``.
Default cases: OPT-1.3b (32 heads of 64) and OPT-6.7b (32 heads of 128) at a 2040-token prompt, OPT-1.3b at 512.
Writes DIR/attention_8bit_out.json and .md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import bench_ms, capture_calls, measure_ceilings, write_results  # noqa: E402

from fuseinfer.ops.attention import attention  # noqa: E402
from fuseinfer.ops.attention_8bit_out import (attention_fp8out, attention_fp8out_ref, attention_int8out,  # noqa: E402
                                             attention_int8out_ref)
from fuseinfer.ops.fp8_linear import quantize_fp8_per_token  # noqa: E402
from fuseinfer.ops.linear_8bit_out import quantize_fp8_static  # noqa: E402
from fuseinfer.ops.quant import quantize_per_token  # noqa: E402

CASES = "1x32x2040x64,1x32x2040x128,1x32x512x64"
IMPLS = ("fp16", "dynamic", "static_pass", "fused", "int8_dynamic", "int8_fused")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for attention_8bit_out.json and .md")
    ap.add_argument("--cases", default=CASES, help="comma list of BATCHxHEADSxSEQxHEAD_DIM")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--graph-calls", type=int, default=10, help="calls per CUDA graph replay, timed per call")
    args = ap.parse_args()
    common.RESULTS_DIR = Path(args.out)
    ceilings = measure_ceilings()
    rows = []
    for case in args.cases.split(","):
        b, h, s, d = (int(x) for x in case.lower().split("x"))
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.float16) for _ in range(3))  # (B, H, S, D)
        scale = d ** -0.5
        out16 = attention(q, k, v, None, None, scale)  # (B, S, H, D)
        out_scale = (out16.float().abs().amax() / 448).reshape(1)
        int8_scale = (out16.float().abs().amax() / 127).reshape(1)
        runs = {
            "fp16": lambda: attention(q, k, v, None, None, scale),
            "dynamic": lambda: quantize_fp8_per_token(attention(q, k, v, None, None, scale).view(b * s, h * d)),
            "static_pass": lambda: quantize_fp8_static(attention(q, k, v, None, None, scale), out_scale),
            "fused": lambda: attention_fp8out(q, k, v, None, None, scale, out_scale),
            "int8_dynamic": lambda: quantize_per_token(attention(q, k, v, None, None, scale).view(b * s, h * d)),
            "int8_fused": lambda: attention_int8out(q, k, v, None, None, scale, int8_scale),
        }
        refs = {"static_pass": attention_fp8out_ref(q, k, v, None, None, scale, out_scale).view(torch.uint8),
                "int8_fused": attention_int8out_ref(q, k, v, None, None, scale, int8_scale).view(torch.uint8)}
        refs["fused"] = refs["static_pass"]
        for name, ref in refs.items():
            same = (runs[name]().view(torch.uint8) == ref).float().mean().item()
            if not same > 0.95:
                raise SystemExit(f"case {case}: {name}'s 8-bit output matches the reference for {same:.3f} only")
        timed = {n: capture_calls([runs[n]] * args.graph_calls).replay for n in IMPLS}
        per = {n: [] for n in IMPLS}
        for _ in range(args.rounds):
            for n in IMPLS:
                per[n].append(bench_ms(timed[n])["median_ms"] / args.graph_calls)
        flops = 4 * b * h * s * s * d / 2
        row = {"case": case}
        for n in IMPLS:
            ms = statistics.median(per[n])
            row[f"{n}_us"] = ms * 1e3
            row[f"{n}_spread_us"] = f"{min(per[n]) * 1e3:.1f}-{max(per[n]) * 1e3:.1f}"
            row[f"{n}_TFLOPs"] = flops / (ms * 1e-3) / 1e12
        for n in IMPLS[1:]:
            row[f"{n}_over_fp16_us"] = row[f"{n}_us"] - row["fp16_us"]
        print(f"{case}: " + ", ".join(f"{n} {row[f'{n}_us']:.1f} us" for n in IMPLS), flush=True)
        rows.append(row)
        q = k = v = timed = None
        torch.cuda.empty_cache()
    columns = (["case"] + [f"{n}_us" for n in IMPLS] + [f"{n}_spread_us" for n in IMPLS]
               + [f"{n}_over_fp16_us" for n in IMPLS[1:]] + ["fp16_TFLOPs", "fused_TFLOPs", "int8_fused_TFLOPs"])
    print(f"wrote {write_results('attention_8bit_out', vars(args), ceilings, rows, columns)}")


if __name__ == "__main__":
    main()
