"""W8A8 kernels on the H100: the sm90 int8 GEMM with its epilogue, and LayerNorm + per-token quantize.

Part 1, GEMM (``w8a8_gemm`` results): OPT-1.3b and OPT-6.7b prefill shapes, M = 2048 and 8192 tokens, each layer's
linear with the epilogue it has in the model (q/k/v fused: + bias; out_proj, fc2: + bias + residual; fc1: + bias,
ReLU). Implementations, timed in turn over rounds (common.paired_ms; "x" columns are medians of per-round ratios):
  ours      fuseinfer.ops.w8a8_linear: int8 x int8 -> int32 wgmma (CUTLASS sm90) with the per-token x per-channel
            scales, bias, residual / ReLU in the epilogue, fp16 out (the backend actually used is recorded per row),
            its tile configuration chosen by M (FUSEINFER_W8A8_TILE=auto); ``large`` columns: the same op forced to
            the 256x128 cooperative configuration (FUSEINFER_W8A8_TILE=large, set before each call: ~1 us of host
            time against >= 50 us GEMMs), to choose the default;
  cublas    bare cuBLAS fp16 ``torch.mm(x, w.T)`` (no bias, no epilogue: the baseline of the targets);
  int_mm    ``torch._int_mm`` (int32 out) followed by the rescale + epilogue in separate PyTorch ops, the path
            torchao-style W8A8 takes on H100; ``int_mm bare`` is torch._int_mm alone.
TOPS = 2 M N K / median time / 1e12 (int8 ops for ours and int_mm, fp16 FLOPs for cuBLAS); "% fp16 rate" is ours'
TOPS over the cuBLAS fp16 rate measured in the same run (8192^3, common.measure_ceilings). Targets: ours >= 1.6x
cublas and >= 1.5x int_mm. Each row first checks ours against the exact-integer reference (SQNR >= 60 dB).

Part 2, LayerNorm + quantize (``w8a8_layernorm_quant`` results): fuseinfer.ops.add_layer_norm_quant against the
eager PyTorch expression (add, layer_norm, amax, divide, round, clamp, cast) and its torch.compile, fp16, two forms
(ln_quant: y = LN(x) -> q, scale; add_ln_quant_sum: s = x + r -> q, scale, s). Bytes moved = 2 B x (x, r read,
s written) + 1 B q written + 4 B scale per row + weight and bias; "% copy" is that rate over the device-to-device
copy bandwidth measured in the same run. Target: >= 85% of copy at >= 16M elements, faster than eager and compile
at L2 and HBM sizes. do_bench flushes L2 before every timed call, so rows whose working set fits in half the L2
are also timed warm: 20 calls back to back in one CUDA graph (common.graph_calls_ms), as bench_layernorm.py does.

Usage: python bench/bench_w8a8.py [--quick] [--part gemm|ln|all]  -> bench/results/w8a8_gemm.{json,md},
bench/results/w8a8_layernorm_quant.{json,md}
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import graph_calls_ms, measure_ceilings, paired_ms, paired_ratio, write_results  # noqa: E402

from fuseinfer.core import knobs  # noqa: E402
from fuseinfer.ops.w8a8_linear import w8a8_backend, w8a8_linear, w8a8_linear_ref, w8a8_unavailable_reason  # noqa: E402
from fuseinfer.ops.layer_norm_quant import add_layer_norm_quant  # noqa: E402
from fuseinfer.ops.quant import quantize_int8_ref  # noqa: E402

MODELS = {"opt-1.3b": (2048, 8192), "opt-6.7b": (4096, 16384)}  # hidden E, ffn F
DTYPE = torch.float16
EPS = 1e-5
GEMM_COLUMNS = ["model", "layer", "M", "N", "K", "backend", "ours ms", "cublas ms", "int_mm ms", "int_mm bare ms",
                "ours TOPS", "cublas TFLOPs", "% fp16 rate", "x cublas", "x int_mm", "sqnr dB", "large ms",
                "large x cublas"]
LN_COLUMNS = ["form", "N", "rows", "elements", "where", "ours ms", "eager ms", "compile ms", "ours GB/s", "% copy",
              "x eager", "x compile", "warm ms", "warm compile ms", "warm x compile"]
WARM_CALLS = 20


def layers(e: int, f: int) -> list[tuple[str, int, int, str, bool]]:
    """(name, N, K, activation, residual) of one OPT decoder layer's linears."""
    return [("qkv", 3 * e, e, "none", False), ("out_proj", e, e, "none", True), ("fc1", f, e, "relu", False),
            ("fc2", e, f, "none", True)]


def sqnr_db(ref, approx) -> float:
    return 10 * math.log10(ref.double().pow(2).sum().item() / (ref.double() - approx.double()).pow(2).sum().item())


def int_mm_rescale(xq, xs, wq_t, ws_row, bias, residual, activation):
    """torch._int_mm, then the epilogue as separate ops (fp32 math, fp16 out)."""
    y = torch._int_mm(xq, wq_t).float() * xs * ws_row + bias.float()
    if residual is not None:
        y = y + residual.float()
    if activation == "relu":
        y = torch.relu(y)
    return y.half()


def bench_gemm(quick: bool, ceilings: dict) -> list[dict]:
    rows = []
    ms_list = [2048] if quick else [2048, 8192]
    for model, (e, f) in MODELS.items():
        for m in ms_list:
            for name, n, k, act, has_res in layers(e, f):
                torch.manual_seed(0)
                x = torch.randn(m, k, device="cuda", dtype=DTYPE)
                w = torch.randn(n, k, device="cuda", dtype=DTYPE) * 0.02
                bias = torch.randn(n, device="cuda", dtype=DTYPE) * 0.1
                res = torch.randn(m, n, device="cuda", dtype=DTYPE) if has_res else None
                xq, xs = quantize_int8_ref(x, -1)  # (M, K) int8, (M, 1) fp32
                wq, ws = quantize_int8_ref(w, -1)  # (N, K) int8, (N, 1) fp32
                wq_t, ws_row = wq.t(), ws.reshape(1, n)  # _int_mm takes B (K, N) column-major: w.T is that view
                out = w8a8_linear(xq, xs, wq, ws, bias, res, act, DTYPE)
                ref = w8a8_linear_ref(xq, xs, wq, ws, bias, res, act, torch.float32)
                sq = sqnr_db(ref, out)
                assert sq >= 60.0, f"{model} {name} M={m}: SQNR {sq:.1f} dB against the exact reference"
                def ours(tile):  # the FUSEINFER_W8A8_TILE knob is read by the kernel's host code on every call
                    knobs.set_value("FUSEINFER_W8A8_TILE", tile)
                    return w8a8_linear(xq, xs, wq, ws, bias, res, act, DTYPE)

                large = ours("large")
                sq_large = sqnr_db(ref, large)
                assert sq_large >= 60.0, f"{model} {name} M={m} large tiles: SQNR {sq_large:.1f} dB"
                t = paired_ms({
                    "ours": lambda: ours("auto"),
                    "ours_large": lambda: ours("large"),
                    "cublas": lambda: torch.mm(x, w.t()),
                    "int_mm": lambda: int_mm_rescale(xq, xs, wq_t, ws_row, bias, res, act),
                    "int_mm_bare": lambda: torch._int_mm(xq, wq_t),
                }, rounds=3, rep_ms=40)
                ops = 2 * m * n * k
                ours_tops = ops / (t["ours"]["median_ms"] * 1e-3) / 1e12
                rows.append({
                    "model": model, "layer": name, "M": m, "N": n, "K": k, "backend": w8a8_backend(x.device),
                    "ours ms": t["ours"]["median_ms"], "cublas ms": t["cublas"]["median_ms"],
                    "int_mm ms": t["int_mm"]["median_ms"], "int_mm bare ms": t["int_mm_bare"]["median_ms"],
                    "ours TOPS": ours_tops,
                    "cublas TFLOPs": ops / (t["cublas"]["median_ms"] * 1e-3) / 1e12,
                    "% fp16 rate": 100 * ours_tops / ceilings["matmul_fp16_TFLOPs"],
                    "x cublas": paired_ratio(t["cublas"], t["ours"]), "x int_mm": paired_ratio(t["int_mm"], t["ours"]),
                    "sqnr dB": sq, "times": t,
                    "large ms": t["ours_large"]["median_ms"],
                    "large x cublas": paired_ratio(t["cublas"], t["ours_large"]),
                })
                os.environ["FUSEINFER_W8A8_TILE"] = "auto"
                print(" | ".join(f"{c}={rows[-1][c]:.4g}" if isinstance(rows[-1][c], float) else f"{c}={rows[-1][c]}"
                                 for c in GEMM_COLUMNS), flush=True)
                del x, w, xq, wq, res, out, ref
    return rows


def eager_ln_quant(has_residual: bool, store_sum: bool):
    """The unfused PyTorch expression of add + LayerNorm + per-token int8 quantize."""
    tiny = torch.finfo(torch.float32).tiny

    def fn(x, r, w, b):
        s = x + r if has_residual else x
        y = F.layer_norm(s, (s.shape[-1],), w, b, EPS)
        scale = (y.float().abs().amax(-1, keepdim=True) / 127.0).clamp_min(tiny)
        q = torch.round(y.float() / scale).clamp_(-127, 127).to(torch.int8)
        return (q, scale, s) if store_sum else (q, scale)
    return fn


def bench_ln(quick: bool, ceilings: dict) -> list[dict]:
    rows_out = []
    hidden = [4096] if quick else [2048, 4096, 8192]
    sizes_mb = [1, 8, 32, 64] if quick else [1, 8, 32, 64, 256]  # one fp16 activation tensor; 32 MiB = 16M elements
    l2_bytes = torch.cuda.get_device_properties().L2_cache_size
    forms = {"ln_quant": (False, False), "add_ln_quant_sum": (True, True)}
    with torch.no_grad():
        for form, (has_res, store_sum) in forms.items():
            eager = eager_ln_quant(has_res, store_sum)
            for n in hidden:
                torch._dynamo.reset()
                compiled = torch.compile(eager)
                w = torch.randn(n, device="cuda", dtype=DTYPE) * 0.5 + 1
                b = torch.randn(n, device="cuda", dtype=DTYPE) * 0.1
                for size_mb in sizes_mb:
                    rows = max(1, size_mb * 2**20 // (n * DTYPE.itemsize))
                    x = torch.randn(rows, n, device="cuda", dtype=DTYPE)
                    r = torch.randn(rows, n, device="cuda", dtype=DTYPE)
                    torch._dynamo.mark_dynamic(x, 0)
                    torch._dynamo.mark_dynamic(r, 0)
                    r_arg = r if has_res else None
                    q, scale, s = add_layer_norm_quant(x, r_arg, w, b, EPS, store_sum)
                    eq, escale = eager(x, r, w, b)[:2]
                    assert (q.int() - eq.int()).abs().max() <= 1, "q differs from eager by more than one step"
                    compiled(x, r, w, b)
                    t = paired_ms({"ours": lambda: add_layer_norm_quant(x, r_arg, w, b, EPS, store_sum),
                                   "eager": lambda: eager(x, r, w, b), "compile": lambda: compiled(x, r, w, b)})
                    ours, ref, comp = t["ours"], t["eager"], t["compile"]
                    moved = rows * n * (2 * (1 + has_res + store_sum) + 1) + 4 * rows + 2 * 2 * n
                    gbs = moved / (ours["median_ms"] * 1e-3) / 1e9
                    rows_out.append({
                        "form": form, "N": n, "rows": rows, "elements": rows * n,
                        "where": "L2" if moved <= l2_bytes else "HBM",
                        "ours ms": ours["median_ms"], "eager ms": ref["median_ms"], "compile ms": comp["median_ms"],
                        "ours GB/s": gbs, "% copy": 100 * gbs / ceilings["copy_GBps"],
                        "x eager": paired_ratio(ref, ours), "x compile": paired_ratio(comp, ours),
                        "bytes": moved, "times": t,
                    })
                    if 2 * moved <= l2_bytes:
                        g = graph_calls_ms({
                            "ours": [lambda: add_layer_norm_quant(x, r_arg, w, b, EPS, store_sum)] * WARM_CALLS,
                            "compile": [lambda: compiled(x, r, w, b)] * WARM_CALLS})
                        rows_out[-1].update({"warm ms": g["ours"]["median_ms"],
                                             "warm compile ms": g["compile"]["median_ms"],
                                             "warm x compile": g["compile"]["median_ms"] / g["ours"]["median_ms"]})
                    print(" | ".join(f"{c}={rows_out[-1][c]:.4g}" if isinstance(rows_out[-1].get(c), float)
                                     else f"{c}={rows_out[-1].get(c, '')}" for c in LN_COLUMNS), flush=True)
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="M = 2048 only; LN at N = 4096, 1 / 8 / 32 / 64 MiB")
    parser.add_argument("--part", choices=["gemm", "ln", "all"], default="all")
    args = parser.parse_args()
    dev = torch.device("cuda")
    print(f"W8A8 GEMM backend: {w8a8_backend(dev)} {w8a8_unavailable_reason(dev) or ''}", flush=True)
    ceilings = measure_ceilings()
    print(f"ceilings: {ceilings}", flush=True)
    if args.part in ("gemm", "all"):
        rows = bench_gemm(args.quick, ceilings)
        settings = {"dtype": "int8 x int8 -> int32, fp16 out", "quick": args.quick, "rounds": 3,
                    "backend": w8a8_backend(dev), "unavailable_reason": w8a8_unavailable_reason(dev),
                    "note": "ours / cuBLAS fp16 bare / _int_mm + rescale / _int_mm bare in turn over 3 rounds; "
                            "TOPS = 2MNK / median; % fp16 rate vs the 8192^3 cuBLAS fp16 rate of this run"}
        print(f"wrote {write_results('w8a8_gemm', settings, ceilings, rows, GEMM_COLUMNS)}")
    if args.part in ("ln", "all"):
        rows = bench_ln(args.quick, ceilings)
        settings = {"dtype": str(DTYPE), "eps": EPS, "quick": args.quick, "warm_calls": WARM_CALLS,
                    "note": "L2 flushed before every timed call (do_bench); ours / eager / compile in turn over 5 "
                            "rounds; warm: WARM_CALLS calls in one CUDA graph for working sets <= L2 / 2"}
        print(f"wrote {write_results('w8a8_layernorm_quant', settings, ceilings, rows, LN_COLUMNS)}")


if __name__ == "__main__":
    main()
