"""The fast-decode half of the OPT family: the per-op decode forward over fuseinfer's static cache and the
one-kernel decode step (``fuseinfer::opt_decode_step``) with the checks that say when it applies.

The runtime (``fuseinfer/runtime/decode.py``) calls these through the family interface
(:class:`fuseinfer.models.base.ModelFamily`); the module swaps live in ``modules.py``.
"""
from __future__ import annotations

import torch
from torch import nn

from fuseinfer.core.quant_config import Float8, Int8WeightOnly, SmoothQuantW8A8
from fuseinfer.layers.linear import QuantizedLinear
from fuseinfer.core.state import patch_state, runtime_config
from fuseinfer.ops import decode_step as decode_step_op
from fuseinfer.ops import decode_step_workspace, opt_decode_step
from fuseinfer.layers import attention_backend, hf_attention
from fuseinfer.models.common import global_hooks, has_hooks
from fuseinfer.models.opt.modules import FusedOPTAttention, FusedOPTDecoderLayer, _qkv_linked, _qkv_params


def decode_forward(model: nn.Module):
    """The fast-decode forward for ``model``, or None with the reason it cannot take that path."""
    if type(model).__name__ != "OPTForCausalLM":
        return None, f"fast decode needs an OPTForCausalLM, got {type(model).__name__}"
    if model.config._attn_implementation != hf_attention.NAME:  # patched in training mode
        return None, ("fast decode needs the fuseinfer attention, which patch() skips in training mode: "
                      "call model.eval() before fuseinfer.patch(model)")
    return forward_last_logits, None


def decode_step_kernel(model: nn.Module, cache):
    """(step(tokens, positions, q_start) -> fp32 logits (B, V), None) running the whole decode step over
    ``cache`` as one kernel (``fuseinfer::opt_decode_step``), or (None, why it cannot)."""
    if attention_backend.decode_backend(model) == "sdpa":
        return None, "attention_backend='sdpa': the one-kernel step runs fuseinfer's attention"
    mode = runtime_config(model).decode_kernel
    if mode == "off":
        return None, "the one-kernel step is off: RuntimeConfig(decode_kernel='off')"
    quant = patch_state(model).config.quant
    if quant is not None:
        why = _int8_unsupported(model, quant)
        if why is not None:
            return None, why
    kv_scales = getattr(cache, "kv_scales", None)  # an FP8 (e4m3) cache's, else None
    if kv_scales is not None and quant is not None:
        return None, ("the one-kernel step reads an FP8 (e4m3) cache with fp16/bf16 weights only: a quantized model "
                      "with kv_cache='fp8' decodes per op")
    rows = cache.key_mask.shape[0]
    if mode == "auto" and rows > decode_step_op.AUTO_MAX_ROWS:
        return None, (f"the one-kernel step is slower than per op above {decode_step_op.AUTO_MAX_ROWS} row(s) "
                      "(measured); RuntimeConfig(decode_kernel='on') uses it wherever it applies")
    if mode == "auto" and quant is not None and model.config.hidden_size > decode_step_op.AUTO_INT8_MAX_HIDDEN:
        return None, (f"the int8 one-kernel step is slower than per op above hidden size "
                      f"{decode_step_op.AUTO_INT8_MAX_HIDDEN} (measured); RuntimeConfig(decode_kernel='on') uses "
                      "it wherever it applies")
    cfg, dec = model.config, model.model.decoder
    if not cfg.do_layer_norm_before or dec.project_in is not None or dec.project_out is not None:
        return None, "post-LN OPT with projected embeddings (opt-350m) runs per op"
    if cfg.activation_function != "relu" or not cfg.enable_bias or model.lm_head.bias is not None \
            or not cfg.layer_norm_elementwise_affine or dec.final_layer_norm is None:
        return None, "the kernel covers ReLU, biased linears, affine LayerNorms and a bias-free LM head"
    layers = list(dec.layers)
    if not all(isinstance(layer, FusedOPTDecoderLayer) and {"layer_norm", "linear"} <= layer._fuseinfer_ops
               and isinstance(layer.self_attn, FusedOPTAttention) and hasattr(layer.self_attn, "qkv_weight")
               and _qkv_linked(layer.self_attn, _qkv_params(layer.self_attn))
               for layer in layers):
        return None, ("a layer is not fully fused (patch skipped it, see the report, or its q/k/v weights were "
                      "replaced after patch)")
    if dec.embed_positions.offset != 2:
        return None, ("the kernel reads positions with OPT's offset 2, the model's is "
                      f"{dec.embed_positions.offset}")
    if global_hooks() or any(has_hooks(m) for m in model.modules()):
        return None, "a module has hooks, which the one-kernel step would bypass (the per-op step calls them)"
    embed = dec.embed_tokens.weight
    heads = cfg.num_attention_heads
    int8 = quant is not None
    kv_scales = list(kv_scales or ())
    if not decode_step_op.kernel_supports(rows, embed, cfg.ffn_dim, cfg.hidden_size // heads, int8=int8,
                                          kv_scales=decode_step_op.kv_scale_count(kv_scales)):
        return None, (f"no kernel for {rows} rows of {embed.dtype} on {embed.device} (needs the extension, "
                      f"sm_90, fp16/bf16, head dim 64/128, <= {decode_step_op.MAX_ROWS} rows that fit shared memory"
                      f"{'; int8: hidden and ffn sizes multiples of 64' if int8 else ''})")
    params = decode_step_params(model)
    weight_scales = decode_step_weight_scales(model)
    if not all(p.is_contiguous() and p.data_ptr() % 16 == 0 for p in params + weight_scales):
        return None, "a parameter is not contiguous and 16-byte aligned"
    eps = layers[0].self_attn_layer_norm.eps
    scale = layers[0].self_attn.scaling
    workspace = decode_step_workspace(rows, cfg.hidden_size, cfg.ffn_dim, heads, cfg.hidden_size // heads,
                                      cache.key_mask.shape[1], embed.device)
    # tensors only: the session that keeps this step lives on the model, which it must not reference
    pos_embed, lnf_w, lnf_b = dec.embed_positions.weight, dec.final_layer_norm.weight, dec.final_layer_norm.bias
    lm_head = model.lm_head.weight

    def step(tokens, positions, q_start):
        return opt_decode_step(tokens, positions, q_start, cache.key_mask, embed, pos_embed, params, cache.keys,
                               cache.values, lnf_w, lnf_b, lm_head, workspace, eps, scale, weight_scales, kv_scales)

    step.op = "fuseinfer::opt_decode_step"  # (the runtime's description of its path)
    return step, None


# the quantized models whose 8-bit weights the one-kernel step streams (W8A8 and FP8 linears run their weights on
# unquantized activations at decode anyway: layers/linear.py decode_rows)
STEP_SCHEMES = (Int8WeightOnly, SmoothQuantW8A8, Float8)


def _int8_unsupported(model: nn.Module, quant) -> str | None:
    """Why the one-kernel step cannot run this quantized model, or None: it takes Int8WeightOnly, W8A8 and Float8
    models whose every decoder linear (the fused q/k/v, out_proj, fc1, fc2) streams an 8-bit (N, K) weight with fp32 (N,)
    scales and a bias (``QuantizedLinear.step_weights``), and whose LM head is unquantized (Int8WeightOnly's
    default, include_lm_head=False; Float8 never quantizes it)."""
    if not isinstance(quant, STEP_SCHEMES):
        return (f"the one-kernel step streams fp16/bf16, int8 or FP8 weights; {type(quant).__name__} runs per op")
    if type(model.lm_head) is not nn.Linear:
        return ("the one-kernel step keeps the LM head in fp16/bf16: quantize with include_lm_head=False (the "
                "default) to use it")
    for i, layer in enumerate(model.model.decoder.layers):
        attn = layer.self_attn
        for name, lin in (("self_attn.qkv_proj", attn._modules.get("qkv_proj")), ("self_attn.out_proj", attn.out_proj),
                          ("fc1", layer.fc1), ("fc2", layer.fc2)):
            sw = lin.step_weights() if isinstance(lin, QuantizedLinear) else None
            if sw is None or sw[0].dtype not in decode_step_op.WEIGHT_FORMATS or sw[0].dim() != 2 \
                    or sw[1].dtype != torch.float32 or sw[1].shape != (sw[0].shape[0],) or lin.bias is None:
                return (f"layer {i}'s {name} is not a quantized linear with an 8-bit (N, K) weight, fp32 scales "
                        "and a bias (filter_fn left it unquantized?): the 8-bit one-kernel step quantizes every "
                        "decoder linear")
    return None


def decode_step_weight_scales(model: nn.Module) -> list[torch.Tensor]:
    """The per-output-channel fp32 scales of an 8-bit model (int8 weight-only, FP8), 4 per layer (qkv, out_proj,
    fc1, fc2: ``decode_step.SCALED``), for ``fuseinfer::opt_decode_step``; [] when the model's linears are not
    quantized."""
    scales = []
    for layer in model.model.decoder.layers:
        lins = (layer.self_attn._modules.get("qkv_proj"), layer.self_attn.out_proj, layer.fc1, layer.fc2)
        streamed = [_step_weights(lin) for lin in lins]  # (8-bit weight, scales) or None each
        if not any(w is not None for w in streamed):
            continue
        scales += [w[1] for w in streamed]
    return scales


def _step_weights(linear: nn.Module):
    """A quantized linear's (8-bit weight, scales) the step streams, or None."""
    return linear.step_weights() if isinstance(linear, QuantizedLinear) else None


def decode_step_params(model: nn.Module) -> list[torch.Tensor]:
    """The 12 per-layer tensors ``fuseinfer::opt_decode_step`` takes, for a patched pre-LN OPTForCausalLM; of an
    8-bit model, its 8-bit weights (and the fused q/k/v's 8-bit weight and bias) in their place."""
    params = []
    for layer in model.model.decoder.layers:
        a = layer.self_attn
        qkv = a._modules.get("qkv_proj")
        qkv_w, qkv_b = (a.qkv_weight, a.qkv_bias) if qkv is None else (_weight(qkv), qkv.bias)
        params += [layer.self_attn_layer_norm.weight, layer.self_attn_layer_norm.bias, qkv_w, qkv_b,
                   _weight(a.out_proj), a.out_proj.bias, layer.final_layer_norm.weight, layer.final_layer_norm.bias,
                   _weight(layer.fc1), layer.fc1.bias, _weight(layer.fc2), layer.fc2.bias]
    return params


def _weight(linear: nn.Module) -> torch.Tensor:
    """The weight the step streams: a quantized linear's 8-bit (N, K) weight, else the (N, K) ``weight``."""
    sw = _step_weights(linear)
    return linear.weight if sw is None else sw[0]


def forward_last_logits(model: nn.Module, tokens, positions, cache, q_start, keep: int = 0) -> torch.Tensor:
    """The fast-decode forward of a patched OPTForCausalLM over a :class:`~fuseinfer.runtime.StaticKVCache`.

    tokens, positions: (B, S) int64 (OPT positions, -1 on padding); writes k/v to ``cache.write_idx``;
    q_start: (B,) int32 slot of tokens[:, 0]. Returns fp32 logits of the last position, (B, V); with ``keep`` > 0
    those of the last ``keep`` positions, (B, keep, V) (transformers' loop verifying assisted candidates).
    """
    dec = model.model.decoder
    h = dec.embed_tokens(tokens)  # (B, S, E_word)
    if dec.project_in is not None:
        h = dec.project_in(h)
    h = h + dec.embed_positions(None, 0, position_ids=positions)  # (B, S, E)
    mask = hf_attention.MaskInfo(cache.key_mask, q_start, getattr(cache, "kv_scales", None))
    for layer in dec.layers:
        h = layer(h, attention_mask=mask, past_key_values=cache)
    h = h[:, -(keep or 1):]  # (B, keep or 1, E)
    if dec.final_layer_norm is not None:
        h = dec.final_layer_norm(h)
    if dec.project_out is not None:
        h = dec.project_out(h)
    logits = model.lm_head(h).float()
    return logits if keep else logits[:, -1]  # (B, keep, V) or (B, V)
