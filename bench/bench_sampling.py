"""ms/token of sampling against greedy decoding on the fast path, and the token choice alone.

    python bench/bench_sampling.py --out DIR [--model random:opt-1.3b] [--context 512] [--new 128] [--batches 1,8]

Generate (random-weight OPT, default opt-1.3b, fp16, prompt --context tokens, --new new tokens, no EOS so that every
call decodes the same count), at each batch size, implementations timed in turn over rounds:
  greedy          fuseinfer.generate(do_sample=False)
  topp_fused      do_sample, top_p 0.9, temperature 0.7: fuseinfer::sample_tokens inside the decode graph
  topp_torch      the same setting by the PyTorch warpers and the exponential race (decode.FUSED_SAMPLING = False)
  topk_fused      do_sample, top_k 50
  topk_torch      the same by the PyTorch warpers
ms/token = (T(new) - T(1)) / (new - 1), CUDA events, as bench_generate.py; median over rounds with min and max;
x_greedy = median / greedy's (target: topp_fused and topk_fused <= 1.05).
Kernels (the token choice alone, logits (B, V) fp32 of std 3, calls back to back in a CUDA graph, per call; us =
microseconds): the greedy tail (emit_tokens' argmax kernel), sample_tokens (the host's kernel: "cluster" is its
cluster size, 0 the one-block kernel), where that is the cluster kernel the one-block kernel too, sample_tokens +
emit_tokens(chosen) (the sampling tail), the PyTorch warpers + race, for V in {50272, 151936}. Results:
DIR/sampling.{json,md}.
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
from common import event_ms, graph_calls_ms, measure_ceilings, write_results  # noqa: E402

import fuseinfer  # noqa: E402
from fuseinfer import ops  # noqa: E402
from fuseinfer.core.extension import extension  # noqa: E402
from fuseinfer.harness.models import load_config, load_model, resolve_model  # noqa: E402
from fuseinfer.runtime import decode  # noqa: E402
from fuseinfer.runtime.args import Sampling  # noqa: E402

SETTINGS = {"topp": dict(top_p=0.9, temperature=0.7), "topk": dict(top_k=50)}


def generate_rows(args) -> list[dict]:
    source = resolve_model(args.model)
    base = load_model(source, load_config(source), torch.float16, torch.device("cuda"), seed=0)
    fused, torch_path = copy.deepcopy(base), base  # (two models: each keeps the sessions of its path)
    fuseinfer.patch(fused)
    fuseinfer.patch(torch_path)
    vocab = base.config.vocab_size
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        ids = torch.randint(3, vocab, (b, args.context), generator=torch.Generator().manual_seed(b)).cuda()
        mask = torch.ones_like(ids)

        def run(model, **kw):
            return lambda n: fuseinfer.generate(model, ids, mask, max_new_tokens=n, eos_token_id=None,
                                                pad_token_id=1, **kw)

        impls = {"greedy": (True, run(fused))}
        for name, kw in SETTINGS.items():
            impls[f"{name}_fused"] = (True, run(fused, do_sample=True, **kw))
            impls[f"{name}_torch"] = (False, run(torch_path, do_sample=True, **kw))
        times = {k: [] for k in impls}
        with torch.no_grad():
            for flag, fn in impls.values():  # warm-up: the sessions (built under their path's flag) and graphs
                decode.FUSED_SAMPLING = flag
                fn(args.new)
                fn(1)
            decode.FUSED_SAMPLING = True
            for _ in range(args.rounds):
                for name, (_, fn) in impls.items():
                    t_full, t_one = event_ms(lambda: fn(args.new)), event_ms(lambda: fn(1))
                    times[name].append((t_full - t_one) / (args.new - 1))
        for model, flag in ((fused, True), (torch_path, False)):  # each path ran as named
            lru = decode.sessions_of(model)[0].lru[decode._bucket(b)]
            assert all(s.fused_sampling == flag for s in lru.values() if s.sampling.do_sample)
        greedy = statistics.median(times["greedy"])
        for name, v in times.items():
            med = statistics.median(v)
            row = {"part": "generate", "batch": b, "impl": name, "vocab": vocab, "ms": med, "min": min(v),
                   "max": max(v), "rounds": len(v), "x_greedy": med / greedy}
            rows.append(row)
            print(row, flush=True)
        torch.cuda.empty_cache()
    return rows


def kernel_rows(args) -> list[dict]:
    rows = []
    for v in (50272, 151936):
        for b in [int(x) for x in args.batches.split(",")]:
            logits = torch.randn(b, v, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 3
            seed, off = torch.tensor([1], device="cuda"), torch.zeros(1, dtype=torch.long, device="cuda")
            eos = torch.empty(0, dtype=torch.long, device="cuda")
            state = [torch.zeros(b, 1, dtype=torch.long, device="cuda"),
                     torch.zeros(b, 1, dtype=torch.long, device="cuda"),
                     torch.zeros(b, dtype=torch.int32, device="cuda"), torch.zeros(1, dtype=torch.long, device="cuda"),
                     torch.zeros(1, dtype=torch.long, device="cuda"), torch.ones(b, dtype=torch.bool, device="cuda"),
                     torch.zeros(b, 4, dtype=torch.long, device="cuda"),
                     torch.ones(4, dtype=torch.bool, device="cuda"), ops.emit_tokens_scratch(b, "cuda")]

            def greedy_tail():
                ops.emit_tokens(logits, eos, 0, *state)

            groups = {"greedy_tail (emit argmax)": [greedy_tail] * 20}
            ext = extension(logits.device)
            cluster = int(ext.sample_tokens_cluster_size(logits)) if hasattr(ext, "sample_tokens_with") else 0
            for name, kw in SETTINGS.items():
                sampling = Sampling(True, kw.get("temperature", 1.0), kw.get("top_k"), kw.get("top_p"))

                def fused(sampling=sampling):
                    return sampling.sample(logits, seed, off)

                def fused_tail(sampling=sampling):
                    ops.emit_tokens(logits, eos, 0, *state, sampling.sample(logits, seed, off))

                def torch_tail(sampling=sampling):
                    ops.emit_tokens(sampling.choose(sampling.warp(logits)), eos, 0, *state)

                groups[f"{name}: sample_tokens"] = [fused] * 20
                if cluster:  # (the host's pick above is the cluster kernel: the one-block kernel beside it)
                    def one_block(sampling=sampling):
                        return ext.sample_tokens_with(logits, seed, off, sampling.temperature, sampling.top_k or 0,
                                                      1.0 if sampling.top_p is None else sampling.top_p,
                                                      sampling.min_p or 0.0, 0)

                    groups[f"{name}: sample_tokens one-block kernel"] = [one_block] * 20
                groups[f"{name}: sample_tokens + emit(chosen)"] = [fused_tail] * 20
                groups[f"{name}: torch warpers + race + emit"] = [torch_tail] * 5
            for name, st in graph_calls_ms(groups, rounds=args.rounds, replays=10).items():
                row = {"part": "kernel", "batch": b, "impl": name, "vocab": v, "ms": st["median_ms"],
                       "us": 1000 * st["median_ms"], "min": st["p10_ms"], "max": st["p90_ms"], "rounds": st["n"],
                       "cluster": cluster if "sample_tokens" in name and "one-block" not in name else 0}
                rows.append(row)
                print(row, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="folder for sampling.json / sampling.md")
    ap.add_argument("--model", default="random:opt-1.3b")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--skip-generate", action="store_true", help="the kernels only")
    args = ap.parse_args()
    common.RESULTS_DIR = Path(args.out)
    rows = kernel_rows(args) + ([] if args.skip_generate else generate_rows(args))
    settings = {"model": args.model, "dtype": "fp16", "context": args.context, "new_tokens": args.new,
                "sampling": SETTINGS,
                "method": "generate: (T(new) - T(1)) / (new - 1), CUDA events, median over rounds (min, max); "
                          "kernel: per call in a CUDA graph, median (p10, p90 as min, max)",
                "target": "topp_fused and topk_fused x_greedy <= 1.05"}
    cols = ["part", "batch", "vocab", "impl", "ms", "us", "cluster", "min", "max", "rounds", "x_greedy"]
    print(write_results("sampling", settings, measure_ceilings(), rows, cols).with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
