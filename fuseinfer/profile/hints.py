"""Rules that turn a profile into advice for this model and backend, each with the figure that triggered it.

Every rule reads the tables (never a hard-coded expectation); thresholds are named constants below. A hint is
{"rule", "advice", "figure"}: the figure is the measured number the advice rests on.
"""
from __future__ import annotations

from fuseinfer.profile.trace import GRAPH

ATTENTION_SHARE = 0.20  # attention this much of the step is worth its own kernel
MEMORY_BOUND_SHARE = 0.40  # memory-bound GEMVs this much of a decode step: fewer weight bytes pay
LAUNCHES = 300  # launches per step from the host beyond which graphs pay
IDLE_SHARE = 0.30  # the device idle this much of the step: the host is the limit
LOW_COMPUTE = 0.60  # compute-bound ops below this fraction of the GEMM rate
FUSIBLE_SHARE = 0.08  # LayerNorm + residual adds this much of the step


def _share(analysis: dict, coarse: str) -> float:
    return sum(r["share"] for r in analysis["kinds"] if r["coarse"] == coarse)


def _weighted(rows: list[dict]) -> float | None:
    w = sum(r["device_ms"] for r in rows if r.get("pct_roofline") is not None)
    return sum(r["pct_roofline"] * r["device_ms"] for r in rows if r.get("pct_roofline") is not None) / w if w else None


def _hint(rule: str, advice: str, figure: str) -> dict:
    return {"rule": rule, "advice": advice, "figure": figure}


def hints_for(result) -> list[dict]:
    """Hints for the profiled backend (the first profile), then a comparison hint when --compare ran."""
    prof = result.main
    a = prof.analysis
    phase, name, device = result.settings["phase"], prof.name, result.ceilings["device"]
    patched = name.startswith("fuseinfer") or "patched by fuseinfer" in prof.summary
    step, out = a["step_ms"], []
    if not device.startswith("cuda"):
        out.append(_hint("cpu", "fuseinfer's kernels are CUDA kernels: on CPU a patched model runs their PyTorch "
                         "references, so profile on a GPU to see what patching buys",
                         f"device {device}, step {step:.2f} ms"))
    ops = prof.cost_analysis["ops"]  # (the op-by-op pass where the step replays CUDA graphs)
    attention = [r for r in ops if r["coarse"] == "attention" and r.get("op_class") == "attention"]
    att_share, att_pct = _share(prof.kinds, "attention"), _weighted(attention)
    if att_share >= ATTENTION_SHARE:
        pct = f", its core at {att_pct:.0%} of its roofline" if att_pct is not None else ""
        advice = ("patch with fuseinfer.PatchConfig(ops=('attention', 'qkv')) for the fused attention kernel and the "
                  "one q/k/v GEMM" if not patched else
                  "attention is already fused; what is left is its roofline gap (a longer prompt raises its intensity)")
        out.append(_hint("attention", advice, f"attention (q/k/v, core, output projection) is {att_share:.0%} of the "
                         f"{phase} step{pct}"))
    gemv = [r for r in ops if r.get("op_class") in ("gemv", "step") and r["verdict"] == "memory-bound"]
    gemv_share = sum(r["share"] for r in gemv)
    if phase in ("decode", "generate") and gemv_share >= MEMORY_BOUND_SHARE:
        out.append(_hint("weights", "the step streams weights: int8 weight-only quantisation "
                         "(--backend fuseinfer-w8a16, PatchConfig(quant=Int8WeightOnly())) halves the bytes it reads",
                         f"memory-bound GEMVs are {gemv_share:.0%} of the step at {_weighted(gemv) or 0:.0%} of the "
                         f"measured copy bandwidth ({result.ceilings['copy_gbps']:.0f} GB/s)"))
    graphs = any(r["kind"] == GRAPH for r in a["kinds"])
    if a["launches_per_step"] >= LAUNCHES and not graphs:
        out.append(_hint("launches", "launches dominate: replay the step as a CUDA graph -- fuseinfer.generate / "
                         "--backend fuseinfer (fast decode), or torch.compile(mode='reduce-overhead')",
                         f"{a['launches_per_step']:,.0f} {'launches' if a['unit'] == 'kernel' else 'op calls'} "
                         f"per step"))
    if step > 0 and a["idle_ms"] / step >= IDLE_SHARE:
        out.append(_hint("host", "host time exceeds device time: the device waits for Python and launches; CUDA "
                         "graphs (fuseinfer fast decode) or a larger batch per step" if a["unit"] == "kernel" else
                         "time between ops (Python, framework) is a large part of the step: fewer, larger ops "
                         "(fused modules, torch.compile)",
                         f"{a['idle_label']}: {a['idle_ms']:.2f} ms of the {step:.2f} ms step "
                         f"({a['idle_ms'] / step:.0%})"))
    compute = [r for r in ops if r["verdict"] == "compute-bound"]
    pct = _weighted(compute)
    if compute and pct is not None:
        share = sum(r["share"] for r in compute)
        if pct < LOW_COMPUTE:
            out.append(_hint("gemm", "compute-bound ops run well below the measured GEMM rate: check their shapes "
                             "(multiples of 64/128), dtype and that the fused linear epilogue is on (ops=('linear',))",
                             f"compute-bound ops: {share:.0%} of the step at {pct:.0%} of the GEMM roofline"))
        elif share >= 0.5:
            int8 = result.ceilings["gemm_tflops"].get("int8")
            gain = f" (int8 GEMM measured at {int8:.0f} TOP/s here)" if int8 else ""
            out.append(_hint("gemm", "the GEMMs are near the measured GEMM rate: little is left in them; int8 "
                             f"activations and weights (W8A8) raise the roof{gain}",
                             f"compute-bound ops: {share:.0%} of the step at {pct:.0%} of the GEMM roofline"))
    fusible = _share(prof.kinds, "residual") + _share(prof.kinds, "layernorm")
    if not patched and fusible >= FUSIBLE_SHARE:
        out.append(_hint("fusion", "patch with PatchConfig(ops=('layer_norm', 'linear')): residual adds ride in the "
                         "LayerNorm kernel and in the attention output / second MLP projection GEMM epilogues",
                         f"LayerNorm + residual adds: {fusible:.0%} of the step"))
    top = max(ops, key=lambda r: r["device_ms"], default=None)
    if top is not None and top["device_ms"] > 0:
        pct = f" at {top['pct_roofline']:.0%} of its roofline" if top.get("pct_roofline") is not None else ""
        out.append(_hint("top", f"the largest item is {top['op']} ({top['kind']}): start there",
                         f"{top['device_ms']:.3f} ms per step ({top['share']:.0%}), {top['verdict']}{pct}"))
    if result.compare:
        c = result.compare
        best = max(c["by_kind"], key=lambda r: r["saved_ms"])
        acc = f"; the per-kind savings account for {c['accounted']:.0%} of the busy-time difference" \
            if c["accounted"] is not None else ""
        out.append(_hint("compare", f"{c['main']} vs {c['base']}: most time saved in {best['kind']}",
                         f"{c['speedup']:.2f}x end to end; {best['kind']} {best['base_ms']:.3f} -> "
                         f"{best['main_ms']:.3f} ms{acc}"))
    return out
