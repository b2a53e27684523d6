"""The quantized fuseinfer backends ``fuseinfer-w8a16``, ``fuseinfer-w8a8``, ``fuseinfer-w8a8-static``,
``fuseinfer-fp8`` and ``fuseinfer-fp8-static`` (``fuseinfer/quant/backends.py``): int8 weights, SmoothQuant int8
activations, FP8 (e4m3) weights and activations (the ``-static`` rows: the inputs no LayerNorm quantizes with
calibrated static scales, written by the kernel before them); their rows state the quantized model's weight bytes,
which the decode GB/s column counts."""
from fuseinfer.eval.backends import register
from fuseinfer.quant.backends import (FuseInferFP8Backend, FuseInferFP8StaticBackend, FuseInferW8A8Backend,
                                      FuseInferW8A8StaticBackend, FuseInferW8A16Backend)

register(FuseInferW8A16Backend)
register(FuseInferW8A8Backend)
register(FuseInferW8A8StaticBackend)
register(FuseInferFP8Backend)
register(FuseInferFP8StaticBackend)
