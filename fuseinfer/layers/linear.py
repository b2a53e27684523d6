"""Quantized linear modules and ``fused_linear``, the one call the patched forwards make for every GEMM.

``fused_linear(module, x, residual, activation)`` runs ``act(x @ W.T + bias + residual)`` for an ``nn.Linear``
(``linear_epilogue``), a quantized linear (its ``fused`` method: int8 weights), or an attention module whose q/k/v
are fused (its ``qkv_weight`` buffer, or the quantized ``qkv_proj`` the quantizer put in its place). Schemes add
their module types by subclassing :class:`QuantizedLinear`.
"""
from __future__ import annotations

import torch
from torch import nn

from fuseinfer.ops import w8a16_linear, linear_epilogue
from fuseinfer.ops.linear_8bit_out import linear_8bit_out
from fuseinfer.ops.w8a16_linear import dequantize_weight


# rows up to which a W8A8 linear on CUDA runs the int8 weight-only GEMV instead of quantizing its input (the
# w8a16_linear kernel's own GEMV limit): decode reads every weight once per token, so its time is the weight bytes,
# which are the same int8 bytes either way; quantizing the activations there costs a pass and buys nothing
DECODE_ROWS = 16


def decode_rows(x: torch.Tensor) -> bool:
    """Whether x (..., K) is a decode-sized input on CUDA (at most DECODE_ROWS rows): W8A8 linears then run the
    int8 weight-only GEMV on their int8 weights (fp16/bf16 activations, per-channel weight scales)."""
    return x.is_cuda and x.numel() <= DECODE_ROWS * x.shape[-1]


class QuantizedLinear(nn.Module):
    """Base of the quantized linears: ``fused(x, residual, activation)`` is what the fused forwards call."""

    # whether ``forward_quantized(x_q, x_scale, residual, activation, out_dtype)`` takes per-token int8 activations
    # (W8A8): the fused decoder layer then feeds it add_layer_norm_quant's output instead of a fp16 LayerNorm output
    takes_int8 = False
    # the per-token 8-bit activations ``forward_quantized`` takes: "int8" (W8A8), "e4m3" (FP8), or None; the fused
    # decoder layer feeds such a linear the matching fused LayerNorm + quantize output (add_layer_norm_quant /
    # add_layer_norm_quant_fp8)
    quantized_input: str | None = None

    def fused(self, x, residual=None, activation: str = "none"):
        raise NotImplementedError

    def step_weights(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The 8-bit (N, K) weight (int8 or float8_e4m3fn) and its fp32 (N,) per-output-channel scales that a
        weight-streaming decode kernel may read in place of this layer (``act(x @ (w * scale).T + bias)`` on the
        unquantized activations), or None where the layer is not that."""
        return None

    def forward(self, x):
        return self.fused(x)


class ChannelScaledLinear(QuantizedLinear):
    """Base of the quantized linears that hold an 8-bit weight with one fp32 scale per output channel (SmoothQuant
    W8A8's int8, FP8's e4m3) and quantize their input at run time: per token, or, with an ``input_scale`` buffer
    ((1,) fp32, calibrated: ``set_input_amax``), with that one static scale for every token. Buffers: weight_q
    (N, K), weight_scale (N, 1) fp32, bias (N,) or None, input_scale or None. At decode-sized inputs they run the
    8-bit weight GEMV on the unquantized activations, so the one-kernel decode step may stream the same weights."""

    INPUT_QMAX = 127.0  # the input format's largest value (int8; e4m3: 448): a static scale is amax / INPUT_QMAX

    def __init__(self, weight_q: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 input_scale: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("weight_q", weight_q)          # (N, K) int8 or float8_e4m3fn
        self.register_buffer("weight_scale", weight_scale)  # (N, 1) fp32
        self.register_buffer("bias", bias)                  # (N,) or None
        self.register_buffer("input_scale", input_scale)    # (1,) fp32 or None (dynamic per-token scales)
        self.in_features, self.out_features = weight_q.shape[1], weight_q.shape[0]

    def step_weights(self):
        return self.weight_q, self.weight_scale.view(-1)

    def set_input_amax(self, amax: float) -> None:
        """A static input scale from the calibrated max|x| of this linear's input: ``amax / INPUT_QMAX`` (the
        smallest normal fp32 value for an input that was always 0)."""
        scale = max(float(amax) / self.INPUT_QMAX, torch.finfo(torch.float32).tiny)
        self.input_scale = torch.tensor([scale], dtype=torch.float32, device=self.weight_scale.device)

    def static_scales(self, x_q: torch.Tensor) -> torch.Tensor:
        """The x_scale of an input ``x_q`` quantized with ``input_scale``: that one (1,) fp32 value, which the scaled
        GEMMs apply to every row (no per-row copy of it)."""
        return self.input_scale

    def forward_8bit_out(self, x_q, x_scale, out_scale: torch.Tensor, activation: str = "none",
                         bias_dtype: torch.dtype = torch.float16) -> torch.Tensor:
        """x_q (..., K) in this linear's 8-bit format (``quantized_input``), x_scale (..., 1) fp32 or one value ->
        (..., N) in the same format, quantized with the static ``out_scale`` (the next linear's ``input_scale``) in
        this GEMM's epilogue, the activation first (``linear_8bit_out``)."""
        bias = None if self.bias is None else self.bias.to(bias_dtype)
        return linear_8bit_out(x_q, x_scale, self.weight_q, self.weight_scale, bias, out_scale, activation,
                               self.quantized_input)

    def _apply(self, fn, recurse=True):
        """``model.half()`` / ``.to(dtype)`` convert every floating-point tensor: the scales stay fp32 (the kernels'
        format; a round trip through fp16 may round them)."""
        super()._apply(fn, recurse)
        for name in ("weight_scale", "input_scale"):
            t = getattr(self, name)
            if t is not None and t.dtype != torch.float32 and not t.is_meta:
                setattr(self, name, t.float())
        return self


class Int8WeightOnlyLinear(QuantizedLinear):
    """y = x @ (qweight * scale[:, None]).T + bias. Buffers: qweight int8 (N, K), scale fp32 (N,); bias: the
    original layer's Parameter (the same object, so it keeps its identity) or, for the fused q/k/v, a buffer."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)  # (N, K) int8
        self.register_buffer("scale", scale)  # (N,) fp32
        if isinstance(bias, nn.Parameter) or bias is None:
            self.bias = bias
        else:
            self.register_buffer("bias", bias)  # (N,)

    def fused(self, x, residual=None, activation: str = "none"):
        return w8a16_linear(x, self.qweight, self.scale, self.bias, residual, activation)

    def step_weights(self):
        return self.qweight, self.scale

    def _apply(self, fn, recurse=True):
        """``model.half()`` / ``.to(dtype)`` convert every floating-point tensor: the scales stay fp32 (the kernels'
        format; a round trip through fp16 may round them)."""
        super()._apply(fn, recurse)
        if self.scale.dtype != torch.float32 and not self.scale.is_meta:
            self.scale = self.scale.float()
        return self

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight this layer computes with, (N, K) in ``dtype``."""
        return dequantize_weight(self.qweight, self.scale, dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               "int8 weight, fp32 per-channel scale"


class QKVSlice(nn.Module):
    """A q/k/v projection of an attention module whose q/k/v weights were quantized as one (3E, E) int8 tensor
    (the attention module's ``qkv_proj``): rows [index * E, (index + 1) * E) of it. Holds no tensor of its own (the
    slices are taken per call, so ``model.to(...)`` cannot separate them from the fused tensor); ``weight`` and
    ``bias`` are registered as None so that the family's check that the projections are still the fused ones
    (which compares the stored parameters) sees them as they were recorded."""

    def __init__(self, qkv: Int8WeightOnlyLinear, index: int, embed_dim: int, start: int | None = None):
        """Rows [start, start + embed_dim) (``start`` None: index * embed_dim; grouped-query k / v rows differ in
        number from q's)."""
        super().__init__()
        object.__setattr__(self, "_qkv", qkv)  # a sibling, not a child (it must not appear twice in the tree)
        self.index, self.embed_dim = index, embed_dim
        self.start = index * embed_dim if start is None else start
        self.register_parameter("weight", None)
        self.register_parameter("bias", None)

    def forward(self, x):
        rows = slice(self.start, self.start + self.embed_dim)
        q = self._qkv
        return w8a16_linear(x, q.qweight[rows], q.scale[rows], None if q.bias is None else q.bias[rows])

    def extra_repr(self) -> str:
        return f"rows {self.start}:{self.start + self.embed_dim} of the int8 fused linear"


def int8_input(module: nn.Module | None) -> QuantizedLinear | None:
    """The linear that reads ``module``'s input if it takes per-token int8 activations (``takes_int8``): the module
    itself, or the quantized fused q/k/v (``qkv_proj``) of an attention module; else None."""
    if module is None:
        return None
    linear = module if isinstance(module, QuantizedLinear) else module._modules.get("qkv_proj")
    return linear if getattr(linear, "takes_int8", False) else None


def quantized_input(module: nn.Module | None) -> QuantizedLinear | None:
    """The linear that reads ``module``'s input if it takes per-token 8-bit activations (``quantized_input`` set:
    int8 or e4m3): the module itself, or the quantized fused q/k/v (``qkv_proj``) of an attention module; else
    None."""
    if module is None:
        return None
    linear = module if isinstance(module, QuantizedLinear) else module._modules.get("qkv_proj")
    return linear if getattr(linear, "quantized_input", None) is not None else None


def writes_static_input(lin: nn.Module, nxt: nn.Module | None) -> bool:
    """Whether ``lin``'s GEMM writes the input of ``nxt`` (the linear it feeds) in 8 bits from its epilogue:
    ``nxt`` holds a calibrated static ``input_scale`` (``fc2_input="static"``) and both are channel-scaled linears
    of one 8-bit format (``forward_8bit_out``). The patched modules (at prefill) and the lean prefill loop both ask
    it."""
    return (isinstance(lin, ChannelScaledLinear) and isinstance(nxt, ChannelScaledLinear)
            and nxt._buffers.get("input_scale") is not None and lin.quantized_input == nxt.quantized_input)


def fused_linear(module: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None,
                 activation: str = "none") -> torch.Tensor:
    """``act(x @ W.T + bias + residual)`` for ``module``: an nn.Linear, a :class:`QuantizedLinear`, or an attention
    module with fused q/k/v (then W is (3E, E) and there is no residual or activation). x: (..., K) -> (..., N)."""
    if isinstance(module, QuantizedLinear):
        return module.fused(x, residual, activation)
    qkv = module._modules.get("qkv_proj")
    if qkv is not None:  # quantized fused q/k/v
        return qkv.fused(x, residual, activation)
    if "qkv_weight" in module.__dict__:  # fp16 fused q/k/v (the family's patch keeps it outside _buffers)
        return linear_epilogue(x, module.qkv_weight, module.qkv_bias, residual, activation)
    return linear_epilogue(x, module.weight, module.bias, residual, activation)
