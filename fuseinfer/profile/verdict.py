"""Roofline verdicts: is an op compute-bound, memory-bound, or too short to reach either ceiling?

For an op with a cost (costs.py), per call: arithmetic intensity AI = FLOPs / bytes; the ridge point R = GEMM rate /
copy bandwidth (ceilings.py, measured in the same run); the roofline (attainable FLOP/s) = min(GEMM rate, AI x
bandwidth); achieved = FLOPs / mean device time; % of roofline = achieved / attainable (the same as
bytes / time / bandwidth for a memory-bound op).

* ``launch/latency-bound``: the mean call takes less than ``LATENCY_FLOORS`` x the measured launch floor and
  reaches under ``LATENCY_FRACTION`` of its roofline: fixed costs (launch, ramp-up, tail) dominate the work;
* else ``compute-bound`` where AI >= R, ``memory-bound`` where AI < R.

Ops without a cost model get ``latency-bound`` by the time rule alone, else ``no cost model``.
"""
from __future__ import annotations

from fuseinfer.profile.ceilings import peak_tflops, ridge

LATENCY_FLOORS = 3.0
LATENCY_FRACTION = 0.5


def verdict(row: dict, ceilings: dict) -> dict:
    """Verdict fields for one op-table row (``flops_per_call``, ``bytes_per_call``, ``precision``, ``mean_us``)."""
    floor = ceilings["launch_floor_us"]
    short = row["mean_us"] < LATENCY_FLOORS * floor
    flops, nbytes = row.get("flops_per_call"), row.get("bytes_per_call")
    if flops is None or not nbytes or row["mean_us"] <= 0:
        return {"verdict": "launch/latency-bound" if short and row["mean_us"] > 0 else "no cost model",
                "ai": None, "ridge": None, "achieved_tflops": None, "achieved_gbps": None, "pct_roofline": None}
    peak = peak_tflops(ceilings, row.get("precision")) * 1e12  # FLOP/s
    bw = ceilings["copy_gbps"] * 1e9  # B/s
    ai = flops / nbytes
    seconds = row["mean_us"] * 1e-6
    attainable = min(peak, ai * bw)
    achieved = flops / seconds
    fraction = achieved / attainable if attainable > 0 else (nbytes / seconds) / bw
    r = ridge(ceilings, row.get("precision"))
    if short and fraction < LATENCY_FRACTION:
        kind = "launch/latency-bound"
    else:
        kind = "compute-bound" if ai >= r else "memory-bound"
    return {"verdict": kind, "ai": ai, "ridge": r, "achieved_tflops": achieved / 1e12,
            "achieved_gbps": nbytes / seconds / 1e9, "pct_roofline": fraction}


def add_verdicts(analysis: dict, ceilings: dict) -> None:
    """Verdicts on every op row, and on each kernel row: its op's verdict where that kernel is most of its op's
    time (a GEMM op launching one GEMM kernel), else the time rule alone."""
    by_op = {}
    for row in analysis["ops"]:
        row.update(verdict(row, ceilings))
        by_op.setdefault(row["op"], []).append(row)
    for k in analysis.get("kernels", []):
        candidates = [r for r in by_op.get(k["op"], []) if r["dims"] == k.get("op_dims")]
        op_row = candidates[0] if candidates else None
        if op_row is not None and op_row["device_ms"] > 0 and k["device_ms"] >= 0.8 * op_row["device_ms"]:
            k.update({f: op_row.get(f) for f in ("verdict", "ai", "ridge", "pct_roofline", "op_class")})
        else:
            short = k["mean_us"] < LATENCY_FLOORS * ceilings["launch_floor_us"]
            k.update(verdict="launch/latency-bound" if short else "no cost model", ai=None, ridge=None,
                     pct_roofline=None, op_class=None)


def verdict_table(analysis: dict) -> list[dict]:
    """Time per (op class, verdict): the summary the issue asks for (GEMMs at prefill compute-bound, ...)."""
    table: dict[tuple, dict] = {}
    for row in analysis["ops"]:
        if row["device_ms"] <= 0:
            continue
        key = (row.get("op_class") or "-", row["verdict"])
        t = table.setdefault(key, {"op_class": key[0], "verdict": key[1], "device_ms": 0.0, "share": 0.0,
                                   "_weighted": 0.0, "_w": 0.0})
        t["device_ms"] += row["device_ms"]
        t["share"] += row["share"]
        if row.get("pct_roofline") is not None:
            t["_weighted"] += row["pct_roofline"] * row["device_ms"]
            t["_w"] += row["device_ms"]
    out = []
    for t in sorted(table.values(), key=lambda t: -t["device_ms"]):
        w = t.pop("_w")
        t["pct_roofline"] = t.pop("_weighted") / w if w else None  # time-weighted mean
        out.append(t)
    return out
