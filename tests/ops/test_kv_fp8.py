"""The FP8 (e4m3) KV cache's ops: fuseinfer::kv_cache_append_fp8, fuseinfer::qkv_rope_append_fp8 and
fuseinfer::attention_kv_fp8 (fuseinfer/ops/kv_cache.py, rope.py, attention.py). The references (quantization error
bounds, calibration, saturation: hypothesis), bad input, the registrations (opcheck) and, on a GPU, the kernels
against the references: the append byte-exact, the rotary append within one e4m3 step, decode attention within the
dtype rule of the attention tests (head dims 64 and 128, grouped-query heads, odd lengths), prefill-sized calls."""
from __future__ import annotations

import pytest
import torch
from helpers import DEVICES, assert_lowp_close, examples, given, lowp_atol, require_kernel, sqnr_db, st

from fuseinfer import FuseInferError, ops
from fuseinfer.ops.attention import attention_kv_fp8, attention_kv_fp8_ref, attention_ref
from fuseinfer.ops.kv_cache import (
    FP8_DTYPE, FP8_HEADROOM, FP8_MAX, dequantize_kv, kv_cache_append_fp8, kv_cache_append_fp8_ref, kv_scales_from,
    quantize_kv,
)
from fuseinfer.ops.rope import qkv_rope_ref

E4M3_REL = 2.0 ** -4  # half a unit in the last place of a 3-bit mantissa, relative
E4M3_SUB = 2.0 ** -10  # half the subnormal step (2^-9), in units of the scale


def _caches(b, hkv, t, d, device="cpu"):
    return (torch.zeros(b, hkv, t, d, dtype=FP8_DTYPE, device=device),
            torch.zeros(b, hkv, t, d, dtype=FP8_DTYPE, device=device))


def _rope(b, s, d, dtype=torch.float32, device="cpu"):
    """cos, sin (B, S, D) of random positions, as transformers' rotary module returns them."""
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=device).float() / d))
    pos = torch.randint(0, 4096, (b, s, 1), device=device).float()
    ang = torch.cat([pos * inv, pos * inv], dim=-1)  # (B, S, D)
    return ang.cos().to(dtype), ang.sin().to(dtype)


# ---- the references ----

@examples("cpu", 40, 40)
@given(log_mag=st.floats(-6, 6), hkv=st.integers(1, 4), d=st.sampled_from([4, 16, 64]), seed=st.integers(0, 2**16))
def test_quantize_round_trip_is_within_half_an_e4m3_step(log_mag, hkv, d, seed):
    """Calibrated scales: every value of the calibrating write comes back within half an e4m3 step (relative) or
    half a subnormal step (absolute), at any magnitude, and the largest lands at FP8_MAX / FP8_HEADROOM."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(2, hkv, 5, d, generator=g) * 2.0 ** log_mag
    v = torch.randn(2, hkv, 5, d, generator=g) * 2.0 ** (-log_mag)
    scales = kv_scales_from(k, v)  # (2, Hkv)
    assert scales.shape == (2, hkv) and scales.dtype == torch.float32
    for x, s in ((k, scales[0]), (v, scales[1])):
        back = dequantize_kv(quantize_kv(x, s), s)
        bound = E4M3_REL * x.abs() + E4M3_SUB * s.view(1, -1, 1, 1) * (1 + 1e-6)
        assert ((back - x).abs() <= bound).all()
        top = quantize_kv(x, s).float().abs().amax(dim=(0, 2, 3))
        assert torch.allclose(top, torch.full_like(top, FP8_MAX / FP8_HEADROOM), rtol=E4M3_REL)


def test_values_beyond_the_range_saturate():
    s = torch.tensor([0.5])
    x = torch.tensor([1e4, -1e4, 224.0, float(FP8_MAX) * 0.5]).view(1, 1, 1, 4)
    q = quantize_kv(x, s)
    assert q.dtype == FP8_DTYPE and torch.equal(q.float().view(-1), torch.tensor([448.0, -448.0, 448.0, 448.0]))
    assert not torch.isnan(q.float()).any()


def test_a_zero_head_gets_a_finite_scale():
    k = torch.zeros(1, 2, 3, 8)
    k[:, 1] = 1.0
    scales = kv_scales_from(k, k)
    assert (scales > 0).all() and torch.isfinite(scales).all()
    assert torch.equal(dequantize_kv(quantize_kv(k, scales[0]), scales[0]), k)


@pytest.mark.parametrize("calibrate", [True, False])
def test_append_quantizes_at_the_slots_and_calibrates_only_when_asked(calibrate, device):
    b, h, s, t, d = 2, 3, 4, 9, 16
    k, v = torch.randn(b, h, s, d, device=device) * 3, torch.randn(b, h, s, d, device=device) * 0.1
    slots = torch.tensor([6, 0, 2, 8], device=device)
    kc, vc = _caches(b, h, t, d, device)
    kv_scale = torch.full((2, h), 0.02, device=device)
    kv_cache_append_fp8(kc, vc, k, v, slots, kv_scale, calibrate=calibrate)
    expected = kv_scales_from(k, v) if calibrate else torch.full((2, h), 0.02, device=device)
    assert torch.equal(kv_scale, expected)
    for cache, x, sc in ((kc, k, kv_scale[0]), (vc, v, kv_scale[1])):
        assert torch.equal(cache[:, :, slots].view(torch.uint8), quantize_kv(x, sc).view(torch.uint8))
        untouched = [i for i in range(t) if i not in slots.tolist()]
        assert cache[:, :, untouched].float().eq(0).all()


@examples("cpu", 15, 15)
@given(hkv=st.integers(1, 3), group=st.sampled_from([1, 2, 4]), sq=st.integers(1, 5), skv=st.integers(5, 20),
       seed=st.integers(0, 2**16))
def test_attention_reference_is_the_reference_on_dequantized_keys_and_values(hkv, group, sq, skv, seed):
    g = torch.Generator().manual_seed(seed)
    b, d = 2, 16
    q = torch.randn(b, hkv * group, sq, d, generator=g)
    k32, v32 = torch.randn(b, hkv, skv, d, generator=g), torch.randn(b, hkv, skv, d, generator=g)
    scales = kv_scales_from(k32, v32)
    k, v = quantize_kv(k32, scales[0]), quantize_kv(v32, scales[1])
    key_mask = torch.rand(b, skv, generator=g) > 0.2
    q_start = torch.tensor([skv - sq, skv - sq - 1], dtype=torch.int32).clamp_min(0)
    ours = attention_kv_fp8(q, k, v, key_mask, q_start, 0.25, scales)
    expected = attention_ref(q, dequantize_kv(k, scales[0]), dequantize_kv(v, scales[1]), key_mask, q_start, 0.25)
    assert torch.equal(ours, expected)
    assert torch.equal(ops.attention(q, k, v, key_mask, q_start, 0.25, kv_scale=scales), expected)
    # and close to attention on the unquantized k, v: e4m3's error, not a wrong scale or layout (SQNR over 1,500 draws
    # of these sizes: 23.0 dB at the least, 29.7 the median; a wrong scale or layout is near 0)
    exact = attention_ref(q, k32, v32, key_mask, q_start, 0.25)
    assert sqnr_db(exact, ours) >= 20


def test_rope_append_fp8_is_rotation_then_fp8_append(device):
    b, s, h, hkv, d, t = 2, 3, 4, 2, 16, 7
    qkv = torch.randn(b, s, (h + 2 * hkv) * d, device=device)
    cos, sin = _rope(b, s, d, device=device)
    slots = torch.tensor([4, 5, 6], device=device)
    kc, vc = _caches(b, hkv, t, d, device)
    scales = torch.zeros(2, hkv, device=device)
    q = ops.qkv_rope_append(qkv, cos, sin, h, hkv, kc, vc, slots, scales, calibrate=True)
    q_ref, k_ref, v_ref = ops.qkv_rope(qkv, cos, sin, h, hkv)  # (the device's rotation: the kernel on CUDA)
    assert torch.equal(q, q_ref) and torch.equal(scales, kv_scales_from(k_ref, v_ref))
    assert torch.equal(kc[:, :, 4:].view(torch.uint8), quantize_kv(k_ref, scales[0]).view(torch.uint8))
    kc2, vc2 = _caches(b, hkv, t, d, device)
    q2 = ops.qkv_rope_append(qkv, cos, sin, h, hkv, kc2, vc2, slots, scales)  # kept scales: the same bytes
    assert torch.equal(q2, q_ref) and torch.equal(kc2.view(torch.uint8), kc.view(torch.uint8))
    assert torch.equal(vc2.view(torch.uint8), vc.view(torch.uint8))


# ---- bad input ----

def test_scales_missing_or_misshaped_are_one_clear_error():
    kc, vc = _caches(1, 2, 4, 8)
    k = torch.randn(1, 2, 1, 8)
    slots = torch.tensor([0])
    for bad in (None, torch.ones(2, 3), torch.ones(2, 2, dtype=torch.float16), torch.ones(2)):
        with pytest.raises(FuseInferError, match=r"needs kv_scale, a \(2, 2\) float32 tensor"):
            kv_cache_append_fp8(kc, vc, k, k, slots, bad)
        with pytest.raises(FuseInferError, match="needs kv_scale"):
            ops.attention(torch.randn(1, 2, 1, 8), kc, vc, kv_scale=bad)
    with pytest.raises(FuseInferError, match="float8_e4m3fn"):
        kv_cache_append_fp8(kc.float(), vc.float(), k, k, slots, torch.ones(2, 2))
    with pytest.raises(FuseInferError, match="float8_e4m3fn"):
        attention_kv_fp8(torch.randn(1, 2, 1, 8), kc.float(), vc, kv_scale=torch.ones(2, 2))


# ---- the registrations ----

def _append_args(device, dtype=torch.float32, d=64, hkv=2):
    k = torch.randn(2, 3, 3, hkv, d, dtype=dtype, device=device).unbind(1)[1].transpose(1, 2)  # a strided view
    v = torch.randn(2, hkv, 3, d, dtype=dtype, device=device)
    kc, vc = _caches(2, hkv, 9, d, device)
    return kc, vc, k, v, torch.tensor([8, 2, 5], device=device), kv_scales_from(k, v)


def _rope_args(device, dtype=torch.float32, d=64, h=4, hkv=2):
    cos, sin = _rope(2, 3, d, dtype, device)
    qkv = torch.randn(2, 3, (h + 2 * hkv) * d, dtype=dtype, device=device)
    kc, vc = _caches(2, hkv, 9, d, device)
    return qkv, cos, sin, h, hkv, kc, vc, torch.tensor([1, 2, 3], device=device), torch.full((2, hkv), 0.05,
                                                                                           device=device)


def _attention_args(device, dtype=torch.float32, d=64, h=4, hkv=2, sq=1, skv=37):
    q = torch.randn(2, h, sq, d, dtype=dtype, device=device)
    k32, v32 = torch.randn(2, hkv, skv, d, device=device), torch.randn(2, hkv, skv, d, device=device)
    scales = kv_scales_from(k32, v32)
    key_mask = torch.ones(2, skv, dtype=torch.bool, device=device)
    key_mask[1, :3] = False
    q_start = torch.tensor([skv - sq, skv - sq - 4], dtype=torch.int32, device=device)
    return q, quantize_kv(k32, scales[0]), quantize_kv(v32, scales[1]), key_mask, q_start, d ** -0.5, scales


# opcheck's test_schema compares the arguments before and after the call with ops that have no float8 kernel
# (mul on e4m3 fails inside it): the other checks run, and the mutations are checked by hand below
OPCHECKS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    dtype = torch.float32 if device == "cpu" else torch.float16
    torch.library.opcheck(torch.ops.fuseinfer.kv_cache_append_fp8.default, _append_args(device, dtype),
                          test_utils=OPCHECKS)
    torch.library.opcheck(torch.ops.fuseinfer.qkv_rope_append_fp8.default, _rope_args(device, dtype),
                          test_utils=OPCHECKS)
    for sq in (1, 20):  # the split-KV kernel, and a prefill (dequantized) on CUDA
        torch.library.opcheck(torch.ops.fuseinfer.attention_kv_fp8.default, _attention_args(device, dtype, sq=sq),
                              test_utils=OPCHECKS)


@pytest.mark.parametrize("device", DEVICES)
def test_the_ops_mutate_only_what_their_schemas_say(device):
    """What test_schema would check: the appends write their caches only, the attention nothing."""
    dtype = torch.float32 if device == "cpu" else torch.float16
    for op, args, mutated in ((torch.ops.fuseinfer.kv_cache_append_fp8, _append_args(device, dtype), (0, 1)),
                              (torch.ops.fuseinfer.qkv_rope_append_fp8, _rope_args(device, dtype), (5, 6)),
                              (torch.ops.fuseinfer.attention_kv_fp8, _attention_args(device, dtype), ())):
        before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        op(*args)
        for i, (a, b) in enumerate(zip(args, before)):
            if isinstance(a, torch.Tensor):
                same = torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == FP8_DTYPE \
                    else torch.equal(a, b)
                assert same != (i in mutated), (op, i)


# ---- the CUDA kernels ----

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128, 96, 40, 6])  # (6: one element per thread)
def test_append_kernel_is_byte_exact(dtype, d):
    require_kernel()
    kc, vc, k, v, slots, scales = _append_args("cuda", dtype, d=d, hkv=3)
    k, v = k * 40, v * 0.01  # far from 1: the scales matter
    scales = kv_scales_from(k, v) * torch.tensor([[1.0], [0.25]], device="cuda")  # values saturate
    expected = [c.clone() for c in (kc, vc)]
    kv_cache_append_fp8_ref(*expected, k, v, slots, scales)
    kv_cache_append_fp8(kc, vc, k, v, torch.cat([slots[:2], torch.tensor([99], device="cuda")]), scales)
    ref_first = [e.clone() for e in expected]
    assert torch.equal(kc[:, :, slots[:2]].view(torch.uint8), ref_first[0][:, :, slots[:2]].view(torch.uint8))
    assert torch.equal(vc[:, :, slots[:2]].view(torch.uint8), ref_first[1][:, :, slots[:2]].view(torch.uint8))
    assert kc[:, :, slots[2]].float().eq(0).all()  # slot 99 is outside the cache: skipped, nothing written
    kv_cache_append_fp8(kc, vc, k, v, slots, scales)
    assert torch.equal(kc.view(torch.uint8), expected[0].view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), expected[1].view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d, h, hkv", [(64, 4, 2), (128, 8, 1), (64, 3, 3), (128, 2, 2), (6, 2, 1), (36, 4, 2)])
def test_rope_append_kernel_is_the_rotary_kernel_then_the_reference_quantization(dtype, d, h, hkv):
    """q equals the plain rotary kernel's; the cache bytes are quantize_kv of its rotated k and v (the append kernel
    divides correctly rounded, rounds to nearest even and saturates, as the reference), and within one e4m3 step of
    the rotation done in fp32 and rounded to the dtype."""
    require_kernel()
    qkv, cos, sin, _, _, kc, vc, slots, scales = _rope_args("cuda", dtype, d=d, h=h, hkv=hkv)
    scales[1] *= 0.05  # the values saturate
    q_plain, k_plain, v_plain = ops.qkv_rope(qkv, cos, sin, h, hkv)  # the fp16 / bf16 kernel
    q = ops.qkv_rope_append(qkv, cos, sin, h, hkv, kc, vc, slots, scales)
    assert torch.equal(q, q_plain)
    _, exact_k, exact_v = qkv_rope_ref(qkv.float(), cos.float(), sin.float(), h, hkv)
    for ours, plain, s in ((kc, k_plain, scales[0]), (vc, v_plain, scales[1])):
        assert torch.equal(ours[:, :, slots].view(torch.uint8), quantize_kv(plain, s).view(torch.uint8))
        assert ours[:, :, :1].float().eq(0).all() and ours[:, :, 4:].float().eq(0).all()  # other slots untouched
        # against the rotation in fp32 rounded to the dtype (the reference rotates in the dtype, op by op: in bf16
        # its own rounding can exceed an e4m3 step where x cos and rotate_half(x) sin cancel)
        exact = exact_k if ours is kc else exact_v  # (B, Hkv, S, D)
        a, r = dequantize_kv(ours[:, :, slots], s), dequantize_kv(quantize_kv(exact.to(dtype), s), s)
        assert ((a - r).abs() <= 2 * E4M3_REL * r.abs() + 2 * E4M3_SUB * s.view(1, -1, 1, 1) + 1e-6).all()


ATTN_CASES = [  # (B, H, Hkv, Sq, Skv, D)
    (1, 4, 4, 1, 1, 64), (3, 8, 2, 1, 77, 64), (2, 12, 12, 1, 513, 64), (2, 32, 8, 1, 2049, 128),
    (1, 16, 2, 3, 300, 128), (5, 4, 1, 16, 131, 64), (2, 6, 3, 40, 200, 128),  # last: a prefill (dequantized)
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ATTN_CASES, ids=str)
def test_attention_kernel_against_the_reference(case, dtype):
    """|ours - ref32| <= 2 |torch in dtype - ref32| + atol, ref32 the fp32 reference on the dequantized cache and
    'torch in dtype' PyTorch attention on that cache dequantized to the dtype."""
    _check_attention_kernel(case, dtype)


# Every block shape of the decode kernel: 1 and 2 rows per block (16-byte loads of 16 e4m3 per thread; scores on
# tensor cores at head dim 64), 4 and 8 (8-byte loads of 8), rows from grouped query heads or from queries; odd
# context lengths, contexts shorter than one block iteration, and grids of several waves of resident blocks (the
# split count then fills the last wave).
DECODE_CASES = [  # (B, H, Hkv, Sq, Skv, D); rows per key/value head = H / Hkv * Sq
    (3, 5, 5, 1, 1001, 64), (2, 3, 3, 1, 257, 128), (1, 2, 2, 1, 31, 128), (2, 2, 2, 1, 7, 64),  # 1 row
    (2, 8, 4, 1, 333, 64), (1, 4, 4, 2, 517, 128), (2, 6, 3, 1, 95, 128), (3, 2, 1, 1, 130, 64),  # 2 rows
    (2, 8, 2, 1, 211, 128), (1, 3, 3, 3, 77, 64),  # 3 or 4 rows
    (1, 14, 2, 1, 403, 64), (2, 4, 2, 5, 129, 128),  # 7 rows, 10 rows (two chunks of 8)
    (24, 32, 32, 1, 1029, 64), (8, 32, 8, 1, 2050, 128), (40, 16, 16, 1, 515, 128),  # several waves
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
def test_decode_kernel_every_block_shape_against_the_reference(case, dtype):
    _check_attention_kernel(case, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("q_factor", [1e-6, 3e3, 1e6])
@pytest.mark.parametrize("case", [(2, 4, 4, 1, 301, 64), (2, 4, 2, 1, 301, 64), (2, 4, 4, 1, 301, 128)], ids=str)
def test_decode_kernel_takes_queries_of_any_magnitude(case, dtype, q_factor):
    """Tiny queries (fp16 subnormals: a near-uniform softmax), large ones (one key takes it all) and, in bf16,
    queries past fp16's range: the tensor-core scores take fp16 queries, bf16 ones scaled by a power of two."""
    if dtype == torch.float16 and q_factor > 1e4:
        pytest.skip("beyond float16's range")
    _check_attention_kernel(case, dtype, q_factor)


def _check_attention_kernel(case, dtype, q_factor=1.0):
    require_kernel()
    b, h, hkv, sq, skv, d = case
    g = torch.Generator(device="cuda").manual_seed(sum(case))
    q = (torch.randn(b, h, sq, d, device="cuda", generator=g) * q_factor).to(dtype)
    k32 = torch.randn(b, hkv, skv, d, device="cuda", generator=g) * 3
    v32 = torch.randn(b, hkv, skv, d, device="cuda", generator=g) * 0.3
    scales = kv_scales_from(k32, v32)
    k, v = quantize_kv(k32, scales[0]), quantize_kv(v32, scales[1])
    key_mask = torch.rand(b, skv, device="cuda", generator=g) > 0.1
    key_mask[:, -1] = True
    q_start = (skv - sq - torch.arange(b, device="cuda") % 3).clamp_min(0).int()
    scale = d ** -0.5
    ours = attention_kv_fp8(q, k, v, key_mask, q_start, scale, scales)
    ref32 = attention_kv_fp8_ref(q.float(), k, v, key_mask, q_start, scale, scales)
    kd, vd = (x.repeat_interleave(h // hkv, dim=1) for x in (dequantize_kv(k, scales[0], dtype),
                                                              dequantize_kv(v, scales[1], dtype)))
    allowed = _allowed(key_mask, q_start, b, sq, skv)  # (B, 1, Sq, Skv)
    torch_lowp = torch.nn.functional.scaled_dot_product_attention(q, kd, vd, attn_mask=allowed,
                                                                  scale=scale).transpose(1, 2)  # (B, Sq, H, D)
    has_key = allowed.any(-1).view(b, sq, 1, 1).expand_as(ours)  # (B, Sq, H, D)
    assert_lowp_close(ours[has_key], torch_lowp[has_key], ref32[has_key], str(case), lowp_atol(ref32, dtype))
    assert ours[~has_key].eq(0).all()


def _allowed(key_mask, q_start, b, sq, skv):
    from fuseinfer.ops.attention import allowed_mask

    return allowed_mask(key_mask, q_start, b, sq, skv, key_mask.device)  # (B, 1, Sq, Skv)


@pytest.mark.gpu
def test_decode_kernel_replays_in_a_cuda_graph_and_reads_new_scales():
    """Captured once, the decode attention reads the scales' current values at each replay (a new prompt's
    calibration changes them in place)."""
    require_kernel()
    q, k, v, key_mask, q_start, scale, scales = _attention_args("cuda", torch.float16, d=128, h=8, hkv=2, skv=300)
    out = attention_kv_fp8(q, k, v, key_mask, q_start, scale, scales)  # (warm-up)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention_kv_fp8(q, k, v, key_mask, q_start, scale, scales)
    for factor in (1.0, 0.5):
        scales.mul_(factor)
        graph.replay()
        torch.cuda.synchronize()
        ref = attention_kv_fp8_ref(q.float(), k, v, key_mask, q_start, scale, scales)
        assert (out.float() - ref).abs().max() < 2e-2
