"""The module ``torch.onnx.export`` traces: a functional OPT decoder over explicit KV-cache tensors.

``DecoderGraph(model, flavour)`` reads the weights of a Hugging Face ``OPTForCausalLM`` (no copy, except the
fused flavour's concatenated q/k/v weight) and computes, for one call:

    inputs   input_ids (B, S) int64, attention_mask (B, P + S) int64 (1 = token, 0 = padding),
             num_logits_to_keep (1,) int64 (0 = logits for all S positions, n = the last n),
             past_key_<i>, past_value_<i> (B, H, P, D) for each layer i (P may be 0)
    outputs  logits (B, S or n, V), present_key_<i>, present_value_<i> (B, H, P + S, D)

Position ids are part of the graph, computed as OPT computes them: ``cumsum(mask) * mask - 1`` over the whole
mask, sliced to the last S columns (a padded slot gets -1, the embedding table's row 1 after OPT's offset of 2).

Two flavours share this forward and differ in the ``Ops`` object that builds each step:
* ``plain``: standard ONNX ops only (Gather, MatMul, Add, LayerNormalization, Softmax, ...), as the Hugging Face
  model computes them (the causal + padding mask applied with a Where before the softmax).
* ``fused``: onnxruntime contrib ops (see contrib.py): SkipLayerNormalization for every residual add + LayerNorm
  (the first one adds the token and position embeddings), MultiHeadAttention with past/present, causal through
  ``unidirectional`` and the padding as an additive ``attention_bias``, one q/k/v FusedMatMul (its bias folded
  into MultiHeadAttention), FusedMatMul(transB) for the other projections (biases folded into the next
  SkipLayerNormalization), BiasGelu for gelu models, ReLU as a plain Add + Relu.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fuseinfer.export import contrib

FLAVOURS = ("fused", "plain")
PADDING_BIAS = -10000.0  # added to the scores of padded keys (fused); finite, so no fp16 overflow to -inf and NaN


class PlainOps:
    """Each step with standard ops, the way the Hugging Face model computes it."""

    def __init__(self, dtype):
        self.dtype = dtype

    def masks(self, attention_mask, s):
        """attention_mask (B, T) -> allowed (B, 1, S, T) bool: causal (query i sees keys up to T - S + i) and not
        padding."""
        t = attention_mask.shape[1]
        q_pos = torch.arange(s, device=attention_mask.device) + (t - s)  # (S,)
        causal = torch.arange(t, device=attention_mask.device)[None, :] <= q_pos[:, None]  # (S, T)
        return causal[None, None] & (attention_mask[:, None, None, :] > 0)  # (B, 1, S, T)

    def add_norm(self, x, skip, bias, ln):
        """(LayerNorm(x + skip + bias) or None without ``ln``, x + skip + bias); x, skip (B, S, E)."""
        total = x + skip if bias is None else x + skip + bias
        if ln is None:
            return None, total
        return F.layer_norm(total, ln.normalized_shape, ln.weight, ln.bias, ln.eps), total

    def matmul(self, x, weight):
        return F.linear(x, weight)  # (B, S, out)

    def ffn_in(self, x, fc1, activation):
        return activation(F.linear(x, fc1.weight, fc1.bias))

    def attention(self, attn, x, allowed, past_k, past_v):
        """x (B, S, E) -> (context (B, S, E) before out_proj, present_k, present_v (B, H, T, D))."""
        b, s, e = x.shape
        h, d = attn.num_heads, attn.head_dim
        split = lambda t: t.view(b, s, h, d).transpose(1, 2)  # (B, S, E) -> (B, H, S, D)
        q = split(attn.q_proj(x) * attn.scaling)
        k = torch.cat([past_k, split(attn.k_proj(x))], dim=2)  # (B, H, T, D)
        v = torch.cat([past_v, split(attn.v_proj(x))], dim=2)
        scores = torch.matmul(q, k.transpose(-1, -2))  # (B, H, S, T)
        scores = torch.where(allowed, scores, torch.finfo(scores.dtype).min)
        probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v)  # (B, H, S, D)
        return out.transpose(1, 2).reshape(b, s, e), k, v


class FusedOps(PlainOps):
    """Each step as an onnxruntime contrib op where one fits."""

    def __init__(self, dtype, model):
        super().__init__(dtype)
        # one (3E, E) q/k/v weight and (3E,) bias per attention module, made once: MultiHeadAttention takes the
        # bias, the projection becomes one GEMM
        self.qkv = {}
        for layer in model.model.decoder.layers:
            a = layer.self_attn
            with torch.no_grad():  # constants of the graph, not parameters
                weight = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])  # (3E, E)
                biases = [p.bias if p.bias is not None else torch.zeros_like(p.weight[:, 0])
                          for p in (a.q_proj, a.k_proj, a.v_proj)]
                self.qkv[id(a)] = (weight, torch.cat(biases))
        self._ones = {}

    def masks(self, attention_mask, s):
        """attention_mask (B, T) -> additive attention_bias (B, 1, S, T): PADDING_BIAS on padded keys."""
        b, t = attention_mask.shape
        bias = (attention_mask[:, None, None, :] == 0).to(self.dtype) * PADDING_BIAS  # (B, 1, 1, T)
        return bias.expand(b, 1, s, t)

    def _affine(self, ln, e, device):
        """LayerNorm gamma, beta; ones and zeros for a LayerNorm without elementwise affine."""
        if ln.weight is not None:
            return ln.weight, ln.bias if ln.bias is not None else torch.zeros_like(ln.weight)
        if e not in self._ones:
            self._ones[e] = (torch.ones(e, dtype=self.dtype, device=device),
                             torch.zeros(e, dtype=self.dtype, device=device))
        return self._ones[e]

    def add_norm(self, x, skip, bias, ln):
        if ln is None:
            return super().add_norm(x, skip, bias, ln)
        gamma, beta = self._affine(ln, x.shape[-1], x.device)
        return contrib.SkipLayerNorm.apply(x, skip, gamma, beta, bias, ln.eps)

    def matmul(self, x, weight):
        return contrib.FusedMatMul.apply(x, weight)

    def ffn_in(self, x, fc1, activation):
        y = contrib.FusedMatMul.apply(x, fc1.weight)  # (B, S, F)
        if type(activation).__name__ in ("GELUActivation", "GELU") and fc1.bias is not None:  # erf gelu
            return contrib.BiasGelu.apply(y, fc1.bias)
        return activation(y if fc1.bias is None else y + fc1.bias)

    def attention(self, attn, x, attn_bias, past_k, past_v):
        e = attn.embed_dim  # a Python int: a traced size would make the Split's sizes dynamic
        weight, bias = self.qkv[id(attn)]
        q, k, v = contrib.FusedMatMul.apply(x, weight).split([e, e, e], dim=-1)  # 3 x (B, S, E)
        return contrib.MultiHeadAttention.apply(q, k, v, bias, attn_bias, past_k, past_v, attn.num_heads,
                                                attn.scaling)


class DecoderGraph(nn.Module):
    """OPTForCausalLM -> one decoder step over explicit past tensors (see the module docstring)."""

    def __init__(self, model: nn.Module, flavour: str = "fused"):
        super().__init__()
        if flavour not in FLAVOURS:
            raise ValueError(f"flavour must be one of {FLAVOURS}, got {flavour!r}")
        self.model = model
        self.flavour = flavour
        dtype = next(model.parameters()).dtype
        self.ops = FusedOps(dtype, model) if flavour == "fused" else PlainOps(dtype)
        cfg = model.config
        self.num_layers = cfg.num_hidden_layers
        self.pre_ln = cfg.do_layer_norm_before

    def forward(self, input_ids, attention_mask, num_logits_to_keep, *past):
        dec, ops = self.model.model.decoder, self.ops
        s = input_ids.shape[1]
        positions = (torch.cumsum(attention_mask, dim=1) * attention_mask - 1)[:, -s:]  # (B, S) as OPT
        tok = F.embedding(input_ids, dec.embed_tokens.weight)  # (B, S, W)
        if dec.project_in is not None:
            tok = ops.matmul(tok, dec.project_in.weight)  # (B, S, E)
        pos = F.embedding(positions + dec.embed_positions.offset, dec.embed_positions.weight)  # (B, S, E)
        masks = ops.masks(attention_mask, s)
        layers = dec.layers
        if self.pre_ln:
            x, h = ops.add_norm(tok, pos, None, layers[0].self_attn_layer_norm)  # x: LayerNorm of h
        else:
            h = tok + pos
            x = h
        presents = []
        for i, layer in enumerate(layers):
            ctx, pk, pv = ops.attention(layer.self_attn, x, masks, past[2 * i], past[2 * i + 1])
            presents += [pk, pv]
            o = ops.matmul(ctx, layer.self_attn.out_proj.weight)  # (B, S, E), bias added with the residual
            if self.pre_ln:
                x, h = ops.add_norm(o, h, layer.self_attn.out_proj.bias, layer.final_layer_norm)
            else:
                h, _ = ops.add_norm(o, h, layer.self_attn.out_proj.bias, layer.self_attn_layer_norm)
                x = h
            f = ops.matmul(ops.ffn_in(x, layer.fc1, layer.activation_fn), layer.fc2.weight)  # (B, S, E)
            if self.pre_ln:
                nxt = layers[i + 1].self_attn_layer_norm if i + 1 < len(layers) else dec.final_layer_norm
                x, h = ops.add_norm(f, h, layer.fc2.bias, nxt)
                if x is None:  # no final LayerNorm (_remove_final_layer_norm)
                    x = h
            else:
                h, _ = ops.add_norm(f, h, layer.fc2.bias, layer.final_layer_norm)
                x = h
        x = contrib.SliceLast.apply(x, num_logits_to_keep)  # (B, S or n, E)
        if dec.project_out is not None:
            x = ops.matmul(x, dec.project_out.weight)  # (B, n, W)
        logits = ops.matmul(x, self.model.lm_head.weight)  # (B, n, V)
        return (logits, *presents)
