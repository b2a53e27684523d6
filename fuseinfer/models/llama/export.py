"""The Llama-architecture families' ONNX export graph (Llama, Mistral, Qwen2): one decoder step of a causal LM over
explicit past tensors, for ``torch.onnx.export`` to trace (the family's ``export_graph``).

The export strategy ``ops`` (fuseinfer.export.graph: standard ONNX ops or onnxruntime contrib ops) builds each step;
this module says what the model computes around its decoder layers, and runs each layer through
:func:`~fuseinfer.models.llama.layer.decoder_layer` (through :class:`LayerOps`, which maps the layer's protocol onto
the strategy's):

* position ids inside the graph from the attention mask: ``cumsum(mask) - 1`` clamped at 0, the last S columns (as
  generation computes them for a left-padded batch; a padded slot gets 0, and its key is masked anyway);
* rotary tables baked at export time from the model's own rotary module: ``cos / sin(position * inv_freq) *
  attention_scaling`` for every position below ``max_position_embeddings``, (P, D/2) in the model's dtype, so any
  static rope scaling (linear, llama3, yarn) comes out as the model computes it. Rope types whose frequencies depend
  on the sequence length at run time (``dynamic``, ``longrope``) are refused: one fixed graph cannot recompute
  them, and baking them for one length would silently differ from the model at the others;
* past / present key and value with the key/value heads (B, Hkv, P, D); sliding-window layers (Mistral, Qwen2's
  sliding layers) attend over their window of cache slots;
* token embeddings, the layers, the final RMSNorm, the last ``num_logits_to_keep`` positions and the LM head (tied
  to the embedding table or not: the fused flavour reads the table as stored).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fuseinfer.models.base import AttentionProjections, ExportSpec
from fuseinfer.models.llama.layer import decoder_layer

# the profiler's kinds of an exported graph's matrix products (see ModelFamily.ort_matmul_kinds)
ORT_MATMUL_KINDS = {"qkv": "qkv", "out": "attn_out", "mlp_in": "mlp_in", "mlp_out": "mlp_out", "head": "lm_head"}

# the configuration fields the graph depends on (others, e.g. transformers_version, do not matter): an export
# records their hash, so a change here makes earlier exports stale
CONFIG_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
                 "rope_parameters", "rope_scaling", "rope_theta", "hidden_act", "attention_bias", "mlp_bias",
                 "tie_word_embeddings", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
                 "pad_token_id")
POSITION_IDS = ("computed in the graph from attention_mask: cumsum(mask) - 1 clamped at 0, the last `sequence` "
                "columns kept; rotary tables for positions below max_positions baked from the model's rotary "
                "embedding")
# rope types whose inverse frequencies change with the sequence length at run time
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _rotary(model: nn.Module) -> nn.Module:
    return model.model.rotary_emb


def spec(model: nn.Module) -> ExportSpec:
    """The graph's sizes; NotImplementedError (saying why) unless ``model`` is a causal LM of the architecture with
    a rope the graph can bake."""
    base = getattr(model, "model", None)
    if not isinstance(getattr(base, "layers", None), nn.ModuleList) or getattr(model, "lm_head", None) is None:
        raise NotImplementedError(f"fuseinfer.export exports causal LMs (e.g. LlamaForCausalLM), got a "
                                  f"{type(model).__name__}; load the checkpoint with AutoModelForCausalLM")
    cfg = model.config
    rotary = getattr(base, "rotary_emb", None)
    rope_type = getattr(rotary, "rope_type", None)
    if not isinstance(rope_type, str) or not isinstance(getattr(rotary, "inv_freq", None), torch.Tensor):
        raise NotImplementedError(f"fuseinfer.export found no single rotary embedding in this "
                                  f"{type(model).__name__} (rope type {rope_type!r}); export a model with one rope "
                                  "for all layers")
    if any(kind in rope_type for kind in LENGTH_DEPENDENT_ROPE):
        raise NotImplementedError(f"rope type {rope_type!r} recomputes its frequencies from the sequence length at "
                                  "run time, which one ONNX graph cannot; export a model with a static rope type "
                                  "(default, linear, llama3, yarn)")
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    if rotary.inv_freq.numel() * 2 != head_dim:
        raise NotImplementedError(f"the rotary embedding covers {rotary.inv_freq.numel() * 2} of {head_dim} head "
                                  "dims (partial rotary), which fuseinfer.export does not export")
    return ExportSpec(layers=cfg.num_hidden_layers, heads=heads, head_dim=head_dim, hidden=cfg.hidden_size,
                      vocab=cfg.vocab_size, max_positions=cfg.max_position_embeddings,
                      pad_token_id=getattr(cfg, "pad_token_id", None), position_ids=POSITION_IDS,
                      kv_heads=getattr(cfg, "num_key_value_heads", None) or heads)


@torch.no_grad()
def rotary_tables(model: nn.Module, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (positions, D/2) in the model's dtype: what the model's rotary embedding gives for positions
    0 .. positions - 1 (one half of its duplicated (.., D) rows), computed in fp32 as it does."""
    rotary = _rotary(model)
    inv_freq = rotary.inv_freq.float()
    pos = torch.arange(positions, device=inv_freq.device, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]  # (P, D/2)
    dtype = next(model.parameters()).dtype
    scale = rotary.attention_scaling
    return (freqs.cos() * scale).to(dtype), (freqs.sin() * scale).to(dtype)


def window_of(attn: nn.Module, config) -> int | None:
    """The sliding window of one attention module, or None: Qwen2 sets it per layer on the module, Mistral on the
    config for every layer."""
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window or None
    return getattr(config, "sliding_window", None) or None


class LayerOps:
    """The decoder layer's strategy protocol (models/llama/layer.py) over an export strategy: RMSNorm and the gated
    MLP by the strategy's ``rms_norm`` / ``gated_mlp``, the rest as they are."""

    def __init__(self, ops, layers: nn.ModuleList):
        self.ops = ops
        self._layer = {id(layer.mlp): i for i, layer in enumerate(layers)}  # the strategy binds gate / up by layer

    def norm(self, x, norm, residual=None):
        return self.ops.rms_norm(x, norm.weight, norm.variance_epsilon, residual)

    def linear(self, x, lin, residual=None):
        return self.ops.linear(x, lin, residual)

    def gated_mlp(self, mlp, x):
        return self.ops.gated_mlp(self._layer[id(mlp)], x, mlp.act_fn)

    def attention(self, i, attn, x, ctx):
        return self.ops.attention(i, attn, x, ctx)


class LlamaStepGraph(nn.Module):
    """A Llama-architecture causal LM -> one decoder step over explicit past tensors, built by ``ops`` (see the
    module docstring)."""

    def __init__(self, model: nn.Module, ops):
        super().__init__()
        self.spec = spec(model)
        self.model = model
        self.ops = ops
        sp, layers = self.spec, model.model.layers
        ops.bind([AttentionProjections(a.q_proj, a.k_proj, a.v_proj, sp.heads, sp.head_dim, a.scaling,
                                       kv_heads=sp.cache_heads, window=window_of(a, model.config))
                  for a in (layer.self_attn for layer in layers)],
                 [(layer.mlp.gate_proj, layer.mlp.up_proj) for layer in layers])
        self.layer_ops = LayerOps(ops, layers)
        # constants of the graph (plain attributes, not buffers: the traced graph takes them as initializers)
        self.rotary = rotary_tables(model, sp.max_positions)
        # how the graph attends, for the manifest
        self.attention = ("com.microsoft.RotaryEmbedding + com.microsoft.GroupQueryAttention (causal, key/value "
                          f"heads {sp.cache_heads}, padding as attention_bias: -10000 on padded keys; several new "
                          "tokens over a past need batch 1)"
                          if ops.flavour == "fused" else
                          "rotate_half with gathered cos / sin rows, k / v repeated per query-head group, MatMul / "
                          "Where(causal and not padding) / Softmax(fp32) / MatMul")

    def forward(self, input_ids, attention_mask, num_logits_to_keep, *past):
        base, ops, lops = self.model.model, self.ops, self.layer_ops
        s = input_ids.shape[1]
        positions = (torch.cumsum(attention_mask, dim=1) - 1).clamp(min=0)[:, -s:]  # (B, S)
        h = F.embedding(input_ids, base.embed_tokens.weight)  # (B, S, E)
        ctx = ops.context(attention_mask, s, past, positions=positions, rotary=self.rotary)
        for i, layer in enumerate(base.layers):
            h = decoder_layer(lops, i, layer, h, ctx)
        x = lops.norm(h, base.norm)[0]
        x = ops.last(x, num_logits_to_keep)  # (B, S or n, E)
        logits = ops.value(ops.linear(x, self.model.lm_head))  # (B, n, V)
        return (logits, *ctx.presents)
