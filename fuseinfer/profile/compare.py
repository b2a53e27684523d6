"""``--compare``: the profiled backend against a second one on the same inputs, side by side.

Per coarse module kind (idle time included, so the rows add up to each step): the baseline's time, the profiled
backend's, and the time saved; which kernels (ops on CPU) disappeared and which are new; the end-to-end ratio of
the unprofiled steps; and how much of the measured (unprofiled) step-time difference the per-kind savings account
for: sum of per-kind savings / (baseline step - profiled backend's step), both unprofiled.
"""
from __future__ import annotations

from collections import Counter

from .trace import COARSE_ORDER


def coarse_times(analysis: dict) -> dict[str, float]:
    """Device ms per step by coarse kind, with the idle time as kind 'idle'."""
    out = Counter()
    for row in analysis["kinds"]:
        out[row["coarse"]] += row["device_ms"]
    out["idle"] += analysis["idle_ms"]
    return dict(out)


def _by_name(analysis: dict) -> dict[str, float]:
    rows = analysis["kernels"] if analysis["kernels"] else analysis["ops"]
    key = "kernel" if analysis["kernels"] else "op"
    out = Counter()
    for r in rows:
        out[r[key]] += r["device_ms"]
    return dict(out)


def compare_profiles(main, base) -> dict:
    """``main`` (the profiled backend) against ``base`` (the --compare one); both BackendProfile."""
    a, b = coarse_times(main.analysis), coarse_times(base.analysis)
    kinds = sorted(set(a) | set(b), key=lambda k: COARSE_ORDER.index(k) if k in COARSE_ORDER else len(COARSE_ORDER))
    rows = [{"kind": k, "base_ms": b.get(k, 0.0), "main_ms": a.get(k, 0.0), "saved_ms": b.get(k, 0.0) - a.get(k, 0.0)}
            for k in kinds]
    saved = sum(r["saved_ms"] for r in rows)
    measured = base.unprofiled_ms["median"] - main.unprofiled_ms["median"]
    names_a, names_b = _by_name(main.analysis), _by_name(base.analysis)
    gone = sorted(((n, ms) for n, ms in names_b.items() if n not in names_a), key=lambda x: -x[1])
    new = sorted(((n, ms) for n, ms in names_a.items() if n not in names_b), key=lambda x: -x[1])
    return {
        "main": main.name, "base": base.name, "unit": main.analysis["unit"],
        "by_kind": rows,
        "step_ms": {"main": main.unprofiled_ms["median"], "base": base.unprofiled_ms["median"]},
        "profiled_step_ms": {"main": main.profiled_ms, "base": base.profiled_ms},
        "speedup": base.unprofiled_ms["median"] / main.unprofiled_ms["median"],
        "saved_by_kind_ms": saved, "measured_difference_ms": measured,
        "accounted": saved / measured if abs(measured) > 1e-9 else None,
        "disappeared": [{"name": n, "base_ms": ms} for n, ms in gone],
        "new": [{"name": n, "main_ms": ms} for n, ms in new],
        "disappeared_ms": sum(ms for _, ms in gone),
    }
