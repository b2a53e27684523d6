"""ms/token of beam search (num_beams=4) on patched ``model.generate``: the one-graph path (runtime/beam.py) against
transformers' beam search, the middle path it replaces, and the greedy decode of as many rows as the floor.

Random-weight OPT (default opt-1.3b) fp16, prompt --context tokens, --new new tokens, every beam call with
min_new_tokens = max_new_tokens (so that each decodes the same number of steps). Per batch size (--batches, default
1), timed in turn in one process (each round runs every implementation once):
  hf_beam          unpatched model.generate(num_beams=4): static cache if transformers accepts it, else its default
  patched_beam     patched model.generate(num_beams=4): the one-graph beam search (checked: it ran)
  patched_middle   the same call on the middle path (transformers' loop over the fused forward; beam.ENABLED=False)
  patched_beam_gather  the one-graph beam search with the cache reorder of before fuseinfer::kv_reorder (a gather and
                   a scatter of every generated slot of every row, beam.REORDER_KERNEL=False; its own patched copy)
  greedy_rows      fuseinfer.generate of batch * 4 rows, greedy: a decode step of the beams' rows (the floor)
ms/token = (T(new tokens) - T(1 token)) / (new - 1), CUDA events, so that prefill cancels; median over rounds with min
and max. Also: whether patched_beam's tokens equal patched_middle's and patched_beam_gather's (the same forward; they
must) and hf_beam's (fp16 rounding of another forward may reorder near-equal beams). Target: patched_beam <= 2.0
ms/token at batch 1 on H100.
Results: --out DIR (default $FUSEINFER_BENCH_DIR or bench/results)/beam.{json,md}.

    python bench/bench_beam.py --out DIR
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
from common import event_ms, measure_ceilings, write_results  # noqa: E402

import fuseinfer  # noqa: E402
from fuseinfer.harness.models import load_config, load_model, resolve_model  # noqa: E402
from fuseinfer.runtime import beam  # noqa: E402
from fuseinfer.runtime.cache import COUNTS  # noqa: E402

TARGET_MS = 2.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:opt-1.3b")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--batches", default="1")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="results folder (default: $FUSEINFER_BENCH_DIR or bench/results)")
    args = ap.parse_args()
    if args.out:
        common.RESULTS_DIR = Path(args.out)
    source = resolve_model(args.model)
    base = load_model(source, load_config(source), torch.float16, torch.device("cuda"), seed=0)
    patched = copy.deepcopy(base)
    fuseinfer.patch(patched)
    gather = copy.deepcopy(base)  # (its programs are made with beam.REORDER_KERNEL off)
    fuseinfer.patch(gather)
    vocab = base.config.vocab_size
    nb = args.beams
    try:  # HF's fastest beam search: static cache where it accepts beams
        ids = torch.randint(3, vocab, (1, 8), device="cuda")
        base.generate(ids, max_new_tokens=2, min_new_tokens=2, num_beams=nb, cache_implementation="static")
        beam_cache = "static"
    except Exception as exc:  # noqa: BLE001 (recorded in the results)
        beam_cache = f"default (static refused: {type(exc).__name__}: {str(exc)[:120]})"
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        g = torch.Generator().manual_seed(b)
        ids = torch.randint(3, vocab, (b, args.context), generator=g).cuda()
        mask = torch.ones_like(ids)
        wide = ids.repeat_interleave(nb, 0)

        def call(model, **kw):
            return lambda n: model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                            do_sample=False, num_beams=nb, **kw)

        def switched_off(flag, model):
            """call(model) with runtime.beam's module switch ``flag`` False during the call."""
            def run(n):
                setattr(beam, flag, False)
                try:
                    return call(model)(n)
                finally:
                    setattr(beam, flag, True)
            return run

        middle, gathered = switched_off("ENABLED", patched), switched_off("REORDER_KERNEL", gather)

        impls = {
            "hf_beam": call(base, **({"cache_implementation": "static"} if beam_cache == "static" else {})),
            "patched_beam": call(patched),
            "patched_beam_gather": gathered,
            "patched_middle": middle,
            "greedy_rows": lambda n: fuseinfer.generate(patched, wide, torch.ones_like(wide), max_new_tokens=n),
        }
        times = {k: [] for k in impls}
        with torch.no_grad():
            outs = {}
            for name, fn in impls.items():  # warm-up: compiles, captures graphs, allocates caches
                outs[name] = fn(args.new)
                fn(1)
            ran = COUNTS["beam"]
            impls["patched_beam"](2)
            assert COUNTS["beam"] == ran + 1, "patched beam search did not take the one-graph path"
            assert COUNTS["beam_reorder_kernel"] > 0, "the beam cache reorder did not take fuseinfer::kv_reorder"
            for _ in range(args.rounds):
                for name, fn in impls.items():
                    t_full, t_one = event_ms(lambda: fn(args.new)), event_ms(lambda: fn(1))
                    times[name].append((t_full - t_one) / (args.new - 1))
        med = {k: statistics.median(v) for k, v in times.items()}
        same_middle = torch.equal(outs["patched_beam"], outs["patched_middle"])
        same_gather = torch.equal(outs["patched_beam"], outs["patched_beam_gather"])
        same_hf = outs["patched_beam"].shape == outs["hf_beam"].shape and \
            float((outs["patched_beam"] == outs["hf_beam"]).float().mean())
        for name, v in times.items():
            row = {"batch": b, "impl": name, "ms_per_token": med[name], "min": min(v), "max": max(v),
                   "rounds": len(v), "x_greedy_rows": med[name] / med["greedy_rows"],
                   "x_hf_beam": med[name] / med["hf_beam"]}
            if name == "patched_beam":
                row.update(tokens_equal_middle=same_middle, tokens_equal_gather=same_gather,
                           tokens_agree_hf=same_hf,
                           meets_target=med[name] <= TARGET_MS)
            rows.append(row)
            print(row, flush=True)
        del impls, outs
        torch.cuda.empty_cache()
    settings = {"model": args.model, "dtype": "fp16", "context": args.context, "new_tokens": args.new,
                "num_beams": nb, "min_new_tokens": args.new, "hf_beam_cache": beam_cache,
                "method": "(T(new) - T(1)) / (new - 1), CUDA events, median over rounds (min, max)",
                "target": f"patched_beam <= {TARGET_MS} ms/token at batch 1 (H100)"}
    cols = ["batch", "impl", "ms_per_token", "min", "max", "rounds", "x_greedy_rows", "x_hf_beam",
            "tokens_equal_middle", "tokens_equal_gather", "tokens_agree_hf", "meets_target"]
    print(write_results("beam", settings, measure_ceilings(), rows, cols).with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
