"""PNG figures (matplotlib, Agg): time by module kind stacked per backend, and a roofline scatter of the ops."""
from __future__ import annotations

from pathlib import Path

from fuseinfer.profile.compare import coarse_times
from fuseinfer.profile.trace import COARSE_ORDER


def _times(p) -> dict:
    """Busy ms by coarse kind (attribution pass) plus the un-hooked pass's idle, so a bar is the profiled step."""
    return {**coarse_times(p.kinds), "idle": p.analysis["idle_ms"]}


def write_plots(result, out: Path) -> dict[str, str]:
    """Writes the figures into ``out``; returns {name: path}; {} without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    files = {}
    # time by coarse kind, one stacked bar per backend
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.7 * len(result.profiles)))
    kinds = [k for k in COARSE_ORDER if any(_times(p).get(k, 0) > 0 for p in result.profiles)]
    cmap = plt.get_cmap("tab10")
    for i, p in enumerate(result.profiles):
        times, left = _times(p), 0.0
        for j, k in enumerate(kinds):
            v = times.get(k, 0.0)
            ax.barh(i, v, left=left, color="lightgrey" if k == "idle" else cmap(j % 10),
                    label=k if i == 0 else None, edgecolor="white")
            left += v
    ax.set_yticks(range(len(result.profiles)), [p.name for p in result.profiles])
    ax.set_xlabel(f"ms per {result.settings['phase']} step ({result.main.analysis['unit']} time; idle in grey)")
    ax.legend(ncol=4, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(result.profiles) < 2 else -0.2))
    ax.set_title(f"{result.settings['model']}: where the {result.settings['phase']} step goes")
    fig.tight_layout()
    files["time_by_kind"] = str(out / "time_by_kind.png")
    fig.savefig(files["time_by_kind"], dpi=120)
    plt.close(fig)
    # roofline: achieved TFLOP/s against arithmetic intensity, marker area ~ time per step
    c = result.ceilings
    fig, ax = plt.subplots(figsize=(7, 5))
    bw = c["copy_gbps"] * 1e9
    xs = [10 ** (e / 10) for e in range(-20, 51)]
    for prec, tf in c["gemm_tflops"].items():
        ax.plot(xs, [min(tf * 1e12, x * bw) / 1e12 for x in xs], lw=1, label=f"roof: {prec} {tf:.3g} TFLOP/s")
    markers = "os^Dv"
    for i, p in enumerate(result.profiles):
        rows = [r for r in p.cost_analysis["ops"] if r.get("ai") and r.get("achieved_tflops") and r["device_ms"] > 0]
        if rows:
            total = sum(r["device_ms"] for r in rows)
            ax.scatter([r["ai"] for r in rows], [r["achieved_tflops"] for r in rows], marker=markers[i % 5],
                       s=[20 + 400 * r["device_ms"] / total for r in rows], alpha=0.6, label=p.name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title(f"roofline (copy {c['copy_gbps']:.3g} GB/s, ceilings measured in this run); area ~ time")
    ax.legend(fontsize=7)
    fig.tight_layout()
    files["roofline"] = str(out / "roofline.png")
    fig.savefig(files["roofline"], dpi=120)
    plt.close(fig)
    # memory timeline of the profiled steps (first backend that has one)
    for p in result.profiles:
        mem = {k: v for k, v in p.analysis["memory"].items() if k != "cuda_stats"}
        if not mem:
            continue
        fig, ax = plt.subplots(figsize=(7, 3))
        for dev, m in mem.items():
            ax.plot([t for t, _ in m["timeline"]], [v for _, v in m["timeline"]], lw=1, label=f"{p.name} {dev}")
        ax.set_xlabel("ms from the first profiled step")
        ax.set_ylabel("allocated MiB")
        ax.legend(fontsize=7)
        fig.tight_layout()
        files[f"memory_{p.name}"] = str(out / f"memory_{p.name}.png")
        fig.savefig(files[f"memory_{p.name}"], dpi=100)
        plt.close(fig)
    return files
