"""Residual add + LayerNorm, fused: ``s = x + residual; y = LayerNorm(s)``, returning ``(y, s)``.

Serves both OPT layouts: pre-LN blocks normalise the residual stream (``residual=None``), post-LN blocks
(opt-350m) normalise ``residual + sublayer_out`` in one pass. The sum is rounded to the input dtype before
normalising, exactly like eager PyTorch's ``layer_norm(residual + x)``; statistics are fp32.
"""
from __future__ import annotations

import torch

from fuseinfer.core.extension import extension, route
from fuseinfer.core.errors import FuseInferError

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # csrc/layer_norm.cu; others run the reference


def add_layer_norm_ref(x, residual, weight, bias, eps: float, store_sum: bool):
    """Pure-PyTorch reference. x, residual: (..., N); weight, bias: (N,) or None -> (y, s)."""
    s = x if residual is None else x + residual
    y = torch.nn.functional.layer_norm(s, (s.shape[-1],), weight, bias, eps)
    return y, (s if store_sum else x.new_empty(0))


@torch.library.custom_op("fuseinfer::add_layer_norm", mutates_args=())
def _add_layer_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, bias: torch.Tensor | None,
    eps: float, store_sum: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _contiguous_outputs(x, *add_layer_norm_ref(x, residual, weight, bias, eps, store_sum))


def _contiguous_outputs(x, y, s):
    """(y, s) contiguous, as the kernel returns them (and the fake promises), and never ``x`` itself (custom
    ops may not return an input; s is x when there is no residual)."""
    return y.contiguous(), (s.clone(memory_format=torch.contiguous_format) if s is x else s.contiguous())


@_add_layer_norm.register_kernel("cuda")
def _add_layer_norm_cuda(x, residual, weight, bias, eps, store_sum):
    ext = extension(x.device)
    if ext is None or x.dtype not in KERNEL_DTYPES:
        return _contiguous_outputs(x, *add_layer_norm_ref(x, residual, weight, bias, eps, store_sum))
    x = x.contiguous()
    residual = None if residual is None else residual.contiguous()
    return ext.add_layer_norm(x, residual, weight, bias, eps, store_sum)


@_add_layer_norm.register_fake
def _(x, residual, weight, bias, eps, store_sum):
    return x.new_empty(x.shape), (x.new_empty(x.shape) if store_sum else x.new_empty(0))  # contiguous


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, eps, store_sum = inputs
    ctx.save_for_backward(x, residual, weight, bias)
    ctx.eps, ctx.store_sum = eps, store_sum


def _backward(ctx, grad_y, grad_s):
    """The reference's gradients: aten's LayerNorm backward at s = x + residual (its statistics recomputed), plus
    s's own gradient when s is an output; x and the residual both get ds."""
    x, residual, weight, bias = ctx.saved_tensors
    s = x if residual is None else x + residual  # (..., N)
    n = [s.shape[-1]]
    _, mean, rstd = torch.ops.aten.native_layer_norm(s, n, weight, bias, ctx.eps)
    need = ctx.needs_input_grad
    ds, dw, db = torch.ops.aten.native_layer_norm_backward(
        grad_y, s, n, mean, rstd, weight, bias, [True, weight is not None and need[2], bias is not None and need[3]])
    if ctx.store_sum:
        ds = ds + grad_s
    return ds, (ds if residual is not None else None), dw, db, None, None


# the kernel is forward-only: a call whose inputs need gradients goes through the dispatcher (_ext.route)
_add_layer_norm.register_autograd(_backward, setup_context=_setup_context)


def add_layer_norm(x, residual=None, weight=None, bias=None, eps: float = 1e-5, store_sum: bool = False):
    """Fused residual add + LayerNorm over the last dim. Returns ``(y, s)``, contiguous; ``s`` is empty unless
    store_sum. ``residual`` has x's shape (no broadcasting)."""
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise FuseInferError(f"add_layer_norm: residual must have x's shape and dtype {tuple(x.shape)} {x.dtype}, "
                             f"got {tuple(residual.shape)} {residual.dtype}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.shape != x.shape[-1:]:
            raise FuseInferError(f"add_layer_norm: {name} must be ({x.shape[-1]},), x's last dim, got {tuple(t.shape)}")
    return route(torch.ops.fuseinfer.add_layer_norm, add_layer_norm_ref, _add_layer_norm_cuda,
                 (x, residual, weight, bias, eps, store_sum), (x, residual, weight, bias))
