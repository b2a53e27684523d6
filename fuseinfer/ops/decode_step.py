"""One whole decode step of a pre-LN OPT as one op: embeddings, every layer, the final LayerNorm and the LM head.

``opt_decode_step`` takes one new token per row (tokens, positions: (B,) int64), writes each layer's new keys
and values into the static caches at slot ``q_start[b]`` (int32) and attends keys ``j <= q_start[b]`` where
``key_mask[b, j]``, exactly like the per-op decode path (``fuseinfer.models.opt.decode.forward_last_logits``), and
returns fp32 logits (B, V) (rounded to the model dtype first, like the LM head's output).

On CUDA (sm_90, fp16/bf16, head dim 64 or 128, B <= 8) it runs ``csrc/decode_step.cu``: one persistent kernel
whose producer warp streams every weight (and the attention's cached keys and values) through shared memory while
the consumer warps compute, handing activations between phases as epoch-tagged words (no grid barrier), so the
~200 kernel boundaries of the per-op step are gone. ``workspace`` holds the kernel's scratch (activations,
attention partials and counters, launch counters); make it with :func:`decode_step_workspace` once per cache and
keep it. Elsewhere the op runs :func:`opt_decode_step_ref`. Token ids below the vocabulary size and positions
within the model's are the caller's to guarantee: the kernel does not check them on the device (the reference
raises), as the fast-decode runtime only feeds it ids it produced and positions it counted.

int8 weight-only models (``Int8WeightOnly``): ``weight_scales`` holds 4 fp32 (N,) per-output-channel scales per layer
(the fused q/k/v, the attention output projection, the MLP's two projections: ``SCALED``) and those four matrices
of ``layer_params`` are int8 (N, K); each linear then computes ``act(x @ (q * scale).T + bias (+ residual))``
like ``fuseinfer::w8a16_linear`` (the kernel streams the int8 tiles and applies the scale to the fp32 accumulator,
docs/quantization.md "int8 in the one-kernel step"). FP8 models (``Float8``) pass the same four matrices as
float8_e4m3fn (N, K) with their scales: the kernel streams the same 8-bit tiles and converts e4m3 instead of int8
(the activations stay fp16/bf16, as the FP8 linears' decode GEMV keeps them). One 8-bit format for all layers.
Empty ``weight_scales``: fp16/bf16 weights. The LM head is never quantized here.

FP8 KV caches (``RuntimeConfig(kv_cache="fp8")``, fp16/bf16 weights): ``k_caches`` / ``v_caches`` are float8_e4m3fn
and ``kv_scales`` holds each layer's (2, H) fp32 scales (the keys' row, the values' row; ops/kv_cache.py). The step
stores the new keys and values as ``kv_cache_append_fp8`` does (the projection rounded to the model dtype, divided by
the head's scale, rounded to e4m3 with saturation) and attends to them as stored, like the per-op path, which reads
them back from the cache; the kernel streams e4m3 keys and values (half the bytes) and applies the scales to the
scores and the attention output. Empty ``kv_scales``: caches in the model dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fuseinfer.core.extension import eager_cuda, extension
from fuseinfer.core.errors import FuseInferError
from fuseinfer.ops.attention import attention_kv_fp8_ref, attention_ref
from fuseinfer.ops.kv_cache import FP8_DTYPE, check_kv_scale, quantize_kv
from fuseinfer.ops.w8a16_linear import w8a16_linear_ref

# a layer's tensors, in order (the model family lists its modules' tensors so, ``models/opt/decode.py``): the
# attention LayerNorm's weight and bias, the fused (3E, E) q/k/v weight and bias, the attention output projection's
# weight and bias, the MLP LayerNorm's weight and bias, the MLP's first (E -> F) and second (F -> E) projections'
# weights and biases
PARAMS_PER_LAYER = 12
SCALED = (2, 4, 8, 10)  # indices in a layer's params of the four weights an int8 model quantizes
MAX_ROWS = 8
# RuntimeConfig.decode_kernel="auto" (the default) runs the kernel for batch buckets up to this many rows: where it
# was measured faster than the per-op step (docs/history.md, "Fast decode (H100)": H100, random
# OPT-1.3b fp16, context 512).
AUTO_MAX_ROWS = 2
# ... and, for int8 weight-only models, hidden sizes up to this. Measured on an H200, batch 1, prompt 128, 64 decoded
# tokens (bench/bench_opt66b_int8.py, one machine; docs/history.md), step vs per op in ms/token: OPT-1.3b 0.784 vs 0.911
# (prompt 512, the eval), OPT-6.7b 2.95 vs 2.43, OPT-13b 5.93 vs 4.61, OPT-66b 27.9 vs 19.0.
AUTO_INT8_MAX_HIDDEN = 2048


def write_kv_ref(k_cache, v_cache, rows, slots, k, v, kv_scale=None, kv_round=None) -> None:
    """The reference steps' cache write: k, v (M, Hkv, D) into the caches (B, Hkv, T, D) at (rows[i], slots[i]).
    e4m3 caches (``kv_scale`` (2, Hkv)): quantized as ``kv_cache_append_fp8`` stores them, after rounding k, v to
    ``kv_round`` when given (the dtype the per-op path stores the projection in; an fp32 reference of an fp16 model
    passes it, so that both quantize the same values)."""
    if kv_scale is None:
        k_cache[rows, :, slots] = k
        v_cache[rows, :, slots] = v
        return
    if kv_round is not None:
        k, v = k.to(kv_round), v.to(kv_round)
    for cache, x, s in ((k_cache, k, kv_scale[0]), (v_cache, v, kv_scale[1])):
        # (as bytes: indexed assignment has no float8 form on every device)
        cache.view(torch.uint8)[rows, :, slots] = quantize_kv(x.unsqueeze(2), s)[:, :, 0].view(torch.uint8)


def attend_ref(q, k_cache, v_cache, key_mask, q_start, scale, kv_scale=None) -> torch.Tensor:
    """The reference steps' attention of q (M, H, 1, D) over the caches' first M rows -> (M, 1, H, D): over e4m3
    caches (``kv_scale``) their dequantized values, as ``attention_kv_fp8`` reads them."""
    m = q.shape[0]
    if kv_scale is None:
        return attention_ref(q, k_cache[:m], v_cache[:m], key_mask[:m], q_start[:m], scale)
    return attention_kv_fp8_ref(q, k_cache[:m], v_cache[:m], key_mask[:m], q_start[:m], scale, kv_scale)


def check_kv_scales(k_caches, v_caches, kv_scales, op: str) -> list:
    """One clear error for caches and ``kv_scales`` that do not go together: float8_e4m3fn caches need one (2, Hkv)
    fp32 scale tensor per layer, caches in the model dtype none. Returns kv_scales as a list."""
    kv_scales = list(kv_scales or ())
    fp8 = [c.dtype == FP8_DTYPE for c in list(k_caches) + list(v_caches)]
    if any(fp8) and not all(fp8):
        raise FuseInferError(f"{op}: the caches must all be float8_e4m3fn or all be in the model dtype")
    if not all(fp8) and kv_scales:
        raise FuseInferError(f"{op}: kv_scales are for float8_e4m3fn caches only; pass none for caches in the "
                             "model dtype")
    if all(fp8):
        if len(kv_scales) != len(k_caches):
            raise FuseInferError(f"{op}: float8_e4m3fn caches need one kv_scales tensor (2, KV heads) per layer, got "
                                 f"{len(kv_scales)} for {len(k_caches)} layer(s) (the cache's kv_scales)")
        for s, c in zip(kv_scales, k_caches):
            check_kv_scale(s, c)
    return kv_scales


def opt_decode_step_ref(tokens, positions, q_start, key_mask, embed, pos_embed, layer_params, k_caches, v_caches,
                        lnf_w, lnf_b, lm_head, workspace, eps: float, scale: float,
                        weight_scales=(), kv_scales=(), kv_round=None) -> torch.Tensor:
    """Pure-PyTorch reference (in the tensors' dtype; pass fp32 copies for an fp32 reference). Writes the caches
    in place; ``workspace`` is not used. Slots must lie in the cache. With ``weight_scales`` (int8 weights) each
    linear is ``w8a16_linear_ref`` with the per-op path's fused residual / ReLU, so it equals the per-op int8 step.
    With ``kv_scales`` (e4m3 caches) the new keys and values are quantized on write (``write_kv_ref``, ``kv_round``)
    and the attention reads the dequantized caches."""
    if weight_scales:
        return _int8_step_ref(tokens, positions, q_start, key_mask, embed, pos_embed, layer_params, k_caches,
                              v_caches, lnf_w, lnf_b, lm_head, eps, scale, weight_scales, kv_scales, kv_round)
    m = tokens.numel()
    e = embed.shape[1]
    _, heads, _, d = k_caches[0].shape
    rows, slots = torch.arange(m, device=tokens.device), q_start.long()
    h = embed[tokens.view(m)] + pos_embed[positions.view(m) + 2]  # (M, E); OPT's position offset is 2
    for layer, (k_cache, v_cache) in enumerate(zip(k_caches, v_caches)):
        ln1_w, ln1_b, wqkv, bqkv, wo, bo, ln2_w, ln2_b, w1, b1, w2, b2 = \
            layer_params[PARAMS_PER_LAYER * layer:PARAMS_PER_LAYER * (layer + 1)]
        x = F.layer_norm(h, (e,), ln1_w, ln1_b, eps)
        q, k, v = F.linear(x, wqkv, bqkv).view(m, 3, heads, d).unbind(1)  # 3 x (M, H, D)
        kv_scale = kv_scales[layer] if kv_scales else None
        write_kv_ref(k_cache, v_cache, rows, slots, k, v, kv_scale, kv_round)
        attn = attend_ref(q.unsqueeze(2), k_cache, v_cache, key_mask, q_start, scale, kv_scale)  # (M, 1, H, D)
        h = h + F.linear(attn.reshape(m, e), wo, bo)
        x = F.layer_norm(h, (e,), ln2_w, ln2_b, eps)
        h = h + F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)
    x = F.layer_norm(h, (e,), lnf_w, lnf_b, eps)
    return F.linear(x, lm_head).float()  # (M, V)


def _int8_step_ref(tokens, positions, q_start, key_mask, embed, pos_embed, layer_params, k_caches, v_caches, lnf_w,
                   lnf_b, lm_head, eps, scale, weight_scales, kv_scales=(), kv_round=None) -> torch.Tensor:
    """The reference step of an int8 weight-only model: the weights of ``SCALED`` are int8 (N, K), dequantized with
    their scales (fp32, (N,)) by ``w8a16_linear_ref``; the residual adds and the ReLU fused as the per-op forward
    fuses them (the attention output and second MLP projections take the residual, the first MLP projection the
    ReLU)."""
    m = tokens.numel()
    e = embed.shape[1]
    _, heads, _, d = k_caches[0].shape
    rows, slots = torch.arange(m, device=tokens.device), q_start.long()
    h = embed[tokens.view(m)] + pos_embed[positions.view(m) + 2]  # (M, E)
    for layer, (k_cache, v_cache) in enumerate(zip(k_caches, v_caches)):
        ln1_w, ln1_b, wqkv, bqkv, wo, bo, ln2_w, ln2_b, w1, b1, w2, b2 = \
            layer_params[PARAMS_PER_LAYER * layer:PARAMS_PER_LAYER * (layer + 1)]
        s_qkv, s_o, s_1, s_2 = weight_scales[len(SCALED) * layer:len(SCALED) * (layer + 1)]
        x = F.layer_norm(h, (e,), ln1_w, ln1_b, eps)
        q, k, v = w8a16_linear_ref(x, wqkv, s_qkv, bqkv, None, "none").view(m, 3, heads, d).unbind(1)  # 3 x (M, H, D)
        kv_scale = kv_scales[layer] if kv_scales else None
        write_kv_ref(k_cache, v_cache, rows, slots, k, v, kv_scale, kv_round)
        attn = attend_ref(q.unsqueeze(2), k_cache, v_cache, key_mask, q_start, scale, kv_scale)  # (M, 1, H, D)
        h = w8a16_linear_ref(attn.reshape(m, e), wo, s_o, bo, h, "none")
        x = F.layer_norm(h, (e,), ln2_w, ln2_b, eps)
        h = w8a16_linear_ref(w8a16_linear_ref(x, w1, s_1, b1, None, "relu"), w2, s_2, b2, h, "none")
    x = F.layer_norm(h, (e,), lnf_w, lnf_b, eps)
    return F.linear(x, lm_head).float()  # (M, V)


@torch.library.custom_op("fuseinfer::opt_decode_step", mutates_args=("k_caches", "v_caches", "workspace"))
def _opt_decode_step(
    tokens: torch.Tensor, positions: torch.Tensor, q_start: torch.Tensor, key_mask: torch.Tensor,
    embed: torch.Tensor, pos_embed: torch.Tensor, layer_params: list[torch.Tensor], k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor], lnf_w: torch.Tensor, lnf_b: torch.Tensor, lm_head: torch.Tensor,
    workspace: torch.Tensor, eps: float, scale: float, weight_scales: list[torch.Tensor],
    kv_scales: list[torch.Tensor],
) -> torch.Tensor:
    return opt_decode_step_ref(tokens, positions, q_start, key_mask, embed, pos_embed, layer_params, k_caches,
                               v_caches, lnf_w, lnf_b, lm_head, workspace, eps, scale, weight_scales, kv_scales)


def kernel_supports(rows: int, embed: torch.Tensor, ffn: int, head_dim: int, int8: bool = False,
                    kv_scales: int = 0) -> bool:
    """Whether the CUDA kernel serves a step of ``rows`` tokens for this model (else the reference runs); ``int8``:
    with int8 weights, whose k-steps of 64 need hidden and ffn sizes that are multiples of 64; ``kv_scales``: with
    e4m3 caches, the number of their scales (layers x 2 x heads, staged in shared memory; fp16/bf16 weights only)."""
    ext = extension(embed.device)
    multiple = 64 if int8 else 32
    return (ext is not None and embed.is_cuda and torch.cuda.get_device_capability(embed.device)[0] >= 9
            and embed.dtype in (torch.float16, torch.bfloat16) and head_dim in (64, 128)
            and 1 <= rows <= MAX_ROWS and embed.shape[1] % multiple == 0 and ffn % multiple == 0
            and not (int8 and kv_scales)
            and bool(ext.decode_step_fits(rows, embed.shape[1], ffn, 0, kv_scales)))


def kv_scale_count(kv_scales) -> int:
    """The number of e4m3 cache scales the kernel stages (0 for caches in the model dtype)."""
    return sum(s.numel() for s in kv_scales)


def decode_step_workspace(rows: int, hidden: int, ffn: int, heads: int, head_dim: int, capacity: int,
                          device) -> torch.Tensor:
    """Zeroed scratch for the kernel (empty when the extension is not built); keep it for the cache's lifetime."""
    ext = extension()
    size = ext.decode_step_workspace_bytes(rows, hidden, ffn, heads, head_dim, capacity) if ext is not None else 0
    return torch.zeros(size, dtype=torch.uint8, device=device)


@_opt_decode_step.register_kernel("cuda")
def _opt_decode_step_cuda(tokens, positions, q_start, key_mask, embed, pos_embed, layer_params, k_caches,
                          v_caches, lnf_w, lnf_b, lm_head, workspace, eps, scale, weight_scales, kv_scales):
    if not kernel_supports(tokens.numel(), embed, layer_params[8].shape[0], k_caches[0].shape[-1],
                           int8=bool(weight_scales), kv_scales=kv_scale_count(kv_scales)):
        return opt_decode_step_ref(tokens, positions, q_start, key_mask, embed, pos_embed, layer_params,
                                   k_caches, v_caches, lnf_w, lnf_b, lm_head, workspace, eps, scale, weight_scales,
                                   kv_scales)
    return extension().decode_step(tokens, positions, q_start, key_mask, embed, pos_embed, layer_params, k_caches,
                                   v_caches, lnf_w, lnf_b, lm_head, workspace, eps, scale, list(weight_scales),
                                   list(kv_scales))


@_opt_decode_step.register_fake
def _(tokens, positions, q_start, key_mask, embed, pos_embed, layer_params, k_caches, v_caches, lnf_w, lnf_b,
      lm_head, workspace, eps, scale, weight_scales, kv_scales):
    return embed.new_empty(tokens.numel(), lm_head.shape[0], dtype=torch.float32)


WEIGHT_FORMATS = (torch.int8, torch.float8_e4m3fn)  # the 8-bit weights the step streams


def _check_int8(layer_params, weight_scales, layers: int) -> None:
    """One clear error for 8-bit weights / scales that do not match what the kernel and the reference read."""
    if len(weight_scales) != len(SCALED) * layers:
        raise FuseInferError(f"int8 step: expected {len(SCALED)} weight scales per layer (q/k/v, attention "
                             "output, MLP in, MLP out), "
                             f"got {len(weight_scales)} for {layers} layer(s)")
    fmt = layer_params[SCALED[0]].dtype
    for layer in range(layers):
        for i, index in enumerate(SCALED):
            w = layer_params[PARAMS_PER_LAYER * layer + index]
            s = weight_scales[len(SCALED) * layer + i]
            if fmt not in WEIGHT_FORMATS or w.dtype != fmt or w.dim() != 2 or s.dtype != torch.float32 \
                    or tuple(s.shape) != (w.shape[0],):
                raise FuseInferError(
                    f"8-bit step: layer {layer} parameter {index} must be an int8 or float8_e4m3fn (N, K) weight "
                    f"(one format for all) with (N,) float32 scales, got {w.dtype} {tuple(w.shape)} and {s.dtype} "
                    f"{tuple(s.shape)} (quantize the model with PatchConfig(quant=Int8WeightOnly()) or Float8() and "
                    "pass opt_decode.decode_step_weight_scales(model))")


def opt_decode_step(tokens, positions, q_start, key_mask, embed, pos_embed, layer_params, k_caches, v_caches,
                    lnf_w, lnf_b, lm_head, workspace, eps: float, scale: float, weight_scales=(),
                    kv_scales=()) -> torch.Tensor:
    """One decode step; see the module docstring. Returns fp32 logits (B, V)."""
    if len(layer_params) != PARAMS_PER_LAYER * len(k_caches) or len(k_caches) != len(v_caches) or not k_caches:
        raise FuseInferError(f"expected {PARAMS_PER_LAYER} parameters and a k and v cache per layer, got "
                             f"{len(layer_params)} parameters and {len(k_caches)}/{len(v_caches)} caches")
    weight_scales = list(weight_scales)
    if weight_scales:
        _check_int8(layer_params, weight_scales, len(k_caches))
    kv_scales = check_kv_scales(k_caches, v_caches, kv_scales, "opt_decode_step")
    if eager_cuda(embed):
        return _opt_decode_step_cuda(tokens, positions, q_start, key_mask, embed, pos_embed, layer_params, k_caches,
                                     v_caches, lnf_w, lnf_b, lm_head, workspace, eps, scale, weight_scales,
                                     kv_scales)
    return torch.ops.fuseinfer.opt_decode_step(tokens, positions, q_start, key_mask, embed, pos_embed, layer_params,
                                               k_caches, v_caches, lnf_w, lnf_b, lm_head, workspace, eps, scale,
                                               weight_scales, kv_scales)
