"""Causal attention over a KV cache with per-row key masks (FlashAttention-style on CUDA).

One op serves prefill and decode: queries ``q`` (B, H, Sq, D) attend keys ``k``/values ``v`` (B, Hkv, Skv, D)
that may come from a cache; with grouped-query attention (Hkv < H, H a multiple of Hkv) query head ``h`` reads
key/value head ``h // (H / Hkv)``. Masking is described per row instead of by a (B, 1, Sq, Skv) tensor:

* ``key_mask`` (B, Skv) bool, True for real tokens (None: all real) — left padding, static-cache slack;
* ``q_start`` (B,) int32, the key index of query 0 (None: ``Skv - Sq``, bottom-right-aligned causal).

Query ``i`` of row ``b`` attends key ``j`` iff ``key_mask[b, j] and j <= q_start[b] + i``; a query with no
such key returns 0 (never NaN, so padded positions cannot poison later layers). ``q`` is not pre-scaled:
``scale`` multiplies ``q @ k.T``. The output is (B, Sq, H, D), the layout the attention output projection reads.
"""
from __future__ import annotations

import torch

from fuseinfer.core import knobs
from fuseinfer.core.extension import eager_cuda, extension, route, transformed
from fuseinfer.core.errors import FuseInferError
from fuseinfer.ops.kv_cache import FP8_DTYPE, check_kv_scale, dequantize_kv

KERNEL_HEAD_DIMS = (64, 128)
KERNEL_GQA = True  # whether the CUDA kernels take Hkv < H (else those calls run SDPA on repeated k / v)
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def allowed_mask(key_mask, q_start, b: int, sq: int, skv: int, device) -> torch.Tensor:
    """(B, 1, Sq, Skv) bool: which key each query may attend, from the per-row description."""
    if q_start is None:
        q_start = torch.full((b,), skv - sq, dtype=torch.int32, device=device)
    qpos = q_start.view(b, 1, 1, 1) + torch.arange(sq, device=device).view(1, 1, sq, 1)  # (B, 1, Sq, 1)
    allowed = torch.arange(skv, device=device).view(1, 1, 1, skv) <= qpos  # (B, 1, Sq, Skv)
    if key_mask is not None:
        allowed = allowed & key_mask.view(b, 1, 1, skv)
    return allowed


def repeat_kv(q, k, v):
    """k, v (B, Hkv, Skv, D) repeated to q's H heads (query head h reads key/value head h // (H / Hkv))."""
    group = q.shape[1] // k.shape[1]
    if group == 1:
        return k, v
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def _probs(q, k, v, key_mask, q_start, scale: float):
    """The reference's softmax in fp32: P (B, H, Sq, Skv), 0 outside the allowed keys and on rows without any, and
    k, v in fp32 with the keys no query may see (e.g. cache slots not written yet, which the kernels never read)
    zeroed, so that whatever they hold (NaN in uninitialised memory) cannot reach a result through 0 * NaN."""
    b, _, sq, _ = q.shape
    skv = k.shape[2]
    k, v = repeat_kv(q, k, v)  # (B, H, Skv, D)
    allowed = allowed_mask(key_mask, q_start, b, sq, skv, q.device)  # (B, 1, Sq, Skv)
    seen = allowed.any(2).view(b, 1, skv, 1)  # (B, 1, Skv, 1)
    k32, v32 = k.float().masked_fill(~seen, 0.0), v.float().masked_fill(~seen, 0.0)
    scores = torch.matmul(q.float(), k32.transpose(-1, -2)) * scale  # (B, H, Sq, Skv)
    has_key = allowed.any(-1, keepdim=True)  # (B, 1, Sq, 1)
    # rows with no key: a softmax over zeros, then 0 (the kernels' output); finite, so that differentiating the
    # reference itself (under torch.func transforms) gives 0 there, not NaN
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")).masked_fill(~has_key, 0.0), dim=-1)
    return probs.masked_fill(~has_key, 0.0), k32, v32


def attention_ref(q, k, v, key_mask, q_start, scale: float) -> torch.Tensor:
    """Pure-PyTorch reference in fp32: softmax(scale * q k^T, masked) v -> (B, Sq, H, D) in q's dtype."""
    probs, _, v32 = _probs(q, k, v, key_mask, q_start, scale)
    out = torch.matmul(probs, v32)  # (B, H, Sq, D)
    return out.transpose(1, 2).contiguous().to(q.dtype)


FP8_TILE = 128  # keys per scale of the FP8 prefill's k and v


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    """x rounded to float8 e4m3 (nearest even, saturated at +-448), back in fp32."""
    return x.clamp(-448.0, 448.0).to(FP8_DTYPE).float()


def _tile_pow2_scales(x: torch.Tensor) -> torch.Tensor:
    """x (B, Hkv, Skv, D) -> (B, Hkv, Skv, 1): for each key, the scale of its 128-key tile, the power of two s with
    max |x| / s in (224, 448] over the tile (1 for a zero tile)."""
    b, h, skv, d = x.shape
    pad = -skv % FP8_TILE
    tiles = torch.nn.functional.pad(x.abs(), (0, 0, 0, pad)).view(b, h, -1, FP8_TILE * d).amax(-1)  # (B, Hkv, T)
    scale = torch.exp2(torch.ceil(torch.log2(tiles / 448.0)))
    scale = torch.where(tiles > 0, scale, torch.ones_like(scale))
    return scale.repeat_interleave(FP8_TILE, dim=-1)[..., :skv, None]


def attention_fp8_ref(q, k, v, key_mask, q_start, scale: float) -> torch.Tensor:
    """Pure-PyTorch reference of the FP8 prefill (``FUSEINFER_ATTN_FP8=1``) in fp32: q rounded to e4m3 at one scale
    per row (max |q| / 448), k and v at one power-of-two scale per 128-key tile, P (at most 1 here: the exact row max)
    rounded to e4m3 for P V and for its row sums -> (B, Sq, H, D) in q's dtype. The kernel's online softmax rescales
    by a running max, so its P is rounded at other magnitudes: tests compare both to fp32 attention."""
    b, _, sq, _ = q.shape
    skv = k.shape[2]
    allowed = allowed_mask(key_mask, q_start, b, sq, skv, q.device)  # (B, 1, Sq, Skv)
    # keys up to the row's causal end (those its last query may see, padding too) go into the tiles' scales; the
    # kernel zeroes the rest (unwritten cache slots may hold NaN)
    inside = allowed_mask(None, q_start, b, sq, skv, q.device)[:, :, -1:].transpose(-1, -2)  # (B, 1, Skv, 1)
    k32, v32 = k.float().masked_fill(~inside, 0.0), v.float().masked_fill(~inside, 0.0)
    ks, vs = _tile_pow2_scales(k32), _tile_pow2_scales(v32)  # (B, Hkv, Skv, 1)
    k8, v8 = _e4m3(k32 / ks) * ks, _e4m3(v32 / vs) * vs
    qamax = q.float().abs().amax(-1, keepdim=True)  # (B, H, Sq, 1)
    qs = torch.where(qamax > 0, qamax / 448.0, torch.ones_like(qamax))
    q8 = _e4m3(q.float() / qs) * qs
    k8, v8 = repeat_kv(q, k8, v8)  # (B, H, Skv, D)
    scores = torch.matmul(q8, k8.transpose(-1, -2)) * scale  # (B, H, Sq, Skv)
    has_key = allowed.any(-1, keepdim=True)  # (B, 1, Sq, 1)
    scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(~has_key, 0.0)
    p = _e4m3(torch.exp(scores - scores.amax(-1, keepdim=True)).masked_fill(~allowed, 0.0))  # (B, H, Sq, Skv)
    total = p.sum(-1, keepdim=True)
    out = torch.matmul(p, v8) / total.clamp_min(torch.finfo(torch.float32).tiny)  # (B, H, Sq, D)
    out = out.masked_fill(~has_key, 0.0)
    return out.transpose(1, 2).contiguous().to(q.dtype)


def attention_sdpa(q, k, v, key_mask, q_start, scale: float) -> torch.Tensor:
    """The CUDA fallback for cases our kernel does not cover (fp32, other head dims): SDPA with the boolean
    mask, queries with no key set to 0 -> (B, Sq, H, D)."""
    b, _, sq, _ = q.shape
    allowed = allowed_mask(key_mask, q_start, b, sq, k.shape[2], q.device)  # (B, 1, Sq, Skv)
    k, v = repeat_kv(q, k, v)  # (B, H, Skv, D)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    out = out.masked_fill(~allowed.any(-1, keepdim=True), 0.0)  # (B, H, Sq, D); SDPA may give NaN there
    return out.transpose(1, 2).contiguous()


@torch.library.custom_op("fuseinfer::attention", mutates_args=())
def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
    q_start: torch.Tensor | None, scale: float,
) -> torch.Tensor:
    return attention_ref(q, k, v, key_mask, q_start, scale)


def sm90_prefill(enabled: bool):
    """Within the block, CUDA prefills (more than 16 queries) run the wgmma kernel where the build and the GPU have
    it (``True``) or the mma.sync one (``False``): overrides the FUSEINFER_ATTN_SM90 knob (``fuseinfer.core.knobs``)."""
    return knobs.override(ATTN_SM90="1" if enabled else "0")


def kernel_supports(q: torch.Tensor) -> bool:
    """Whether the CUDA kernel handles this query tensor (else the op runs SDPA on CUDA)."""
    return q.dtype in KERNEL_DTYPES and q.shape[-1] in KERNEL_HEAD_DIMS


@_attention.register_kernel("cuda")
def _attention_cuda(q, k, v, key_mask, q_start, scale):
    ext = extension(q.device)
    if ext is None or not kernel_supports(q) or (k.shape[1] != q.shape[1] and not KERNEL_GQA):
        return attention_sdpa(q, k, v, key_mask, q_start, scale)
    return ext.attention(q, k, v, key_mask, q_start, scale)


@_attention.register_fake
def _(q, k, v, key_mask, q_start, scale):
    b, h, sq, d = q.shape
    return q.new_empty(b, sq, h, d)


def _setup_context(ctx, inputs, output):
    q, k, v, key_mask, q_start, scale = inputs
    ctx.save_for_backward(q, k, v, key_mask, q_start)
    ctx.scale = scale


def _backward(ctx, grad):
    """The reference's gradients, in fp32 from P recomputed: dV = P^T dO, dS = P * (dO V^T - rowsum(dO V^T * P)),
    dQ = scale dS K, dK = scale dS^T Q (0 wherever P is 0: masked keys, rows without keys, unseen keys)."""
    q, k, v, key_mask, q_start = ctx.saved_tensors
    probs, k32, v32 = _probs(q, k, v, key_mask, q_start, ctx.scale)  # P (B, H, Sq, Skv)
    do = grad.transpose(1, 2).float()  # (B, H, Sq, D)
    dp = torch.matmul(do, v32.transpose(-1, -2))  # (B, H, Sq, Skv)
    ds = probs * (dp - (dp * probs).sum(-1, keepdim=True)) * ctx.scale
    dq = torch.matmul(ds, k32)  # (B, H, Sq, D)
    dk = torch.matmul(ds.transpose(-1, -2), q.float())  # (B, H, Skv, D)
    dv = torch.matmul(probs.transpose(-1, -2), do)  # (B, H, Skv, D)
    group = q.shape[1] // k.shape[1]
    if group > 1:  # sum over the query heads that share a key/value head: (B, Hkv, Skv, D)
        dk = dk.unflatten(1, (k.shape[1], group)).sum(2)
        dv = dv.unflatten(1, (k.shape[1], group)).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


# the kernels are forward-only: a call whose inputs need gradients goes through the dispatcher (_ext.route)
_attention.register_autograd(_backward, setup_context=_setup_context)


def check_shapes(q, k, v) -> None:
    """q (B, H, Sq, D) and k, v (B, Hkv, Skv, D) with H a multiple of Hkv and D > 0, else one clear error."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[1] == 0 \
            or q.shape[1] % k.shape[1] or k.shape[-1] != q.shape[-1] or q.shape[-1] == 0:
        raise FuseInferError(f"attention: expected q (B,H,Sq,D) and k, v (B,Hkv,Skv,D) with H a multiple of Hkv, "
                             f"D > 0; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")


def check_mask(q, k, key_mask, q_start) -> None:
    """key_mask (B, Skv) bool and q_start (B,) int32, or None: one clear error naming the fix otherwise."""
    b, skv = q.shape[0], k.shape[2]
    if key_mask is not None and (key_mask.dtype != torch.bool or key_mask.shape != (b, skv)):
        raise FuseInferError(f"attention: key_mask must be a ({b}, {skv}) bool tensor (True: a real key), got "
                             f"{tuple(key_mask.shape)} {key_mask.dtype}; e.g. attention_mask.bool()")
    if q_start is not None and (q_start.shape != (b,) or q_start.dtype != torch.int32):
        raise FuseInferError(f"attention: q_start must be a ({b},) int32 tensor, got {tuple(q_start.shape)} "
                             f"{q_start.dtype}; e.g. q_start.int()")


def attention(q, k, v, key_mask=None, q_start=None, scale: float | None = None, kv_scale=None) -> torch.Tensor:
    """Masked causal attention; see the module docstring. Returns (B, Sq, H, D). k, v may be an FP8 cache
    (float8_e4m3fn) with its scales ``kv_scale`` (2, Hkv) fp32 (``attention_kv_fp8``)."""
    if k.dtype == FP8_DTYPE:
        return attention_kv_fp8(q, k, v, key_mask, q_start, scale, kv_scale)
    check_shapes(q, k, v)
    if not q.dtype == k.dtype == v.dtype:
        raise FuseInferError(f"attention: q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    check_mask(q, k, key_mask, q_start)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return route(torch.ops.fuseinfer.attention, attention_ref, _attention_cuda, (q, k, v, key_mask, q_start, scale),
                 (q, k, v))


# ---------------------------------------------------------------------------------------------- FP8 (e4m3) caches

FP8_SPLIT_MAX_SQ = 16  # queries up to which the CUDA kernel reads e4m3 directly (split-KV); above, it dequantizes


def attention_kv_fp8_ref(q, k, v, key_mask, q_start, scale: float, kv_scale) -> torch.Tensor:
    """Pure-PyTorch reference over an e4m3 cache: k, v (B, Hkv, Skv, D) times their (2, Hkv) scales in fp32, then
    ``attention_ref`` (fp32 softmax and products) -> (B, Sq, H, D) in q's dtype."""
    return attention_ref(q, dequantize_kv(k, kv_scale[0]), dequantize_kv(v, kv_scale[1]), key_mask, q_start, scale)


@torch.library.custom_op("fuseinfer::attention_kv_fp8", mutates_args=())
def _attention_kv_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                      q_start: torch.Tensor | None, scale: float, kv_scale: torch.Tensor) -> torch.Tensor:
    return attention_kv_fp8_ref(q, k, v, key_mask, q_start, scale, kv_scale)


@_attention_kv_fp8.register_kernel("cuda")
def _attention_kv_fp8_cuda(q, k, v, key_mask, q_start, scale, kv_scale):
    """Decode-sized calls (Sq <= FP8_SPLIT_MAX_SQ) read e4m3 in the split-KV kernel (scales folded into q.k and the
    output, one multiply per head); prefills dequantize the cache to q's dtype once and run the fp16/bf16 kernels
    (a prefill reads the cache once; its time is in the tensor-core GEMMs, not in K/V bytes)."""
    ext = extension(q.device)
    if ext is not None and hasattr(ext, "attention_kv_fp8") and kernel_supports(q) \
            and q.shape[2] <= FP8_SPLIT_MAX_SQ and kv_scale.is_contiguous():
        return ext.attention_kv_fp8(q, k, v, key_mask, q_start, scale, kv_scale)
    return _attention_cuda(q, dequantize_kv(k, kv_scale[0], q.dtype), dequantize_kv(v, kv_scale[1], q.dtype),
                           key_mask, q_start, scale)


@_attention_kv_fp8.register_fake
def _(q, k, v, key_mask, q_start, scale, kv_scale):
    b, h, sq, d = q.shape
    return q.new_empty(b, sq, h, d)


def attention_kv_fp8(q, k, v, key_mask=None, q_start=None, scale: float | None = None, kv_scale=None):
    """``attention`` over an FP8 cache: k, v (B, Hkv, Skv, D) float8_e4m3fn, a stored x meaning x * kv_scale[0]
    (keys) or x * kv_scale[1] (values), per head; q (B, H, Sq, D) fp16 / bf16 / fp32. Inference only (no
    gradients). Returns (B, Sq, H, D) in q's dtype."""
    check_shapes(q, k, v)
    if not k.dtype == v.dtype == FP8_DTYPE or not q.is_floating_point() or q.dtype == FP8_DTYPE:
        raise FuseInferError(f"attention over an FP8 cache: k and v must be float8_e4m3fn and q fp16/bf16/fp32, got "
                             f"{q.dtype}, {k.dtype}, {v.dtype}")
    check_kv_scale(kv_scale, k)
    check_mask(q, k, key_mask, q_start)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    args = (q, k, v, key_mask, q_start, scale, kv_scale)
    if transformed():
        return attention_kv_fp8_ref(*args)
    if eager_cuda(q, k, v, kv_scale):
        return _attention_kv_fp8_cuda(*args)
    return torch.ops.fuseinfer.attention_kv_fp8(*args)
