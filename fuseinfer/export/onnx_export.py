"""``to_onnx(model, out_dir, ...)``: trace the model family's export graph (see graph.py) into an ONNX directory.

Exporter: the TorchScript one (``torch.onnx.export(..., dynamo=False)``). Why not ``dynamo=True``: the fused
flavour needs contrib ops, which the TorchScript exporter takes from each ``autograd.Function.symbolic`` in the
same pass, while the dynamo exporter would need each one registered as a ``torch.library`` custom op plus an
onnxscript translation table entry; and ``torch.export`` specialises sizes 0 and 1, so a prefill graph (past
length 0) and a decode graph (one new token) traced from one example would need care with every dynamic dim.
The TorchScript exporter records ``tensor.shape`` reads as Shape ops, so batch, sequence and past lengths stay
dynamic. It is deprecated but present in torch 2.11 and 2.13 (the versions we run); it prints a
DeprecationWarning, which this module silences.

Layout of the directory (written by :func:`fuseinfer.core.files.atomic_dir`: a temporary sibling renamed into place at
the end, so a failure or a kill leaves nothing; ``--overwrite`` replaces only an earlier export or an empty folder):
``model.onnx`` (graph), ``model.onnx.data`` (every weight over 1 KiB, external data: no 2 GiB protobuf limit)
and ``fuseinfer_onnx.json`` (see manifest.py).
"""
from __future__ import annotations

import copy
import os
import shutil
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

from fuseinfer.core import files
from fuseinfer.models.base import ExportSpec
from fuseinfer.export import manifest as mf
from fuseinfer.export.errors import ExportError
from fuseinfer.export.graph import FLAVOURS, DecoderGraph
from fuseinfer.models import family, supported

OPSET = 17  # LayerNormalization is a standard op from 17; onnxruntime 1.17+ reads it


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    past = [f"past_{kv}_{i}" for i in range(num_layers) for kv in ("key", "value")]
    present = [f"present_{kv}_{i}" for i in range(num_layers) for kv in ("key", "value")]
    return ["input_ids", "attention_mask", "num_logits_to_keep"] + past, ["logits"] + present


def _io_spec(num_layers, heads, head_dim, vocab, dtype_name):
    """``heads``: the past / present tensors' (the key/value heads of grouped-query attention)."""
    kv = ["batch", heads, "past_sequence", head_dim]
    present = ["batch", heads, "past_sequence + sequence", head_dim]
    inputs = [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"]},
              {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "past_sequence + sequence"],
               "meaning": "1 for a token, 0 for padding (left padding as in generation)"},
              {"name": "num_logits_to_keep", "dtype": "int64", "shape": [1],
               "meaning": "0: logits for every position; n: for the last n (prefill: 1)"}]
    outputs = [{"name": "logits", "dtype": dtype_name, "shape": ["batch", "sequence or n", vocab]}]
    for i in range(num_layers):
        for name in ("key", "value"):
            inputs.append({"name": f"past_{name}_{i}", "dtype": dtype_name, "shape": kv})
            outputs.append({"name": f"present_{name}_{i}", "dtype": dtype_name, "shape": present})
    return inputs, outputs


def check_model(model) -> ExportSpec:
    """The sizes of ``model``'s export graph; ExportError unless its family has one for it."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    fam = family(kind)
    if fam is None:
        raise ExportError(f"fuseinfer.export exports causal LMs of the families it knows ({supported()}), got a "
                          f"{kind or type(model).__name__!r} model; use optimum's exporter for other families")
    try:
        return fam.export_spec(model)
    except NotImplementedError as exc:
        raise ExportError(str(exc)) from None


def check_out_dir(out_dir, overwrite: bool) -> None:
    """Raise ExportError unless ``out_dir`` can take an export: absent, empty, or (with ``overwrite``) an earlier
    export; its parent writable. Nothing is created."""
    try:
        files.check_writable(out_dir, folder=True, marker=mf.MANIFEST, overwrite=overwrite)
    except files.WriteError as exc:
        raise ExportError(str(exc)) from None


def _example(spec: ExportSpec, device, dtype):
    """Inputs to trace with: batch 2, 3 new tokens after 2 cached ones (no size 0 or 1, which a tracer could
    mistake for a constant)."""
    ids = torch.full((2, 3), 4, dtype=torch.long, device=device)
    mask = torch.ones(2, 5, dtype=torch.long, device=device)
    keep = torch.zeros(1, dtype=torch.long, device=device)
    past = [torch.zeros(2, spec.cache_heads, 2, spec.head_dim, dtype=dtype, device=device)
            for _ in range(2 * spec.layers)]
    return (ids, mask, keep, *past)


def to_onnx(model, out_dir, flavour: str = "fused", dtype: torch.dtype | None = None,
            device: str | torch.device | None = None, overwrite: bool = False, opset: int = OPSET,
            source: str | None = None, memo: dict | None = None) -> dict:
    """Export a causal LM (of a family with an export graph: OPT, Llama, Mistral, Qwen2) to ``out_dir``; returns the
    manifest (also written as fuseinfer_onnx.json).

    ``dtype`` / ``device``: export in that dtype on that device (default: the model's). The model itself is
    never changed: a model in another dtype or on another device is copied first. ``source``: how the model was
    named (recorded in the manifest). ``memo``: the weights hashes already taken of this model
    (``manifest.model_hash``), so an eval that checked for a reusable export does not hash it again.
    """
    spec = check_model(model)
    if flavour not in FLAVOURS:
        raise ExportError(f"unknown flavour {flavour!r}: choose from {', '.join(FLAVOURS)}")
    if dtype is not None and dtype not in mf.DTYPE_NAMES:
        raise ExportError(f"unsupported dtype {dtype}: use torch.float16 or torch.float32")
    out_dir = Path(out_dir).expanduser().absolute()
    check_out_dir(out_dir, overwrite)
    param = next(model.parameters())
    dtype = dtype or param.dtype
    device = torch.device(device) if device is not None else param.device
    if (param.dtype, param.device.type) != (dtype, device.type):
        model = copy.deepcopy(model).to(device=device, dtype=dtype)  # the caller's model stays as it was
        memo = None  # (hashes of the caller's model are not this copy's)
    start = time.perf_counter()
    with files.atomic_dir(out_dir, marker=mf.MANIFEST, overwrite=overwrite) as tmp:
        inputs, outputs = io_names(spec.layers)
        dynamic = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "total_sequence"},
                   "logits": {0: "batch", 1: "kept_sequence"}}
        dynamic.update({n: {0: "batch", 2: "past_sequence"} for n in inputs[3:]})
        dynamic.update({n: {0: "batch", 2: "total_sequence"} for n in outputs[1:]})
        graph = DecoderGraph(model, flavour)
        attention = getattr(graph, "attention", None)  # how the graph attends (the family's words), or OPT's
        # the exporter sets eval mode and then restores the *wrapper's* mode on every submodule: a fresh module is
        # in training mode, which would leave the caller's model with dropout on; restore the model's own mode
        graph.train(model.training)
        traced = tmp / "traced"
        traced.mkdir()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer warnings
            torch.onnx.export(graph, _example(spec, device, dtype), str(traced / mf.MODEL_FILE), dynamo=False,
                              input_names=inputs, output_names=outputs, dynamic_axes=dynamic,
                              opset_version=opset, do_constant_folding=True, external_data=True)
        del graph
        ops = _consolidate(traced / mf.MODEL_FILE, tmp / mf.MODEL_FILE)
        shutil.rmtree(traced)
        io_in, io_out = _io_spec(spec.layers, spec.cache_heads, spec.head_dim, spec.vocab, mf.DTYPE_NAMES[dtype])
        manifest = _manifest(model, spec, flavour, dtype, device, opset, source, ops, io_in, io_out, memo,
                             attention)
        manifest["export_seconds"] = round(time.perf_counter() - start, 2)
        mf.write(tmp, manifest)  # last: the manifest marks a finished export
    return manifest


def _consolidate(src: Path, dst: Path) -> dict:
    """Rewrite the exporter's output as one graph file plus one external-data file; returns op counts."""
    import onnx

    from onnx.external_data_helper import set_external_data

    model = onnx.load(str(src), load_external_data=True)
    model.producer_name = "fuseinfer.export"
    _drop_unused_optional_outputs(model.graph)
    # onnx.save_model(save_as_external_data=True, location=...) refuses when a file of that name exists in the
    # *current* directory (it tests the bare relative name): mark the tensors ourselves, then save_model writes
    # them next to dst
    for tensor in _tensors(model.graph):
        if tensor.HasField("raw_data") and sys.getsizeof(tensor.raw_data) >= EXTERNAL_BYTES:
            set_external_data(tensor, mf.DATA_FILE)
    onnx.save_model(model, str(dst))
    os.chmod(dst.parent / mf.DATA_FILE, 0o644)  # onnx creates it private; it is read by other users' runtimes
    counts = Counter(f"{n.domain + '.' if n.domain else ''}{n.op_type}" for n in model.graph.node)
    return dict(sorted(counts.items()))


EXTERNAL_BYTES = 1024  # tensors from this size on go to the external data file (as onnx's size_threshold)


def _tensors(graph):
    """Every tensor of the graph: initializers and node attributes, subgraphs included."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from _tensors(sub)


# optional outputs a consumer of the graph never needs: SkipLayerNormalization's mean and inv_std_var (training
# outputs; the CUDA kernel does not write them) and the last one's input_skip_bias_sum
OPTIONAL_OUTPUTS = {"SkipLayerNormalization": (1, 2, 3), "SkipSimplifiedLayerNormalization": (1, 2, 3)}


def _drop_unused_optional_outputs(graph) -> None:
    """Name unused optional outputs "" (ONNX's "not requested"), as onnxruntime's own fusions emit them, so no
    runtime computes or allocates them; trailing ones are removed."""
    used = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    for node in graph.node:
        for i in OPTIONAL_OUTPUTS.get(node.op_type, ()) if node.domain == "com.microsoft" else ():
            if i < len(node.output) and node.output[i] not in used:
                node.output[i] = ""
        while node.output and node.output[-1] == "" and len(node.output) > 1:
            node.output.pop()


def _manifest(model, spec, flavour, dtype, device, opset, source, ops, inputs, outputs, memo=None,
              attention=None) -> dict:
    import onnx
    import transformers

    from fuseinfer.core.version import __version__

    cfg = model.config
    contrib = {k.split(".", 2)[-1]: v for k, v in ops.items() if k.startswith("com.microsoft.")}
    return {
        "schema": mf.SCHEMA,
        "model_file": mf.MODEL_FILE,
        "external_data": mf.DATA_FILE,
        "flavour": flavour,
        "dtype": mf.DTYPE_NAMES[dtype],
        "opset": opset,
        "exported_on": str(device),
        "exporter": "torch.onnx.export (TorchScript, dynamo=False)",
        "versions": {"torch": torch.__version__, "onnx": onnx.__version__, "transformers": transformers.__version__,
                     "fuseinfer": __version__},
        "model": {"source": source or getattr(cfg, "_name_or_path", "") or "in-memory model",
                  "config_hash": mf.config_hash(cfg), "weights_hash": mf.model_hash(model, memo=memo),
                  "layers": spec.layers, "heads": spec.heads, "head_dim": spec.head_dim, "hidden": spec.hidden,
                  "vocab": spec.vocab, "max_positions": spec.max_positions, "pad_token_id": spec.pad_token_id,
                  "kv_heads": spec.cache_heads},
        "inputs": inputs,
        "outputs": outputs,
        "position_ids": spec.position_ids,
        "attention": attention or (
            "com.microsoft.MultiHeadAttention, unidirectional=1 (causal, offset by the past length), padding as "
            "attention_bias (-10000 on padded keys)" if flavour == "fused" else
            "MatMul / Where(causal and not padding) / Softmax(fp32) / MatMul"),
        "contrib_ops": contrib,
        "op_counts": ops,
        "run": ("fuseinfer.export.OrtDecoder(dir, device) (IO binding; see docs/export.md), or any ONNX Runtime: "
                "feed input_ids, attention_mask, num_logits_to_keep and past_* (B, H, 0, D) for the prompt, then "
                "feed present_* back as past_* with the mask grown by one column per new token"),
    }
