"""Fused residual add + LayerNorm (fuseinfer_C::add_layer_norm) and + RMSNorm (fuseinfer_C::add_rms_norm) against
eager PyTorch and torch.compile.

Five forms, fp16, hidden sizes 2048 / 4096 / 8192, activation sizes from ~1 MB (working set inside the 50 MB L2) to
256 MB (HBM):
  ln           y = LayerNorm(x)                      (pre-LN blocks: the residual add sits in the GEMM epilogue)
  add_ln       y = LayerNorm(x + r)                  (post-LN blocks)
  add_ln_sum   s = x + r; y = LayerNorm(s); returns (y, s)  (pre-LN with the residual add fused here)
  rms          y = RMSNorm(x)                        (a Llama model's first norm)
  add_rms_sum  s = x + r; y = RMSNorm(s); returns (y, s)  (every later norm of the Llama family's layers)
RMSNorm's eager form is transformers' LlamaRMSNorm (fp32 statistics, two roundings to fp16).
Bytes moved = element size * rows * N * (tensors read + tensors written) + weight (and bias); GB/s is that over
our median time and "% copy" compares it with the device-to-device copy bandwidth measured in the same run.
Ours, eager and torch.compile take turns over five rounds (common.paired_ms: times are medians over rounds, "x"
columns the median of the per-round ratios). Note: triton's do_bench, which times each turn, zeroes a 256 MB
buffer before every timed call, so even the rows whose working set fits in L2 start from a cold cache; "L2" /
"HBM" in the table labels the working set. Rows whose working set fits in half the L2 are also timed L2-resident
("warm" columns): 20 calls on the same tensors back to back in one CUDA graph, as a model runs the op on
activations the previous op just wrote; ours and torch.compile's graphs take turns over five rounds
(common.graph_calls_ms), and "warm x compile" is the ratio of the two medians over all replays. "size MiB" is one
activation tensor (GB/s counts 1e9 bytes).

Every row first checks ours against eager (s bit-exact, y within 2x eager's error against an fp32 reference).
torch.compile gets one compile per (form, N) with the row count marked dynamic (Triton still autotunes per
size). Usage: python bench/bench_layernorm.py [--quick] [--norm layer|rms]  -> bench/results/layernorm.json and .md
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
from fuseinfer.ops.rms_norm import add_rms_norm_ref  # noqa: E402

C = extension()  # the CUDA extension's ops (torch.ops.fuseinfer_C); None when it is not built

EPS = 1e-5
DTYPE = torch.float16
FORMS = {  # name: (norm, has residual, store_sum)
    "ln": ("layer", False, False),
    "add_ln": ("layer", True, False),
    "add_ln_sum": ("layer", True, True),
    "rms": ("rms", False, False),
    "add_rms_sum": ("rms", True, True),
}
COLUMNS = ["form", "N", "rows", "size MiB", "where", "ours ms", "eager ms", "compile ms", "ours GB/s",
           "% copy", "x eager", "x compile", "warm ms", "warm compile ms", "warm x compile"]
WARM_CALLS = 20


def rms_norm(s, w):
    """transformers' LlamaRMSNorm.forward: fp32 statistics, normalised value rounded to s's dtype, times weight."""
    s32 = s.float()
    return w * (s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + EPS)).to(s.dtype)


def eager_fn(norm: str, has_residual: bool, store_sum: bool):
    """The unfused PyTorch expression of one form."""
    def fn(x, r, w, b):
        s = x + r if has_residual else x
        y = F.layer_norm(s, (s.shape[-1],), w, b, EPS) if norm == "layer" else rms_norm(s, w)
        return (y, s) if store_sum else y
    return fn


def ours_fn(norm: str, has_residual: bool, store_sum: bool):
    """The fused kernel of one form, called on the extension directly -> (y, s)."""
    if norm == "layer":
        return lambda x, r, w, b: C.add_layer_norm(x, r if has_residual else None, w, b, EPS, store_sum)
    return lambda x, r, w, b: C.add_rms_norm(x, r if has_residual else None, w, EPS, store_sum)


def bytes_moved(rows: int, n: int, norm: str, has_residual: bool, store_sum: bool) -> int:
    """Bytes read + written: x (+ r) read, y (+ s) written, weight (and LayerNorm's bias) read once."""
    tensors = 1 + has_residual + 1 + store_sum
    return DTYPE.itemsize * (rows * n * tensors + (2 if norm == "layer" else 1) * n)


def check(x, r, w, b, norm, has_residual, store_sum, eager):
    """ours vs eager: s bit-exact, y no further from the fp32 reference than 2x eager (+ slack)."""
    y, s = ours_fn(norm, has_residual, store_sum)(x, r, w, b)
    s_ref = x + r if has_residual else x
    if store_sum:
        assert torch.equal(s, s_ref), "sum differs from eager x + r"
    else:
        assert s.numel() == 0
    if norm == "layer":
        ref32 = F.layer_norm(s_ref.float(), (x.shape[-1],), w.float(), b.float(), EPS)
    else:
        ref32 = add_rms_norm_ref(s_ref.float(), None, w.float(), EPS, False)[0]
    y_eager = eager(x, r, w, b)
    y_eager = y_eager[0] if store_sum else y_eager
    ours_err = (y.float() - ref32).abs().max().item()
    eager_err = (y_eager.float() - ref32).abs().max().item()
    assert ours_err <= 2 * eager_err + 1e-6, f"ours err {ours_err:.3g} vs eager {eager_err:.3g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes (1, 16, 256 MB) and only N = 4096")
    parser.add_argument("--norm", choices=["layer", "rms"], help="only the LayerNorm or only the RMSNorm forms")
    args = parser.parse_args()
    if C is None or not hasattr(C, "add_layer_norm") or not hasattr(C, "add_rms_norm"):
        raise SystemExit("the CUDA extension with add_layer_norm and add_rms_norm is not built "
                         "(pip install --no-build-isolation -e .)")
    torch.manual_seed(0)
    hidden = [4096] if args.quick else [2048, 4096, 8192]
    sizes_mb = [1, 16, 256] if args.quick else [1, 4, 16, 64, 256]  # one activation tensor, in MiB
    l2_bytes = torch.cuda.get_device_properties().L2_cache_size
    ceilings = measure_ceilings()
    rows_out = []
    with torch.no_grad():
        for form, (norm, has_residual, store_sum) in FORMS.items():
            if args.norm not in (None, norm):
                continue
            eager = eager_fn(norm, has_residual, store_sum)
            ours_call = ours_fn(norm, has_residual, store_sum)
            for n in hidden:
                torch._dynamo.reset()
                compiled = torch.compile(eager)
                w = torch.randn(n, device="cuda", dtype=DTYPE)
                b = torch.randn(n, device="cuda", dtype=DTYPE)
                for size_mb in sizes_mb:
                    rows = max(1, size_mb * 2**20 // (n * DTYPE.itemsize))
                    x = torch.randn(rows, n, device="cuda", dtype=DTYPE)
                    r = torch.randn(rows, n, device="cuda", dtype=DTYPE)
                    torch._dynamo.mark_dynamic(x, 0)
                    torch._dynamo.mark_dynamic(r, 0)
                    check(x, r, w, b, norm, has_residual, store_sum, eager)
                    compiled(x, r, w, b)  # compile / autotune outside the timing
                    t = paired_ms({"ours": lambda: ours_call(x, r, w, b),
                                   "eager": lambda: eager(x, r, w, b), "compile": lambda: compiled(x, r, w, b)})
                    ours, ref, comp = t["ours"], t["eager"], t["compile"]
                    moved = bytes_moved(rows, n, norm, has_residual, store_sum)
                    gbs = moved / (ours["median_ms"] * 1e-3) / 1e9
                    rows_out.append({
                        "form": form, "N": n, "rows": rows, "size MiB": size_mb,
                        "where": "L2" if moved <= l2_bytes else "HBM",
                        "ours ms": ours["median_ms"], "eager ms": ref["median_ms"], "compile ms": comp["median_ms"],
                        "ours GB/s": gbs, "% copy": 100 * gbs / ceilings["copy_GBps"],
                        "x eager": paired_ratio(ref, ours), "x compile": paired_ratio(comp, ours),
                        "ours": ours, "eager": ref, "compile": comp, "bytes": moved,
                    })
                    if 2 * moved <= l2_bytes:
                        t = graph_calls_ms({
                            "ours": [lambda: ours_call(x, r, w, b)] * WARM_CALLS,
                            "compile": [lambda: compiled(x, r, w, b)] * WARM_CALLS})
                        warm, warm_comp = t["ours"], t["compile"]
                        rows_out[-1].update({"warm ms": warm["median_ms"], "warm compile ms": warm_comp["median_ms"],
                                             "warm x compile": warm_comp["median_ms"] / warm["median_ms"],
                                             "warm": warm, "warm_compile": warm_comp})
                    print(" | ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                     for k, v in rows_out[-1].items() if k in COLUMNS), flush=True)
    settings = {"dtype": str(DTYPE), "eps": EPS, "hidden": hidden, "sizes_MiB": sizes_mb, "quick": args.quick,
                "norm": args.norm or "all",
                "L2_bytes": l2_bytes, "warm_calls": WARM_CALLS,
                "note": "L2 flushed before every timed call (triton do_bench), ours / eager / compile in turn over "
                        "5 rounds; warm columns: WARM_CALLS calls on the "
                        "same tensors in one CUDA graph, ours and compile in turn over 5 rounds, per-call median, for "
                        "working sets <= L2 / 2"}
    path = write_results("layernorm", settings, ceilings, rows_out, COLUMNS)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
