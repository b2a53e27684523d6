"""``--ncu``: the top kernels of a profile again under Nsight Compute, for achieved DRAM bandwidth and SM throughput.

Each kernel is profiled in its own ``ncu`` run of ``python -m fuseinfer.profile.ncu_target`` (the same model,
backend, phase and inputs, a few steps, no torch.profiler), filtered by its name (``--kernel-name regex:``, skipping
the first launches: warm-up) with a small metric set; the figures are added to the kernel rows (``ncu_*`` fields).
"""
from __future__ import annotations

import csv
import io
import shutil
import subprocess
import sys

from fuseinfer.profile.errors import ProfileError

METRICS = ("gpu__time_duration.sum", "dram__bytes.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
           "sm__throughput.avg.pct_of_peak_sustained_elapsed")
TIME_UNITS = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}  # -> µs
BYTE_UNITS = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}
_REGEX_SPECIAL = set(".^$*+?()[]{}|\\")


def ncu_path() -> str:
    """The ncu executable; raises :class:`ProfileError` when Nsight Compute is not on PATH."""
    path = shutil.which("ncu")
    if path is None:
        raise ProfileError("--ncu needs Nsight Compute's `ncu` on PATH (part of the CUDA toolkit: "
                           "export PATH=/usr/local/cuda/bin:$PATH), or drop --ncu")
    return path


def name_regex(kernel: str, limit: int = 80) -> str:
    """An anchored regex matching ``kernel``'s first ``limit`` characters literally."""
    return "^" + "".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in kernel[:limit])


def parse_csv(text: str) -> dict[str, float]:
    """Metric values of the first kernel in ncu's ``--csv`` output, normalised: duration µs, DRAM bytes,
    percentages; plus ``dram_gbps`` = bytes / duration."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    out: dict[str, float] = {}
    for r in rows:
        name, unit = r.get("Metric Name"), r.get("Metric Unit", "")
        try:
            value = float(str(r.get("Metric Value", "")).replace(",", ""))
        except ValueError:
            continue
        if name == "gpu__time_duration.sum" and "duration_us" not in out:
            out["duration_us"] = value * TIME_UNITS.get(unit, 1.0)
        elif name == "dram__bytes.sum" and "dram_bytes" not in out:
            out["dram_bytes"] = value * BYTE_UNITS.get(unit, 1.0)
        elif name == "dram__throughput.avg.pct_of_peak_sustained_elapsed" and "dram_pct" not in out:
            out["dram_pct"] = value
        elif name == "sm__throughput.avg.pct_of_peak_sustained_elapsed" and "sm_pct" not in out:
            out["sm_pct"] = value
    if out.get("duration_us") and "dram_bytes" in out:
        out["dram_gbps"] = out["dram_bytes"] / (out["duration_us"] * 1e-6) / 1e9
    return out


def target_args(settings: dict, backend: str) -> list[str]:
    s = settings
    args = [sys.executable, "-m", "fuseinfer.profile.ncu_target", "--model", s["model"], "--backend", backend,
            "--phase", s["phase"], "--device", s["device"], "--dtype", _dtype_flag(s["dtype"]),
            "--batch-size", str(s["batch_size"]), "--prompt-len", str(s["prompt_len"]), "--gen-len",
            str(s["gen_len"]), "--seed", str(s["seed"])]
    return args


def _dtype_flag(dtype: str) -> str:
    return {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}.get(dtype, dtype)


def run_ncu(result, top: int = 5, timeout_s: int = 300, ui=None) -> list[str]:
    """Adds ncu figures to the top ``top`` kernels of each profile; returns notes (failures, one line each)."""
    exe = ncu_path()
    notes = []
    for p in result.profiles:
        for k in p.analysis["kernels"][:top]:
            cmd = [exe, "--csv", "--page", "details", "--kernel-name-base", "demangled",
                   "--kernel-name", "regex:" + name_regex(k["kernel"]), "--launch-skip", "2", "--launch-count", "1",
                   "--metrics", ",".join(METRICS), *target_args(result.settings, p.name)]
            if ui:
                ui.info(f"ncu: {p.name}: {k['kernel'][:60]}")
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                notes.append(f"ncu timed out on {k['kernel'][:60]}")
                continue
            figures = parse_csv(done.stdout)
            if not figures:
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
                notes.append(f"ncu gave no metrics for {k['kernel'][:60]} (exit {done.returncode}: {tail[0][:120]})")
                continue
            k.update({f"ncu_{key}": v for key, v in figures.items()})
    return notes
