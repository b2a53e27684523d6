"""Reading a profiler trace back (Chrome trace JSON, as ``torch.profiler`` writes it) into per-step tables.

The analysis works from the file the user gets, so what the tables say can be checked against the trace:

* host events (ops, our module and op ranges, CUDA runtime/driver calls, allocator events) are nested per thread
  by time, which gives each one its enclosing module ranges and its top-level op;
* on CUDA each kernel / memcpy / memset is linked by its correlation id to the runtime call that launched it, and so
  to that call's op and module ranges; the unit of time is the kernel's device time. Kernels replayed from a CUDA
  graph link to the graph launch only: they count as "cuda graph replay" (no module ranges run inside a graph);
* on CPU the unit is a top-level op's (inclusive) time.

Per step (``ProfilerStep#N`` ranges, one per profiled step; times are totals over the active steps divided by their
number): an op table (op + input shapes), a kernel table, time by module kind and per decoder layer, the time no
unit covers (device idle on CUDA, host time between ops on CPU), launches, and the memory timeline.
"""
from __future__ import annotations

import bisect
import gzip
import json
import re
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from fuseinfer.profile.costs import cost_of
from fuseinfer.profile.modules import parse_op_range, parse_range

STEP_PREFIX = "ProfilerStep#"
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME_CATS = ("cuda_runtime", "cuda_driver")
GRAPH = "cuda graph replay"
COMPILED = "compiled region"
IDLE = {"cuda": "idle (GPU waits for the host)", "cpu": "outside ops (Python, framework)"}
# the fine kinds of the linears around the attention core and of the MLP's two projections (the names every
# family's ``module_kinds`` maps its modules to)
QKV, ATTN_OUT, MLP_IN, MLP_OUT = "qkv", "attn_out", "mlp_in", "mlp_out"
# fine kind -> the coarse kind plots and --compare use
COARSE = {"embeddings": "embeddings", "projection": "embeddings", QKV: "attention", "attn_core": "attention",
          "attn_other": "attention", ATTN_OUT: "attention", MLP_IN: "mlp", MLP_OUT: "mlp", "activation": "mlp",
          "mlp_other": "mlp", "layernorm": "layernorm", "residual": "residual", "lm_head": "lm_head",
          "other": "other", COMPILED: COMPILED, GRAPH: GRAPH}
COARSE_ORDER = ("embeddings", "attention", "mlp", "layernorm", "residual", "lm_head", "other", COMPILED, GRAPH,
                "idle")
_LEAF = {QKV, ATTN_OUT, MLP_IN, MLP_OUT, "activation", "layernorm", "lm_head", "embeddings", "projection"}
_LINEAR = {"aten::linear": 1, "fuseinfer::linear_epilogue": 1, "aten::addmm": 2, "aten::mm": 1, "aten::matmul": 1}


@dataclass(eq=False)
class HostEvent:
    name: str
    cat: str
    ts: float
    dur: float
    tid: object
    args: dict
    ancestors: tuple = ()
    op: "HostEvent | None" = None  # the top-level op (itself if it is one)
    kernels: list = field(default_factory=list)

    @property
    def end(self) -> float:
        return self.ts + self.dur

    @cached_property
    def op_info(self) -> tuple[str, list, list, list] | None:
        """(op name, dims, dtypes, concrete inputs) if this event is an op: a recorded op or one of our op ranges."""
        if self.cat == "cpu_op":
            a = self.args
            return self.name, a.get("Input Dims") or [], a.get("Input type") or [], a.get("Concrete Inputs") or []
        if self.cat == "user_annotation":
            parsed = parse_op_range(self.name)
            if parsed:
                return parsed[0], parsed[1], parsed[2], parsed[2]
        return None


def load_events(path: str | Path) -> list[dict]:
    """The ``traceEvents`` of a Chrome trace file (.json or .json.gz)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        # torch's trace writer does not escape string arguments in "Concrete Inputs" (e.g. ["", ""relu""]): empty
        # that field (nothing here reads it) and parse again
        data = json.loads(_CONCRETE_INPUTS.sub('"Concrete Inputs": []', text))
    return data["traceEvents"] if isinstance(data, dict) else data


# the whole "Concrete Inputs" field of an event's args, whatever (unescaped) strings it holds, up to the next key
_CONCRETE_INPUTS = re.compile(r'"Concrete Inputs": \[.*?\](?=, "|\s*\})', re.S)


def _is_launch(name: str) -> bool:
    return any(s in name for s in ("LaunchKernel", "GraphLaunch", "Memcpy", "Memset", "cuLaunch"))


def _nest(host: list[HostEvent]) -> None:
    """Sets each event's ancestors (outermost first) from time containment on its thread."""
    by_tid = defaultdict(list)
    for e in host:
        by_tid[e.tid].append(e)
    for events in by_tid.values():
        events.sort(key=lambda e: (e.ts, -e.dur))
        stack: list[HostEvent] = []
        for e in events:
            while stack and stack[-1].end <= e.ts:
                stack.pop()
            e.ancestors = tuple(stack)
            if e.cat != "memory":
                stack.append(e)
    for e in host:
        chain = [*e.ancestors, e]
        e.op = next((a for a in chain if a.op_info is not None), None)


def _path(e: HostEvent) -> list[tuple[str, str, HostEvent]]:
    """The module ranges around an event, outermost first: (kind, qualified name, range event)."""
    out = []
    for a in (*e.ancestors, e):
        if a.cat == "user_annotation":
            parsed = parse_range(a.name)
            if parsed:
                out.append((*parsed, a))
    return out


def _fallback_op(e: HostEvent) -> str:
    """What launched a kernel that no op encloses: a graph replay, a compiled region, or the runtime call."""
    if "GraphLaunch" in e.name:
        return GRAPH
    for a in reversed(e.ancestors):
        if a.cat == "user_annotation" and not parse_range(a.name) and not a.name.startswith(STEP_PREFIX):
            return a.name
    return e.name


def _out_dim(op: str, dims: list) -> tuple[int | None, int | None]:
    """(output features, input features) of a linear-like op from its weight's dims."""
    i = _LINEAR.get(op)
    if i is None and op.startswith("fuseinfer::") and ("linear" in op or "mm" in op):
        i = 1
    if i is None or i >= len(dims) or not isinstance(dims[i], list) or len(dims[i]) != 2:
        return None, None
    w = dims[i]
    return (w[0], w[1]) if op in ("aten::linear", "fuseinfer::linear_epilogue") or op.startswith("fuseinfer::int8") \
        else (w[1], w[0])


def _is_core(op: str) -> bool:
    return any(s in op for s in ("attention", "softmax", "bmm", "matmul", "sdpa", "flash"))


def classify(path: list, op: str, dims: list, hidden: int, ffn: int, seen_core: set) -> str:
    """The fine kind of an op (or of what launched a kernel) from its module ranges, name and shapes. Inside a
    fused attention the linear before the attention core is q/k/v, the one after it the output projection; directly
    inside a (fused) decoder layer a linear to ffn features is the MLP's first projection, one from ffn features its
    second."""
    if op == GRAPH:
        return GRAPH
    if not path:
        return COMPILED if "Compiled" in op or "compiled" in op or "triton" in op else "other"
    inner, _, rng = path[-1]
    if inner in _LEAF:
        return inner
    linear = _out_dim(op, dims)[0] is not None
    if inner == "attention":
        if _is_core(op):
            seen_core.add(id(rng))
            return "attn_core"
        if linear:
            return ATTN_OUT if id(rng) in seen_core else QKV
        return "layernorm" if "layer_norm" in op else "attn_other"
    if inner == "layer":
        if linear:
            out, inp = _out_dim(op, dims)
            return MLP_IN if out == ffn else MLP_OUT if inp == ffn else "mlp_other"
        if "layer_norm" in op:
            return "layernorm"
        if any(s in op for s in ("relu", "gelu", "silu")):
            return "activation"
        return "residual"
    return "other"


def _layer_of(path: list) -> int | None:
    for kind, qual, _ in path:
        if kind == "layer" and qual.rsplit(".", 1)[-1].isdigit():
            return int(qual.rsplit(".", 1)[-1])
    return None


def _shape_key(dims) -> str:
    return json.dumps(dims, separators=(",", ":"))


def analyze(events: list[dict], hidden: int, ffn: int) -> dict:
    """Per-step tables from a trace's events; ``hidden`` and ``ffn`` (the model's sizes) sort fused linears."""
    steps = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                    and str(e.get("name", "")).startswith(STEP_PREFIX)), key=lambda e: e["ts"])
    if not steps:
        raise ValueError("the trace has no ProfilerStep# ranges (no active profiler step was recorded)")
    starts = [float(s["ts"]) for s in steps]
    ends = [float(s["ts"]) + float(s["dur"]) for s in steps]

    def step_of(ts: float) -> int | None:
        i = bisect.bisect_right(starts, ts) - 1
        return i if i >= 0 and ts < ends[i] else None

    host, device, runtime = [], [], {}
    for e in events:
        cat, ph = e.get("cat"), e.get("ph")
        if ph == "X" and cat in ("cpu_op", "user_annotation") + RUNTIME_CATS and not \
                str(e.get("name", "")).startswith(STEP_PREFIX):
            h = HostEvent(e["name"], cat, float(e["ts"]), float(e.get("dur", 0)), (e.get("pid"), e.get("tid")),
                          e.get("args") or {})
            host.append(h)
            if cat in RUNTIME_CATS and "correlation" in h.args:
                runtime[h.args["correlation"]] = h
        elif ph == "X" and cat in DEVICE_CATS:
            device.append(e)
        elif ph == "i" and e.get("name") == "[memory]":
            host.append(HostEvent("[memory]", "memory", float(e["ts"]), 0.0, (e.get("pid"), e.get("tid")),
                                  e.get("args") or {}))
    _nest(host)
    n = len(steps)
    on_cuda = bool(device) or any(h.cat in RUNTIME_CATS for h in host)
    # op instances: top-level ops in a step, plus what launched kernels outside any op
    instances: dict[int, dict] = {}
    seen_core: set = set()

    def instance(key_event: HostEvent, op_event: HostEvent | None, launcher: HostEvent | None) -> dict:
        owner = op_event or launcher
        inst = instances.get(id(owner))
        if inst is None:
            if op_event is not None:
                name, dims, types, concrete = op_event.op_info
            else:
                name, dims, types, concrete = _fallback_op(launcher), [], [], []
            path = _path(owner)
            inst = instances[id(owner)] = {
                "op": name, "dims": dims, "types": types, "concrete": concrete, "ts": owner.ts,
                "host_ms": owner.dur / 1e3 if op_event is not None else 0.0, "device_ms": 0.0, "kernels": 0,
                "kind": classify(path, name, dims, hidden, ffn, seen_core), "layer": _layer_of(path),
                "step": step_of(owner.ts)}
        return inst

    for h in sorted((h for h in host if h.cat != "memory" and h.op is h and step_of(h.ts) is not None
                     and not any(a.op_info for a in h.ancestors)), key=lambda h: h.ts):
        instance(h, h, None)
    units = []  # (start, end, step, inst, kernel name or None)
    if on_cuda:
        for d in device:
            launcher = runtime.get((d.get("args") or {}).get("correlation"))
            ts = float(d["ts"])
            if launcher is None:
                continue  # (a kernel launched outside the profiled steps' host calls)
            step = step_of(launcher.ts)
            if step is None:
                continue
            graph = "GraphLaunch" in launcher.name  # (kernels of a replay: no op or module range runs inside it)
            op_event = None if graph else launcher.op
            inst = instance(launcher, op_event, None if op_event is not None else launcher)
            dur = float(d.get("dur", 0)) / 1e3
            inst["device_ms"] += dur
            inst["kernels"] += 1
            units.append((ts, ts + dur * 1e3, step, inst, d["name"]))
    else:
        for inst in instances.values():
            inst["device_ms"] = inst["host_ms"]
        units = [(i["ts"], i["ts"] + i["device_ms"] * 1e3, i["step"], i, None) for i in instances.values()]

    step_ms = [(e - s) / 1e3 for s, e in zip(starts, ends)]
    busy = _busy_ms(units, n)
    result = {"unit": "kernel" if on_cuda else "op", "steps": n, "step_ms": sum(step_ms) / n, "step_ms_each": step_ms,
              "busy_ms": busy, "idle_ms": max(0.0, sum(step_ms) / n - busy),
              "idle_label": IDLE["cuda" if on_cuda else "cpu"],
              "launches_per_step": (sum(1 for h in host if h.cat in RUNTIME_CATS and _is_launch(h.name)
                                        and step_of(h.ts) is not None) / n) if on_cuda else len(instances) / n,
              "host_op_ms": sum(i["host_ms"] for i in instances.values()) / n,
              "graph_launches_without_kernels": _opaque_graphs(host, device, step_of) / n}
    result["ops"] = _op_table(instances.values(), n, result["step_ms"])
    result["kernels"] = _kernel_table(units, n, result["step_ms"]) if on_cuda else []
    result["kinds"] = _kind_table(instances.values(), n, result["step_ms"])
    result["layers"] = _layer_table(instances.values(), n)
    result["memory"] = memory_timeline([h for h in host if h.cat == "memory"], starts[0])
    return result


def _busy_ms(units: list, n: int) -> float:
    """Time per step covered by at least one unit (the union of their intervals)."""
    total, end = 0.0, -math.inf
    for s, e, *_ in sorted(units, key=lambda u: u[0]):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total / 1e3 / n


def _opaque_graphs(host, device, step_of) -> int:
    """Graph launches in the steps whose kernels the profiler did not report (CUPTI without graph tracing)."""
    linked = {(d.get("args") or {}).get("correlation") for d in device}
    return sum(1 for h in host if h.cat in RUNTIME_CATS and "GraphLaunch" in h.name and step_of(h.ts) is not None
               and h.args.get("correlation") not in linked)


def _op_table(instances, n: int, step: float) -> list[dict]:
    groups: dict[tuple, dict] = {}
    for i in instances:
        key = (i["op"], _shape_key(i["dims"]))
        g = groups.setdefault(key, {"op": i["op"], "dims": i["dims"], "types": i["types"], "calls": 0,
                                    "device_ms": 0.0, "host_ms": 0.0, "kernels": 0, "_kinds": Counter()})
        g["calls"] += 1
        g["device_ms"] += i["device_ms"]
        g["host_ms"] += i["host_ms"]
        g["kernels"] += i["kernels"]
        g["_kinds"][i["kind"]] += i["device_ms"] or 1e-9
        g.setdefault("_concrete", i["concrete"])
    rows = []
    for g in groups.values():
        calls = g["calls"]
        cost = cost_of(g["op"], g["dims"], g["types"], g.pop("_concrete"))
        kind = g.pop("_kinds").most_common(1)[0][0]
        rows.append({**g, "calls": calls / n, "device_ms": g["device_ms"] / n, "host_ms": g["host_ms"] / n,
                     "kernels_per_call": g["kernels"] / calls, "mean_us": g["device_ms"] / calls * 1e3,
                     "share": g["device_ms"] / n / step if step else 0.0, "kind": kind, "coarse": COARSE[kind],
                     "flops_per_call": cost.flops if cost else None, "bytes_per_call": cost.bytes if cost else None,
                     "op_class": cost.op_class if cost else None, "precision": cost.precision if cost else None})
        rows[-1].pop("kernels")
    return sorted(rows, key=lambda r: (-r["device_ms"], -r["host_ms"]))


def _kernel_table(units, n: int, step: float) -> list[dict]:
    groups: dict[str, dict] = {}
    for s, e, _, inst, name in units:
        g = groups.setdefault(name, {"kernel": name, "calls": 0, "device_ms": 0.0, "_ops": Counter(),
                                     "_kinds": Counter(), "_op_keys": Counter()})
        g["calls"] += 1
        ms = (e - s) / 1e3
        g["device_ms"] += ms
        g["_ops"][inst["op"]] += ms
        g["_kinds"][inst["kind"]] += ms
        g["_op_keys"][(inst["op"], _shape_key(inst["dims"]))] += ms
    rows = []
    for g in groups.values():
        op_key = g["_op_keys"].most_common(1)[0][0]
        kind = g.pop("_kinds").most_common(1)[0][0]
        rows.append({"kernel": g["kernel"], "calls": g["calls"] / n, "device_ms": g["device_ms"] / n,
                     "mean_us": g["device_ms"] / g["calls"] * 1e3, "share": g["device_ms"] / n / step if step else 0,
                     "op": g.pop("_ops").most_common(1)[0][0], "op_dims": json.loads(op_key[1]), "kind": kind,
                     "coarse": COARSE[kind]})
    return sorted(rows, key=lambda r: -r["device_ms"])


def _kind_table(instances, n: int, step: float) -> list[dict]:
    device, hostt = Counter(), Counter()
    for i in instances:
        device[i["kind"]] += i["device_ms"] / n
        hostt[i["kind"]] += i["host_ms"] / n
    order = {k: COARSE_ORDER.index(COARSE[k]) for k in device}
    return [{"kind": k, "coarse": COARSE[k], "device_ms": device[k], "host_ms": hostt[k],
             "share": device[k] / step if step else 0.0} for k in sorted(device, key=lambda k: (order[k], k))]


def _layer_table(instances, n: int) -> list[dict]:
    per = Counter()
    for i in instances:
        if i["layer"] is not None:
            per[i["layer"]] += i["device_ms"] / n
    return [{"layer": k, "device_ms": per[k]} for k in sorted(per)]


def memory_timeline(mem: list[HostEvent], t0: float, points: int = 1500) -> dict:
    """Per device: the allocated-bytes timeline of the profiled steps, its peak, what was allocated before them,
    and which module kind / op holds the allocations made in the window that are live at the peak."""
    out = {}
    by_device = defaultdict(list)
    for m in mem:
        a = m.args
        dev = "cuda" if a.get("Device Type") == 1 else "cpu" if a.get("Device Type") == 0 else str(a.get("Device Type"))
        by_device[dev].append(m)
    for dev, events in by_device.items():
        events.sort(key=lambda m: m.ts)
        totals = [float(m.args.get("Total Allocated", 0)) for m in events]
        peak_i = max(range(len(totals)), key=totals.__getitem__)
        live: dict = {}
        for m in events[:peak_i + 1]:
            b, addr = float(m.args.get("Bytes", 0)), m.args.get("Addr")
            if b > 0:
                live[addr] = (b, _holder(m))
            else:
                live.pop(addr, None)
        holders = Counter()
        for b, who in live.values():
            holders[who] += b
        before = totals[0] - float(events[0].args.get("Bytes", 0))
        stride = max(1, len(events) // points)
        out[dev] = {"peak_mib": totals[peak_i] / 2**20, "before_window_mib": before / 2**20,
                    "peak_over_before_mib": (totals[peak_i] - before) / 2**20,
                    "peak_at_ms": (events[peak_i].ts - t0) / 1e3,
                    "held_at_peak": [{"holder": k, "mib": v / 2**20} for k, v in holders.most_common(8)],
                    "timeline": [[(m.ts - t0) / 1e3, t / 2**20] for m, t in zip(events[::stride], totals[::stride])]}
    return out


def _holder(m: HostEvent) -> str:
    path = _path(m)
    where = f"{path[-1][0]} {path[-1][1]}" if path else "outside modules"
    op = m.op.op_info[0] if m.op is not None else "-"
    return f"{where} / {op}"
