"""Split-KV decode attention's split count, swept: the kernel's own choice against forced counts.

    python bench/bench_splitkv.py --out DIR [--cases 1x32x8x512x64,...] [--splits 1,2,4,8,16,32] [--rounds 5]
                                  [--graph-calls 20]

Per case BxHxHKVxCTXxD (batch, query heads, key/value heads, cached keys, head dim; one query per row, a full key
mask and q_start = CTX - 1, as a decode step's attention), ``fuseinfer.ops.attention`` with
``FUSEINFER_SPLITKV_SPLITS`` unset (``auto``: the kernel's choice) and forced to each count of ``--splits`` (capped
by the kernel at one split per block iteration of keys), timed in turn round after round (each round's do_bench
median; the median over rounds reported, with its min and max). Each count is timed as a decode step runs it: a CUDA
graph of ``--graph-calls`` launches, replayed, its time divided by the launches (eager launches with 0). Reports
microseconds per call, GB/s of the K and V bytes read and that as a share of the copy bandwidth measured in the same
run, and the fastest count. The default cases are decode layers at batch 1 (where a step's attention is a few
microseconds and launch-bound): Llama-3.2-1B (32 query heads over 8 key/value heads of 64) at contexts 512, 2048 and
8192, Llama-3.1-8B (8 of 128) at 512 and 8192, OPT-1.3b (32 heads of 64, no grouping) at 512, Llama-3.2-1B at batch
8, and OPT-1.3b at batches 8 and 32 (context 512) and 32 (context 2048). Writes DIR/splitkv.json and .md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import attention_cases, bench_ms, capture_calls, measure_ceilings, write_results  # noqa: E402

from fuseinfer.core import knobs  # noqa: E402
from fuseinfer.ops.attention import attention  # noqa: E402

CASES = ("1x32x8x512x64,1x32x8x2048x64,1x32x8x8192x64,1x32x8x512x128,1x32x8x8192x128,1x32x32x512x64,8x32x8x512x64,"
         "8x32x32x512x64,32x32x32x512x64,32x32x32x2048x64")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for splitkv.json and splitkv.md")
    ap.add_argument("--cases", default=CASES, help="comma list of BATCHxHEADSxKV_HEADSxCONTEXTxHEAD_DIM")
    ap.add_argument("--splits", default="1,2,4,8,16,32", help="forced split counts to time beside the kernel's own")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    ap.add_argument("--graph-calls", type=int, default=20,
                    help="launches per CUDA graph replay, timed per launch (0: eager launches, where a few "
                         "microseconds of host work per call can hide the kernel's own time)")
    args = ap.parse_args()
    common.RESULTS_DIR = Path(args.out)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    counts = ["auto"] + [str(int(n)) for n in args.splits.split(",")]
    ceilings = measure_ceilings()
    rows = []
    for case, b, h, hkv, ctx, d in attention_cases(args.cases, ap):
        q = torch.randn(b, h, 1, d, device="cuda", dtype=dtype)  # (B, H, 1, D)
        k = torch.randn(b, hkv, ctx, d, device="cuda", dtype=dtype)  # (B, HKV, CTX, D)
        v = torch.randn(b, hkv, ctx, d, device="cuda", dtype=dtype) * 0.3
        key_mask = torch.ones(b, ctx, dtype=torch.bool, device="cuda")
        q_start = torch.full((b,), ctx - 1, dtype=torch.int32, device="cuda")
        scale = d ** -0.5

        def run():
            return attention(q, k, v, key_mask, q_start, scale)

        outs = {}
        for n in counts:  # every count computes the same attention (a split only reorders the softmax's sums)
            with knobs.override(SPLITKV_SPLITS="0" if n == "auto" else n):
                outs[n] = run().float()
        diff = max((o - outs["auto"]).abs().max().item() for o in outs.values())
        if not diff < 1e-2:
            raise SystemExit(f"case {case}: forced split counts differ from the kernel's choice by {diff}")
        timed = {}  # count -> what is timed: a CUDA graph of --graph-calls launches (as decode replays), or one launch
        for n in counts:
            with knobs.override(SPLITKV_SPLITS="0" if n == "auto" else n):  # (read when the launch is captured)
                timed[n] = capture_calls([run] * args.graph_calls).replay if args.graph_calls else run
        calls = max(1, args.graph_calls)
        per = {n: [] for n in counts}
        for _ in range(args.rounds):
            for n in counts:
                with knobs.override(SPLITKV_SPLITS="0" if n == "auto" else n):
                    per[n].append(bench_ms(timed[n])["median_ms"] / calls)
        kv_bytes = 2 * b * hkv * ctx * d * q.element_size()
        row = {"case": case, "rows_per_kv_head": h // hkv, "kv_MB": kv_bytes / 1e6, "max_abs_diff": diff}
        for n in counts:
            ms = statistics.median(per[n])
            row[f"{n}_us"] = ms * 1e3
            row[f"{n}_spread_us"] = f"{min(per[n]) * 1e3:.2f}-{max(per[n]) * 1e3:.2f}"
            row[f"{n}_pct_copy"] = 100 * kv_bytes / (ms * 1e-3) / 1e9 / ceilings["copy_GBps"]
        best = min(counts, key=lambda n: row[f"{n}_us"])
        row["best"], row["auto_over_best"] = best, row["auto_us"] / row[f"{best}_us"]
        print(f"{case}: " + ", ".join(f"{n} {row[f'{n}_us']:.2f} us" for n in counts) + f"; best {best}", flush=True)
        rows.append(row)
        q = k = v = outs = timed = None  # (the next case's tensors and graphs replace them)
        torch.cuda.empty_cache()
    columns = (["case", "rows_per_kv_head", "kv_MB"] + [f"{n}_us" for n in counts] + ["best", "auto_over_best"]
               + [f"{n}_pct_copy" for n in ("auto",)])
    out = write_results("splitkv", vars(args), ceilings, rows, columns)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
