"""``--compare``: the profiled backend against a second one on the same inputs, side by side.

Per coarse module kind (busy time, from each backend's attribution pass): the baseline's time, the profiled
backend's, and the time saved; which kernels (ops on CPU) disappeared and which are new; the end-to-end ratio of
the unprofiled steps; how much of the device busy-time difference (un-hooked passes) the per-kind savings account
for; and the host / idle difference (unprofiled step difference - busy difference) on its own line.
"""
from __future__ import annotations

from collections import Counter

from fuseinfer.profile.trace import COARSE_ORDER


def coarse_times(attribution: dict) -> dict[str, float]:
    """Busy (kernel / op) ms per step by coarse kind, from the attribution pass; idle is not a kind here."""
    out = Counter()
    for row in attribution["kinds"]:
        out[row["coarse"]] += row["device_ms"]
    return dict(out)


def _by_name(analysis: dict) -> dict[str, float]:
    rows = analysis["kernels"] if analysis["kernels"] else analysis["ops"]
    key = "kernel" if analysis["kernels"] else "op"
    out = Counter()
    for r in rows:
        out[r[key]] += r["device_ms"]
    return dict(out)


def compare_profiles(main, base) -> dict:
    """``main`` (the profiled backend) against ``base`` (the --compare one); both BackendProfile.

    Three differences: the unprofiled step (``measured_difference_ms``, wall clock); the device busy time of the
    un-hooked passes (``busy_difference_ms``); and the busy time saved per module kind in the attribution passes
    (``saved_by_kind_ms``), checked against the busy difference (``accounted`` = saved by kind / busy difference).
    The host / idle part of the step difference (step difference - busy difference) is its own line
    (``host_idle_difference_ms``): module kinds cannot account for time the device spends waiting."""
    a, b = coarse_times(main.kinds), coarse_times(base.kinds)
    kinds = sorted(set(a) | set(b), key=lambda k: COARSE_ORDER.index(k) if k in COARSE_ORDER else len(COARSE_ORDER))
    rows = [{"kind": k, "base_ms": b.get(k, 0.0), "main_ms": a.get(k, 0.0), "saved_ms": b.get(k, 0.0) - a.get(k, 0.0)}
            for k in kinds]
    saved = sum(r["saved_ms"] for r in rows)
    measured = base.step_ms - main.step_ms
    busy = base.busy_ms - main.busy_ms
    names_a, names_b = _by_name(main.analysis), _by_name(base.analysis)
    gone = sorted(((n, ms) for n, ms in names_b.items() if n not in names_a), key=lambda x: -x[1])
    new = sorted(((n, ms) for n, ms in names_a.items() if n not in names_b), key=lambda x: -x[1])
    return {
        "main": main.name, "base": base.name, "unit": main.analysis["unit"],
        "by_kind": rows,
        "attribution": {"main": (main.attribution or {}).get("label", "un-hooked pass"),
                        "base": (base.attribution or {}).get("label", "un-hooked pass")},
        "step_ms": {"main": main.step_ms, "base": base.step_ms},
        "busy_ms": {"main": main.busy_ms, "base": base.busy_ms},
        "profiled_step_ms": {"main": main.profiled_ms, "base": base.profiled_ms},
        "speedup": base.step_ms / main.step_ms,
        "saved_by_kind_ms": saved, "measured_difference_ms": measured, "busy_difference_ms": busy,
        "host_idle_difference_ms": measured - busy,
        "accounted": saved / busy if abs(busy) > 1e-9 else None,
        "disappeared": [{"name": n, "base_ms": ms} for n, ms in gone],
        "new": [{"name": n, "main_ms": ms} for n, ms in new],
        "disappeared_ms": sum(ms for _, ms in gone),
    }
