"""Our attention op (``ops/attention.py``: causal, per-row ``key_mask`` / ``q_start``) run by the flash-attn-4 package
(FlashAttention's CuTe-DSL kernels, import name ``flash_attn.cute``), where its API can express the call exactly.

How our mask description maps onto flash-attn-4's API (``flash_attn_func`` / ``flash_attn_varlen_func``):

* no ``key_mask``, no ``q_start`` (query i at key index ``Skv - Sq + i``): ``flash_attn_func(causal=True)`` on the
  (B, S, H, D) views of q, k, v (its causal mask is bottom-right aligned, as ours; no copy: it takes strided tensors
  whose last dim is contiguous);
* ``q_start`` only (a static cache whose slots past ``q_start + Sq`` are not written yet): batched
  ``flash_attn_varlen_func`` with ``seqused_k = q_start + Sq`` (again bottom-right aligned, no copy);
* a ``key_mask`` (left padding): flash-attn-4 has no per-key mask (only ``mask_mod`` callables compiled per mask,
  not used here) and its ``seqused_k`` trims keys at the end, not the start. A row whose allowed keys are one run
  ``[lo, hi)`` (left padding, ``hi = q_start + Sq``) maps exactly onto its varlen form with every (row, head) as a
  batch entry of one head: k, v (B, H, Skv, D) flatten to (B*H*Skv, 1, D) (a view when contiguous, e.g. a KV cache;
  else one copy), ``cu_seqlens_k[b*H + h] = (b*H + h) * Skv + lo[b]`` gives each entry's first key and ``seqused_k =
  hi - lo`` its length. Cost: q (B, H, Sq, D) -> (B*H, Sq, 1, D) and the output back to (B, Sq, H, D) are one copy
  each (plus k/v's when they are views of the fused q/k/v GEMM, i.e. a prefill without a cache), O(S * D) against
  attention's O(S^2 * D); and one host sync to check that every row's keys are one run (once per forward for
  transformers' caches, whose key mask all layers share; per layer for fuseinfer.generate's prefill). A mask with
  holes runs our kernel.
* inside CUDA-graph capture (``fuseinfer.generate``) a key mask cannot be checked (no host sync there), so those calls
  run our kernel; so do fp32 inputs, head dims flash-attn-4 does not take on sm_90 (8..256, multiple of 8),
  grouped-query attention (fewer key/value heads than query heads: the per-(row, head) mapping above assumes one
  key/value head per query head), inputs that need gradients, torch.func transforms and CPUs (the reference).

Queries without any allowed key return 0, as our kernel does (set explicitly, whatever the package writes there).
"""
from __future__ import annotations

import importlib

import torch

from fuseinfer.core.extension import transformed
from fuseinfer.ops.attention import _attention_cuda, _backward, _setup_context, attention_ref

PACKAGE = "flash-attn-4"
INSTALL_HINT = "pip install fuseinfer[flash-attn]"
_fa = None  # the flash_attn.cute module once imported
_fa_error: str | None = None
_run_check: tuple | None = None  # (key_mask, its version, Sq, result): see _left_padded


def load_flash_attn():
    """(flash_attn.cute, None) or (None, why it does not import); tried once per process."""
    global _fa, _fa_error
    if _fa is None and _fa_error is None:
        try:
            _fa = importlib.import_module("flash_attn.cute")
            for name in ("flash_attn_func", "flash_attn_varlen_func"):
                if not hasattr(_fa, name):
                    raise ImportError(f"flash_attn.cute has no {name} (a flash-attn-4 too old or too new)")
        except Exception as exc:  # (a broken install raises more than ImportError: RuntimeError from the DSL libs)
            _fa, _fa_error = None, f"{type(exc).__name__}: {exc}"
    return _fa, _fa_error


def package_version() -> str:
    """The installed flash-attn-4's version, or 'not installed'."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(PACKAGE)
    except PackageNotFoundError:
        return "not installed"


def fa_supports(q: torch.Tensor) -> bool:
    """Whether flash-attn-4 takes these queries (dtype, head dim) on their device; False on CPU."""
    d = q.shape[-1]
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and 8 <= d <= 256 and d % 8 == 0


def _out(res) -> torch.Tensor:
    return res[0] if isinstance(res, tuple) else res  # (out, lse); lse is None without return_lse


def _left_padded(key_mask: torch.Tensor, q_start: torch.Tensor | None, sq: int):
    """(exact, lo (B,) int32, hi (B,) int32): whether each row's allowed keys, ``key_mask`` within ``[0, hi)`` with
    ``hi = q_start + Sq`` (``Skv`` without q_start), are one run ``[lo, hi)`` (lo = hi for a row without keys).

    One host sync. Without q_start (transformers' caches) it is cached for the key_mask object (held, so its id
    cannot be reused) until it is written to (its version counter): transformers builds one mask per forward for
    all layers. With q_start (fuseinfer.generate's static cache) it is not: the runtime advances q_start in place
    from a kernel, which autograd's version counter does not see."""
    global _run_check
    c = _run_check
    if q_start is None and c is not None and c[0] is key_mask and c[1] == key_mask._version and sq == c[2]:
        return c[3]
    b, skv = key_mask.shape
    dev = key_mask.device
    if q_start is None:
        hi = torch.full((b,), skv, dtype=torch.int32, device=dev)
    else:
        hi = (q_start.to(torch.int32) + sq).clamp(0, skv)
    valid = key_mask & (torch.arange(skv, device=dev).view(1, skv) < hi.view(b, 1))  # (B, Skv)
    count = valid.sum(1, dtype=torch.int32)  # (B,)
    first = valid.to(torch.int32).argmax(1).to(torch.int32)  # (B,) first True (0 when none)
    lo = torch.where(count > 0, first, hi)
    exact = bool(((hi - lo) == count).all())  # the one host sync
    result = (exact, lo, hi)
    if q_start is None:
        _run_check = (key_mask, key_mask._version, sq, result)
    return result


def plan(q, k, key_mask, q_start) -> tuple[str | None, object]:
    """How flash-attn-4 runs this call: ("dense" | "seqused" | "runs", (lo, hi) for "runs"), or (None, why our op
    runs it instead); see the module docstring."""
    fa, why = load_flash_attn()
    if fa is None:
        return None, f"flash-attn-4 does not import ({why})"
    if not fa_supports(q):
        return None, f"flash-attn-4 does not take {q.dtype} head dim {q.shape[-1]} on {q.device.type}"
    if k.shape[1] != q.shape[1]:  # (the "runs" mapping flattens one key/value head per query head)
        return None, "grouped-query attention (fewer key/value heads than query heads)"
    sq, skv = q.shape[2], k.shape[2]
    if key_mask is None and q_start is None:
        return ("dense", None) if sq <= skv else (None, "more queries than keys without a q_start")
    if key_mask is None:
        return "seqused", None
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        return None, "a key mask inside CUDA-graph capture (its runs cannot be checked without a host sync)"
    if k.shape[1] != q.shape[1]:  # (the runs path flattens k / v per query head)
        return None, "grouped-query k / v with a key mask: the runs path takes one key/value head per query head"
    exact, lo, hi = _left_padded(key_mask, q_start, sq)
    return ("runs", (lo, hi)) if exact else (None, "a row's allowed keys are not one run (a mask with holes)")


def flash_attention_cuda(q, k, v, key_mask, q_start, scale: float) -> torch.Tensor:
    """flash-attn-4 where it covers the call exactly (module docstring), else our CUDA op -> (B, Sq, H, D)."""
    kind, info = plan(q, k, key_mask, q_start)
    if kind is None:
        return _attention_cuda(q, k, v, key_mask, q_start, scale)
    fa = _fa
    b, h, sq, d = q.shape
    skv = k.shape[2]
    if kind == "dense":
        # (B, S, H, D) views; bottom-right-aligned causal = ours with q_start = Skv - Sq
        return _out(fa.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       softmax_scale=scale, causal=True)).contiguous()
    if kind == "seqused":
        # keys [0, q_start + Sq) (the cache slots written so far; q_start + Sq <= Skv, as the cache guarantees)
        seqused = (q_start.to(torch.int32) + sq).clamp(0, skv)  # (B,)
        return _out(fa.flash_attn_varlen_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              seqused_k=seqused, max_seqlen_k=skv, softmax_scale=scale,
                                              causal=True)).contiguous()
    lo, hi = info  # "runs"
    # every (row, head) a batch entry of one head, its keys a window of the flattened cache
    qb = q.reshape(b * h, sq, 1, d)  # (B*H, Sq, 1, D)
    kb, vb = k.reshape(b * h * skv, 1, d), v.reshape(b * h * skv, 1, d)  # (B*H*Skv, 1, D); views when contiguous
    entry = torch.arange(b * h, device=q.device, dtype=torch.int32)  # (B*H,)
    starts = entry * skv + lo.repeat_interleave(h)  # (B*H,)
    cu_seqlens_k = torch.cat([starts, starts.new_full((1,), b * h * skv)])  # (B*H + 1,)
    seqused_k = (hi - lo).repeat_interleave(h).contiguous()  # (B*H,)
    out = _out(fa.flash_attn_varlen_func(qb, kb, vb, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
                                         max_seqlen_k=skv, softmax_scale=scale, causal=True))  # (B*H, Sq, 1, D)
    qpos = (hi - sq).view(b, 1) + torch.arange(sq, device=q.device, dtype=torch.int32).view(1, sq)  # (B, Sq)
    no_key = (qpos < lo.view(b, 1)).view(b, 1, sq, 1)  # queries before the row's first key
    out = out.view(b, h, sq, d).masked_fill(no_key, 0.0)  # (B, H, Sq, D)
    return out.transpose(1, 2).contiguous()  # (B, Sq, H, D)


@torch.library.custom_op("fuseinfer::flash_attention", mutates_args=())
def _flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
    q_start: torch.Tensor | None, scale: float,
) -> torch.Tensor:
    return attention_ref(q, k, v, key_mask, q_start, scale)


_flash_attention.register_kernel("cuda")(flash_attention_cuda)


@_flash_attention.register_fake
def _(q, k, v, key_mask, q_start, scale):
    b, h, sq, d = q.shape
    return q.new_empty(b, sq, h, d)


# forward-only like our kernel: gradients are the reference's (ops/attention.py)
_flash_attention.register_autograd(_backward, setup_context=_setup_context)


def flash_attention(q, k, v, key_mask=None, q_start=None, scale: float | None = None) -> torch.Tensor:
    """``ops.attention``'s contract run by flash-attn-4 where it covers the call -> (B, Sq, H, D). The inputs are not
    checked again: the patched attention calls it with what it would hand ``ops.attention``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if transformed():
        return attention_ref(q, k, v, key_mask, q_start, scale)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if q.is_cuda and not needs_grad and not torch.compiler.is_compiling():
        return flash_attention_cuda(q, k, v, key_mask, q_start, scale)  # eager: skip the dispatcher's Python layer
    return torch.ops.fuseinfer.flash_attention(q, k, v, key_mask, q_start, scale)
