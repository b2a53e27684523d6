"""One short Markdown page from what tools/gpu_stage_export.sh measured (the export and ONNX Runtime figures, each with
its target).

    python tools/export_stage_summary.py RESULTS_DIR > summary.md

Reads, where present: export_{fused,plain}.json (the export CLI's output line + wall time), ort_accuracy.json,
eval_b1.json, eval_b8.json, eval_prefill2040.json (fuseinfer.eval), ort_profile.json. A missing file becomes a
line saying so; nothing here is a figure that was not measured in the run.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

EXPORT_TARGET_S = 180  # export of OPT-1.3b fp16 under 3 minutes


def load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def fmt(x, digits=3):
    return "n/a" if x is None else f"{x:.{digits}g}"


def med(row, key):
    v = row.get(key)
    return v.get("median") if isinstance(v, dict) else v


def export_lines(r: Path) -> list[str]:
    out = ["## Export (python -m fuseinfer.export onnx; the two flavours ran concurrently)"]
    for flavour in ("fused", "plain"):
        d = load(r / f"export_{flavour}.json")
        if not d:
            out.append(f"- {flavour}: no result (see the stage log)")
            continue
        wall, export_s = d.get("wall_s"), d.get("export_s")
        ok = wall is not None and wall < EXPORT_TARGET_S
        out.append(f"- {flavour} ({d.get('dtype')}): to_onnx {fmt(export_s)} s, whole CLI process {fmt(wall)} s "
                   f"(model load {fmt(d.get('load_s'))} s) -> target < {EXPORT_TARGET_S} s: {'met' if ok else 'NOT met'}; "
                   f"contrib ops {d.get('contrib_ops')}")
    return out


def accuracy_lines(r: Path) -> list[str]:
    d = load(r / "ort_accuracy.json")
    if not d:
        return ["## Logits vs PyTorch: no result (see the stage log)"]
    env = d["environment"]
    out = [f"## Logits vs PyTorch (opt-wt2-tiny {env['dtype']}, {env['device']}, batch {env['batch']}, one row "
           "left-padded; target: ORT err <= 2x PyTorch's own err in that dtype + 0.01)", "",
           "| flavour | ORT max err | PyTorch max err | ratio | target | greedy = PyTorch (32) |",
           "|---|---|---|---|---|---|"]
    for flavour, x in d["flavours"].items():
        out.append(f"| {flavour} | {fmt(x['ort_max_err'])} | {fmt(x['torch_max_err'])} | "
                   f"{fmt(x['ratio_to_torch'])} | {'met' if x['within_2x_torch'] else 'NOT met'} | "
                   f"{x['greedy_match_32']:.0%} |")
    return out


def eval_lines(r: Path, name: str, title: str) -> list[str]:
    d = load(r / f"{name}.json")
    if not d:
        return [f"## {title}: no result (see the stage log)"]
    rows, st = d["backends"], d.get("settings", {})
    where = d.get("environment", {}).get("gpu") or st.get("device")
    title = (f"{title}: {st.get('model')} {st.get('dtype')} on {where}, batch {st.get('batch_size')}, prompt {st.get('prompt_len')}, {st.get('gen_len')} new tokens")
    out = [f"## {title}", "", "| backend | prefill ms | decode ms/tok | tok/s | peak MiB | greedy = eager | note |",
           "|---|---|---|---|---|---|---|"]
    for n, row in rows.items():
        mem = row.get("device_memory")
        if mem:  # ORT: its arena is outside torch's allocator, the driver's count minus before the session
            peak = f"{fmt(mem.get('peak_mib'), 5)} (GPU used)"
        else:
            pm = row.get("peak_memory") or {}
            peak = f"{fmt(pm.get('max_reserved_mib'), 5)} (torch reserved)"
        note = row.get("error") or ""
        if row.get("export_reused") is not None:
            note = (note + "; " if note else "") + ("reused the CLI export" if row["export_reused"] else
                                                    f"exported here in {fmt(row.get('export_s'))} s")
        match = row.get("greedy_match_eager")
        out.append(f"| {n} | {fmt(med(row, 'prefill_ms'))} | {fmt(med(row, 'decode_ms_per_token'))} | "
                   f"{fmt(row.get('tokens_per_s'))} | {peak} | {'' if match is None else f'{match:.0%}'} | {note} |")

    def ratio(a, b, key):
        x, y = (med(rows.get(a, {}), key), med(rows.get(b, {}), key))
        return x / y if x and y else None

    fp, fd = ratio("ort", "ort-plain", "prefill_ms"), ratio("ort", "ort-plain", "decode_ms_per_token")
    out.append("")
    if fp is not None and fd is not None:
        verdict = "met" if fp < 1 and fd < 1 else "NOT met"
        out.append(f"- ort (fused) / ort-plain time: prefill {fp:.2f}x, decode {fd:.2f}x (target: fused faster on "
                   f"both: {verdict})")
    qp, qd = ratio("ort", "fuseinfer", "prefill_ms"), ratio("ort", "fuseinfer", "decode_ms_per_token")
    if qp is not None and qd is not None:
        out.append(f"- ort / fuseinfer time: prefill {qp:.2f}x, decode {qd:.2f}x")
    return out


def profile_lines(r: Path) -> list[str]:
    d = load(r / "ort_profile.json")
    if not d:
        return ["## Profile: no result (see the stage log)"]
    out = ["## Where ORT's time goes (batch 1; details in ort_profile.md)"]
    for flavour, x in d.items():
        on_cpu = sorted(op for op, p in x.get("providers", {}).items() if "CPU" in p)
        out.append(f"- {flavour}: fresh-process load {fmt(x['session_load_s'])} s (logits finite: "
                   f"{x['logits_finite']}); decode {fmt(x['decode_ms_per_step'])} ms/step wall vs "
                   f"{fmt(x['gpu_decode_ms_per_step'])} ms GPU kernels; IO binding "
                   f"{fmt(x['host_bind_us_per_run'])} us/run; prefill {fmt(x['prefill_ms'])} ms wall vs "
                   f"{fmt(x['gpu_prefill_ms'])} ms GPU; ops on CPU: {', '.join(on_cpu) or 'none'}")
    return out


def main():
    r = Path(sys.argv[1])
    lines = ["# GPU stage: ONNX export and ONNX Runtime", ""]
    for part in (export_lines(r), accuracy_lines(r),
                 eval_lines(r, "eval_b1", "Eval (decode, batch 1)"),
                 eval_lines(r, "eval_b8", "Eval (decode, batch 8)"),
                 eval_lines(r, "eval_prefill2040", "Eval (long prefill)"),
                 profile_lines(r)):
        lines += part + [""]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
