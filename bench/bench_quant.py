"""Row-wise int8 quantization (fuseinfer_C::quantize_int8_rows) against eager PyTorch and torch.compile.

Two forms of the same op (symmetric, scale = max|x| / 127 per row, round half to even), fp16 input:
  per_token    activations (M, K), K = 2048 / 8192 (OPT-1.3b hidden / ffn), M set by the size
  per_channel  weights (N, K) with one scale per output row, K = 2048 / 16384
at 0.5M to 50M elements (1 MB, inside the 50 MB L2, to 100 MB, HBM). Bytes moved = 2 (read x) + 1 (write q) per
element + 4 per row (scale); GB/s = that / our median time, "% copy" against the copy bandwidth measured in the same
run. Ours, eager (``quantize_int8_ref``: amax, divide, round, clamp, cast: several passes) and torch.compile of the
same expression take turns over five rounds (common.paired_ms; L2 flushed before each timed call by do_bench);
rows whose working set fits in half the L2 are also timed L2-resident ("warm": 20 calls on the same tensor in one
CUDA graph, ours and compile in turn, common.graph_calls_ms). Every row first checks ours bit for bit against the
reference. Usage: python bench/bench_quant.py [--quick] -> bench/results/quant.json and .md
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import graph_calls_ms, measure_ceilings, paired_ms, paired_ratio, write_results  # noqa: E402

from fuseinfer.core.extension import extension  # noqa: E402

C = extension()  # the CUDA extension's ops (torch.ops.fuseinfer_C); None when it is not built
from fuseinfer.ops.quant import quantize_int8_ref  # noqa: E402

DTYPE = torch.float16
FORMS = {"per_token": (2048, 8192), "per_channel": (2048, 16384)}
COLUMNS = ["form", "K", "rows", "M elements", "where", "ours ms", "eager ms", "compile ms", "ours GB/s", "% copy",
           "x eager", "x compile", "warm ms", "warm compile ms", "warm x compile"]
WARM_CALLS = 20


def eager(x):
    return quantize_int8_ref(x, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="0.5M, 8M, 50M elements, one K per form")
    args = parser.parse_args()
    torch.manual_seed(0)
    sizes = (0.5, 8, 50) if args.quick else (0.5, 2, 8, 16, 32, 50)  # millions of elements
    l2 = torch.cuda.get_device_properties().L2_cache_size
    ceilings = measure_ceilings()
    rows_out = []
    with torch.no_grad():
        for form, ks in FORMS.items():
            for k in ks[:1] if args.quick else ks:
                torch._dynamo.reset()
                compiled = torch.compile(eager)
                for size in sizes:
                    rows = max(1, int(size * 1e6) // k)
                    x = torch.randn(rows, k, device="cuda", dtype=DTYPE) * 3
                    torch._dynamo.mark_dynamic(x, 0)
                    q, s = C.quantize_int8_rows(x)
                    q_ref, s_ref = quantize_int8_ref(x, -1)
                    assert torch.equal(q, q_ref) and torch.equal(s, s_ref.reshape(-1)), "not bit-exact"
                    compiled(x)
                    t = paired_ms({"ours": lambda: C.quantize_int8_rows(x), "eager": lambda: eager(x),
                                   "compile": lambda: compiled(x)})
                    moved = rows * k * 3 + rows * 4
                    gbs = moved / (t["ours"]["median_ms"] * 1e-3) / 1e9
                    rows_out.append({"form": form, "K": k, "rows": rows, "M elements": rows * k / 1e6,
                                     "where": "L2" if moved <= l2 else "HBM", "ours ms": t["ours"]["median_ms"],
                                     "eager ms": t["eager"]["median_ms"], "compile ms": t["compile"]["median_ms"],
                                     "ours GB/s": gbs, "% copy": 100 * gbs / ceilings["copy_GBps"],
                                     "x eager": paired_ratio(t["eager"], t["ours"]),
                                     "x compile": paired_ratio(t["compile"], t["ours"]), "bytes": moved, **t})
                    if 2 * moved <= l2:
                        w = graph_calls_ms({"ours": [lambda: C.quantize_int8_rows(x)] * WARM_CALLS,
                                            "compile": [lambda: compiled(x)] * WARM_CALLS})
                        rows_out[-1].update({"warm ms": w["ours"]["median_ms"],
                                             "warm compile ms": w["compile"]["median_ms"],
                                             "warm x compile": w["compile"]["median_ms"] / w["ours"]["median_ms"],
                                             "warm": w["ours"], "warm_compile": w["compile"]})
                    print(" | ".join(f"{c}={rows_out[-1][c]:.4g}" if isinstance(rows_out[-1].get(c), float)
                                     else f"{c}={rows_out[-1].get(c)}" for c in COLUMNS), flush=True)
    settings = {"dtype": str(DTYPE), "sizes_M": sizes, "quick": args.quick, "L2_bytes": l2,
                "warm_calls": WARM_CALLS, "bytes": "3 per element (fp16 read, int8 write) + 4 per row"}
    path = write_results("quant", settings, ceilings, rows_out, COLUMNS)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
