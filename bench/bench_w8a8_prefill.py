"""W8A8 prefill paths: where the OPT-1.3b 1x2047 W8A8 prefill time goes, and what the fused LayerNorm +
quantize and the lean loop / prefill graphs buy, with fp16 fuseinfer timed in the same run.

Random-weight OPT (default opt-1.3b) fp16 on one GPU; the W8A8 copy is SmoothQuant-calibrated on seeded random ids
(``--calibration-samples`` windows of 512; no tokenizer for random weights). For each shape B x S (default 1x2047,
1x512, 1x128), fast decode's prefill (``_Session.begin``: the prompt into the static cache + the first token):

* ``fp16_graph``: the fp16 patched model, FUSEINFER_PREFILL=graph (what the eval's fuseinfer row runs at 1x2047);
* ``w8a8_module_unfused``: W8A8, the patched modules with the LayerNorm -> quantize_per_token path of before
  (``FusedOPTDecoderLayer._int8_qkv`` / ``_int8_fc1`` switched off), FUSEINFER_PREFILL=module (the eval's W8A8 row
  before this change);
* ``w8a8_module``: W8A8 patched modules with ``add_layer_norm_quant`` feeding q/k/v and fc1 (FUSEINFER_PREFILL=module);
* ``w8a8_lean`` / ``w8a8_graph``: W8A8 through the lean loop / its CUDA graph (FUSEINFER_PREFILL=lean / graph);
* ``w8a8_gemms``: the 4 x layers W8A8 GEMMs of the forward alone (``torch.ops.fuseinfer_C.w8a8_linear`` on that shape's
  operands, captured in one CUDA graph so no launch gap counts): the GEMM floor of the W8A8 prefill.

Timing: CUDA events around each call with the GPU idle before it (so host launch gaps count), 3 warm-up calls each
(graph captures), then ``--reps`` rounds calling every implementation once in turn; median and p10-p90. Derived:
``graph_over_fp16`` = w8a8_graph / fp16_graph, ``gemm_share`` = w8a8_gemms / w8a8_graph (the rest: attention,
LayerNorms, quantize, embeddings, head), ``module_host_ms`` = w8a8_module - w8a8_graph (what the module path's host
work costs at that shape). Target (H100): 1x2048 <= 6.0 ms.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import event_ms, measure_ceilings, percentile_stats, write_results  # noqa: E402

import fuseinfer  # noqa: E402
from fuseinfer.harness.models import load_config, load_model, resolve_model  # noqa: E402
from fuseinfer.models.opt.modules import FusedOPTDecoderLayer  # noqa: E402
from fuseinfer.quant import smoothquant as sq  # noqa: E402
from fuseinfer.runtime import prefill as pf  # noqa: E402
from fuseinfer.runtime.decode import COUNTS, Sampling, decode_forward, session_for  # noqa: E402

TARGET_MS = {2047: 6.0, 2048: 6.0}


def gemms_graph(model, m: int):
    """A replay closure of a CUDA graph running the W8A8 model's 4 x layers GEMMs at M = m (random int8 input)."""
    from fuseinfer.core.extension import extension

    ext = extension(torch.device("cuda"))
    calls = []
    for layer in model.model.decoder.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.out_proj, layer.fc1, layer.fc2):
            n, k = lin.weight_q.shape
            x = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda")
            xs = torch.rand(m, device="cuda") * 0.01
            out = torch.empty(m, n, dtype=torch.float16, device="cuda")
            res = torch.empty(m, n, dtype=torch.float16, device="cuda") if lin is not layer.fc1 and \
                lin is not layer.self_attn.qkv_proj else None
            calls.append((x, xs, lin, res, lin is layer.fc1, out))

    def run():
        for x, xs, lin, res, relu, out in calls:
            ext.w8a8_linear(x, xs, lin.weight_q, lin.weight_scale.view(-1), lin.bias, res, relu, out)
    run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()

    def replay():
        # (the closure keeps ``calls`` alive: the graph reads and writes those tensors' memory, which would otherwise
        # go back to the allocator when this function returns and be released by the next empty_cache)
        g.replay()
        return calls
    return replay


def traced(name, fn):
    """fn, printing its name before each call and synchronizing after it (a fault then names its call)."""
    def call():
        print(f"  call {name}", flush=True)
        out = fn()
        torch.cuda.synchronize()
        return out
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="random:opt-1.3b")
    ap.add_argument("--shapes", default="1x2047,1x512,1x128")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--calibration-samples", type=int, default=8)
    ap.add_argument("--impls", default="", help="comma-separated subset of the implementations (default: all)")
    ap.add_argument("--trace", action="store_true", help="name each call and synchronize after it (to find a fault)")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    ceilings = measure_ceilings()
    source = resolve_model(args.model)
    base = load_model(source, load_config(source), torch.float16, torch.device("cuda"), seed=0)
    cfg = base.config
    seq = min(512, cfg.max_position_embeddings)
    ids = torch.randint(0, cfg.vocab_size, (1, args.calibration_samples * seq), generator=torch.Generator()
                        .manual_seed(0))
    with torch.no_grad():
        stats = sq.calibrate(base, ids=ids, samples=args.calibration_samples, seq_len=seq)
    fp16 = copy.deepcopy(base)
    fuseinfer.patch(fp16)
    w8a8 = base  # (the unpatched copy is no longer needed: quantize it in place)
    fuseinfer.patch(w8a8, fuseinfer.PatchConfig(quant=fuseinfer.SmoothQuantW8A8(calibration=stats)))
    why = pf.lean_reason(w8a8)
    assert why is None, f"the W8A8 model does not take the lean loop: {why}"
    no_eos = torch.empty(0, dtype=torch.long)
    sessions = {}
    for name, model in (("fp16", fp16), ("w8a8", w8a8)):
        forward, why = decode_forward(model)
        assert forward is not None, why
        sessions[name] = (model, forward)
    orig = (FusedOPTDecoderLayer._int8_qkv, FusedOPTDecoderLayer._int8_fc1)

    def unfused(on: bool):
        FusedOPTDecoderLayer._int8_qkv = (lambda self, h: None) if on else orig[0]
        FusedOPTDecoderLayer._int8_fc1 = (lambda self: None) if on else orig[1]

    rows = []
    for b, s in shapes:
        prompt = torch.randint(3, cfg.vocab_size, (b, s), device="cuda")
        mask = torch.ones_like(prompt)
        sess = {n: session_for(m, f, b, s + 1, Sampling(), 1, no_eos, pad=cfg.pad_token_id or 0)
                for n, (m, f) in sessions.items()}

        def begin(name, choice, off=False):
            def call():
                fuseinfer.runtime.set_runtime(sessions[name][0], prefill=choice)  # (the patched model's config)
                unfused(off)
                try:
                    return sess[name].begin(prompt, mask)
                finally:
                    unfused(False)
            return call

        impls = {"fp16_graph": begin("fp16", "graph"), "w8a8_module_unfused": begin("w8a8", "module", True),
                 "w8a8_module": begin("w8a8", "module"), "w8a8_lean": begin("w8a8", "lean"),
                 "w8a8_graph": begin("w8a8", "graph"), "w8a8_gemms": None}
        if args.impls:
            impls = {n: impls[n] for n in args.impls.split(",")}
        if "w8a8_gemms" in impls:
            impls["w8a8_gemms"] = gemms_graph(w8a8, b * s)
        if args.trace:
            impls = {n: traced(n, fn) for n, fn in impls.items()}
        graphs_before = COUNTS["prefill_graph"]
        with torch.no_grad():
            for fn in impls.values():
                for _ in range(3):
                    fn()
            captured = COUNTS["prefill_graph"] - graphs_before
            times = {n: [] for n in impls}
            for _ in range(args.reps):
                for n, fn in impls.items():
                    times[n].append(event_ms(fn))
        for model, _ in sessions.values():
            fuseinfer.runtime.set_runtime(model, prefill="auto")
        row = {"shape": f"{b}x{s}", "prefill_graphs_captured": captured}
        for n, t in times.items():
            st = percentile_stats(t)
            row[f"{n}_ms"] = st["median_ms"]
            row[f"{n}_spread"] = f"{st['p10_ms']:.3g}-{st['p90_ms']:.3g}"
        have = lambda *names: all(f"{n}_ms" in row for n in names)  # noqa: E731 (a subset ran: --impls)
        if have("w8a8_graph", "fp16_graph"):
            row["graph_over_fp16"] = row["w8a8_graph_ms"] / row["fp16_graph_ms"]
        if have("w8a8_gemms", "w8a8_graph"):
            row["gemm_share"] = row["w8a8_gemms_ms"] / row["w8a8_graph_ms"]
        if have("w8a8_module", "w8a8_graph"):
            row["module_host_ms"] = row["w8a8_module_ms"] - row["w8a8_graph_ms"]
        row["target_ms"] = TARGET_MS.get(s, "") if b == 1 else ""
        print(f"{b}x{s}: " + ", ".join(f"{n} {row[n + '_ms']:.3f}" for n in impls), flush=True)
        rows.append(row)
    cols = ["shape", "fp16_graph_ms", "w8a8_module_unfused_ms", "w8a8_module_ms", "w8a8_lean_ms", "w8a8_graph_ms",
            "w8a8_gemms_ms", "graph_over_fp16", "gemm_share", "module_host_ms", "target_ms",
            "prefill_graphs_captured"]
    settings = {**vars(args), "dtype": "fp16 activations, W8A8 linears", "calibration": "random ids, seed 0"}
    path = write_results("w8a8_prefill", settings, ceilings, rows, cols)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
