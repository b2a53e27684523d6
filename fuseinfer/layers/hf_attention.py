"""The ``"fuseinfer"`` attention implementation for Hugging Face transformers.

Registered with both ``AttentionInterface`` (the attention call) and ``AttentionMaskInterface`` (the mask
builder): without the mask registration transformers builds no mask for an unknown implementation and padding
would be silently ignored. The mask builder returns a compact per-row description, :class:`MaskInfo`, instead of
a (B, 1, Sq, Skv) tensor; patterns it cannot describe (packed sequences, custom or/and masks) fall back to
sdpa's boolean mask, and the attention call then runs SDPA with it.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from transformers import AttentionInterface
from transformers.masking_utils import (
    AttentionMaskInterface,
    causal_mask_function,
    prepare_padding_mask,
    sdpa_mask,
)
from transformers.utils.output_capturing import _active_collector

from fuseinfer.core.config import ATTN_NAME
from fuseinfer.core.errors import FuseInferError
from fuseinfer.ops.attention import allowed_mask, attention, attention_kv_fp8, repeat_kv
from fuseinfer.ops.attention_8bit_out import attention_8bit
from fuseinfer.ops.kv_cache import FP8_DTYPE, dequantize_kv
from fuseinfer.layers.attention_backend import attention_for

NAME = ATTN_NAME


class MaskInfo(NamedTuple):
    """Per-row mask: ``key_mask`` (B, Skv) bool or None, ``q_start`` (B,) int32 or None (see ops.attention); over an
    FP8 static cache also its per-layer (2, Hkv) fp32 scales ``kv_scales`` (the attention of layer i reads
    ``kv_scales[i]``)."""

    key_mask: torch.Tensor | None
    q_start: torch.Tensor | None
    kv_scales: list | None = None


def fuseinfer_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                   mask_function=causal_mask_function, attention_mask=None, device="cpu", **kwargs):
    """Mask builder: a :class:`MaskInfo` for causal masks with padding, else sdpa's 4D boolean mask."""
    if mask_function is not causal_mask_function:
        kwargs.pop("allow_is_causal_skip", None)
        return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                         allow_is_causal_skip=False, device=device, **kwargs)
    key_mask = prepare_padding_mask(attention_mask, kv_length, kv_offset)  # (B, >= kv_offset + Skv) or None
    if key_mask is not None:
        key_mask = key_mask[:, kv_offset:kv_offset + kv_length]  # (B, Skv) bool
        # "every key is real" -> no mask reads the mask on the host: not while compiling, nor while a CUDA graph is
        # captured (a device-to-host sync invalidates the capture: transformers 5.17's OPT always passes a mask of
        # ones); the kernel gives the same result from the all-True mask
        if not _tracing() and bool(key_mask.all()):
            key_mask = None
        else:
            key_mask = key_mask.contiguous()
    first = q_offset - kv_offset  # key index of the first query; a tensor for static caches
    if isinstance(first, int) and first == kv_length - q_length:
        q_start = None
    else:
        q_start = torch.as_tensor(first, device=device).to(torch.int32).reshape(-1).expand(batch_size)
        q_start = q_start.contiguous()
    return MaskInfo(key_mask, q_start)


def _tracing() -> bool:
    """Whether values on the GPU must not be read on the host now: under torch.compile, or while the current CUDA
    stream is being captured into a graph."""
    return torch.compiler.is_compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def weights_requested(module) -> bool:
    """Whether this forward records attention weights: transformers' output capture (``output_attentions=True``
    on the model call) or the config."""
    collected = _active_collector.get()  # the outputs this forward records, or None
    return bool(collected and "attentions" in collected) or bool(getattr(module.config, "output_attentions", False))


def fuseinfer_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query (B, H, Sq, D), key/value (B, H, Skv, D) -> ((B, Sq, H, D), None), or with the weights (B, H, Sq, Skv)
    through eager attention when the call records them (an attention module ``patch`` left unswapped).

    In training mode (a model patched in eval mode, then ``.train()``) it runs transformers' SDPA attention, which
    has a backward and applies the attention dropout (eager where the call records the weights, which SDPA does not
    form); the fused kernel is for inference only."""
    if module.training and weights_requested(module):
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        return eager_attention_with_weights(module, query, key, value, attention_mask, scale, dropout=dropout)
    if module.training:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if isinstance(attention_mask, MaskInfo):
            b, _, sq, _ = query.shape
            if attention_mask.key_mask is None and attention_mask.q_start is None and sq == key.shape[2]:
                attention_mask = None  # plain causal: SDPA's is_causal
            else:
                attention_mask = allowed_mask(attention_mask.key_mask, attention_mask.q_start, b, sq, key.shape[2],
                                              query.device)  # (B, 1, Sq, Skv); a row without keys gives 0s
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    if key.dtype == FP8_DTYPE:  # an FP8 static cache: its scales come with the mask
        if not isinstance(attention_mask, MaskInfo) or attention_mask.kv_scales is None:
            raise FuseInferError("an FP8 (e4m3) KV cache is read with its scales: pass the mask as "
                                 "MaskInfo(key_mask, q_start, kv_scales=cache.kv_scales)")
        kv_scale = attention_mask.kv_scales[module.layer_idx]  # (2, Hkv)
        if not weights_requested(module):  # (fuseinfer's kernel whatever the backend: it reads e4m3)
            return attention_kv_fp8(query, key, value, attention_mask.key_mask, attention_mask.q_start, scale,
                                    kv_scale), None
        key, value = dequantize_kv(key, kv_scale[0], query.dtype), dequantize_kv(value, kv_scale[1], query.dtype)
    if weights_requested(module):
        return eager_attention_with_weights(module, query, key, value, attention_mask, scale)
    attention = attention_for(module, query.shape[2])  # the patch's backend for this phase (attention_backend.py)
    rows = _row_mask(attention_mask)
    if rows is not None:
        return attention(query, key, value, *rows, scale), None
    # a prepared 4D mask (user-supplied, or a pattern MaskInfo cannot express); grouped-query k / v repeated to H heads
    key, value = repeat_kv(query, key, value)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scale)
    return out.transpose(1, 2).contiguous(), None


def fuseinfer_attention_8bit(module, query, key, value, attention_mask, scaling: float, out_scale, fmt: str):
    """:func:`fuseinfer_attention_forward`'s output quantized to ``fmt`` ("e4m3" or "int8") with the static scale
    ``out_scale`` by the attention kernel itself (``ops.attention_8bit_out``): (B, Sq, H, D) float8_e4m3fn / int8,
    or None where that call would not run fuseinfer's attention op over this mask (training, the weights recorded,
    an FP8 cache, another backend for this phase, a 4D mask), which the caller then makes as before."""
    if module.training or weights_requested(module) or key.dtype == FP8_DTYPE \
            or attention_for(module, query.shape[2]) is not attention:
        return None
    rows = _row_mask(attention_mask)
    return None if rows is None else attention_8bit(query, key, value, *rows, scaling, out_scale, fmt)


def _row_mask(attention_mask) -> tuple | None:
    """(key_mask, q_start) for fuseinfer's attention ops from the builder's mask: a :class:`MaskInfo`'s, or
    (None, None) for no mask (called without one: OPT is causal); None for a 4D mask, which they do not take."""
    if isinstance(attention_mask, MaskInfo):
        return attention_mask.key_mask, attention_mask.q_start
    return (None, None) if attention_mask is None else None


def eager_attention_with_weights(module, query, key, value, attention_mask, scaling: float, dropout=0.0, **kwargs):
    """OPT's eager attention over the mask the ``fuseinfer`` builder made (a :class:`MaskInfo`, None or a 4D
    mask), for calls that ask for the attention weights, which the kernel does not form:
    ((B, Sq, H, D), weights (B, H, Sq, Skv)). Grouped-query key/value (B, Hkv, Skv, D) are repeated to H heads;
    ``dropout`` applies to the weights in training mode."""
    from transformers.models.opt.modeling_opt import eager_attention_forward

    key, value = repeat_kv(query, key, value)

    if attention_mask is None or isinstance(attention_mask, MaskInfo):
        info = attention_mask or MaskInfo(None, None)
        attention_mask = allowed_mask(info.key_mask, info.q_start, query.shape[0], query.shape[2], key.shape[2],
                                      query.device)  # (B, 1, Sq, Skv) bool
    if attention_mask.dtype == torch.bool:  # eager adds the mask to the scores
        attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~attention_mask, torch.finfo(query.dtype).min)
    return eager_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout)


AttentionInterface.register(NAME, fuseinfer_attention_forward)
AttentionMaskInterface.register(NAME, fuseinfer_mask)
