"""The ``tensorrt`` backend: the plain ONNX export built into a TensorRT engine (``fuseinfer/export/backends.py``)."""
from fuseinfer.eval.backends import register
from fuseinfer.export.backends import TensorRTBackend

register(TensorRTBackend)
