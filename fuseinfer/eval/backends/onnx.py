"""The ONNX Runtime backends ``ort`` (onnxruntime's fused contrib ops) and ``ort-plain`` (standard ONNX ops only)
(``fuseinfer/export/backends.py``): the model exported, or an export reused from ``--onnx-dir``, run with IO
binding."""
from fuseinfer.eval.backends import register
from fuseinfer.export.backends import OrtBackend, OrtPlainBackend

register(OrtBackend)
register(OrtPlainBackend)
