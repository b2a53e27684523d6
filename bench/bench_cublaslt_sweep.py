"""A sweep of cuBLASLt's configurations of the residual GEMMs against bare torch.mm: can the vendor library make
the residual epilogue free?

csrc/linear.cu runs OPT's prefill linears on cuBLASLt and times the heuristic's first 8 algorithms once per
problem. The target is the fused epilogue at <= 1.03x the bare GEMM; out_proj + residual misses it
(bench_linear). This script asks the whole library, not its heuristic's short list: for each problem (OPT
out_proj by default; --layers adds fc2) and mode
  residual   bias epilogue + residual as C (beta = 1) into a new output, as linear_epilogue runs it
  inplace    the residual passed as both C and D (its output equals eager F.linear(x, w, b) + r bit for bit:
             rounded twice, so cuBLASLt computes it another way than `residual`, which rounds once)
  bare       no epilogue, beta = 0 (the GEMM alone)
it lists every configuration cublasLtMatmulAlgoCheck accepts (algorithm id x tile x stages x custom option x
CTA swizzle x 7 cluster shapes x split-K 1 or 2 with each reduction scheme, the inner shape left at its
default, within --workspace-mib; bench/cublaslt_sweep.cu), screens each with one timed call after a warm-up
call (L2 flushed before each timed call), re-times the best 64 over five calls, and then times the best --top
of those and the heuristic's list (up to 8) in turn with torch.mm(x, w.t()) over five rounds (triton do_bench,
L2 flushed; "x bare" is the median of the per-round ratios, as bench_linear's "ours/bare"; "best" is the
lowest of those ~20 medians, so it leans low). The fastest configuration's output is checked against
the fp32 reference (error at most 2x torch's + 1e-6). fp16, random inputs.

Needs a CUDA GPU and nvcc (FUSEINFER_NVCC, default "nvcc") to build bench/cublaslt_sweep.cu into a shared
library loaded with ctypes, which binds to the cuBLASLt torch has loaded (same soname). About 30-60 s per
problem and mode on an H100.
Usage: python bench/bench_cublaslt_sweep.py [--models opt-1.3b,opt-6.7b] [--layers out_proj,fc2] [--M 2048,8192]
  [--modes residual,inplace,bare] [--name cublaslt_sweep]  -> bench/results/<name>.json and .md
"""
from __future__ import annotations

import argparse
import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import measure_ceilings, paired_ms, paired_ratio, write_results  # noqa: E402

DTYPE = torch.float16
MODELS = {"opt-1.3b": (2048, 8192), "opt-6.7b": (4096, 16384)}  # hidden, ffn
LAYERS = {"out_proj": lambda h, f: (h, h), "fc2": lambda h, f: (h, f)}  # N, K
MODES = ("residual", "inplace", "bare")
SCREEN_KEEP = 64  # configurations re-timed over five calls after the one-call screen
MAX_CONFIGS = 200_000
FIELDS = ("id", "tile", "stages", "splitk", "reduction", "swizzle", "custom", "cluster")
COLUMNS = ["model", "layer", "mode", "M", "N", "K", "configs", "best x bare", "best min", "best max", "best ms",
           "bare mm ms", "heuristic first x bare", "best of heuristic x bare", "best config", "best workspace"]
U64P = ctypes.POINTER(ctypes.c_uint64)


def build_library(out_dir: Path) -> ctypes.CDLL:
    """nvcc bench/cublaslt_sweep.cu into out_dir and load it; one clear error if nvcc is missing or fails."""
    nvcc = os.environ.get("FUSEINFER_NVCC", "nvcc")
    src = Path(__file__).resolve().parent / "cublaslt_sweep.cu"
    lib = out_dir / "libcublaslt_sweep.so"
    cmd = [nvcc, "-O2", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", str(src), "-lcublasLt", "-o", str(lib)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        sys.exit(f"bench_cublaslt_sweep: {nvcc} not found; set FUSEINFER_NVCC to the CUDA compiler")
    if done.returncode != 0:
        sys.exit(f"bench_cublaslt_sweep: building {src.name} failed:\n{done.stderr}")
    cdll = ctypes.CDLL(str(lib))
    cdll.lt_version.restype = ctypes.c_size_t
    cdll.lt_heuristic.argtypes = [ctypes.c_size_t, U64P, U64P, ctypes.c_int]
    cdll.lt_enumerate.argtypes = [ctypes.c_size_t, U64P, U64P, ctypes.c_int]
    cdll.lt_describe.argtypes = [U64P, ctypes.POINTER(ctypes.c_int)]
    cdll.lt_run.argtypes = [U64P] + [ctypes.c_void_p] * 6 + [ctypes.c_size_t, ctypes.c_void_p]
    return cdll


def find_header(nvcc: str) -> Path | None:
    """cublasLt.h next to nvcc's CUDA, else in torch's nvidia wheels on sys.path; None if neither has it."""
    roots = [Path(shutil.which(nvcc) or nvcc).resolve().parent.parent / "include"]
    roots += [Path(p) / "nvidia" / sub / "include" for p in sys.path for sub in ("cu13", "cublas")]
    return next((r / "cublasLt.h" for r in roots if (r / "cublasLt.h").is_file()), None)


def enum_names(header: Path | None) -> dict:
    """{field: {value: name}} for the tile, stages and cluster enums of cublasLt.h; empty without a header (the
    report then shows the numbers)."""
    if header is None:
        return {}
    text = header.read_text()
    prefixes = {"tile": "CUBLASLT_MATMUL_TILE_", "stages": "CUBLASLT_MATMUL_STAGES_",
                "cluster": "CUBLASLT_CLUSTER_SHAPE_"}
    return {field: {int(v): name for name, v in re.findall(prefix + r"(\w+)\s*=\s*(\d+)", text)}
            for field, prefix in prefixes.items()}


class Configs:
    """A block of cuBLASLt configurations (8 words each), as lt_enumerate / lt_heuristic fill it."""

    def __init__(self, capacity: int):
        self.words = (ctypes.c_uint64 * (8 * capacity))()
        self.workspace = (ctypes.c_uint64 * capacity)()
        self.count = 0

    def ptr(self, i: int):
        return ctypes.cast(ctypes.byref(self.words, 64 * i), U64P)

    def describe(self, lib, i: int, names: dict) -> dict:
        """The configuration's fields, with enum names where `names` (enum_names) has them."""
        fields = (ctypes.c_int * 8)()
        lib.lt_describe(self.ptr(i), fields)
        return {f: names.get(f, {}).get(v, v) for f, v in zip(FIELDS, fields)}


def flushed_times(run, calls: int, flush: torch.Tensor) -> list:
    """CUDA-event times (ms) of `calls` calls of run(), L2 flushed before each (as triton's do_bench does)."""
    events = []
    for _ in range(calls):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def sweep(lib, names: dict, model: str, layer: str, mode: str, m: int, n: int, k: int, top: int,
          workspace: torch.Tensor, flush: torch.Tensor) -> dict:
    """One problem and mode: enumerate, screen, pair the finalists with torch.mm, check the winner; one row."""
    x = torch.randn(m, k, device="cuda", dtype=DTYPE)
    w = torch.randn(n, k, device="cuda", dtype=DTYPE) * k**-0.5
    b = torch.randn(n, device="cuda", dtype=DTYPE)
    r = torch.randn(m, n, device="cuda", dtype=DTYPE)
    y = r.clone() if mode == "inplace" else torch.empty(m, n, device="cuda", dtype=DTYPE)
    has_epilogue = mode != "bare"
    status = lib.lt_setup(m, n, k, 0, int(has_epilogue), int(has_epilogue))
    if status != 0:
        sys.exit(f"bench_cublaslt_sweep: cuBLASLt set-up failed (status {status})")
    stream = torch.cuda.current_stream().cuda_stream
    c = (y if mode == "inplace" else r).data_ptr() if has_epilogue else None
    bias = b.data_ptr() if has_epilogue else None

    def runner(configs: Configs, i: int):
        return lambda: lib.lt_run(configs.ptr(i), w.data_ptr(), x.data_ptr(), bias, c, y.data_ptr(),
                                  workspace.data_ptr(), workspace.numel(), stream)

    enum = Configs(MAX_CONFIGS)
    enum.count = min(lib.lt_enumerate(workspace.numel(), enum.words, enum.workspace, MAX_CONFIGS), MAX_CONFIGS)
    heur = Configs(8)
    heur.count = lib.lt_heuristic(workspace.numel(), heur.words, heur.workspace, 8)

    # screen: one warm-up call (which also drops configurations that fail to launch), one timed call each
    screen = {}
    for i in range(enum.count):
        run = runner(enum, i)
        if run() == 0:
            screen[i] = flushed_times(run, 1, flush)[0]
    best = sorted(screen, key=screen.get)[:SCREEN_KEEP]
    retimed = {i: sorted(flushed_times(runner(enum, i), 5, flush))[2] for i in best}
    finalists = [("enum", i) for i in sorted(retimed, key=retimed.get)[:top]] + [("heur", i) for i in range(heur.count)]

    blocks = {"enum": enum, "heur": heur}
    fns = {"bare": lambda: torch.mm(x, w.t())}
    fns.update({f"{src}{i}": runner(blocks[src], i) for src, i in finalists})
    timed = paired_ms(fns, rep_ms=30)
    ratios = {name: paired_ratio(t, timed["bare"]) for name, t in timed.items() if name != "bare"}
    winner = min(ratios, key=ratios.get)
    src, i = winner[:4], int(winner[4:])  # "enum12" -> ("enum", 12)

    # the winner's output against the fp32 reference, within 2x torch's own error
    ref32 = x.float() @ w.float().t() + (b.float() + r.float() if has_epilogue else 0)
    eager = F.linear(x, w, b) + r if has_epilogue else torch.mm(x, w.t())
    if mode == "inplace":
        y.copy_(r)
    assert runner(blocks[src], i)() == 0
    err = (y.float() - ref32).abs().max().item()
    torch_err = (eager.float() - ref32).abs().max().item()
    assert err <= 2 * torch_err + 1e-6, f"{model} {layer} {mode}: best config err {err:.3g} vs torch {torch_err:.3g}"

    w_times = timed[winner]
    round_ratios = [t / s for t, s in zip(w_times["rounds_ms"], timed["bare"]["rounds_ms"])]
    heur_ratios = [ratios[f"heur{j}"] for j in range(heur.count)]
    row = {"model": model, "layer": layer, "mode": mode, "M": m, "N": n, "K": k, "configs": enum.count,
           "configs_ran": len(screen), "best x bare": ratios[winner],
           "best min": min(round_ratios), "best max": max(round_ratios),
           "best ms": w_times["median_ms"], "bare mm ms": timed["bare"]["median_ms"],
           "heuristic first x bare": heur_ratios[0] if heur_ratios else None,
           "best of heuristic x bare": min(heur_ratios) if heur_ratios else None,
           "best config": " ".join(f"{f}={v}" for f, v in blocks[src].describe(lib, i, names).items()),
           "best workspace": int(blocks[src].workspace[i]),
           "best source": "heuristic" if src == "heur" else "enumeration", "best err": err, "torch err": torch_err,
           "finalists": {name: {"x bare": ratios[name], **timed[name]} for name in ratios}, "bare": timed["bare"]}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    parser.add_argument("--layers", default="out_proj", help=f"comma-separated subset of {', '.join(LAYERS)}")
    parser.add_argument("--M", default="2048,8192", help="comma-separated token counts")
    parser.add_argument("--modes", default="residual,inplace", help=f"comma-separated subset of {', '.join(MODES)}")
    parser.add_argument("--top", type=int, default=12, help="enumerated configurations in the paired rounds")
    parser.add_argument("--workspace-mib", type=int, default=32, help="cuBLASLt workspace limit")
    parser.add_argument("--name", default="cublaslt_sweep", help="results file name (bench/results/<name>.json)")
    args = parser.parse_args()
    models, layers, modes = args.models.split(","), args.layers.split(","), args.modes.split(",")
    for given, known, what in ((models, MODELS, "model"), (layers, LAYERS, "layer"), (modes, MODES, "mode")):
        unknown = sorted(set(given) - set(known))
        if unknown:
            parser.error(f"unknown {what}(s) {', '.join(unknown)}: choose from {', '.join(known)}")
    if not torch.cuda.is_available():
        sys.exit("bench_cublaslt_sweep: needs a CUDA GPU (torch.cuda.is_available() is False)")
    m_values = [int(v) for v in args.M.split(",")]
    torch.manual_seed(0)
    ceilings = measure_ceilings()
    workspace = torch.empty(args.workspace_mib << 20, device="cuda", dtype=torch.uint8)
    flush = torch.empty(256 << 20, device="cuda", dtype=torch.uint8)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        lib = build_library(Path(tmp))
        names = enum_names(find_header(os.environ.get("FUSEINFER_NVCC", "nvcc")))
        for model in models:
            for layer in layers:
                n, k = LAYERS[layer](*MODELS[model])
                for m in m_values:
                    for mode in modes:
                        row = sweep(lib, names, model, layer, mode, m, n, k, args.top, workspace, flush)
                        rows.append(row)
                        print(" | ".join(f"{c}={row[c]:.4g}" if isinstance(row[c], float) else f"{c}={row[c]}"
                                         for c in COLUMNS), flush=True)
        version = lib.lt_version()
    settings = {"dtype": str(DTYPE), "models": models, "layers": layers, "M": m_values, "modes": modes,
                "top": args.top, "workspace_MiB": args.workspace_mib, "cublasLt_version": version,
                "note": "every configuration cublasLtMatmulAlgoCheck accepts (id x tile x stages x custom x swizzle "
                        "x cluster {auto,1x1,2x1,1x2,2x2,4x1,1x4} x split-K {1,2}); screened with one L2-flushed "
                        f"call each, best {SCREEN_KEEP} re-timed over 5, best `top` and the heuristic's first 8 "
                        "paired with torch.mm over 5 rounds of triton do_bench (L2 flushed); x bare = median of "
                        "the per-round ratios, best min / max = the lowest and highest of them"}
    path = write_results(args.name, settings, ceilings, rows, COLUMNS)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
