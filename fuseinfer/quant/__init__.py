"""Quantization for fuseinfer (placeholder from the w8a8 branch: the int8 weight-only branch owns this file and its
configs; take that branch's version at merge). SmoothQuant W8A8 lives in ``fuseinfer.quant.smoothquant``."""
