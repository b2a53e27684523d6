"""Residual add + RMSNorm, fused: ``s = x + residual; y = RMSNorm(s)``, returning ``(y, s)`` (the Llama family's norm).

Rounds exactly as transformers' ``LlamaRMSNorm`` (and Mistral's, Qwen2's): the sum is rounded to x's dtype, the
statistics are fp32, the normalised value is rounded to x's dtype and then multiplied by ``weight`` in the weight's
dtype (``weight * hidden.to(input_dtype)``), so a fused model matches the unpatched one bit for bit where
``rsqrt`` agrees.
"""
from __future__ import annotations

import torch

from fuseinfer.core.extension import extension, route
from fuseinfer.core.errors import FuseInferError

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # csrc/rms_norm.cu; others run the reference


def add_rms_norm_ref(x, residual, weight, eps: float, store_sum: bool):
    """Pure-PyTorch reference. x, residual: (..., N); weight: (N,) or None -> (y, s) (s empty unless store_sum)."""
    s = x if residual is None else x + residual
    s32 = s.float()
    n = (s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = n if weight is None else weight * n
    return y, (s if store_sum else x.new_empty(0))


def _contiguous_outputs(x, y, s):
    """(y, s) contiguous and never ``x`` itself (a custom op may not return an input)."""
    return y.contiguous(), (s.clone(memory_format=torch.contiguous_format) if s is x else s.contiguous())


@torch.library.custom_op("fuseinfer::add_rms_norm", mutates_args=())
def _add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
                  store_sum: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _contiguous_outputs(x, *add_rms_norm_ref(x, residual, weight, eps, store_sum))


def kernel_supports(x, weight) -> bool:
    """Whether the CUDA kernel handles these tensors (else the op runs the reference)."""
    return x.dtype in KERNEL_DTYPES and (weight is None or weight.dtype == x.dtype)


@_add_rms_norm.register_kernel("cuda")
def _add_rms_norm_cuda(x, residual, weight, eps, store_sum):
    ext = extension(x.device)
    if ext is None or not hasattr(ext, "add_rms_norm") or not kernel_supports(x, weight):
        return _contiguous_outputs(x, *add_rms_norm_ref(x, residual, weight, eps, store_sum))
    return ext.add_rms_norm(x.contiguous(), None if residual is None else residual.contiguous(),
                            None if weight is None else weight.contiguous(), eps, store_sum)


@_add_rms_norm.register_fake
def _(x, residual, weight, eps, store_sum):
    # y has the reference's dtype: ``weight * n`` promotes (an fp32 weight on bf16 activations gives fp32, as in
    # transformers)
    y_dtype = x.dtype if weight is None else torch.promote_types(weight.dtype, x.dtype)
    return x.new_empty(x.shape, dtype=y_dtype), (x.new_empty(x.shape) if store_sum else x.new_empty(0))


def _setup_context(ctx, inputs, output):
    x, residual, weight, eps, store_sum = inputs
    ctx.save_for_backward(x, residual, weight)
    ctx.eps, ctx.store_sum = eps, store_sum


def _backward(ctx, grad_y, grad_s):
    """The reference's gradients (autograd through it, recomputed), plus s's own gradient when s is an output."""
    x, residual, weight = ctx.saved_tensors
    need = ctx.needs_input_grad
    with torch.enable_grad():
        xs = x.detach().requires_grad_(need[0] or need[1])
        w = None if weight is None else weight.detach().requires_grad_(need[2])
        s = xs if residual is None else xs + residual.detach()
        y, _ = add_rms_norm_ref(s, None, w, ctx.eps, False)
        inputs = [t for t in (xs, w) if t is not None and t.requires_grad]
        grads = torch.autograd.grad(y, inputs, grad_y, allow_unused=True) if inputs else []
    grads = dict(zip([id(t) for t in inputs], grads))
    ds = grads.get(id(xs))
    if ctx.store_sum and grad_s is not None and grad_s.numel():
        ds = grad_s if ds is None else ds + grad_s
    dw = grads.get(id(w)) if w is not None else None
    return ds, (ds if residual is not None else None), dw, None, None


_add_rms_norm.register_autograd(_backward, setup_context=_setup_context)


def add_rms_norm(x, residual=None, weight=None, eps: float = 1e-6, store_sum: bool = False):
    """Fused residual add + RMSNorm over the last dim. Returns ``(y, s)``, contiguous; ``s`` is empty unless
    store_sum. ``residual`` has x's shape (no broadcasting); ``weight`` is (N,)."""
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise FuseInferError(f"add_rms_norm: residual must have x's shape and dtype {tuple(x.shape)} {x.dtype}, "
                             f"got {tuple(residual.shape)} {residual.dtype}")
    if weight is not None and weight.shape != x.shape[-1:]:
        raise FuseInferError(f"add_rms_norm: weight must be ({x.shape[-1]},), x's last dim, got {tuple(weight.shape)}")
    return route(torch.ops.fuseinfer.add_rms_norm, add_rms_norm_ref, _add_rms_norm_cuda,
                 (x, residual, weight, eps, store_sum), (x, residual, weight))
