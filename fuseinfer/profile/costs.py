"""FLOPs and bytes of one call of an op, from the input shapes and dtypes the profiler records.

Each formula counts the work the op must do and the bytes it must move at least (every input read once, every
output written once), which is what a roofline compares a measured time against. ``register_cost`` adds a
formula for a new op (e.g. an int8 linear ``fuseinfer::int8_*``) without touching this file::

    from fuseinfer.profile.costs import register_cost, linear_cost
    register_cost("fuseinfer::w8a16_linear", linear_cost(x=0, weight=1, bias=2))
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

# element sizes of the dtype names the profiler writes ("Input type") and of torch dtype names (our own ranges)
ELEMENT_SIZE = {
    "float": 4, "c10::Half": 2, "c10::BFloat16": 2, "double": 8, "signed char": 1, "unsigned char": 1, "bool": 1,
    "long int": 8, "long": 8, "int": 4, "short int": 2, "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1,
    "torch.float32": 4, "torch.float16": 2, "torch.bfloat16": 2, "torch.float64": 8, "torch.int8": 1,
    "torch.uint8": 1, "torch.bool": 1, "torch.int64": 8, "torch.int32": 4, "torch.int16": 2,
}
# which GEMM ceiling (ceilings.py keys) a dtype name computes at
PRECISION = {"float": "float32", "c10::Half": "float16", "c10::BFloat16": "bfloat16", "signed char": "int8",
             "torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16",
             "torch.int8": "int8"}
GEMV_ROWS = 16  # a matrix product with at most this many rows streams its weight once: a GEMV in effect


@dataclass(frozen=True)
class Cost:
    """Work of one call: ``flops``, ``bytes`` moved at least, the op class (gemm, gemv, attention, norm,
    elementwise, memory, step) and the precision whose GEMM ceiling bounds it."""

    flops: float
    bytes: float
    op_class: str
    precision: str = "float16"


class Call:
    """One recorded call: input dims (list per input; [] for a scalar or None), dtype names, concrete scalars."""

    def __init__(self, dims, types, concrete=None):
        self.dims = [d if isinstance(d, list) else [] for d in (dims or [])]
        self.types = list(types or [])
        self.concrete = list(concrete or [])

    def shape(self, i: int) -> list:
        return self.dims[i] if i < len(self.dims) and self._is_tensor(i) else []

    def _is_tensor(self, i: int) -> bool:
        return i < len(self.types) and self.types[i] in ELEMENT_SIZE or (i < len(self.dims) and bool(self.dims[i]))

    def numel(self, i: int) -> int:
        dims = self.shape(i)
        return math.prod(dims) if dims else (1 if i < len(self.types) and self.types[i] in ELEMENT_SIZE else 0)

    def esize(self, i: int, default: int = 2) -> int:
        return ELEMENT_SIZE.get(self.types[i], default) if i < len(self.types) else default

    def nbytes(self, i: int) -> int:
        return self.numel(i) * self.esize(i) if self.shape(i) or (i < len(self.types) and self.types[i]) else 0

    def precision(self, i: int = 0) -> str:
        return PRECISION.get(self.types[i], "float16") if i < len(self.types) else "float16"

    def listed(self, i: int) -> list[list]:
        """The dims of each tensor of input ``i``, a tensor list (``Tensor[]``); [] where there is none."""
        return [d for d in (self.dims[i] if i < len(self.dims) else []) if isinstance(d, list)]


COSTS: dict[str, Callable[[Call], Cost | None]] = {}


def register_cost(name: str, fn: Callable[[Call], Cost | None] | None = None):
    """Register ``fn(call) -> Cost | None`` for the op ``name`` (e.g. "aten::mm", "fuseinfer::linear_epilogue");
    usable as a decorator. A later registration replaces an earlier one."""
    if fn is None:
        return lambda f: register_cost(name, f)
    COSTS[name] = fn
    return fn


def cost_of(name: str, dims, types, concrete=None) -> Cost | None:
    """The cost of one call of ``name`` with these inputs, or None when no formula is registered or the shapes do
    not fit it."""
    fn = COSTS.get(name)
    if fn is None:
        return None
    try:
        return fn(Call(dims, types, concrete))
    except (IndexError, TypeError, ValueError, ZeroDivisionError):  # a call whose inputs the formula does not know
        return None


def _gemm(m: int, n: int, k: int, batch: int, byte_count: float, precision: str, extra_flops: float = 0) -> Cost:
    """2 m n k flops per batch entry (a multiply and an add each)."""
    return Cost(2.0 * batch * m * n * k + extra_flops, byte_count, "gemv" if m <= GEMV_ROWS else "gemm", precision)


def linear_cost(x: int = 0, weight: int = 1, bias: int | None = 2, residual: int | None = None) -> Callable:
    """Formula of a linear layer: x (..., K) @ weight (N, K)^T (+ bias (N,)) (+ residual (..., N)) -> (..., N).
    FLOPs 2 M N K (+ M N per epilogue add); bytes: x, weight, bias, residual read, output written (in x's dtype).
    The precision is the weight's (an int8 weight with fp16 activations dequantises: the GEMM runs in fp16, unless
    x is int8 too)."""

    def fn(c: Call) -> Cost | None:
        xs, ws = c.shape(x), c.shape(weight)
        if len(ws) != 2 or not xs:
            return None
        n, k = ws
        m = math.prod(xs[:-1]) if len(xs) > 1 else 1
        adds = sum(1 for i in (bias, residual) if i is not None and c.shape(i))
        out_bytes = m * n * c.esize(x)
        moved = c.nbytes(x) + c.nbytes(weight) + out_bytes + sum(c.nbytes(i) for i in (bias, residual)
                                                                  if i is not None and c.shape(i))
        precision = "int8" if c.precision(x) == "int8" and c.precision(weight) == "int8" else c.precision(x)
        return _gemm(m, n, k, 1, moved, precision, adds * m * n)

    return fn


register_cost("aten::linear", linear_cost())
register_cost("fuseinfer::linear_epilogue", linear_cost(0, 1, 2, 3))
# (the q/k/v GEMV with the rotary and the cache write in its epilogue writes its N outputs once, q out and k/v into
# the cache; the RMSNorm prologue's weight is one row of K more)
register_cost("fuseinfer::linear_rope_append", linear_cost(0, 1, 3))  # (x, weight, scale, bias, cos, sin, ...)
register_cost("fuseinfer::rms_norm_linear", linear_cost(0, 3, 4, 5))  # (x, norm_weight, eps, weight, bias, residual)
register_cost("fuseinfer::rms_norm_linear_rope_append", linear_cost(0, 3, 4))  # (x, norm_weight, eps, weight, bias,..)
# (the LayerNorm prologue's weight and bias: two rows of K more; an int8 weight counts its bytes, 1 each)
register_cost("fuseinfer::layer_norm_linear", linear_cost(0, 4, 6, 7))  # (x, ln_weight, ln_bias, eps, weight, scale,
# bias, residual, activation)
register_cost("fuseinfer::layer_norm_linear_append", linear_cost(0, 4, 6))  # (x, ln_weight, ln_bias, eps, weight,
# scale, bias, heads, ...)


@register_cost("aten::mm")
def _mm(c: Call) -> Cost | None:
    (m, k), (_, n) = c.shape(0), c.shape(1)
    return _gemm(m, n, k, 1, c.nbytes(0) + c.nbytes(1) + m * n * c.esize(0), c.precision(0))


@register_cost("aten::_int_mm")
def _int_mm(c: Call) -> Cost | None:
    (m, k), (_, n) = c.shape(0), c.shape(1)
    return _gemm(m, n, k, 1, c.nbytes(0) + c.nbytes(1) + m * n * 4, "int8")


@register_cost("aten::addmm")
def _addmm(c: Call) -> Cost | None:  # bias, x (M, K), w (K, N)
    (m, k), (_, n) = c.shape(1), c.shape(2)
    return _gemm(m, n, k, 1, c.nbytes(0) + c.nbytes(1) + c.nbytes(2) + m * n * c.esize(1), c.precision(1), m * n)


@register_cost("aten::bmm")
def _bmm(c: Call) -> Cost | None:
    (b, m, k), (_, _, n) = c.shape(0), c.shape(1)
    return _gemm(m, n, k, b, c.nbytes(0) + c.nbytes(1) + b * m * n * c.esize(0), c.precision(0))


@register_cost("aten::baddbmm")
def _baddbmm(c: Call) -> Cost | None:
    (b, m, k), (_, _, n) = c.shape(1), c.shape(2)
    return _gemm(m, n, k, b, c.nbytes(0) + c.nbytes(1) + c.nbytes(2) + b * m * n * c.esize(1), c.precision(1), b * m * n)


@register_cost("aten::matmul")
def _matmul(c: Call) -> Cost | None:
    a, b = c.shape(0), c.shape(1)
    if not a or not b:
        return None
    a2, b2 = (a if len(a) > 1 else [1] + a), (b if len(b) > 1 else b + [1])
    m, k, n = a2[-2], a2[-1], b2[-1]
    batch = math.prod(_broadcast(a2[:-2], b2[:-2]))
    return _gemm(m, n, k, batch, c.nbytes(0) + c.nbytes(1) + batch * m * n * c.esize(0), c.precision(0))


def _broadcast(a: list, b: list) -> list:
    n = max(len(a), len(b))
    a, b = [1] * (n - len(a)) + list(a), [1] * (n - len(b)) + list(b)
    return [max(x, y) for x, y in zip(a, b)]


def _causal_pairs(sq: int, skv: int) -> int:
    """(query, key) pairs of bottom-right-aligned causal attention: query i sees keys j <= skv - sq + i."""
    if sq > skv:
        return skv * (skv + 1) // 2
    return sq * skv - sq * (sq - 1) // 2


def _attention(c: Call, causal: bool, extra_bytes: float = 0) -> Cost | None:
    """q (B, H, Sq, D), k, v (B, H, Skv, D): QK^T and PV, 2 x 2 D flops per (query, key) pair; bytes: q, k, v
    read, the output (q's size) written."""
    q, k = c.shape(0), c.shape(1)
    b, h, sq, d = q
    skv = k[2]
    pairs = _causal_pairs(sq, skv) if causal else sq * skv
    moved = c.nbytes(0) + c.nbytes(1) + c.nbytes(2) + c.nbytes(0) + extra_bytes
    return Cost(4.0 * b * h * pairs * d, moved, "attention", c.precision(0))


@register_cost("aten::scaled_dot_product_attention")
def _sdpa(c: Call) -> Cost | None:
    # (query, key, value, attn_mask, dropout_p, is_causal, scale): is_causal from the concrete inputs where recorded;
    # else a square call without a mask is causal (OPT's prefill), a decode call (Sq = 1) is not masked anyway
    is_causal = len(c.concrete) > 5 and str(c.concrete[5]).lower() == "true"
    square_unmasked = not c.shape(3) and c.shape(0)[2] == c.shape(1)[2]
    return _attention(c, is_causal or square_unmasked, c.nbytes(3))


@register_cost("fuseinfer::attention")
def _fi_attention(c: Call) -> Cost | None:
    # (q, k, v, key_mask, q_start, scale): causal from q_start; with a static cache Skv is its capacity, so the
    # count is an upper bound for decode (the kernel reads keys up to the current position only)
    return _attention(c, True, c.nbytes(3) + c.nbytes(4))


def _fi_attention_8bit(c: Call) -> Cost | None:
    # (q, k, v, key_mask, q_start, scale, out_scale): as fuseinfer::attention, the output one byte per element
    return _attention(c, True, c.nbytes(3) + c.nbytes(4) + c.nbytes(6) + c.numel(0) - c.nbytes(0))


register_cost("fuseinfer::attention_fp8out", _fi_attention_8bit)
register_cost("fuseinfer::attention_int8out", _fi_attention_8bit)


def _norm(c: Call, inputs: tuple[int, ...], outputs: int) -> Cost | None:
    """LayerNorm over the last dim: ~8 flops per element (mean, variance, normalise, scale, shift); bytes: the
    inputs and parameters read, ``outputs`` tensors of x's size written."""
    n = c.numel(0)
    return Cost(8.0 * n, sum(c.nbytes(i) for i in inputs) + outputs * c.nbytes(0), "norm", c.precision(0))


register_cost("aten::layer_norm", lambda c: _norm(c, (0, 2, 3), 1))  # (x, normalized_shape, weight, bias, eps)
register_cost("aten::native_layer_norm", lambda c: _norm(c, (0, 2, 3), 1))


@register_cost("fuseinfer::add_layer_norm")
def _fi_add_layer_norm(c: Call) -> Cost | None:
    # (x, residual, weight, bias, eps, store_sum): the sum is written too when store_sum
    store = len(c.concrete) > 5 and str(c.concrete[5]).lower() == "true"
    return _norm(c, (0, 1, 2, 3), 2 if store else 1)


@register_cost("fuseinfer::kv_cache_append")
def _fi_kv_append(c: Call) -> Cost | None:  # (k_cache, v_cache, k, v, slots): read k, v; write them into the caches
    return Cost(0.0, 2.0 * (c.nbytes(2) + c.nbytes(3)) + c.nbytes(4), "memory", c.precision(2))


def _step_cost(c: Call, weights: int, weight_bytes: float, vectors: int, caches: int, kv8: bool, es: int,
               precision: str) -> Cost:
    """A one-kernel decode step's cost: ``weights`` (2-D layer weights, ``weight_bytes`` of them) and the LM head
    (argument 11) read once at 2 flops per weight per row (argument 0's rows), ``vectors`` (norm weights, biases)
    and ``caches`` (keys and values, capacity: an upper bound; e4m3, one byte, with ``kv8``) at ``es`` bytes, the
    fp32 logits written."""
    m, lm = c.numel(0), c.shape(11)
    head = math.prod(lm) if lm else 0
    moved = weight_bytes + (head + vectors) * es + caches * (1 if kv8 else es) + m * (lm[0] if lm else 0) * 4
    return Cost(2.0 * m * (weights + head), moved, "step", precision)


@register_cost("fuseinfer::opt_decode_step")
def _fi_decode_step(c: Call) -> Cost | None:
    """The whole decode step (:func:`_step_cost`): the layers' tensors (argument 6), embedding rows, the caches (7,
    keys and values alike). With weight scales (argument 15: an int8 weight-only model) the layers' 2-D weights are
    int8 (1 byte) plus their fp32 scales; with KV scales (argument 16: FP8 caches) the caches are e4m3 (1 byte)."""
    layers = c.listed(6)
    weights = sum(math.prod(d) for d in layers if len(d) == 2)
    scales = c.listed(15)
    es = c.esize(4)
    weight_bytes = weights + 4 * sum(math.prod(d) for d in scales) if scales else weights * es
    vectors = sum(math.prod(d) for d in layers if len(d) == 1)
    caches = sum(math.prod(d) for d in c.listed(7)) * 2
    return _step_cost(c, weights, weight_bytes, vectors, caches, bool(c.listed(16)), es, c.precision(4))


@register_cost("fuseinfer::llama_decode_step")
def _fi_llama_decode_step(c: Call) -> Cost | None:
    """The Llama family's whole decode step (:func:`_step_cost`): the layers' tensors (argument 6), the RMSNorm
    weights and q/k/v biases among them and in argument 7, the caches (8, 9; e4m3 with KV scales: argument 15)."""
    layers = c.listed(6)
    weights = sum(math.prod(d) for d in layers if len(d) == 2)
    vectors = sum(math.prod(d) for d in layers if len(d) == 1) + sum(math.prod(d) for d in c.listed(7))
    caches = sum(math.prod(d) for d in c.listed(8) + c.listed(9))
    es = c.esize(5)
    return _step_cost(c, weights, weights * es, vectors, caches, bool(c.listed(15)), es, c.precision(5))


# elementwise and data-movement ops: one flop per output element, every input read and the output written
ELEMENTWISE = ("aten::add", "aten::add_", "aten::mul", "aten::mul_", "aten::sub", "aten::div", "aten::relu",
               "aten::relu_", "aten::gelu", "aten::silu", "aten::tanh", "aten::exp", "aten::neg", "aten::where",
               "aten::masked_fill", "aten::masked_fill_", "aten::copy_", "aten::clone", "aten::contiguous",
               "aten::to", "aten::_to_copy", "aten::softmax", "aten::_softmax", "aten::cat", "aten::index_copy_",
               "aten::fill_", "aten::zero_", "aten::cumsum", "aten::argmax", "aten::eq", "aten::ne", "aten::lt",
               "aten::gt", "aten::le", "aten::ge", "aten::__and__", "aten::bitwise_and", "aten::logical_not",
               "aten::dropout", "aten::float", "aten::type_as")


def _elementwise(c: Call) -> Cost | None:
    sizes = [c.numel(i) for i in range(len(c.dims)) if c.shape(i)]
    if not sizes or max(sizes) == 0:  # (only scalars, or empty tensors: nothing moved, no cost to model)
        return None
    out = max(sizes)
    tensor_bytes = sum(c.nbytes(i) for i in range(len(c.dims)) if c.shape(i))
    first = next(i for i in range(len(c.dims)) if c.shape(i))
    return Cost(float(out), tensor_bytes + out * c.esize(first), "elementwise", c.precision(first))


for _name in ELEMENTWISE:
    register_cost(_name, _elementwise)


@register_cost("aten::embedding")
def _embedding(c: Call) -> Cost | None:  # (weight (V, E), indices): gather the rows, write them
    rows, e = c.numel(1), c.shape(0)[-1]
    return Cost(0.0, 2.0 * rows * e * c.esize(0) + c.nbytes(1), "memory", c.precision(0))
