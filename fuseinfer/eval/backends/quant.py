"""The quantized fuseinfer backends ``fuseinfer-w8a16``, ``fuseinfer-w8a8`` and ``fuseinfer-fp8``
(``fuseinfer/quant/backends.py``): int8 weights, SmoothQuant int8 activations, FP8 (e4m3) weights and
activations; their rows state the quantized model's weight bytes, which the decode GB/s column counts."""
from fuseinfer.eval.backends import register
from fuseinfer.quant.backends import FuseInferFP8Backend, FuseInferW8A8Backend, FuseInferW8A16Backend

register(FuseInferW8A16Backend)
register(FuseInferW8A8Backend)
register(FuseInferFP8Backend)
