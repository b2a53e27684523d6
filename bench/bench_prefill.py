"""Prefill latency and time to first token: the lean loop and the per-bucket prefill graphs against eager,
torch.compile and today's patched forward, with the floors measured in the same run.

Random weights (``--model``, default opt-1.3b; any family with a lean loop, e.g.
``random:meta-llama/Llama-3.2-1B``) in fp16, prompts of random ids (no padding), for each shape B x S:

* ``eager``: the unpatched model, ``model(input_ids, use_cache=False, logits_to_keep=1)``;
* ``compile`` / ``compile_ro``: that call through ``torch.compile(model)`` (default mode) and
  ``torch.compile(model, mode="reduce-overhead")`` (CUDA graphs), compiled in the warm-up (compile time reported);
* ``patched``: today's path, the patched model's same call (``patched_full``: all positions' logits, the call
  timed before the lean loop existed);
* ``prefill_lean``: ``fuseinfer.prefill(model, ids)`` (the lean loop, no cache);
* ``begin_module`` / ``begin_lean`` / ``begin_graph``: fast decode's prefill (``_Session.begin``: the prompt into the
  static cache and the first token chosen) with FUSEINFER_PREFILL=module (today's) / lean / graph; ``begin_auto``
  whichever ``auto`` picks.

Timing: CUDA events around each call with the GPU idle before it (so a host-bound call's launch gaps count), three
warm-up calls each, then ``--reps`` rounds in which every implementation runs once in turn; median and p10-p90. The
``begin_*`` rows are timed in blocks of their own, one per prefill mode (switching modes releases the model's graphs).
Floors (same run): ``floor_weights_ms`` = bytes of the weights read once (all parameters but the position table, at
their dtype) / copy bandwidth measured in the run; ``floor_gemm_ms`` = sum over the forward's GEMMs (per layer q/k/v,
out_proj, fc1, fc2 at M = B*S; the LM head at M = B) of cuBLAS's own time on that shape (``torch.mm``, cold L2,
i.e. their FLOPs at the fp16 rate cuBLAS reaches on those shapes); ``floor_ms`` = the larger (attention and
LayerNorms are left out: the floor is a lower bound).

Time to first token (TTFT), per prompt length in ``--ttft-prompts`` (batch 1): the wall clock of one whole call
that returns one new token, ``torch.cuda.synchronize()`` before and after, so it counts the host's argument checks
and session lookup, the prefill (graph replay), the first-token choice and the result's copy, i.e. what a caller
waits for. Callers: ``model.generate(ids, max_new_tokens=1)`` on the patched model (the generation config's EOS and
pad), ``fuseinfer.generate(patched, ids, max_new_tokens=1)`` (no EOS, pad 0) and the unpatched model's
``model.generate`` for reference. Each caller is warmed up with 3 calls (its session and graphs made); then
``--reps`` rounds call every caller once in turn, so the two patched styles alternate on one model as an app mixing
them would; median and p10-p90. ``ttft_rebuilds`` records the runtime's ``COUNTS`` over the timed rounds (sessions,
caches, decode / prefill graphs made: 0 expected, each style keeps its session). ``ttft_over_prefill`` = patched
model.generate's TTFT / ``begin_auto``'s prefill at that shape (target: <= 1.2).
"""
from __future__ import annotations

import argparse
import copy
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import bench_ms, event_ms, measure_ceilings, percentile_stats, wall_ms, write_results  # noqa: E402

import fuseinfer  # noqa: E402
from fuseinfer.harness.models import load_config, load_model, model_stats, resolve_model  # noqa: E402
from fuseinfer.models import family_of  # noqa: E402
from fuseinfer.runtime import prefill as pf  # noqa: E402
from fuseinfer.runtime.decode import COUNTS, Sampling, decode_forward, session_for  # noqa: E402

TARGETS_MS = {(1, 128): 1.3, (1, 512): 2.8}  # targets on an H100


def gemm_floor_ms(model, b: int, s: int) -> tuple[float, float]:
    """(sum of cuBLAS's times on the forward's GEMM shapes, their FLOPs) for B x S tokens (fp16, cold L2): every
    linear of a decoder layer (as the unpatched model has them) at M = B*S, times the layers, and the LM head at
    M = B."""
    _, layers = family_of(model).decoder_layers(model)
    head = model.get_output_embeddings().weight
    m = b * s
    shapes = [(m, lin.out_features, lin.in_features, len(layers)) for lin in layers[0].modules()
              if isinstance(lin, torch.nn.Linear)] + [(b, head.shape[0], head.shape[1], 1)]
    total_ms, flops = 0.0, 0.0
    for rows, n, k, count in shapes:
        x = torch.randn(rows, k, device="cuda", dtype=torch.float16)
        w = torch.randn(n, k, device="cuda", dtype=torch.float16)
        t = bench_ms(lambda: torch.mm(x, w.t()), warmup_ms=10, rep_ms=40)["median_ms"]
        total_ms += count * t
        flops += count * 2 * rows * n * k
    return total_ms, flops


def set_prefill(model, choice: str):
    """The patched model's prefill path (its RuntimeConfig; the environment is only read when it is patched)."""
    fuseinfer.runtime.set_runtime(model, prefill=choice)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="random:opt-1.3b")
    ap.add_argument("--shapes", default="1x128,1x512,8x128,8x512,1x2048")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--ttft-prompts", default="128,512", help="comma list, or none")
    ap.add_argument("--no-compile", action="store_true", help="leave out the torch.compile rows (saves minutes)")
    ap.add_argument("--out", default=None, help="folder for the results (default: bench/results, or "
                                                "FUSEINFER_BENCH_DIR)")
    args = ap.parse_args()
    if args.out:
        common.RESULTS_DIR = Path(args.out)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    ceilings = measure_ceilings()
    source = resolve_model(args.model)
    base = load_model(source, load_config(source), torch.float16, torch.device("cuda"), seed=0)
    base.generation_config.eos_token_id = None  # random weights: never stop early
    cfg = base.config
    stats = model_stats(base)
    weight_bytes = stats.weight_bytes_per_token
    patched = copy.deepcopy(base)
    fuseinfer.patch(patched)
    forward, why = decode_forward(patched)
    assert forward is not None, why
    compiled = {}
    compile_s = {}
    for knob in ("recompile_limit", "cache_size_limit"):  # 5 shapes x 2 modes must not hit dynamo's limit (8)
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    if not args.no_compile:
        compiled["compile"] = torch.compile(base)
        compiled["compile_ro"] = torch.compile(base, mode="reduce-overhead")
    no_eos = torch.empty(0, dtype=torch.long)
    rows, graph_info = [], {}
    for b, s in shapes:
        ids = torch.randint(3, cfg.vocab_size, (b, s), device="cuda")
        mask = torch.ones_like(ids)
        session = session_for(patched, forward, b, s + 1, Sampling(), 1, no_eos, pad=cfg.pad_token_id or 0)
        impls = {"eager": lambda: base(input_ids=ids, use_cache=False, logits_to_keep=1)}
        for name, fn in compiled.items():
            def call(fn=fn, ro=name == "compile_ro"):
                if ro:
                    torch.compiler.cudagraph_mark_step_begin()
                return fn(input_ids=ids, use_cache=False, logits_to_keep=1)
            impls[name] = call
        impls["patched"] = lambda: patched(input_ids=ids, use_cache=False, logits_to_keep=1)
        impls["patched_full"] = lambda: patched(input_ids=ids, use_cache=False)
        lean = family_of(patched).prefill_reason(patched) is None  # (a family without a lean loop: the modules)
        if lean:
            impls["prefill_lean"] = lambda: fuseinfer.prefill(patched, ids)
        # fast decode's prefill under each mode, timed in a block of its own: switching the mode releases the model's
        # sessions and graphs (set_runtime), so switching within a round would recapture the forward's graph in the
        # next round's first patched call
        blocks = [("auto", impls)] + [(choice, {f"begin_{choice}": lambda: session.begin(ids, mask)})
                                      for choice in (("module", "lean", "graph", "auto") if lean else ("module",))]
        times = {}
        with torch.no_grad():
            for mode, block in blocks:
                set_prefill(patched, mode)
                for name, fn in block.items():  # warm-up (compiles, graph captures)
                    t0 = time.perf_counter()
                    fn()
                    torch.cuda.synchronize()
                    if name in compiled:
                        compile_s[f"{name} {b}x{s}"] = time.perf_counter() - t0
                    for _ in range(2):
                        fn()
                    times[name] = []
                for _ in range(args.reps):
                    for name, fn in block.items():
                        times[name].append(event_ms(fn))
        set_prefill(patched, "auto")
        floor_gemm, flops = gemm_floor_ms(base, b, s)
        floor_weights = weight_bytes / (ceilings["copy_GBps"] * 1e9) * 1e3
        row = {"shape": f"{b}x{s}", "floor_weights_ms": floor_weights, "floor_gemm_ms": floor_gemm,
               "floor_ms": max(floor_weights, floor_gemm), "gemm_TFLOPs_cublas": flops / (floor_gemm * 1e-3) / 1e12}
        for name, t in times.items():
            st = percentile_stats(t)
            row[name] = st
            row[f"{name}_ms"] = st["median_ms"]
            row[f"{name}_spread"] = f"{st['p10_ms']:.3g}-{st['p90_ms']:.3g}"
        paths = [k for k in ("begin_lean", "begin_graph") if f"{k}_ms" in row]
        row["faster_new_path"] = min(paths, key=lambda k: row[f"{k}_ms"]) if paths else ""
        auto = row.get("begin_auto_ms", row["begin_module_ms"])
        row["auto_over_floor"] = auto / row["floor_ms"]
        row["patched_over_gemm"] = row["patched_ms"] / floor_gemm
        target = TARGETS_MS.get((b, s)) if args.model == "random:opt-1.3b" else None
        row["target_ms"] = target if target is not None else ""
        if s == 2048 and b == 1 and args.model == "random:opt-1.3b":
            row["target_ms"] = f"<= patched ({row['patched_ms']:.3g})"
        graph_info[f"{b}x{s}"] = pf.graph_stats(session)
        print(f"{b}x{s}: " + ", ".join(f"{k} {row[k + '_ms']:.3f}" for k in impls) +
              f"; floor {row['floor_ms']:.3f} ms", flush=True)
        rows.append(row)
    # time to first token
    ttft, ttft_rebuilds = {}, {}
    for p in [int(x) for x in args.ttft_prompts.split(",") if x != "none"]:
        ids = torch.randint(3, cfg.vocab_size, (1, p), device="cuda")
        gens = {"model.generate (patched)": lambda: patched.generate(ids, max_new_tokens=1, do_sample=False),
                "fuseinfer.generate": lambda: fuseinfer.generate(patched, ids, max_new_tokens=1),
                "model.generate (unpatched)": lambda: base.generate(ids, max_new_tokens=1, do_sample=False)}
        with torch.no_grad():
            for fn in gens.values():  # warm-up: each style's session, prefill graph and first call
                for _ in range(3):
                    fn()
            before = dict(COUNTS)
            per = {name: [] for name in gens}
            for _ in range(args.reps):  # the styles alternate (each keeps its own session per batch bucket)
                for name, fn in gens.items():
                    per[name].append(wall_ms(fn))
            ttft_rebuilds[p] = {k: v - before.get(k, 0) for k, v in COUNTS.items() if v != before.get(k, 0)}
        ttft[p] = {name: percentile_stats(t) for name, t in per.items()}
        prefill_row = next((r for r in rows if r["shape"] == f"1x{p}"), None)
        for r in rows:
            if r["shape"] == f"1x{p}":
                r["ttft_ms"] = ttft[p]["model.generate (patched)"]["median_ms"]
                r["ttft_over_prefill"] = r["ttft_ms"] / r.get("begin_auto_ms", r["begin_module_ms"])
        print(f"TTFT prompt {p} (sessions/graphs made while timed: {ttft_rebuilds[p] or 'none'}): "
              + ", ".join(f"{k} {v['median_ms']:.3f} ms" for k, v in ttft[p].items())
              + ("" if prefill_row is None else f" (prefill {prefill_row.get('begin_auto_ms', prefill_row['begin_module_ms']):.3f} ms)"),
              flush=True)
    names = [k[:-3] for k in rows[0] if k.endswith("_ms") and not k.startswith("floor") and k != "ttft_ms"
             and k != "target_ms" and isinstance(rows[0][k], float)]
    cols = ["shape", "floor_ms", "floor_weights_ms", "floor_gemm_ms", *[f"{n}_ms" for n in names],
            "faster_new_path", "auto_over_floor", "patched_over_gemm", "target_ms", "ttft_ms", "ttft_over_prefill"]
    settings = {**vars(args), "dtype": "fp16", "weight_bytes": weight_bytes, "compile_s": compile_s,
                "prefill_graphs": graph_info, "ttft": {str(k): v for k, v in ttft.items()},
                "ttft_rebuilds": {str(k): v for k, v in ttft_rebuilds.items()},
                "ttft_timing": "wall clock of one max_new_tokens=1 call, GPU synchronised before and after (host "
                               "checks + prefill + first token + result copy); 3 warm-up calls per caller, then "
                               "rounds alternating the callers",
                "length_bucket": pf.LENGTH_BUCKET, "auto_graph_max_tokens": pf.AUTO_GRAPH_MAX_TOKENS,
                "timing": "CUDA events around each call, GPU idle before it; 3 warm-up calls each, then reps rounds "
                          "with every implementation once per round; median (p10-p90 in the JSON and *_spread)"}
    name = "prefill" if args.model == "random:opt-1.3b" else \
        f"prefill_{args.model.removeprefix('random:').replace('/', '_')}"  # (a hub id's slash: not a folder)
    out = write_results(name, settings, ceilings, rows, cols)
    print(out.with_suffix(".md").read_text())
    del compiled
    gc.collect()


if __name__ == "__main__":
    main()
