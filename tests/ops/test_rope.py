"""fuseinfer::qkv_rope and fuseinfer::qkv_rope_append (fuseinfer/ops/rope.py): the reference against transformers'
apply_rotary_pos_emb bit for bit with the rotary module's cos / sin (default, linear, dynamic and llama3 scaling),
grouped-query head counts, the cache-writing form, bad input, gradients against autograd of the reference, the
registrations (opcheck), property tests (hypothesis) on every device and, on a GPU, the CUDA kernel (the 2x rule
against an fp32 reference on round and odd head dims, out-of-range slots skipped, replay in a CUDA graph)."""
from __future__ import annotations

import pytest
import torch
from helpers import (
    LOWP,
    assert_lowp_close,
    examples,
    given,
    lowp_atol,
    ref_dtype,
    require_kernel,
    st,
)
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from fuseinfer import FuseInferError
from fuseinfer.ops.rope import qkv_rope, qkv_rope_append, qkv_rope_append_ref, qkv_rope_ref

ALL_DTYPES = [torch.float32, *LOWP]
ROPE_PARAMETERS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    # positions past max_position_embeddings (64): the dynamic module rescales its frequencies
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _cos_sin(b, s, d, dtype, device="cpu", rope="default", offset=0):
    """cos, sin (B, S, D) from transformers' Llama rotary module for positions offset.. offset + S - 1 (row r
    shifted by 3 r, as left padding shifts positions)."""
    cfg = LlamaConfig(hidden_size=d * 4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      rope_parameters=dict(ROPE_PARAMETERS[rope]), head_dim=d)
    emb = LlamaRotaryEmbedding(cfg).to(device)
    pos = offset + torch.arange(s, device=device)[None] + 3 * torch.arange(b, device=device)[:, None]  # (B, S)
    return emb(torch.zeros(1, dtype=dtype, device=device), pos)


def _inputs(b, s, h, hkv, d, dtype=torch.float32, device="cpu", rope="default"):
    qkv = torch.randn(b, s, (h + 2 * hkv) * d, dtype=dtype, device=device)
    cos, sin = _cos_sin(b, s, d, dtype, device, rope)
    return qkv, cos, sin


def _split(qkv, h, hkv):
    """q (B, H, S, D), k, v (B, Hkv, S, D): the unfused model's projections, as views."""
    b, s, width = qkv.shape
    d = width // (h + 2 * hkv)
    x = qkv.view(b, s, h + 2 * hkv, d).transpose(1, 2)
    return x[:, :h], x[:, h:h + hkv], x[:, h + hkv:]


@pytest.mark.parametrize("rope", sorted(ROPE_PARAMETERS))
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_reference_equals_transformers_bit_for_bit(rope, dtype):
    """On the CPU a patched model must give the unpatched one's bits: the reference rotates as transformers does."""
    h, hkv, d = 4, 2, 64
    qkv, cos, sin = _inputs(2, 100, h, hkv, d, dtype, rope=rope)  # 100 + 3 positions: past the dynamic limit
    q, k, v = qkv_rope(qkv, cos, sin, h, hkv)
    q0, k0, v0 = _split(qkv, h, hkv)
    eq, ek = apply_rotary_pos_emb(q0, k0, cos, sin)
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    assert torch.equal(q, eq) and torch.equal(k, ek) and torch.equal(v, v0)
    assert not torch.equal(q, q0)  # (the rotation did something)


def test_grouped_query_heads_and_multi_head():
    """H = Hkv (multi-head) and H = 6 Hkv split where the fused projection puts them: q, then k, then v."""
    for h, hkv in ((3, 3), (6, 1), (12, 2)):
        qkv, cos, sin = _inputs(1, 5, h, hkv, 16)
        q, k, v = qkv_rope(qkv, cos, sin, h, hkv)
        assert q.shape == (1, h, 5, 16) and k.shape == v.shape == (1, hkv, 5, 16)
        q0, k0, v0 = _split(qkv, h, hkv)
        eq, ek = apply_rotary_pos_emb(q0, k0, cos, sin)
        assert torch.equal(q, eq) and torch.equal(k, ek) and torch.equal(v, v0)


def test_append_writes_the_rotated_k_v_at_the_slots(device):
    h, hkv, d, t = 4, 2, 32, 12
    qkv, cos, sin = _inputs(2, 3, h, hkv, d, device=device)
    caches = [torch.randn(2, hkv, t, d, device=device) for _ in range(2)]
    before = [c.clone() for c in caches]
    slots = torch.tensor([7, 2, 11], device=device)
    q = qkv_rope_append(qkv, cos, sin, h, hkv, *caches, slots)
    eq, ek, ev = qkv_rope(qkv, cos, sin, h, hkv)  # on CUDA the same kernel: the same bits
    assert torch.equal(q, eq)
    ref_caches = [c.clone() for c in before]  # the reference (fp32 rounding order of PyTorch's: close, not equal)
    torch.testing.assert_close(qkv_rope_append_ref(qkv, cos, sin, h, hkv, *ref_caches, slots), q)
    torch.testing.assert_close(ref_caches, caches)
    others = [i for i in range(t) if i not in (7, 2, 11)]
    for cache, old, new in ((caches[0], before[0], ek), (caches[1], before[1], ev)):
        assert torch.equal(cache[:, :, [7, 2, 11]], new) and torch.equal(cache[:, :, others], old[:, :, others])


def test_rejects_bad_input_with_one_clear_error(device):
    qkv, cos, sin = _inputs(2, 3, 4, 2, 8, device=device)
    with pytest.raises(FuseInferError, match="H a multiple of Hkv"):
        qkv_rope(qkv, cos, sin, 4, 3)
    with pytest.raises(FuseInferError, match="H a multiple of Hkv"):
        qkv_rope(qkv[0], cos, sin, 4, 2)
    with pytest.raises(FuseInferError, match=r"is not \(H \+ 2 Hkv\) \* D"):
        qkv_rope(qkv[..., :-1], cos, sin, 4, 2)
    with pytest.raises(FuseInferError, match="even head dim"):  # D = 7
        qkv_rope(torch.randn(1, 2, 7 * 3, device=device), cos[:1, :2, :7], sin[:1, :2, :7], 1, 1)
    with pytest.raises(FuseInferError, match=r"cos must be \(2, 3, 8\)"):
        qkv_rope(qkv, cos[:, :2], sin, 4, 2)
    with pytest.raises(FuseInferError, match=r"sin must be \(2, 3, 8\) in torch.float32"):
        qkv_rope(qkv, cos, sin.half(), 4, 2)
    cache = torch.zeros(2, 2, 5, 8, device=device)
    with pytest.raises(FuseInferError, match="int64 slots"):
        qkv_rope_append(qkv, cos, sin, 4, 2, cache, cache.clone(), torch.arange(3, dtype=torch.int32, device=device))
    with pytest.raises(FuseInferError, match=r"expected caches \(2, 2, T, 8\)"):
        qkv_rope_append(qkv, cos, sin, 4, 2, cache[:, :1], cache[:, :1].clone(), torch.arange(3, device=device))


@pytest.mark.parametrize("needs", ["qkv", "all"])
def test_gradients_match_autograd_of_the_reference(needs):
    """The op's autograd formula against autograd through the reference itself, in float64 (qkv, cos and sin)."""
    h, hkv, d = 6, 2, 10
    qkv, cos, sin = (t.double() for t in _inputs(2, 5, h, hkv, d))
    cos, sin = cos + 0.1 * torch.randn_like(cos), sin + 0.1 * torch.randn_like(sin)  # (not the same two halves)
    leaves = [qkv.requires_grad_()] + ([cos.requires_grad_(), sin.requires_grad_()] if needs == "all" else [])
    grads = [torch.randn(2, n, 5, d, dtype=torch.float64) for n in (h, hkv, hkv)]
    ours = torch.autograd.grad(qkv_rope(qkv, cos, sin, h, hkv), leaves, grads)
    expected = torch.autograd.grad(qkv_rope_ref(qkv, cos, sin, h, hkv), leaves, grads)
    for a, e in zip(ours, expected):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda *x: torch.ops.fuseinfer.qkv_rope(*x, h, hkv), (qkv, cos, sin))


def test_gradients_of_an_unused_output():
    """Only q used (k, v's gradients undefined): dqkv is 0 over k and v's columns."""
    qkv, cos, sin = _inputs(1, 4, 2, 1, 8)
    qkv.requires_grad_()
    q, _, _ = qkv_rope(qkv, cos, sin, 2, 1)
    q.sum().backward()
    assert qkv.grad[..., 16:].abs().max() == 0 and qkv.grad[..., :16].abs().max() > 0


OPCHECK_CASES = {
    "qkv_rope": lambda dev: (*_inputs(2, 3, 4, 2, 16, device=dev), 4, 2),
    "qkv_rope_grad": lambda dev: (*(t.requires_grad_() for t in _inputs(2, 3, 6, 3, 8, device=dev)), 6, 3),
    "qkv_rope_append": lambda dev: (*_inputs(2, 3, 4, 1, 16, device=dev), 4, 1, torch.randn(2, 1, 9, 16, device=dev),
                                    torch.randn(2, 1, 9, 16, device=dev), torch.tensor([8, 0, 4], device=dev)),
}


@pytest.mark.parametrize("case", sorted(OPCHECK_CASES))
def test_opcheck(case, device):
    op = torch.ops.fuseinfer.qkv_rope_append if case == "qkv_rope_append" else torch.ops.fuseinfer.qkv_rope
    torch.library.opcheck(op.default, OPCHECK_CASES[case](device))


# ---- property tests (hypothesis) ----

@st.composite
def rope_cases(draw, device):
    """(qkv, cos, sin, H, Hkv, caches, slots): batch 1-3, 1-40 tokens, Hkv 1-4 with 1-4 query heads each, even head
    dims (the kernel's widths: 16-byte vectors where D / 2 allows, narrower else), any dtype, cos / sin of a random
    scaling; slots distinct, in a cache of up to 48 slots."""
    torch.manual_seed(draw(st.integers(0, 2**32 - 1)))
    b, s = draw(st.integers(1, 3)), draw(st.integers(1, 40))
    hkv = draw(st.integers(1, 4))
    h = hkv * draw(st.integers(1, 4))
    d = draw(st.sampled_from([64, 128, 80, 96, 32]) | st.integers(2, 40).map(lambda x: 2 * x))  # (dynamic: D > 2)
    dtype = draw(st.sampled_from(ALL_DTYPES))
    qkv, cos, sin = _inputs(b, s, h, hkv, d, dtype, device, draw(st.sampled_from(sorted(ROPE_PARAMETERS))))
    t = draw(st.integers(s, 48))
    slots = torch.tensor(draw(st.permutations(range(t)))[:s], device=device)
    caches = [torch.randn(b, hkv, t, d, dtype=dtype, device=device) for _ in range(2)]
    return qkv, cos, sin, h, hkv, caches, slots


def _expected(qkv, cos, sin, h, hkv):
    """(ours' reference in the next precision up, plain PyTorch in the inputs' dtype): q, k, v each."""
    hi = ref_dtype(qkv.dtype)
    return qkv_rope_ref(qkv.to(hi), cos.to(hi), sin.to(hi), h, hkv), qkv_rope_ref(qkv, cos, sin, h, hkv)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_qkv_rope_matches_reference_property(device):
    @examples(device, cpu=25, cuda=200)
    @given(case=rope_cases(device))
    def check(case):
        qkv, cos, sin, h, hkv, caches, slots = case
        before = [c.clone() for c in caches]
        q, k, v = qkv_rope(qkv, cos, sin, h, hkv)
        q2 = qkv_rope_append(qkv, cos, sin, h, hkv, *caches, slots)
        refs, same = _expected(qkv, cos, sin, h, hkv)
        for name, ours, ref, torch_same in zip("qkv", (q, k, v), refs, same):
            assert ours.dtype == qkv.dtype and ours.is_contiguous()
            assert_lowp_close(ours, torch_same, ref, f"{name} {tuple(qkv.shape)} {qkv.dtype}",
                              lowp_atol(ref, qkv.dtype))
        assert torch.equal(q2, q) and torch.equal(v, same[2])  # the same kernel's q; v only copied
        written = slots.tolist()
        others = [i for i in range(caches[0].shape[2]) if i not in written]
        for cache, old, new in ((caches[0], before[0], k), (caches[1], before[1], v)):
            assert torch.equal(cache[:, :, written], new) and torch.equal(cache[:, :, others], old[:, :, others])
    check()


# ---- CUDA kernel ----

def _check_kernel(b, s, h, hkv, d, dtype, rope="llama3"):
    require_kernel()
    qkv, cos, sin = _inputs(b, s, h, hkv, d, dtype, "cuda", rope)
    ours = qkv_rope(qkv, cos, sin, h, hkv)
    refs, same = _expected(qkv, cos, sin, h, hkv)
    for name, o, ref, torch_same in zip("qkv", ours, refs, same):
        assert_lowp_close(o, torch_same, ref, f"{name} d={d} {dtype}", lowp_atol(ref, dtype))
    assert torch.equal(ours[2], same[2])
    return qkv, cos, sin, ours


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 32, 80, 96, 36, 6, 256])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_kernel_against_fp32_reference(d, dtype):
    """Round head dims and odd ones (36: 4-byte vectors in 16-bit types, 6: one element a thread)."""
    _check_kernel(3, 37, 8, 2, d, dtype)
    _check_kernel(1, 1, 4, 4, d, dtype, rope="default")  # decode, multi-head


@pytest.mark.gpu
def test_kernel_takes_the_extension(monkeypatch):
    """The op reaches the extension's kernel (not its reference), eager and through the dispatcher, same bits."""
    require_kernel()
    from fuseinfer.core import extension as _ext

    calls, ext = [], _ext.extension()

    class Recording:
        def __getattr__(self, name):
            attr = getattr(ext, name)
            return (lambda *a: calls.append(name) or attr(*a)) if name.startswith("qkv_rope") else attr

    monkeypatch.setattr(_ext, "_ext", Recording())
    qkv, cos, sin = _inputs(2, 9, 4, 2, 64, torch.float16, "cuda")
    eager = qkv_rope(qkv, cos, sin, 4, 2)
    dispatched = torch.ops.fuseinfer.qkv_rope(qkv, cos, sin, 4, 2)
    assert all(torch.equal(a, e) for a, e in zip(dispatched, eager))
    cache = torch.zeros(2, 2, 16, 64, device="cuda", dtype=torch.float16)
    qkv_rope_append(qkv, cos, sin, 4, 2, cache, cache.clone(), torch.arange(9, device="cuda"))
    assert calls == ["qkv_rope", "qkv_rope", "qkv_rope_append"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", LOWP, ids=str)
def test_append_kernel_skips_slots_out_of_range(dtype):
    require_kernel()
    qkv, cos, sin = _inputs(2, 5, 8, 2, 128, dtype, "cuda")
    caches = [torch.randn(2, 2, 10, 128, device="cuda", dtype=dtype) for _ in range(2)]
    before = [c.clone() for c in caches]
    slots = torch.tensor([3, -1, 9, 10, 0], device="cuda")  # -1 and 10 lie outside [0, 10)
    q = qkv_rope_append(qkv, cos, sin, 8, 2, *caches, slots)
    eq, ek, ev = qkv_rope(qkv, cos, sin, 8, 2)
    assert torch.equal(q, eq)
    for cache, old, new in ((caches[0], before[0], ek), (caches[1], before[1], ev)):
        assert torch.equal(cache[:, :, [3, 9, 0]], new[:, :, [0, 2, 4]])
        keep = [1, 2, 4, 5, 6, 7, 8]
        assert torch.equal(cache[:, :, keep], old[:, :, keep])


@pytest.mark.gpu
def test_requires_grad_call_runs_the_kernel_forward_and_the_formula_backward():
    qkv, cos, sin, ours = _check_kernel(2, 7, 4, 2, 64, torch.float32)
    qkv.requires_grad_()
    q, k, v = qkv_rope(qkv, cos, sin, 4, 2)
    assert torch.equal(q, ours[0]) and q.requires_grad
    (q.sum() + 2 * k.sum() + 3 * v.sum()).backward()
    qkv_ref = qkv.detach().double().requires_grad_()
    rq, rk, rv = qkv_rope_ref(qkv_ref, cos.double(), sin.double(), 4, 2)
    (rq.sum() + 2 * rk.sum() + 3 * rv.sum()).backward()
    torch.testing.assert_close(qkv.grad.double(), qkv_ref.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", LOWP, ids=str)
def test_append_replays_in_a_cuda_graph(dtype):
    """Decode's form captured once and replayed over new inputs and slots (what fuseinfer.generate does)."""
    require_kernel()
    h, hkv, d, t = 8, 2, 128, 32
    qkv, cos, sin = _inputs(2, 1, h, hkv, d, dtype, "cuda")
    caches = [torch.zeros(2, hkv, t, d, device="cuda", dtype=dtype) for _ in range(2)]
    slots = torch.tensor([0], device="cuda")
    qkv_rope_append(qkv, cos, sin, h, hkv, *caches, slots)  # warm-up (the extension loads, the kernel is set up)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = qkv_rope_append(qkv, cos, sin, h, hkv, *caches, slots)
    expected_k = torch.zeros_like(caches[0])
    for step in range(5):
        qkv.copy_(torch.randn_like(qkv))
        c, s = _cos_sin(2, 1, d, dtype, "cuda", "llama3", offset=step)
        cos.copy_(c)
        sin.copy_(s)
        slots.fill_(step)
        graph.replay()
        eq, ek, _ = qkv_rope(qkv, cos, sin, h, hkv)
        expected_k[:, :, step] = ek[:, :, 0]
        assert torch.equal(q, eq), step
    torch.cuda.synchronize()
    assert torch.equal(caches[0], expected_k)
