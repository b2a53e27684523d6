"""OPT's ONNX export graph: one decoder step of an ``OPTForCausalLM`` over explicit past tensors, for
``torch.onnx.export`` to trace (the family's ``export_graph``).

The export strategy ``ops`` (fuseinfer.export.graph: standard ONNX ops or onnxruntime contrib ops) builds each step;
this module says what OPT computes around the decoder layers, and runs each layer through :func:`decoder_layer`:

* position ids as OPT computes them, inside the graph: ``cumsum(mask) * mask - 1`` over the whole mask, sliced to
  the last S columns (a padded slot gets -1, the position table's row 1 after OPT's offset of 2);
* token embeddings (through ``project_in`` when the model has one) plus position embeddings, a residual sum that
  the first layer's LayerNorm takes (pre-LN; post-LN adds them first);
* after the layers: the final LayerNorm (pre-LN models that have one), the last ``num_logits_to_keep`` positions,
  ``project_out`` when the model has one, and the LM head.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fuseinfer.models.base import AttentionProjections, ExportSpec
from fuseinfer.models.opt.layer import decoder_layer

# the profiler's kinds of an exported OPT graph's matrix products (see ModelFamily.ort_matmul_kinds)
ORT_MATMUL_KINDS = {"qkv": "qkv", "out": "attn_out", "mlp_in": "mlp_in", "mlp_out": "mlp_out", "head": "lm_head"}

# the configuration fields the graph depends on (others, e.g. transformers_version, do not matter): an export
# records their hash, so a change here makes earlier exports stale
CONFIG_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "ffn_dim", "num_attention_heads",
                 "max_position_embeddings", "word_embed_proj_dim", "do_layer_norm_before",
                 "_remove_final_layer_norm", "activation_function", "enable_bias", "layer_norm_elementwise_affine",
                 "pad_token_id")
POSITION_IDS = ("computed in the graph from attention_mask as OPT does: cumsum(mask) * mask - 1 over the whole mask, "
                "the last `sequence` columns kept, + 2 (OPT's offset) into the position table")


def spec(model: nn.Module) -> ExportSpec:
    """The graph's sizes; NotImplementedError unless ``model`` is a causal LM (a decoder and an LM head)."""
    if not hasattr(getattr(model, "model", None), "decoder") or getattr(model, "lm_head", None) is None:
        raise NotImplementedError(f"fuseinfer.export exports OPT causal LMs (OPTForCausalLM), got a "
                                  f"{type(model).__name__}; load the checkpoint with AutoModelForCausalLM")
    cfg = model.config
    return ExportSpec(layers=cfg.num_hidden_layers, heads=cfg.num_attention_heads,
                      head_dim=cfg.hidden_size // cfg.num_attention_heads, hidden=cfg.hidden_size,
                      vocab=cfg.vocab_size, max_positions=cfg.max_position_embeddings, pad_token_id=cfg.pad_token_id,
                      position_ids=POSITION_IDS)


class OPTStepGraph(nn.Module):
    """OPTForCausalLM -> one decoder step over explicit past tensors, built by ``ops`` (see the module docstring)."""

    def __init__(self, model: nn.Module, ops):
        super().__init__()
        self.spec = spec(model)
        self.model = model
        self.ops = ops
        self.pre_ln = model.config.do_layer_norm_before
        ops.bind([AttentionProjections(a.q_proj, a.k_proj, a.v_proj, a.num_heads, a.head_dim, a.scaling)
                  for a in (layer.self_attn for layer in model.model.decoder.layers)])

    def forward(self, input_ids, attention_mask, num_logits_to_keep, *past):
        dec, ops = self.model.model.decoder, self.ops
        s = input_ids.shape[1]
        positions = (torch.cumsum(attention_mask, dim=1) * attention_mask - 1)[:, -s:]  # (B, S) as OPT
        tok = F.embedding(input_ids, dec.embed_tokens.weight)  # (B, S, W)
        if dec.project_in is not None:
            tok = ops.value(ops.linear(tok, dec.project_in))  # (B, S, E)
        pos = F.embedding(positions + dec.embed_positions.offset, dec.embed_positions.weight)  # (B, S, E)
        ctx = ops.context(attention_mask, s, past)
        h = ops.add(tok, pos)
        if not self.pre_ln:  # post-LN: the first layer attends over the sum itself
            h = ops.value(h)
        for i, layer in enumerate(dec.layers):
            h = decoder_layer(ops, i, layer, h, ctx, self.pre_ln)
        if dec.final_layer_norm is not None:
            x = ops.norm(h, dec.final_layer_norm)[0]
        else:  # post-LN, or a pre-LN model without one (_remove_final_layer_norm)
            x = ops.value(h)
        x = ops.last(x, num_logits_to_keep)  # (B, S or n, E)
        if dec.project_out is not None:
            x = ops.value(ops.linear(x, dec.project_out))  # (B, n, W)
        logits = ops.value(ops.linear(x, self.model.lm_head))  # (B, n, V)
        return (logits, *ctx.presents)
