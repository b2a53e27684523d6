"""The quantized fuseinfer backends ``fuseinfer-w8a16`` and ``fuseinfer-w8a8`` (``fuseinfer/quant/backends.py``):
int8 weights, and SmoothQuant int8 activations; their rows state the int8 model's weight bytes, which the decode
GB/s column counts."""
from fuseinfer.eval.backends import register
from fuseinfer.quant.backends import FuseInferW8A8Backend, FuseInferW8A16Backend

register(FuseInferW8A16Backend)
register(FuseInferW8A8Backend)
