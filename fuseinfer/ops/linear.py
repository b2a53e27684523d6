"""Linear layer with a fused epilogue: ``y = act(x @ w.T + bias + residual)``.

A decoder layer uses three forms: bias (the fused q/k/v projection), bias + ReLU (the first MLP projection) and bias
+ residual add (the attention output projection and the second MLP projection in pre-LN blocks). On CUDA
(``csrc/linear.cu``) the epilogue is applied to the fp32 accumulator before the single store, so the bias,
activation and residual cost no extra pass over memory: cuBLASLt's epilogues for prefill, a weight-streaming
tensor-core kernel for fp16/bf16 decode (M <= 16 rows).

A gated MLP's fused gate/up projection uses a fourth form, activation ``"silu_mul"``: the weight (2F, K) holds the
gate rows then the up rows, and ``y = silu(gate) * up`` is (..., F), exactly ``silu_mul(linear(x))``. The decode
kernel computes it in its epilogue (no (M, 2F) intermediate, one kernel fewer); other shapes run the GEMM and then
``silu_mul``. Both round as that pair of ops does.
"""
from __future__ import annotations

import torch

from fuseinfer.core.extension import extension, route
from fuseinfer.core.errors import FuseInferError
from fuseinfer.ops.silu_mul import _silu_mul_cuda, silu_mul_grad, silu_mul_ref

ACTIVATIONS = ("none", "relu")  # what every fused linear takes
GATED_ACTIVATIONS = (*ACTIVATIONS, "silu_mul")  # linear_epilogue and w8a16_linear: also the gated MLP's
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # csrc/linear.cu; others run the reference


def linear_epilogue_ref(x, weight, bias, residual, activation: str):
    """Pure-PyTorch reference. x: (..., K), weight: (N, K), bias: (N,), residual: (..., N) -> (..., N); with
    activation ``"silu_mul"`` (no residual): ``silu_mul`` of the linear, (..., N / 2).

    Eager PyTorch's order: the linear's output is rounded to x's dtype before the residual add; the CUDA kernel
    adds bias and residual to the fp32 accumulator and rounds once, so in fp16 / bf16 the two can differ by one
    unit in the last place (the tests' dtype tolerances cover it)."""
    y = torch.nn.functional.linear(x, weight, bias)
    if activation == "silu_mul":
        return silu_mul_ref(y)  # (..., N) -> (..., N / 2)
    if residual is not None:
        y = y + residual
    return torch.relu(y) if activation == "relu" else y


def check_activation(activation: str, residual, n: int, choices=GATED_ACTIVATIONS) -> None:
    """The fused linears' common checks of ``activation`` for a weight of ``n`` rows (and a residual or None)."""
    if activation not in choices:
        raise FuseInferError(f"activation must be one of {choices}, got {activation!r}")
    if activation != "none" and residual is not None:
        raise FuseInferError("an activation and a residual cannot be fused into one linear")
    if activation == "silu_mul" and n % 2:
        raise FuseInferError(f"activation 'silu_mul' takes a weight of gate rows then up rows (an even count), got "
                             f"{n} rows")


def _check(x, weight, bias, residual, activation):
    check_activation(activation, residual, weight.shape[0] if weight.dim() == 2 else 0)
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise FuseInferError(f"linear_epilogue: expected x (..., K) and weight (N, K), got {tuple(x.shape)} and "
                             f"{tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise FuseInferError(f"linear_epilogue: bias must be ({weight.shape[0]},), weight's N, got {tuple(bias.shape)}")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise FuseInferError(f"linear_epilogue: weight (and bias) must be in x's dtype {x.dtype}, got {weight.dtype}"
                             + ("" if bias is None else f" and {bias.dtype}"))
    if residual is not None and (residual.shape != (*x.shape[:-1], weight.shape[0]) or residual.dtype != x.dtype):
        raise FuseInferError(f"residual must be {tuple(x.shape[:-1]) + (weight.shape[0],)} in {x.dtype}, got "
                             f"{tuple(residual.shape)} in {residual.dtype}")


SMALL_K = 16  # below it the CUDA op computes in fp32 itself (see _linear_epilogue_cuda)


@torch.library.custom_op("fuseinfer::linear_epilogue", mutates_args=())
def _linear_epilogue(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
    activation: str,
) -> torch.Tensor:
    return linear_epilogue_ref(x, weight, bias, residual, activation)


@_linear_epilogue.register_kernel("cuda")
def _linear_epilogue_cuda(x, weight, bias, residual, activation):
    ext = extension(x.device)
    # a strided weight would be copied just before the kernel, whose decode path reads weights before its PDL
    # wait (launch.h): take the reference (cuBLAS through F.linear) instead
    if ext is None or not weight.is_contiguous() or x.dtype not in KERNEL_DTYPES:
        return linear_epilogue_ref(x, weight, bias, residual, activation)
    if x.shape[-1] < SMALL_K:
        # cuBLASLt rounded tiny-K products to the output dtype before its bias / residual epilogue (1x9 @ 9x1 fp16:
        # 0.0410 against 0.0414; 1x1: 3 units where PyTorch's two roundings gave 1): fp32 math and one rounding
        # instead (no model has such a K; the cost is nil). silu_mul keeps its contract, gate and up rounded to the
        # dtype before silu(gate) * up: this same linear, then the silu_mul kernel, exactly the unfused pair (the
        # GEMV's own fp32 sums, in another order, could round a gate or up the other way).
        up = (lambda t: None if t is None else t.float())
        if activation == "silu_mul":
            return _silu_mul_cuda(linear_epilogue_ref(x.float(), weight.float(), up(bias), None, "none").to(x.dtype))
        return linear_epilogue_ref(x.float(), weight.float(), up(bias), up(residual), activation).to(x.dtype)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # (M, K)
    r2 = None if residual is None else residual.reshape(-1, weight.shape[0]).contiguous()  # (M, N)
    y = ext.linear_epilogue(x2, weight, None if bias is None else bias.contiguous(), r2, activation)  # (M, N or N/2)
    return y.view(*lead, y.shape[-1])


@_linear_epilogue.register_fake
def _(x, weight, bias, residual, activation):
    return x.new_empty(*x.shape[:-1], weight.shape[0] // (2 if activation == "silu_mul" else 1))


def _setup_context(ctx, inputs, output):
    x, weight, bias, residual, activation = inputs
    ctx.silu = activation == "silu_mul"
    ctx.save_for_backward(x, weight, output if activation == "relu" else None, bias if ctx.silu else None)
    ctx.has_bias, ctx.has_residual = bias is not None, residual is not None


def _backward(ctx, grad):
    """The reference's gradients: with g = grad * act'(y) (ReLU: y > 0; silu_mul: its gradient at the linear's
    output, recomputed), dx = g W, dW = g^T x, db = sum of g over the rows, dresidual = g."""
    x, weight, y, bias = ctx.saved_tensors
    if ctx.silu:
        grad = silu_mul_grad(torch.nn.functional.linear(x, weight, bias), grad)  # (..., F) -> (..., 2F)
    g = grad if y is None else grad * (y > 0)  # (..., N)
    rows = g.shape[:-1].numel()  # M (1 for a 1-D x; the sizes may be 0)
    g2 = g.reshape(rows, g.shape[-1])  # (M, N)
    need = ctx.needs_input_grad
    dx = g @ weight if need[0] else None  # (..., K)
    dw = g2.t() @ x.reshape(rows, x.shape[-1]) if need[1] else None  # (N, K)
    db = g2.sum(0) if ctx.has_bias and need[2] else None  # (N,)
    dr = g if ctx.has_residual and need[3] else None
    return dx, dw, db, dr, None


# the kernels are forward-only: a call whose inputs need gradients goes through the dispatcher (_ext.route)
_linear_epilogue.register_autograd(_backward, setup_context=_setup_context)


def linear_epilogue(x, weight, bias=None, residual=None, activation: str = "none"):
    """``act(x @ weight.T + bias + residual)`` in one kernel where the CUDA extension is built."""
    _check(x, weight, bias, residual, activation)
    return route(torch.ops.fuseinfer.linear_epilogue, linear_epilogue_ref, _linear_epilogue_cuda,
                 (x, weight, bias, residual, activation), (x, weight, bias, residual))
