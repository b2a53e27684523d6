"""fuseinfer::attention (fuseinfer/ops/attention.py): the reference against SDPA and per-row formulas (left padding,
decode offsets, queries without keys, unwritten cache slots), grouped-query attention against repeated key/value
heads, bad input, gradients, the SDPA fallback, the registration (opcheck), property tests against the reference
(hypothesis) on every device, the CUDA kernels (wgmma / mma.sync prefill, split-KV decode; multi-head and
grouped-query) with their path counts, and the FP8 prefill against its reference (attention_fp8_ref)."""
from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    DEVICES,
    LOWP,
    assert_lowp_close,
    examples,
    given,
    lowp_atol,
    paths_taken,
    record_kernel_calls,
    ref_dtype,
    sqnr_db,
    st,
    wgmma_available,
)

from fuseinfer import FuseInferError, ops
from fuseinfer.ops.attention import allowed_mask, attention_sdpa


@pytest.fixture(autouse=True)
def _seed():
    """Each test's random inputs do not depend on which tests ran before it (a failure reproduces alone)."""
    torch.manual_seed(0)


def _attention_inputs(b=3, h=4, sq=113, skv=113, d=64, dtype=torch.float32, device="cpu", kv_heads=None):
    q = torch.randn(b, h, sq, d, dtype=dtype, device=device)
    k, v = (torch.randn(b, kv_heads or h, skv, d, dtype=dtype, device=device) for _ in range(2))
    return q, k, v


def _repeated(q, k, v):
    """k, v (B, Hkv, Skv, D) repeated to q's heads by hand (query head h reads key/value head h // group)."""
    group = q.shape[1] // k.shape[1]
    idx = torch.arange(q.shape[1], device=q.device) // group
    return k[:, idx], v[:, idx]


def test_attention_rejects_bad_input_with_one_clear_error(device):
    """Inputs a user could pass by mistake end in one FuseInferError naming what is expected, not in aten."""
    q = torch.randn(2, 3, 5, 8, device=device)
    ones = lambda *s, dtype: torch.ones(*s, dtype=dtype, device=device)  # noqa: E731
    zeros = lambda *s, dtype: torch.zeros(*s, dtype=dtype, device=device)  # noqa: E731
    with pytest.raises(FuseInferError, match=r"key_mask must be a \(2, 5\) bool tensor.*attention_mask.bool"):
        ops.attention(q, q, q, ones(2, 5, dtype=torch.long))  # an HF-style 0/1 mask
    with pytest.raises(FuseInferError, match=r"key_mask must be a \(2, 5\) bool tensor"):
        ops.attention(q, q, q, ones(2, 4, dtype=torch.bool))
    with pytest.raises(FuseInferError, match=r"q_start must be a \(2,\) int32 tensor"):
        ops.attention(q, q, q, None, zeros(3, dtype=torch.int32))
    with pytest.raises(FuseInferError, match=r"q_start must be a \(2,\) int32 tensor, got \(2,\) torch.int64"):
        ops.attention(q, q, q, None, zeros(2, dtype=torch.int64))  # the kernel reads int32
    with pytest.raises(FuseInferError, match="share a dtype"):
        ops.attention(q, q.half(), q.half())
    with pytest.raises(FuseInferError, match="D > 0"):
        ops.attention(*(torch.randn(2, 3, 5, 0, device=device),) * 3)


def test_attention_rejects_mismatched_shapes(device):
    q, k, v = _attention_inputs(device=device)
    with pytest.raises(FuseInferError, match=r"expected q \(B,H,Sq,D\)"):
        ops.attention(q, k[:, :, :, :32], v)
    with pytest.raises(FuseInferError, match="H a multiple of Hkv"):  # 4 query heads, 3 key/value heads
        ops.attention(q, k[:, :3], v[:, :3])
    with pytest.raises(FuseInferError, match="H a multiple of Hkv"):
        ops.attention(q, k[:, :2], v[:, :1])


@pytest.mark.parametrize("h,kv_heads", [(4, 2), (12, 2), (8, 1), (6, 6)])
def test_gqa_reference_equals_repeated_key_value_heads(h, kv_heads):
    """Query head h reads key/value head h // (H / Hkv): the op on Hkv heads gives what it gives on k, v repeated to
    H heads by hand, bit for bit, with left padding and per-row q_start."""
    q, k, v = _attention_inputs(b=2, h=h, sq=5, skv=23, d=16, kv_heads=kv_heads)
    key_mask = torch.arange(23)[None] >= torch.tensor([[0], [6]])
    q_start = torch.tensor([18, 9], dtype=torch.int32)
    ours = ops.attention(q, k, v, key_mask, q_start, 0.25)
    assert torch.equal(ours, ops.attention(q, *_repeated(q, k, v), key_mask, q_start, 0.25))
    if 1 < kv_heads < h:  # (the grouping matters: query head h reading key/value head h % Hkv differs)
        wrong = torch.arange(h) % kv_heads
        assert not torch.equal(ours, ops.attention(q, k[:, wrong], v[:, wrong], key_mask, q_start, 0.25))


def test_gqa_gradients_sum_over_the_group(device):
    """dK and dV of a key/value head are the sums over the query heads that read it: the op's formula against
    autograd through the hand-repeated heads, in float64."""
    q, k, v = (t.double().requires_grad_() for t in _attention_inputs(b=2, h=6, sq=4, skv=9, d=8, device=device,
                                                                       kv_heads=2))
    key_mask = torch.arange(9, device=device)[None] >= torch.tensor([[0], [3]], device=device)
    g = torch.randn(2, 4, 6, 8, dtype=torch.float64, device=device)  # (B, Sq, H, D)
    ours = torch.autograd.grad(ops.attention(q, k, v, key_mask, None, 0.3), (q, k, v), g)
    expected = torch.autograd.grad(ops.attention(q, *_repeated(q, k, v), key_mask, None, 0.3), (q, k, v), g)
    for name, a, e in zip("qkv", ours, expected):
        assert a.shape == e.shape
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6, msg=name)


def test_flash_attn_backend_leaves_gqa_to_our_op(monkeypatch):
    """The flash-attn backend's per-(row, head) mapping flattens one key/value head per query head: it refuses GQA,
    and the call runs our op (the reference here), whatever the package would take."""
    from fuseinfer.ops import flash_attention as fa_op

    monkeypatch.setattr(fa_op, "_fa", object())  # "imports"; any call into it would fail the test
    monkeypatch.setattr(fa_op, "_fa_error", None)
    monkeypatch.setattr(fa_op, "fa_supports", lambda q: True)
    q, k, v = _attention_inputs(b=2, h=4, sq=3, skv=10, d=8, kv_heads=2)
    key_mask = torch.arange(10)[None] >= torch.tensor([[0], [4]])
    for mask in (None, key_mask):
        kind, why = fa_op.plan(q, k, mask, None)
        assert kind is None and "grouped-query" in why
        torch.testing.assert_close(fa_op.flash_attention_cuda(q, k, v, mask, None, 0.3),
                                   ops.attention_ref(q, k, v, mask, None, 0.3), rtol=1e-5, atol=1e-5)


def test_attention_gradients_match_autograd_in_float64(device):
    """dQ, dK, dV of the op (fp32 inside) against autograd of masked softmax attention in float64, with left
    padding, per-row q_start and a query that sees no key (its output and gradients are 0)."""
    q, k, v = (t.double().requires_grad_() for t in _attention_inputs(b=2, h=3, sq=7, skv=12, d=16, device=device))
    key_mask = torch.arange(12, device=device)[None] >= torch.tensor([[4], [0]], device=device)
    q_start = torch.tensor([3, 5], dtype=torch.int32, device=device)  # row 0, query 0: keys 0..3, all padding
    g = torch.randn(2, 7, 3, 16, dtype=torch.float64, device=device)  # (B, Sq, H, D)
    ours = torch.autograd.grad(ops.attention(q, k, v, key_mask, q_start, 0.3), (q, k, v), g)
    allowed = allowed_mask(key_mask, q_start, 2, 7, 12, device)  # (B, 1, Sq, Skv)
    has_key = allowed.any(-1, keepdim=True)
    scores = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~allowed, float("-inf")).masked_fill(~has_key, 0)
    out = (torch.softmax(scores, -1).masked_fill(~has_key, 0) @ v).transpose(1, 2)
    expected = torch.autograd.grad(out, (q, k, v), g)
    for name, a, e in zip("qkv", ours, expected):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5, msg=name)
    assert ours[0][0, :, 0].abs().max() == 0


def test_attention_gradients_finite_for_queries_without_keys(device):
    """A query with no key to attend outputs 0; its gradients are 0 as well, not NaN (which would spread
    through a model's backward)."""
    q, k, v = (t.requires_grad_() for t in _attention_inputs(b=2, sq=3, skv=9, d=32, device=device))
    key_mask = torch.tensor([[0] * 3 + [1] * 6, [1] * 9], dtype=torch.bool, device=device)
    # row 0: query 0 sees keys 0..2, all masked; query 2 sees keys 3 and 4
    out = ops.attention(q, k, v, key_mask, torch.tensor([2, 6], dtype=torch.int32, device=device), 0.2)
    (out * torch.randn_like(out)).sum().backward()
    assert all(t.grad.isfinite().all() for t in (q, k, v))
    assert out[0, 0].abs().max() == 0 and q.grad[0, :, 0].abs().max() == 0
    assert q.grad[0, :, 2].abs().min() > 0 and k.grad[0, :, :3].abs().max() == 0


def test_attention_ref_matches_sdpa_causal(device):
    q, k, v = _attention_inputs(device=device)
    out = ops.attention(q, k, v, scale=0.125)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125)
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_attention_ref_left_padding_and_decode_offsets(device):
    b, sq, skv = 3, 4, 50
    q, k, v = _attention_inputs(b=b, sq=sq, skv=skv, device=device)
    pads = torch.tensor([0, 7, 20])
    key_mask = torch.arange(skv)[None, :] >= pads[:, None]  # (B, Skv): left padding
    q_start = torch.tensor([30, 30, 30], dtype=torch.int32)  # a static cache filled to 34 of 50 slots
    out = ops.attention(q, k, v, key_mask.to(device), q_start.to(device), 0.125)
    for i in range(b):
        for t in range(sq):
            keys = slice(int(pads[i]), 30 + t + 1)
            p = torch.softmax(torch.einsum("hd,hnd->hn", q[i, :, t], k[i, :, keys]) * 0.125, -1)  # (H, n)
            expected = torch.einsum("hn,hnd->hd", p, v[i, :, keys])  # (H, D)
            torch.testing.assert_close(out[i, t], expected, rtol=1e-5, atol=1e-5)


def test_attention_query_without_keys_gives_zero_not_nan(device):
    q, k, v = _attention_inputs(b=2, sq=5, skv=5, device=device)
    key_mask = torch.tensor([[False, False, True, True, True], [True] * 5], device=device)
    out = ops.attention(q, k, v, key_mask)
    assert torch.isfinite(out).all()
    assert out[0, :2].abs().max() == 0  # queries 0 and 1 of row 0 see only padding
    assert out[0, 2:].abs().min() > 0


def test_attention_ref_ignores_what_unseen_keys_hold(device):
    """Cache slots no query may see (not written yet: NaN in uninitialised memory) and queries without any key
    give what the kernels give (they never read such slots): finite values, 0 for a query without keys."""
    q, k, v = _attention_inputs(b=2, sq=2, skv=12, device=device)
    k[:, :, 8:], v[:, :, 8:] = float("nan"), float("nan")  # slots 8.. of both rows are unwritten
    q_start = torch.tensor([5, -3], dtype=torch.int32, device=device)  # row 1: its two queries come before every key
    out = ops.attention_ref(q, k, v, None, q_start, 0.125)
    assert torch.isfinite(out).all()
    assert out[1].abs().max() == 0
    ref = ops.attention_ref(q[:1], k[:1, :, :7], v[:1, :, :7], None, None, 0.125)  # row 0 sees keys 0..6
    torch.testing.assert_close(out[:1], ref)


@pytest.mark.parametrize("d", [32, 64])
def test_attention_sdpa_fallback_matches_reference(d, device):
    """The CUDA fallback for cases without a kernel; device-agnostic, so checked on every device."""
    q, k, v = _attention_inputs(b=3, sq=12, skv=40, d=d, device=device)
    key_mask = torch.arange(40, device=device)[None, :] >= torch.tensor([0, 9, 39], device=device)[:, None]
    q_start = torch.tensor([30, 30, 30], dtype=torch.int32, device=device)  # row 2 queries 0-8 see no key: must give 0
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


OPCHECK_CASES = {  # fp32 inputs (on CUDA: the SDPA fallback; test_opcheck_cuda takes fp16, the kernels)
    "attention": lambda dev: (*_attention_inputs(b=2, sq=3, skv=9, d=32, device=dev),
                              torch.ones(2, 9, dtype=torch.bool, device=dev),
                              torch.tensor([6, 6], dtype=torch.int32, device=dev), 0.2),
    # inputs that need gradients: the autograd formula is registered and traces under AOT autograd
    "attention_grad": lambda dev: (*(t.requires_grad_() for t in _attention_inputs(b=2, sq=3, skv=9, d=32, device=dev)),
                                   torch.tensor([[0] * 3 + [1] * 6, [1] * 9], dtype=torch.bool, device=dev),
                                   torch.tensor([2, 6], dtype=torch.int32, device=dev), 0.2),  # row 0's query 0: no key
}


@pytest.mark.parametrize("case", sorted(OPCHECK_CASES))
def test_opcheck(case, device):
    torch.library.opcheck(torch.ops.fuseinfer.attention.default, OPCHECK_CASES[case](device))


# ---- property tests against the reference (hypothesis) ----

@st.composite
def attention_cases(draw, device):
    """(q, k, v, key_mask, q_start, scale, nan_from): batch 1-4, heads 1-4, key/value heads any divisor of them
    (grouped-query attention); one query (decode), a few, or a prefill;
    head dims the kernels take (64, 128) and others (odd ones on the CPU); random left padding per row (up to all
    of a row: no key at all), q_start None (bottom-right causal), one for all rows or per row (negative: queries
    before every key; past Skv - Sq: a static cache's slack); q as a view into a fused QKV buffer; unwritten cache
    slots (NaN) past the last key any query may see."""
    torch.manual_seed(draw(st.integers(0, 2**32 - 1)))  # the tensors follow from the drawn seed (replayable)
    cuda = device == "cuda"
    b, h = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    kv_heads = draw(st.sampled_from([n for n in range(1, h + 1) if h % n == 0]))  # GQA where h allows
    sq = draw(st.one_of(st.just(1), st.integers(2, 16), st.integers(17, 80 if not cuda else 600)))
    skv = draw(st.integers(1, 100 if not cuda else 1200))
    d = draw(st.sampled_from([64, 128]) | (st.integers(1, 40) if not cuda else st.sampled_from([32, 64, 96, 128])))
    dtype = draw(st.sampled_from([torch.float32, *LOWP] if not cuda else [*LOWP, *LOWP, torch.float32]))
    pads = draw(st.sampled_from(["none", "random", "some_rows_empty"]))
    key_mask = None
    if pads != "none":
        hi = skv if pads == "some_rows_empty" else max(skv - 1, 0)
        p = torch.tensor(draw(st.lists(st.integers(0, hi), min_size=b, max_size=b)), device=device)
        key_mask = torch.arange(skv, device=device)[None] >= p[:, None]  # (B, Skv)
    mode = draw(st.sampled_from(["default", "shared", "per_row"]))
    q_start = None
    if mode != "default":
        starts = draw(st.lists(st.integers(-sq - 2, skv + 2), min_size=1 if mode == "shared" else b,
                               max_size=1 if mode == "shared" else b))
        q_start = torch.tensor(starts, dtype=torch.int32, device=device).expand(b).contiguous()
    if draw(st.booleans()):  # q (B, H, Sq, D) as a view into a fused (B, Sq, 3, H, D) projection
        q = torch.randn(b, sq, 3, h, d, device=device)[:, :, 0].transpose(1, 2)
    else:
        q = torch.randn(b, h, sq, d, device=device)
    k, v = (torch.randn(b, kv_heads, skv, d, device=device) for _ in range(2))
    if draw(st.booleans()):  # k, v as a longer cache's first slots (a row stride > Skv * D)
        k, v = (torch.randn(b, kv_heads, skv + 7, d, device=device)[:, :, :skv] for _ in range(2))
    # cache slots past the last key any query may see: never written, may hold anything (on CUDA only where the
    # kernels serve: the SDPA fallback reads every key, and the runtime's caches start zeroed)
    last = (skv - 1 if q_start is None else int(q_start.max()) + sq - 1)
    kernel = d in (64, 128) and dtype in LOWP
    nan_from = last + 1 if last + 1 < skv and (not cuda or kernel) and draw(st.booleans()) else None
    q, k, v = (t.to(dtype) for t in (q, k, v))
    if nan_from is not None:
        k[:, :, nan_from:] = float("nan")
        v[:, :, nan_from:] = float("nan")
    scale = draw(st.sampled_from([d ** -0.5, 0.3]))
    return q, k, v, key_mask, q_start, scale, nan_from


@pytest.mark.parametrize("device", DEVICES)
def test_attention_matches_reference_property(device):
    @examples(device, cpu=50, cuda=200)
    @given(case=attention_cases(device))
    def check(case):
        q, k, v, key_mask, q_start, scale, nan_from = case
        b, h, sq, d = q.shape
        ours = ops.attention(q, k, v, key_mask, q_start, scale)  # (B, Sq, H, D)
        assert ours.shape == (b, sq, h, d) and ours.dtype == q.dtype and ours.is_contiguous()
        assert torch.isfinite(ours).all(), "unwritten slots or queries without keys leaked NaN"
        allowed = allowed_mask(key_mask, q_start, b, sq, k.shape[2], q.device)  # (B, 1, Sq, Skv)
        has_key = allowed.any(-1).view(b, sq)  # (B, Sq)
        if (~has_key).any():
            assert ours[~has_key].abs().max().item() == 0  # a query without keys gives 0, never NaN
        k, v = k.nan_to_num(0.0), v.nan_to_num(0.0)  # the references multiply masked-out NaN slots by 0
        hi = ref_dtype(q.dtype)
        ref = ops.attention_ref(q.to(hi), k.to(hi), v.to(hi), key_mask, q_start, scale).to(hi)
        if device == "cuda":  # plain PyTorch in q's dtype: SDPA with the boolean mask (on repeated k, v for GQA)
            torch_same = torch.nn.functional.scaled_dot_product_attention(q, *_repeated(q, k, v), attn_mask=allowed,
                                                                          scale=scale)
            torch_same = torch_same.transpose(1, 2)
        else:  # the reference in q's dtype (fp32 softmax, one rounding at the end), what the CPU op runs
            torch_same = ops.attention_ref(q, k, v, key_mask, q_start, scale)
        assert_lowp_close(ours[has_key], torch_same[has_key], ref[has_key],
                          f"attention q{tuple(q.shape)} skv={k.shape[2]} {q.dtype}", lowp_atol(ref, q.dtype))
    check()


@pytest.mark.parametrize("device", DEVICES)
def test_attention_opcheck_property(device):
    """opcheck (schema, fake impl, autograd registration, AOT dispatch) on drawn shapes, masks and offsets."""
    @examples(device, cpu=3, cuda=3)
    @given(case=attention_cases(device), grad=st.booleans())
    def check(case, grad):
        q, k, v, key_mask, q_start, scale, _ = case
        q, k, v = (t.nan_to_num(0.0) for t in (q, k, v))  # opcheck compares outputs and gradients
        if grad:  # fp32 for the gradient checks
            q, k, v = (t.float().requires_grad_() for t in (q, k, v))
        torch.library.opcheck(torch.ops.fuseinfer.attention.default, (q, k, v, key_mask, q_start, scale))
    check()


# ---- CUDA kernels ----

def _attn_case(b, h, sq, skv, d, dtype, pads=None, q_start=None, strided_q=False, nan_from=None, kv_heads=None):
    if strided_q:  # q as a view into a fused (B, S, 3, H, D) projection, like the patched OPT produces
        qkv = torch.randn(b, sq, 3, h, d, device="cuda", dtype=dtype)
        q = qkv[:, :, 0].transpose(1, 2)
    else:
        q = torch.randn(b, h, sq, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(b, kv_heads or h, skv, d, device="cuda", dtype=dtype) for _ in range(2))
    if nan_from is not None:  # cache slots past the chunk: never written, may hold anything (must not be used)
        k[:, :, nan_from:] = float("nan")
        v[:, :, nan_from:] = float("nan")
    key_mask = None
    if pads is not None:
        key_mask = torch.arange(skv, device="cuda")[None] >= torch.tensor(pads, device="cuda")[:, None]
    qs = None if q_start is None else torch.tensor(q_start, device="cuda", dtype=torch.int32).expand(b).contiguous()
    return q, k, v, key_mask, qs


def _check_attention_kernel(case: dict, path: str, d: int, dtype) -> torch.Tensor:
    """ops.attention on the case through `path` (asserted by its path count) against the fp32 reference with the 2x
    rule (plain PyTorch: SDPA in the inputs' dtype on repeated key/value heads); queries without keys give 0."""
    q, k, v, key_mask, q_start = _attn_case(d=d, dtype=dtype, **case)
    b, h, sq, _ = q.shape
    scale = d ** -0.5
    ours, paths = paths_taken(lambda: ops.attention(q, k, v, key_mask, q_start, scale))  # (B, Sq, H, D)
    assert paths == {f"attention.{path}": 1}, paths
    assert ours.shape == (b, sq, h, d) and ours.is_contiguous()
    k, v = k.nan_to_num(0.0), v.nan_to_num(0.0)  # the references multiply masked-out NaN slots by 0
    ref32 = ops.attention_ref(q.float(), k.float(), v.float(), key_mask, q_start, scale)
    allowed = allowed_mask(key_mask, q_start, b, sq, k.shape[2], q.device)  # (B, 1, Sq, Skv)
    has_key = allowed.any(-1).view(b, sq)  # (B, Sq)
    assert ours[~has_key].abs().max().item() == 0 if (~has_key).any() else True
    torch_lowp = torch.nn.functional.scaled_dot_product_attention(q, *_repeated(q, k, v), attn_mask=allowed,
                                                                  scale=scale)
    torch_lowp = torch_lowp.transpose(1, 2)
    assert_lowp_close(ours[has_key], torch_lowp[has_key], ref32[has_key], str(case))
    return ours


ATTN_CASES = {
    "prefill_113_pad": dict(b=3, h=4, sq=113, skv=113, pads=[0, 5, 100]),
    "prefill_2048": dict(b=2, h=8, sq=2048, skv=2048),
    "prefill_2048_pad_strided": dict(b=2, h=4, sq=2048, skv=2048, pads=[0, 1000], strided_q=True),
    "chunk_16_after_cache": dict(b=2, h=4, sq=16, skv=700, pads=[3, 0]),
    "decode_1_ctx_8192": dict(b=8, h=8, sq=1, skv=8192),
    "decode_1_pad": dict(b=3, h=4, sq=1, skv=333, pads=[0, 17, 300]),
    "decode_4_static_cache": dict(b=2, h=4, sq=4, skv=1024, q_start=500, pads=[0, 9]),
    "empty_rows": dict(b=2, h=2, sq=64, skv=64, pads=[40, 0]),
    "prefill_259_into_cache_nan_tail": dict(b=2, h=3, sq=259, skv=1024, q_start=300, pads=[0, 7], nan_from=559),
    "prefill_200_into_cache_nan_tail": dict(b=1, h=2, sq=200, skv=512, q_start=100, nan_from=300),
    # per-row q_start, one negative: row 0's first 100 queries see no key, whole warpgroups compute nothing
    "prefill_300_q_start_per_row": dict(b=2, h=3, sq=300, skv=300, q_start=[-100, 50]),
    # more work items than SMs: each block of the persistent wgmma prefill runs several, each with a NaN tail
    "prefill_384_many_items_nan_tail": dict(b=3, h=40, sq=384, skv=640, q_start=200, pads=[0, 33, 250],
                                            nan_from=584),
}


@pytest.mark.gpu
def test_wgmma_prefill_is_built_for_sm90(set_knob):
    """On an H100/H200 the default build (FUSEINFER_CUDA_ARCH=9.0a) must carry the wgmma prefill and pick it, and its
    FP8 form with FUSEINFER_ATTN_FP8=1."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma prefill is for sm_90 GPUs")
    from fuseinfer.core.extension import extension
    set_knob("FUSEINFER_ATTN_FP8", "0")
    assert extension().attention_prefill_kernel() == "wgmma"
    set_knob("FUSEINFER_ATTN_FP8", "1")
    assert extension().attention_prefill_kernel() == "wgmma_fp8"


def _attention_paths():
    """(case, kernel): cases of more than 16 queries run a prefill kernel, wgmma or mma.sync; the others split-KV."""
    for case in sorted(ATTN_CASES):
        paths = ("wgmma", "mma_sync") if ATTN_CASES[case]["sq"] > 16 else ("split_kv",)
        yield from ((case, path) for path in paths)


@pytest.mark.gpu
@pytest.mark.parametrize("case,path", list(_attention_paths()))
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", LOWP)
def test_attention_kernel(case, path, d, dtype, set_knob):
    if path == "wgmma" and not wgmma_available():
        pytest.skip("the wgmma prefill needs an sm_90 GPU")
    set_knob("FUSEINFER_ATTN_SM90", "0" if path == "mma_sync" else "1")
    _check_attention_kernel(ATTN_CASES[case], path, d, dtype)


# grouped-query attention: query heads per key/value head 1, 2, 4, 6 and 8 (Llama 3 8B has 32 / 8, Qwen2.5 1.5B
# 12 / 2); the split-KV cases pack a key/value head's query heads into one block, their rows spanning heads
GQA_CASES = {
    "g1_decode_3_per_row_q_start": dict(b=2, h=4, kv_heads=4, sq=3, skv=500, q_start=[-2, 400], nan_from=403),
    "g2_prefill_113_pad": dict(b=3, h=4, kv_heads=2, sq=113, skv=113, pads=[0, 5, 100]),
    "g2_decode_4_static_cache": dict(b=2, h=4, kv_heads=2, sq=4, skv=1024, q_start=500, pads=[0, 9], nan_from=504),
    "g4_prefill_2048": dict(b=1, h=32, kv_heads=8, sq=2048, skv=2048),
    "g4_decode_1_ctx_8192": dict(b=4, h=32, kv_heads=8, sq=1, skv=8192, pads=[0, 100, 4000, 8191]),
    "g6_prefill_300_into_cache": dict(b=2, h=12, kv_heads=2, sq=300, skv=700, q_start=300, pads=[0, 37],
                                      nan_from=600, strided_q=True),
    "g6_decode_1_pad": dict(b=3, h=12, kv_heads=2, sq=1, skv=333, pads=[0, 17, 300]),
    "g8_prefill_64_after_8192_keys": dict(b=2, h=8, kv_heads=1, sq=64, skv=8192, q_start=8100, pads=[0, 5000],
                                          nan_from=8164),
    "g8_chunk_16_after_cache": dict(b=2, h=16, kv_heads=2, sq=16, skv=700, pads=[3, 0]),
    "g8_decode_3_per_row_q_start": dict(b=2, h=8, kv_heads=1, sq=3, skv=777, q_start=[-2, 600], nan_from=603),
}


def _gqa_paths():
    for case in sorted(GQA_CASES):
        paths = ("wgmma", "mma_sync") if GQA_CASES[case]["sq"] > 16 else ("split_kv",)
        yield from ((case, path) for path in paths)


@pytest.mark.gpu
@pytest.mark.parametrize("case,path", list(_gqa_paths()))
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", LOWP)
def test_attention_kernel_gqa(case, path, d, dtype, set_knob):
    if path == "wgmma" and not wgmma_available():
        pytest.skip("the wgmma prefill needs an sm_90 GPU")
    set_knob("FUSEINFER_ATTN_SM90", "0" if path == "mma_sync" else "1")
    _check_attention_kernel(GQA_CASES[case], path, d, dtype)


# ---- FP8 prefill (FUSEINFER_ATTN_FP8=1): e4m3 Q K^T and P V ----

def _rms(x: torch.Tensor) -> float:
    return x.double().pow(2).mean().sqrt().item()


def _check_fp8_attention(ours, q, k, v, key_mask, q_start, scale, what: str) -> None:
    """ours (the FP8 prefill's output) against fp32 attention: finite, 0 on queries without keys, and its RMS error
    within twice the FP8 reference's (attention_fp8_ref: the same roundings with an exact row max), which itself
    keeps ~26 dB on unit-normal inputs."""
    b, h, sq, d = q.shape
    allowed = allowed_mask(key_mask, q_start, b, sq, k.shape[2], q.device)  # (B, 1, Sq, Skv)
    has_key = allowed.any(-1).view(b, sq)  # (B, Sq)
    assert torch.isfinite(ours).all(), f"{what}: NaN or inf"
    if (~has_key).any():
        assert ours[~has_key].abs().max().item() == 0, f"{what}: a query without keys gave non-zero"
    k, v = k.nan_to_num(0.0), v.nan_to_num(0.0)  # (masked-out unwritten slots)
    ref32 = ops.attention_ref(q.float(), k.float(), v.float(), key_mask, q_start, scale)[has_key].double()
    emul = ops.attention_fp8_ref(q.float(), k.float(), v.float(), key_mask, q_start, scale)[has_key].double()
    ours_err, emul_err = _rms(ours[has_key].double() - ref32), _rms(emul - ref32)
    assert ours_err <= 2 * emul_err + 1e-6, f"{what}: RMS error {ours_err:.3g} vs the FP8 reference's {emul_err:.3g}"


def test_fp8_reference_keeps_its_accuracy_and_masks():
    """attention_fp8_ref on the CPU: within 22 dB of fp32 attention on unit-normal inputs (e4m3 keeps 3 mantissa
    bits; measured ~26-27 dB), 0 for queries without keys, and unwritten slots (NaN past the causal end) unread."""
    for b, h, kv, sq, skv, d, qs, pads in [(2, 4, 4, 300, 300, 64, None, None), (1, 8, 2, 200, 700, 128, 400, None),
                                           (2, 4, 1, 130, 130, 64, None, [0, 129])]:
        q, k, v = torch.randn(b, h, sq, d), torch.randn(b, kv, skv, d), torch.randn(b, kv, skv, d)
        q_start = None if qs is None else torch.full((b,), qs, dtype=torch.int32)
        end = skv if qs is None else qs + sq
        k[:, :, end:], v[:, :, end:] = float("nan"), float("nan")
        key_mask = None if pads is None else torch.arange(skv)[None] >= torch.tensor(pads)[:, None]
        ours = ops.attention_fp8_ref(q, k, v, key_mask, q_start, d ** -0.5)
        assert torch.isfinite(ours).all()
        ref = ops.attention_ref(q, k.nan_to_num(0.0), v.nan_to_num(0.0), key_mask, q_start, d ** -0.5)
        has_key = allowed_mask(key_mask, q_start, b, sq, skv, q.device).any(-1).view(b, sq)
        assert sqnr_db(ref[has_key], ours[has_key]) >= 22.0
        if (~has_key).any():
            assert ours[~has_key].abs().max().item() == 0


def _fp8_prefill_cases():
    for name, case in sorted({**ATTN_CASES, **GQA_CASES}.items()):
        if case["sq"] > 16:
            yield name


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(_fp8_prefill_cases()))
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", LOWP)
def test_attention_kernel_fp8(case, d, dtype, set_knob):
    """The FP8 prefill on every prefill case (padding, per-row q_start, NaN in unwritten slots, more items than SMs,
    grouped-query heads, q strided): one FP8 kernel call (path count), within twice the FP8 reference's error."""
    if not wgmma_available():
        pytest.skip("the FP8 prefill needs an sm_90 GPU")
    set_knob("FUSEINFER_ATTN_FP8", "1")
    q, k, v, key_mask, q_start = _attn_case(d=d, dtype=dtype, **{**ATTN_CASES, **GQA_CASES}[case])
    scale = d ** -0.5
    ours, paths = paths_taken(lambda: ops.attention(q, k, v, key_mask, q_start, scale))
    assert paths == {"attention.wgmma_fp8": 1}, paths
    assert ours.shape == (q.shape[0], q.shape[2], q.shape[1], d) and ours.dtype == dtype
    _check_fp8_attention(ours, q, k, v, key_mask, q_start, scale, f"{case} d{d} {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", LOWP)
def test_attention_kernel_fp8_scales_change_between_tiles(d, dtype, set_knob):
    """Key and value tiles at different scales, every tile carrying weight: one key element of 100 in tile 0 (in a
    head dim the queries do not use, so the scores keep their spread while the tile's key scale grows 16x), values x
    1e-3 in tile 1 and x 30 in tile 2 (O moves between value scales), a zero query row: within the rule."""
    if not wgmma_available():
        pytest.skip("the FP8 prefill needs an sm_90 GPU")
    set_knob("FUSEINFER_ATTN_FP8", "1")
    q, k, v, key_mask, q_start = _attn_case(b=2, h=4, sq=400, skv=400, d=d, dtype=dtype)
    q[..., 0] = 0.0
    k[:, :, 7, 0] = 100.0
    v[:, :, 128:256] *= 1e-3
    v[:, :, 256:384] *= 30.0
    q[:, :, 5] = 0.0
    ours = ops.attention(q, k, v, key_mask, q_start, d ** -0.5)
    _check_fp8_attention(ours, q, k, v, key_mask, q_start, d ** -0.5, f"scales d{d} {dtype}")


@pytest.mark.gpu
def test_attention_fp8_output_and_graph_replay(set_knob):
    """With the FP8 prefill on, the e4m3-output op (attention_fp8out) takes it too, and a CUDA graph of the call
    (the prep's temporaries from the graph's pool) replays to the eager result bit for bit."""
    if not wgmma_available():
        pytest.skip("the FP8 prefill needs an sm_90 GPU")
    set_knob("FUSEINFER_ATTN_FP8", "1")
    q, k, v, key_mask, q_start = _attn_case(b=2, h=8, sq=600, skv=600, d=128, dtype=torch.bfloat16, pads=[0, 77])
    out_scale = torch.tensor([0.01], device="cuda")
    out8, paths = paths_taken(lambda: ops.attention_fp8out(q, k, v, key_mask, q_start, 128 ** -0.5, out_scale))
    assert paths == {"attention.wgmma_fp8": 1}, paths
    eager = ops.attention(q, k, v, key_mask, q_start, 128 ** -0.5)
    assert (out8.float() * 0.01 - eager.float()).abs().max().item() <= 0.01 * 32 + 1e-3  # one e4m3 step at <= 448
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        ops.attention(q, k, v, key_mask, q_start, 128 ** -0.5)  # warm-up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = ops.attention(q, k, v, key_mask, q_start, 128 ** -0.5)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", ["1", "2", "3", "7", "128"])
@pytest.mark.parametrize("case", ["g4_decode_1_ctx_8192", "g6_decode_1_pad", "g1_decode_3_per_row_q_start"])
def test_split_kv_any_forced_split_count(case, splits, set_knob):
    """FUSEINFER_SPLITKV_SPLITS forces the split-KV kernel's split count (benchmarks sweep it): every count, one
    split, a count that does not divide the keys, and more than the keys allow (capped), gives attention within the
    rule."""
    set_knob("FUSEINFER_SPLITKV_SPLITS", splits)
    for d in (64, 128):
        _check_attention_kernel(GQA_CASES[case], "split_kv", d, torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["wgmma", "mma_sync"])
def test_gqa_prefill_equals_the_kernel_on_repeated_heads(path, set_knob):
    """The prefills compute each (row, query head) alike whichever key/value head layout feeds it: on Hkv heads they
    give the bits they give on k, v repeated to H heads (only the addressing of K and V differs)."""
    if path == "wgmma" and not wgmma_available():
        pytest.skip("the wgmma prefill needs an sm_90 GPU")
    set_knob("FUSEINFER_ATTN_SM90", "0" if path == "mma_sync" else "1")
    q, k, v, key_mask, q_start = _attn_case(2, 12, 300, 700, 128, torch.bfloat16, pads=[0, 37], q_start=300,
                                            kv_heads=2)
    ours = ops.attention(q, k, v, key_mask, q_start, 0.1)
    assert torch.equal(ours, ops.attention(q, *(t.contiguous() for t in _repeated(q, k, v)), key_mask, q_start, 0.1))


@pytest.mark.gpu
def test_gqa_decode_replays_in_a_cuda_graph():
    """Split-KV decode with GQA packing (several splits: merge counters, scratch) captured and replayed as the
    cache fills: each replay equals an eager call."""
    q, k, v, key_mask, _ = _attn_case(2, 32, 1, 4096, 128, torch.float16, pads=[0, 1000], kv_heads=8)
    q_start = torch.tensor([100, 100], dtype=torch.int32, device="cuda")
    ops.attention(q, k, v, key_mask, q_start, 0.1)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.attention(q, k, v, key_mask, q_start, 0.1)
    for step in (1500, 4000, 4095):
        q.copy_(torch.randn_like(q))
        q_start.fill_(step)
        graph.replay()
        assert torch.equal(out, ops.attention(q, k, v, key_mask, q_start, 0.1)), step


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["attention", "attention_grad"])
def test_opcheck_cuda(name):
    q, k, v, key_mask, _ = _attn_case(2, 4, 9, 9, 64, torch.float16, pads=[0, 3])
    if name == "attention_grad":  # inputs that need gradients: the kernel's forward, the reference's gradients
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.fuseinfer.attention.default, (q, k, v, key_mask, None, 0.125))


@pytest.mark.gpu
def test_eager_fast_path_equals_registered_op(monkeypatch):
    """The op wrapper calls the extension directly in eager mode; the dispatcher path must run the same kernel and
    give the same bits."""
    calls = record_kernel_calls(monkeypatch)
    q, k, v, key_mask, q_start = _attn_case(2, 4, 33, 33, 64, torch.float16, pads=[0, 5])
    assert torch.equal(ops.attention(q, k, v, key_mask, q_start, 0.125),
                       torch.ops.fuseinfer.attention(q, k, v, key_mask, q_start, 0.125))
    assert calls == ["attention"] * 2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d", [(torch.float32, 64), (torch.float16, 32)])
def test_attention_without_kernel_falls_back_to_sdpa_on_cuda(dtype, d, monkeypatch):
    q, k, v, key_mask, q_start = _attn_case(3, 4, 37, 37, d, dtype, pads=[0, 5, 36])
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(1) or sdpa(*a, **kw))
    out = ops.attention(q, k, v, key_mask, q_start, d ** -0.5)
    assert calls == [1], "the fallback must run SDPA (once), not the kernel or the reference"
    ref32 = ops.attention_ref(q.float(), k.float(), v.float(), key_mask, q_start, d ** -0.5)
    assert torch.isfinite(out).all() and out[2, :36].abs().max() == 0  # row 2: queries before its only key
    torch.testing.assert_close(out.float(), ref32, rtol=2e-3 if dtype == torch.float16 else 1e-5,
                               atol=2e-3 if dtype == torch.float16 else 1e-5)
