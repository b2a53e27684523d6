"""The op tables of an ONNX Runtime backend (``ort``, ``ort-plain``) from ONNX Runtime's own profiler.

torch.profiler sees an ORT step as one opaque call (ORT's nodes are not torch ops) and the backend has no torch
modules, so the per-op, per-kind and per-layer tables come from ``SessionOptions.enable_profiling`` instead: a
session with profiling on runs the same steps, and its JSON trace's node events (``<node>_kernel_time``, with the
op type, execution provider and input / output shapes) of the active steps' runs (``model_run`` events) become the
rows the torch tables have (op, dims, calls, ms per step, kind, FLOPs / bytes for matrix products).

On the CPU provider a node's time is the op's own time. On the CUDA provider it is the host side of the node (the
launches and any synchronous work; kernels run asynchronously): the kernel table (CUPTI, which sees ORT's kernels
in this process) keeps the device times there, and the op rows report the node times as host time.

Kinds come from op types and shapes, in run order: attention ops, layer norms, activations, embedding gathers, and
matrix products by their sizes and roles (to ``ffn`` features: the MLP's input projection, from ``ffn``: its output
projection, to the vocabulary: the LM head, to 3 x hidden: fused q/k/v, hidden to hidden: q/k/v before the layer's
attention op, the attention output after it), named by the model family (``ModelFamily.ort_matmul_kinds``); each
MLP output projection ends a decoder layer, which gives the layer table.
"""
from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

from fuseinfer.models import family
from fuseinfer.profile.costs import cost_of
from fuseinfer.profile.trace import COARSE, COARSE_ORDER

ATTENTION = {"MultiHeadAttention", "Attention", "GroupQueryAttention", "Softmax", "PackedAttention"}
NORMS = {"LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization",
         "SkipSimplifiedLayerNormalization"}
ACTIVATIONS = {"Relu", "Gelu", "FastGelu", "BiasGelu", "QuickGelu", "Sigmoid"}
MATMULS = {"MatMul", "FusedMatMul", "Gemm", "MatMulNBits", "MatMulInteger"}
# ORT's element type names -> the torch profiler's (costs.py's ELEMENT_SIZE / PRECISION keys)
TORCH_TYPES = {"float": "float", "float16": "c10::Half", "bfloat16": "c10::BFloat16", "double": "double",
               "int8": "signed char", "uint8": "unsigned char", "int64": "long int", "int32": "int", "bool": "bool"}
IDLE_LABEL = "outside ORT nodes (IO binding, session overhead, Python)"


def runs_ort(backend) -> bool:
    """Whether the backend runs an ONNX Runtime session (``OrtDecoder``) that a profiling one can replace."""
    return getattr(backend, "ort", None) is not None and hasattr(backend, "directory")


def _shapes(typed: list) -> tuple[list, list]:
    """([dims per tensor], [torch dtype name per tensor]) of ORT's ``input_type_shape`` / ``output_type_shape``."""
    dims, types = [], []
    for entry in typed or []:
        (name, shape), = entry.items()
        dims.append(list(shape))
        types.append(TORCH_TYPES.get(name, name))
    return dims, types


class _Kinds:
    """Gives each node of one run its kind and decoder layer, in run order (see the module docstring)."""

    def __init__(self, hidden: int, ffn: int, vocab: int | None, layers: int | None, names: dict[str, str],
                 qkv_width: int | None = None):
        self.hidden, self.ffn, self.vocab, self.layers, self.names = hidden, ffn, vocab, layers, names
        self.qkv_width = qkv_width or 3 * hidden  # the fused q/k/v product's width ((H + 2 Hkv) D with grouped heads)
        self.layer, self.attended = 0, False

    def __call__(self, op: str, dims: list, out: list) -> tuple[str, int | None]:
        # (after the last layer's MLP: the final layer norm and the head, in no layer)
        layer = self.layer if self.layers is None or self.layer < self.layers else None
        if op in ATTENTION:
            self.attended = True
            return "attn_core", layer
        if op in NORMS:
            return "layernorm", layer
        if op in ACTIVATIONS:
            return "activation", layer
        if op == "Gather" and dims and len(dims[0]) == 2 and dims[0][1] == self.hidden:
            return "embeddings", None
        if op in MATMULS and dims and out and dims[0] and out[0]:
            k, n = dims[0][-1], out[0][-1]
            names = self.names
            if self.vocab is not None and n == self.vocab:
                return names["head"], None
            if n in (self.ffn, 2 * self.ffn):  # (2F: gate and up as one product)
                return names["mlp_in"], layer
            if k == self.ffn:
                self.layer, self.attended = self.layer + 1, False
                return names["mlp_out"], layer
            if n == self.qkv_width:
                return names["qkv"], layer
            if k == n == self.hidden:
                return names["out" if self.attended else "qkv"], layer
        return "other", None


def _matmul_cost(dims: list, types: list, out: list):
    """The cost of a matrix product node as a (M, K) x (K, N) aten::mm of its activation's dtype."""
    if not dims or not out or not dims[0] or not out[0]:
        return None
    k, n = dims[0][-1], out[0][-1]
    m = 1
    for d in dims[0][:-1]:
        m *= d
    t = types[0] if types else "float"
    return cost_of("aten::mm", [[m, k], [k, n]], [t, t])


def analyze_ort(path: str | Path, runs: int, steps: int, hidden: int, ffn: int, vocab: int | None = None,
                layers: int | None = None, on_cuda: bool = False, *, model_type: str,
                qkv_width: int | None = None) -> dict:
    """Tables of the last ``runs`` session runs of ORT's profile ``path`` of a ``model_type`` model (its family
    names the matrix products' kinds), per step (``steps`` steps made them):
    ``ops`` (the torch op table's fields), ``kinds``, ``layers``, ``busy_ms`` (node time per step) and ``run_ms``
    (ORT's own time per step, node gaps included)."""
    events = json.loads(Path(path).read_text())
    model_runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])[-runs:]
    if not model_runs or runs < 1:
        raise ValueError(f"ONNX Runtime's profile {path} has no model_run event for the profiled steps")
    starts = [(r["ts"], r["ts"] + r["dur"]) for r in model_runs]
    nodes = sorted((e for e in events if e.get("cat") == "Node" and str(e.get("name", "")).endswith("_kernel_time")
                    and any(s <= e["ts"] <= end for s, end in starts)), key=lambda e: e["ts"])
    names = family(model_type).ort_matmul_kinds()
    groups: dict[tuple, dict] = {}
    kinds_ms, layers_ms = Counter(), Counter()
    run_index, kinds = -1, None
    for e in nodes:
        i = next(j for j, (s, end) in enumerate(starts) if s <= e["ts"] <= end)
        if i != run_index:  # a new run: layers count from 0 again
            run_index, kinds = i, _Kinds(hidden, ffn, vocab, layers, names, qkv_width)
        args = e.get("args") or {}
        op = args.get("op_name", "?")
        dims, types = _shapes(args.get("input_type_shape"))
        out, _ = _shapes(args.get("output_type_shape"))
        kind, layer = kinds(op, dims, out)
        ms = float(e.get("dur", 0)) / 1e3
        key = (f"ort::{op}", json.dumps(dims), json.dumps(out), args.get("provider", ""))
        g = groups.setdefault(key, {"op": key[0], "dims": dims, "out_dims": out, "types": types, "calls": 0,
                                    "ms": 0.0,
                                    "provider": key[3].replace("ExecutionProvider", ""), "_kinds": Counter(),
                                    "_cost": _matmul_cost(dims, types, out) if op in MATMULS else None})
        g["calls"] += 1
        g["ms"] += ms
        g["_kinds"][kind] += ms or 1e-9
        kinds_ms[kind] += ms
        if layer is not None:
            layers_ms[layer] += ms
    busy = sum(g["ms"] for g in groups.values()) / steps
    run_ms = sum(r["dur"] for r in model_runs) / 1e3 / steps
    rows = []
    for g in groups.values():
        kind, cost, ms = g.pop("_kinds").most_common(1)[0][0], g.pop("_cost"), g.pop("ms")
        device = 0.0 if on_cuda else ms / steps
        rows.append({**g, "calls": g["calls"] / steps, "device_ms": device, "host_ms": ms / steps,
                     "kernels_per_call": 0.0, "mean_us": ms / g["calls"] * 1e3,
                     "share": device / run_ms if run_ms else 0.0, "kind": kind, "coarse": COARSE[kind],
                     "flops_per_call": cost.flops if cost else None, "bytes_per_call": cost.bytes if cost else None,
                     "op_class": cost.op_class if cost else None, "precision": cost.precision if cost else None})
    rows.sort(key=lambda r: (-r["device_ms"], -r["host_ms"]))
    order = {k: COARSE_ORDER.index(COARSE[k]) for k in kinds_ms}
    kind_rows = [{"kind": k, "coarse": COARSE[k], "device_ms": 0.0 if on_cuda else kinds_ms[k] / steps,
                  "host_ms": kinds_ms[k] / steps, "share": 0.0 if on_cuda or not run_ms else kinds_ms[k] / steps / run_ms}
                 for k in sorted(kinds_ms, key=lambda k: (order[k], k))]
    return {"ops": rows, "kinds": kind_rows, "layers": [{"layer": k, "device_ms": layers_ms[k] / steps}
                                                         for k in sorted(layers_ms)],
            "busy_ms": busy, "run_ms": run_ms, "runs_per_step": len(model_runs) / steps}


def start_profiling(backend, folder: Path) -> None:
    """Replace the backend's ORT session by one with ONNX Runtime's profiler on: the same export, device and dtype;
    the old session is dropped first, so the weights are held once. Call before the backend's ``start``."""
    import gc

    from fuseinfer.export.ort_runtime import OrtDecoder

    device, dtype = backend.ort.device, backend.ort.dtype
    backend.ort = None
    gc.collect()
    backend.ort = OrtDecoder(backend.directory, device, dtype=dtype, profile_prefix=str(folder / "ort_profile"))


def stop_profiling(backend, folder: Path) -> Path:
    """End ORT's profile of the session :func:`start_profiling` made; returns its JSON, moved into ``folder``."""
    written = Path(backend.ort.end_profiling())
    target = folder / "ort_profile.json"
    written.replace(target)
    return target


def merge(analysis: dict, ort: dict, on_cuda: bool) -> list[str]:
    """Put ORT's tables into the torch pass's ``analysis`` (op rows, and on CPU kinds, layers and busy time);
    returns the notes that say so."""
    analysis["ops"] = ort["ops"]
    analysis["ort_run_ms"] = ort["run_ms"]
    if on_cuda:
        return ["ONNX Runtime runs the graph: the op table is ORT's own profile (SessionOptions.enable_profiling), "
                "whose CUDA node times are host time (launch and synchronous work; shown as host ms); the kernel "
                "table has the device times; there are no torch modules to attribute time to"]
    analysis.update(kinds=ort["kinds"], layers=ort["layers"], unit="ORT node", busy_ms=ort["busy_ms"],
                    idle_ms=max(0.0, analysis["step_ms"] - ort["busy_ms"]), idle_label=IDLE_LABEL)
    return ["ONNX Runtime runs the graph: the op, kind and layer tables are ORT's own per-node profile of the "
            "profiled steps (SessionOptions.enable_profiling), kinds read from op types and shapes; there are no "
            "torch modules to attribute time to"]
