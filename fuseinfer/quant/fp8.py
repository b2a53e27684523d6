"""FP8 W8A8 (``Float8``) through ``patch``: e4m3 weights per output channel, e4m3 activations per token, and the
optional SmoothQuant smoothing before them.

The flow is SmoothQuant W8A8's (``quant/w8a8.py``: calibrate and smooth when ``alpha`` is set, swap the linears of
the swapped modules, the q/k/v fused as one (3E, E) ``qkv_proj`` with slice views in the projections' places, the
same undo state and checkpoint layout), with :class:`Float8Linear` in place of the int8 ``W8A8Linear``. The linear
quantizes its input per token (``quantize_fp8_per_token``) and calls ``fuseinfer.ops.fp8_linear``:
``torch._scaled_mm`` on GPUs of compute capability >= 8.9, the fp32 reference elsewhere; at decode-sized inputs on
CUDA (``decode_rows``) it runs the e4m3 weight GEMV on the unquantized activations instead
(``fuseinfer.ops.fp8_weight_linear``), as the int8 W8A8 linears run the int8 weight-only GEMV there. It takes
per-token e4m3 activations (``quantized_input`` "e4m3", ``forward_quantized``): at prefill the fused decoder layer
feeds the linears that read a pre-LN LayerNorm's output the output of ``add_layer_norm_quant_fp8`` (LayerNorm and the
e4m3 quantize in one kernel), as it feeds the W8A8 linears ``add_layer_norm_quant``'s int8; the others quantize their
input in ``fused`` (``quantize_fp8_per_token``: one kernel on CUDA). It does not take int8 activations
(``takes_int8`` is False). The OPT lean prefill loop (``models/opt/lean.py``, ``Fp8LeanOps``) and its CUDA graphs run
FP8 models with the same ops in the same order.

``Float8(fc2_input="static")`` gives the MLP's output projection a calibrated per-tensor input scale
(``input_scale``, ``amax / 448`` of its input over the calibration windows, after smoothing): the MLP's first GEMM
then writes that e4m3 input from its epilogue (``fp8_linear_fp8out``, ReLU before the quantization; the family's
patched layer and lean loop make the call), instead of writing fp16 for a separate pass to quantize per token.
``Float8(out_proj_input="static")`` does the same for the attention's output projection: the attention kernel writes
its e4m3 input (``attention_fp8out``). Any Float8Linear with an ``input_scale`` quantizes an fp16 / bf16 input with
it (``quantize_fp8_static``).
"""
from __future__ import annotations

import torch
from torch import nn

from fuseinfer.core.errors import FuseInferError
from fuseinfer.layers.linear import ChannelScaledLinear, decode_rows
from fuseinfer.ops.fp8_gemv import fp8_weight_linear
from fuseinfer.ops.fp8_linear import (FP8_DTYPE, FP8_MAX, fp8_gemm_note, fp8_linear, quantize_fp8_per_token,
                                      quantize_fp8_ref)
from fuseinfer.ops.linear_8bit_out import quantize_fp8_static
from fuseinfer.ops.w8a8_linear import OUT_DTYPES
from fuseinfer.quant.smoothquant import model_family
from fuseinfer.quant.w8a8 import Flavor, W8A8QKVSlice, quantize_w8a8

FAMILIES = ("opt",)  # the families whose fused q/k/v layout (three equal row blocks) the swap takes


class Float8Linear(ChannelScaledLinear):
    """An nn.Linear with float8_e4m3fn weights (per output channel, fp32 scales) whose input is quantized to e4m3
    per token at run time, or with its static ``input_scale`` (ChannelScaledLinear). ``fused(x, residual,
    activation)`` is the call the patched forwards make."""

    INPUT_QMAX = FP8_MAX

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Float8Linear:
        return build(linear.weight, linear.bias)

    def _apply(self, fn, recurse=True):
        """``model.half()`` / ``.to(dtype)`` convert every floating-point tensor, float8 ones included: the weights
        go back to e4m3 (exact: every e4m3 value is an fp16 / bf16 / fp32 value) and the scales stay fp32."""
        super()._apply(fn, recurse)
        if self.weight_q.dtype != FP8_DTYPE and not self.weight_q.is_meta:
            self.weight_q = self.weight_q.to(FP8_DTYPE)
        return self

    def dequantized_weight(self, dtype=torch.float32) -> torch.Tensor:
        return (self.weight_q.float() * self.weight_scale).to(dtype)  # (N, K)

    quantized_input = "e4m3"

    def fused(self, x: torch.Tensor, residual: torch.Tensor | None = None, activation: str = "none"):
        """act(x @ W.T + bias + residual) with x quantized per token first; x (..., K) -> (..., N) in x's dtype."""
        if x.dtype not in OUT_DTYPES:
            raise FuseInferError(f"Float8Linear: input dtype must be one of {OUT_DTYPES}, got {x.dtype}")
        if decode_rows(x):  # decode on CUDA: the e4m3 weight GEMV on fp16/bf16 activations (ops/fp8_gemv.py)
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return fp8_weight_linear(x, self.weight_q, self.weight_scale.view(-1), bias, residual, activation)
        q, s = self.quantize_input(x)  # (..., K) e4m3, (..., 1) fp32
        return self.forward_quantized(q, s, residual, activation, x.dtype)

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (..., K) fp16/bf16 -> (x_q (..., K) e4m3, x_scale (..., 1) fp32): with the static ``input_scale``
        when there is one, else per token."""
        if self.input_scale is not None:
            q = quantize_fp8_static(x, self.input_scale)
            return q, self.static_scales(q)
        return quantize_fp8_per_token(x)

    def forward_quantized(self, x_q, x_scale, residual=None, activation: str = "none",
                          out_dtype: torch.dtype = torch.float16) -> torch.Tensor:
        """x_q (..., K) float8_e4m3fn, x_scale (..., 1) fp32 (``add_layer_norm_quant_fp8``'s output) -> (..., N)
        out_dtype."""
        bias = None if self.bias is None else self.bias.to(out_dtype)
        return fp8_linear(x_q, x_scale, self.weight_q, self.weight_scale, bias, residual, activation, out_dtype)

    def extra_repr(self) -> str:
        how = "static input scale" if self.input_scale is not None else "per-token input scales"
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 weights and activations ({how})"


class Float8QKVSlice(W8A8QKVSlice):
    """A q/k/v projection of an attention module whose q/k/v are one (3E, E) :class:`Float8Linear`: rows
    [index * E, (index + 1) * E) of it, for the original forward (training mode, global hooks)."""

    def forward(self, x):  # (..., E) -> (..., E)
        rows = slice(self.index * self.embed_dim, (self.index + 1) * self.embed_dim)
        q = self._qkv
        xq, xs = quantize_fp8_per_token(x)
        bias = None if q.bias is None else q.bias[rows].to(x.dtype)
        return fp8_linear(xq, xs, q.weight_q[rows], q.weight_scale[rows], bias, None, "none", x.dtype)

    def extra_repr(self) -> str:
        return f"rows {self.index * self.embed_dim}:{(self.index + 1) * self.embed_dim} of the FP8 qkv_proj"


def build(w: torch.Tensor, bias: torch.Tensor | None, empty: bool = False) -> Float8Linear:
    """(N, K) weight -> Float8Linear; with ``empty``, uninitialized tensors of its layout on w's device (what
    ``load_quantized`` fills from a checkpoint; w may be on the meta device)."""
    if empty:
        n, k = w.shape
        return Float8Linear(torch.empty(n, k, dtype=FP8_DTYPE, device=w.device),
                            torch.empty(n, 1, dtype=torch.float32, device=w.device),
                            None if bias is None else torch.empty_like(bias))
    with torch.no_grad():
        q, scale = quantize_fp8_ref(w.detach(), -1)  # (N, K) e4m3, (N, 1) fp32
    return Float8Linear(q, scale, None if bias is None else bias.detach().clone())


PREFILL_NOTE = "FP8 prefill: the lean loop (LayerNorm + e4m3 quantize fused, then the FP8 GEMMs)"


def fp8_note(device: torch.device, dtype: torch.dtype = torch.float16) -> str:
    """The patch report's and the eval's line for an FP8 model: its GEMM and the prefill path."""
    return f"{fp8_gemm_note(device, dtype)}; {PREFILL_NOTE}"


FP8 = Flavor(build, Float8QKVSlice, fp8_note)


def quantize_fp8(model: nn.Module, config, report):
    """Float8 of the swapped modules' linears (see the module docstring); returns the undo state."""
    fam = model_family(model, "Float8")
    if fam.model_type not in FAMILIES:
        raise FuseInferError(f"Float8 supports {', '.join(FAMILIES).upper()} models for now, got a "
                             f"{fam.model_type} model: quantize it with Int8WeightOnly instead")
    return quantize_w8a8(model, config, report, FP8)
