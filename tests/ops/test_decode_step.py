"""fuseinfer::opt_decode_step (fuseinfer/ops/decode_step.py): the reference against the per-op decode path (CPU),
the op's registration (opcheck), property tests against the reference (hypothesis: random model sizes, batch rows,
padding and slots) on every device, and on the GPU the one-kernel step against the fp32 reference and inside fast
decode (the RuntimeConfig.decode_kernel choice)."""
from __future__ import annotations

import pytest
import torch
from conftest import random_opt
from helpers import (DEVICES, LOWP, assert_fp8_cache_tokens_agree, assert_fp8_step, assert_lowp_close,
                     assert_step_within_rule, assume, examples, generate_decode_kernel_off_on, given, lowp_atol, st,
                     step_args_in, step_cache_copy, with_fp8_caches)

import fuseinfer
from fuseinfer.ops import opt_decode_step, opt_decode_step_ref
from fuseinfer.ops.decode_step import AUTO_MAX_ROWS, decode_step_workspace, kernel_supports
from fuseinfer.models.opt.decode import decode_step_params, decode_step_weight_scales, forward_last_logits
from fuseinfer.ops.kv_cache import FP8_DTYPE
from fuseinfer.runtime.cache import StaticKVCache
from fuseinfer.runtime.decode import SESSIONS_ATTR


def _step_inputs(model, pads, q_start, capacity, seed=1):
    """Inputs of one decode step of a patched ``model``: caches of random k/v, left padding ``pads`` per row,
    the new token of row b at slot ``q_start[b]`` -> dict of the op's arguments (caches fresh, owned)."""
    cfg, dec = model.config, model.model.decoder
    embed = dec.embed_tokens.weight
    rows, heads = len(pads), cfg.num_attention_heads
    d = cfg.hidden_size // heads
    g = torch.Generator().manual_seed(seed)
    caches = [torch.randn(rows, heads, capacity, d, generator=g).to(embed) for _ in range(2 * cfg.num_hidden_layers)]
    key_mask = torch.ones(rows, capacity, dtype=torch.bool)
    for b, pad in enumerate(pads):
        key_mask[b, :pad] = False
    q_start_t = torch.tensor(q_start, dtype=torch.int32)
    args = dict(
        tokens=torch.randint(3, cfg.vocab_size, (rows, 1), generator=g).to(embed.device),
        positions=(q_start_t - torch.tensor(pads, dtype=torch.int32)).long()[:, None].to(embed.device),
        q_start=q_start_t.to(embed.device), key_mask=key_mask.to(embed.device), embed=embed,
        pos_embed=dec.embed_positions.weight, layer_params=decode_step_params(model),
        k_caches=caches[0::2], v_caches=caches[1::2], lnf_w=dec.final_layer_norm.weight,
        lnf_b=dec.final_layer_norm.bias, lm_head=model.lm_head.weight,
        workspace=decode_step_workspace(rows, cfg.hidden_size, cfg.ffn_dim, heads, d, capacity, embed.device),
        eps=dec.layers[0].self_attn_layer_norm.eps, scale=d ** -0.5,
        weight_scales=decode_step_weight_scales(model),  # [] unless the model is int8 weight-only
        kv_scales=[])  # (caches in the model dtype)
    args["layer_params"] = [p.detach() for p in args["layer_params"]]  # no autograd (opcheck would test it)
    return {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}


@torch.no_grad()
def test_reference_equals_per_op_decode_path():
    """The reference step and the patched modules (forward_last_logits over a StaticKVCache) agree on CPU."""
    model = random_opt(hidden_size=64, num_attention_heads=2, ffn_dim=96, num_hidden_layers=3)
    fuseinfer.patch(model)
    args = _step_inputs(model, pads=[0, 3], q_start=[9, 9], capacity=16)
    cfg = model.config
    cache = StaticKVCache(cfg.num_hidden_layers, 2, 2, 32, 16, torch.float32, torch.device("cpu"))
    cache.keys = [c.clone() for c in args["k_caches"]]
    cache.values = [c.clone() for c in args["v_caches"]]
    cache.key_mask = args["key_mask"]
    cache.write_idx = torch.tensor([9])
    per_op = forward_last_logits(model, args["tokens"], args["positions"], cache, args["q_start"])
    ref = opt_decode_step_ref(**args)
    torch.testing.assert_close(ref, per_op, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(args["k_caches"] + args["v_caches"], cache.keys + cache.values):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_opcheck_cpu():
    model = random_opt(hidden_size=64, num_attention_heads=2, ffn_dim=96, num_hidden_layers=2)
    fuseinfer.patch(model)
    args = _step_inputs(model, pads=[0, 2, 5], q_start=[7, 7, 7], capacity=12)
    torch.library.opcheck(torch.ops.fuseinfer.opt_decode_step.default, tuple(args.values()))


def test_wrong_parameter_count_is_one_clear_error():
    model = random_opt(num_hidden_layers=2)
    fuseinfer.patch(model)
    args = _step_inputs(model, pads=[0], q_start=[3], capacity=8)
    args["layer_params"] = args["layer_params"][:-1]
    with pytest.raises(fuseinfer.FuseInferError, match="12 parameters and a k and v cache per layer"):
        opt_decode_step(**args)


# ---- property tests against the reference (hypothesis) ----

def _random_step_args(rows, hidden, heads, ffn, layers, vocab, capacity, pads, q_start, device, dtype=torch.float32):
    """The op's arguments for a random pre-LN OPT (no model built): weights scaled by fan-in, LayerNorms near
    (1, 0), caches of random keys and values, row b's new token at slot ``q_start[b]`` after ``pads[b]`` pads."""
    d = hidden // heads
    rand = lambda *s, scale=1.0: (torch.randn(*s) * scale).to(device=device, dtype=dtype)  # noqa: E731
    ln = lambda: (1 + 0.1 * torch.randn(hidden)).to(device=device, dtype=dtype)  # noqa: E731
    params = []
    for _ in range(layers):
        params += [ln(), rand(hidden, scale=0.1), rand(3 * hidden, hidden, scale=hidden ** -0.5),
                   rand(3 * hidden, scale=0.1), rand(hidden, hidden, scale=hidden ** -0.5), rand(hidden, scale=0.1),
                   ln(), rand(hidden, scale=0.1), rand(ffn, hidden, scale=hidden ** -0.5), rand(ffn, scale=0.1),
                   rand(hidden, ffn, scale=ffn ** -0.5), rand(hidden, scale=0.1)]
    key_mask = torch.arange(capacity)[None] >= torch.tensor(pads)[:, None]  # (B, T)
    q_start_t = torch.tensor(q_start, dtype=torch.int32)
    return dict(
        tokens=torch.randint(0, vocab, (rows, 1)).to(device),
        positions=(q_start_t - torch.tensor(pads, dtype=torch.int32)).long()[:, None].to(device),
        q_start=q_start_t.to(device), key_mask=key_mask.to(device), embed=rand(vocab, hidden),
        pos_embed=rand(capacity + 2, hidden), layer_params=params,
        k_caches=[rand(rows, heads, capacity, d) for _ in range(layers)],
        v_caches=[rand(rows, heads, capacity, d) for _ in range(layers)],
        lnf_w=ln(), lnf_b=rand(hidden, scale=0.1), lm_head=rand(vocab, hidden, scale=hidden ** -0.5),
        workspace=decode_step_workspace(rows, hidden, ffn, heads, d, capacity, device), eps=1e-5, scale=d ** -0.5)


@st.composite
def step_cases(draw, device):
    """(OPT sizes, rows, pads, q_start, capacity, dtype): on the CPU any head count and size (odd ones too); on CUDA
    the kernel's domain (head dim 64 or 128, hidden and ffn multiples of 32, 1-8 rows), fp16 / bf16. Rows have
    their own padding and slot (the first token of a row at slot 0, a row whose slot is the cache's last)."""
    seed = draw(st.integers(0, 2**32 - 1))
    if device == "cpu":
        heads, d = draw(st.integers(1, 4)), draw(st.integers(1, 24))
        ffn = draw(st.integers(1, 100))
        rows = draw(st.integers(1, 5))
        dtype = draw(st.sampled_from([torch.float32, *LOWP]))
    else:
        heads, d = draw(st.integers(1, 8)), draw(st.sampled_from([64, 128]))
        ffn = 32 * draw(st.integers(1, 64))
        rows = draw(st.integers(1, 8))
        dtype = draw(st.sampled_from(LOWP))
    # vocabularies of 64 and more on CUDA: the dtype rule compares maximum errors, and over a handful of logits
    # PyTorch's can fall below one rounding step of ours (drawn: 4 bf16 logits, 0.0142 against 0.0035; the Llama
    # step's test_kernel_tiny_vocabulary_within_rule keeps such a case as a strict xfail)
    layers, vocab = draw(st.integers(1, 3)), draw(st.integers(4 if device == "cpu" else 64, 700))
    capacity = draw(st.integers(1, 64 if device == "cpu" else 1200))
    q_start = draw(st.lists(st.integers(0, capacity - 1), min_size=rows, max_size=rows))
    pads = [draw(st.integers(0, s)) for s in q_start]  # a row's new token is never padding
    return dict(rows=rows, hidden=heads * d, heads=heads, ffn=ffn, layers=layers, vocab=vocab, capacity=capacity,
                pads=pads, q_start=q_start), dtype, seed


@pytest.mark.parametrize("device", DEVICES)
def test_decode_step_matches_reference_property(device):
    """Logits and every written cache slot within the dtype rule of the reference run in higher precision (on
    CUDA: the one-kernel step, which the case must select)."""
    @examples(device, cpu=10, cuda=60)
    @given(case=step_cases(device))
    def check(case):
        sizes, dtype, seed = case
        torch.manual_seed(seed)
        args = _random_step_args(**sizes, device=device, dtype=dtype)
        if device == "cuda":
            assume(kernel_supports(sizes["rows"], args["embed"], sizes["ffn"], sizes["hidden"] // sizes["heads"]))
        hi = torch.float64 if dtype == torch.float32 else torch.float32
        ref_args, same_args = step_args_in(args, hi), step_args_in(args, dtype)
        ref = opt_decode_step_ref(**ref_args)
        torch_same = opt_decode_step_ref(**same_args)
        ours = opt_decode_step(**args)
        assert ours.shape == (sizes["rows"], sizes["vocab"]) and ours.dtype == torch.float32
        assert_lowp_close(ours, torch_same, ref, f"logits {sizes} {dtype}", lowp_atol(ref, dtype))
        for i, (o, r, s) in enumerate(zip(args["k_caches"] + args["v_caches"], ref_args["k_caches"] +
                                          ref_args["v_caches"], same_args["k_caches"] + same_args["v_caches"])):
            assert_lowp_close(o, s, r, f"cache {i} {sizes} {dtype}", lowp_atol(r, dtype))
    check()


@examples("cpu", cpu=6, cuda=0)
@given(case=step_cases("cpu"))
def test_reference_equals_per_op_decode_path_property(case):
    """The reference step and the patched modules (forward_last_logits over a StaticKVCache) agree on CPU, in
    fp32, for random model sizes, rows, padding and slots."""
    sizes, _, seed = case
    rows, heads, layers = sizes["rows"], sizes["heads"], sizes["layers"]
    model = random_opt(seed=seed % 1000, hidden_size=sizes["hidden"], num_attention_heads=heads,
                       ffn_dim=sizes["ffn"], num_hidden_layers=layers, vocab_size=sizes["vocab"])
    fuseinfer.patch(model)
    slot = sizes["q_start"][0]  # forward_last_logits' cache has one write slot for all rows
    pads = [min(p, slot) for p in sizes["pads"]]
    args = _step_inputs(model, pads, [slot] * rows, sizes["capacity"], seed=seed % 1000)
    cache = StaticKVCache(layers, rows, heads, sizes["hidden"] // heads, sizes["capacity"], torch.float32,
                          torch.device("cpu"))
    cache.keys = [c.clone() for c in args["k_caches"]]
    cache.values = [c.clone() for c in args["v_caches"]]
    cache.key_mask = args["key_mask"]
    cache.write_idx = torch.tensor([slot])
    with torch.no_grad():
        per_op = forward_last_logits(model, args["tokens"], args["positions"], cache, args["q_start"])
        ref = opt_decode_step_ref(**args)
    torch.testing.assert_close(ref, per_op, rtol=1e-4, atol=1e-4)
    for ours, theirs in zip(args["k_caches"] + args["v_caches"], cache.keys + cache.values):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


# ---- GPU: the one-kernel step ----

GPU_CASES = {  # name -> (OPTConfig overrides, pads, q_start, capacity)
    "b1_ctx300_d64": (dict(hidden_size=512, num_attention_heads=8, ffn_dim=2048), [0], [299], 384),
    "b3_padded_d128_odd_len": (dict(hidden_size=512, num_attention_heads=4, ffn_dim=1536), [0, 17, 40],
                               [112, 112, 112], 128),
    "b8_ragged_q_start": (dict(hidden_size=256, num_attention_heads=4, ffn_dim=1024),
                          [0, 1, 2, 3, 0, 9, 31, 60], [64, 64, 70, 64, 33, 64, 64, 100], 128),
    "b2_first_token": (dict(hidden_size=256, num_attention_heads=4, ffn_dim=1024), [0, 0], [0, 0], 128),
    # the attention merge takes 32 (d64) or 16 (d128) slices of 32 keys per L2 round trip: several groups, and
    # (row 1 of the d128 case) a leading group whose keys are all masked
    "b1_ctx1100_d64_2_merge_groups": (dict(hidden_size=256, num_attention_heads=4, ffn_dim=1024), [0], [1099], 1152),
    "b2_ctx1500_d128_3_merge_groups": (dict(hidden_size=512, num_attention_heads=4, ffn_dim=1024), [0, 600],
                                       [1500, 1500], 1536),
}


def _assert_step_within_rule(args: dict, dtype) -> torch.Tensor:
    return assert_step_within_rule(opt_decode_step, opt_decode_step_ref, args, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_matches_fp32_reference(case, dtype):
    overrides, pads, q_start, capacity = GPU_CASES[case]
    model = random_opt(device="cuda", dtype=dtype, num_hidden_layers=3, vocab_size=4000,
                       max_position_embeddings=2048, **overrides)
    fuseinfer.patch(model)
    args = _step_inputs(model, pads, q_start, capacity)
    assert kernel_supports(len(pads), args["embed"], overrides["ffn_dim"], args["k_caches"][0].shape[-1])
    ours = _assert_step_within_rule(args, dtype)
    for _ in range(4):  # the launch counters, attention counters and tagged buffers carry over between launches
        assert torch.equal(opt_decode_step(**args), ours)


@pytest.mark.gpu
def test_opcheck_cuda():
    model = random_opt(device="cuda", dtype=torch.float16, hidden_size=256, num_attention_heads=4, ffn_dim=512)
    fuseinfer.patch(model)
    args = _step_inputs(model, pads=[0, 2, 5], q_start=[20, 20, 20], capacity=64)
    torch.library.opcheck(torch.ops.fuseinfer.opt_decode_step.default, tuple(args.values()))


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["on", "off", "auto"])
def test_fast_decode_path_and_tokens(tiny_model_path, kernel):
    """RuntimeConfig.decode_kernel picks the step: on the one-kernel step wherever it applies (batch buckets up to
    8), off never, auto (the default) up to AUTO_MAX_ROWS rows; beyond the kernel (10 rows, bucket 16) the step is
    per op whatever the setting. Every path gives HF's greedy tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float16).cuda().eval()
    ids = torch.randint(3, 8192, (5, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :7] = mask[3, :20] = 0
    ids = ids.masked_fill(mask == 0, model.config.pad_token_id)
    kwargs = dict(max_new_tokens=48, min_new_tokens=48, do_sample=False)
    ref = model.generate(ids, attention_mask=mask, **kwargs)
    ref_one = model.generate(ids[:1], **kwargs)
    fuseinfer.patch(model, fuseinfer.PatchConfig(runtime=fuseinfer.RuntimeConfig(decode_kernel=kernel)))
    assert torch.equal(fuseinfer.generate(model, ids, mask, max_new_tokens=48), ref)
    assert torch.equal(fuseinfer.generate(model, ids[:1], max_new_tokens=48), ref_one)
    sessions = model.__dict__[SESSIONS_ATTR]
    expect_kernel = {1: kernel != "off", 8: kernel == "on" or (kernel == "auto" and AUTO_MAX_ROWS >= 8)}
    for bucket, on in expect_kernel.items():
        assert sessions[bucket].path.startswith("one kernel" if on else "per op"), (bucket, sessions[bucket].path)
    if kernel == "off":
        assert "RuntimeConfig(decode_kernel='off')" in sessions[8].path
    big = torch.cat([ids, ids])  # 10 rows: bucket 16, beyond the kernel
    fuseinfer.generate(model, big, torch.cat([mask, mask]), max_new_tokens=2)
    assert sessions[16].path.startswith("per op"), sessions[16].path


def test_bad_decode_kernel_setting_is_one_clear_error(monkeypatch):
    """A bad FUSEINFER_DECODE_KERNEL is an error naming it when a config takes its default from it (patch)."""
    model = random_opt(hidden_size=64, num_attention_heads=2, ffn_dim=96, num_hidden_layers=1).eval()
    monkeypatch.setenv("FUSEINFER_DECODE_KERNEL", "yes")
    with pytest.raises(fuseinfer.FuseInferError, match="FUSEINFER_DECODE_KERNEL must be one of auto, 0, 1"):
        fuseinfer.patch(model)
    fuseinfer.patch(model, fuseinfer.PatchConfig(runtime=fuseinfer.RuntimeConfig(decode_kernel="on")))  # explicit
    assert fuseinfer.generate(model, torch.tensor([[5, 6, 7]]), max_new_tokens=2).shape == (1, 5)


# ---- int8 weight-only models (Int8WeightOnly): the step with int8 weights and per-channel scales ----

INT8 = fuseinfer.PatchConfig(quant=fuseinfer.Int8WeightOnly())


def _int8_stub_cache(rows, capacity=32):
    """What decode_step_kernel reads of a cache before it builds the step: the key mask's shape."""
    from types import SimpleNamespace

    return SimpleNamespace(key_mask=torch.ones(rows, capacity, dtype=torch.bool))


@torch.no_grad()
def test_int8_reference_equals_per_op_int8_decode_path(tiny_model_path):
    """The int8 reference step and the patched int8 modules (forward_last_logits) agree on CPU, logits and caches,
    on the trained tiny model in fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    fuseinfer.patch(model, INT8)
    args = _step_inputs(model, pads=[0, 5], q_start=[20, 20], capacity=24)
    assert len(args["weight_scales"]) == 4 * model.config.num_hidden_layers
    assert all(args["layer_params"][12 * i + j].dtype == torch.int8 for i in range(4) for j in (2, 4, 8, 10))
    cfg = model.config
    cache = StaticKVCache(cfg.num_hidden_layers, 2, cfg.num_attention_heads, 64, 24, torch.float32,
                          torch.device("cpu"))
    cache.keys = [c.clone() for c in args["k_caches"]]
    cache.values = [c.clone() for c in args["v_caches"]]
    cache.key_mask = args["key_mask"]
    cache.write_idx = torch.tensor([20])
    per_op = forward_last_logits(model, args["tokens"], args["positions"], cache, args["q_start"])
    ref = opt_decode_step_ref(**args)
    torch.testing.assert_close(ref, per_op, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(args["k_caches"] + args["v_caches"], cache.keys + cache.values):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    # and the int8 reference is the fp step run on the dequantized weights (the scales applied once per weight)
    fp_ref = opt_decode_step_ref(**{**args, "weight_scales": [], "layer_params": [
        p if p.dtype != torch.int8 else p.float() * s[:, None]
        for p, s in zip(args["layer_params"], _scales_by_param(args))]})
    torch.testing.assert_close(fp_ref, ref, rtol=1e-4, atol=1e-4)  # dequantized fp32 weights: the same step


def _scales_by_param(args):
    """For each of the step's parameters its int8 scale (or None), aligned with layer_params."""
    scales = iter(args["weight_scales"])
    return [next(scales) if p.dtype == torch.int8 else None for p in args["layer_params"]]


def test_int8_opcheck_cpu():
    model = random_opt(hidden_size=64, num_attention_heads=2, ffn_dim=128, num_hidden_layers=2)
    fuseinfer.patch(model, INT8)
    args = _step_inputs(model, pads=[0, 2, 5], q_start=[7, 7, 7], capacity=12)
    assert len(args["weight_scales"]) == 8
    torch.library.opcheck(torch.ops.fuseinfer.opt_decode_step.default, tuple(args.values()))


def test_int8_bad_scales_are_one_clear_error():
    model = random_opt(hidden_size=64, num_attention_heads=2, ffn_dim=128, num_hidden_layers=2)
    fuseinfer.patch(model, INT8)
    args = _step_inputs(model, pads=[0], q_start=[3], capacity=8)
    with pytest.raises(fuseinfer.FuseInferError, match="expected 4 weight scales per layer"):
        opt_decode_step(**{**args, "weight_scales": args["weight_scales"][:-1]})
    bad = list(args["weight_scales"])
    bad[1] = bad[1].half()
    with pytest.raises(fuseinfer.FuseInferError, match="layer 0 parameter 4 must be an int8"):
        opt_decode_step(**{**args, "weight_scales": bad})


def test_decode_step_kernel_takes_int8_weight_only_models():
    """decode_step_kernel no longer refuses Int8WeightOnly: on this CPU it stops at the kernel check (no extension),
    not at the quantization; the LM head quantized, or a layer left unquantized, are refused with the reason."""
    from fuseinfer.models.opt.decode import _int8_unsupported, decode_step_kernel

    model = random_opt(hidden_size=64, num_attention_heads=2, ffn_dim=128, num_hidden_layers=2)
    fuseinfer.patch(model, INT8)
    step, why = decode_step_kernel(model, _int8_stub_cache(1))
    assert step is None and why.startswith("no kernel") and "multiples of 64" in why
    assert _int8_unsupported(model, fuseinfer.patch_state(model).config.quant) is None
    assert "object runs per op" in _int8_unsupported(model, object())  # another scheme (e.g. W8A8)

    head = random_opt(hidden_size=64, num_attention_heads=2, ffn_dim=128, num_hidden_layers=2)
    fuseinfer.patch(head, fuseinfer.PatchConfig(quant=fuseinfer.Int8WeightOnly(include_lm_head=True)))
    assert "include_lm_head=False" in decode_step_kernel(head, _int8_stub_cache(1))[1]

    part = random_opt(hidden_size=64, num_attention_heads=2, ffn_dim=128, num_hidden_layers=2)
    fuseinfer.patch(part, fuseinfer.PatchConfig(quant=fuseinfer.Int8WeightOnly(),
                                                filter_fn=lambda m, name: "layers.1" not in name))
    assert "layer 1's self_attn.qkv_proj is not a quantized linear" in decode_step_kernel(part, _int8_stub_cache(1))[1]


def test_auto_takes_the_int8_step_only_up_to_its_measured_hidden_size(monkeypatch):
    """decode_kernel='auto' sends int8 weight-only models wider than AUTO_INT8_MAX_HIDDEN per op (measured slower
    there), saying why; decode_kernel='on' still tries the kernel; fp16 models are not affected."""
    from fuseinfer.ops import decode_step as decode_step_op
    from fuseinfer.models.opt.decode import decode_step_kernel

    model = random_opt(hidden_size=64, num_attention_heads=2, ffn_dim=128, num_hidden_layers=2)
    fuseinfer.patch(model, INT8)
    monkeypatch.setattr(decode_step_op, "AUTO_INT8_MAX_HIDDEN", 32)
    assert "slower than per op above hidden size 32" in decode_step_kernel(model, _int8_stub_cache(1))[1]
    with fuseinfer.runtime.using_runtime(model, decode_kernel="on"):
        assert decode_step_kernel(model, _int8_stub_cache(1))[1].startswith("no kernel")
    fp = random_opt(hidden_size=64, num_attention_heads=2, ffn_dim=128, num_hidden_layers=2)
    fuseinfer.patch(fp)
    assert decode_step_kernel(fp, _int8_stub_cache(1))[1].startswith("no kernel")


INT8_GPU_CASES = {  # hidden and ffn multiples of 64 (the int8 k-step)
    "b1_d64": (dict(hidden_size=256, num_attention_heads=4, ffn_dim=1024), [0], [40], 64),
    "b3_d64_pad": (dict(hidden_size=512, num_attention_heads=8, ffn_dim=1536), [0, 9, 30], [70, 70, 50], 96),
    "b2_d128_long": (dict(hidden_size=512, num_attention_heads=4, ffn_dim=2048), [0, 600], [1100, 1500], 1536),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(INT8_GPU_CASES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_8bit_kernel_matches_fp32_reference(case, dtype, scheme):
    """The one-kernel step with int8 (Int8WeightOnly) or e4m3 (Float8) weights against the reference in fp32 (the
    same 8-bit weights and scales), within twice the reference's own error in the model dtype; and repeated launches
    give the same logits."""
    overrides, pads, q_start, capacity = INT8_GPU_CASES[case]
    model = random_opt(device="cuda", dtype=dtype, num_hidden_layers=3, vocab_size=4000,
                       max_position_embeddings=2048, **overrides)
    fuseinfer.patch(model, INT8 if scheme == "int8" else fuseinfer.PatchConfig(quant=fuseinfer.Float8()))
    args = _step_inputs(model, pads, q_start, capacity)
    fmt = torch.int8 if scheme == "int8" else torch.float8_e4m3fn
    assert args["weight_scales"] and args["layer_params"][2].dtype == fmt
    assert kernel_supports(len(pads), args["embed"], overrides["ffn_dim"], args["k_caches"][0].shape[-1], int8=True)
    ours = _assert_step_within_rule(args, dtype)
    for _ in range(3):
        assert torch.equal(opt_decode_step(**args), ours)


@pytest.mark.gpu
def test_int8_opcheck_cuda():
    model = random_opt(device="cuda", dtype=torch.float16, hidden_size=256, num_attention_heads=4, ffn_dim=512)
    fuseinfer.patch(model, INT8)
    args = _step_inputs(model, pads=[0, 2, 5], q_start=[20, 20, 20], capacity=64)
    torch.library.opcheck(torch.ops.fuseinfer.opt_decode_step.default, tuple(args.values()))


@pytest.mark.gpu
def test_int8_fast_decode_takes_the_kernel_and_matches_per_op_tokens(tiny_model_path):
    """The trained tiny model in fp16, int8 weight-only: fast decode runs the one-kernel step (batch 1 and a padded
    batch of 5, decode_kernel='on') and gives the per-op int8 step's greedy tokens (decode_kernel='off')."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float16).cuda().eval()
    fuseinfer.patch(model, INT8)
    ids = torch.randint(3, 8192, (5, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :7] = mask[3, :20] = 0
    ids = ids.masked_fill(mask == 0, model.config.pad_token_id)
    out = {}
    for kernel in ("off", "on"):
        fuseinfer.runtime.set_runtime(model, decode_kernel=kernel)  # (and fresh sessions: they chose their step)
        out[kernel] = (fuseinfer.generate(model, ids, mask, max_new_tokens=32),
                       fuseinfer.generate(model, ids[:1], max_new_tokens=32))
        sessions = model.__dict__[SESSIONS_ATTR]
        for bucket in (1, 8):
            assert sessions[bucket].path.startswith("one kernel" if kernel == "on" else "per op"), \
                (kernel, bucket, sessions[bucket].path)
    assert torch.equal(out["on"][0], out["off"][0])
    assert torch.equal(out["on"][1], out["off"][1])


# ---- FP8 models (Float8): the same step streaming e4m3 weights (the activations stay fp16/bf16) ----

FP8 = fuseinfer.PatchConfig(quant=fuseinfer.Float8())
# opcheck's schema test compares inputs with torch.allclose, which float8 tensors do not implement
FP8_OPCHECK = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@torch.no_grad()
def test_fp8_reference_is_the_fp_step_on_the_dequantized_weights():
    """With e4m3 weights the reference step is the fp32 step on the weights times their scales (the activations
    are not quantized: what the FP8 linears' decode GEMV computes)."""
    model = random_opt(hidden_size=64, num_attention_heads=2, ffn_dim=128, num_hidden_layers=2)
    fuseinfer.patch(model, FP8)
    args = _step_inputs(model, pads=[0, 3], q_start=[9, 9], capacity=12)
    assert len(args["weight_scales"]) == 8
    assert all(args["layer_params"][12 * i + j].dtype == torch.float8_e4m3fn for i in range(2) for j in (2, 4, 8, 10))
    ref = opt_decode_step_ref(**args)
    scales = iter(args["weight_scales"])
    fp_ref = opt_decode_step_ref(**{**args, "weight_scales": [], "layer_params": [
        p if p.dtype != torch.float8_e4m3fn else p.float() * next(scales)[:, None] for p in args["layer_params"]]})
    torch.testing.assert_close(fp_ref, ref, rtol=1e-4, atol=1e-4)


def test_fp8_opcheck_cpu():
    model = random_opt(hidden_size=64, num_attention_heads=2, ffn_dim=128, num_hidden_layers=2)
    fuseinfer.patch(model, FP8)
    args = _step_inputs(model, pads=[0, 2], q_start=[7, 7], capacity=12)
    torch.library.opcheck(torch.ops.fuseinfer.opt_decode_step.default, tuple(args.values()), test_utils=FP8_OPCHECK)


def test_mixed_8bit_formats_are_one_clear_error():
    model = random_opt(hidden_size=64, num_attention_heads=2, ffn_dim=128, num_hidden_layers=2)
    fuseinfer.patch(model, FP8)
    args = _step_inputs(model, pads=[0], q_start=[3], capacity=8)
    params = list(args["layer_params"])
    params[4] = params[4].float().to(torch.int8)  # layer 0's out_proj int8, the rest e4m3
    with pytest.raises(fuseinfer.FuseInferError, match="layer 0 parameter 4 must be an int8 or float8_e4m3fn"):
        opt_decode_step(**{**args, "layer_params": params})


def test_decode_step_kernel_takes_fp8_models():
    """Float8 models pass the scheme checks (on this CPU the step stops at the kernel check); other schemes run per
    op."""
    from fuseinfer.models.opt.decode import _int8_unsupported, decode_step_kernel

    model = random_opt(hidden_size=64, num_attention_heads=2, ffn_dim=128, num_hidden_layers=2)
    fuseinfer.patch(model, FP8)
    assert _int8_unsupported(model, fuseinfer.patch_state(model).config.quant) is None
    assert decode_step_kernel(model, _int8_stub_cache(1))[1].startswith("no kernel")
    assert "object runs per op" in _int8_unsupported(model, object())


@pytest.mark.gpu
def test_fp8_fast_decode_takes_the_kernel_and_matches_per_op_tokens(tiny_model_path):
    """The trained tiny model in fp16 with Float8: fast decode runs the one-kernel step (decode_kernel='on') and
    gives the per-op step's greedy tokens (decode_kernel='off': the FP8 linears' e4m3 GEMV)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float16).cuda().eval()
    fuseinfer.patch(model, FP8)
    ids = torch.randint(3, 8192, (3, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    out = {}
    for kernel in ("off", "on"):
        fuseinfer.runtime.set_runtime(model, decode_kernel=kernel)
        out[kernel] = fuseinfer.generate(model, ids[:1], max_new_tokens=32)
        path = model.__dict__[SESSIONS_ATTR][1].path
        assert path.startswith("one kernel" if kernel == "on" else "per op"), (kernel, path)
    assert torch.equal(out["on"], out["off"])


def test_decode_step_kernel_takes_w8a8_models():
    """SmoothQuant W8A8 models: their int8 weights are what the decode GEMV reads at decode rows, so the one-kernel
    step takes them too (on this CPU it stops at the kernel check); the weights the step streams are the int8 ones."""
    from fuseinfer.models.opt.decode import _int8_unsupported, decode_step_kernel

    model = random_opt(hidden_size=64, num_attention_heads=2, ffn_dim=128, num_hidden_layers=2)
    from fuseinfer.quant.smoothquant import calibrate

    stats = calibrate(model, ids=torch.arange(3, 40)[None], seq_len=16)
    fuseinfer.patch(model, fuseinfer.PatchConfig(quant=fuseinfer.SmoothQuantW8A8(calibration=stats)))
    assert _int8_unsupported(model, fuseinfer.patch_state(model).config.quant) is None
    assert decode_step_kernel(model, _int8_stub_cache(1))[1].startswith("no kernel")
    params = decode_step_params(model)
    assert all(params[12 * i + j].dtype == torch.int8 for i in range(2) for j in (2, 4, 8, 10))
    assert len(decode_step_weight_scales(model)) == 8


# ---- FP8 (e4m3) KV caches: keys and values stored as kv_cache_append_fp8 stores them, attended to as stored ----

def _fp8_per_op(model, args, slot):
    """The patched modules' decode step over a StaticKVCache holding copies of the step's FP8 caches and scales (one
    write slot for all rows, the scales kept: a decode step) -> (fp32 logits (B, V), the cache)."""
    cache = step_cache_copy(model.config.num_hidden_layers, args, slot, torch.float32)
    with torch.no_grad():
        return forward_last_logits(model, args["tokens"], args["positions"], cache, args["q_start"]), cache


@torch.no_grad()
def test_fp8_cache_reference_equals_per_op_fp8_decode_path(tiny_model_path):
    """Over FP8 caches the reference step and the patched modules (the per-op FP8 path: kv_cache_append_fp8, then
    attention over the dequantized cache) agree on the trained tiny model in fp32 on CPU: logits, greedy tokens and
    every cache byte."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    fuseinfer.patch(model)
    args = with_fp8_caches(_step_inputs(model, pads=[0, 5, 11], q_start=[20, 20, 20], capacity=24))
    assert all(c.dtype == FP8_DTYPE for c in args["k_caches"] + args["v_caches"])
    per_op, cache = _fp8_per_op(model, args, 20)
    ref = opt_decode_step_ref(**args)
    torch.testing.assert_close(ref, per_op, rtol=1e-5, atol=1e-5)
    assert torch.equal(ref.argmax(-1), per_op.argmax(-1))
    for ours, theirs in zip(args["k_caches"] + args["v_caches"], cache.keys + cache.values):
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
    # the step wrote e4m3 values (not the fp32 ones): within an e4m3 step of the fp32 step's key
    fp_args = _step_inputs(model, pads=[0, 5, 11], q_start=[20, 20, 20], capacity=24)
    opt_decode_step_ref(**fp_args)
    scale = args["kv_scales"][0][0]
    new = args["k_caches"][0][:, :, 20].float() * scale.view(1, -1, 1)
    assert not torch.equal(new, fp_args["k_caches"][0][:, :, 20])
    torch.testing.assert_close(new, fp_args["k_caches"][0][:, :, 20], rtol=2 ** -4, atol=scale.max().item() * 2 ** -9)


# opcheck's test_schema compares the arguments before and after the call with ops that have no float8 kernel (as in
# tests/ops/test_kv_fp8.py): the other checks run; what the step writes is checked against the per-op path above
FP8_OPCHECKS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def test_fp8_cache_opcheck_cpu():
    model = random_opt(hidden_size=64, num_attention_heads=2, ffn_dim=96, num_hidden_layers=2)
    fuseinfer.patch(model)
    args = with_fp8_caches(_step_inputs(model, pads=[0, 2, 5], q_start=[7, 7, 7], capacity=12))
    torch.library.opcheck(torch.ops.fuseinfer.opt_decode_step.default, tuple(args.values()), test_utils=FP8_OPCHECKS)


def test_fp8_cache_arguments_are_one_clear_error():
    """Scales without FP8 caches, FP8 caches without (or with malformed) scales, mixed caches: one error each."""
    model = random_opt(hidden_size=64, num_attention_heads=2, ffn_dim=96, num_hidden_layers=2)
    fuseinfer.patch(model)
    args = _step_inputs(model, pads=[0], q_start=[3], capacity=8)
    fp8 = with_fp8_caches(args)
    with pytest.raises(fuseinfer.FuseInferError, match="kv_scales are for float8_e4m3fn caches only"):
        opt_decode_step(**{**args, "kv_scales": fp8["kv_scales"]})
    with pytest.raises(fuseinfer.FuseInferError, match="need one kv_scales tensor"):
        opt_decode_step(**{**fp8, "kv_scales": []})
    with pytest.raises(fuseinfer.FuseInferError, match="needs kv_scale, a \\(2, 2\\) float32"):
        opt_decode_step(**{**fp8, "kv_scales": [s[0] for s in fp8["kv_scales"]]})
    with pytest.raises(fuseinfer.FuseInferError, match="all be float8_e4m3fn or all"):
        opt_decode_step(**{**fp8, "v_caches": args["v_caches"]})


def test_fp8_cache_with_8bit_weights_decodes_per_op():
    """The kernel reads FP8 caches with fp16/bf16 weights only: the family hook says so for an int8 model."""
    from types import SimpleNamespace

    from fuseinfer.models.opt import decode as opt_decode

    model = random_opt(hidden_size=64, num_attention_heads=2, ffn_dim=128, num_hidden_layers=2)
    fuseinfer.patch(model, fuseinfer.PatchConfig(quant=fuseinfer.Int8WeightOnly(),
                                                 runtime=fuseinfer.RuntimeConfig(decode_kernel="on")))
    cache = SimpleNamespace(key_mask=torch.ones(1, 8, dtype=torch.bool), kv_scales=[torch.ones(2, 2)] * 2)
    step, why = opt_decode.decode_step_kernel(model, cache)
    assert step is None and "FP8 (e4m3) cache with fp16/bf16 weights only" in why


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_fp8_cache_matches_fp32_reference(case, dtype):
    """The one-kernel step over FP8 caches (e4m3 keys and values streamed through the ring, 4 (D 64) or 2 (D 128)
    attention items per stage): logits within the dtype rule of the fp32 reference, the caches' e4m3 codes equal,
    and repeated launches equal."""
    overrides, pads, q_start, capacity = GPU_CASES[case]
    model = random_opt(device="cuda", dtype=dtype, num_hidden_layers=3, vocab_size=4000,
                       max_position_embeddings=2048, **overrides)
    fuseinfer.patch(model)
    args = with_fp8_caches(_step_inputs(model, pads, q_start, capacity))
    heads = overrides["num_attention_heads"]
    assert kernel_supports(len(pads), args["embed"], overrides["ffn_dim"], args["k_caches"][0].shape[-1],
                           kv_scales=2 * heads * 3)
    assert_fp8_step(opt_decode_step, opt_decode_step_ref, args, dtype, q_start)


@pytest.mark.gpu
@pytest.mark.parametrize("model_dtype", [torch.float16, torch.bfloat16])
def test_fast_decode_fp8_cache_takes_the_kernel(tiny_model_path, model_dtype):
    """RuntimeConfig(kv_cache="fp8", decode_kernel="on"): the one-kernel step runs over the FP8 cache (batch buckets 1
    and 8) and gives the per-op FP8 path's greedy tokens."""
    out = generate_decode_kernel_off_on(tiny_model_path, model_dtype, "one kernel per step", pad=True, kv_cache="fp8")
    assert_fp8_cache_tokens_agree(out, prompt=40)
