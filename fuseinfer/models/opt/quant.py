"""What the quantization schemes need to know of OPT: its decoder linears, which q/k/v are fused, and where
SmoothQuant can fold its factors (``OPTFamily`` exposes these through the family interface).

SmoothQuant's groups per decoder layer, in this order (``models.base.Smoothing``; the paper's choice for OPT):
  * q/k/v input <- ``self_attn_layer_norm`` (its weight and bias), pre-LN only;
  * out_proj input <- v_proj's output rows and bias: attention output channel j is a convex combination of v's
    channel j (softmax weights), so it scales by 1 / s exactly;
  * fc1 input <- ``final_layer_norm``, pre-LN only;
  * fc2 input <- fc1's output rows and bias: ReLU is positively homogeneous, relu(z / s) = relu(z) / s.
Post-LN OPT (opt-350m, ``do_layer_norm_before=False``): the LayerNorm output that feeds q/k/v and fc1 is also the
residual stream, so dividing its weight by s would change the model: those two groups are skipped with that reason.
"""
from __future__ import annotations

from torch import nn

from fuseinfer.core.errors import FuseInferError
from fuseinfer.models.base import Smoothing

QKV = ("q_proj", "k_proj", "v_proj")
POST_LN_REASON = ("post-LN OPT (do_layer_norm_before=False, e.g. opt-350m): this LayerNorm's output is also the "
                  "residual stream, so folding 1/s into it would change the model; left unsmoothed")


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(qualified name, layers) of an OPTForCausalLM / OPTModel's decoder layers, or a clear error."""
    decoder = getattr(getattr(model, "model", model), "decoder", None)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise FuseInferError(f"expected an OPT model with decoder layers (OPTForCausalLM, OPTModel), got "
                             f"{type(model).__name__}")
    return next(n for n, m in model.named_modules() if m is layers), layers


def quant_targets(model: nn.Module) -> list[str]:
    """Every decoder linear (q/k/v, out_proj, fc1, fc2 of each layer), in module order."""
    prefix, layers = decoder_layers(model)
    wanted = set(QKV) | {"out_proj", "fc1", "fc2"}
    return [n for n, _ in layers.named_modules(prefix=prefix) if n.rsplit(".", 1)[-1] in wanted]


def smoothing_groups(model: nn.Module) -> list[Smoothing]:
    """The four groups of every layer (see the module docstring), each with why it is skipped where it is."""
    prefix, layers = decoder_layers(model)
    pre_ln = bool(getattr(model.config, "do_layer_norm_before", True))
    activation = getattr(model.config, "activation_function", "relu")
    groups = []
    for i, layer in enumerate(layers):
        p = f"{prefix}.{i}"
        attn = f"{p}.self_attn"

        def ln_reason(ln):
            return POST_LN_REASON if not pre_ln else "" if ln.elementwise_affine else "LayerNorm without affine weights"

        groups += [
            Smoothing("layernorm", f"{p}.self_attn_layer_norm", tuple(f"{attn}.{n}" for n in QKV),
                      f"{p} q/k/v input", ln_reason(layer.self_attn_layer_norm)),
            Smoothing("linear_rows", f"{attn}.v_proj", (f"{attn}.out_proj",), f"{p} out_proj input"),
            Smoothing("layernorm", f"{p}.final_layer_norm", (f"{p}.fc1",), f"{p} fc1 input",
                      ln_reason(layer.final_layer_norm)),
            Smoothing("linear_rows", f"{p}.fc1", (f"{p}.fc2",), f"{p} fc2 input",
                      "" if activation == "relu" else
                      f"activation {activation!r} is not ReLU (not positively homogeneous)"),
        ]
    return groups
