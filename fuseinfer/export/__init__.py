"""Export OPT models to ONNX (plain or with onnxruntime fused ops) and TensorRT; see docs/export.md."""
