"""The fast-decode half of the Llama-architecture family: the per-op decode forward over fuseinfer's static KV cache
(the runtime, ``fuseinfer/runtime/decode.py``, replays it in CUDA graphs on GPU and runs it eagerly elsewhere) and the
one-kernel decode step (``fuseinfer::llama_decode_step``) with the checks that say when it applies.

The runtime calls these through the family interface (:class:`fuseinfer.models.base.ModelFamily`); the module swaps
live in ``modules.py``.
"""
from __future__ import annotations

import torch
from torch import nn

from fuseinfer.core.state import patch_state, runtime_config
from fuseinfer.layers import attention_backend, hf_attention
from fuseinfer.models.common import global_hooks, has_hooks
from fuseinfer.models.llama import modules as llama
from fuseinfer.ops import decode_step_workspace, llama_decode_step
from fuseinfer.ops.decode_step import kv_scale_count
from fuseinfer.ops.kv_cache import FP8_DTYPE
from fuseinfer.ops import llama_step as step_op

# rotary types whose tables depend on more than the positions (transformers rescales them from the longest position
# seen, a host read at every call): the decode step could not run inside a CUDA graph
_DYNAMIC_ROPE = ("dynamic", "longrope")


def decode_forward(model: nn.Module):
    """(the fast-decode forward for ``model``, None), or (None, the reason it cannot take that path)."""
    if not hasattr(model, "lm_head") or not hasattr(getattr(model, "model", None), "layers"):
        return None, f"fast decode needs a causal LM (e.g. LlamaForCausalLM), got {type(model).__name__}"
    if model.config._attn_implementation != hf_attention.NAME:  # patched in training mode
        return None, ("fast decode needs the fuseinfer attention, which patch() skips in training mode: "
                      "call model.eval() before fuseinfer.patch(model)")
    rope = (getattr(model.config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope in _DYNAMIC_ROPE:
        return None, (f"rope_type {rope!r} rescales its tables from the longest position seen (a host read per "
                      "call), which the decode step's CUDA graphs cannot take")
    return forward_last_logits, None


def forward_last_logits(model: nn.Module, tokens, positions, cache, q_start, keep: int = 0) -> torch.Tensor:
    """The fast-decode forward of a patched Llama / Mistral / Qwen2 causal LM over a static KV cache.

    tokens, positions: (B, S) int64 (positions: 0-based count of real tokens, -1 on left padding, hidden by the key
    mask); writes k/v to ``cache.write_idx``; q_start: (B,) int32 slot of tokens[:, 0]. Returns fp32 logits of the
    last position, (B, V); with ``keep`` > 0 those of the last ``keep`` positions, (B, keep, V).
    """
    base = model.model
    h = base.embed_tokens(tokens)  # (B, S, E)
    rotary = base.rotary_emb(h, positions)  # cos, sin (B, S, D) in h's dtype: every rope scaling transformers has
    mask = hf_attention.MaskInfo(cache.key_mask, q_start, getattr(cache, "kv_scales", None))
    for layer in base.layers:
        h = layer(h, attention_mask=mask, past_key_values=cache, position_embeddings=rotary)
    h = base.norm(h[:, -(keep or 1):])  # (B, keep or 1, E)
    logits = model.lm_head(h).float()
    return logits if keep else logits[:, -1]  # (B, keep, V) or (B, V)


def decode_step_kernel(model: nn.Module, cache):
    """(step(tokens, positions, q_start) -> fp32 logits (B, V), None) running the whole decode step over
    ``cache`` as one kernel (``fuseinfer::llama_decode_step``), or (None, why it cannot)."""
    if attention_backend.decode_backend(model) == "sdpa":
        return None, "attention_backend='sdpa': the one-kernel step runs fuseinfer's attention"
    mode = runtime_config(model).decode_kernel
    if mode == "off":
        return None, "the one-kernel step is off: RuntimeConfig(decode_kernel='off')"
    if patch_state(model).config.quant is not None:
        return None, "the Llama one-kernel step streams fp16/bf16 weights only: quantized models decode per op"
    if not model.model.embed_tokens.weight.is_cuda:
        return None, "the one-kernel step runs on CUDA (sm_90)"
    rows = cache.key_mask.shape[0]
    if mode == "auto" and rows > step_op.AUTO_MAX_ROWS:
        return None, ("the Llama one-kernel step is not measured faster than per op at this batch size; "
                      "RuntimeConfig(decode_kernel='on') uses it wherever it applies")
    forward, why = decode_forward(model)
    if forward is None:
        return None, why
    cfg, base = model.config, model.model
    layers = list(base.layers)
    if not all(_fully_fused(layer) for layer in layers) or not isinstance(base.norm, llama._FusedRMSNorm):
        return None, ("a layer is not fully fused (patch skipped it, see the report, or its q/k/v or gate/up weights "
                      "were replaced after patch)")
    if model.lm_head.bias is not None or any(layer.self_attn.o_proj.bias is not None
                                             or layer.mlp.down_proj.bias is not None
                                             or layer.mlp.__dict__.get(llama.GATE_UP.bias) is not None
                                             for layer in layers):
        return None, "the kernel covers bias-free o_proj, MLP and LM head linears (a q/k/v bias is fine)"
    if global_hooks() or any(has_hooks(m) for m in model.modules()):
        return None, "a module has hooks, which the one-kernel step would bypass (the per-op step calls them)"
    embed = base.embed_tokens.weight
    kv_scales = list(getattr(cache, "kv_scales", None) or ())  # an FP8 (e4m3) cache's, else []
    if any(c.dtype != (FP8_DTYPE if kv_scales else embed.dtype) for c in cache.keys + cache.values):
        return None, "the one-kernel step reads caches of the model's dtype or FP8 (e4m3) caches with their scales"
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = llama.head_dim_of(cfg)
    if not step_op.kernel_supports(rows, embed, cfg.intermediate_size, heads, kv_heads, head_dim,
                                   kv_scale_count(kv_scales)):
        return None, (f"no kernel for {rows} rows of {embed.dtype} on {embed.device} (needs the extension, sm_90, "
                      f"fp16/bf16, head dim 64/128 with hidden = heads x head dim, <= {step_op.MAX_ROWS} rows that fit "
                      "shared memory)")
    params, biases = decode_step_params(model)
    if len(biases) not in (0, len(layers)):
        return None, "the kernel takes a q/k/v bias in every layer or in none"
    why = step_op.weights_refusal(embed, params)
    if why is not None:
        return None, why
    if base.norm.weight.dtype != embed.dtype or model.lm_head.weight.dtype != embed.dtype:
        return None, f"the final norm and the LM head must be {embed.dtype} like the embedding"
    if not all(p.is_contiguous() and p.data_ptr() % 16 == 0 for p in params + biases):
        return None, "a parameter is not contiguous and 16-byte aligned"
    eps = layers[0].input_layernorm.variance_epsilon
    if any(norm.variance_epsilon != eps for layer in layers
           for norm in (layer.input_layernorm, layer.post_attention_layernorm)) or base.norm.variance_epsilon != eps:
        return None, "the kernel takes one RMSNorm epsilon for every norm"
    scale = layers[0].self_attn.scaling
    workspace = decode_step_workspace(rows, cfg.hidden_size, cfg.intermediate_size, heads, head_dim,
                                      cache.key_mask.shape[1], embed.device)
    # tensors and the rotary module only: the session that keeps this step lives on the model, which it must not
    # reference
    rotary, norm_w, lm_head = base.rotary_emb, base.norm.weight, model.lm_head.weight
    like = embed[:1]  # the dtype and device the rotary tables are made in

    def step(tokens, positions, q_start):
        cos, sin = rotary(like, positions.view(-1, 1))  # (B, 1, D) each, every rope scaling transformers has
        return llama_decode_step(tokens.view(-1), cos, sin, q_start, cache.key_mask, embed, params, biases,
                                 cache.keys, cache.values, norm_w, lm_head, workspace, eps, scale, kv_scales)

    step.op = "fuseinfer::llama_decode_step"  # (the runtime's description of its path)
    return step, None


def _fully_fused(layer: nn.Module) -> bool:
    """Whether the patched layer runs every fused op the step replaces, over its fused q/k/v and gate/up tensors."""
    attn, mlp = layer._modules["self_attn"], layer._modules["mlp"]
    return (isinstance(layer, llama._FusedDecoderLayer) and {"layer_norm", "linear"} <= layer._fuseinfer_ops
            and isinstance(attn, llama._FusedAttention) and {"qkv", "linear"} <= attn._fuseinfer_ops
            and isinstance(mlp, llama._FusedMLP)
            and llama.QKV.name not in attn._modules and llama.GATE_UP.name not in mlp._modules
            and isinstance(attn.__dict__.get(llama.QKV.weight), torch.Tensor)
            and isinstance(mlp.__dict__.get(llama.GATE_UP.weight), torch.Tensor)
            and llama._linked(attn, llama.QKV) and llama._linked(mlp, llama.GATE_UP))


def decode_step_params(model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the 6 per-layer tensors ``fuseinfer::llama_decode_step`` takes, the fused q/k/v biases or []) of a patched
    Llama-architecture causal LM: input norm weight, q/k/v weight, o_proj weight, post-attention norm weight,
    gate/up weight, down_proj weight; the fused tensors are the ones patch made (the model's own, not copies)."""
    params, biases = [], []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        params += [layer.input_layernorm.weight, attn.__dict__[llama.QKV.weight], attn.o_proj.weight,
                   layer.post_attention_layernorm.weight, mlp.__dict__[llama.GATE_UP.weight], mlp.down_proj.weight]
        bias = attn.__dict__.get(llama.QKV.bias)
        if bias is not None:
            biases.append(bias)
    return params, biases
