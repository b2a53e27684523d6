"""Decode with the FP8 (e4m3) KV cache against the model-dtype cache: fuseinfer.generate's ms/token.

    python bench/bench_kv_fp8.py --out DIR [--model random:opt-1.3b] [--cases 32x2048,1x512] [--new-tokens 128]

For random-weight OPT (default opt-1.3b, fp16), per case BxC (batch B, context C: the prompt is C - N - 1 tokens, so
that the last of the N new tokens sits at position C - 1, within OPT's 2048 positions): two patched copies of the
model, ``RuntimeConfig(kv_cache="auto")`` and ``kv_cache="fp8"``, timed in turn in each of --repeats rounds (drift
cancels in the per-round ratio) after a warm-up of both (graphs captured, caches allocated). ms/token = (T(generate
1 + N new) - T(generate 1 new)) / N, wall clock around synchronised calls, as bench_decode.py (prefill cancels);
median with p10-p90 over rounds, and the median over rounds of fp16 / fp8 (``speedup``: above 1, the FP8 cache is
faster). The K/V bytes a decode step reads at the timed steps' mean context (keys and values of every layer, B x
Hkv x context x D elements each, 2 bytes or 1) and the weight bytes are recorded beside them. Writes
DIR/kv_fp8.json and DIR/kv_fp8.md (GPU, versions, measured copy bandwidth); each copy's decode path is recorded.
``--decode-kernel``: both copies' RuntimeConfig.decode_kernel; ``on`` times the one-kernel step over both caches (it
reads e4m3 caches too: ``--cases 1x512,2x512 --decode-kernel on`` is the FP8 cache's "not slower than the fp16
cache" check), ``off`` both per op.
"""
from __future__ import annotations

import argparse
import copy
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import measure_ceilings, percentile_stats, wall_ms, write_results  # noqa: E402

import fuseinfer  # noqa: E402
from fuseinfer.runtime.decode import SESSIONS_ATTR  # noqa: E402

KINDS = ("auto", "fp8")  # RuntimeConfig.kv_cache of the two copies


def kv_bytes_per_step(config, batch: int, context: float, elem_bytes: int) -> float:
    """Bytes of keys and values a decode step reads at ``context`` cached tokens: every layer's K and V."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * batch * heads * context * head_dim * elem_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for kv_fp8.json and kv_fp8.md (kv_fp8_perop.* with "
                                                  "--decode-kernel off, kv_fp8_step.* with on)")
    ap.add_argument("--model", default="random:opt-1.3b")
    ap.add_argument("--cases", default="32x2048,1x512", help="comma list of BATCHxCONTEXT")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    ap.add_argument("--decode-kernel", default="auto", choices=["auto", "on", "off"],
                    help="RuntimeConfig.decode_kernel of both copies: 'auto' lets both caches take the one-kernel "
                         "step where the default would (OPT: 1-2 rows), 'on' wherever it applies, 'off' compares per "
                         "op with per op")
    args = ap.parse_args()
    common.RESULTS_DIR = Path(args.out)
    ceilings = measure_ceilings()
    base, stats = common.decode_model(args.model, args.dtype)
    cfg, n = base.config, args.new_tokens
    rows = []
    for case in args.cases.split(","):
        batch, context = (int(x) for x in case.lower().split("x"))
        prompt = context - n - 1
        if prompt < 1:
            ap.error(f"case {case}: context {context} leaves no prompt for {n} new tokens")
        ids = torch.randint(3, cfg.vocab_size, (batch, prompt), device="cuda")
        models, gens, paths = {}, {}, {}
        for kind in KINDS:
            model = models[kind] = copy.deepcopy(base)
            runtime = fuseinfer.RuntimeConfig(kv_cache=kind, decode_kernel=args.decode_kernel)
            fuseinfer.patch(model, fuseinfer.PatchConfig(runtime=runtime))
            gens[kind] = (lambda m: lambda k: fuseinfer.generate(m, ids, max_new_tokens=k))(model)
            with torch.no_grad():
                for k in (1, 1 + n):  # warm-up: sessions, caches, graphs
                    gens[kind](k)
            paths[kind] = next(s.path for key, s in model.__dict__[SESSIONS_ATTR].items() if isinstance(key, int))
        times = {kind: [] for kind in KINDS}
        with torch.no_grad():
            for _ in range(args.repeats):
                for kind in KINDS:
                    gen = gens[kind]
                    times[kind].append((wall_ms(lambda: gen(1 + n)) - wall_ms(lambda: gen(1))) / n)
        mean_context = prompt + (n + 1) / 2
        row = {"batch": batch, "context": context, "prompt": prompt, "weight_GB": stats.weight_bytes_per_token / 1e9}
        for kind in KINDS:
            t = percentile_stats(times[kind])
            label = "fp16" if kind == "auto" else "fp8"
            row[f"{label}_ms"], row[f"{label}_spread_ms"] = t["median_ms"], f"{t['p10_ms']:.4g}-{t['p90_ms']:.4g}"
            row[f"{label}_kv_GB"] = kv_bytes_per_step(cfg, batch, mean_context, 2 if kind == "auto" else 1) / 1e9
            row[f"{label}_path"] = paths[kind]
            row[f"{label}_rounds_ms"] = times[kind]
        ratios = sorted(a / b for a, b in zip(times["auto"], times["fp8"]))
        row["speedup"] = ratios[len(ratios) // 2]
        print(f"batch {batch} context {context}: fp16 cache {row['fp16_ms']:.3f} ms/token, fp8 cache "
              f"{row['fp8_ms']:.3f} ms/token, speedup {row['speedup']:.3f}", flush=True)
        rows.append(row)
        models = gens = None
        gc.collect()
        torch.cuda.empty_cache()
    cols = ["batch", "context", "prompt", "weight_GB", "fp16_kv_GB", "fp8_kv_GB", "fp16_ms", "fp16_spread_ms",
            "fp8_ms", "fp8_spread_ms", "speedup"]
    settings = {**vars(args), "weight_bytes": stats.weight_bytes_per_token,
                "timing": "(T(1+N new) - T(1 new)) / N per round, fp16 and fp8 caches in turn each round, wall clock "
                          "around synchronised generate; median and p10-p90 over rounds; speedup: median over "
                          "rounds of fp16 / fp8"}
    name = {"auto": "kv_fp8", "off": "kv_fp8_perop", "on": "kv_fp8_step"}[args.decode_kernel]
    print(write_results(name, settings, ceilings, rows, cols).with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
