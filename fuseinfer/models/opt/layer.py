"""The OPT decoder layer, written once, over an *ops strategy*.

Every path that runs an OPT layer — the patched modules, the lean prefill loop, the per-op decode forward, tensor
parallel and the ONNX export — calls :func:`decoder_layer` with its own strategy object. The layer says *what* is
computed (which LayerNorm, which projection, where the residual joins); the strategy says *how*: fused CUDA ops in
fp16/bf16, int8 weights (W8A16), int8 weights and activations (W8A8), all-reduces after the row-parallel projections
(tensor parallel), standard ONNX ops or onnxruntime's contrib ops (export).

The strategy protocol (``ops``); ``x``/``h`` are whatever the strategy passes between its steps — (tokens, E) or
(B, S, E) tensors, int8 activations with their scales, or a pending ``x @ W.T + b`` that the next LayerNorm absorbs:

* ``ops.norm(x, ln, residual=None) -> (y, s)``: ``s = x + residual`` (``x`` when there is none), ``y = ln(s)``;
  ``ln`` is the layer's ``nn.LayerNorm`` (its weight, bias, eps). The layer reads ``s`` only when there is no
  ``residual``, so a strategy whose fused add + LayerNorm does not form the sum may return None for it then.
* ``ops.linear(x, lin, residual=None, activation=None) -> out``: ``act(x @ lin.weight.T + lin.bias) + residual``
  (``activation``: None, or the layer's activation module; ReLU may run in the GEMM's epilogue).
* ``ops.attention(i, attn, x, ctx) -> a``: layer ``i``'s q/k/v projections of ``x``, attention over ``ctx`` (the
  caller's cache / mask / past, opaque to the layer), concatenated heads before ``out_proj``.

OPT's two layouts (``config.do_layer_norm_before``): pre-LN (every OPT but opt-350m) normalises the residual stream
before each block and adds the block's output to it; post-LN (opt-350m) adds first and normalises the sum, which then
is the stream.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def decoder_layer(ops, i: int, layer: nn.Module, h, ctx, pre_ln: bool):
    """One OPT decoder layer (``layer``: an ``OPTDecoderLayer``, patched or not) over ``ops``: h -> h."""
    # submodules read from ``_modules``: nn.Module's attribute lookup would cost the host-bound loops ~0.3 us each
    mods = layer._modules
    attn = mods["self_attn"]
    out_proj, fc1, fc2, act = attn._modules["out_proj"], mods["fc1"], mods["fc2"], mods["activation_fn"]
    if pre_ln:
        x, h = ops.norm(h, mods["self_attn_layer_norm"])
        h = ops.linear(ops.attention(i, attn, x, ctx), out_proj, residual=h)
        x, h = ops.norm(h, mods["final_layer_norm"])
        return ops.linear(ops.linear(x, fc1, activation=act), fc2, residual=h)
    a = ops.linear(ops.attention(i, attn, h, ctx), out_proj)
    h, _ = ops.norm(a, mods["self_attn_layer_norm"], residual=h)
    f = ops.linear(ops.linear(h, fc1, activation=act), fc2)
    return ops.norm(f, mods["final_layer_norm"], residual=h)[0]


class TorchOps:
    """The reference strategy: plain PyTorch over (B, S, E) tensors with a causal mask and no cache, in the order
    transformers' OPT computes (q scaled before QK^T). ``ctx``: the additive attention bias, (B, 1, S, S) or None
    for plain causal attention."""

    def norm(self, x, ln, residual=None):
        s = x if residual is None else residual + x
        return F.layer_norm(s, ln.normalized_shape, ln.weight, ln.bias, ln.eps), s

    def linear(self, x, lin, residual=None, activation=None):
        y = F.linear(x, lin.weight, lin.bias)
        y = y if activation is None else activation(y)
        return y if residual is None else residual + y

    def attention(self, i, attn, x, ctx):
        b, s, _ = x.shape
        heads, d = attn.num_heads, attn.head_dim
        q = (F.linear(x, attn.q_proj.weight, attn.q_proj.bias) * attn.scaling).view(b, s, heads, d).transpose(1, 2)
        k = F.linear(x, attn.k_proj.weight, attn.k_proj.bias).view(b, s, heads, d).transpose(1, 2)
        v = F.linear(x, attn.v_proj.weight, attn.v_proj.bias).view(b, s, heads, d).transpose(1, 2)
        scores = q @ k.transpose(-1, -2)  # (B, H, S, S)
        if ctx is None:
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        else:
            scores = scores + ctx
        p = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        return (p @ v).transpose(1, 2).reshape(b, s, heads * d)  # (B, S, E)
