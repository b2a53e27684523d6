"""Decode latency of fuseinfer's fast path (static cache + CUDA graphs) vs transformers' generate.

For random-weight OPT (default opt-1.3b, fp16) at each batch size, with a prompt of --context tokens:
ms/token = (T(generate 1 + N new tokens) - T(generate 1 new token)) / N: each of --repeats rounds times the two
calls back to back (so drift between rounds cancels in the difference), after a warm-up (which also absorbs
torch.compile's compile time), so prefill cancels out; the median over rounds, with the 10th and 90th
percentiles. Compared: eager HF generate,
HF generate(cache_implementation="static") (which torch.compiles its decode step), and fuseinfer.generate.
Derived: floor = weight bytes / measured copy bandwidth (docs/results.md defines it), floor_kv = the bytes of a step,
KV cache included, / copy bandwidth (the KV cache outweighs the weights at batch 32); achieved GB/s = bytes read per decode step / ms-per-token,
the bytes by ``fuseinfer.harness.metrics.decode_bytes_per_step`` (weights + KV cache at the mean context of the N timed
steps), so the figure matches the eval CLI's GB/s for the same settings.

Llama-family decode before / after the GEMV epilogue fusions, in one process: ``--model
random:meta-llama/Llama-3.2-1B --backends fuseinfer,fuseinfer-unfused`` (``-unfused``: FUSEINFER_GEMV_EPILOGUES=0 while
that backend is patched, captured and timed, so gate/up runs the GEMV and then silu_mul as two kernels);
``<backend>_over_floor`` is each fuseinfer backend's ms/token over the weight-read floor.

The one-kernel step against the per-op step, in one process: ``--backends fuseinfer-step,fuseinfer-perop``
(RuntimeConfig(decode_kernel="on") and "off"; plain ``fuseinfer`` is "auto", the measured default).

The Llama family's RMSNorms folded into the next GEMV's prologue (the default) against the norm kernels, in one
process: ``--backends fuseinfer-perop,fuseinfer-perop-nofold`` (``-nofold``: ``models.llama.modules.FOLD_NORMS`` off
while that backend is patched, captured and timed; ``-foldnorm`` on; either changes the per-op step only).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import measure_ceilings, percentile_stats, wall_ms, write_results  # noqa: E402

import fuseinfer  # noqa: E402
from fuseinfer.core import knobs  # noqa: E402
from fuseinfer.harness.metrics import decode_bytes_per_step  # noqa: E402


# fuseinfer backends -> their quantization scheme (None: fp16/bf16)
SCHEMES = {"fuseinfer": None, "fuseinfer-w8a16": fuseinfer.Int8WeightOnly, "fuseinfer-fp8": fuseinfer.Float8}


@contextlib.contextmanager
def fold_norms(on: bool = True):
    """The Llama family's RMSNorms folded into the next GEMV (``modules.FOLD_NORMS``) or not inside the block."""
    from fuseinfer.models.llama import modules as llama_modules

    before, llama_modules.FOLD_NORMS = llama_modules.FOLD_NORMS, on
    try:
        yield
    finally:
        llama_modules.FOLD_NORMS = before


def eight_bit_elements(model) -> int:
    """Elements of the 8-bit weights a patched model's quantized linears stream (each saves a byte against fp16)."""
    from fuseinfer.layers.linear import QuantizedLinear

    seen = {}
    for m in model.modules():
        sw = m.step_weights() if isinstance(m, QuantizedLinear) else None
        if sw is not None:
            seen[sw[0].data_ptr()] = sw[0].numel()
    return sum(seen.values())


def ms_per_token(gen, ids, new_tokens: int, repeats: int) -> dict:
    """Median, p10 and p90 over rounds of (T(1 + N new) - T(1 new)) / N, the two timed back to back per round."""
    for n in (1, 1 + new_tokens):  # warm-up both lengths (compiles, captures graphs)
        gen(ids, n)
    return percentile_stats([(wall_ms(lambda: gen(ids, 1 + new_tokens)) - wall_ms(lambda: gen(ids, 1))) / new_tokens
                             for _ in range(repeats)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="random:opt-1.3b")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backends", default="eager,hf_static_compile,fuseinfer",
                    help="comma list of eager, hf_static_compile, fuseinfer, fuseinfer-w8a16, fuseinfer-fp8; a "
                         "'-perop' suffix on a fuseinfer backend turns the one-kernel step off, '-step' on wherever it "
                         "applies (decode_kernel='on'), a '-unfused' suffix "
                         "the GEMV epilogue fusions (FUSEINFER_GEMV_EPILOGUES=0: gate/up GEMV, then silu_mul), a "
                         "'-foldnorm' / '-nofold' suffix (last) folds the Llama family's RMSNorms into the next GEMV "
                         "or not (folded is the default)")
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    ap.add_argument("--quick", action="store_true", help="batch 1 only, 64 tokens, 3 repeats")
    ap.add_argument("--out", default=None, help="results folder (default: $FUSEINFER_BENCH_DIR or bench/results)")
    args = ap.parse_args()
    if args.out:
        common.RESULTS_DIR = Path(args.out)
    if args.quick:
        args.batches, args.new_tokens, args.repeats = "1", 64, 3
    ceilings = measure_ceilings()
    base, stats = common.decode_model(args.model, args.dtype)
    weight_bytes = stats.weight_bytes_per_token
    floor_ms = weight_bytes / (ceilings["copy_GBps"] * 1e9) * 1e3
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        ids = torch.randint(3, base.config.vocab_size, (batch, args.context), device="cuda")
        step_bytes = decode_bytes_per_step(stats, batch, args.context, args.new_tokens)  # the N timed steps
        row = {"batch": batch, "context": args.context, "floor_ms": floor_ms,
               "floor_kv_ms": step_bytes / (ceilings["copy_GBps"] * 1e9) * 1e3}
        for name in args.backends.split(","):
            model = copy.deepcopy(base)
            fold = True if name.endswith("-foldnorm") else False if name.endswith("-nofold") else None
            kind = name.removesuffix("-foldnorm").removesuffix("-nofold")
            kind, unfused = kind.removesuffix("-unfused"), kind.endswith("-unfused")
            knob = contextlib.ExitStack()  # (held while the backend's CUDA graphs are captured and timed)
            if unfused:
                knob.enter_context(knobs.override(GEMV_EPILOGUES="0"))
            if fold is not None:
                knob.enter_context(fold_norms(fold))
            if name == "eager":
                gen = lambda x, n: model.generate(x, max_new_tokens=n, do_sample=False)  # noqa
            elif name == "hf_static_compile":
                gen = lambda x, n: model.generate(x, max_new_tokens=n, do_sample=False,  # noqa
                                                  cache_implementation="static")
            elif kind.removesuffix("-perop").removesuffix("-step") in SCHEMES:
                quant = SCHEMES[kind.removesuffix("-perop").removesuffix("-step")]
                mode = "off" if kind.endswith("-perop") else "on" if kind.endswith("-step") else "auto"
                runtime = fuseinfer.RuntimeConfig(decode_kernel=mode)
                fuseinfer.patch(model, fuseinfer.PatchConfig(quant=quant() if quant else None, runtime=runtime))
                gen = lambda x, n: fuseinfer.generate(model, x, max_new_tokens=n)  # noqa: E731
                if quant is not None:  # the weight-read floor with the 8-bit weights (1 byte instead of 2)
                    eight_bit = weight_bytes - eight_bit_elements(model)
                    row["floor_8bit_ms"] = eight_bit / (ceilings["copy_GBps"] * 1e9) * 1e3
            else:
                ap.error(f"unknown backend {name!r} (eager, hf_static_compile, {', '.join(SCHEMES)}; '-perop', "
                         "'-step', '-unfused', '-foldnorm')")
            with torch.no_grad(), knob:  # (the knob holds while the backend's CUDA graphs are captured)
                t = ms_per_token(gen, ids, args.new_tokens, args.repeats)
            ms = t["median_ms"]
            row[name] = t
            row[f"{name}_ms"], row[f"{name}_spread_ms"] = ms, f"{t['p10_ms']:.4g}-{t['p90_ms']:.4g}"
            row[f"{name}_GBps"] = step_bytes / (ms * 1e-3) / 1e9
            if name.startswith("fuseinfer"):
                row[f"{name}_over_floor"] = ms / floor_ms
            print(f"batch {batch}: {name} {ms:.3f} ms/token (p10-p90 {row[f'{name}_spread_ms']})", flush=True)
            model = gen = None  # the copy and its caches go before the next backend
            gc.collect()
            torch.cuda.empty_cache()
        if "fuseinfer_ms" in row:
            row["fuseinfer_pct_copy"] = 100 * row["fuseinfer_GBps"] / ceilings["copy_GBps"]
            row["fuseinfer_over_floor"] = row["fuseinfer_ms"] / floor_ms
            row["fuseinfer_over_floor_kv"] = row["fuseinfer_ms"] / row["floor_kv_ms"]
            row["fuseinfer_tok_s"] = batch * 1e3 / row["fuseinfer_ms"]
            for other in ("eager", "hf_static_compile"):
                if f"{other}_ms" in row:
                    row[f"speedup_vs_{other}"] = row[f"{other}_ms"] / row["fuseinfer_ms"]
        rows.append(row)
    cols = ["batch", "context", "floor_ms", "floor_kv_ms", *[c for c in ("floor_8bit_ms",) if c in rows[0]],
            *[c for c in rows[0] if c.endswith("_ms") and not c.startswith("floor")],
            *[c for c in rows[0] if c.endswith("_over_floor") and c != "fuseinfer_over_floor"],
            *[c for c in ("fuseinfer_over_floor", "fuseinfer_over_floor_kv", "fuseinfer_GBps", "fuseinfer_pct_copy",
                          "fuseinfer_tok_s",
                          "speedup_vs_eager", "speedup_vs_hf_static_compile") if c in rows[0]]]
    settings = {**vars(args), "weight_bytes": weight_bytes,
                "timing": "(T(1+N new) - T(1 new)) / N per round, the two timed back to back, wall clock around "
                            "synchronised generate; median and p10-p90 over rounds"}
    name = "decode" if args.model == "random:opt-1.3b" and args.dtype == "fp16" else \
        f"decode_{args.model.rsplit('/', 1)[-1].removeprefix('random:')}_{args.dtype}"
    print(write_results(name, settings, ceilings, rows, cols).with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
