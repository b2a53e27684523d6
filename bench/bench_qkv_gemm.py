"""The q/k/v projection at prefill sizes over the static cache: the sm_90 GEMM with the rotary embedding, the split
into heads and the cache write in its epilogue, against the unfused pair and the bare GEMM.

Three implementations of q = linear_rope_append(x, w, bias, cos, sin, H, Hkv, k_cache, v_cache, slots), x (1, M, K),
w ((H + 2 Hkv) D, K), timed in turn over five rounds in one process (ratios are medians of per-round ratios):
  fused = with FUSEINFER_QKV_GEMM=1: one kernel (csrc/qkv_rope_gemm_sm90.cu) reading x and w, writing q, k and v once;
  pair  = with FUSEINFER_QKV_GEMM=0: cuBLASLt's GEMM writing (M, N), then qkv_rope_append (reads it, writes q, k, v);
  gemm  = torch.mm(x, w.t()): cuBLAS's GEMM alone, no bias, rotary or split (the ceiling).
TFLOP/s = 2 M N K / t. Shapes: the q/k/v of Llama-3.2-1B (K 2048, 32 / 8 heads of 64), Qwen2.5-1.5B (K 1536, 12 / 2
of 128, biases), Llama-3.1-8B (K 4096, 32 / 8 of 128) and OPT-1.3b (K 2048, 32 / 32 of 64, biases, no rotation) at
M = 128, 512, 2048, 8192 rows. Every row first checks fused against the pair.
Usage: python bench/bench_qkv_gemm.py [--quick] [--dtype fp16|bf16] [--name NAME]
  -> bench/results/<name>.json, .md (default name qkv_gemm_<dtype>)
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

# FUSEINFER_QKV_GEMM while each is timed: the fused GEMM on, the pair off
KNOB = {"fused": "1", "pair": "0", "gemm": "0"}

# name: (K, H, Hkv, D, bias, rotary)
PROJECTIONS = {"llama-3.2-1b": (2048, 32, 8, 64, False, True), "qwen2.5-1.5b": (1536, 12, 2, 128, True, True),
               "llama-3.1-8b": (4096, 32, 8, 128, False, True), "opt-1.3b": (2048, 32, 32, 64, True, False)}


def operands(m: int, k: int, h: int, hkv: int, d: int, bias: bool, rotary: bool, dtype) -> list:
    """linear_rope_append's arguments for one prompt of m tokens into a cache of m slots."""
    n = (h + 2 * hkv) * d
    x = torch.randn(1, m, k, device="cuda", dtype=dtype)
    w = (torch.randn(n, k, device="cuda") * k ** -0.5).to(dtype)
    b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
    ang = torch.rand(1, m, d // 2, device="cuda") * 6
    cos, sin = (torch.cat([f(ang)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin)) if rotary else (None, None)
    kc, vc = (torch.zeros(1, hkv, m, d, device="cuda", dtype=dtype) for _ in range(2))
    return [x, w, None, b, cos, sin, h, hkv, kc, vc, torch.arange(m, device="cuda")]


def main(argv=None) -> None:
    args, dtype, rows_m = fused_bench_args(__doc__, "qkv_gemm", argv)
    ceilings = measure_ceilings()
    rows = []
    for model, (k, h, hkv, d, bias, rotary) in PROJECTIONS.items():
        for m in rows_m:
            a = operands(m, k, h, hkv, d, bias, rotary, dtype)
            x2, w = a[0].view(m, k), a[1]
            fns = {"fused": lambda: ops.linear_rope_append(*a), "pair": lambda: ops.linear_rope_append(*a),
                   "gemm": lambda: torch.mm(x2, w.t())}
            before = extension().path_counts()["linear.qkv_rope_gemm"]
            with override(QKV_GEMM="1"):
                fused = (fns["fused"](), a[8].clone(), a[9].clone())
            took = extension().path_counts()["linear.qkv_rope_gemm"] - before == 1
            with override(QKV_GEMM="0"):
                pair = (fns["pair"](), a[8].clone(), a[9].clone())
            diff = max((f.float() - p.float()).abs().max().item() for f, p in zip(fused, pair))
            rows.append({"model": model, "M": m, "N": w.shape[0], "K": k, "fused_kernel": took,
                         "max_abs_diff_vs_pair": diff,
                         **fused_pair_gemm_row(fns, "QKV_GEMM", KNOB, 2 * m * w.shape[0] * k)})
            show_fused_row(model, m, rows[-1])
    write_fused_results(args, rows_m, ceilings, rows, ["model", "M", "N", "K"])


if __name__ == "__main__":
    main()
