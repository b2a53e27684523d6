"""One whole decode step of a Llama-architecture model (Llama, Mistral, Qwen2) as one op: the embedding, every layer,
the final RMSNorm and the LM head.

``llama_decode_step`` takes one new token per row (tokens: (B,) int64) and the rotary tables of this step's positions
(cos, sin: (B, D) in the model dtype, from the model's own ``rotary_emb``, so every rope scaling transformers has is
covered without the kernel knowing it), writes each layer's new keys and values into the static caches (B, Hkv, T, D)
at slot ``q_start[b]`` (int32) and attends keys ``j <= q_start[b]`` where ``key_mask[b, j]``, exactly like the per-op
decode path (``fuseinfer.models.llama.decode.forward_last_logits``), and returns fp32 logits (B, V) (rounded to the
model dtype first, like the LM head's output).

A layer's tensors (``PARAMS_PER_LAYER``, as the family lists them, ``models/llama/decode.py``): the input RMSNorm's
weight, the fused q/k/v weight ((H + 2 Hkv) D, E: q rows, then k, then v), o_proj's weight, the post-attention
RMSNorm's weight, the fused gate/up weight (2F, E: gate rows, then up rows) and down_proj's weight; ``qkv_biases``:
empty, or the fused q/k/v bias of every layer (Qwen2). No other linear has a bias.

On CUDA (sm_90, fp16/bf16, head dim 64 or 128, hidden = heads x head dim, B <= 8) it runs ``csrc/decode_step.cu``'s
Llama instantiation: the OPT step's persistent kernel (one block per SM, a producer warp streaming every weight and
the attention's cached keys and values through shared memory, epoch-tagged hand-offs between phases) with the
family's phases: RMSNorm, q/k/v with the rotary and the cache write in its epilogue (a tile pairs dims d and d + D/2
of a head by the rows it loads: no permuted copy of the weight), grouped-query attention, o_proj + residual,
RMSNorm, gate/up with SiLU * up in its epilogue (a tile pairs gate and up rows the same way), down_proj + residual.
``workspace`` is :func:`fuseinfer.ops.decode_step.decode_step_workspace`'s (made once per cache and kept). Elsewhere
the op runs :func:`llama_decode_step_ref`. fp16/bf16 weights only: int8 / FP8 Llama models decode per op. Token ids
below the vocabulary size are the caller's to guarantee (the kernel does not check them on the device).

FP8 KV caches (``RuntimeConfig(kv_cache="fp8")``): float8_e4m3fn ``k_caches`` / ``v_caches`` with ``kv_scales``, each
layer's (2, Hkv) fp32 scales, handled as :func:`fuseinfer.ops.decode_step.opt_decode_step` handles them (the new keys
and values stored as ``kv_cache_append_fp8`` stores them, after the rotary, and attended to as stored). Empty
``kv_scales``: caches in the model dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fuseinfer.core.errors import FuseInferError
from fuseinfer.core.extension import eager_cuda, extension
from fuseinfer.ops.decode_step import MAX_ROWS, attend_ref, check_kv_scales, kv_scale_count, write_kv_ref
from fuseinfer.ops.linear import linear_epilogue_ref
from fuseinfer.ops.rms_norm import add_rms_norm_ref
from fuseinfer.ops.rope import qkv_rope_ref

PARAMS_PER_LAYER = 6
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
# RuntimeConfig.decode_kernel="auto" runs the Llama step for batch buckets up to this many rows ("on" uses it
# wherever it applies). 0: measured slower than the per-op step at every batch (Llama-3.2-1B shapes on an H200,
# prompt 512: 0.977 against 0.970 ms/token at batch 1, 1.85 against 1.07 at batch 8)
AUTO_MAX_ROWS = 0


def llama_decode_step_ref(tokens, cos, sin, q_start, key_mask, embed, layer_params, qkv_biases, k_caches, v_caches,
                          norm_w, lm_head, workspace, eps: float, scale: float, kv_scales=(),
                          kv_round=None) -> torch.Tensor:
    """Pure-PyTorch reference (in the tensors' dtype; pass fp32 copies for an fp32 reference), rounding where the
    per-op path's ops round. Writes the caches in place; ``workspace`` is not used. Slots must lie in the cache. With
    ``kv_scales`` (e4m3 caches) the new keys and values are quantized on write (``write_kv_ref``) and the attention
    reads the dequantized caches; ``kv_round`` (an fp32 reference of a ``kv_round`` model) rounds the keys' and
    values' projection to it before the rotary and the rotated values before quantizing, where the per-op path
    stores them, so that both quantize the same values."""
    m = tokens.numel()
    _, kv_heads, _, d = k_caches[0].shape
    rows, slots = torch.arange(m, device=tokens.device), q_start.long()
    cos, sin = cos.reshape(m, 1, d), sin.reshape(m, 1, d)  # (M, S = 1, D)
    h = embed[tokens.view(m)]  # (M, E)
    for layer, (k_cache, v_cache) in enumerate(zip(k_caches, v_caches)):
        ln1_w, wqkv, wo, ln2_w, wgu, wd = layer_params[PARAMS_PER_LAYER * layer:PARAMS_PER_LAYER * (layer + 1)]
        heads = wqkv.shape[0] // d - 2 * kv_heads
        x, _ = add_rms_norm_ref(h, None, ln1_w, eps, False)
        qkv = F.linear(x, wqkv, qkv_biases[layer] if len(qkv_biases) else None)  # (M, (H + 2 Hkv) D)
        q, k, v = qkv_rope_ref(qkv.unsqueeze(1), cos, sin, heads, kv_heads)  # (M, H, 1, D), 2 x (M, Hkv, 1, D)
        kv_scale = kv_scales[layer] if len(kv_scales) else None
        if kv_scale is not None and kv_round is not None:  # k, v from the projection as the per-op path stores it
            _, k, v = qkv_rope_ref(qkv.to(kv_round).to(qkv.dtype).unsqueeze(1), cos, sin, heads, kv_heads)
        write_kv_ref(k_cache, v_cache, rows, slots, k[:, :, 0], v[:, :, 0], kv_scale, kv_round)
        attn = attend_ref(q, k_cache, v_cache, key_mask, q_start, scale, kv_scale)  # (M, 1, H, D)
        h = linear_epilogue_ref(attn.reshape(m, -1), wo, None, h, "none")
        x, _ = add_rms_norm_ref(h, None, ln2_w, eps, False)
        h = linear_epilogue_ref(linear_epilogue_ref(x, wgu, None, None, "silu_mul"), wd, None, h, "none")
    x, _ = add_rms_norm_ref(h, None, norm_w, eps, False)
    return F.linear(x, lm_head).float()  # (M, V)


@torch.library.custom_op("fuseinfer::llama_decode_step", mutates_args=("k_caches", "v_caches", "workspace"))
def _llama_decode_step(
    tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_start: torch.Tensor, key_mask: torch.Tensor,
    embed: torch.Tensor, layer_params: list[torch.Tensor], qkv_biases: list[torch.Tensor],
    k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], norm_w: torch.Tensor, lm_head: torch.Tensor,
    workspace: torch.Tensor, eps: float, scale: float, kv_scales: list[torch.Tensor],
) -> torch.Tensor:
    return llama_decode_step_ref(tokens, cos, sin, q_start, key_mask, embed, layer_params, qkv_biases, k_caches,
                                 v_caches, norm_w, lm_head, workspace, eps, scale, kv_scales)


def kernel_supports(rows: int, embed: torch.Tensor, ffn: int, heads: int, kv_heads: int, head_dim: int,
                    kv_scales: int = 0) -> bool:
    """Whether the CUDA kernel serves a step of ``rows`` tokens for this model (else the reference runs);
    ``kv_scales``: with e4m3 caches, the number of their scales (layers x 2 x KV heads, staged in shared memory)."""
    ext = extension(embed.device)
    hidden = embed.shape[1]
    return (ext is not None and hasattr(ext, "llama_decode_step") and embed.is_cuda
            and torch.cuda.get_device_capability(embed.device)[0] >= 9 and embed.dtype in KERNEL_DTYPES
            and head_dim in (64, 128) and hidden == heads * head_dim and kv_heads >= 1 and heads % kv_heads == 0
            and 1 <= rows <= MAX_ROWS and hidden % 32 == 0 and ffn % 32 == 0
            and bool(ext.decode_step_fits(rows, hidden, ffn, head_dim, kv_scales)))


def _sizes(layer_params, k_caches):
    """(heads, kv heads, head dim, ffn) from the first layer's tensors."""
    _, kv_heads, _, d = k_caches[0].shape
    return layer_params[1].shape[0] // d - 2 * kv_heads, kv_heads, d, layer_params[4].shape[0] // 2


@_llama_decode_step.register_kernel("cuda")
def _llama_decode_step_cuda(tokens, cos, sin, q_start, key_mask, embed, layer_params, qkv_biases, k_caches, v_caches,
                            norm_w, lm_head, workspace, eps, scale, kv_scales):
    heads, kv_heads, d, ffn = _sizes(layer_params, k_caches)
    if not kernel_supports(tokens.numel(), embed, ffn, heads, kv_heads, d, kv_scale_count(kv_scales)):
        return llama_decode_step_ref(tokens, cos, sin, q_start, key_mask, embed, layer_params, qkv_biases, k_caches,
                                     v_caches, norm_w, lm_head, workspace, eps, scale, kv_scales)
    m = tokens.numel()
    return extension().llama_decode_step(tokens, cos.reshape(m, d).contiguous(), sin.reshape(m, d).contiguous(),
                                         q_start, key_mask, embed, layer_params, list(qkv_biases), k_caches, v_caches,
                                         norm_w, lm_head, workspace, eps, scale, list(kv_scales))


@_llama_decode_step.register_fake
def _(tokens, cos, sin, q_start, key_mask, embed, layer_params, qkv_biases, k_caches, v_caches, norm_w, lm_head,
      workspace, eps, scale, kv_scales):
    return embed.new_empty(tokens.numel(), lm_head.shape[0], dtype=torch.float32)


def weights_refusal(embed: torch.Tensor, layer_params) -> str | None:
    """Why the step cannot take these weights, or None: every weight in the embedding's dtype (int8 / FP8 Llama
    models decode per op)."""
    for i, p in enumerate(layer_params):
        if p.dtype != embed.dtype:
            return (f"layer {i // PARAMS_PER_LAYER} parameter {i % PARAMS_PER_LAYER} is {p.dtype}, not the model's "
                    f"{embed.dtype}: the Llama one-kernel step streams fp16/bf16 weights only (quantized models "
                    "decode per op)")
    return None


def llama_decode_step(tokens, cos, sin, q_start, key_mask, embed, layer_params, qkv_biases, k_caches, v_caches,
                      norm_w, lm_head, workspace, eps: float, scale: float, kv_scales=()) -> torch.Tensor:
    """One decode step; see the module docstring. Returns fp32 logits (B, V)."""
    layers = len(k_caches)
    qkv_biases = list(qkv_biases)
    if len(layer_params) != PARAMS_PER_LAYER * layers or layers != len(v_caches) or not layers \
            or len(qkv_biases) not in (0, layers):
        raise FuseInferError(f"expected {PARAMS_PER_LAYER} parameters, a k and v cache and no or one q/k/v bias per "
                             f"layer, got {len(layer_params)} parameters, {len(k_caches)}/{len(v_caches)} caches and "
                             f"{len(qkv_biases)} biases")
    why = weights_refusal(embed, layer_params)
    if why is not None:
        raise FuseInferError(why)
    kv_scales = check_kv_scales(k_caches, v_caches, kv_scales, "llama_decode_step")
    if eager_cuda(embed):
        return _llama_decode_step_cuda(tokens, cos, sin, q_start, key_mask, embed, layer_params, qkv_biases,
                                       k_caches, v_caches, norm_w, lm_head, workspace, eps, scale, kv_scales)
    return torch.ops.fuseinfer.llama_decode_step(tokens, cos, sin, q_start, key_mask, embed, layer_params,
                                                 qkv_biases, k_caches, v_caches, norm_w, lm_head, workspace, eps,
                                                 scale, kv_scales)
