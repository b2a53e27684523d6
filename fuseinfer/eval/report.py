"""Rendering results: the terminal table (rich), ``--output`` JSON, ``--markdown`` report and ``--plot`` figure,
each written atomically by fuseinfer.core.files (never over an earlier file unless told), and ``output_problem``, which
checks before the run that the plot's format can be written."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from fuseinfer.core import files

HEADERS = ("backend", "PPL", "prefill ms", "decode ms/tok", "tok/s", "TFLOP/s", "GB/s", "peak MiB", "1st call s",
           "notes")
LEGEND = ("prefill ms, decode ms/tok: median (speedup = eager time / this time) over [p10-p90] of the timed runs "
          "after warm-up; TFLOP/s: prefill; GB/s: weights + KV cache read per decode step / its time (% of the "
          "measured copy bandwidth); peak MiB: max allocated/reserved while timing; 1st call s: first prefill / "
          "first decode steps, compilation included")


def _num(value: float | None, missing: str = "-") -> str:
    """Three significant digits, without exponents: 0.00234, 2.46, 47.3, 2160."""
    if value is None:
        return missing
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _timing(stats: dict | None, speedup: float | None) -> str:
    """'median (speedup x) [p10-p90]' in ms; narrow tables wrap it at the spaces."""
    if not stats:
        return "-"
    ratio = f" ({speedup:.2f}x)" if speedup is not None else ""
    return f"{_num(stats['median'])}{ratio} [{_num(stats['p10'])}-{_num(stats['p90'])}]"


def _ppl(row: dict) -> str:
    if row.get("ppl") is None:
        return "n/a" if row.get("ppl_note") else "-"
    return f"{row['ppl']:.3f}"


def _kernels(row: dict) -> str | None:
    """'all cuda', or 'cuda: attention, linear; reference: qkv', from the patch report's op -> backends."""
    by_backend: dict[str, list[str]] = {}
    for op, backends in (row.get("patch_backends") or {}).items():
        for backend in backends:
            by_backend.setdefault(backend, []).append(op)
    if len(by_backend) == 1:
        return f"all {next(iter(by_backend))}"
    return "; ".join(f"{b}: {', '.join(ops)}" for b, ops in sorted(by_backend.items())) or None


def _notes(row: dict) -> str:
    notes = [row["error"]] if row.get("error") else []
    kernels = _kernels(row)
    if kernels:
        notes.append(f"kernels: {kernels}")
    for key in ("w8a8_gemm", "fp8_gemm"):  # which GEMM the quantized linears ran, and the fix when it is slow
        if row.get(key):
            notes.append(row[key])
    match = row.get("greedy_match_eager")
    if match is not None and match < 1:
        notes.append(f"greedy tokens = eager's: {match:.0%}")
    return "; ".join(notes)


def row_cells(row: dict) -> list[str]:
    """One backend's table cells, in ``HEADERS`` order."""
    memory = row.get("peak_memory") or {}
    alloc, reserved = memory.get("max_allocated_mib"), memory.get("max_reserved_mib")
    first = row.get("first_call_s") or {}
    bw = _num(row.get("decode_gbps"))
    if row.get("decode_bw_fraction") is not None:
        bw += f" ({row['decode_bw_fraction']:.0%})"
    return [
        row["name"],
        _ppl(row),
        _timing(row.get("prefill_ms"), row.get("speedup_prefill")),
        _timing(row.get("decode_ms_per_token"), row.get("speedup_decode")),
        _num(row.get("tokens_per_s")),
        _num(row.get("prefill_tflops")),
        bw,
        "n/a" if alloc is None else f"{alloc:.0f}/{reserved:.0f}",
        f"{first['prefill']:.2f}/{first['decode']:.2f}" if first else "-",
        _notes(row),
    ]


def _title(results: dict) -> str:
    env, s = results["environment"], results["settings"]
    where = env["gpu"] or f"CPU ({env['cpu_threads']} threads)"
    latency = "" if s.get("skip_latency") else f", prompt {s['prompt_len']}, decode {s['gen_len']} tokens"
    return f"fuseinfer.eval: {results['model']['spec']} on {where}, {s['dtype']}, batch {s['batch_size']}{latency}"


def settings_lines(results: dict) -> list[str]:
    """Plain-text lines describing the settings, environment, data and measured ceilings."""
    env, s, data = results["environment"], results["settings"], results["data"]
    lines = [
        "settings: " + ", ".join(f"{k}={v}" for k, v in s.items()),
        f"environment: GPU {env['gpu'] or 'none'} (driver {env['driver'] or 'n/a'}), CUDA {env['cuda']}, "
        f"torch {env['torch']}, transformers {env['transformers']}, fuseinfer {env['fuseinfer']} "
        f"(extension: {env['fuseinfer_extension']}), python {env['python']}"
        + "".join(f", {k}={v}" for k, v in (env.get("switches") or {}).items()),
    ]
    if data:
        lines.append(f"data: {data['source']}, {data['rows']} rows, {data['chars']:,} chars, {data['tokens']:,} "
                     f"tokens, {data['windows']} windows of {data['seq_len']} ({data['protocol']} protocol"
                     + (f", stride {data['stride']}" if data["stride"] else "") + ")")
    else:
        lines.append(f"perplexity: {results['ppl_note']}")
    lines += [f"warning: {w}" for w in results.get("warnings", [])]
    if results["copy_gbps"]:
        lines.append(f"device copy bandwidth measured in this run: {results['copy_gbps']:.0f} GB/s (read + write)")
    lines.append(LEGEND)
    return lines


def print_table(results: dict, console: Console | None = None) -> None:
    """The results table on the terminal."""
    console = console or Console()
    table = Table(title=_title(results), title_justify="left", show_lines=True)
    for header in HEADERS:
        table.add_column(header, overflow="fold", justify="left" if header in ("backend", "notes") else "right")
    for row in results["backends"].values():
        style = None if row["status"] == "ok" else "red"
        table.add_row(*(Text(cell) for cell in row_cells(row)), style=style)
    console.print(table)
    for line in settings_lines(results)[1:]:
        console.print(line, style="dim", markup=False, highlight=False)


def write_json(results: dict, path: str, overwrite: bool = False) -> None:
    files.write_text(path, json.dumps(results, indent=2) + "\n", overwrite=overwrite, flag="--output")


def write_markdown(results: dict, path: str, overwrite: bool = False) -> None:
    """The same table as the terminal's, with the settings and environment."""
    lines = [f"# {_title(results)}", ""] + [f"- {line}" for line in settings_lines(results)] + [""]
    lines += ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    for row in results["backends"].values():
        cells = (cell.replace("|", "\\|") for cell in row_cells(row))
        lines.append("| " + " | ".join(cells) + " |")
    files.write_text(path, "\n".join(lines) + "\n", overwrite=overwrite, flag="--markdown")


def write_plot(results: dict, path: str, overwrite: bool = False) -> None:
    """Prefill latency, decode ms/token (bars: median, whiskers: p10-p90) and peak memory per backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(results["backends"].values())
    names = [r["name"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, label in ((axes[0], "prefill_ms", "prefill ms"), (axes[1], "decode_ms_per_token", "decode ms/token")):
        stats = [r.get(key) or {"median": 0, "p10": 0, "p90": 0} for r in rows]
        medians = [st["median"] for st in stats]
        errors = [[m - st["p10"] for m, st in zip(medians, stats)], [st["p90"] - m for m, st in zip(medians, stats)]]
        ax.bar(names, medians, yerr=errors, capsize=4, color="tab:blue")
        ax.set_title(label)
    memory = [r.get("peak_memory") or {} for r in rows]
    if any("max_allocated_mib" in m for m in memory):
        x = range(len(rows))
        axes[2].bar([i - 0.2 for i in x], [m.get("max_allocated_mib", 0) for m in memory], 0.4, label="allocated")
        axes[2].bar([i + 0.2 for i in x], [m.get("max_reserved_mib", 0) for m in memory], 0.4, label="reserved")
        axes[2].set_xticks(list(x), names)
        axes[2].legend()
    else:
        axes[2].set_axis_off()
        axes[2].text(0.5, 0.5, "n/a (no GPU)", ha="center", va="center", transform=axes[2].transAxes)
    axes[2].set_title("peak memory MiB")
    fig.suptitle(_title(results), fontsize=9)
    fig.tight_layout()
    try:
        with files.atomic_file(path, overwrite=overwrite, flag="--plot") as tmp:  # tmp keeps the suffix
            fig.savefig(tmp, dpi=120)
    finally:
        plt.close(fig)


def output_problem(path: str, plot: bool = False) -> str | None:
    """Why ``write_plot`` (``plot``) cannot write ``path``'s format and what to do, or None (whether the path
    itself can be written is :func:`fuseinfer.core.files.check_writable`'s question)."""
    if not plot:
        return None
    if importlib.util.find_spec("matplotlib") is None:
        return "plotting needs matplotlib; pip install matplotlib, or drop --plot"
    from matplotlib.backend_bases import FigureCanvasBase

    suffix = Path(path).suffix.lstrip(".").lower()  # savefig picks the format from it, png without one
    if suffix and suffix not in FigureCanvasBase.get_supported_filetypes():
        return f"matplotlib cannot write .{suffix} files; use .png"
    return None
