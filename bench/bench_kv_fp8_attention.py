"""Decode attention alone over an FP8 (e4m3) cache against the same attention over a model-dtype cache.

    python bench/bench_kv_fp8_attention.py --out DIR [--cases 32x32x32x2048x64,...] [--rounds 5] [--dtype fp16]

Per case BxHxHKVxCTXxD (batch, query heads, key/value heads, cached keys, head dim; one query per row, a full key
mask and q_start = CTX - 1, as a decode step's attention): ``fuseinfer.ops.attention`` on fp16/bf16 K and V and
``attention_kv_fp8`` on e4m3 K and V with their (2, HKV) scales, timed in turn (``paired_ms``: each round's
do_bench median, median over rounds) on the same queries. Reports microseconds per call, GB/s of the K and V bytes
read (2 or 1 byte an element; q and the output are under 0.1% of them) and that as a share of the copy bandwidth
measured in the same run (read + written bytes, so a kernel that only reads can approach 100%), and ``speedup``
(median over rounds of the fp16 time / the fp8 time; the bytes halve, so 2 is the ceiling). The default cases are
each over 100 MB of fp8 keys and values, well past L2: OPT-1.3b's layer at batch 32 (32 heads of 64, one row per
block), the same heads of 128, two query heads per key/value head (two rows per block), a Llama-3-8B-like layer
(8 key/value heads of 4 query heads each: four rows per block) and a Qwen2-7B-like one (7 query heads per key/value
head: eight rows per block). Writes DIR/kv_fp8_attention.json and .md.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import attention_cases, measure_ceilings, paired_ms, paired_ratio, write_results  # noqa: E402

from fuseinfer.ops.attention import attention, attention_kv_fp8  # noqa: E402
from fuseinfer.ops.kv_cache import dequantize_kv, kv_scales_from, quantize_kv  # noqa: E402

CASES = "32x32x32x2048x64,16x32x32x2048x128,16x32x16x2048x128,16x32x8x4096x128,32x28x4x4096x128"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for kv_fp8_attention.json and .md")
    ap.add_argument("--cases", default=CASES, help="comma list of BATCHxHEADSxKV_HEADSxCONTEXTxHEAD_DIM")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    args = ap.parse_args()
    common.RESULTS_DIR = Path(args.out)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    ceilings = measure_ceilings()
    rows = []
    for case, b, h, hkv, ctx, d in attention_cases(args.cases, ap):
        q = torch.randn(b, h, 1, d, device="cuda", dtype=dtype)
        k32 = torch.randn(b, hkv, ctx, d, device="cuda")  # (B, HKV, CTX, D)
        v32 = torch.randn(b, hkv, ctx, d, device="cuda") * 0.3
        scales = kv_scales_from(k32, v32)  # (2, HKV)
        k8, v8 = quantize_kv(k32, scales[0]), quantize_kv(v32, scales[1])
        del k32, v32
        # the model-dtype cache holds the same values, so both compute the same attention
        k16, v16 = dequantize_kv(k8, scales[0], dtype), dequantize_kv(v8, scales[1], dtype)
        key_mask = torch.ones(b, ctx, dtype=torch.bool, device="cuda")
        q_start = torch.full((b,), ctx - 1, dtype=torch.int32, device="cuda")
        scale = d ** -0.5
        fns = {"fp16": lambda: attention(q, k16, v16, key_mask, q_start, scale),
               "fp8": lambda: attention_kv_fp8(q, k8, v8, key_mask, q_start, scale, scales)}
        diff = (fns["fp16"]().float() - fns["fp8"]().float()).abs().max().item()
        if not diff < 2e-2:  # (both round once to the dtype; NaN fails too)
            raise SystemExit(f"case {case}: the fp8 kernel differs from the fp16 one on the same values by {diff}")
        t = paired_ms(fns, rounds=args.rounds)
        elems = 2 * b * hkv * ctx * d  # keys and values
        row = {"case": case, "rows_per_kv_head": h // hkv, "max_abs_diff": diff}
        for name, nbytes in (("fp16", 2), ("fp8", 1)):
            ms = t[name]["median_ms"]
            gbs = elems * nbytes / (ms * 1e-3) / 1e9
            row[f"{name}_us"], row[f"{name}_kv_GBps"] = ms * 1e3, gbs
            row[f"{name}_pct_copy"] = 100 * gbs / ceilings["copy_GBps"]
            row[f"{name}_rounds_ms"] = t[name]["rounds_ms"]
        row["speedup"] = paired_ratio(t["fp16"], t["fp8"])
        print(f"{case}: fp16 {row['fp16_us']:.1f} us ({row['fp16_kv_GBps']:.0f} GB/s), fp8 {row['fp8_us']:.1f} us "
              f"({row['fp8_kv_GBps']:.0f} GB/s), speedup {row['speedup']:.3f}", flush=True)
        rows.append(row)
        q = k8 = v8 = k16 = v16 = fns = None  # (freed before the next case)
        torch.cuda.empty_cache()
    cols = ["case", "rows_per_kv_head", "fp16_us", "fp16_kv_GBps", "fp16_pct_copy", "fp8_us", "fp8_kv_GBps",
            "fp8_pct_copy", "speedup"]
    settings = {**vars(args), "timing": "paired_ms: fp16 and fp8 in turn each round, do_bench median per round, "
                                        "median over rounds; speedup: median over rounds of fp16 / fp8"}
    print(write_results("kv_fp8_attention", settings, ceilings, rows, cols).with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
