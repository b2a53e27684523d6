"""The export strategies, and ``DecoderGraph(model, flavour)``: the module ``torch.onnx.export`` traces.

The model family writes the graph (``family.export_graph(model, ops)``: for OPT, models/opt/export.py runs the one
decoder layer of models/opt/layer.py); the strategy ``ops`` built here says how each step becomes ONNX nodes. The
traced module computes, for one call:

    inputs   input_ids (B, S) int64, attention_mask (B, P + S) int64 (1 = token, 0 = padding),
             num_logits_to_keep (1,) int64 (0 = logits for all S positions, n = the last n),
             past_key_<i>, past_value_<i> (B, H, P, D) for each layer i (P may be 0)
    outputs  logits (B, S or n, V), present_key_<i>, present_value_<i> (B, H, P + S, D)

Two flavours, two strategies:
* ``plain`` (:class:`PlainOps`): standard ONNX ops only (Gather, MatMul, Add, LayerNormalization, Softmax, ...), as
  the Hugging Face model computes them (the causal + padding mask applied with a Where before the softmax).
* ``fused`` (:class:`FusedOps`): onnxruntime contrib ops (see contrib.py): SkipLayerNormalization for every residual
  add + LayerNorm (the first one adds the token and position embeddings), MultiHeadAttention with past/present,
  causal through ``unidirectional`` and the padding as an additive ``attention_bias``, one q/k/v FusedMatMul (its
  bias folded into MultiHeadAttention), FusedMatMul(transB) for the other projections (biases folded into the next
  SkipLayerNormalization), BiasGelu for gelu models, ReLU as a plain Add + Relu.

The strategy protocol is the decoder layer's (``norm``, ``linear``, ``attention``: see models/opt/layer.py) plus what
a whole graph needs: ``bind(projections)`` (the attention modules' :class:`~fuseinfer.models.base.
AttentionProjections`, by layer, given once before tracing), ``context(attention_mask, s, past)`` (the ``ctx`` of
the layers: mask, past tensors, and the ``presents`` list that ``attention`` appends each layer's key and value
to), ``add(x, residual)`` (a residual sum that the next ``norm`` takes), ``value(x)`` (a tensor of a pending result)
and ``last(x, keep)`` (the last ``keep`` positions, all of them for 0). ``linear`` without an activation returns a
:class:`Pending` ``x @ W.T`` whose bias and residual the next ``norm`` adds: one SkipLayerNormalization in the fused
flavour, and the same sums in the same order in the plain one.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from fuseinfer.export import contrib
from fuseinfer.models import family

FLAVOURS = ("fused", "plain")
PADDING_BIAS = -10000.0  # added to the scores of padded keys (fused); finite, so no fp16 overflow to -inf and NaN


class Pending(NamedTuple):
    """``y + skip + bias`` not yet computed (``skip`` / ``bias`` may be None): the next LayerNorm takes all three."""
    y: torch.Tensor
    skip: torch.Tensor | None
    bias: torch.Tensor | None


class Context:
    """The layers' ``ctx``: the attention mask as the strategy applies it, the past tensors (key, value per layer)
    and the presents ``attention`` appends, in the same order."""

    def __init__(self, mask, past):
        self.mask, self.past, self.presents = mask, past, []


class PlainOps:
    """Each step with standard ops, the way the Hugging Face model computes it."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.projections = []

    def bind(self, projections) -> None:
        self.projections = list(projections)

    # --- the graph's steps

    def context(self, attention_mask, s, past) -> Context:
        return Context(self.masks(attention_mask, s), past)

    def masks(self, attention_mask, s):
        """attention_mask (B, T) -> allowed (B, 1, S, T) bool: causal (query i sees keys up to T - S + i) and not
        padding."""
        t = attention_mask.shape[1]
        q_pos = torch.arange(s, device=attention_mask.device) + (t - s)  # (S,)
        causal = torch.arange(t, device=attention_mask.device)[None, :] <= q_pos[:, None]  # (S, T)
        return causal[None, None] & (attention_mask[:, None, None, :] > 0)  # (B, 1, S, T)

    def add(self, x, residual) -> Pending:
        return Pending(x, residual, None)

    def value(self, x):
        """The tensor of ``x``: a Pending's sum, in the order ``norm`` adds it."""
        if not isinstance(x, Pending):
            return x
        y, skip, bias = x
        total = y if skip is None else y + skip
        return total if bias is None else total + bias

    def last(self, x, keep):
        return contrib.SliceLast.apply(x, keep)  # (B, S or n, E)

    # --- the decoder layer's protocol

    def norm(self, x, ln, residual=None):
        """(LayerNorm(x + residual), x + residual), ``x`` a tensor or a Pending (its bias and skip added too)."""
        y, skip, bias = x if isinstance(x, Pending) else (x, None, None)
        if residual is not None:
            if skip is not None:
                raise ValueError("a residual sum cannot take a second residual")
            skip = residual
        if skip is None:
            total = self.value(Pending(y, None, bias))
            return F.layer_norm(total, ln.normalized_shape, ln.weight, ln.bias, ln.eps), total
        return self.add_norm(y, skip, bias, ln)

    def add_norm(self, x, skip, bias, ln):
        """(LayerNorm(x + skip + bias), x + skip + bias); x, skip (B, S, E)."""
        total = x + skip if bias is None else x + skip + bias
        return F.layer_norm(total, ln.normalized_shape, ln.weight, ln.bias, ln.eps), total

    def linear(self, x, lin, residual=None, activation=None):
        """act(x @ W.T + b) (+ residual, pending) with an activation; else a Pending ``x @ W.T`` + b + residual."""
        if activation is None:
            return Pending(self.matmul(x, lin.weight), residual, lin.bias)
        out = self.mlp_in(x, lin, activation)
        return out if residual is None else Pending(out, residual, None)

    def matmul(self, x, weight):
        return F.linear(x, weight)  # (B, S, out)

    def mlp_in(self, x, lin, activation):
        return activation(F.linear(x, lin.weight, lin.bias))

    def attention(self, i, attn, x, ctx):
        """x (B, S, E) -> context (B, S, E) before the output projection; appends layer ``i``'s present key and
        value (B, H, T, D) to ``ctx.presents``."""
        p = self.projections[i]
        b, s, e = x.shape
        h, d = p.num_heads, p.head_dim
        split = lambda t: t.view(b, s, h, d).transpose(1, 2)  # (B, S, E) -> (B, H, S, D)
        q = split(p.q(x) * p.scaling)
        k = torch.cat([ctx.past[2 * i], split(p.k(x))], dim=2)  # (B, H, T, D)
        v = torch.cat([ctx.past[2 * i + 1], split(p.v(x))], dim=2)
        scores = torch.matmul(q, k.transpose(-1, -2))  # (B, H, S, T)
        scores = torch.where(ctx.mask, scores, torch.finfo(scores.dtype).min)
        probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v)  # (B, H, S, D)
        ctx.presents += [k, v]
        return out.transpose(1, 2).reshape(b, s, e)


class FusedOps(PlainOps):
    """Each step as an onnxruntime contrib op where one fits."""

    def __init__(self, dtype):
        super().__init__(dtype)
        self.qkv = []
        self._ones = {}

    def bind(self, projections) -> None:
        """One (3E, E) q/k/v weight and (3E,) bias per attention module, made once, before tracing:
        MultiHeadAttention takes the bias, the projection becomes one GEMM."""
        super().bind(projections)
        self.qkv = []
        for p in self.projections:
            with torch.no_grad():  # constants of the graph, not parameters
                weight = torch.cat([p.q.weight, p.k.weight, p.v.weight])  # (3E, E)
                biases = [lin.bias if lin.bias is not None else torch.zeros_like(lin.weight[:, 0])
                          for lin in (p.q, p.k, p.v)]
                self.qkv.append((weight, torch.cat(biases)))

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
        gamma, beta = self._affine(ln, x.shape[-1], x.device)
        return contrib.SkipLayerNorm.apply(x, skip, gamma, beta, bias, ln.eps)

    def matmul(self, x, weight):
        return contrib.FusedMatMul.apply(x, weight)

    def mlp_in(self, x, lin, activation):
        y = contrib.FusedMatMul.apply(x, lin.weight)  # (B, S, F)
        if type(activation).__name__ in ("GELUActivation", "GELU") and lin.bias is not None:  # erf gelu
            return contrib.BiasGelu.apply(y, lin.bias)
        return activation(y if lin.bias is None else y + lin.bias)

    def attention(self, i, attn, x, ctx):
        p = self.projections[i]
        e = p.num_heads * p.head_dim  # a Python int: a traced size would make the Split's sizes dynamic
        weight, bias = self.qkv[i]
        q, k, v = contrib.FusedMatMul.apply(x, weight).split([e, e, e], dim=-1)  # 3 x (B, S, E)
        out, present_k, present_v = contrib.MultiHeadAttention.apply(
            q, k, v, bias, ctx.mask, ctx.past[2 * i], ctx.past[2 * i + 1], p.num_heads, p.scaling)
        ctx.presents += [present_k, present_v]
        return out


def make_ops(flavour: str, dtype: torch.dtype):
    """The strategy of ``flavour`` (one of FLAVOURS) for a model in ``dtype``."""
    if flavour not in FLAVOURS:
        raise ValueError(f"flavour must be one of {FLAVOURS}, got {flavour!r}")
    return FusedOps(dtype) if flavour == "fused" else PlainOps(dtype)


def DecoderGraph(model: nn.Module, flavour: str = "fused") -> nn.Module:
    """The module to trace for ``model`` (a causal LM of a family with an export) in ``flavour``; its ``spec`` is
    the graph's :class:`~fuseinfer.models.base.ExportSpec`."""
    ops = make_ops(flavour, next(model.parameters()).dtype)
    fam = family(getattr(getattr(model, "config", None), "model_type", None))
    if fam is None:
        raise NotImplementedError(f"no ONNX export for a {type(model).__name__}")
    graph = fam.export_graph(model, ops)
    graph.flavour = flavour
    return graph
