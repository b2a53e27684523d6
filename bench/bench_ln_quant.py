"""Fused residual add + LayerNorm + per-token 8-bit quantize (int8 and e4m3) against the copy bandwidth.

Times fuseinfer.ops.add_layer_norm_quant (int8) and add_layer_norm_quant_fp8 (e4m3), two forms each (ln_quant: y =
LN(x) -> q, scale; add_ln_quant_sum: s = x + r -> q, scale, s), at N = 2048, 4096, 8192 and 2040 / 4096 / 8192 rows
(2040: OPT-1.3b's 2040-token prefill), fp16 and bf16; beside them add_layer_norm (the same rows, y written in x's
dtype: the non-quantized kernel sharing the row machinery) and the unfused e4m3 path (add_layer_norm, then
quantize_fp8_per_token: its row quantize kernel on CUDA; "unfused ref": add_layer_norm, then the PyTorch reference
quantize_fp8_ref). For e4m3 the row quantize kernel alone (quantize_fp8_per_token of y: "quant" columns, bytes = y
read + q written + 4 B scale per row; "quant exact": bit for bit against quantize_fp8_ref). Bytes moved = 2 B x (x,
r read, s written) + 1 B q written + 4 B scale per row + weight and bias; "% copy" is that rate over the device-to-
device copy bandwidth measured in the same run (common.measure_ceilings). L2 is flushed before every timed call
(do_bench); the implementations take turns over rounds (common.paired_ms). Target: >= 80% of copy for both forms.
Before timing, each row checks the fused kernel bit for bit against the per-token quantize reference applied to
add_layer_norm's y ("exact": at these row counts both kernels take the same layout, so the same statistics).

Usage: python bench/bench_ln_quant.py [--quick] [--hidden N ...] [--rows R ...] [--out DIR]
  -> DIR/ln_quant.{json,md} (default bench/results)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import common  # noqa: E402
from common import measure_ceilings, paired_ms, paired_ratio, write_results  # noqa: E402

from fuseinfer.ops.fp8_linear import quantize_fp8_per_token, quantize_fp8_ref  # noqa: E402
from fuseinfer.ops.layer_norm import add_layer_norm  # noqa: E402
from fuseinfer.ops.layer_norm_quant import add_layer_norm_quant, add_layer_norm_quant_fp8  # noqa: E402
from fuseinfer.ops.quant import quantize_int8_ref  # noqa: E402

EPS = 1e-5
COLUMNS = ["fmt", "form", "dtype", "N", "rows", "exact", "ours ms", "ours GB/s", "% copy", "add_ln ms",
           "add_ln % copy", "x add_ln", "unfused ms", "x unfused", "unfused ref ms", "quant exact", "quant ms",
           "quant GB/s", "quant % copy", "quant ref ms"]
HIDDEN, ROWS = (2048, 4096, 8192), (2040, 4096, 8192)  # (2040: OPT-1.3b's 2040-token prefill)
QUICK_HIDDEN, QUICK_ROWS = (4096,), (8192,)
FUSED = {"int8": (add_layer_norm_quant, quantize_int8_ref), "e4m3": (add_layer_norm_quant_fp8, quantize_fp8_ref)}


def bench(quick: bool, ceilings: dict, hidden: list[int] | None = None,
          row_counts: list[int] | None = None) -> list[dict]:
    out = []
    hidden = hidden or (QUICK_HIDDEN if quick else HIDDEN)
    row_counts = row_counts or (QUICK_ROWS if quick else ROWS)
    dtypes = [torch.float16] if quick else [torch.float16, torch.bfloat16]
    forms = {"ln_quant": (False, False), "add_ln_quant_sum": (True, True)}
    with torch.no_grad():
        for dtype in dtypes:
            for n in hidden:
                w = (torch.randn(n, device="cuda") * 0.5 + 1).to(dtype)
                b = (torch.randn(n, device="cuda") * 0.1).to(dtype)
                for rows in row_counts:
                    x = torch.randn(rows, n, device="cuda", dtype=dtype)
                    r = torch.randn(rows, n, device="cuda", dtype=dtype)
                    for form, (has_res, store_sum) in forms.items():
                        r_arg = r if has_res else None
                        y = add_layer_norm(x, r_arg, w, b, EPS)[0]
                        for fmt, (op, ref) in FUSED.items():
                            q, scale, _ = op(x, r_arg, w, b, EPS, store_sum)
                            eq, escale = ref(y, -1)
                            exact = bool(torch.equal(q.view(torch.uint8), eq.view(torch.uint8))
                                         and torch.equal(scale, escale))
                            fns = {"ours": lambda: op(x, r_arg, w, b, EPS, store_sum),
                                   "add_ln": lambda: add_layer_norm(x, r_arg, w, b, EPS, store_sum)}
                            if fmt == "e4m3":
                                fns["unfused"] = lambda: quantize_fp8_per_token(
                                    add_layer_norm(x, r_arg, w, b, EPS, store_sum)[0])
                                fns["unfused_ref"] = lambda: quantize_fp8_ref(
                                    add_layer_norm(x, r_arg, w, b, EPS, store_sum)[0], -1)
                                fns["quant"] = lambda: quantize_fp8_per_token(y)  # the row kernel alone
                                fns["quant_ref"] = lambda: quantize_fp8_ref(y, -1)
                                kq, ks = quantize_fp8_per_token(y)
                                quant_exact = bool(torch.equal(kq.view(torch.uint8), eq.view(torch.uint8))
                                                   and torch.equal(ks, escale))
                            t = paired_ms(fns)
                            item = dtype.itemsize
                            moved = rows * n * (item * (1 + has_res + store_sum) + 1) + 4 * rows + 2 * item * n
                            moved_ln = rows * n * item * (2 + has_res + store_sum) + 2 * item * n
                            gbs = moved / (t["ours"]["median_ms"] * 1e-3) / 1e9
                            gbs_ln = moved_ln / (t["add_ln"]["median_ms"] * 1e-3) / 1e9
                            row = {"fmt": fmt, "form": form, "dtype": str(dtype).replace("torch.", ""), "N": n,
                                   "rows": rows, "exact": exact, "ours ms": t["ours"]["median_ms"],
                                   "ours GB/s": gbs, "% copy": 100 * gbs / ceilings["copy_GBps"],
                                   "add_ln ms": t["add_ln"]["median_ms"],
                                   "add_ln % copy": 100 * gbs_ln / ceilings["copy_GBps"],
                                   "x add_ln": paired_ratio(t["add_ln"], t["ours"]), "bytes": moved, "times": t}
                            if "unfused" in t:
                                quant_gbs = (rows * n * (item + 1) + 4 * rows) / (t["quant"]["median_ms"] * 1e-3) / 1e9
                                row.update({"unfused ms": t["unfused"]["median_ms"],
                                            "x unfused": paired_ratio(t["unfused"], t["ours"]),
                                            "unfused ref ms": t["unfused_ref"]["median_ms"],
                                            "quant exact": quant_exact, "quant ms": t["quant"]["median_ms"],
                                            "quant GB/s": quant_gbs,
                                            "quant % copy": 100 * quant_gbs / ceilings["copy_GBps"],
                                            "quant ref ms": t["quant_ref"]["median_ms"]})
                            out.append(row)
                            print(" | ".join(f"{c}={row[c]:.4g}" if isinstance(row.get(c), float)
                                             else f"{c}={row.get(c, '')}" for c in COLUMNS), flush=True)
                    del x, r
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fp16 only (and N = 4096, 8192 rows by default)")
    parser.add_argument("--hidden", type=int, nargs="+", default=None, help="hidden sizes N (default 2048 4096 8192)")
    parser.add_argument("--rows", type=int, nargs="+", default=None, help="row counts (default 2040 4096 8192)")
    parser.add_argument("--out", type=Path, default=None, help="directory for ln_quant.{json,md}")
    args = parser.parse_args()
    if args.out is not None:
        common.RESULTS_DIR = args.out
    if any(v < 1 for v in (args.hidden or []) + (args.rows or [])):
        parser.error("--hidden and --rows take positive integers")
    ceilings = measure_ceilings()
    print(f"ceilings: {ceilings}", flush=True)
    rows = bench(args.quick, ceilings, args.hidden, args.rows)
    settings = {"eps": EPS, "quick": args.quick,
                "note": "L2 flushed before every timed call (do_bench); implementations in turn over 5 rounds; "
                        "% copy against the device-to-device copy bandwidth of this run"}
    print(f"wrote {write_results('ln_quant', settings, ceilings, rows, COLUMNS)}")


if __name__ == "__main__":
    main()
