"""OPT-66b, random weights, int8 weight-only on one GPU: build, decode ms/token and peak memory.

The weights: ``fuseinfer.quant.random_init.random_quantized_opt("opt-66b")`` -- built on the meta device, patched
with an empty-layout Int8WeightOnly, allocated on the GPU (int8 linears, fp16 embeddings / LayerNorms / biases),
then every linear drawn as fp16 normal(0, 0.02) in row blocks from a seeded generator and quantized per channel
by the CUDA kernel straight into its int8 tensor (never a 132 GB fp16 copy; the largest fp16 temporary is one
block of 8192 rows). Decode: ``fuseinfer.generate`` (static cache, CUDA graphs, per-op step with the int8 GEMV),
batch B, prompt P, G new tokens; ms/token = (t(G + 1 new) - t(1 new)) / G, each timed after an untimed call of
the same shape (graph capture), median of three. Floor: int8 weight bytes read per step / copy bandwidth measured
in this run (the copy buffers are freed before the build). The run fails unless the decode took an int8 path:
the one-kernel step with int8 weights (``session.path`` "one kernel ...", where it applies: batch <= 2 by default)
or per op with the int8 GEMV (``fuseinfer_C::int8_path_counts()["gemv"]`` rises during the calls: captured kernels
count once, at capture); the path is recorded. Memory: peak allocated during the build
(the int8 model + one row block's fp16 temporaries) and during decode (+ KV cache, CUDA-graph pools), and the
driver's view (``torch.cuda.mem_get_info``) at the end. Usage: python bench/bench_opt66b_int8.py [--model opt-66b] [--batch 1] [--prompt 128] [--gen 64]
-> bench/results/opt66b_int8.json and .md
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import write_results  # noqa: E402

import fuseinfer  # noqa: E402
from fuseinfer.core.extension import extension  # noqa: E402
from fuseinfer.harness.timing import copy_bandwidth_gbps  # noqa: E402
from fuseinfer.quant.backends import weight_bytes_per_token  # noqa: E402
from fuseinfer.quant.random_init import random_quantized_opt  # noqa: E402


def timed(model, ids, new):
    fuseinfer.generate(model, ids, max_new_tokens=new)  # capture / warm-up
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fuseinfer.generate(model, ids, max_new_tokens=new)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="opt-66b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--gen", type=int, default=64)
    args = parser.parse_args()
    copy = copy_bandwidth_gbps(torch.device("cuda"))
    torch.cuda.empty_cache()  # (the copy's 2 x 512 MiB go back before the 66 GB build)
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with torch.no_grad():
        model = random_quantized_opt(args.model, device="cuda", seed=0)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    build_peak = torch.cuda.max_memory_allocated()
    weights = torch.cuda.memory_allocated()
    wbytes = weight_bytes_per_token(model)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(0))
    print(f"built in {build_s:.1f} s: {weights / 2**30:.2f} GiB allocated, build peak {build_peak / 2**30:.2f} GiB",
          flush=True)
    torch.cuda.reset_peak_memory_stats()
    ext = extension(torch.device("cuda"))
    before = ext.int8_path_counts()
    one = timed(model, ids, 1)
    many = timed(model, ids, args.gen + 1)
    after = ext.int8_path_counts()
    ms_per_token = (many - one) / args.gen
    peak = torch.cuda.max_memory_allocated()
    reserved = torch.cuda.max_memory_reserved()
    free, total = torch.cuda.mem_get_info()
    paths = {k: after[k] - before[k] for k in after}
    session_path = "; ".join(s.path for s in model.__dict__.get("_fuseinfer_sessions", {}).values() if s is not None)
    floor_ms = wbytes / (copy * 1e9) * 1e3
    row = {"model": args.model, "batch": args.batch, "prompt": args.prompt, "gen": args.gen,
           "decode ms/token": ms_per_token, "int8 floor ms": floor_ms, "x floor": ms_per_token / floor_ms,
           "weights GiB": weights / 2**30, "peak GiB": peak / 2**30, "peak reserved GiB": reserved / 2**30,
           "build peak GiB": build_peak / 2**30, "build s": build_s, "prefill+1 ms": one,
           "weight bytes/token": wbytes, "GPU memory GiB": total / 2**30, "free at end GiB": free / 2**30,
           "int8 gemv calls": paths["gemv"], "int8 dequant_gemm calls": paths["dequant_gemm"],
           "decode path": session_path}
    print(row, flush=True)
    settings = {**vars(args), "weights": "random_quantized_opt: meta build, layer-by-layer fp16 normal(0, 0.02) "
                "in row blocks, quantized on the GPU; no full-precision copy", "timing": "fuseinfer.generate, "
                "(t(gen+1) - t(1)) / gen, median of 3 after a warm-up call each"}
    path = write_results("opt66b_int8", settings, {"copy_GBps": copy, "matmul_fp16_TFLOPs": float("nan")}, [row],
                         list(row))
    print(f"wrote {path}")
    if not session_path.startswith("one kernel") and (paths["gemv"] <= 0 or "per op" not in session_path):
        sys.exit(f"decode took neither the int8 one-kernel step nor the int8 GEMV per-op path: {paths}, session path "
                 f"{session_path!r}")


if __name__ == "__main__":
    main()
