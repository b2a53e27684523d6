"""The fast-decode half of the Llama-architecture family: the per-op decode forward over fuseinfer's static KV cache
(the runtime, ``fuseinfer/runtime/decode.py``, replays it in CUDA graphs on GPU and runs it eagerly elsewhere).
There is no one-kernel decode step for this family (the base class says so)."""
from __future__ import annotations

import torch
from torch import nn

from fuseinfer.layers import hf_attention

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
