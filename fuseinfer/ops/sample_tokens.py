"""Sampling's next-token choice in one pass over each row: transformers' warpers and the draw, without a sort.

``sample_tokens(scores, seed, offset, temperature, top_k, top_p, min_p)`` takes processed logits ``scores`` (B, V)
fp32 and returns each row's sampled token (B,) int64. Its meaning is :func:`sample_tokens_ref`: the warpers
temperature, top-k, top-p, min-p in transformers' order (:func:`warp_ref`, which ``Sampling.warp`` runs as well),
then a Gumbel-max draw, ``argmax(warped - log(-log(u)))`` with ``u`` uniform in (0, 1), which samples from
``softmax(warped)``. The uniforms come from a counter-based generator (Philox4x32-10, :func:`philox_uniform`): token
``i`` of row ``r`` takes word ``i % 4`` of the block keyed by ``seed`` (1,) at counter (i // 4, r, offset), so a draw
is a pure function of (seed, offset, row, token) and reads both from device tensors: a CUDA graph replays new draws
as the session's step counter (``offset``) moves, and the kernel and the reference draw the same numbers.

Ties at the cut-offs resolve as transformers does: top-k keeps every token >= the k-th largest value; top-p sorts
ascending (stable: among equal values the lower index comes first), drops the tokens whose cumulative probability is
<= 1 - top_p and keeps the last; min-p drops the tokens whose probability is below ``min_p`` times the largest.

On CUDA it is one kernel (``csrc/sample_tokens.cu``): the top-k and top-p cut-offs found by selection over 256-bin
histograms (per-bin counts for top-k, per-bin probability mass for top-p; first equal slices of the row's value
range, then the order-preserving 32-bit keys of the scaled logits in the chosen slice), then the draw over the kept
tokens; no sort, no (B, V) temporaries. On sm_90 GPUs a row is split over a thread-block cluster of 2 to 16 blocks
(their histograms summed over distributed shared memory) for vocabularies of 4096 tokens and more; elsewhere one
block takes a row. Its result feeds
``emit_tokens(..., chosen=tokens)``, whose bookkeeping then skips the argmax over the vocabulary: the greedy path's
kernel is unchanged. The cut-offs' probability sums run in another order than the reference's cumulative sum, so a
token whose cumulative probability lies within float rounding of a cut-off may be kept by one and not the other.
"""
from __future__ import annotations

import torch

from fuseinfer.core.errors import FuseInferError
from fuseinfer.core.extension import eager_cuda, extension

_MASK = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # and key increments (Salmon et al., Random123)


def warp_ref(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             min_p: float | None = None) -> torch.Tensor:
    """Processed logits (B, V) fp32 -> the warped scores transformers samples from (TemperatureLogitsWarper,
    TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, in that order); removed tokens are -inf."""
    if temperature != 1.0:
        logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        # ascending like TopPLogitsWarper; stable, so that ties at the cut-off resolve by index (the CUDA kernel's
        # rule; an unstable sort resolves them arbitrarily)
        sorted_logits, order = torch.sort(logits, dim=-1, stable=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum <= 1 - top_p
        drop[:, -1] = False  # keep at least the most likely token
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    if min_p is not None:  # MinPLogitsWarper: drop p < min_p * max p (the top token always stays)
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
    return logits


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of a * m for int64 tensors a in [0, 2^32) and a constant m < 2^32, without
    overflowing int64: m splits into 16-bit halves."""
    p_lo = a * (m & 0xFFFF)  # < 2^48
    p_hi = a * (m >> 16)  # < 2^48
    t = p_lo + ((p_hi & 0xFFFF) << 16)  # < 2^49: the product's low 48 bits plus a carry
    return ((t >> 32) + (p_hi >> 16)) & _MASK, t & _MASK


def philox4x32(counter: tuple, key: tuple) -> tuple:
    """Philox4x32-10 on int64 tensors holding 32-bit words (broadcasting): counter (c0, c1, c2, c3), key (k0, k1)
    -> four 32-bit words (what csrc/sample_tokens.cu computes per counter)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
        hi0, lo0 = _mulhilo(c0, _M0)
        hi1, lo1 = _mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def philox_uniform(seed: torch.Tensor, offset: torch.Tensor, rows: int, v: int) -> torch.Tensor:
    """(rows, v) fp32 uniforms in (0, 1): token i of row r from word i % 4 of Philox at counter (i // 4, r,
    offset low, offset high), key (seed low, seed high); u = (word >> 9 + 0.5) / 2^23, exact in fp32 (neither 0
    nor 1, so both logarithms of the draw are finite). seed, offset: (1,) int64 (device tensors: graph safe)."""
    dev = seed.device
    blocks = -(-v // 4)
    c0 = torch.arange(blocks, dtype=torch.long, device=dev)[None, :]  # (1, blocks)
    c1 = torch.arange(rows, dtype=torch.long, device=dev)[:, None]  # (rows, 1)
    off, s = offset.long().view(1, 1), seed.long().view(1, 1)
    words = philox4x32((c0, c1, off & _MASK, (off >> 32) & _MASK), (s & _MASK, (s >> 32) & _MASK))
    x = torch.stack(torch.broadcast_tensors(*words), dim=-1).reshape(rows, blocks * 4)[:, :v]  # (rows, v)
    return ((x >> 9).float() + 0.5) * 2.0 ** -23


def sample_tokens_ref(scores: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor, temperature: float = 1.0,
                      top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """Pure-PyTorch reference: scores (B, V) fp32 -> sampled tokens (B,) int64 (a row with nothing kept, all -inf:
    token 0). top_k 0, top_p 1 and min_p 0 switch that warper off."""
    warped = warp_ref(scores, temperature, top_k or None, top_p if top_p < 1.0 else None, min_p or None)
    u = philox_uniform(seed, offset, *scores.shape)
    return (warped - torch.log(-torch.log(u))).argmax(-1)  # Gumbel-max: first maximum on ties


def kernel_supports(scores: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor) -> bool:
    """Whether the CUDA kernel serves these tensors (else the op runs the reference)."""
    ext = extension(scores.device)
    return (ext is not None and hasattr(ext, "sample_tokens") and scores.dtype == torch.float32
            and scores.is_contiguous() and 1 <= scores.shape[0] <= 65535 and 1 <= scores.shape[1] < 2**30
            and seed.dtype == offset.dtype == torch.int64 and seed.device == offset.device == scores.device)


@torch.library.custom_op("fuseinfer::sample_tokens", mutates_args=())
def _sample_tokens(scores: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor, temperature: float, top_k: int,
                   top_p: float, min_p: float) -> torch.Tensor:
    return sample_tokens_ref(scores, seed, offset, temperature, top_k, top_p, min_p)


@_sample_tokens.register_kernel("cuda")
def _sample_tokens_cuda(scores, seed, offset, temperature, top_k, top_p, min_p):
    if kernel_supports(scores, seed, offset):
        return extension().sample_tokens(scores, seed, offset, temperature, top_k, top_p, min_p)
    return sample_tokens_ref(scores, seed, offset, temperature, top_k, top_p, min_p)


@_sample_tokens.register_fake
def _(scores, seed, offset, temperature, top_k, top_p, min_p):
    return scores.new_empty(scores.shape[0], dtype=torch.long)


def sample_tokens(scores: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor, temperature: float = 1.0,
                  top_k: int | None = None, top_p: float | None = None, min_p: float | None = None) -> torch.Tensor:
    """See the module docstring. scores (B, V) fp32; seed, offset (1,) int64 on the scores' device -> (B,) int64.
    top_k / top_p / min_p None: that warper is off (transformers' meaning for each value)."""
    if scores.dim() != 2 or scores.dtype != torch.float32 or seed.shape != (1,) or offset.shape != (1,):
        raise FuseInferError(f"sample_tokens: expected scores (B, V) float32 and seed, offset (1,) int64, got scores "
                             f"{tuple(scores.shape)} {scores.dtype}, seed {tuple(seed.shape)}, offset "
                             f"{tuple(offset.shape)}")
    if not temperature > 0:
        raise FuseInferError(f"sample_tokens: temperature must be > 0, got {temperature!r}")
    args = (scores, seed, offset, float(temperature), int(top_k or 0), 1.0 if top_p is None else float(top_p),
            0.0 if min_p is None else float(min_p))
    if eager_cuda(scores):
        return _sample_tokens_cuda(*args)
    return torch.ops.fuseinfer.sample_tokens(*args)
