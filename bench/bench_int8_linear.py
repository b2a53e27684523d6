"""W8A16 linear (fuseinfer_C::w8a16_linear) at OPT decode and prefill shapes, against fp16
(fuseinfer_C::linear_epilogue).

The four linears of an OPT decoder layer with the patched model's epilogues (qkv: bias, out_proj: bias + residual,
fc1: bias + ReLU, fc2: bias + residual) for OPT-1.3b (h 2048, ffn 8192) and OPT-6.7b (h 4096, ffn 16384).
Decode, M = 1, 2, 4, 8, 12, 16: calls over distinct int8 weight copies (together > 4x L2, so every call reads HBM)
captured back to back in one CUDA graph, ours and the fp16 kernel (its own fp16 copies) taking turns over five
rounds (common.graph_calls_ms); per-call medians. Derived: int8 GB/s = N K (int8 bytes; scales, bias and x add
< 0.3%) / t, "% copy" = that / the device-to-device copy bandwidth measured in this run (target >= 85%), and
"x fp16" = fp16 time / int8 time (the bytes halve: 2x at best).
Prefill, M = 2048 (and 8192 without --quick): int8 (dequantize into a scratch weight + cuBLASLt fp16 GEMM with
the epilogue) against fp16 alone, paired over five rounds (common.paired_ms); "int8/fp16" = median of per-round
ratios (target <= 1.10 at OPT-1.3b, 1x2048 summed over the four layers: "sum" rows).
Every row first checks int8 against an fp32 reference of the dequantized weight: error at most 2x PyTorch fp16's.
Usage: python bench/bench_int8_linear.py [--quick]  -> bench/results/w8a16_linear.json and .md
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import graph_calls_ms, measure_ceilings, paired_ms, paired_ratio, write_results  # noqa: E402

from fuseinfer.core.extension import extension  # noqa: E402

C = extension()  # the CUDA extension's ops (torch.ops.fuseinfer_C); None when it is not built
from fuseinfer.ops import quantize_per_channel  # noqa: E402

DTYPE = torch.float16
MODELS = {"opt-1.3b": (2048, 8192), "opt-6.7b": (4096, 16384)}
DECODE_M = (1, 2, 4, 8, 12, 16)
COLUMNS = ["model", "layer", "epilogue", "M", "N", "K", "int8 ms", "fp16 ms", "x fp16", "int8 GB/s", "% copy",
           "prefill int8 ms", "prefill fp16 ms", "int8/fp16"]


def layers(hidden: int, ffn: int):
    return [("qkv", 3 * hidden, hidden, "bias"), ("out_proj", hidden, hidden, "bias+residual"),
            ("fc1", ffn, hidden, "bias+relu"), ("fc2", hidden, ffn, "bias+residual")]


def fns(epilogue: str):
    res = epilogue == "bias+residual"
    act = "relu" if epilogue == "bias+relu" else "none"
    int8 = lambda x, q, s, b, r: C.w8a16_linear(x, q, s, b, r if res else None, act)  # noqa: E731
    fp16 = lambda x, w, b, r: C.linear_epilogue(x, w, b, r if res else None, act)  # noqa: E731
    return int8, fp16, res, act


def check(int8, x, q, s, b, r, res, act):
    w = (q.float() * s[:, None])
    ref = F.linear(x.float(), w, b.float()) + (r.float() if res else 0)
    ref = ref.relu() if act == "relu" else ref
    torch_lp = F.linear(x, w.to(DTYPE), b) + (r if res else 0)
    torch_lp = torch_lp.relu() if act == "relu" else torch_lp
    ours_err = (int8(x, q, s, b, r).float() - ref).abs().max().item()
    torch_err = (torch_lp.float() - ref).abs().max().item()
    assert ours_err <= 2 * torch_err + 1e-3, f"int8 err {ours_err:.3g} vs torch fp16 {torch_err:.3g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="M in (1, 8, 16), prefill M = 2048 only")
    args = parser.parse_args()
    torch.manual_seed(0)
    decode_m = (1, 8, 16) if args.quick else DECODE_M
    prefill_m = (2048,) if args.quick else (2048, 8192)
    l2 = torch.cuda.get_device_properties().L2_cache_size
    ceilings = measure_ceilings()
    copy = ceilings["copy_GBps"]
    rows = []
    with torch.no_grad():
        for model, (hidden, ffn) in MODELS.items():
            sums = {m: [0.0, 0.0] for m in prefill_m}
            for layer, n, k, epilogue in layers(hidden, ffn):
                w = torch.randn(n, k, device="cuda", dtype=DTYPE) * k**-0.5
                q, s = quantize_per_channel(w)
                s = s.reshape(-1).contiguous()
                b = torch.randn(n, device="cuda", dtype=DTYPE)
                int8, fp16, res, act = fns(epilogue)
                copies = max(2, -(-4 * l2 // (n * k)))  # int8 copies, together > 4x L2
                qs = [q.clone() for _ in range(copies)]
                ws = [w.clone() for _ in range(max(2, -(-4 * l2 // (2 * n * k))))]
                for m in decode_m:
                    x = torch.randn(m, k, device="cuda", dtype=DTYPE)
                    r = torch.randn(m, n, device="cuda", dtype=DTYPE)
                    check(int8, x, q, s, b, r, res, act)
                    t = graph_calls_ms({"int8": [lambda qi=qi: int8(x, qi, s, b, r) for qi in qs],
                                        "fp16": [lambda wi=wi: fp16(x, wi, b, r) for wi in ws]})
                    gbs = n * k / (t["int8"]["median_ms"] * 1e-3) / 1e9  # int8 weight bytes / time
                    rows.append({"model": model, "layer": layer, "epilogue": epilogue, "M": m, "N": n, "K": k,
                                 "int8 ms": t["int8"]["median_ms"], "fp16 ms": t["fp16"]["median_ms"],
                                 "x fp16": t["fp16"]["median_ms"] / t["int8"]["median_ms"], "int8 GB/s": gbs,
                                 "% copy": 100 * gbs / copy, "int8": t["int8"], "fp16": t["fp16"],
                                 "weight_copies": copies})
                    print(rows[-1]["model"], layer, m, f"{rows[-1]['% copy']:.1f}% copy", flush=True)
                del qs, ws
                for m in prefill_m:
                    x = torch.randn(m, k, device="cuda", dtype=DTYPE)
                    r = torch.randn(m, n, device="cuda", dtype=DTYPE)
                    check(int8, x, q, s, b, r, res, act)
                    t = paired_ms({"int8": lambda: int8(x, q, s, b, r), "fp16": lambda: fp16(x, w, b, r)})
                    sums[m][0] += t["int8"]["median_ms"]
                    sums[m][1] += t["fp16"]["median_ms"]
                    rows.append({"model": model, "layer": layer, "epilogue": epilogue, "M": m, "N": n, "K": k,
                                 "prefill int8 ms": t["int8"]["median_ms"], "prefill fp16 ms": t["fp16"]["median_ms"],
                                 "int8/fp16": paired_ratio(t["int8"], t["fp16"]), "int8": t["int8"], "fp16": t["fp16"]})
                    print(model, layer, m, f"prefill int8/fp16 {rows[-1]['int8/fp16']:.3f}", flush=True)
            for m, (a, f) in sums.items():
                rows.append({"model": model, "layer": "sum", "epilogue": "", "M": m, "prefill int8 ms": a,
                             "prefill fp16 ms": f, "int8/fp16": a / f})
    settings = {"dtype": str(DTYPE), "decode_M": decode_m, "prefill_M": prefill_m, "quick": args.quick,
                "L2_bytes": l2, "note": "decode: per-call medians in one CUDA graph over weight copies > 4x L2, "
                "int8 and fp16 in turn over 5 rounds; GB/s counts int8 weight bytes N*K; prefill: paired_ms"}
    path = write_results("w8a16_linear", settings, ceilings, rows, COLUMNS)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
