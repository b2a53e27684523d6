"""The gated MLP's gate/up projection at prefill sizes: the sm_90 GEMM with SiLU(gate) * up in its epilogue against
the unfused pair and the bare GEMM.

Three implementations of y (M, F) = silu(x @ w[:F]^T) * (x @ w[F:]^T), x (M, K), w (2F, K), timed in turn over
five rounds in one process (ratios are medians of per-round ratios):
  fused = linear_epilogue(x, w, activation="silu_mul") with FUSEINFER_SILU_GEMM=1: one kernel
          (csrc/silu_gemm_sm90.cu), writes y only;
  pair  = linear_epilogue(x, w) then silu_mul: cuBLASLt's GEMM writing (M, 2F), then the activation pass (what
          FUSEINFER_SILU_GEMM=0 runs);
  gemm  = torch.mm(x, w.t()): cuBLAS's GEMM alone, no activation (the ceiling the prefill target is quoted against).
TFLOP/s = 2 M (2F) K / t. Shapes: the MLPs of Llama-3.2-1B (K 2048, F 8192), Qwen2.5-1.5B (K 1536, F 8960) and
Llama-3.1-8B (K 4096, F 14336) at M = 128, 512, 2048, 8192 rows. Every row first checks fused against the pair.
Usage: python bench/bench_silu_gemm.py [--quick] [--dtype fp16|bf16] [--name silu_gemm]
  -> bench/results/<name>.json, .md
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import (fused_bench_args, fused_pair_gemm_row, measure_ceilings, show_fused_row,  # noqa: E402
                    write_fused_results)

from fuseinfer import ops  # noqa: E402
from fuseinfer.core.extension import extension  # noqa: E402
from fuseinfer.core.knobs import override  # noqa: E402

# FUSEINFER_SILU_GEMM while each is timed: the fused GEMM on, the pair off
KNOB = {"fused": "1", "pair": "0", "gemm": "0"}

MLPS = {"llama-3.2-1b": (2048, 8192), "qwen2.5-1.5b": (1536, 8960), "llama-3.1-8b": (4096, 14336)}


def main(argv=None) -> None:
    args, dtype, rows_m = fused_bench_args(__doc__, "silu_gemm", argv)
    ceilings = measure_ceilings()
    rows = []
    for model, (k, f) in MLPS.items():
        w = (torch.randn(2 * f, k, device="cuda") * k ** -0.5 * 3).to(dtype)
        for m in rows_m:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            fns = {"fused": lambda: ops.linear_epilogue(x, w, None, None, "silu_mul"),
                   "pair": lambda: ops.silu_mul(ops.linear_epilogue(x, w, None, None, "none")),
                   "gemm": lambda: torch.mm(x, w.t())}
            before = extension().path_counts()["linear.silu_gemm"]
            with override(SILU_GEMM="1"):
                fused = fns["fused"]()
            took = extension().path_counts()["linear.silu_gemm"] - before == 1
            diff = (fused.float() - fns["pair"]().float()).abs().max().item()
            rows.append({"model": model, "M": m, "F": f, "K": k, "fused_kernel": took, "max_abs_diff_vs_pair": diff,
                         **fused_pair_gemm_row(fns, "SILU_GEMM", KNOB, 2 * m * 2 * f * k)})
            show_fused_row(model, m, rows[-1])
    write_fused_results(args, rows_m, ceilings, rows, ["model", "M", "F", "K"])


if __name__ == "__main__":
    main()
