"""The fused ops on CPU: references against independent formulas, the custom-op registrations (opcheck),
and int8 quantisation accuracy (SQNR floor). The CUDA kernels are tested in test_gpu.py."""
from __future__ import annotations

import math

import pytest
import torch

from fuseinfer import FuseInferError, ops
from fuseinfer.ops.attention import allowed_mask, attention_sdpa


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantisation-noise ratio in dB."""
    return 10 * math.log10(ref.float().pow(2).sum().item() / (ref.float() - approx.float()).pow(2).sum().item())


@pytest.mark.parametrize("n", [123, 256])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_layer_norm_ref_matches_formula(n, with_residual):
    x, r = torch.randn(7, 5, n, dtype=torch.float64), torch.randn(7, 5, n, dtype=torch.float64)
    w, b = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    s = x + r if with_residual else x
    expected = (s - s.mean(-1, keepdim=True)) / torch.sqrt(s.var(-1, unbiased=False, keepdim=True) + 1e-5) * w + b
    y, s_out = ops.add_layer_norm(x, r if with_residual else None, w, b, 1e-5, store_sum=True)
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(s_out, s)
    assert ops.add_layer_norm(x, r, w, b, 1e-5, store_sum=False)[1].numel() == 0


@pytest.mark.parametrize("activation,residual", [("none", False), ("relu", False), ("none", True)])
def test_linear_epilogue_ref_matches_formula(activation, residual):
    x, w, b = torch.randn(3, 113, 96, dtype=torch.float64), torch.randn(123, 96, dtype=torch.float64), \
        torch.randn(123, dtype=torch.float64)
    r = torch.randn(3, 113, 123, dtype=torch.float64) if residual else None
    expected = x @ w.T + b + (r if residual else 0)
    expected = expected.clamp_min(0) if activation == "relu" else expected
    torch.testing.assert_close(ops.linear_epilogue(x, w, b, r, activation), expected)


def test_linear_epilogue_rejects_bad_input():
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    with pytest.raises(FuseInferError, match="activation must be one of"):
        ops.linear_epilogue(x, w, activation="gelu")
    with pytest.raises(FuseInferError, match="cannot be fused"):
        ops.linear_epilogue(x, w, residual=torch.randn(4, 6), activation="relu")
    with pytest.raises(FuseInferError, match=r"expected x \(..., K\) and weight \(N, K\), got \(4, 7\)"):
        ops.linear_epilogue(torch.randn(4, 7), w)
    with pytest.raises(FuseInferError, match=r"weight \(N, K\), got \(4, 8\) and \(8,\)"):
        ops.linear_epilogue(x, torch.randn(8))
    with pytest.raises(FuseInferError, match=r"bias must be \(6,\), weight's N, got \(8,\)"):
        ops.linear_epilogue(x, w, torch.randn(8))
    with pytest.raises(FuseInferError, match="must be in x's dtype torch.float32, got torch.float32 and torch.float16"):
        ops.linear_epilogue(x, w, torch.randn(6).half())
    with pytest.raises(FuseInferError, match="must be in x's dtype torch.float16, got torch.float32"):
        ops.linear_epilogue(x.half(), w)
    with pytest.raises(FuseInferError, match=r"residual must be \(4, 6\) in torch.float32"):
        ops.linear_epilogue(x, w, residual=torch.randn(4, 6, dtype=torch.float64))
    with pytest.raises(FuseInferError, match="residual must be"):
        ops.linear_epilogue(x, w, residual=torch.randn(6))  # no broadcasting: the kernel takes (M, N)


def test_ops_reject_bad_input_with_one_clear_error():
    """Inputs a user could pass by mistake end in one FuseInferError naming what is expected, not in aten."""
    q = torch.randn(2, 3, 5, 8)
    with pytest.raises(FuseInferError, match=r"key_mask must be a \(2, 5\) bool tensor.*attention_mask.bool"):
        ops.attention(q, q, q, torch.ones(2, 5, dtype=torch.long))  # an HF-style 0/1 mask
    with pytest.raises(FuseInferError, match=r"key_mask must be a \(2, 5\) bool tensor"):
        ops.attention(q, q, q, torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(FuseInferError, match=r"q_start must be a \(2,\) int32 tensor"):
        ops.attention(q, q, q, None, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(FuseInferError, match=r"q_start must be a \(2,\) int32 tensor, got \(2,\) torch.int64"):
        ops.attention(q, q, q, None, torch.zeros(2, dtype=torch.int64))  # the kernel reads int32
    with pytest.raises(FuseInferError, match="share a dtype"):
        ops.attention(q, q.half(), q.half())
    with pytest.raises(FuseInferError, match="D > 0"):
        ops.attention(*(torch.randn(2, 3, 5, 0),) * 3)
    with pytest.raises(FuseInferError, match=r"weight must be \(8,\), x's last dim, got \(7,\)"):
        ops.add_layer_norm(torch.randn(4, 8), None, torch.randn(7))
    cache, kv = torch.zeros(1, 2, 6, 4), torch.randn(1, 2, 3, 4)
    with pytest.raises(FuseInferError, match="slots must be int64"):
        ops.kv_cache_append(cache, cache.clone(), kv, kv, torch.arange(3, dtype=torch.int32))
    with pytest.raises(FuseInferError, match="in the caches' dtype"):
        ops.kv_cache_append(cache, cache.clone(), kv.half(), kv.half(), torch.arange(3))
    with pytest.raises(FuseInferError, match=r"scale \(4,\) must broadcast to q's shape \(4, 8\)"):
        ops.dequantize(torch.zeros(4, 8, dtype=torch.int8), torch.ones(4))


def test_int8_edge_cases():
    q, scale = ops.quantize_per_token(torch.randn(3, 0))  # K = 0: empty values, the all-zero scale
    assert q.shape == (3, 0) and q.dtype == torch.int8 and scale.shape == (3, 1) and bool((scale > 0).all())
    with pytest.raises(FuseInferError, match="must broadcast to q's shape"):
        ops.dequantize(torch.zeros(1, 4, dtype=torch.int8), torch.ones(3, 1))


def test_add_layer_norm_rejects_a_broadcast_or_other_dtype_residual():
    with pytest.raises(FuseInferError, match=r"x's shape and dtype \(4, 8\) torch.float32, got \(8,\) torch.float32"):
        ops.add_layer_norm(torch.randn(4, 8), torch.randn(8))
    with pytest.raises(FuseInferError, match=r"got \(4, 8\) torch.float64"):  # (the fake op promised x's dtype)
        ops.add_layer_norm(torch.randn(4, 8), torch.randn(4, 8, dtype=torch.float64))


def _attention_inputs(b=3, h=4, sq=113, skv=113, d=64, dtype=torch.float32):
    q, k, v = (torch.randn(b, h, s, d, dtype=dtype) for s in (sq, skv, skv))
    return q, k, v


@pytest.mark.parametrize("form", ["residual", "relu", "no_bias"])
def test_linear_epilogue_gradients_gradcheck(form):
    x, w = torch.randn(2, 5, 12, dtype=torch.float64), torch.randn(7, 12, dtype=torch.float64)
    b = None if form == "no_bias" else torch.randn(7, dtype=torch.float64)
    r = torch.randn(2, 5, 7, dtype=torch.float64) if form == "residual" else None
    args = [t.requires_grad_() if t is not None else None for t in (x, w, b, r)]
    assert torch.autograd.gradcheck(lambda *a: ops.linear_epilogue(*a, activation="relu" if form == "relu" else "none"),
                                    args)


@pytest.mark.parametrize("k,n", [(0, 7), (12, 0)])
def test_linear_epilogue_gradients_with_zero_features(k, n):
    x, w, b = torch.randn(2, 5, k, requires_grad=True), torch.randn(n, k, requires_grad=True), torch.randn(n)
    b.requires_grad_()
    ops.linear_epilogue(x, w, b).sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape and b.grad.shape == b.shape
    assert x.grad.abs().sum() == 0 and w.grad.abs().sum() == 0 and b.grad.eq(10 if k == 0 else 0).all()


def test_int8_quantize_is_not_differentiable_and_dequantize_is():
    x = torch.randn(4, 33, requires_grad=True)
    q, scale = ops.quantize_per_token(x)
    assert not q.requires_grad and not scale.requires_grad
    scale = scale.clone().requires_grad_()
    g = torch.randn(4, 33)
    (ops.dequantize(q, scale, torch.float32) * g).sum().backward()
    torch.testing.assert_close(scale.grad, (g * q.float()).sum(-1, keepdim=True))


@pytest.mark.parametrize("residual,affine,store_sum", [(True, True, True), (True, True, False), (False, True, True),
                                                       (False, False, False)])
def test_add_layer_norm_gradients_gradcheck(residual, affine, store_sum):
    x = torch.randn(6, 5, 11, dtype=torch.float64).transpose(0, 1)  # strided
    r = torch.randn(5, 6, 11, dtype=torch.float64) if residual else None
    w, b = (torch.randn(11, dtype=torch.float64), torch.randn(11, dtype=torch.float64)) if affine else (None, None)
    args = [t.requires_grad_() if t is not None else None for t in (x, r, w, b)]

    def f(*a):
        y, s = ops.add_layer_norm(*a, eps=1e-5, store_sum=store_sum)
        return (y, s) if store_sum else y
    assert torch.autograd.gradcheck(f, args)


def test_attention_gradients_match_autograd_in_float64():
    """dQ, dK, dV of the op (fp32 inside) against autograd of masked softmax attention in float64, with left
    padding, per-row q_start and a query that sees no key (its output and gradients are 0)."""
    q, k, v = (t.double().requires_grad_() for t in _attention_inputs(b=2, h=3, sq=7, skv=12, d=16))
    key_mask = torch.arange(12)[None] >= torch.tensor([[4], [0]])
    q_start = torch.tensor([3, 5], dtype=torch.int32)  # row 0, query 0: keys 0..3, all padding
    g = torch.randn(2, 7, 3, 16, dtype=torch.float64)  # (B, Sq, H, D)
    ours = torch.autograd.grad(ops.attention(q, k, v, key_mask, q_start, 0.3), (q, k, v), g)
    allowed = allowed_mask(key_mask, q_start, 2, 7, 12, "cpu")  # (B, 1, Sq, Skv)
    has_key = allowed.any(-1, keepdim=True)
    scores = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~allowed, float("-inf")).masked_fill(~has_key, 0)
    out = (torch.softmax(scores, -1).masked_fill(~has_key, 0) @ v).transpose(1, 2)
    expected = torch.autograd.grad(out, (q, k, v), g)
    for name, a, e in zip("qkv", ours, expected):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5, msg=name)
    assert ours[0][0, :, 0].abs().max() == 0


def test_attention_gradients_finite_for_queries_without_keys():
    """A query with no key to attend outputs 0; its gradients are 0 as well, not NaN (which would spread
    through a model's backward)."""
    q, k, v = (t.requires_grad_() for t in _attention_inputs(b=2, sq=3, skv=9, d=32))
    key_mask = torch.tensor([[0] * 3 + [1] * 6, [1] * 9], dtype=torch.bool)
    # row 0: query 0 sees keys 0..2, all masked; query 2 sees keys 3 and 4
    out = ops.attention(q, k, v, key_mask, torch.tensor([2, 6], dtype=torch.int32), 0.2)  # (B, Sq, H, D)
    (out * torch.randn_like(out)).sum().backward()
    assert all(t.grad.isfinite().all() for t in (q, k, v))
    assert out[0, 0].abs().max() == 0 and q.grad[0, :, 0].abs().max() == 0
    assert q.grad[0, :, 2].abs().min() > 0 and k.grad[0, :, :3].abs().max() == 0


def test_attention_ref_matches_sdpa_causal():
    q, k, v = _attention_inputs()
    out = ops.attention(q, k, v, scale=0.125)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125)
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_attention_ref_left_padding_and_decode_offsets():
    b, sq, skv = 3, 4, 50
    q, k, v = _attention_inputs(b=b, sq=sq, skv=skv)
    pads = torch.tensor([0, 7, 20])
    key_mask = torch.arange(skv)[None, :] >= pads[:, None]  # (B, Skv): left padding
    q_start = torch.tensor([30, 30, 30], dtype=torch.int32)  # a static cache filled to 34 of 50 slots
    out = ops.attention(q, k, v, key_mask, q_start, 0.125)
    for i in range(b):
        for t in range(sq):
            keys = slice(int(pads[i]), 30 + t + 1)
            p = torch.softmax(torch.einsum("hd,hnd->hn", q[i, :, t], k[i, :, keys]) * 0.125, -1)  # (H, n)
            expected = torch.einsum("hn,hnd->hd", p, v[i, :, keys])  # (H, D)
            torch.testing.assert_close(out[i, t], expected, rtol=1e-5, atol=1e-5)


def test_attention_query_without_keys_gives_zero_not_nan():
    q, k, v = _attention_inputs(b=2, sq=5, skv=5)
    key_mask = torch.tensor([[False, False, True, True, True], [True] * 5])
    out = ops.attention(q, k, v, key_mask)
    assert torch.isfinite(out).all()
    assert out[0, :2].abs().max() == 0  # queries 0 and 1 of row 0 see only padding
    assert out[0, 2:].abs().min() > 0


def test_attention_ref_ignores_what_unseen_keys_hold():
    """Cache slots no query may see (not written yet: NaN in uninitialised memory) and queries without any key
    give what the kernels give (they never read such slots): finite values, 0 for a query without keys."""
    q, k, v = _attention_inputs(b=2, sq=2, skv=12)
    k[:, :, 8:], v[:, :, 8:] = float("nan"), float("nan")  # slots 8.. of both rows are unwritten
    q_start = torch.tensor([5, -3], dtype=torch.int32)  # row 1: its two queries come before every key
    out = ops.attention_ref(q, k, v, None, q_start, 0.125)
    assert torch.isfinite(out).all()
    assert out[1].abs().max() == 0
    ref = ops.attention_ref(q[:1], k[:1, :, :7], v[:1, :, :7], None, None, 0.125)  # row 0 sees keys 0..6
    torch.testing.assert_close(out[:1], ref)


@pytest.mark.parametrize("d", [32, 64])
def test_attention_sdpa_fallback_matches_reference(d):
    """The CUDA fallback for cases without a kernel; device-agnostic, so checked here on CPU."""
    q, k, v = _attention_inputs(b=3, sq=12, skv=40, d=d)
    key_mask = torch.arange(40)[None, :] >= torch.tensor([0, 9, 39])[:, None]
    q_start = torch.tensor([30, 30, 30], dtype=torch.int32)  # row 2 queries 0-8 see no key: must give 0
    expected = ops.attention_ref(q, k, v, key_mask, q_start, 0.2)
    got = attention_sdpa(q, k, v, key_mask, q_start, 0.2)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert got[2, :9].abs().max() == 0 and got[2, 9:].abs().max() > 0 and torch.isfinite(got).all()


def test_attention_sdpa_fallback_zeroes_queries_without_keys(monkeypatch):
    """CPU SDPA already gives 0 there; CUDA backends may give NaN, which the fallback must not pass on."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def nan_on_rows_without_keys(q, k, v, attn_mask, scale):
        return sdpa(q, k, v, attn_mask=attn_mask, scale=scale).masked_fill(~attn_mask.any(-1, keepdim=True), math.nan)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", nan_on_rows_without_keys)
    q, k, v = _attention_inputs(b=1, sq=4, skv=8, d=16)
    got = attention_sdpa(q, k, v, torch.arange(8)[None] >= 6, torch.tensor([3], dtype=torch.int32), 0.25)
    assert got[0, :3].abs().max() == 0 and torch.isfinite(got).all()  # queries 0-2 see keys 0-5, all masked


def test_allowed_mask_default_is_bottom_right_causal():
    m = allowed_mask(None, None, 1, 2, 4, "cpu")[0, 0]
    assert m.tolist() == [[True, True, True, False], [True, True, True, True]]


def test_attention_rejects_mismatched_shapes():
    q, k, v = _attention_inputs()
    with pytest.raises(FuseInferError, match=r"expected q \(B,H,Sq,D\)"):
        ops.attention(q, k[:, :, :, :32], v)


@pytest.mark.parametrize("shape", [(113, 123), (4, 9, 256)])
def test_int8_quantisation_sqnr_and_bounds(shape):
    x = torch.randn(*shape)
    q, scale = ops.quantize_per_token(x)
    assert q.dtype == torch.int8 and scale.shape == (*shape[:-1], 1) and scale.dtype == torch.float32
    deq = ops.dequantize(q, scale, torch.float32)
    assert (deq - x).abs().le(scale / 2 + 1e-6).all()  # round-to-nearest: at most half a step off
    assert sqnr_db(x, deq) > 35.0  # int8 absmax on Gaussian rows gives about 38-40 dB
    assert q.abs().amax(-1).eq(127).all()  # the absmax element of every row maps to +-127


def test_int8_per_channel_weight_and_zero_rows():
    w = torch.randn(64, 96)
    w[3] = 0
    q, scale = ops.quantize_per_channel(w)
    assert scale.shape == (64, 1) and q[3].eq(0).all()
    assert sqnr_db(w, ops.dequantize(q, scale, torch.float32)) > 35.0


OPCHECK_CASES = {
    "add_layer_norm": lambda: (torch.ops.fuseinfer.add_layer_norm.default,
                               (torch.randn(5, 123), torch.randn(5, 123), torch.randn(123), torch.randn(123),
                                1e-5, True)),
    "add_layer_norm_no_residual": lambda: (torch.ops.fuseinfer.add_layer_norm.default,
                                           (torch.randn(2, 3, 96), None, None, None, 1e-5, True)),
    "add_layer_norm_strided": lambda: (torch.ops.fuseinfer.add_layer_norm.default,  # contiguous outputs
                                       (torch.randn(6, 5, 32).transpose(0, 1), torch.randn(5, 6, 32), torch.randn(32),
                                        torch.randn(32), 1e-5, True)),
    "add_layer_norm_strided_no_residual": lambda: (torch.ops.fuseinfer.add_layer_norm.default,
                                                   (torch.randn(6, 5, 32).transpose(0, 1), None, None, None, 1e-5,
                                                    True)),
    "linear_epilogue": lambda: (torch.ops.fuseinfer.linear_epilogue.default,
                                (torch.randn(2, 7, 96), torch.randn(123, 96), torch.randn(123),
                                 torch.randn(2, 7, 123), "none")),
    "attention": lambda: (torch.ops.fuseinfer.attention.default,
                          (*_attention_inputs(b=2, sq=3, skv=9, d=32), torch.ones(2, 9, dtype=torch.bool),
                           torch.tensor([6, 6], dtype=torch.int32), 0.2)),
    # inputs that need gradients: the autograd formula is registered and traces under AOT autograd
    "add_layer_norm_grad": lambda: (torch.ops.fuseinfer.add_layer_norm.default,
                                    tuple(t.requires_grad_() for t in (torch.randn(5, 123), torch.randn(5, 123),
                                                                       torch.randn(123), torch.randn(123)))
                                    + (1e-5, True)),
    "linear_epilogue_grad": lambda: (torch.ops.fuseinfer.linear_epilogue.default,
                                     tuple(t.requires_grad_() for t in (torch.randn(2, 7, 96), torch.randn(123, 96),
                                                                        torch.randn(123)))
                                     + (None, "relu")),
    "attention_grad": lambda: (torch.ops.fuseinfer.attention.default,
                               (*(t.requires_grad_() for t in _attention_inputs(b=2, sq=3, skv=9, d=32)),
                                torch.tensor([[0] * 3 + [1] * 6, [1] * 9], dtype=torch.bool),
                                torch.tensor([2, 6], dtype=torch.int32), 0.2)),  # row 0's first query: no key
    "quantize_int8": lambda: (torch.ops.fuseinfer.quantize_int8.default, (torch.randn(7, 123), -1)),
    "dequantize_int8": lambda: (torch.ops.fuseinfer.dequantize_int8.default,
                                (torch.randint(-127, 128, (7, 123), dtype=torch.int8), torch.rand(7, 1),
                                 torch.float16)),
}


@pytest.mark.parametrize("case", sorted(OPCHECK_CASES))
def test_opcheck_cpu(case):
    op, args = OPCHECK_CASES[case]()
    torch.library.opcheck(op, args)
