"""Latency of a patched model's own forward, ``model(input_ids)``: the fast forward (the lean loop, replayed as a
CUDA graph per (batch, length bucket)) against the unpatched model, the patched modules and a CUDA graph the user
captures, and patched ``model.generate``'s first token.

Random-weight OPT (default opt-1.3b) fp16, batch 1, prompts of ``--prompts`` random tokens (no padding), under
``torch.no_grad()``; each implementation is its own copy of the model (a RuntimeConfig change drops the graphs):

* ``unpatched``: ``model(ids)`` of the unpatched model (transformers' default: ``use_cache=True``);
* ``fast_graph``: the patched model's ``model(ids)`` with the default RuntimeConfig (prefill ``auto``: graphs);
* ``fast_lean``: the same with ``RuntimeConfig(prefill="lean")`` (the lean loop, no graph);
* ``module``: the same with ``RuntimeConfig(prefill="module")`` (the patched modules, the path before the fast
  forward);
* ``user_graph``: ``torch.cuda.graph`` of the module path's ``model(ids, use_cache=False)``, replayed (a floor: no
  host work at all; use_cache=False because transformers' cache allocates on the host side);
* ``generate_1``: patched ``model.generate(ids, max_new_tokens=1)`` (the time to the first token);
  ``generate_1_unpatched``: the unpatched model's;
* ``fast_graph_nocache`` / ``unpatched_nocache``: ``model(ids, use_cache=False)``, the cost of building the
  DynamicCache.

Timing: CUDA events around each call with the GPU idle before it (so a host-bound call's launch gaps count), three
warm-up calls each (the graphs captured there), then ``--rounds`` rounds in which every implementation runs once in
turn; median with min and max over the rounds (and the wall clock's median, host work after the last launch
included). Targets (H100): fast_graph <= 2.2 ms at 1 x 128 and <= 3.4 ms at 1 x 512; generate_1 <= 1.25 x
fast_graph. ``max_abs_diff_vs_lean``: the largest |logit| difference of fast_graph from fast_lean (fp16 rounding of
another GEMM algorithm only). ``host_before_prefill_ms`` (generate_1): the host time from the call to its prefill's
first launch (checks, model probe, session lookup, ``begin``), median of 20 calls. ``forward_graph_captures_timed``:
graphs captured during the timed rounds (0 expected).
Results: ``--out``/forward.{json,md}.

Run: ``python bench/bench_forward.py --out DIR`` on a CUDA GPU with the extension built.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import event_ms, measure_ceilings, wall_ms, write_results  # noqa: E402

import fuseinfer  # noqa: E402
from fuseinfer.harness.models import load_config, load_model, resolve_model  # noqa: E402
from fuseinfer.harness.timing import host_before_prefill_s  # noqa: E402
from fuseinfer.runtime import forward as fw  # noqa: E402
from fuseinfer.runtime.cache import COUNTS  # noqa: E402

TARGETS_MS = {128: 2.2, 512: 3.4}  # fast_graph, batch 1, H100


def patched_copy(base, prefill: str):
    model = copy.deepcopy(base)
    fuseinfer.patch(model, fuseinfer.PatchConfig(runtime=fuseinfer.RuntimeConfig(prefill=prefill)))
    return model


def user_graph(model, ids):
    """A replay closure of ``torch.cuda.graph`` of ``model(ids, use_cache=False)`` (three warm-up calls on a side
    stream first), or the reason it could not be captured."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                model(input_ids=ids, use_cache=False)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model(input_ids=ids, use_cache=False)
        return graph.replay
    except Exception as exc:  # noqa: BLE001 (recorded in the results)
        return f"{type(exc).__name__}: {str(exc)[:160]}"


def host_before_prefill_ms(fn, calls: int = 20) -> float:
    """Median host time of ``fn()`` (a patched generate call) from its start to the entry of the session's prefill
    (the first launch of its graph or lean loop): the argument checks, the model probe, the session lookup, the
    launches of ``begin``. The GPU is idle at each start."""
    return statistics.median(host_before_prefill_s(fn, calls, torch.cuda.synchronize)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:opt-1.3b")
    ap.add_argument("--prompts", default="128,512")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", default=None, help="folder for forward.json / forward.md (default bench/results)")
    args = ap.parse_args()
    if args.out:
        common.RESULTS_DIR = Path(args.out)
    source = resolve_model(args.model)
    base = load_model(source, load_config(source), torch.float16, torch.device("cuda"), seed=0)
    models = {"graph": patched_copy(base, "auto"), "lean": patched_copy(base, "lean"),
              "module": patched_copy(base, "module")}
    vocab = base.config.vocab_size
    rows, notes = [], {}
    for s in [int(x) for x in args.prompts.split(",")]:
        g = torch.Generator().manual_seed(s)
        ids = torch.randint(3, vocab, (1, s), generator=g).cuda()
        gen = dict(max_new_tokens=1, do_sample=False)
        with torch.no_grad():
            replay = user_graph(models["module"], ids)
            impls = {
                "unpatched": lambda: base(ids),
                "fast_graph": lambda: models["graph"](ids),
                "fast_lean": lambda: models["lean"](ids),
                "module": lambda: models["module"](ids),
                "generate_1": lambda: models["graph"].generate(ids, **gen),
                "generate_1_unpatched": lambda: base.generate(ids, **gen),
                "fast_graph_nocache": lambda: models["graph"](ids, use_cache=False),
                "unpatched_nocache": lambda: base(ids, use_cache=False),
            }
            if callable(replay):
                impls["user_graph"] = replay
            else:
                notes[f"user_graph_{s}"] = replay
            for fn in impls.values():  # warm-up: graphs captured, cuBLASLt tuned
                for _ in range(3):
                    fn()
            fast = COUNTS["fast_forward"]
            models["graph"](ids)
            models["lean"](ids)
            served = COUNTS["fast_forward"] - fast  # 2: both patched calls took the fast forward
            diff = (models["graph"](ids).logits.float() - models["lean"](ids).logits.float()).abs().max().item()
            captures = COUNTS["forward_graph"]
            events = {k: [] for k in impls}
            walls = {k: [] for k in impls}
            for _ in range(args.rounds):
                for name, fn in impls.items():
                    events[name].append(event_ms(fn))
                    walls[name].append(wall_ms(fn))
            captures = COUNTS["forward_graph"] - captures
            host_ms = host_before_prefill_ms(impls["generate_1"])
        med = {k: statistics.median(v) for k, v in events.items()}
        for name, v in events.items():
            row = {"prompt": s, "impl": name, "median_ms": med[name], "min_ms": min(v), "max_ms": max(v),
                   "wall_median_ms": statistics.median(walls[name]), "rounds": len(v),
                   "x_unpatched": med[name] / med["unpatched"], "x_fast_graph": med[name] / med["fast_graph"]}
            if name == "generate_1":
                row.update(host_before_prefill_ms=host_ms, target_x_fast_graph=1.25)
            if name == "fast_graph":
                row.update(target_ms=TARGETS_MS.get(s), max_abs_diff_vs_lean=diff, fast_forward_served=served,
                           forward_graph_captures_timed=captures)
            rows.append(row)
            print(row, flush=True)
        del impls, replay
        torch.cuda.empty_cache()
    settings = {"model": args.model, "dtype": "fp16", "batch": 1, "prompts": args.prompts, "rounds": args.rounds,
                "method": "CUDA events, GPU idle before each call; implementations in turn; median (min, max)",
                "targets": "fast_graph <= 2.2 ms (1x128), <= 3.4 ms (1x512); generate_1 <= 1.25 x fast_graph",
                "graphs": {str(k): v for k, v in fw.graph_stats(models["graph"]).items()}, "notes": notes}
    cols = ["prompt", "impl", "median_ms", "min_ms", "max_ms", "wall_median_ms", "x_unpatched", "x_fast_graph",
            "target_ms", "host_before_prefill_ms", "max_abs_diff_vs_lean", "forward_graph_captures_timed"]
    print(write_results("forward", settings, measure_ceilings(), rows, cols).with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
