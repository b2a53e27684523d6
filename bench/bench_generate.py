"""ms/token of patched ``model.generate`` with the settings apps pass, against transformers' generate.

Random-weight OPT (default opt-1.3b) fp16, prompt --context tokens, --new new tokens; every call passes
min_new_tokens = max_new_tokens so that each setting decodes the same number of tokens. At each batch size
(1/8/32), timed in turn in one process (each round runs every implementation once):
  hf_eager      unpatched model.generate (default dynamic cache)
  hf_static     unpatched model.generate(cache_implementation="static")
  fuseinfer     fuseinfer.generate on the patched model
  patched_a     patched model.generate, no extra settings
  patched_b     ... min_new_tokens=new (the bench's common setting; same call as patched_a here, listed separately)
  patched_c     ... repetition_penalty=1.1
  hf_beam4      unpatched beam search, num_beams=4: static cache if transformers accepts it, else its default
  patched_beam4 patched model.generate(num_beams=4) (the one-graph beam search, runtime/beam.py)
ms/token = (T(new tokens) - T(1 token)) / (new - 1): two calls per round timed with CUDA events, so prefill cancels;
median over rounds with min and max. Derived: ratio to fuseinfer.generate (targets: patched_a..c <= 1.15) and
patched_beam4 / hf_beam4 (target < 1). Results: $FUSEINFER_BENCH_DIR/generate.{json,md}.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import event_ms, measure_ceilings, write_results  # noqa: E402

import fuseinfer  # noqa: E402
from fuseinfer.harness.models import load_config, load_model, resolve_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:opt-1.3b")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rounds-large", type=int, default=2, help="rounds at batch >= 32")
    args = ap.parse_args()
    source = resolve_model(args.model)
    base = load_model(source, load_config(source), torch.float16, torch.device("cuda"), seed=0)
    patched = copy.deepcopy(base)
    fuseinfer.patch(patched)
    vocab = base.config.vocab_size
    try:  # HF's fastest beam search: static cache where it accepts beams
        ids = torch.randint(3, vocab, (1, 8), device="cuda")
        base.generate(ids, max_new_tokens=2, min_new_tokens=2, num_beams=4, cache_implementation="static")
        beam_cache = "static"
    except Exception as exc:  # noqa: BLE001 (recorded in the results)
        beam_cache = f"default (static refused: {type(exc).__name__}: {str(exc)[:120]})"
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        g = torch.Generator().manual_seed(b)
        ids = torch.randint(3, vocab, (b, args.context), generator=g).cuda()
        mask = torch.ones_like(ids)

        def hf(model, **kw):
            return lambda n: model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                            do_sample=False, **kw)

        impls = {
            "hf_eager": hf(base),
            "hf_static": hf(base, cache_implementation="static"),
            "fuseinfer": lambda n: fuseinfer.generate(patched, ids, mask, max_new_tokens=n, eos_token_id=2,
                                                      pad_token_id=1),
            "patched_a": lambda n: patched.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                                                    eos_token_id=None),
            "patched_b": hf(patched),
            "patched_c": hf(patched, repetition_penalty=1.1),
            "hf_beam4": hf(base, num_beams=4, **({"cache_implementation": "static"} if beam_cache == "static"
                                                  else {})),
            "patched_beam4": hf(patched, num_beams=4),
        }
        rounds = args.rounds_large if b >= 32 else args.rounds
        times = {k: [] for k in impls}
        with torch.no_grad():
            for fn in impls.values():  # warm-up: compiles, captures graphs, allocates caches
                fn(args.new)
                fn(1)
            for _ in range(rounds):
                for name, fn in impls.items():
                    t_full, t_one = event_ms(lambda: fn(args.new)), event_ms(lambda: fn(1))
                    times[name].append((t_full - t_one) / (args.new - 1))
        med = {k: statistics.median(v) for k, v in times.items()}
        for name, v in times.items():
            row = {"batch": b, "impl": name, "ms_per_token": med[name], "min": min(v), "max": max(v),
                   "rounds": len(v), "x_fuseinfer": med[name] / med["fuseinfer"],
                   "x_hf_static": med[name] / med["hf_static"]}
            if name == "patched_beam4":
                row["x_hf_beam4"] = med[name] / med["hf_beam4"]
            rows.append(row)
            print(row, flush=True)
        del impls
        torch.cuda.empty_cache()
    settings = {"model": args.model, "dtype": "fp16", "context": args.context, "new_tokens": args.new,
                "min_new_tokens": args.new, "hf_beam_cache": beam_cache,
                "method": "(T(new) - T(1)) / (new - 1), CUDA events, median over rounds (min, max)",
                "targets": "patched_a..c x_fuseinfer <= 1.15; patched_beam4 x_hf_beam4 < 1"}
    cols = ["batch", "impl", "ms_per_token", "min", "max", "rounds", "x_fuseinfer", "x_hf_static", "x_hf_beam4"]
    print(write_results("generate", settings, measure_ceilings(), rows, cols).with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
