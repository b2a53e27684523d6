"""Gradients for the fused ops that a patched model's forward runs: those of each op's pure-PyTorch reference.

The CUDA kernels are forward-only. A call whose inputs need gradients (grad mode on and an input with
``requires_grad``, e.g. a patched model in eval mode run without ``torch.no_grad()``) goes through the
dispatcher, where the formula registered here saves the op's tensor inputs and, in backward, takes the
vector-Jacobian product of the reference on them (``torch.func.vjp``, so torch.compile traces it too). The
gradients are the reference's: correct, not fused, at the cost of running the reference forward once more.
"""
from __future__ import annotations

from typing import Callable

import torch


def register_reference_backward(op, ref: Callable) -> None:
    """Register ``op``'s autograd formula as the VJP of ``ref``, which takes the op's arguments in order and
    returns a tensor or a tuple of tensors like the op. Integer, boolean and absent (None) arguments get no
    gradient."""

    def setup_context(ctx, inputs, output):
        ctx.tensor_pos = [i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor)]
        ctx.save_for_backward(*(inputs[i] for i in ctx.tensor_pos))
        ctx.args = [None if isinstance(a, torch.Tensor) else a for a in inputs]

    def backward(ctx, *grads):
        args = list(ctx.args)
        for i, t in zip(ctx.tensor_pos, ctx.saved_tensors):
            args[i] = t
        wanted = [i for i in ctx.tensor_pos if ctx.needs_input_grad[i] and args[i].is_floating_point()]
        result: list = [None] * len(args)
        if not wanted:
            return tuple(result)

        def f(*diff):  # ref as a function of the inputs that get gradients
            full = list(args)
            for i, t in zip(wanted, diff):
                full[i] = t
            return ref(*full)

        outs, vjp = torch.func.vjp(f, *(args[i] for i in wanted))
        single = isinstance(outs, torch.Tensor)
        outs = (outs,) if single else outs
        # an output nobody differentiated (None), or an empty placeholder, contributes nothing
        cot = tuple(torch.zeros_like(o) if g is None or g.shape != o.shape else g.to(o.dtype)
                    for o, g in zip(outs, grads))
        for i, g in zip(wanted, vjp(cot[0] if single else cot)):
            result[i] = g
        return tuple(result)

    torch.library.register_autograd(op, backward, setup_context=setup_context)
