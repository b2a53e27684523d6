"""fuseinfer::llama_decode_step (fuseinfer/ops/llama_step.py): the reference against the per-op Llama decode path
(CPU: the trained tiny Llama, a random Qwen2-like model with a q/k/v bias and odd sizes), the op's registration
(opcheck), its refusals, and on the GPU the one-kernel step against the fp32 reference (head dim 64 and 128,
grouped-query 4:1 and 2:1, 1-8 rows, ring-wrapping contexts, fp16 and bf16, a Qwen2 bias), greedy tokens over several
steps, and fast decode with RuntimeConfig(decode_kernel="on") against "off"."""
from __future__ import annotations

import pytest
import torch
from conftest import random_llama
from helpers import (assert_fp8_cache_tokens_agree, assert_fp8_step, assert_step_within_rule, examples,
                     generate_decode_kernel_off_on, given, require_kernel, st, step_args_in, step_cache_copy,
                     with_fp8_caches)

import fuseinfer
from fuseinfer.models.llama import decode as llama_decode
from fuseinfer.models.llama.decode import decode_step_params, forward_last_logits
from fuseinfer.ops import llama_decode_step, llama_decode_step_ref
from fuseinfer.ops.decode_step import decode_step_workspace
from fuseinfer.ops.kv_cache import FP8_DTYPE
from fuseinfer.ops.llama_step import kernel_supports


def _step_inputs(model, pads, q_start, capacity, seed=1):
    """Inputs of one decode step of a patched Llama-architecture ``model``: caches of random k/v, left padding
    ``pads`` per row, the new token of row b at slot ``q_start[b]`` (position q_start - pad), its rotary tables from
    the model's rotary_emb -> dict of the op's arguments (caches fresh, owned)."""
    cfg, base = model.config, model.model
    embed = base.embed_tokens.weight
    rows, heads, kv_heads = len(pads), cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    g = torch.Generator().manual_seed(seed)
    caches = [torch.randn(rows, kv_heads, capacity, d, generator=g).to(embed)
              for _ in range(2 * cfg.num_hidden_layers)]
    key_mask = torch.ones(rows, capacity, dtype=torch.bool)
    for b, pad in enumerate(pads):
        key_mask[b, :pad] = False
    q_start_t = torch.tensor(q_start, dtype=torch.int32)
    positions = (q_start_t - torch.tensor(pads, dtype=torch.int32)).long()[:, None].to(embed.device)  # (B, 1)
    with torch.no_grad():
        cos, sin = base.rotary_emb(embed[:1], positions)  # (B, 1, D)
    params, biases = decode_step_params(model)
    args = dict(
        tokens=torch.randint(3, cfg.vocab_size, (rows,), generator=g).to(embed.device),
        cos=cos.reshape(rows, d), sin=sin.reshape(rows, d), q_start=q_start_t.to(embed.device),
        key_mask=key_mask.to(embed.device), embed=embed, layer_params=params, qkv_biases=biases,
        k_caches=caches[0::2], v_caches=caches[1::2], norm_w=base.norm.weight, lm_head=model.lm_head.weight,
        workspace=decode_step_workspace(rows, cfg.hidden_size, cfg.intermediate_size, heads, d, capacity,
                                        embed.device),
        eps=base.layers[0].input_layernorm.variance_epsilon, scale=d ** -0.5, kv_scales=[])
    args["layer_params"] = [p.detach() for p in args["layer_params"]]
    args["qkv_biases"] = [b.detach() for b in args["qkv_biases"]]
    out = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    return out, positions


def _per_op(model, args, positions, slot):
    """The patched modules' decode step (forward_last_logits over a StaticKVCache holding copies of the step's
    caches, and of their scales when they are FP8, one write slot for all rows) -> (fp32 logits (B, V), the
    cache)."""
    cache = step_cache_copy(model.config.num_hidden_layers, args, slot, args["embed"].dtype)
    with torch.no_grad():
        logits = forward_last_logits(model, args["tokens"][:, None], positions, cache, args["q_start"])
    return logits, cache


def _assert_reference_equals_per_op(model, pads, slot, capacity):
    args, positions = _step_inputs(model, pads, [slot] * len(pads), capacity)
    per_op, cache = _per_op(model, args, positions, slot)
    with torch.no_grad():
        ref = llama_decode_step_ref(**args)
    assert ref.shape == per_op.shape == (len(pads), model.config.vocab_size)
    torch.testing.assert_close(ref, per_op, rtol=1e-5, atol=1e-5)
    assert torch.equal(ref.argmax(-1), per_op.argmax(-1))
    for ours, theirs in zip(args["k_caches"] + args["v_caches"], cache.keys + cache.values):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


@torch.no_grad()
def test_reference_equals_per_op_decode_path_tiny_llama(tiny_llama_path):
    """The reference step and the patched modules agree on the trained tiny Llama (grouped-query, tied embeddings),
    fp32 on CPU: logits, tokens and every cache."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    fuseinfer.patch(model)
    _assert_reference_equals_per_op(model, pads=[0, 5, 11], slot=20, capacity=24)


@torch.no_grad()
@pytest.mark.parametrize("model_type", ["qwen2", "mistral"])
def test_reference_equals_per_op_decode_path_odd_sizes(model_type):
    """A random Qwen2 (q/k/v bias) and Mistral of odd sizes (hidden 60, 5 heads of 12, 1 KV head, ffn 37, 3 layers,
    vocab 301): the reference step equals the per-op path."""
    model = random_llama(model_type, hidden_size=60, num_attention_heads=5, num_key_value_heads=1,
                         intermediate_size=37, num_hidden_layers=3, vocab_size=301)
    fuseinfer.patch(model)
    args, _ = _step_inputs(model, pads=[0], q_start=[0], capacity=4)
    assert len(args["qkv_biases"]) == (3 if model_type == "qwen2" else 0)
    _assert_reference_equals_per_op(model, pads=[0, 2], slot=6, capacity=9)


def test_reference_notices_a_wrong_rotary_table():
    """The comparison above can fail: a rotary table of another position changes the logits."""
    model = random_llama()
    fuseinfer.patch(model)
    args, positions = _step_inputs(model, pads=[0], q_start=[5], capacity=8)
    per_op, _ = _per_op(model, args, positions, 5)
    args["cos"], args["sin"] = args["cos"].roll(1, -1), args["sin"].roll(1, -1)
    with torch.no_grad():
        assert not torch.allclose(llama_decode_step_ref(**args), per_op, rtol=1e-3, atol=1e-3)


def test_opcheck_cpu():
    model = random_llama("qwen2", num_hidden_layers=2)
    fuseinfer.patch(model)
    args, _ = _step_inputs(model, pads=[0, 2, 5], q_start=[7, 7, 7], capacity=12)
    torch.library.opcheck(torch.ops.fuseinfer.llama_decode_step.default, tuple(args.values()))


def test_wrong_parameter_count_is_one_clear_error():
    model = random_llama()
    fuseinfer.patch(model)
    args, _ = _step_inputs(model, pads=[0], q_start=[3], capacity=8)
    args["layer_params"] = args["layer_params"][:-1]
    with pytest.raises(fuseinfer.FuseInferError, match="expected 6 parameters"):
        llama_decode_step(**args)


def test_quantized_weights_are_refused_with_a_reason():
    """int8 / FP8 Llama steps are out of scope: an 8-bit weight is one clear error, and the family hook says why a
    quantized model decodes per op."""
    model = random_llama()
    fuseinfer.patch(model)
    args, _ = _step_inputs(model, pads=[0], q_start=[3], capacity=8)
    args["layer_params"][1] = args["layer_params"][1].to(torch.int8)
    with pytest.raises(fuseinfer.FuseInferError, match="fp16/bf16 weights only"):
        llama_decode_step(**args)
    quantized = random_llama()
    fuseinfer.patch(quantized, fuseinfer.PatchConfig(quant=fuseinfer.Int8WeightOnly()))
    step, why = llama_decode.decode_step_kernel(quantized, None)
    assert step is None and "quantized models decode per op" in why


def test_family_hook_refuses_off_and_cpu():
    """decode_kernel="off" and a CPU model: no step, with the reason."""
    model = random_llama()
    fuseinfer.patch(model, fuseinfer.PatchConfig(runtime=fuseinfer.RuntimeConfig(decode_kernel="off")))
    step, why = fuseinfer.models.family("llama").decode_step_kernel(model, None)
    assert step is None and "decode_kernel='off'" in why
    model = random_llama()
    fuseinfer.patch(model, fuseinfer.PatchConfig(runtime=fuseinfer.RuntimeConfig(decode_kernel="on")))
    step, why = fuseinfer.models.family("llama").decode_step_kernel(model, None)
    assert step is None and "CUDA" in why


@st.composite
def step_cases(draw, device):
    """(model type, config overrides, pads, q_start, capacity, seed): on the CPU odd sizes (any even head dim, any
    ffn), one slot for all rows (the per-op path's cache writes one); on CUDA the kernel's domain (head dim 64 or 128,
    ffn a multiple of 32, 1-8 rows, each row its own slot and padding, contexts past the ring; vocabularies of 64 and
    more: the dtype rule compares maximum errors, and over a handful of logits PyTorch's can fall below one rounding
    step of ours, see test_kernel_tiny_vocabulary_within_rule)."""
    seed = draw(st.integers(0, 999))
    kv_heads, group = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 4]))
    if device == "cpu":
        d, ffn, rows = 2 * draw(st.integers(1, 12)), draw(st.integers(1, 100)), draw(st.integers(1, 4))
        capacity = draw(st.integers(1, 40))
        q_start = [draw(st.integers(0, capacity - 1))] * rows
    else:
        d, ffn, rows = draw(st.sampled_from([64, 128])), 32 * draw(st.integers(1, 64)), draw(st.integers(1, 8))
        capacity = draw(st.integers(1, 1200))
        q_start = draw(st.lists(st.integers(0, capacity - 1), min_size=rows, max_size=rows))
    pads = [draw(st.integers(0, s)) for s in q_start]  # a row's new token is never padding
    heads = kv_heads * group
    overrides = dict(hidden_size=heads * d, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=d,
                     intermediate_size=ffn, num_hidden_layers=draw(st.integers(1, 3)),
                     vocab_size=draw(st.integers(4 if device == "cpu" else 64, 700)),
                     max_position_embeddings=capacity + 1)
    return draw(st.sampled_from(["llama", "qwen2"])), overrides, pads, q_start, capacity, seed


@examples("cpu", cpu=6, cuda=0)
@given(case=step_cases("cpu"))
def test_reference_equals_per_op_decode_path_property(case):
    """The reference step and the patched modules agree on CPU in fp32 for random sizes (grouped-query 1:1 to 4:1,
    with and without a q/k/v bias), rows, padding and slots."""
    model_type, overrides, pads, q_start, capacity, seed = case
    model = random_llama(model_type, seed=seed, **overrides)
    fuseinfer.patch(model)
    args, positions = _step_inputs(model, pads, q_start, capacity, seed=seed)
    per_op, cache = _per_op(model, args, positions, q_start[0])
    with torch.no_grad():
        ref = llama_decode_step_ref(**args)
    torch.testing.assert_close(ref, per_op, rtol=1e-4, atol=1e-4)
    for ours, theirs in zip(args["k_caches"] + args["v_caches"], cache.keys + cache.values):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


# ---- GPU: the one-kernel step ----

STEP_PATH = "one kernel per step (fuseinfer::llama_decode_step)"  # (a fast-decode session's path with the step)

GPU_CASES = {  # name -> (config overrides, pads, q_start, capacity)
    # Llama-3.2-1B-like heads (D 64, 4:1), ring-wrapping context (more keys than ring stages hold)
    "b1_d64_gqa4_ctx300": (dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
                                intermediate_size=2048), [0], [299], 384),
    "b2_d128_gqa2_padded": (dict(hidden_size=512, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=1536), [0, 17], [112, 112], 128),
    "b3_d64_gqa4_ragged": (dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=1,
                                intermediate_size=1024), [0, 3, 9], [64, 70, 33], 128),
    "b8_d64_gqa2_ragged": (dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=768), [0, 1, 2, 3, 0, 9, 31, 60], [64, 64, 70, 64, 33, 64, 64, 100],
                           128),
    "b2_d128_gqa4_ctx1500": (dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2,
                                  intermediate_size=2048), [0, 600], [1500, 1500], 1536),
    "b1_first_token": (dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=1024),
                       [0], [0], 128),
}


def _gpu_model(model_type, dtype, overrides):
    require_kernel()
    model = random_llama(model_type, device="cuda", dtype=dtype, num_hidden_layers=3, vocab_size=4000,
                         max_position_embeddings=4096, **overrides)
    fuseinfer.patch(model)
    return model


def _assert_step_within_rule(args: dict, dtype) -> torch.Tensor:
    return assert_step_within_rule(llama_decode_step, llama_decode_step_ref, args, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_matches_fp32_reference(case, dtype):
    overrides, pads, q_start, capacity = GPU_CASES[case]
    model = _gpu_model("llama", dtype, overrides)
    args, _ = _step_inputs(model, pads, q_start, capacity)
    cfg = model.config
    assert kernel_supports(len(pads), args["embed"], cfg.intermediate_size, cfg.num_attention_heads,
                           cfg.num_key_value_heads, args["k_caches"][0].shape[-1])
    ours = _assert_step_within_rule(args, dtype)
    for _ in range(3):  # the launch counters, attention counters and tagged buffers carry over between launches
        assert torch.equal(llama_decode_step(**args), ours)


@pytest.mark.gpu
@pytest.mark.xfail(strict=True, reason="at a 4-token vocabulary the step's fp16 logits are 2.7x as far from the fp32 "
                   "reference as PyTorch's fp16 reference (0.00068 against 0.00025: about 3 and 1 units in the last "
                   "place of logits below 0.4); the maximum over 4 logits may be noise, the cause is not established")
def test_kernel_tiny_vocabulary_within_rule():
    """A case the property test below drew: hidden 256 (2 heads of 128), ffn 416, 2 layers, a 4-token vocabulary,
    the first token of a 1-slot cache, fp16. Its logits miss the dtype rule (the half-ulp slack included); kept as a
    strict xfail so a fix shows."""
    require_kernel()
    overrides = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=2, head_dim=128,
                     intermediate_size=416, num_hidden_layers=2, vocab_size=4, max_position_embeddings=2)
    model = random_llama("llama", seed=0, device="cuda", dtype=torch.float16, **overrides)
    fuseinfer.patch(model)
    args, _ = _step_inputs(model, [0], [0], 1, seed=0)
    _assert_step_within_rule(args, torch.float16)


@pytest.mark.gpu
def test_kernel_matches_fp32_reference_property():
    """Random models in the kernel's domain (hypothesis), fp16 and bf16: logits and caches within the dtype rule."""
    @examples("cuda", cpu=0, cuda=40)
    @given(case=step_cases("cuda"), bf16=st.booleans())
    def check(case, bf16):
        model_type, overrides, pads, q_start, capacity, seed = case
        dtype = torch.bfloat16 if bf16 else torch.float16
        require_kernel()
        model = random_llama(model_type, seed=seed, device="cuda", dtype=dtype, **overrides)
        fuseinfer.patch(model)
        args, _ = _step_inputs(model, pads, q_start, capacity, seed=seed)
        assert kernel_supports(len(pads), args["embed"], overrides["intermediate_size"],
                               overrides["num_attention_heads"], overrides["num_key_value_heads"],
                               overrides["head_dim"]), overrides
        _assert_step_within_rule(args, dtype)
    check()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_qwen2_bias_matches_fp32_reference(dtype):
    """Qwen2: the fused q/k/v bias rides in the tiles' first ring stage (two pieces per rotary tile)."""
    model = _gpu_model("qwen2", dtype, dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
                                            intermediate_size=1024))
    args, _ = _step_inputs(model, [0, 4], [90, 90], 128)
    assert len(args["qkv_biases"]) == 3
    _assert_step_within_rule(args, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_matches_per_op_path(dtype):
    """The kernel against the patched modules on the GPU (forward_last_logits over the same caches): logits within
    twice the per-op path's error against the fp32 reference, the same greedy tokens."""
    model = _gpu_model("llama", dtype, dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
                                            intermediate_size=2048))
    args, positions = _step_inputs(model, [0, 7], [200, 200], 256)
    per_op, _ = _per_op(model, args, positions, 200)
    ref32 = llama_decode_step_ref(**step_args_in(args, torch.float32))
    ours = llama_decode_step(**args)
    err, per_op_err = (ours - ref32).abs().max().item(), (per_op - ref32).abs().max().item()
    assert err <= 2 * per_op_err + 1e-6, f"logits: ours {err:.3g} vs per op {per_op_err:.3g}"
    assert torch.equal(ours.argmax(-1), per_op.argmax(-1))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_greedy_tokens_over_steps(dtype):
    """Eight greedy steps, each step's token fed to the next at the next slot: the kernel and the per-op path give
    the same tokens (the caches they each wrote are what they read next)."""
    model = _gpu_model("llama", dtype, dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
                                            intermediate_size=2048))
    slot, capacity = 40, 64
    args, positions = _step_inputs(model, [0, 3], [slot, slot], capacity)
    ours_args = {**args, "k_caches": [c.clone() for c in args["k_caches"]],
                 "v_caches": [c.clone() for c in args["v_caches"]]}
    rotary = model.model.rotary_emb
    per_op_cache = None
    for step in range(8):
        pos = positions + step
        cos, sin = rotary(args["embed"][:1], pos)
        ours_args.update(q_start=torch.full_like(args["q_start"], slot + step), cos=cos.reshape(2, -1),
                         sin=sin.reshape(2, -1))
        ours = llama_decode_step(**ours_args)
        if per_op_cache is None:
            per_op, per_op_cache = _per_op(model, {**args, "q_start": ours_args["q_start"]}, pos, slot + step)
        else:
            per_op_cache.write_idx.fill_(slot + step)
            with torch.no_grad():
                per_op = forward_last_logits(model, args["tokens"][:, None], pos, per_op_cache, ours_args["q_start"])
        assert torch.equal(ours.argmax(-1), per_op.argmax(-1)), step
        args["tokens"] = ours_args["tokens"] = ours.argmax(-1)


@pytest.mark.gpu
def test_opcheck_cuda():
    model = _gpu_model("qwen2", torch.float16, dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                                    intermediate_size=512))
    args, _ = _step_inputs(model, pads=[0, 2, 5], q_start=[20, 20, 20], capacity=64)
    torch.library.opcheck(torch.ops.fuseinfer.llama_decode_step.default, tuple(args.values()))


@pytest.mark.gpu
def test_fast_decode_on_equals_off(tiny_llama_path):
    """fuseinfer.generate on the tiny Llama: decode_kernel="on" runs the one-kernel step (batch buckets 1 and 8),
    "off" the per-op step, and both give the same greedy tokens."""
    out = generate_decode_kernel_off_on(tiny_llama_path, torch.float16, STEP_PATH)
    assert torch.equal(out["on"][0], out["off"][0])
    assert torch.equal(out["on"][1], out["off"][1])


def test_family_hook_reads_the_patched_tensors():
    """The step streams the model's own fused tensors (no copies): the fused q/k/v and gate/up weights patch made,
    the q/k/v bias of a Qwen2; a layer patch skipped is not fully fused (the hook then says so)."""
    from fuseinfer.models.llama import modules as llama

    model = random_llama("qwen2")
    fuseinfer.patch(model)
    params, biases = decode_step_params(model)
    assert len(params) == 6 * model.config.num_hidden_layers and len(biases) == model.config.num_hidden_layers
    for i, layer in enumerate(model.model.layers):
        assert params[6 * i + 1] is layer.self_attn.__dict__[llama.QKV.weight]
        assert params[6 * i + 4] is layer.mlp.__dict__[llama.GATE_UP.weight]
        assert params[6 * i + 4].shape == (2 * model.config.intermediate_size, model.config.hidden_size)
        assert biases[i] is layer.self_attn.__dict__[llama.QKV.bias]
        with torch.no_grad():
            assert llama_decode._fully_fused(layer)
    skipped = random_llama()
    fuseinfer.patch(skipped, fuseinfer.PatchConfig(filter_fn=lambda module, name: "layers.1." not in name + "."))
    with torch.no_grad():
        assert llama_decode._fully_fused(skipped.model.layers[0])
        assert not llama_decode._fully_fused(skipped.model.layers[1])


# ---- FP8 (e4m3) KV caches: keys and values stored as the per-op path stores them (after the rotary), attended to as
# stored ----

# opcheck's test_schema compares the arguments before and after the call with ops that have no float8 kernel (as in
# tests/ops/test_kv_fp8.py): the other checks run; what the step writes is checked against the per-op path below
FP8_OPCHECKS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@torch.no_grad()
def test_fp8_cache_reference_equals_per_op_fp8_decode_path(tiny_llama_path):
    """Over FP8 caches the reference step and the patched modules (the per-op FP8 path: qkv_rope_append into the e4m3
    cache, attention over the dequantized cache) agree on the trained tiny Llama in fp32 on CPU: logits, greedy tokens
    and every cache byte."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    fuseinfer.patch(model)
    fp_args, positions = _step_inputs(model, pads=[0, 5, 11], q_start=[20] * 3, capacity=24)
    args = with_fp8_caches(fp_args)
    per_op, cache = _per_op(model, args, positions, 20)
    ref = llama_decode_step_ref(**args)
    torch.testing.assert_close(ref, per_op, rtol=1e-5, atol=1e-5)
    assert torch.equal(ref.argmax(-1), per_op.argmax(-1))
    for ours, theirs in zip(args["k_caches"] + args["v_caches"], cache.keys + cache.values):
        assert ours.dtype == FP8_DTYPE and torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
    # the first layer's rotated key went in quantized: within an e4m3 step of the fp32 step's, not equal to it
    llama_decode_step_ref(**fp_args)
    scale = args["kv_scales"][0][0]
    new = args["k_caches"][0][:, :, 20].float() * scale.view(1, -1, 1)
    assert not torch.equal(new, fp_args["k_caches"][0][:, :, 20])
    torch.testing.assert_close(new, fp_args["k_caches"][0][:, :, 20], rtol=2 ** -4, atol=scale.max().item() * 2 ** -9)


@examples("cpu", cpu=4, cuda=0)
@given(case=step_cases("cpu"))
def test_fp8_cache_reference_equals_per_op_decode_path_property(case):
    """Over FP8 caches, the reference step and the patched modules agree on CPU in fp32 for random sizes (grouped-query
    1:1 to 4:1, with and without a q/k/v bias), rows, padding and slots: logits and cache bytes."""
    model_type, overrides, pads, q_start, capacity, seed = case
    model = random_llama(model_type, seed=seed, **overrides)
    fuseinfer.patch(model)
    fp_args, positions = _step_inputs(model, pads, q_start, capacity, seed=seed)
    args = with_fp8_caches(fp_args)
    per_op, cache = _per_op(model, args, positions, q_start[0])
    with torch.no_grad():
        ref = llama_decode_step_ref(**args)
    torch.testing.assert_close(ref, per_op, rtol=1e-4, atol=1e-4)
    for ours, theirs in zip(args["k_caches"] + args["v_caches"], cache.keys + cache.values):
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))


def test_fp8_cache_opcheck_cpu():
    model = random_llama("qwen2", num_hidden_layers=2)
    fuseinfer.patch(model)
    args, _ = _step_inputs(model, pads=[0, 2, 5], q_start=[7, 7, 7], capacity=12)
    args = with_fp8_caches(args)
    torch.library.opcheck(torch.ops.fuseinfer.llama_decode_step.default, tuple(args.values()),
                          test_utils=FP8_OPCHECKS)


def test_fp8_cache_without_scales_is_one_clear_error():
    model = random_llama()
    fuseinfer.patch(model)
    args, _ = _step_inputs(model, pads=[0], q_start=[3], capacity=8)
    with pytest.raises(fuseinfer.FuseInferError, match="need one kv_scales tensor"):
        llama_decode_step(**{**with_fp8_caches(args), "kv_scales": []})
    with pytest.raises(fuseinfer.FuseInferError, match="kv_scales are for float8_e4m3fn caches only"):
        llama_decode_step(**{**args, "kv_scales": with_fp8_caches(args)["kv_scales"]})


def _fp8_gpu_check(model_type, dtype, overrides, pads, q_start, capacity):
    model = _gpu_model(model_type, dtype, overrides)
    args, _ = _step_inputs(model, pads, q_start, capacity)
    args = with_fp8_caches(args)
    cfg = model.config
    assert kernel_supports(len(pads), args["embed"], cfg.intermediate_size, cfg.num_attention_heads,
                           cfg.num_key_value_heads, args["k_caches"][0].shape[-1],
                           kv_scales=2 * cfg.num_key_value_heads * cfg.num_hidden_layers)
    assert_fp8_step(llama_decode_step, llama_decode_step_ref, args, dtype, q_start)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_fp8_cache_matches_fp32_reference(case, dtype):
    """The one-kernel step over FP8 caches (e4m3 keys and values streamed through the ring, grouped-query heads,
    ring-wrapping contexts, D 64 and 128): logits within the dtype rule of the fp32 reference, the caches' e4m3 codes
    equal, repeated launches equal."""
    overrides, pads, q_start, capacity = GPU_CASES[case]
    _fp8_gpu_check("llama", dtype, overrides, pads, q_start, capacity)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_fp8_cache_qwen2_bias_matches_fp32_reference(dtype):
    _fp8_gpu_check("qwen2", dtype, dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
                                        intermediate_size=1024), [0, 4], [90, 90], 128)


@pytest.mark.gpu
def test_fast_decode_fp8_cache_takes_the_kernel(tiny_llama_path):
    """fuseinfer.generate on the tiny Llama with RuntimeConfig(kv_cache="fp8"): decode_kernel="on" runs the
    one-kernel step over the FP8 cache (batch buckets 1 and 8), "off" the per-op FP8 step; the same greedy tokens."""
    out = generate_decode_kernel_off_on(tiny_llama_path, torch.float16, STEP_PATH, kv_cache="fp8")
    assert_fp8_cache_tokens_agree(out, prompt=40)
