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

Rotary families (models/llama/export.py) take, in the same two strategies, ``rms_norm`` (RMSNorm with the pending
residual: SkipSimplifiedLayerNormalization in the fused flavour, Pow / ReduceMean / Sqrt / Div / Mul in the plain
one), ``gated_mlp`` (act(gate) * up; fused: one FusedMatMul for gate and up), and, when the context carries rotary
tables, rotary attention with grouped-query key/value heads: RotaryEmbedding + GroupQueryAttention (past/present
with the key/value heads, the padding as its ``attention_bias``) in the fused flavour; rotate_half on the gathered
cos / sin rows and k / v repeated per query-head group in the plain one. Every contrib op runs on onnxruntime's
CPU provider (fp32 and fp16); what stays standard ops in the fused flavour: the first layer's RMSNorm (no residual
to skip; onnxruntime fuses it into SimplifiedLayerNormalization when it loads the graph), SiLU (Sigmoid, Mul) and
q/k/v biases (one Add: GroupQueryAttention has no bias input). GroupQueryAttention's limits: several new tokens over
a past need batch 1 (one-token steps and a fresh prefill take any batch), and the CUDA provider runs an
``attention_bias`` only in onnxruntime builds that support it there (older ones refuse it at run time).

The strategy protocol is the decoder layer's (``norm``, ``linear``, ``attention``: see models/opt/layer.py) plus what
a whole graph needs: ``bind(projections, mlps=())`` (the attention modules' :class:`~fuseinfer.models.base.
AttentionProjections` and the gated MLPs' (gate, up) linears, by layer, given once before tracing),
``context(attention_mask, s, past, positions=None, rotary=None)`` (the ``ctx`` of the layers: mask, past tensors,
position ids and rotary tables, and the ``presents`` list that ``attention`` appends each layer's key and value
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
    and the presents ``attention`` appends, in the same order; for rotary families also the position ids (B, S)
    and the rotary tables (cos, sin), each (max positions, D/2), and the raw attention mask (B, T)."""

    def __init__(self, mask, past, attention_mask=None, positions=None, rotary=None):
        self.mask, self.past, self.presents = mask, past, []
        self.attention_mask, self.positions, self.rotary = attention_mask, positions, rotary
        self.lengths = None  # GroupQueryAttention's (seqlens_k, total_sequence_length), made once per graph


class PlainOps:
    """Each step with standard ops, the way the Hugging Face model computes it."""

    flavour = "plain"

    def __init__(self, dtype):
        self.dtype = dtype
        self.projections, self.mlps = [], []

    def bind(self, projections, mlps=()) -> None:
        """``projections``: the attention modules' AttentionProjections by layer; ``mlps``: the (gate, up) linears
        of gated MLPs by layer (rotary families)."""
        self.projections = list(projections)
        self.mlps = list(mlps)

    # --- the graph's steps

    def context(self, attention_mask, s, past, positions=None, rotary=None) -> Context:
        """``positions`` (B, S) int64 and ``rotary`` (cos, sin) tables: rotary attention (see the module
        docstring); None for OPT's."""
        return Context(self.masks(attention_mask, s), past, attention_mask, positions, rotary)

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

    @staticmethod
    def _unpack(x, residual):
        """(y, skip, bias) of a tensor or a Pending and an optional residual."""
        y, skip, bias = x if isinstance(x, Pending) else (x, None, None)
        if residual is not None:
            if skip is not None:
                raise ValueError("a residual sum cannot take a second residual")
            skip = residual
        return y, skip, bias

    def norm(self, x, ln, residual=None):
        """(LayerNorm(x + residual), x + residual), ``x`` a tensor or a Pending (its bias and skip added too)."""
        y, skip, bias = self._unpack(x, residual)
        if skip is None:
            total = self.value(Pending(y, None, bias))
            return F.layer_norm(total, ln.normalized_shape, ln.weight, ln.bias, ln.eps), total
        return self.add_norm(y, skip, bias, ln)

    def add_norm(self, x, skip, bias, ln):
        """(LayerNorm(x + skip + bias), x + skip + bias); x, skip (B, S, E)."""
        total = x + skip if bias is None else x + skip + bias
        return F.layer_norm(total, ln.normalized_shape, ln.weight, ln.bias, ln.eps), total

    def rms_norm(self, x, weight, eps, residual=None):
        """(RMSNorm(x + residual) * weight, x + residual), ``x`` a tensor or a Pending (its bias and skip added)."""
        y, skip, bias = self._unpack(x, residual)
        if skip is None:
            total = self.value(Pending(y, None, bias))
            return contrib.rms_norm(total, weight, eps), total
        return self.add_rms_norm(y, skip, bias, weight, eps)

    def add_rms_norm(self, x, skip, bias, weight, eps):
        """(RMSNorm(x + skip + bias) * weight, x + skip + bias); x, skip (B, S, E)."""
        total = x + skip if bias is None else x + skip + bias
        return contrib.rms_norm(total, weight, eps), total

    def gated_mlp(self, i, x, act):
        """act(x @ gate.T + b) * (x @ up.T + b) of layer ``i``'s bound (gate, up): (B, S, F)."""
        gate, up = self.mlps[i]
        return act(F.linear(x, gate.weight, gate.bias)) * F.linear(x, up.weight, up.bias)

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
        hk = p.kv_heads or h
        split = lambda t, n: t.view(b, s, n, d).transpose(1, 2)  # (B, S, N*D) -> (B, N, S, D)
        q, k = p.q(x), p.k(x)  # (B, S, H*D), (B, S, Hkv*D)
        if ctx.rotary is not None:
            q = contrib.rotate(q, ctx.positions, *ctx.rotary, h)
            k = contrib.rotate(k, ctx.positions, *ctx.rotary, hk)
        q = split(q * p.scaling, h)
        k = torch.cat([ctx.past[2 * i], split(k, hk)], dim=2)  # (B, Hkv, T, D)
        v = torch.cat([ctx.past[2 * i + 1], split(p.v(x), hk)], dim=2)
        ctx.presents += [k, v]
        if hk != h:  # grouped-query: query head n reads key/value head n // (H / Hkv)
            t = k.shape[2]
            k = k[:, :, None].expand(b, hk, h // hk, t, d).reshape(b, h, t, d)  # (B, H, T, D)
            v = v[:, :, None].expand(b, hk, h // hk, t, d).reshape(b, h, t, d)
        scores = torch.matmul(q, k.transpose(-1, -2))  # (B, H, S, T)
        allowed = ctx.mask
        if p.window:  # a sliding window over the cache slots: key j within (i - window, i]
            t = k.shape[2]
            q_pos = torch.arange(s, device=x.device) + (t - s)  # (S,)
            allowed = allowed & (torch.arange(t, device=x.device)[None, :] > q_pos[:, None] - p.window)
        scores = torch.where(allowed, scores, torch.finfo(scores.dtype).min)
        probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v)  # (B, H, S, D)
        return out.transpose(1, 2).reshape(b, s, e if p.kv_heads is None else h * d)  # (B, S, H*D)


class FusedOps(PlainOps):
    """Each step as an onnxruntime contrib op where one fits."""

    flavour = "fused"

    def __init__(self, dtype):
        super().__init__(dtype)
        self.qkv = []
        self._ones = {}

    def bind(self, projections, mlps=()) -> None:
        """One (3E, E) q/k/v weight ((H + 2 Hkv) D rows with grouped-query heads) and its bias per attention
        module, and one (2F, E) gate/up weight per gated MLP, made once, before tracing: each projection becomes one
        GEMM. MultiHeadAttention takes the q/k/v bias (zeros where there is none); GroupQueryAttention has no bias
        input, so there a model's q/k/v bias is one Add after the GEMM (None without one)."""
        super().bind(projections, mlps)
        self.qkv, self.gate_up = [], []
        with torch.no_grad():  # constants of the graph, not parameters
            for p in self.projections:
                lins = (p.q, p.k, p.v)
                weight = torch.cat([lin.weight for lin in lins])  # (3E, E)
                biases = [lin.bias if lin.bias is not None else torch.zeros_like(lin.weight[:, 0]) for lin in lins]
                bias = torch.cat(biases)
                if self._grouped(p) and all(lin.bias is None for lin in lins):
                    bias = None
                self.qkv.append((weight, bias))
            for gate, up in self.mlps:
                bias = None if gate.bias is None and up.bias is None else torch.cat(
                    [lin.bias if lin.bias is not None else torch.zeros_like(lin.weight[:, 0]) for lin in (gate, up)])
                self.gate_up.append((torch.cat([gate.weight, up.weight]), bias))  # (2F, E), (2F,)

    @staticmethod
    def _grouped(p) -> bool:
        """Whether the attention runs as GroupQueryAttention: grouped-query heads, or a rotary family's (which
        binds ``kv_heads`` even when it equals ``num_heads``)."""
        return p.kv_heads is not None

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

    def add_rms_norm(self, x, skip, bias, weight, eps):
        return contrib.SkipRMSNorm.apply(x, skip, weight, bias, eps)

    def gated_mlp(self, i, x, act):
        weight, bias = self.gate_up[i]
        f = weight.shape[0] // 2  # a Python int: a traced size would make the Split's sizes dynamic
        y = contrib.FusedMatMul.apply(x, weight)  # (B, S, 2F)
        if bias is not None:
            y = y + bias
        gate, up = y.split([f, f], dim=-1)
        return act(gate) * up

    def matmul(self, x, weight):
        return contrib.FusedMatMul.apply(x, weight)

    def mlp_in(self, x, lin, activation):
        y = contrib.FusedMatMul.apply(x, lin.weight)  # (B, S, F)
        if type(activation).__name__ in ("GELUActivation", "GELU") and lin.bias is not None:  # erf gelu
            return contrib.BiasGelu.apply(y, lin.bias)
        return activation(y if lin.bias is None else y + lin.bias)

    def attention(self, i, attn, x, ctx):
        p = self.projections[i]
        if self._grouped(p):
            return self.grouped_attention(i, p, x, ctx)
        e = p.num_heads * p.head_dim  # a Python int: a traced size would make the Split's sizes dynamic
        weight, bias = self.qkv[i]
        q, k, v = contrib.FusedMatMul.apply(x, weight).split([e, e, e], dim=-1)  # 3 x (B, S, E)
        out, present_k, present_v = contrib.MultiHeadAttention.apply(
            q, k, v, bias, ctx.mask, ctx.past[2 * i], ctx.past[2 * i + 1], p.num_heads, p.scaling)
        ctx.presents += [present_k, present_v]
        return out

    def grouped_attention(self, i, p, x, ctx):
        """RotaryEmbedding on q and k (when the context has rotary tables), then GroupQueryAttention over the past
        with Hkv heads: x (B, S, E) -> (B, S, H*D)."""
        h, hk, d = p.num_heads, p.kv_heads, p.head_dim
        weight, bias = self.qkv[i]
        y = contrib.FusedMatMul.apply(x, weight)  # (B, S, (H + 2 Hkv) D)
        if bias is not None:
            y = y + bias
        q, k, v = y.split([h * d, hk * d, hk * d], dim=-1)
        if ctx.rotary is not None:
            q = contrib.Rotary.apply(q, ctx.positions, *ctx.rotary, h)
            k = contrib.Rotary.apply(k, ctx.positions, *ctx.rotary, hk)
        if ctx.lengths is None:
            ctx.lengths = contrib.SeqLens.apply(ctx.attention_mask)
        out, present_k, present_v = contrib.GroupQueryAttention.apply(
            q, k, v, ctx.past[2 * i], ctx.past[2 * i + 1], *ctx.lengths, ctx.mask, h, hk, p.scaling,
            p.window or -1)
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
