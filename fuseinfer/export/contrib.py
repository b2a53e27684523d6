"""onnxruntime contrib ops (domain ``com.microsoft``) as traceable PyTorch functions.

Each op is a ``torch.autograd.Function`` whose ``forward`` is the PyTorch reference of the op (what runs while
``torch.onnx.export`` traces, and what the wrapper's eager output is checked with) and whose ``symbolic`` emits
the contrib node. This is the TorchScript exporter's documented way to map a function to a custom-domain op: the
fused graph comes out of one export pass, with no pattern matching over a plain graph afterwards (a post-export
rewrite would have to recognise decomposed attention and LayerNorm subgraphs, which change with exporter
versions). The op semantics follow onnxruntime's ContribOperators.md:

* ``SkipLayerNormalization(input, skip, gamma, beta, bias)`` -> (output, mean, inv_std_var, input_skip_bias_sum):
  ``sum = input + skip + bias``; ``output = LayerNorm(sum)``. Outputs 1 and 2 are dropped after export.
* ``MultiHeadAttention(query, key, value, bias, key_padding_mask, attention_bias, past_key, past_value)`` ->
  (output, present_key, present_value): query/key/value (B, S, N*D) before their bias, ``bias`` (3*N*D),
  ``attention_bias`` added to the scores (B or 1, N or 1, S, T), past/present (B, N, past/T, D) (BNSH),
  ``unidirectional=1``: query i sees keys up to past + i, ``scale`` multiplies Q K^T.
* ``BiasGelu(input, bias)``: gelu(input + bias) (erf gelu), for configs whose activation is gelu.
* ``SkipSimplifiedLayerNormalization(input, skip, gamma, bias)`` -> (output, mean, inv_std_var,
  input_skip_bias_sum): ``sum = input + skip + bias``; ``output = RMSNorm(sum) * gamma`` (rotary families).
* ``RotaryEmbedding(input, position_ids, cos_cache, sin_cache)``: input (B, S, N*D), position_ids (B, S) int64,
  caches (max positions, D/2); ``interleaved=0`` rotates the two halves of each head (rotate_half).
* ``GroupQueryAttention(query, key, value, past_key, past_value, seqlens_k, total_sequence_length, cos_cache,
  sin_cache, position_ids, attention_bias)`` -> (output, present_key, present_value): query (B, S, N*D), key /
  value (B, S, Nkv*D) (rotary already applied: ``do_rotary=0``), past/present (B, Nkv, past/T, D) (BNSH),
  ``seqlens_k`` (B,) int32 = T - 1 and ``total_sequence_length`` int32 scalar = T (every row holds T slots: left
  padding is masked by ``attention_bias`` (B, 1, S, T), not by lengths), causal, ``local_window_size`` = the
  sliding window W (query i sees keys i - W < j <= i, as transformers' sliding window; onnxruntime's CPU provider
  checked against it) or -1 for none.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

MS = "com.microsoft"


def _same_type(value, like, same_shape=True):
    """Give a symbolic output the dtype (and the shape, when it is the same) of ``like``: the exporter's shape
    inference knows nothing of contrib ops, and a wrong static shape would mislead the ops after them."""
    if same_shape:
        value.setType(like.type())
    else:
        value.setType(like.type().with_sizes([None] * len(like.type().varyingSizes())))
    return value


class SkipLayerNorm(torch.autograd.Function):
    """(x, skip, gamma, beta, bias | None, eps) -> (LayerNorm(x + skip + bias), x + skip + bias)."""

    @staticmethod
    def forward(ctx, x, skip, gamma, beta, bias, eps):
        total = x + skip if bias is None else x + skip + bias  # (B, S, E)
        return F.layer_norm(total, tuple(gamma.shape), gamma, beta, eps), total

    @staticmethod
    def symbolic(g, x, skip, gamma, beta, bias, eps):
        inputs = [x, skip, gamma, beta] + ([bias] if bias is not None else [])
        out, _mean, _inv_std, total = g.op(f"{MS}::SkipLayerNormalization", *inputs, epsilon_f=eps, outputs=4)
        return _same_type(out, x), _same_type(total, x)


class MultiHeadAttention(torch.autograd.Function):
    """Causal self-attention with a KV cache; see the module docstring for shapes."""

    @staticmethod
    def forward(ctx, q, k, v, bias, attn_bias, past_k, past_v, num_heads, scale):
        b, s, e = q.shape
        d = e // num_heads
        bq, bk, bv = bias.split(e)
        split = lambda t: t.view(b, s, num_heads, d).transpose(1, 2)  # (B, S, E) -> (B, N, S, D)
        k_all = torch.cat([past_k, split(k + bk)], dim=2)  # (B, N, T, D)
        v_all = torch.cat([past_v, split(v + bv)], dim=2)  # (B, N, T, D)
        t = k_all.shape[2]
        scores = torch.matmul(split(q + bq).float(), k_all.float().transpose(-1, -2)) * scale  # (B, N, S, T)
        if attn_bias is not None:
            scores = scores + attn_bias.float()
        q_pos = torch.arange(s, device=q.device) + (t - s)  # absolute position of each query
        causal = torch.arange(t, device=q.device)[None, :] <= q_pos[:, None]  # (S, T)
        scores = scores.masked_fill(~causal, torch.finfo(torch.float32).min)
        out = torch.matmul(scores.softmax(-1), v_all.float()).to(q.dtype)  # (B, N, S, D)
        return out.transpose(1, 2).reshape(b, s, e), k_all, v_all

    @staticmethod
    def symbolic(g, q, k, v, bias, attn_bias, past_k, past_v, num_heads, scale):
        none = g.op("prim::Constant").setType(torch._C.OptionalType.ofTensor())  # an omitted optional input
        out, present_k, present_v = g.op(
            f"{MS}::MultiHeadAttention", q, k, v, bias, none, attn_bias if attn_bias is not None else none,
            past_k, past_v, num_heads_i=num_heads, scale_f=scale, unidirectional_i=1, outputs=3)
        return _same_type(out, q), _same_type(present_k, past_k, False), _same_type(present_v, past_v, False)


class BiasGelu(torch.autograd.Function):
    """(x, bias) -> gelu(x + bias), erf form."""

    @staticmethod
    def forward(ctx, x, bias):
        return F.gelu(x + bias)

    @staticmethod
    def symbolic(g, x, bias):
        return _same_type(g.op(f"{MS}::BiasGelu", x, bias), x)


class SliceLast(torch.autograd.Function):
    """(hidden (B, S, E), keep int64 (1,)) -> hidden[:, -keep:] (all of it when keep is 0), with ``keep`` a graph
    input: tracing would turn ``hidden[:, -int(keep):]`` into a constant, so the Slice is emitted by hand."""

    @staticmethod
    def forward(ctx, hidden, keep):
        return hidden[:, -int(keep.reshape(-1)[0]):]

    @staticmethod
    def symbolic(g, hidden, keep):
        starts = g.op("Neg", keep)
        ends = g.op("Constant", value_t=torch.tensor([2**62], dtype=torch.int64))
        axes = g.op("Constant", value_t=torch.tensor([1], dtype=torch.int64))
        return _same_type(g.op("Slice", hidden, starts, ends, axes), hidden, False)


class FusedMatMul(torch.autograd.Function):
    """(x (..., K), weight (N, K)) -> x @ weight.T, as ``FusedMatMul(transB=1)``: the nn.Linear weight is used as
    stored, so the export neither transposes nor duplicates it (a tied LM head shares the embedding table)."""

    @staticmethod
    def forward(ctx, x, weight):
        return torch.matmul(x, weight.t())

    @staticmethod
    def symbolic(g, x, weight):
        return _same_type(g.op(f"{MS}::FusedMatMul", x, weight, transA_i=0, transB_i=1, alpha_f=1.0), x, False)


def rms_norm(total, gamma, eps):
    """RMSNorm as transformers' Llama computes it: in fp32, cast back, then scaled by gamma. total (..., E)."""
    t32 = total.float()
    y = t32 * torch.rsqrt(t32.pow(2).mean(-1, keepdim=True) + eps)
    return gamma * y.to(total.dtype)


class SkipRMSNorm(torch.autograd.Function):
    """(x, skip, gamma, bias | None, eps) -> (RMSNorm(x + skip + bias) * gamma, x + skip + bias)."""

    @staticmethod
    def forward(ctx, x, skip, gamma, bias, eps):
        total = x + skip if bias is None else x + skip + bias  # (B, S, E)
        return rms_norm(total, gamma, eps), total

    @staticmethod
    def symbolic(g, x, skip, gamma, bias, eps):
        inputs = [x, skip, gamma] + ([bias] if bias is not None else [])
        out, _mean, _inv_std, total = g.op(f"{MS}::SkipSimplifiedLayerNormalization", *inputs, epsilon_f=eps,
                                           outputs=4)
        return _same_type(out, x), _same_type(total, x)


def rotate(x, positions, cos, sin, num_heads):
    """x (B, S, N*D) rotated by the rotary tables cos / sin (P, D/2) at positions (B, S) (rotate_half layout)."""
    b, s, e = x.shape
    half = e // num_heads // 2
    xh = x.view(b, s, num_heads, 2 * half)
    c, sn = cos[positions].unsqueeze(2), sin[positions].unsqueeze(2)  # (B, S, 1, D/2)
    x1, x2 = xh[..., :half], xh[..., half:]
    return torch.cat([x1 * c - x2 * sn, x2 * c + x1 * sn], dim=-1).view(b, s, e)


class Rotary(torch.autograd.Function):
    """(x (B, S, N*D), positions (B, S) int64, cos, sin (P, D/2), num_heads) -> x rotated, as RotaryEmbedding."""

    @staticmethod
    def forward(ctx, x, positions, cos, sin, num_heads):
        return rotate(x, positions, cos, sin, num_heads)

    @staticmethod
    def symbolic(g, x, positions, cos, sin, num_heads):
        return _same_type(g.op(f"{MS}::RotaryEmbedding", x, positions, cos, sin, num_heads_i=num_heads,
                               interleaved_i=0), x)


class SeqLens(torch.autograd.Function):
    """attention_mask (B, T) -> (seqlens_k (B,) int32 = T - 1, total_sequence_length int32 scalar = T): every row
    of a left-padded batch holds T cache slots (the padding is masked by the attention bias)."""

    @staticmethod
    def forward(ctx, mask):
        b, t = mask.shape
        return (torch.full((b,), t - 1, dtype=torch.int32, device=mask.device),
                torch.tensor(t, dtype=torch.int32, device=mask.device))

    @staticmethod
    def symbolic(g, mask):
        shape = g.op("Shape", mask)  # (2,) int64
        batch = g.op("Slice", shape, g.op("Constant", value_t=torch.tensor([0])),
                     g.op("Constant", value_t=torch.tensor([1])))  # (1,)
        total = g.op("Cast", g.op("Gather", shape, g.op("Constant", value_t=torch.tensor(1)), axis_i=0),
                     to_i=torch.onnx.TensorProtoDataType.INT32)  # scalar
        last = g.op("Sub", total, g.op("Constant", value_t=torch.tensor(1, dtype=torch.int32)))
        seqlens = g.op("Expand", last, batch)  # (B,)
        seqlens.setType(torch._C.TensorType.create_from_tensor(torch.zeros(1, dtype=torch.int32)).with_sizes(
            [None]))
        total.setType(torch._C.TensorType.create_from_tensor(torch.zeros((), dtype=torch.int32)))
        return seqlens, total


class GroupQueryAttention(torch.autograd.Function):
    """Causal grouped-query self-attention with a KV cache; see the module docstring for shapes."""

    @staticmethod
    def forward(ctx, q, k, v, past_k, past_v, seqlens, total, attn_bias, num_heads, kv_heads, scale, window):
        b, s, _ = q.shape
        d = past_k.shape[-1]
        split = lambda t, n: t.view(b, s, n, d).transpose(1, 2)  # (B, S, N*D) -> (B, N, S, D)
        k_all = torch.cat([past_k, split(k, kv_heads)], dim=2)  # (B, Nkv, T, D)
        v_all = torch.cat([past_v, split(v, kv_heads)], dim=2)
        t = k_all.shape[2]
        group = num_heads // kv_heads  # query head n reads key / value head n // group
        kk = k_all.float().repeat_interleave(group, dim=1)  # (B, N, T, D)
        vv = v_all.float().repeat_interleave(group, dim=1)
        scores = torch.matmul(split(q, num_heads).float(), kk.transpose(-1, -2)) * scale  # (B, N, S, T)
        if attn_bias is not None:
            scores = scores + attn_bias.float()
        q_pos = torch.arange(s, device=q.device) + (t - s)  # absolute slot of each query
        keys = torch.arange(t, device=q.device)[None, :]
        allowed = keys <= q_pos[:, None]  # (S, T)
        if window > 0:  # local_window_size: the query's own key and the window - 1 before it
            allowed = allowed & (keys > q_pos[:, None] - window)
        scores = scores.masked_fill(~allowed, torch.finfo(torch.float32).min)
        out = torch.matmul(scores.softmax(-1), vv).to(q.dtype)  # (B, N, S, D)
        return out.transpose(1, 2).reshape(b, s, num_heads * d), k_all, v_all

    @staticmethod
    def symbolic(g, q, k, v, past_k, past_v, seqlens, total, attn_bias, num_heads, kv_heads, scale, window):
        none = g.op("prim::Constant").setType(torch._C.OptionalType.ofTensor())  # an omitted optional input
        out, present_k, present_v = g.op(
            f"{MS}::GroupQueryAttention", q, k, v, past_k, past_v, seqlens, total, none, none, none,
            attn_bias if attn_bias is not None else none, num_heads_i=num_heads, kv_num_heads_i=kv_heads,
            scale_f=scale, local_window_size_i=window, do_rotary_i=0, outputs=3)
        return _same_type(out, q), _same_type(present_k, past_k, False), _same_type(present_v, past_v, False)
