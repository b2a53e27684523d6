"""Rendering a profile: rich tables on the terminal; per backend ``ops.csv``, ``kernels.csv``, ``modules.csv``,
``layers.csv``, ``memory.json`` next to its ``trace.json`` and TensorBoard dir; ``profile.json`` (everything),
``summary.md`` (the tables that matter, tying the files together), ``compare.csv`` and the plots; all written into
a temporary folder that fuseinfer.core.files renames into place (``profile.json``, written last, marks it finished)."""
from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fuseinfer.core import files

TOP = 12


def _num(v, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.{digits}g}"
    return str(v)


def _pct(v) -> str:
    return "-" if v is None else f"{v:.0%}"


def _dims(d) -> str:
    return "x".join(map(str, d)) if d and all(isinstance(x, int) for x in d) else "[]" if not d else "?"


def shapes(dims: list) -> str:
    """Compact input shapes: '1x16x256, 768x256, 768'."""
    return ", ".join(_dims(d) for d in dims if d)


# ---- terminal ----

def print_result(result, console: Console | None = None, top: int = TOP) -> None:
    console = console or Console()
    s = result.settings
    console.print(f"[bold]fuseinfer.profile[/]: {s['model']} {s['phase']} (batch {s['batch_size']}, prompt "
                  f"{s['prompt_len']}{', gen ' + str(s['gen_len']) if s['phase'] == 'generate' else ''}) on "
                  f"{result.environment.get('gpu') or s['device']}, {s['dtype']}")
    c = result.ceilings
    gemm = ", ".join(f"{k} {v:.3g}" for k, v in c["gemm_tflops"].items())
    console.print(f"ceilings (measured now): copy {c['copy_gbps']:.3g} GB/s; GEMM TFLOP/s {gemm}; launch floor "
                  f"{c['launch_floor_us']:.2f} µs")
    t = Table(title="step time")
    for h in ("backend", "step ms (no profiler)", "busy ms", "profiled wall ms", "overhead", "busy", "launches/step",
              "notes"):
        t.add_column(h)
    for p in result.profiles:
        a = p.analysis
        u = p.unprofiled_ms
        t.add_row(p.name, f"{u['median']:.3f} [{u['p10']:.3f}-{u['p90']:.3f}]", f"{a['busy_ms']:.3f}",
                  f"{p.profiled_ms:.3f}", f"{p.overhead:+.0%}", _pct(a["busy_ms"] / a["step_ms"] if a["step_ms"] else None),
                  f"{a['launches_per_step']:.0f}", "; ".join(p.notes)[:120])
    console.print(t)
    for p in result.profiles:
        _print_kinds(console, p)
        _print_ops(console, p, top)
        _print_verdicts(console, p)
    if result.compare:
        _print_compare(console, result.compare)
    console.print("[bold]hints[/]")
    for h in result.hints:
        console.print(f"  - {h['advice']}  [dim]({h['figure']})[/]", soft_wrap=True)
    if result.out_dir:
        console.print(f"files in {result.out_dir} (summary.md ties them together)")


def _print_kinds(console, p) -> None:
    a = p.kinds
    t = Table(title=f"{p.name}: time by module kind ({a['unit']} ms per step; {a.get('label', 'un-hooked pass')})")
    for h in ("kind", "coarse", "device ms", "share", "host ms"):
        t.add_column(h)
    for r in a["kinds"]:
        t.add_row(r["kind"], r["coarse"], f"{r['device_ms']:.3f}", _pct(r["share"]), f"{r['host_ms']:.3f}")
    t.add_row(a["idle_label"], "idle", f"{a['idle_ms']:.3f}", _pct(a["idle_ms"] / a["step_ms"]), "")
    console.print(t)


def _print_ops(console, p, top: int) -> None:
    t = Table(title=f"{p.name}: top ops (per step)")
    for h in ("op", "shapes", "kind", "calls", "device ms", "share", "mean µs", "verdict", "% roofline", "AI"):
        t.add_column(h, overflow="fold")
    for r in p.analysis["ops"][:top]:
        t.add_row(r["op"], shapes(r["dims"])[:48], r["kind"], _num(r["calls"]), f"{r['device_ms']:.3f}",
                  _pct(r["share"]), _num(r["mean_us"]), r["verdict"], _pct(r.get("pct_roofline")), _num(r.get("ai")))
    console.print(t)
    if p.analysis["kernels"]:
        t = Table(title=f"{p.name}: top kernels (per step)")
        for h in ("kernel", "op", "kind", "calls", "device ms", "share", "mean µs", "verdict"):
            t.add_column(h, overflow="fold")
        for r in p.analysis["kernels"][:top]:
            t.add_row(r["kernel"][:70], r["op"][:30], r["kind"], _num(r["calls"]), f"{r['device_ms']:.3f}",
                      _pct(r["share"]), _num(r["mean_us"]), r["verdict"])
        console.print(t)


def _print_verdicts(console, p) -> None:
    t = Table(title=f"{p.name}: verdicts by op class")
    for h in ("op class", "verdict", "device ms", "share", "% roofline (time-weighted)"):
        t.add_column(h)
    for r in p.verdicts:
        t.add_row(r["op_class"], r["verdict"], f"{r['device_ms']:.3f}", _pct(r["share"]), _pct(r["pct_roofline"]))
    console.print(t)


def _print_compare(console, c) -> None:
    t = Table(title=f"compare: {c['main']} vs {c['base']} (ms per step)")
    for h in ("kind", c["base"], c["main"], "saved"):
        t.add_column(h)
    for r in c["by_kind"]:
        t.add_row(r["kind"], f"{r['base_ms']:.3f}", f"{r['main_ms']:.3f}", f"{r['saved_ms']:+.3f}")
    console.print(t)
    acc = _pct(c["accounted"])
    console.print(f"end to end: {c['step_ms']['base']:.3f} -> {c['step_ms']['main']:.3f} ms ({c['speedup']:.2f}x); "
                  f"step difference {c['measured_difference_ms']:.3f} ms = busy {c['busy_difference_ms']:.3f} ms + "
                  f"host/idle {c['host_idle_difference_ms']:.3f} ms; per-kind busy savings "
                  f"{c['saved_by_kind_ms']:.3f} ms = {acc} of the busy difference; {len(c['disappeared'])} {c['unit']}s disappeared "
                  f"({c['disappeared_ms']:.3f} ms), {len(c['new'])} new")


# ---- files ----

def _write_csv(path: Path, rows: list[dict], fields: list[str]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (json.dumps(v) if isinstance(v, (list, dict)) else v) for k, v in r.items()})


OP_FIELDS = ["op", "dims", "types", "kind", "coarse", "calls", "device_ms", "share", "mean_us", "host_ms",
             "kernels_per_call", "flops_per_call", "bytes_per_call", "op_class", "precision", "verdict", "ai", "ridge",
             "achieved_tflops", "achieved_gbps", "pct_roofline"]
KERNEL_FIELDS = ["kernel", "op", "op_dims", "kind", "coarse", "calls", "device_ms", "share", "mean_us", "verdict",
                 "pct_roofline", "op_class", "ncu_duration_us", "ncu_dram_gbps", "ncu_dram_pct", "ncu_sm_pct"]


def write_backend_files(p, folder: Path) -> None:
    a = p.analysis
    _write_csv(folder / "ops.csv", a["ops"], OP_FIELDS)
    _write_csv(folder / "kernels.csv", a["kernels"], KERNEL_FIELDS)
    a = p.kinds  # (modules.csv and layers.csv: the attribution pass)
    kinds = a["kinds"] + [{"kind": a["idle_label"], "coarse": "idle", "device_ms": a["idle_ms"], "host_ms": None,
                           "share": a["idle_ms"] / a["step_ms"] if a["step_ms"] else None}]
    _write_csv(folder / "modules.csv", kinds, ["kind", "coarse", "device_ms", "share", "host_ms"])
    _write_csv(folder / "layers.csv", a["layers"], ["layer", "device_ms"])
    (folder / "memory.json").write_text(json.dumps(p.analysis["memory"], indent=1))
    p.files.update({k: str(folder / f) for k, f in (("ops", "ops.csv"), ("kernels", "kernels.csv"),
                                                     ("modules", "modules.csv"), ("layers", "layers.csv"),
                                                     ("memory", "memory.json"))})


MARKER = "profile.json"  # written last: marks a finished profile folder (fuseinfer.core.files replaces only those)


def write_all(result, out: Path, final: Path | None = None) -> None:
    """Every file of a profile into ``out`` (backend folders exist already: the traces are in them). ``final``:
    where ``out`` (a temporary folder of fuseinfer.core.files.atomic_dir) will be renamed to; the recorded paths,
    profile.json and summary.md name the files there."""
    from fuseinfer.profile import plots

    for p in result.profiles:
        folder = out / Path(p.files["trace"]).parent.name if p.files.get("trace") else out / p.name
        folder.mkdir(parents=True, exist_ok=True)
        write_backend_files(p, folder)
    if result.compare:
        _write_csv(out / "compare.csv", result.compare["by_kind"], ["kind", "base_ms", "main_ms", "saved_ms"])
        result.files["compare"] = str(out / "compare.csv")
    result.files.update(plots.write_plots(result, out))
    result.files["json"] = str(out / MARKER)
    result.files["summary"] = str(out / "summary.md")
    if final is not None:
        _rebase(result, Path(out), Path(final))
    (out / "summary.md").write_text(summary_markdown(result), encoding="utf-8")
    (out / MARKER).write_text(json.dumps(result.to_dict(), indent=1, default=str))


def rewrite_all(result, out: Path) -> None:
    """Write a profile folder again (e.g. with ncu columns added) as a whole: a copy of ``out`` with the new files
    replaces it atomically."""
    with files.atomic_dir(out, marker=MARKER, overwrite=True) as tmp:
        shutil.copytree(out, tmp, dirs_exist_ok=True, symlinks=True)
        write_all(result, tmp, final=Path(out))


def _rebase(result, old: Path, new: Path) -> None:
    """Recorded paths under ``old`` (the temporary folder) as paths under ``new``."""
    head = str(old)
    for d in [result.files] + [p.files for p in result.profiles]:
        for key, value in d.items():
            if isinstance(value, str) and (value == head or value.startswith(head + os.sep)):
                d[key] = str(new) + value[len(head):]


def _md_table(headers: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return lines + [""]


def _rel(result, path: str) -> str:
    try:
        return str(Path(path).relative_to(result.out_dir))
    except ValueError:
        return path


def summary_markdown(result, top: int = TOP) -> str:
    s, c, env = result.settings, result.ceilings, result.environment
    lines = [f"# fuseinfer.profile: {s['model']}, {s['phase']}", "",
             f"Batch {s['batch_size']}, prompt {s['prompt_len']}" + (f", {s['gen_len']} generated tokens"
                                                                    if s["phase"] == "generate" else "")
             + f", {s['dtype']} on {env.get('gpu') or s['device']}; torch {env['torch']}, transformers "
             f"{env['transformers']}, fuseinfer {env['fuseinfer']} (extension: {env['fuseinfer_extension']}); "
             f"{env['date_utc']}. Profiler schedule: wait {s['wait']}, warm-up {s['warmup']}, active {s['active']} "
             f"steps (after {3} untimed warm-up steps); step times without the profiler: median of {s['repeats']}.",
             "", "## Ceilings (measured in this run)", "",
             f"Copy bandwidth {c['copy_gbps']:.3g} GB/s; GEMM ({c['gemm_n']}^3) "
             + ", ".join(f"{k} {v:.3g} TFLOP/s" for k, v in c["gemm_tflops"].items())
             + f"; launch floor {c['launch_floor_us']:.2f} µs per call. Ridge point = GEMM rate / copy bandwidth.", "",
             "## Step time", ""]
    rows = []
    for p in result.profiles:
        a, u = p.analysis, p.unprofiled_ms
        rows.append([p.name, f"{u['median']:.3f} [{u['p10']:.3f}-{u['p90']:.3f}]", f"{p.profiled_ms:.3f}",
                     f"{p.overhead:+.0%}", f"{a['busy_ms']:.3f}", f"{a['idle_ms']:.3f}",
                     f"{a['launches_per_step']:.0f}"])
    lines += _md_table(["backend", "step ms, no profiler (median [p10-p90])", "profiled wall ms",
                        "profiler overhead (wall clock)", "busy ms", "idle ms", "launches / step"], rows)
    lines += ["The step time is the unprofiled one, timed for every backend before any profiler ran in the process. "
              "Busy ms is the device time per step of the first profiled pass (no module hooks; kernel events on "
              "CUDA, op time on CPU); the profiled wall ms and the overhead (profiled wall / unprofiled - 1) are the "
              "profiler's own cost, the steps ending with a device sync. The module-kind tables come from a second "
              "pass with module hooks (labelled in each table).", ""]
    for p in result.profiles:
        a = p.analysis
        lines += [f"## {p.name}", "", p.summary + (f" ({p.details.get('decode')})" if p.details.get("decode") else ""),
                  ""]
        lines += [f"- note: {n}" for n in p.notes] + ([""] if p.notes else [])
        k = p.kinds
        lines += ["### Time by module kind", "", f"From: {k.get('label', 'the un-hooked pass')} (that pass's step "
                  f"{k['step_ms']:.3f} ms, busy {k['busy_ms']:.3f} ms).", ""]
        krows = [[r["kind"], r["coarse"], f"{r['device_ms']:.3f}", _pct(r["share"]), f"{r['host_ms']:.3f}"]
                 for r in k["kinds"]]
        krows.append([k["idle_label"], "idle", f"{k['idle_ms']:.3f}", _pct(k["idle_ms"] / k["step_ms"]), ""])
        lines += _md_table(["kind", "coarse", f"{k['unit']} ms / step", "share", "host ms"], krows)
        lines += ["### Verdicts by op class", ""]
        lines += _md_table(["op class", "verdict", "ms / step", "share", "% of roofline (time-weighted)"],
                           [[r["op_class"], r["verdict"], f"{r['device_ms']:.3f}", _pct(r["share"]),
                             _pct(r["pct_roofline"])] for r in p.verdicts])
        lines += [f"### Top ops ({a['unit']} time per step)", ""]
        lines += _md_table(["op", "shapes", "kind", "calls", "ms", "share", "mean µs", "verdict", "% roofline",
                            "FLOP/B"],
                           [[r["op"], shapes(r["dims"])[:60], r["kind"], _num(r["calls"]), f"{r['device_ms']:.3f}",
                             _pct(r["share"]), _num(r["mean_us"]), r["verdict"], _pct(r.get("pct_roofline")),
                             _num(r.get("ai"))] for r in a["ops"][:top]])
        if a["kernels"]:
            lines += ["### Top kernels", ""]
            lines += _md_table(["kernel", "op", "kind", "calls", "ms", "share", "mean µs", "verdict"] +
                               (["ncu DRAM GB/s", "ncu SM %"] if any("ncu_dram_gbps" in k for k in a["kernels"])
                                else []),
                               [[r["kernel"][:80], r["op"][:40], r["kind"], _num(r["calls"]), f"{r['device_ms']:.3f}",
                                 _pct(r["share"]), _num(r["mean_us"]), r["verdict"]] +
                                ([_num(r.get("ncu_dram_gbps")), _num(r.get("ncu_sm_pct"))]
                                 if any("ncu_dram_gbps" in k for k in a["kernels"]) else [])
                                for r in a["kernels"][:top]])
        mem = a["memory"]
        if mem:
            lines += ["### Memory", ""]
            for dev, m in mem.items():
                if dev == "cuda_stats":
                    lines.append(f"- CUDA allocator: {m['allocated_before_mib']:.0f} MiB allocated before the "
                                 f"profiled steps (weights, cache), peak {m['max_allocated_mib']:.0f} MiB allocated, "
                                 f"{m['max_reserved_mib']:.0f} MiB reserved")
                    continue
                held = "; ".join(f"{h['holder']} {h['mib']:.2f} MiB" for h in m["held_at_peak"][:4])
                lines.append(f"- {dev}: peak {m['peak_mib']:.1f} MiB ({m['peak_over_before_mib']:.1f} MiB over what "
                             f"was allocated before the window), at {m['peak_at_ms']:.2f} ms; allocated in the "
                             f"window and live at the peak: {held or 'none'}")
            lines.append("")
        files = ", ".join(f"[{k}]({_rel(result, v)})" for k, v in p.files.items())
        lines += [f"Files: {files}. `trace.json` opens in Perfetto (ui.perfetto.dev) or chrome://tracing; the "
                  "TensorBoard folder in `tensorboard --logdir` (torch-tb-profiler plugin).", ""]
    if result.compare:
        cmp = result.compare
        lines += [f"## Compare: {cmp['main']} vs {cmp['base']}", ""]
        lines += _md_table(["kind", f"{cmp['base']} ms", f"{cmp['main']} ms", "saved ms"],
                           [[r["kind"], f"{r['base_ms']:.3f}", f"{r['main_ms']:.3f}", f"{r['saved_ms']:+.3f}"]
                            for r in cmp["by_kind"]])
        lines += [f"End to end (no profiler): {cmp['step_ms']['base']:.3f} -> {cmp['step_ms']['main']:.3f} ms, "
                  f"{cmp['speedup']:.2f}x: a difference of {cmp['measured_difference_ms']:.3f} ms = device busy "
                  f"{cmp['busy_difference_ms']:.3f} ms (un-hooked passes) + host / idle "
                  f"{cmp['host_idle_difference_ms']:.3f} ms. The per-kind busy savings ({cmp['saved_by_kind_ms']:.3f} "
                  f"ms; kinds from {cmp['main']}: {cmp['attribution']['main']}; {cmp['base']}: "
                  f"{cmp['attribution']['base']}) account for {_pct(cmp['accounted'])} of the busy difference. "
                  f"{len(cmp['disappeared'])} {cmp['unit']}s of {cmp['base']} do not run in {cmp['main']} "
                  f"({cmp['disappeared_ms']:.3f} ms per step): "
                  + ", ".join(f"`{d['name'][:60]}` {d['base_ms']:.3f} ms" for d in cmp["disappeared"][:6]) + ".", ""]
    lines += ["## Hints", ""] + [f"- {h['advice']} ({h['figure']})" for h in result.hints] + [""]
    pics = [(k, v) for k, v in result.files.items() if v.endswith(".png")]
    if pics:
        lines += ["## Plots", ""] + [f"![{k}]({_rel(result, v)})" for k, v in pics] + [""]
    lines += ["Verdicts: AI = FLOPs / bytes of an op (formulas in fuseinfer/profile/costs.py); compute-bound where AI >= "
              "the ridge point, memory-bound below; launch/latency-bound where the mean call is under 3x the launch "
              "floor and reaches under half its roofline. % of roofline = achieved FLOP/s / min(GEMM rate, AI x "
              "bandwidth).", ""]
    return "\n".join(lines)
