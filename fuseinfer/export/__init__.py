"""Export OPT and Llama-architecture models to ONNX (plain, or with onnxruntime's fused contrib ops) and TensorRT;
run the exports.

    from fuseinfer.export import to_onnx, OrtDecoder
    to_onnx(model, "opt-onnx", flavour="fused")          # model.onnx + model.onnx.data + fuseinfer_onnx.json
    dec = OrtDecoder("opt-onnx", "cuda"); dec.start(1, 640); logits = dec.prefill(ids)

CLI: ``python -m fuseinfer.export onnx|tensorrt``. Eval backends ``ort``, ``ort-plain``, ``tensorrt``. See
docs/export.md.
"""
from fuseinfer.export.errors import ExportError
from fuseinfer.export.graph import FLAVOURS, DecoderGraph
from fuseinfer.export.manifest import config_hash, weights_hash
from fuseinfer.export.onnx_export import to_onnx
from fuseinfer.export.ort_runtime import OrtDecoder

__all__ = ["ExportError", "FLAVOURS", "DecoderGraph", "OrtDecoder", "config_hash", "to_onnx",
           "weights_hash"]
