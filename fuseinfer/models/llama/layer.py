"""The Llama-architecture decoder layer (Llama, Mistral, Qwen2), written once, over an *ops strategy*.

Every path that runs a layer calls :func:`decoder_layer` with its own strategy: the patched modules
(``modules.ModuleOps``: fused residual + RMSNorm, fused q/k/v + rotary, gate/up as one GEMM + ``silu_mul``,
residual adds in the o_proj / down_proj epilogues) and the plain-PyTorch reference (:class:`TorchOps`), against
which the tests hold transformers' own layer. The layer says *what* is computed; the strategy says *how*.

The strategy protocol (``ops``); ``h``/``x`` are (B, S, E) tensors:

* ``ops.norm(x, norm, residual=None) -> (y, s)``: ``s = residual + x`` (``x`` when there is none), ``y =
  RMSNorm(s)`` with ``norm``'s weight and ``variance_epsilon``;
* ``ops.attention(i, attn, x, ctx) -> a``: layer ``i``'s q/k/v projections of ``x``, rotary, attention over
  ``ctx`` (the caller's rotary tables, cache and mask, opaque to the layer): the heads concatenated, before o_proj;
* ``ops.gated_mlp(mlp, x) -> g``: ``act(gate_proj(x)) * up_proj(x)``, (B, S, F), before down_proj;
* ``ops.linear(x, lin, residual=None) -> out``: ``x @ lin.weight.T + lin.bias + residual``.

Pre-norm throughout: each block reads the normalised stream and adds its output to the stream.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def decoder_layer(ops, i: int, layer: nn.Module, h, ctx):
    """One decoder layer (``layer``: a Llama / Mistral / Qwen2 decoder layer, patched or not) over ``ops``: h -> h."""
    # submodules read from ``_modules``: nn.Module's attribute lookup costs host-bound loops ~0.3 us each
    mods = layer._modules
    attn, mlp = mods["self_attn"], mods["mlp"]
    x, h = ops.norm(h, mods["input_layernorm"])
    h = ops.linear(ops.attention(i, attn, x, ctx), attn._modules["o_proj"], residual=h)
    x, h = ops.norm(h, mods["post_attention_layernorm"])
    return ops.linear(ops.gated_mlp(mlp, x), mlp._modules["down_proj"], residual=h)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TorchOps:
    """The reference strategy: plain PyTorch over (B, S, E) tensors without a cache, in transformers' order of
    operations. ``ctx``: ``(cos, sin, bias)``, the rotary tables (B or 1, S, D) of the positions and the additive
    attention bias (B, 1, S, S) or None for plain causal attention."""

    def norm(self, x, norm, residual=None):
        s = x if residual is None else residual + x
        s32 = s.float()
        y = s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        return norm.weight * y.to(s.dtype), s

    def linear(self, x, lin, residual=None):
        y = F.linear(x, lin.weight, lin.bias)
        return y if residual is None else residual + y

    def gated_mlp(self, mlp, x):
        return mlp.act_fn(F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias)) * \
            F.linear(x, mlp.up_proj.weight, mlp.up_proj.bias)

    def attention(self, i, attn, x, ctx):
        cos, sin, bias = ctx
        b, s, _ = x.shape
        d = attn.head_dim
        q, k, v = (F.linear(x, p.weight, p.bias).view(b, s, -1, d).transpose(1, 2)
                   for p in (attn.q_proj, attn.k_proj, attn.v_proj))  # (B, H, S, D), k / v (B, Hkv, S, D)
        c, sn = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, S, D)
        q, k = q * c + _rotate_half(q) * sn, k * c + _rotate_half(k) * sn
        group = q.shape[1] // k.shape[1]  # grouped-query attention: query head h reads key/value head h // group
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) * attn.scaling  # (B, H, S, S)
        if bias is None:
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        else:
            scores = scores + bias
        p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        return (p @ v).transpose(1, 2).reshape(b, s, -1)  # (B, S, H * D)
