"""What the quantization schemes need to know of the Llama architecture: its decoder linears and which of them the
patch fused (q/k/v into one weight, gate/up into another: each quantizes as one int8 tensor). SmoothQuant W8A8 is
not supported for this family yet (its smoothing would fold into the RMSNorm weights and the v / up rows; not
written)."""
from __future__ import annotations

from torch import nn

from fuseinfer.core.errors import FuseInferError

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SMOOTHQUANT_REFUSAL = ("SmoothQuant W8A8 is not supported for Llama-architecture models (Llama, Mistral, Qwen2) yet: "
                       "use fuseinfer.Int8WeightOnly() for int8 weights")


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(qualified name, layers) of a causal LM's or base model's decoder layers, or a clear error."""
    layers = getattr(getattr(model, "model", model), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise FuseInferError(f"expected a Llama-architecture model with decoder layers (e.g. LlamaForCausalLM, "
                             f"LlamaModel), got {type(model).__name__}")
    return next(n for n, m in model.named_modules() if m is layers), layers


def quant_targets(model: nn.Module) -> list[str]:
    """Every decoder linear (q/k/v, o_proj, gate/up, down_proj of each layer), in module order."""
    prefix, layers = decoder_layers(model)
    return [n for n, _ in layers.named_modules(prefix=prefix) if n.rsplit(".", 1)[-1] in LINEARS]
