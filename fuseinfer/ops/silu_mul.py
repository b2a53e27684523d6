"""The gated MLP's activation, fused: ``silu(gate) * up`` from the one GEMM that computes gate and up together.

``gate_up`` (..., 2F) holds the gate projection's output in its first F columns and the up projection's in the
last F (the family concatenates ``gate_proj`` and ``up_proj`` weights into one (2F, E) matrix). Rounds exactly as
transformers' ``act_fn(gate_proj(x)) * up_proj(x)``: SiLU in fp32 rounded to the dtype, then the product rounded.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fuseinfer.core.extension import extension, route
from fuseinfer.core.errors import FuseInferError

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # csrc/silu_mul.cu; others run the reference


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Pure-PyTorch reference: (..., 2F) -> (..., F)."""
    gate, up = gate_up.chunk(2, dim=-1)
    # silu of a contiguous gate, as the model's own gate_proj output: on the CPU, fp32 silu's last bit depends on
    # the layout (vectorised and scalar exp), and the chunk is a strided view
    return F.silu(gate.contiguous()) * up


@torch.library.custom_op("fuseinfer::silu_mul", mutates_args=())
def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return silu_mul_ref(gate_up).contiguous()


@_silu_mul.register_kernel("cuda")
def _silu_mul_cuda(gate_up):
    ext = extension(gate_up.device)
    if ext is None or not hasattr(ext, "silu_mul") or gate_up.dtype not in KERNEL_DTYPES:
        return silu_mul_ref(gate_up).contiguous()
    return ext.silu_mul(gate_up.contiguous())


@_silu_mul.register_fake
def _(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def silu_mul_grad(gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of ``silu_mul`` at gate_up (..., 2F) for the output's gradient ``grad`` (..., F): (..., 2F)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    g = grad.float()
    d_gate = g * up * sig * (1 + gate * (1 - sig))
    d_up = g * gate * sig
    return torch.cat([d_gate, d_up], -1).to(gate_up.dtype)


def _backward(ctx, grad):
    (gate_up,) = ctx.saved_tensors
    return silu_mul_grad(gate_up, grad)


_silu_mul.register_autograd(_backward, setup_context=_setup_context)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[..., :F]) * gate_up[..., F:]``: (..., 2F) -> (..., F), contiguous."""
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2 or not gate_up.is_floating_point():
        raise FuseInferError(f"silu_mul: expected a floating-point (..., 2F) tensor, got {tuple(gate_up.shape)} "
                             f"{gate_up.dtype}")
    return route(torch.ops.fuseinfer.silu_mul, silu_mul_ref, _silu_mul_cuda, (gate_up,), (gate_up,))
